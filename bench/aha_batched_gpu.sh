#!/bin/bash
# Issue 34's until-plateau run of an aha_repro preset (Settings.aha_cap > 0) on 4 GPUs, arms
# BATCHED (`python -m bench.aha_repro --arms=...`: run_batched, one rc.train_arms_to_plateau
# program a lane). docs/schemes/aha.md ("The batched plan") sizes it; this is the hand-written
# lane layout for 3 seeds on 4 GPUs:
#   GPU 0..2: seed g's dense model, then ONE program of seed g's window units (w16..w256, the
#             headline lambda) + its first lambda-sweep unit, then (GPUs 0, 1) seed g's static
#             control (it reads w<smallest>: a later program);
#   GPU 3:    once every dense model is stored, ONE program of the other lambda-sweep units of
#             every seed, then seed 2's static control once seed 2's w<smallest> is stored.
# Unlike bench/aha_elastic_gpu.py's `--write` plans, no program is cut at a call's end: `start`
# runs `run` as a daemon (setsid) on one warm machine, and the device calls that follow only
# `watch` it (`status`, then `pack` the unit results); a program keeps its state
# at every plateau check in $W (rc.train_arms_to_plateau), so the same `run` on the same
# machine goes on from there and skips stored units.
# usage: PRESET=h100_pairs_pre W=<work dir> bash bench/aha_batched_gpu.sh \
#          start|watch|run|status|pack|merge
#   start: `run` as a setsid daemon (from a copy of the tree in $SRC where SRC is set: a device
#     call's tree is re-sent by the next call), then `watch`; the first device call.
#   watch: `status` every WATCH_POLL_S until every lane is done or WATCH_S seconds have passed,
#     then `pack`; the later device calls. It exits 3 at once, in one line, where no run was
#     started in $W on this machine (a fresh machine after an idle release: the daemon is gone).
#   SERIAL=1: the lanes one after another (a CPU dry run, e.g. PRESET=tiny_pairs_pre).
set -u
PRESET=${PRESET:-h100_pairs_pre}
export W=${W:-workdir_aha_batched}   # keep it off any path a device call re-sends
OUT=${OUT:-out}
PY=${PY:-python}
SERIAL=${SERIAL:-0}
WORKERS=${WORKERS:-15}   # batch-making processes a lane (64 cores on 4 GPUs)
SEEDS=(${SEEDS:-0 1 2})
POLL_S=${POLL_S:-10}   # how often a waiting lane looks for the unit it waits for
WATCH_S=${WATCH_S:-540}   # how long `watch` watches (a device call's limit is 600 s)
WATCH_POLL_S=${WATCH_POLL_S:-45}
if [ "${1:-}" = watch ] && ! ls "$W"/logs/lane*.log > /dev/null 2>&1; then
  echo "watch: no run in W=$W on this machine (a fresh one? the daemon is gone): 'start' it again"
  exit 3
