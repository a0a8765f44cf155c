#!/usr/bin/env bash
# Issue 29's GPU runs on one host of $GPUS GPUs (default 4: kind nvidia-h100-x4; GPUS=2: kind
# nvidia-h100-x2), every job under `timeout 480` (the tool's commands stop at 10 minutes). Run
# from the repository root with CONDATTN_GIT_COMMIT set (DEVELOPERS.md) and the wheels
# installed (pip install --no-deps .whl/*.whl); what comes back is under $OUT.
#
#   bash bench/match_segmented_gpu.sh mqar 256 128 64   # MQAR h100 on 4 GPUs, call 1: 12 jobs
#   bash bench/match_segmented_gpu.sh mqar512            #   call 2: length 512, one job per
#                                            # (method, lr): 14 jobs (a 12-model job at width 128
#                                            # passes 440 s); --merge joins a method's lr jobs
#   bash bench/match_segmented_gpu.sh mqar   # the older plan: 16 (method, length) jobs, 4 a GPU
#   GPUS=2 bash bench/match_segmented_gpu.sh mqar 512 256   # two GPUs: call 1 (8 jobs, 4 a GPU)
#   GPUS=2 bash bench/match_segmented_gpu.sh mqar 128 64    #           call 2
#   bash bench/match_segmented_gpu.sh seg    # segmented h100 (GPU 1 mod $GPUS) + far_gpu (GPU
#                                            # 2, 4 GPUs only) + MATCH / SWA TTFT at 32K (GPU 3
#                                            # or, on fewer GPUs, 0); repeat until
#                                            # both segmented logs print 'wrote' (they resume
#                                            # from out/segfid, which stays on a WARM machine
#                                            # only: the h100 checkpoints, ~250 MB, do not fit
#                                            # the device tool's carry)
#   bash bench/match_segmented_gpu.sh all    # both at once (4 GPUs; MQAR's memory leaves room)
#   bash bench/match_segmented_gpu.sh far    # segmented far_gpu on GPU 0 alone (kind
#                                            # nvidia-h100-x1): the dense model and its gate, then
#                                            # the fine-tunes; estimate_s: ~727 s in all, so 3
#                                            # calls of --time_budget_s=400 under timeout 480, each
#                                            # resuming from the checkpoints (a few MB: they come
#                                            # back in $OUT/segfid_far; carry them to the next
#                                            # call on a fresh machine: IN=<that folder>, default
#                                            # .gpu/segfid_far)
#
# MQAR, 4 GPUs, all lengths: GPU g runs slot j's length (512, 256, 128, 64) with method
# (g + j) mod 4, so every GPU holds one job of each length and every (method, length) runs once,
# each capped at 24% of its GPU. Given lengths (any $GPUS): the (method, length) jobs of those
# lengths, job k on GPU k mod $GPUS, each capped by its length (CAP: the compiled step + eval
# temporaries on CPU, jax.eval_shape params, bench/match_mqar.compiled_memory; GiB at 512 /
# 256 / 128 / 64: full 11.5 / 10.1 / 3.6 / 1.5, match (its recompute eval) 10.9 / 10.5 / 5.3,
# so 4 jobs of 512 / 256 on one 80 GiB card use <= 45 GiB). Each job writes
# $OUT/mqar_<method>_<length>.json (progress) and .log; a training that would pass 440 s stops
# at an evaluation (recorded under stopped_early) so the job still writes.
# Then, on the lead's machine (files_at = where $OUT came back; every call's files):
#   mkdir -p /tmp/mqar && tar xzf <files_at>/mqar_jobs.tgz -C /tmp/mqar
#   python bench/match_mqar.py --preset=h100 --out_dir=bench/results \
#       --merge=$(ls /tmp/mqar/mqar_*_*.json | paste -sd, -)
#   # -> bench/results/match_mqar_<GPU>.json, run sweep_h100 (its claim re-derives the verdict)
#   cp <files_at>/seg_h100/segmented_fidelity_*.json <files_at>/seg_recall/... bench/results/
#   #    (append the runs to an existing bench/results/segmented_fidelity_<GPU>.json with
#   #     bench/common.append_run if the file exists)
#   cp <files_at>/ttft/match_ttft_*.json bench/results/
#   python -m bench.migrate_results --claims   # records the registered claims on the new runs
set -u
: "${CONDATTN_GIT_COMMIT:?set CONDATTN_GIT_COMMIT (local git rev-parse --short HEAD)}"
: "${OUT:?}"
what=${1:-all}
[ $# -gt 0 ] && shift
GPUS=${GPUS:-4}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
declare -A CAP=([512]=0.17 [256]=0.16 [128]=0.08 [64]=0.04)   # of an 80 GiB card, per job
mqar_job() {  # mqar_job <gpu> <method> <length> <memory fraction>
  CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=$4 timeout 480 \
    python bench/match_mqar.py --preset=h100 --methods=$2 --lengths=$3 --data_workers=3 \
    --deadline_s=440 \
    --progress=$OUT/mqar_$2_$3.json --out_dir=$OUT/mqar_runs/$2_$3 \
    > $OUT/mqar_$2_$3.log 2>&1 &
}
mqar() {  # mqar [lengths...]: none = every length, the 4-GPU layout
  local methods=(full swa match random) lengths=(512 256 128 64) g j m L k=0
  if [ $# -gt 0 ]; then
    for L in "$@"; do
      for m in "${methods[@]}"; do
        mqar_job $(( k % GPUS )) $m $L ${CAP[$L]}; k=$(( k + 1 ))
      done
    done
    return
  fi
  [ "$GPUS" = 4 ] || { echo "mqar: name the lengths of this call on $GPUS GPUs" >&2; exit 2; }
  for g in 0 1 2 3; do
    for j in 0 1 2 3; do
      m=${methods[$(( (g + j) % 4 ))]}; L=${lengths[$j]}
      CUDA_VISIBLE_DEVICES=$g XLA_PYTHON_CLIENT_MEM_FRACTION=0.24 timeout 480 \
        python bench/match_mqar.py --preset=h100 --methods=$m --lengths=$L --data_workers=3 \
        --deadline_s=440 \
        --progress=$OUT/mqar_${m}_${L}.json --out_dir=$OUT/mqar_runs/${m}_${L} \
        > $OUT/mqar_${m}_${L}.log 2>&1 &
    done
  done
}
mqar512() {  # the length-512 jobs one per (method, lr): 14 jobs, job k on GPU k mod $GPUS (a
  # 12-model job at width 128 would pass its 440 s deadline and its memory cap)
  local m lr k=0
  for m in full swa match random; do
    for lr in $(python -c "import sys; sys.path.insert(0, 'bench'); import match_mqar as q; print(*q.method_lrs(q.PRESETS['h100'], '$m'))"); do
      CUDA_VISIBLE_DEVICES=$(( k % GPUS )) XLA_PYTHON_CLIENT_MEM_FRACTION=${CAP[512]} timeout 480 \
        python bench/match_mqar.py --preset=h100 --methods=$m --lengths=512 --lrs=$lr \
        --data_workers=3 --deadline_s=440 --progress=$OUT/mqar_${m}_512_$lr.json \
        --out_dir=$OUT/mqar_runs/${m}_512_$lr > $OUT/mqar_${m}_512_$lr.log 2>&1 &
      k=$(( k + 1 ))
    done
  done
}
seg() {
  mkdir -p out/segfid
  # (the h100 dense step compiled on CPU with the reference attention: 74.5 GiB of temporaries,
  # its [T, T] scores; on GPU the attention kernel holds none of them)
  CUDA_VISIBLE_DEVICES=$(( 1 % GPUS )) XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 480 \
    python -m bench.segmented_fidelity --preset=h100 --checkpoint_dir=out/segfid \
    --time_budget_s=400 --out_dir=$OUT/seg_h100 >> $OUT/seg_h100.log 2>&1 &
  # gpu_recall is recorded (H200, stop 37: its dense model did not learn the recall, so the
  # no-long-layers control could not be judged); its successor far_gpu runs here on GPU 2 of 4
  # (on fewer GPUs it would share the TTFT's GPU: run `far` as its own call)
  if [ "$GPUS" -ge 4 ]; then
    far_on 2 &
  fi
  if [ ! -e out/ttft.done ]; then  # once (out/ stays on a warm machine; $OUT is fresh)
    CUDA_VISIBLE_DEVICES=$(( GPUS > 3 ? 3 : 0 )) XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 480 \
      python bench/match_ttft.py --out_dir=$OUT/ttft > $OUT/ttft.log 2>&1 && touch out/ttft.done &
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
  mqar) mqar "$@" ;;
  mqar512) mqar512 ;;
  seg) seg ;;
  all) mqar; seg ;;
  far) far_on 0 ;;
  *) echo "usage: $0 mqar|mqar512|seg|all|far" >&2; exit 2 ;;
esac
wait
tail -n 3 $OUT/*.log
# a device call returns at most 8 files of $OUT: the MQAR jobs' 32 (progress JSON + log) go back
# as one archive (here: tar xzf <files_at>/mqar_jobs.tgz -C <dir>, then --merge=<dir>/mqar_*_*.json)
if ls $OUT/mqar_*_*.json >/dev/null 2>&1; then
  (cd $OUT && tar czf mqar_jobs.tgz mqar_*_*.json mqar_*_*.log && rm -rf mqar_*_*.json mqar_*_*.log mqar_runs)
fi
