#!/usr/bin/env bash
# Issue 29's GPU runs on one 4-GPU host (the device tool, kind nvidia-h100-x4), every job under
# `timeout 480` (the tool's commands stop at 10 minutes). Run from the repository root with
# CONDATTN_GIT_COMMIT set (DEVELOPERS.md) and the wheels installed
# (pip install --no-deps .whl/*.whl); what comes back is under $OUT.
#
#   bash bench/match_segmented_gpu.sh mqar   # MQAR h100: 16 (method, length) jobs, 4 a GPU
#   bash bench/match_segmented_gpu.sh seg    # segmented h100 (GPU 1) + gpu_recall (GPU 2) +
#                                            # MATCH / SWA TTFT at 32K (GPU 3); repeat until
#                                            # both segmented logs print 'wrote' (they resume
#                                            # from out/segfid, which stays on a warm machine)
#   bash bench/match_segmented_gpu.sh all    # both at once (MQAR's memory leaves room)
#
# MQAR: GPU g runs slot j's length (512, 256, 128, 64) with method (g + j) mod 4, so every GPU
# holds one job of each length and every (method, length) runs once; jobs allocate on demand,
# each capped at 24% of its GPU (the largest, length 512: ~9 GiB step + ~2 GiB eval compiled
# on CPU). Each writes $OUT/mqar_<method>_<length>.json (progress) and .log; a training that
# would pass 440 s stops at an evaluation (recorded under stopped_early) so the job still writes.
# Then, on the lead's machine (files_at = where $OUT came back):
#   python bench/match_mqar.py --preset=h100 --out_dir=bench/results \
#       --merge=$(ls <files_at>/mqar_*_*.json | paste -sd, -)
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
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mqar() {
  local methods=(full swa match random) lengths=(512 256 128 64) g j m L
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
seg() {
  mkdir -p out/segfid
  # (the h100 dense step compiled on CPU with the reference attention: 74.5 GiB of temporaries,
  # its [T, T] scores; on GPU the attention kernel holds none of them)
  CUDA_VISIBLE_DEVICES=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 480 \
    python -m bench.segmented_fidelity --preset=h100 --checkpoint_dir=out/segfid \
    --time_budget_s=400 --out_dir=$OUT/seg_h100 >> $OUT/seg_h100.log 2>&1 &
  CUDA_VISIBLE_DEVICES=2 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 480 \
    python -m bench.segmented_fidelity --preset=gpu_recall --checkpoint_dir=out/segfid \
    --time_budget_s=400 --out_dir=$OUT/seg_recall >> $OUT/seg_recall.log 2>&1 &
  if [ ! -e out/ttft.done ]; then  # once (out/ stays on a warm machine; $OUT is fresh)
    CUDA_VISIBLE_DEVICES=3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 480 \
      python bench/match_ttft.py --out_dir=$OUT/ttft > $OUT/ttft.log 2>&1 && touch out/ttft.done &
  fi
}
case $what in
  mqar) mqar ;;
  seg) seg ;;
  all) mqar; seg ;;
  *) echo "usage: $0 mqar|seg|all" >&2; exit 2 ;;
esac
wait
tail -n 3 $OUT/*.log