fi
mkdir -p "$W/logs" "$OUT"
export PY PRESET WORKERS PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CONDATTN_GIT_COMMIT=${CONDATTN_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
# the preset's unit names: window units, the first lambda-sweep unit, the other sweep units
read -r WINDOWS LAM1 LAMREST < <($PY - "$PRESET" <<'EOF'
import sys
from bench.aha_repro import PRESETS, units
s = PRESETS[sys.argv[1]]
if not s.aha_cap:
  sys.exit(f"preset {sys.argv[1]} has no aha_cap: run_batched runs the until-plateau rule only")
u = units(s, s.seeds[0] if s.sweep_seeds else 0)
win = [x for x in u if x.startswith("w") and "_lam" not in x]
lam = [x for x in u if "_lam" in x] or ["-"]
print(",".join(win), lam[0], ",".join(lam[1:]) or "-")
EOF
) || exit 2
unit_json() { echo "$W/aha_repro_${PRESET}_s$1_$2.json"; }
wait_for() {  # wait_for <file> <lane that writes it>: 0 once it exists, 1 if that lane ended without it
  while [ ! -e "$1" ]; do
    [ -e "$W/logs/lane$2.done" ] && { echo "gave up: lane $2 ended without $1"; return 1; }
    sleep "$POLL_S"
  done
}
step() {  # step <label> <args of bench.aha_repro>: one process, its exit code logged
  local label=$1; shift
  echo "=== $(date -u +%H:%M:%S) start $label"
  $PY -m bench.aha_repro --preset="$PRESET" --work_dir="$W" "$@"
  local rc=$?
  echo "=== $(date -u +%H:%M:%S) end $label rc=$rc"
}
lane() {  # lane <i> <gpu>: the lane's steps (above), logged to $W/logs/lane<i>.log
  local i=$1 g=$2 s j
  rm -f "$W/logs/lane$i.done"
  (
    export CUDA_VISIBLE_DEVICES=$g
    if [ "$i" -lt 3 ]; then
      s=${SEEDS[$i]}
      step "dense s$s" --seeds="$s" --part=dense
      local arms=$WINDOWS; [ "$LAM1" != - ] && arms="$arms,$LAM1"
      step "arms s$s" --seeds="$s" --arms="$arms" --workers="$WORKERS"
      [ "$i" -lt 2 ] && step "static s$s" --seeds="$s" --arms=static --workers="$WORKERS"
    else
      for j in 0 1 2; do wait_for "$(unit_json "${SEEDS[$j]}" dense)" $j || exit 1; done
      [ "$LAMREST" != - ] && step "lambda sweep" --seeds="$(IFS=,; echo "${SEEDS[*]}")" \
        --arms="$LAMREST" --workers="$WORKERS"
      s=${SEEDS[2]}
      wait_for "$(unit_json "$s" "${WINDOWS%%,*}")" 2 || exit 1
      step "static s$s" --seeds="$s" --arms=static --workers="$WORKERS"
    fi
  ) >> "$W/logs/lane$i.log" 2>&1
  touch "$W/logs/lane$i.done"
}
run() {
  echo "preset $PRESET, seeds ${SEEDS[*]}: windows $WINDOWS, sweep $LAM1 + $LAMREST, W=$W"
  for i in 0 1 2 3; do
    if [ "$SERIAL" = 1 ]; then lane $i $i; else lane $i $i & fi
  done
  wait
  status
}
status() {  # one line a lane (its last step), the units stored
  local i
  for i in 0 1 2 3; do
    local f="$W/logs/lane$i.log" d=""
    [ -e "$W/logs/lane$i.done" ] && d=" (done)"
    echo "lane $i$d: $(grep -h '^===' "$f" 2>/dev/null | tail -1) | $(grep -v '^===' "$f" 2>/dev/null | tail -1 | cut -c1-160)"
  done
  echo "units stored: $(ls "$W" | grep -c "^aha_repro_${PRESET}_s.*\.json$")"
}
pack() {  # the unit results and logs (small), back through $OUT
  tar czf "$OUT/aha_units_$PRESET.tgz" -C "$W" $(cd "$W" && ls aha_repro_"${PRESET}"_s*.json 2>/dev/null) logs
  echo "packed $(tar tzf "$OUT/aha_units_$PRESET.tgz" | grep -c json) unit results"
}
lanes_done() { [ "$(ls "$W"/logs/lane*.done 2>/dev/null | wc -l)" -eq 4 ]; }
watch() {
  local end=$((SECONDS + WATCH_S))
  while :; do
    echo "--- $(date -u +%H:%M:%S)"; status
    lanes_done && { echo "all 4 lanes done"; break; }
    [ "$SECONDS" -ge "$end" ] && { echo "still running: watch again"; break; }
    sleep "$WATCH_POLL_S"
  done
  pack
}
start() {
  local dir
  dir=$(cd "$(dirname "$0")/.." && pwd)
  W=$(cd "$W" && pwd); export W   # the daemon runs in $dir
  if [ -n "${SRC:-}" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && cp -rL "$dir/." "$SRC/" && dir=$SRC
  fi
  rm -f "$W"/logs/lane*.done
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" setsid nohup \
     bash bench/aha_batched_gpu.sh run > "$W/logs/daemon.log" 2>&1 < /dev/null &)
  local i
  for i in $(seq 60); do ls "$W"/logs/lane*.log > /dev/null 2>&1 && break; sleep 0.5; done
  watch
}
merge() {  # every unit judged (needs every unit in $W)
  $PY -m bench.aha_repro --preset="$PRESET" --merge_parts="$W" --out_dir="$OUT"
}
case "${1:-}" in
  start) start ;;
  watch) watch ;;
  run) run ;;
  status) status ;;
  pack) pack ;;
  merge) merge ;;
  *) echo "usage: $0 start|watch|run|status|pack|merge"; exit 2 ;;
esac
