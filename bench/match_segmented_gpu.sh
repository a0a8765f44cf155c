#!/usr/bin/env bash
# Issue 29's GPU runs on one host of $GPUS GPUs (default 4: kind nvidia-h100-x4, which may come
# as 4 x H200), every job under `timeout 480` (the tool's commands stop at 10 minutes). Run
# from the repository root with CONDATTN_GIT_COMMIT set (DEVELOPERS.md) and the wheels
# installed (source scripts/gpu_env.sh); what comes back is under $OUT.
#
#   bash bench/match_segmented_gpu.sh plan   # the MQAR plan (no GPU: runs here too): calls,
#                                            # jobs a GPU, estimated seconds
#   bash bench/match_segmented_gpu.sh mqar   # one MQAR call: the first call of the plan of
#                                            # what is left (IN: earlier calls' archives)
#   bash bench/match_segmented_gpu.sh seg    # segmented h100 (GPU 1 mod $GPUS) + far_gpu (GPU
#                                            # 2, 4 GPUs only) + MATCH / SWA TTFT at 32K (GPU 3
#                                            # or, on fewer GPUs, 0); repeat until
#                                            # both segmented logs print 'wrote' (they resume
#                                            # from $SEGFID, default $HOME/segfid, which stays
#                                            # on a WARM machine only: the h100 checkpoints,
#                                            # ~250 MB, do not fit the device tool's carry, and
#                                            # a carried tree is replaced on every call)
#   bash bench/match_segmented_gpu.sh far    # segmented far_gpu on GPU 0 alone (kind
#                                            # nvidia-h100-x1): the dense model and its gate, then
#                                            # the fine-tunes; estimate_s: ~727 s in all, so 3
#                                            # calls of --time_budget_s=400 under timeout 480, each
#                                            # resuming from the checkpoints (a few MB: they come
#                                            # back in $OUT/segfid_far; carry them to the next
#                                            # call on a fresh machine: IN=<that folder>, default
#                                            # .gpu/segfid_far)
#
# MQAR (preset h100: 4 methods x lengths 64-512 x their lrs (4 for full / SWA, 3 for MATCH /
# random) x 3 seeds = 168 models of 12,800 steps). bench/match_mqar.py --plan=$GPUS makes the
# jobs (method, length, lrs, seeds: --lrs / --seeds) and packs them, several a GPU, into calls
# (gpu_plan: first fit decreasing by estimated GPU seconds, STEP_MS there, additive over a GPU's
# jobs, <= 370 s of work, <= 4 jobs and <= 0.9 of memory a GPU; each job capped by its length:
# MEM_FRACTION there). On 4 GPUs: 9 calls, 92 jobs, ~11,500 GPU-s estimated (conservative; the
# largest job, one MATCH / random model at 512, ~200 s + 70 s alone). Each `mqar` call re-plans
# what its IN folder does not already hold finished (--done), so a call that fails, or a job that
# stopped at its deadline (stopped_early), is simply planned again. A call: the rows of its
# lengths made once (--make_data, every core) under out/mqar_rows, then its jobs, each writing
# $OUT/mqar_<method>_<length>_<lrs>_s<seeds>.json (progress) and .log, returned as ONE archive
# $OUT/mqar_jobs_<time>.tgz (a call returns at most 8 files) with $OUT/mqar_plan.txt.
#   here, before each call (the tree at HEAD, with the earlier calls' archives committed under
#   bench/results/mqar_units/):  rm -rf .gpu/src && mkdir -p .gpu/src &&
#     git archive HEAD | tar x -C .gpu/src && git rev-parse --short HEAD > .gpu/src/COMMIT
#   each call (kind nvidia-h100-x4, carry [".whl", ".gpu/src"], timeout_s 600):
#     cd .gpu/src && ln -sfn ../../.whl .whl && source scripts/gpu_env.sh &&
#       bash bench/match_segmented_gpu.sh mqar
#   then here: cp <files_at>/mqar_jobs_*.tgz bench/results/mqar_units/ and commit them (every
#     call's archive, a few KB, kept in the repository for the next call and the merge)
#   what is left, as calls:
#     PATH=$PWD/.venv/bin:$PATH bash bench/match_segmented_gpu.sh plan
#   merge, once the plan is empty (here; calls on H100s and H200s merge into one run naming both):
#     mkdir -p /tmp/mqar && for f in bench/results/mqar_units/mqar_jobs_*.tgz; do tar xzf $f -C /tmp/mqar; done
#     python bench/match_mqar.py --preset=h100 --out_dir=bench/results \
#         --merge=$(ls /tmp/mqar/mqar_*.json | paste -sd, -)
#     # -> bench/results/match_mqar_<GPU>.json, run sweep_h100 (its claim re-derives the verdict;
#     # a stopped-early job that a later call re-ran is dropped by the merge)
# Segmented / TTFT results (`seg`):
#   cp <files_at>/seg_h100/segmented_fidelity_*.json <files_at>/seg_recall/... bench/results/
#   #    (append the runs to an existing bench/results/segmented_fidelity_<GPU>.json with
#   #     bench/common.append_run if the file exists)
#   cp <files_at>/ttft/match_ttft_*.json bench/results/
#   python -m bench.migrate_results --claims   # records the registered claims on the new runs
set -u
what=${1:-plan}
[ $# -gt 0 ] && shift
if [ "$what" != plan ]; then
  : "${CONDATTN_GIT_COMMIT:?set CONDATTN_GIT_COMMIT (local git rev-parse --short HEAD)}"
  : "${OUT:?}"
fi
GPUS=${GPUS:-4}
# GPU_OFFSET: the plan's GPU g runs on device g + GPU_OFFSET (mqar only: GPUS=3 GPU_OFFSET=1 leaves
# GPU 0 of a 4-GPU host to another command of the same call)
GPU_OFFSET=${GPU_OFFSET:-0}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# MQAR: MQAR_PRESET / MQAR_ARGS: another preset / more flags; MQAR_TIMEOUT: another limit a
# job (its --deadline_s 40 s less). The CPU dry run: MQAR_PRESET=cpu MQAR_ARGS="--steps=10
# --lengths=64 --plan_job_s=0.001" (one model a job) GPUS=2 MQAR_TIMEOUT=1800 (a loaded CPU)
PRESET=${MQAR_PRESET:-h100}
read -r -a EXTRA <<< "${MQAR_ARGS:-}"
LIMIT=${MQAR_TIMEOUT:-480}
mqar_done() {  # the progress files of the archives in $IN (earlier calls'), comma-joined
  local in=${IN:-bench/results/mqar_units} t tmp
  tmp=$(mktemp -d)
  for t in "$in"/mqar_jobs_*.tgz; do [ -e "$t" ] && tar xzf "$t" -C $tmp; done
  ls $tmp/mqar_*_*_*.json 2>/dev/null | paste -sd, -
}
mqar() {  # one call: the first call of the plan of what $IN does not hold finished
  local done lengths g m L lrs seeds cap name est
  mkdir -p out/mqar_rows
  done=$(mqar_done)
  python bench/match_mqar.py --preset=$PRESET "${EXTRA[@]}" --plan=$GPUS ${done:+--done=$done} \
    > $OUT/mqar_plan.txt 2> $OUT/mqar_plan.err &&
  python bench/match_mqar.py --preset=$PRESET "${EXTRA[@]}" --plan=$GPUS ${done:+--done=$done} \
    --plan_jobs=1 > $OUT/mqar_call.txt 2> $OUT/mqar_plan.err ||
    { echo "mqar: the plan failed"; tail -n 20 $OUT/mqar_plan.err; return 1; }
  rm -f $OUT/mqar_plan.err
  if [ ! -s $OUT/mqar_call.txt ]; then echo "mqar: nothing left to run"; return; fi
  lengths=$(awk '{print $3}' $OUT/mqar_call.txt | sort -un | paste -sd, -)
  echo "mqar: $(wc -l < $OUT/mqar_call.txt) jobs, lengths $lengths"
  python bench/match_mqar.py --preset=$PRESET "${EXTRA[@]}" --lengths=$lengths --make_data \
    --data_dir=out/mqar_rows --data_workers=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 )) \
    > $OUT/mqar_rows.log 2>&1
  while read -r g m L lrs seeds cap name est; do
    CUDA_VISIBLE_DEVICES=$(( g + GPU_OFFSET )) XLA_PYTHON_CLIENT_MEM_FRACTION=$cap timeout $LIMIT \
      python bench/match_mqar.py --preset=$PRESET "${EXTRA[@]}" --methods=$m --lengths=$L \
      --lrs=$lrs --seeds=$seeds --data_dir=out/mqar_rows --deadline_s=$(( LIMIT - 40 )) \
      --progress=$OUT/$name.json --out_dir=$OUT/mqar_runs/$name > $OUT/$name.log 2>&1 &
  done < $OUT/mqar_call.txt
}
seg() {
  # the h100 checkpoints (hundreds of MB) stay on the warm machine OUTSIDE the repository copy:
  # the device tool replaces a carried tree (and its out/) on every call
  local ckpt=${SEGFID:-$HOME/segfid}
  mkdir -p "$ckpt"
  # (the h100 dense step compiled on CPU with the reference attention: 74.5 GiB of temporaries,
  # its [T, T] scores; on GPU the attention kernel holds none of them)
  CUDA_VISIBLE_DEVICES=$(( 1 % GPUS )) XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 480 \
    python -m bench.segmented_fidelity --preset=h100 --checkpoint_dir="$ckpt" \
    --time_budget_s=400 --out_dir=$OUT/seg_h100 >> $OUT/seg_h100.log 2>&1 &
  # gpu_recall is recorded (H200, stop 37: its dense model did not learn the recall, so the
  # no-long-layers control could not be judged); its successor far_gpu runs here on GPU 2 of 4
  # (on fewer GPUs it would share the TTFT's GPU: run `far` as its own call)
  if [ "$GPUS" -ge 4 ]; then
    far_on 2 &
  fi
  if [ ! -e "$ckpt/ttft.done" ]; then  # once a warm machine (beside the checkpoints: a carried
                                       # tree's out/ is replaced every call; $OUT is fresh)
    CUDA_VISIBLE_DEVICES=$(( GPUS > 3 ? 3 : 0 )) XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 480 \
      python bench/match_ttft.py --out_dir=$OUT/ttft > $OUT/ttft.log 2>&1 && touch "$ckpt/ttft.done" &
  fi
}
far_on() {  # far_on <gpu>: the far_recall run; checkpoints travel through $OUT (carried back)
  # (FAR_PRESET / FAR_BUDGET: another preset / budget, for the CPU dry run on far_test)
  mkdir -p out/segfid_far $OUT/segfid_far
  local in=${IN:-.gpu/segfid_far}   # the earlier call's $OUT/segfid_far, carried back
  if [ -d "$in" ]; then cp -n "$in"/*.npz out/segfid_far/ 2>/dev/null; fi
  CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 480 \
    python -m bench.segmented_fidelity --preset=${FAR_PRESET:-far_gpu} \
    --checkpoint_dir=out/segfid_far --time_budget_s=${FAR_BUDGET:-400} --out_dir=$OUT/seg_far \
    >> $OUT/seg_far.log 2>&1
  local f
  for f in out/segfid_far/*.npz; do  # a phase's progress file only while the phase is unfinished
    case $f in *_partial.npz) [ -e "${f%_partial.npz}.npz" ] && continue ;; esac
    cp "$f" $OUT/segfid_far/
  done
}
case $what in
  plan) done=$(mqar_done)
        python bench/match_mqar.py --preset=$PRESET "${EXTRA[@]}" --plan=$GPUS \
          ${done:+--done=$done} 2>/dev/null; exit ;;
  mqar) mqar ;;
  seg) seg ;;
  far) far_on 0 ;;
  *) echo "usage: $0 plan|mqar|seg|far" >&2; exit 2 ;;
esac
wait
tail -n 3 $OUT/*.log
# a device call returns at most 8 files of $OUT: the MQAR jobs' progress JSON + logs go back
# as one archive, named by the call's time (the next call's IN holds every call's)
if ls $OUT/mqar_*_*_*.json >/dev/null 2>&1; then
  (cd $OUT && tar czf mqar_jobs_$(date +%Y%m%d%H%M%S).tgz mqar_*_*_*.json mqar_*_*_*.log \
     mqar_rows.log && rm -rf mqar_*_*_*.json mqar_*_*_*.log mqar_rows.log mqar_runs)
fi
