"""The GPU plan of the pre-registered reproductions: bench/aha_repro.py (presets h100 and
h100_pairs) and bench/elastic_repro.py (h100), every seed, as a few calls of <= 9 minutes on one
4-GPU machine, then the merges (issue 34).

    python -m bench.aha_elastic_gpu --print                  # the plan: calls, lanes, units
    python -m bench.aha_elastic_gpu --write=bench/aha_elastic_h100.sh   # the lead's script
    bash bench/aha_elastic_h100.sh 1    # call 1 on the GPU machine (then 2, 3, ...), $OUT set
    bash bench/aha_elastic_h100.sh merge   # anywhere (a CPU will do): judge + record

A unit is one piece of a seed's run (bench/aha_elastic_repro_common.py: a dense model, a
window, a lambda, an arm, a static control); a lane is one process on one GPU (jobs via
CUDA_VISIBLE_DEVICES, `per_gpu` lanes a GPU, each under `timeout 480`) that runs units of one
seed (`--part=u1,u2 --work_dir=W`: a dense model saved there, then units that reuse it). Units
are packed into lanes by their estimated H100 seconds (COST: one process alone on a GPU,
compile included) up to `capacity` a lane, leaving room for the slowdown of sharing a GPU with
the other lanes; a unit runs in a call after the units it reads (dense; the static control
reads the headline window / the single arm), or after them in the same lane. A unit that did
not finish (a lane past its timeout) is run by the next call of the same script: every part
skips the units already in W. W (workdir_aha_elastic/ in the repo: git-ignored, so it stays on
a warm machine between calls) holds the dense checkpoints; each call also copies the unit
results (JSON, no checkpoints) to $OUT/aha_elastic_units.tgz, which is all `merge` needs.

Dry run on a CPU (the same plan on the `tiny` presets, lanes one after another):
    python -m bench.aha_elastic_gpu --tiny --write=/tmp/tiny.sh && \\
      W=/tmp/w OUT=/tmp/o SERIAL=1 TIMEOUT=1800 PY=.venv/bin/python bash /tmp/tiny.sh all
(tests/bench/test_aha_elastic_gpu_plan.py: the plan's invariants by default, this dry run as a
manual test: 12 lanes, every one exit 0, and the three merged runs with their claims passing;
5.7 CPU-minutes, 28 minutes on the shared 2-core host.)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (bench module, preset) of the plan; --tiny swaps each preset for its tiny twin
RUNS = (("aha_repro", "h100"), ("aha_repro", "h100_pairs"), ("elastic_repro", "h100"))
TINY = {"h100": "tiny", "h100_pairs": "tiny_pairs"}

# Estimated seconds of a unit alone on one H100, compile included, from the last GPU logs (AHA
# h100: dense ~110 s, ~60 s of training an arm; Elastic h100: ~85 s an arm; its gated dense
# model is unmeasured: the cap's worth). Static controls: 3 fine-tunes of an arm's steps.
COST = {"aha_repro": dict(dense=140, w=100, lam=75, static=200),
        "elastic_repro": dict(dense=300, arm=110, static=260)}
TIMEOUT_S = 480


def _kind(bench: str, unit: str) -> str:
  if unit in ("dense", "static"):
    return unit
  if bench == "aha_repro":
    return "lam" if "_lam" in unit else "w"
  return "arm"


def deps(bench: str, s, unit: str) -> list[str]:
  """The units `unit` reads: the dense model; the static control also the headline window (AHA)
  or the single arm (Elastic)."""
  if unit == "dense":
    return []
  if unit == "static":
    return ["dense", f"w{min(s.windows)}" if bench == "aha_repro" else "single"]
  return ["dense"]


@dataclasses.dataclass
class Cmd:
  bench: str
  preset: str
  seed: int
  units: list
  cost: float = 0.0


def plan(runs=RUNS, *, tiny: bool = False, gpus: int = 4, per_gpu: int = 3,
         capacity: float = 330.0) -> list[list[list[Cmd]]]:
  """calls[c][lane] = the commands of that lane (lane i on GPU i % gpus). Greedy: each call,
  every seed's ready units (in the bench's order, cut into commands of <= capacity) go into the
  lane with the most room that fits, largest first; what does not fit waits for the next call."""
  import importlib
  todo = []   # (bench, preset, seed, settings, [units left])
  for bench, preset in runs:
    mod = importlib.import_module(f"bench.{bench}")
    p = TINY.get(preset, preset) if tiny else preset
    s = mod.PRESETS[p]
    for seed in s.seeds:
      todo.append([bench, p, seed, s, list(mod.units(s, seed))])
  done: set = set()
  calls = []
  while any(t[4] for t in todo):
    chunks = []
    for bench, p, seed, s, left in todo:
      mine = []   # this seed's commands in this call: first fit, a unit after what it reads
      for u in left:
        c = COST[bench][_kind(bench, u)]
        before = [d for d in deps(bench, s, u) if (bench, p, seed, d) not in done]
        for ch in mine:
          if ch.cost + c <= capacity and all(d in ch.units for d in before):
            ch.units.append(u)
            ch.cost += c
            break
        else:
          if not before and c <= capacity:
            mine.append(Cmd(bench, p, seed, [u], c))
      chunks += mine
    lanes = [[] for _ in range(gpus * per_gpu)]
    room = [capacity] * len(lanes)
    placed = []
    # units others wait for (dense, the static control's input) first, then the largest
    needed = lambda c: bool(set(c.units) & set(deps(c.bench, _settings(c), "static")))
    for ch in sorted(chunks, key=lambda c: (not needed(c), -c.cost)):
      i = max(range(len(lanes)), key=lambda j: room[j])
      if room[i] < ch.cost:
        continue
      # a chunk reads only units done in earlier calls or earlier in itself
      lanes[i].append(ch)
      room[i] -= ch.cost
      placed.append(ch)
    if not placed:
      raise RuntimeError("a unit costs more than a lane's capacity: raise capacity")
    for ch in placed:
      t = next(t for t in todo if t[:3] == [ch.bench, ch.preset, ch.seed])
      for u in ch.units:
        t[4].remove(u)
        done.add((ch.bench, ch.preset, ch.seed, u))
    calls.append([lane for lane in lanes if lane])
  return calls


def _settings(c: Cmd):
  import importlib
  return importlib.import_module(f"bench.{c.bench}").PRESETS[c.preset]


DENSE_BUDGET_S = 400   # a gated dense training saves its state and stops (exit 3) past this


def command(c: Cmd, work: str = "$W") -> str:
  """The lane's command: the units it reads first (skipped when done, run when an earlier lane
  did not finish them), then its own units."""
  s = _settings(c)
  first = []
  for u in c.units:
    first += [d for d in deps(c.bench, s, u) if d not in c.units and d not in first]
  budget = f" --dense_budget_s={DENSE_BUDGET_S}" if c.bench == "elastic_repro" else ""
  return (f"$PY -m bench.{c.bench} --preset={c.preset} --seeds={c.seed} "
          f"--part={','.join(first + c.units)} --work_dir={work}{budget}")


def script(calls, runs=RUNS, *, tiny: bool = False, gpus: int = 4) -> str:
  """The bash script: `bash <script> <call number> | all | merge`."""
  presets = sorted({(b, TINY.get(p, p) if tiny else p) for b, p in runs})
  lines = [
      "#!/bin/bash",
      f"# Generated by `python -m bench.aha_elastic_gpu{' --tiny' if tiny else ''} --write=...`"
      " (bench/aha_elastic_gpu.py: the plan, its cost estimates and the dry run).",
      f"# {len(calls)} calls of <= {TIMEOUT_S} s + a merge; usage: bash $0 1|2|...|all|merge",
      "# Run from the repository root (python -m bench.*).",
      "set -u",
      'export W=${W:-workdir_aha_elastic}   # git-ignored: stays on a warm machine',
      'OUT=${OUT:-out}',
      'PY=${PY:-python}',
      'SERIAL=${SERIAL:-0}   # 1: lanes one after another (a CPU dry run)',
      f'TIMEOUT=${{TIMEOUT:-{TIMEOUT_S}}}',
      'mkdir -p "$W/logs" "$OUT"',
      'export PY PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false',
      'export CONDATTN_GIT_COMMIT=${CONDATTN_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}',
      "lane() {  # lane <call> <i> <gpu> <commands...>: one process at a time, one timeout",
      '  local c=$1 i=$2 g=$3; shift 3',
      '  local log="$W/logs/call${c}_lane${i}.log"',
      '  ( export CUDA_VISIBLE_DEVICES=$g; timeout "$TIMEOUT" bash -c "$(printf \'%s; \' "$@")" )'
      ' > "$log" 2>&1',
      '  echo "call $c lane $i (GPU $g): rc=$? $(grep -h \'^part \' "$log" | tr \'\\n\' \' \')"',
      "}",
      "go() {  # a lane in the background (SERIAL=1: in the foreground)",
      '  if [ "$SERIAL" = 1 ]; then lane "$@"; else lane "$@" & fi',
      "}",
      "pack() {  # the unit results (no checkpoints) back to $OUT",
      '  tar czf "$OUT/aha_elastic_units.tgz" -C "$W" $(cd "$W" && ls *.json 2>/dev/null) logs',
      "}",
  ]
  for c, lanes in enumerate(calls, 1):
    lines.append(f"call{c}() {{")
    est = max(sum(ch.cost for ch in lane) for lane in lanes)
    lines.append(f"  # {len(lanes)} lanes, the fullest an estimated {est:.0f} s alone on a GPU")
    for i, lane in enumerate(lanes):
      cmds = " ".join(shlex.quote(command(ch)) for ch in lane)
      lines.append(f"  go {c} {i} {i % gpus} {cmds}")
    lines += ["  wait", "  pack", "}"]
  lines.append("merge() {  # every preset judged on the merged units (needs every unit in $W)")
  for b, p in presets:
    lines.append(f"  $PY -m bench.{b} --preset={p} --merge_parts=$W --out_dir=$OUT || return 1")
  lines.append("}")
  lines += ['case "${1:-}" in',
            "  all) " + "; ".join(f"call{c}" for c in range(1, len(calls) + 1)) + "; merge ;;",
            "  merge) merge ;;"]
  lines += [f"  {c}) call{c} ;;" for c in range(1, len(calls) + 1)]
  lines += ['  *) echo "usage: $0 1..' + str(len(calls)) + '|all|merge"; exit 2 ;;', "esac", ""]
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tiny", action="store_true", help="the tiny presets (a CPU dry run)")
  ap.add_argument("--print", action="store_true", help="print the plan")
  ap.add_argument("--write", help="write the bash script here")
  ap.add_argument("--gpus", type=int, default=4)
  ap.add_argument("--per_gpu", type=int, default=3)
  ap.add_argument("--capacity", type=float, default=330.0,
                  help="estimated seconds alone on a GPU a lane may hold")
  a = ap.parse_args(argv)
  calls = plan(tiny=a.tiny, gpus=a.gpus, per_gpu=a.per_gpu, capacity=a.capacity)
  if a.print or not a.write:
    for c, lanes in enumerate(calls, 1):
      print(f"call {c}: {len(lanes)} lanes")
      for i, lane in enumerate(lanes):
        print(f"  lane {i} GPU {i % a.gpus} ({sum(ch.cost for ch in lane):.0f} s): "
              + " ; ".join(f"{ch.bench}:{ch.preset}:s{ch.seed}:{','.join(ch.units)}"
                           for ch in lane))
  if a.write:
    with open(a.write, "w") as f:
      f.write(script(calls, tiny=a.tiny, gpus=a.gpus))
    os.chmod(a.write, 0o755)
    print(f"wrote {a.write}: {len(calls)} calls")
  return calls


if __name__ == "__main__":
  main()
