# Issue 31's all-full profile on one GPU (one device call; sourced from the repository root with
# .whl carried): where our forward+backward's device time goes against cuDNN's, kernel by kernel.
#   1. bench/block_sparse.py --profile: CUPTI per-kernel times (torch's profiler in the JAX
#      process), launch facts (registers, shared memory, grid) and NVML clocks of ours and cuDNN's
#      forward+backward and of our three kernels alone, 64K then 32K (run PROFILE_RUN in
#      $OUT/block_sparse_<device>.json; the kernels' names for ncu in $OUT/ncu_regex.txt).
#   2. Only with PROFILE_NCU=1: Nsight Compute on those kernels at 64K (one launch each,
#      --clock-control none: the card's clocks are left alone; sections without PM sampling, whose
#      report would be large), the platform allocator (no preallocated pool for ncu to save and
#      restore), raw / details / SASS-source exports and --ncu_summary's key counters. In run
#      mosaic_gpu_profile_all_full (one H100, 2026-11-27) ncu segfaulted (rc 139) in the JAX
#      process before profiling any kernel, as it had for the compacted kernel's profile.
#   3. Mosaic GPU's ptxas report (registers, spills) of our kernels at 8K (no SASS: the image has no
#      nvdisasm where Mosaic GPU looks for it), with its other dumps tarred into
#      $OUT/mosaic_dump.tar.gz (a call returns at most 8 files from $OUT).
# Each stage has its own time limit (PROFILE_T1/T2/T3 s); a stage that fails leaves the others'
# files. The 64K + 32K profile took ~100 s on a warm H100 (95 s cut it during 32K).
# Run with CONDATTN_GIT_COMMIT=<local short HEAD> (the device copy's git metadata may be older).
source scripts/gpu_env.sh
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
T1=${PROFILE_T1:-150}; T2=${PROFILE_T2:-115}; T3=${PROFILE_T3:-25}
timeout "$T1" python -m bench.block_sparse --profile --T=65536,32768 --n=3 --out_dir="$OUT" \
  > "$OUT/profile.log" 2>&1
echo "profile rc $?"
grep -v "^ *$" "$OUT/profile.log" | grep -E "^T=|^    |profile|Error|error" | tail -c 7000
if [ "${PROFILE_NCU:-0}" = 1 ]; then
RE=$(cat "$OUT/ncu_regex.txt" 2>/dev/null)
RE=${RE:-block_sparse_|sdpa}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU regex: $RE"
SECTIONS=""
for s in SpeedOfLight LaunchStats Occupancy ComputeWorkloadAnalysis MemoryWorkloadAnalysis \
         SchedulerStats WarpStateStats InstructionStats SourceCounters; do
  SECTIONS="$SECTIONS --section $s"
done
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$T2" "$NCU" --clock-control none $SECTIONS \
  -k "regex:$RE" -c 8 -f -o "$OUT/ncu_64k" \
  python -m bench.block_sparse --profile_target --T=65536 > "$OUT/ncu.log" 2>&1
echo "ncu rc $?"
grep -E "==PROF==|==ERROR==|==WARNING==|profile_target" "$OUT/ncu.log" | tail -15
if [ -f "$OUT/ncu_64k.ncu-rep" ]; then
  "$NCU" -i "$OUT/ncu_64k.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2> "$OUT/ncu_i.err"
  "$NCU" -i "$OUT/ncu_64k.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>> "$OUT/ncu_i.err"
  python -m bench.block_sparse --ncu_summary="$OUT/ncu_raw.csv" 2>&1 | tail -c 4500
  for k in dq dkv; do
    "$NCU" -i "$OUT/ncu_64k.ncu-rep" -k "regex:block_sparse_${k}_" --page source --csv \
      --print-source sass > "$OUT/ncu_src_$k.csv" 2>> "$OUT/ncu_i.err"
    gzip -f "$OUT/ncu_src_$k.csv"
  done
  [ "$(stat -c %s "$OUT/ncu_64k.ncu-rep")" -gt 15000000 ] && gzip -f "$OUT/ncu_64k.ncu-rep"
fi
fi
mkdir -p "$OUT/mosaic"
MOSAIC_GPU_DUMP_TO="$OUT/mosaic" MOSAIC_GPU_DUMP_PTXAS=1 \
  timeout "$T3" python -m bench.block_sparse --profile_target --T=8192 > "$OUT/mosaic.log" 2>&1
echo "mosaic dump rc $?"
grep -i -E "registers|spill|stack frame" "$OUT"/mosaic/*.ptxas "$OUT"/mosaic/*resources* 2>/dev/null \
  | head -12
tar -C "$OUT" -czf "$OUT/mosaic_dump.tar.gz" mosaic && rm -rf "$OUT/mosaic"
ls -la "$OUT" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ';'
