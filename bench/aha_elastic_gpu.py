"""The GPU plan of the pre-registered reproductions: bench/aha_repro.py (presets h100 and
h100_pairs) and bench/elastic_repro.py (h100), every seed, as calls of <= 8 minutes on one
machine of `--gpus` GPUs, then the merges (issue 34).

    python -m bench.aha_elastic_gpu --gpus=2 --print                # the plan: calls, lanes, units
    python -m bench.aha_elastic_gpu --gpus=2 --write=bench/aha_elastic_x2.sh   # the lead's script
    IN=<packs of earlier calls> bash bench/aha_elastic_x2.sh 1   # call 1 on the GPU machine, $OUT set
    bash bench/aha_elastic_x2.sh merge    # anywhere (a CPU will do): judge + record
(bench/aha_elastic_h100.sh is the same plan for 4 GPUs: --gpus=4.)
    # Elastic h100 alone on 4 GPUs in 2 calls instead of 3 (the same units): each seed's dense
    # model then its single arm in a solo lane (alone on its GPU, timeout 540 s), the rest after
    python -m bench.aha_elastic_gpu --gpus=4 --runs=elastic_repro:h100 --solo_capacity=420 \
      --write=/tmp/e.sh

A unit is one piece of a seed's run (bench/aha_elastic_repro_common.py: a dense model, a
window, a lambda, an arm, a static control); a lane is one process on one GPU (jobs via
CUDA_VISIBLE_DEVICES, `per_gpu` lanes a GPU, each under `timeout 480`) that runs units of one
seed (`--part=u1,u2 --work_dir=W`: a dense model saved there, then units that reuse it). Units
are packed into lanes by their estimated H100 seconds (COST: one process alone on a GPU,
compile included) up to `capacity` a lane, leaving room for the slowdown of sharing a GPU with
the other lanes; a unit runs in a call after the units it reads (dense; the static control
reads the headline window / the single arm), or after them in the same lane. Runs are placed
in RUNS' order (a run's units before the next run's), so the first calls finish whole runs.

Resume across calls: W (workdir_aha_elastic/, git-ignored) holds the unit results and the
dense checkpoints. Each call leaves in $OUT the unit results (aha_elastic_units.tgz: JSON and
logs, all `merge` needs) and the saved trees the seeds with units still to run read
(aha_elastic_state.tgz.NN, <= 15 MiB pieces: the dense models, or a cut dense training's
state); a call first unpacks the packs found in $IN (a folder: the files of earlier calls,
carried in), so a call on a fresh machine goes on where the last one stopped, and a unit that
did not finish (a lane past its timeout) runs again in a later call (every part skips the units
already in W; a cut gated dense training goes on from its saved state).

Dry run on a CPU (the same plan on the `tiny` presets, lanes one after another):
    python -m bench.aha_elastic_gpu --tiny --gpus=2 --write=/tmp/tiny.sh && \\
      W=/tmp/w OUT=/tmp/o SERIAL=1 TIMEOUT=1800 PY=.venv/bin/python bash /tmp/tiny.sh all
(tests/bench/test_aha_elastic_gpu_plan.py: the plan's invariants by default, this dry run as a
manual test: every lane exit 0, and the three merged runs with their claims passing.)

AHA's until-plateau rule in batched programs (`bench.aha_repro --arms`, rc.train_arms_to_plateau):
    python -m bench.aha_elastic_gpu --gpus=4 --batched_cost \
      --runs=aha_repro:h100,aha_repro:h100_pairs,aha_repro:h100_pairs_pre
prints `batched_cost` (calls, programs, arms a program) at DEVICE_MS and a third of it; the
script of such calls is not generated yet (docs/schemes/aha.md, "The batched plan").
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (bench module, preset) of the plan, in the order they are placed (--runs picks some);
# --tiny swaps each preset for its tiny twin
RUNS = (("aha_repro", "h100"), ("aha_repro", "h100_pairs"), ("elastic_repro", "h100"))
# the order on fewer than 4 GPUs (several calls): Elastic first (its chain dense -> arms ->
# static spans 3 calls), then AHA h100, then h100_pairs (not run before: the optional one)
RUNS_FEW = (("elastic_repro", "h100"), ("aha_repro", "h100"), ("aha_repro", "h100_pairs"))
SCRIPTS = {4: "bench/aha_elastic_h100.sh", 2: "bench/aha_elastic_x2.sh"}   # per --gpus
# runs outside the default plan, placed only by --runs: AHA h100_pairs with the gated dense
# baseline (its script: PAIRS_GATED_SCRIPT, `--runs=aha_repro:h100_pairs_gated`)
EXTRA_RUNS = (("aha_repro", "h100_pairs_gated"),)
# the same on a pretrained qwen3-layout dense model (`--runs=aha_repro:h100_pairs_pre`; its
# script is written where the lead runs it, e.g. --write=.gpu/pairs_pre.sh)
PRE_RUNS = (("aha_repro", "h100_pairs_pre"),)
# Elastic's need design (two-hop recall, 1 recall row in 4; `--runs=elastic_repro:h100_need`,
# script written where the lead runs it): docs/schemes/elastic.md, "Need design"
NEED_RUNS = (("elastic_repro", "h100_need"),)
PAIRS_GATED_SCRIPT = "bench/aha_pairs_h100.sh"
TINY = {"h100": "tiny", "h100_pairs": "tiny_pairs", "h100_pairs_gated": "tiny_pairs_gated",
        "h100_pairs_pre": "tiny_pairs_pre", "h100_need": "tiny_need"}

# Estimated seconds of a unit alone on one H100, compile included, from the last GPU logs (AHA
# h100: dense ~110 s, ~60 s of training an arm; Elastic h100: ~85 s an arm; its gated dense
# model is unmeasured: the cap's worth). Static controls: 3 fine-tunes of an arm's steps.
COST = {"aha_repro": dict(dense=140, w=100, lam=75, static=200),
        "elastic_repro": dict(dense=300, arm=110, static=260, need=120)}
# (need: the need unit, ~40 frozen evaluations of 2048 rows, one compile each: unmeasured)
# a gated dense training (a preset with dense_gate): a lane of its own (the whole capacity); it
# stops at DENSE_BUDGET_S (exit 3, state saved) and the same call, rerun, goes on (the script's
# comment); its cost beyond one call is the plan's estimate in docs/schemes/aha.md
GATED_DENSE_COST = 330
TIMEOUT_S = 480
# a solo lane (plan's solo_capacity: a chain longer than `capacity` that holds a whole GPU, no
# other lane on it) runs under this timeout: no sharing slowdown to allow for, and a call may
# last up to 540 s
SOLO_TIMEOUT_S = 540
# MiB of a seed's saved dense model (float32 params, msgpack) in the h100 presets: Elastic 2.9M
# params, AHA 0.62M (jax.eval_shape of the presets' decoders); tiny presets: ~0.
TREE_MIB = {"aha_repro": 2.4, "elastic_repro": 11.2}
# the carry budget of a plan on fewer than 4 GPUs (a fresh machine a call): the device tool
# carries 64 MiB in all, with the wheels (~10 MiB) and the source tree (~9 MiB)
CARRY_MIB = 42.0


def _tree_mib(bench: str, tiny: bool) -> float:
  return 0.05 if tiny else TREE_MIB[bench]


def _kind(bench: str, unit: str) -> str:
  if unit in ("dense", "static"):
    return unit
  if bench == "aha_repro":
    return "lam" if "_lam" in unit else "w"
  return "need" if unit == "need" else "arm"


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
  rank: int = 0     # the run's place in the plan's order
  gpu: int = -1     # the GPU of its lane (set by plan)
  solo: bool = False  # in a solo lane: alone on its GPU (plan's solo_capacity)


# AHA's until-plateau rule (Settings.aha_cap): seconds alone on one H100 of an AHA training
# step of the h100 presets' model and of a dense model (the probe run h100_plateau_probe, one
# H100 at 0cff01a: 1500 -> 4200 steps in 101 s; dense 3000 steps 121 s, compile included), and
# an arm's fixed part (compile, held-out evaluation)
PLATEAU_STEP_S = 0.0374
PLATEAU_ARM_FIXED_S = 20.0
PLATEAU_DENSE_S = 121.0


def plateau_cost(preset: str, *, steps: int | None = None, gpus: int = 2, per_gpu: int = 3,
                 capacity: float = 330.0) -> dict:
  """What re-running every arm of AHA preset `preset` under the until-plateau rule costs when
  each arm trains `steps` steps (default: its cap, the worst case): arms (learned: windows +
  the lambda sweep; static fine-tunes: one per static lr), alone_s (seconds alone on one H100:
  the seeds' dense models + every arm) and calls (at least, on `gpus` GPUs of `per_gpu` lanes
  of `capacity` estimated seconds each, the plan's packing; an arm longer than a lane spans
  calls through its saved state)."""
  from bench import aha_repro
  s = aha_repro.PRESETS[preset]
  n = steps or s.aha_cap or s.aha_steps
  learned = sum(len(s.windows) + (len(set(s.lams) | {s.lam}) - 1
                                  if seed in s.seeds[:s.sweep_seeds] else 0) for seed in s.seeds)
  static = len(s.seeds) * len(s.static_lrs)
  arm_s = PLATEAU_ARM_FIXED_S + n * PLATEAU_STEP_S
  alone = len(s.seeds) * PLATEAU_DENSE_S + (learned + static) * arm_s
  return dict(preset=preset, steps=n, arms=learned + static, learned=learned, static=static,
              arm_s=round(arm_s, 1), alone_s=round(alone), gpu_hours=round(alone / 3600, 2),
              calls=int(-(-alone // (gpus * per_gpu * capacity))))


# Batched until-plateau arms (rc.train_arms_to_plateau: K arms in one program on one GPU, its
# batches made by a BatchPool of the GPU's share of the host's cores). Rates, per arm-step:
# BATCH_MS: host ms to make one training batch of the h100 presets (64 rows of T 512), measured
# on this repo's CPU machine (2 shared cores, 2026-11-28): 66 ms one-token facts, 52 ms
# two-token; DEVICE_MS: device ms of one AHA train step of the h100 model, an UPPER bound from
# the GPU logs (3 lanes sharing one H200: dense 43 ms a step each vs ~40 alone, AHA lambda arms
# <= 42-53 ms vs 37.4 alone: the GPU served 3 steps in ~43 ms, so one takes about <= 14 ms; not
# measured alone: the first batched call measures it).
BATCH_MS = {1: 66.0, 2: 52.0}
DEVICE_MS = 14.0
BATCH_FIXED_S = 60.0    # a program's compile + the held-out evaluations of its arms (guess)
ARM_STATE_MIB = 8.6     # an arm's TrainState (params + Adam's two moments, float32, 0.75M params)


def batched_cost(presets=("h100", "h100_pairs", "h100_pairs_pre"), *, gpus: int = 4,
                 cores_per_gpu: int = 16, call_s: float = 540.0, device_ms: float = DEVICE_MS,
                 batch_ms: dict | None = None, steps: int | None = None,
                 warm_calls: int = 1) -> dict:
  """The calls of every AHA arm of `presets` trained under the until-plateau rule in batched
  programs (one program a GPU a call, all its arms to `steps`, default the cap: the worst case;
  an arm at plateau earlier only frees its share). A program holds K arms of one preset with D
  distinct batch streams (an AHA window's lambda arms share theirs, the static lrs theirs) and
  takes BATCH_FIXED_S + steps * max(K * device_ms, D * batch_ms / (cores_per_gpu - 1)) ms: K
  is the most that finish inside `warm_calls` calls of `call_s` (1: inside one call, so no
  arm's state is carried between calls, only the dense models, TREE_MIB a seed, and JSON; > 1:
  the program goes on from its state saved in W in the next calls on the SAME warm machine,
  held <= 30 min; a fresh machine would need `state_mib_if_fresh`, over the device tool's
  limits). Dense models run first (one call, as the fixed-recipe plans run them). Returns
  {presets (arms, K a program, programs), programs, calls, gpu_seconds, ...}."""
  from bench import aha_repro
  batch_ms = batch_ms or BATCH_MS
  rows, calls = [], 0
  programs = []
  for p in presets:
    s = aha_repro.PRESETS[p]
    n = steps or s.aha_cap or s.aha_steps
    arms = []   # (seed, unit, data key)
    for seed in s.seeds:
      for u in aha_repro.units(s, seed):
        if u == "dense":
          continue
        if u == "static":
          arms += [(seed, f"static_lr{lr}", (seed, "static")) for lr in s.static_lrs]
        else:
          w = int(u[1:].split("_lam")[0])
          arms.append((seed, u, (seed, w)))
    per_step = lambda k, d: max(k * device_ms, d * batch_ms[s.fact_tokens] / (cores_per_gpu - 1))
    k = 0
    while k < len(arms):   # the most arms (any k consecutive: the worst data-sharing) that fit
      nxt = k + 1
      worst_d = max(len({a[2] for a in arms[i:i + nxt]}) for i in range(len(arms) - nxt + 1))
      if BATCH_FIXED_S + n * per_step(nxt, worst_d) / 1e3 > call_s * warm_calls:
        break
      k = nxt
    if k == 0:
      raise ValueError(f"{p}: one arm to {n} steps does not fit a call of {call_s:.0f} s")
    chunks = [arms[i:i + k] for i in range(0, len(arms), k)]
    for c in chunks:
      d = len({a[2] for a in c})
      programs.append(dict(preset=p, arms=len(c), streams=d,
                           seconds=round(BATCH_FIXED_S + n * per_step(len(c), d) / 1e3)))
    rows.append(dict(preset=p, arms=len(arms), steps=n, arms_per_program=k,
                     programs=len(chunks)))
  span = max(-(-q["seconds"] // call_s) for q in programs)   # calls a program spans
  calls = 1 + -(-len(programs) // gpus) * int(span)          # + the dense models' call
  return dict(gpus=gpus, cores_per_gpu=cores_per_gpu, device_ms=device_ms, call_s=call_s,
              presets=rows, programs=len(programs), calls=calls,
              longest_program_s=max(q["seconds"] for q in programs),
              gpu_seconds=round(sum(q["seconds"] for q in programs)),
              warm_calls=warm_calls, calls_a_program_spans=int(span),
              state_mib_if_fresh=round(ARM_STATE_MIB * max(q["arms"] for q in programs) * gpus
                                       if span > 1 else 0.0, 1),
              dense_mib_carried=round(sum(len(aha_repro.PRESETS[p].seeds) for p in presets)
                                      * TREE_MIB["aha_repro"], 1))


def plan(runs=RUNS, *, tiny: bool = False, gpus: int = 4, per_gpu: int = 3,
         capacity: float = 330.0, ordered: bool | None = None,
         carry_mib: float | None = None,
         solo_capacity: float | None = None) -> list[list[list[Cmd]]]:
  """calls[c][lane] = the commands of that lane (lane i on GPU i % gpus). Greedy: each call,
  every seed's ready units (in the bench's order, cut into commands of <= capacity) go into the
  lane with the most room that fits: units others read first, then (with `ordered`, default:
  fewer than 4 GPUs) the runs in `runs`' order, so the first calls finish whole runs, then the
  largest; what does not fit waits for the next call. `carry_mib`: a seed's dense model starts
  only while the dense trees held for later calls (TREE_MIB each) stay within it (what a fresh
  machine's call gets back through the device tool's carry). `solo_capacity` (default None:
  off): a unit that reads a unit of a command of this call, and would otherwise wait for the
  next call, may join that command up to solo_capacity; such a command runs in a solo lane,
  alone on its GPU (no other lane there, SOLO_TIMEOUT_S): e.g. Elastic h100 on 4 GPUs, dense
  then the single arm in one lane a seed, 2 calls instead of 3."""
  if ordered is None:
    ordered = gpus < 4
  import importlib
  todo = []   # (bench, preset, seed, settings, [units left])
  rank = {}   # (bench, preset) -> its place in `runs` (placed in that order when `ordered`)
  for bench, preset in runs:
    mod = importlib.import_module(f"bench.{bench}")
    p = TINY.get(preset, preset) if tiny else preset
    s = mod.PRESETS[p]
    rank[(bench, p)] = len(rank) if ordered else 0
    for seed in s.seeds:
      todo.append([bench, p, seed, s, list(mod.units(s, seed))])
  done: set = set()
  calls = []
  while any(t[4] for t in todo):
    chunks = []
    for r, (bench, p, seed, s, left) in enumerate(todo):
      mine = []   # this seed's commands in this call: first fit, a unit after what it reads
      for u in left:
        c = _cost(bench, s, u)
        before = [d for d in deps(bench, s, u) if (bench, p, seed, d) not in done]
        for ch in mine:
          if ch.cost + c <= capacity and all(d in ch.units for d in before):
            ch.units.append(u)
            ch.cost += c
            break
        else:
          if not before and c <= capacity:
            mine.append(Cmd(bench, p, seed, [u], c, rank=rank[(bench, p)]))
          elif before and solo_capacity is not None:   # after what it reads, in a solo lane
            for ch in mine:
              if ch.cost + c <= solo_capacity and all(d in ch.units for d in before):
                ch.units.append(u)
                ch.cost += c
                ch.solo = True
                break
      chunks += mine
    lanes = [[] for _ in range(gpus * per_gpu)]
    room = [capacity] * len(lanes)
    placed = []
    # MiB of dense trees later calls read: seeds with a dense model and units left (counted
    # until the call after the one that finishes the seed: conservative)
    held = sum(_tree_mib(b, tiny) for b, p, seed, s, left in todo
               if left and (b, p, seed, "dense") in done)
    # units others wait for (dense, the static control's input) first, then the largest
    needed = lambda c: bool(set(c.units) & set(deps(c.bench, _settings(c), "static")))
    for ch in sorted(chunks, key=lambda c: (not needed(c), not c.solo, c.rank, -c.cost)):
      if ch.solo:   # the first lane of a GPU with no lane yet; the GPU's other lanes closed
        free = [g for g in range(gpus) if all(not lanes[j] for j in range(g, len(lanes), gpus))
                and room[g] >= 0]
        if not free:
          continue
        i = free[0]
      else:
        i = max(range(len(lanes)), key=lambda j: room[j])
        if room[i] < ch.cost:
          continue
      left = next(t[4] for t in todo if t[:3] == [ch.bench, ch.preset, ch.seed])
      opens = "dense" in ch.units and set(left) - set(ch.units)
      if opens and carry_mib is not None and held + _tree_mib(ch.bench, tiny) > carry_mib:
        continue   # its dense model would not fit the carry until a held seed finishes
      held += _tree_mib(ch.bench, tiny) if opens else 0.0
      # a chunk reads only units done in earlier calls or earlier in itself
      lanes[i].append(ch)
      ch.gpu = i % gpus
      room[i] -= ch.cost
      if ch.solo:
        room[i] = -1.0                      # nothing after it in its lane
        for j in range(i + gpus, len(lanes), gpus):
          room[j] = -1.0                    # nor beside it on its GPU
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


def _cost(bench: str, s, unit: str) -> float:
  if unit == "dense" and getattr(s, "dense_gate", 0.0) and bench == "aha_repro":
    return GATED_DENSE_COST
  return COST[bench][_kind(bench, unit)]


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
  gated = c.bench == "elastic_repro" or getattr(s, "dense_gate", 0.0)
  budget = f" --dense_budget_s={DENSE_BUDGET_S}" if gated else ""
  return (f"$PY -m bench.{c.bench} --preset={c.preset} --seeds={c.seed} "
          f"--part={','.join(first + c.units)} --work_dir={work}{budget}")


def _flags(runs, tiny: bool, gpus: int, solo_capacity: float | None = None) -> str:
  """The generator flags that rebuild a plan of these runs (what the script's pack step passes
  to --carry)."""
  out = " --tiny" if tiny else ""
  out += f" --gpus={gpus}"
  if tuple(runs) != (RUNS if gpus >= 4 else RUNS_FEW):
    out += " --runs=" + ",".join(f"{b}:{p}" for b, p in runs)
  if solo_capacity is not None:
    out += f" --solo_capacity={solo_capacity:g}"
  return out


def carry(work_dir: str, runs=RUNS, *, tiny: bool = False,
          budget_mib: float | None = None, log=None) -> list[str]:
  """The saved trees in `work_dir` that a later call needs (names relative to it): for every
  seed of `runs` with a unit not yet done, its dense model, or its gated dense training's saved
  state(s) where the dense model is not done (an Elastic state holds Adam's moments: ~34 MiB
  a seed, over the carry budget for more than one seed). With `budget_mib`, the finished dense
  models come first and a cut training's states (all or none of one seed's) only while the
  files' sizes stay within the budget: what is left out restarts in the next call, named on
  `log`, instead of a pack larger than the device tool returns (64 MiB in all), whose lost
  pieces would break the whole split archive."""
  import importlib
  groups = []   # (0 = a finished dense model / 1 = a cut training's states, [names])
  for bench, preset in runs:
    mod = importlib.import_module(f"bench.{bench}")
    p = TINY.get(preset, preset) if tiny else preset
    s = mod.PRESETS[p]
    for seed in s.seeds:
      stem = os.path.join(work_dir, f"{bench}_{p}_s{seed}_")
      if all(os.path.exists(f"{stem}{u}.json") for u in mod.units(s, seed)):
        continue
      done = [n for n in ("dense.msgpack", "dense.pkl") if os.path.exists(stem + n)]
      if done:
        groups.append((0, [os.path.basename(stem + done[0])]))
      else:   # a cut gated dense training: its saved states (one per lr of its sweep)
        states = sorted(os.path.basename(f)
                        for f in glob.glob(glob.escape(stem) + "dense_state*.pkl"))
        if states:
          groups.append((1, states))
  if budget_mib is None:
    return [n for _, names in groups for n in names]
  out, used, left = [], 0.0, []
  for _, names in sorted(groups, key=lambda g: g[0]):   # stable: plan order within a kind
    mib = sum(os.path.getsize(os.path.join(work_dir, n)) for n in names) / 2**20
    if used + mib <= budget_mib:
      out, used = out + names, used + mib
    else:
      left += names
  if left and log is not None:
    log(f"carry: left out {' '.join(left)} (over the {budget_mib:g} MiB carry budget, "
        f"{used:.1f} MiB kept): those dense trainings restart in the next call")
  return out


def script(calls, runs=RUNS, *, tiny: bool = False, gpus: int = 4,
           solo_capacity: float | None = None) -> str:
  """The bash script: `bash <script> <call number> | all | merge` (solo_capacity: the plan's,
  named in its header)."""
  import importlib
  presets = [(b, TINY.get(p, p) if tiny else p) for b, p in runs]
  solo = any(ch.solo for lanes in calls for lane in lanes for ch in lane)
  lines = [
      "#!/bin/bash",
      f"# Generated by `python -m bench.aha_elastic_gpu{_flags(runs, tiny, gpus, solo_capacity)} "
      "--write=...`"
      " (bench/aha_elastic_gpu.py: the plan, its cost estimates and the dry run).",
      f"# {len(calls)} calls of <= {SOLO_TIMEOUT_S if solo else TIMEOUT_S} s on {gpus} GPUs + a "
      "merge; usage: "
      "bash $0 1|2|...|all|merge",
      "# Run from the repository root (python -m bench.*). A call on a fresh machine resumes "
      "from IN=<folder",
      "# holding the earlier calls' aha_elastic_units.tgz and aha_elastic_state.tgz.* (their "
      "$OUT files).",
  ]
  if any(getattr(importlib.import_module(f"bench.{b}").PRESETS[p], "dense_gate", 0.0)
         and b == "aha_repro" for b, p in presets):
    lines += [
        "# Gated dense trainings (call 1, a lane each): a lane with rc=3 (or 124) stopped at its",
        f"# budget ({DENSE_BUDGET_S} s an lr of its sweep) with its state saved: run call 1 again "
        "until every",
        "# lane says rc=0 (a seed that missed its gate at the cap is NOT JUDGED), then call 2.",
    ]
  lines += [
      "set -u",
      'export W=${W:-workdir_aha_elastic}   # git-ignored: stays on a warm machine',
      'OUT=${OUT:-out}',
      'IN=${IN:-}',
      'PY=${PY:-python}',
      'SERIAL=${SERIAL:-0}   # 1: lanes one after another (a CPU dry run)',
      f'TIMEOUT=${{TIMEOUT:-{TIMEOUT_S}}}',
  ]
  if solo:   # a solo lane's timeout (never below TIMEOUT: a CPU dry run sets a longer one)
    lines.append(f'SOLO_TIMEOUT=${{SOLO_TIMEOUT:-$(( TIMEOUT > {SOLO_TIMEOUT_S} ? TIMEOUT : '
                 f'{SOLO_TIMEOUT_S} ))}}   # a lane alone on its GPU')
  lines += [
      'mkdir -p "$W/logs" "$OUT"',
      'export PY PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false',
      'export CONDATTN_GIT_COMMIT=${CONDATTN_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}',
      "lane() {  # lane <call> <i> <gpu> <commands...>: one process at a time, one timeout",
      '  local c=$1 i=$2 g=$3; shift 3',
      '  local log="$W/logs/call${c}_lane${i}.log"',
      '  ( export CUDA_VISIBLE_DEVICES=$g; timeout "$TIMEOUT" bash -c "$(printf \'%s; \' "$@")" )'
      ' >> "$log" 2>&1',
      '  echo "call $c lane $i (GPU $g): rc=$? $(grep -h \'^part \' "$log" | tr \'\\n\' \' \')"',
      "}",
      "go() {  # a lane in the background (SERIAL=1: in the foreground)",
      '  if [ "$SERIAL" = 1 ]; then lane "$@"; else lane "$@" & fi',
      "}",
      "unpack() {  # the earlier calls' packs from $IN (files already in $W are kept)",
      '  [ -n "$IN" ] || return 0',
      '  [ -e "$IN/aha_elastic_units.tgz" ] && tar xzf "$IN/aha_elastic_units.tgz" -C "$W"'
      ' --skip-old-files',
      '  if ls "$IN"/aha_elastic_state.tgz.* >/dev/null 2>&1; then',
      '    cat "$IN"/aha_elastic_state.tgz.* | tar xzf - -C "$W" --skip-old-files',
      "  fi",
      '  echo "resumed from $IN: $(ls "$W" | grep -c \'\\.json$\') unit results"',
      "}",
      "pack() {  # unit results (JSON, logs) and the trees later calls read, back to $OUT",
      '  tar czf "$OUT/aha_elastic_units.tgz" -C "$W" $(cd "$W" && ls *.json 2>/dev/null) logs',
      '  rm -f "$OUT"/aha_elastic_state.tgz.*',
      f'  local keep; keep=$($PY -m bench.aha_elastic_gpu{_flags(runs, tiny, gpus)} '
      '--carry="$W")',
      '  if [ -n "$keep" ]; then',
      '    tar czf - -C "$W" $keep | split -b 15m -d - "$OUT/aha_elastic_state.tgz."',
      "  fi",
      '  echo "packed: $(ls "$OUT"/aha_elastic_* | tr \'\\n\' \' \')"',
      "}",
  ]
  for c, lanes in enumerate(calls, 1):
    lines.append(f"call{c}() {{")
    est = max(sum(ch.cost for ch in lane) for lane in lanes)
    n_solo = sum(any(ch.solo for ch in lane) for lane in lanes)
    lines.append(f"  # {len(lanes)} lanes, the fullest an estimated {est:.0f} s alone on a GPU"
                 + (f" ({n_solo} solo: alone on its GPU)" if n_solo else ""))
    lines.append("  unpack")
    for i, lane in enumerate(lanes):
      cmds = " ".join(shlex.quote(command(ch)) for ch in lane)
      g = lane[0].gpu if lane[0].gpu >= 0 else i % gpus
      env = "TIMEOUT=$SOLO_TIMEOUT " if any(ch.solo for ch in lane) else ""
      lines.append(f"  {env}go {c} {i} {g} {cmds}")
    lines += ["  wait", "  pack", "}"]
  lines.append("merge() {  # every preset judged on the merged units (needs every unit in $W)")
  lines.append("  unpack")
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
  ap.add_argument("--plateau_cost", action="store_true",
                  help="print plateau_cost of the AHA runs at the recipe's steps and at the cap")
  ap.add_argument("--batched_cost", action="store_true",
                  help="print batched_cost of the AHA runs (the until-plateau arms in batched "
                       "programs) at DEVICE_MS and at a third of it")
  ap.add_argument("--write", help="write the bash script here")
  ap.add_argument("--gpus", type=int, default=4)
  ap.add_argument("--per_gpu", type=int, default=3)
  ap.add_argument("--capacity", type=float, default=330.0,
                  help="estimated seconds alone on a GPU a lane may hold")
  ap.add_argument("--carry_mib", type=float, default=None,
                  help=f"carry budget of the held dense models (default: {CARRY_MIB} on fewer "
                       "than 4 GPUs, else none: one warm machine keeps W)")
  ap.add_argument("--solo_capacity", type=float, default=None,
                  help="let a unit that reads one of this call's commands join it up to this "
                       "many estimated seconds, alone on its GPU (a solo lane, timeout "
                       f"{SOLO_TIMEOUT_S} s): fewer calls (Elastic h100 on 4 GPUs: 420 -> 2 "
                       "calls); default off")
  ap.add_argument("--runs", default=None,
                  help="bench:preset,... in the order to place them (default: " +
                       ",".join(f"{b}:{p}" for b, p in RUNS) + ")")
  ap.add_argument("--carry", default=None, metavar="W",
                  help="print the saved trees in W that later calls read (the script's pack)")
  a = ap.parse_args(argv)
  if a.runs is None:
    runs = RUNS if a.gpus >= 4 else RUNS_FEW
  else:
    runs = tuple(tuple(x.split(":")) for x in a.runs.split(","))
  known = RUNS + EXTRA_RUNS + PRE_RUNS + NEED_RUNS
  bad = [r for r in runs if r not in known]
  if bad:
    raise SystemExit(f"--runs: {bad} not in {known}")
  if a.carry is not None:
    budget = a.carry_mib if a.carry_mib is not None else (CARRY_MIB if a.gpus < 4 else None)
    print(" ".join(carry(a.carry, runs, tiny=a.tiny, budget_mib=budget,
                         log=lambda m: print(m, file=sys.stderr))))
    return None
  if a.batched_cost:
    presets = [p for b, p in runs if b == "aha_repro"] or ["h100", "h100_pairs", "h100_pairs_pre"]
    out = [batched_cost(presets, gpus=a.gpus, device_ms=ms, warm_calls=w)
           for ms in (DEVICE_MS, DEVICE_MS / 3) for w in (1, 3)]
    for o in out:
      print(o)
    return out
  if a.plateau_cost:
    from bench import aha_repro
    out = []
    for bench, preset in runs:
      if bench == "aha_repro":
        s = aha_repro.PRESETS[preset]
        for n in sorted({s.aha_steps, s.aha_cap or s.aha_steps}):
          out.append(plateau_cost(preset, steps=n, gpus=a.gpus, per_gpu=a.per_gpu,
                                  capacity=a.capacity))
          print(out[-1])
    return out
  carry_mib = a.carry_mib if a.carry_mib is not None else (CARRY_MIB if a.gpus < 4 else None)
  calls = plan(runs, tiny=a.tiny, gpus=a.gpus, per_gpu=a.per_gpu, capacity=a.capacity,
               carry_mib=carry_mib, solo_capacity=a.solo_capacity)
  if not a.tiny:   # COST is the fixed recipe's: under the until-plateau rule arms run longer
    from bench import aha_repro
    for bench, preset in runs:
      if bench == "aha_repro" and aha_repro.PRESETS[preset].aha_cap:
        c = plateau_cost(preset, gpus=a.gpus, per_gpu=a.per_gpu, capacity=a.capacity)
        print(f"WARNING aha_repro:{preset} trains every arm until plateau (cap {c['steps']} "
              f"steps): an arm may take up to {c['arm_s']:.0f} s alone, more than this plan's "
              f"estimates and a lane; the plan does not split an arm across calls "
              f"(docs/schemes/aha.md, 'Until-plateau rule')", file=sys.stderr)
  if a.print or not a.write:
    total = sum(ch.cost for lanes in calls for lane in lanes for ch in lane)
    print(f"{len(calls)} calls on {a.gpus} GPUs, {a.per_gpu} lanes a GPU: {total:.0f} estimated "
          f"H100-alone seconds of units")
    for c, lanes in enumerate(calls, 1):
      print(f"call {c}: {len(lanes)} lanes")
      for i, lane in enumerate(lanes):
        g = lane[0].gpu if lane[0].gpu >= 0 else i % a.gpus
        solo = " solo" if any(ch.solo for ch in lane) else ""
        print(f"  lane {i} GPU {g}{solo} ({sum(ch.cost for ch in lane):.0f} s): "
              + " ; ".join(f"{ch.bench}:{ch.preset}:s{ch.seed}:{','.join(ch.units)}"
                           for ch in lane))
  if a.write:
    with open(a.write, "w") as f:
      f.write(script(calls, runs, tiny=a.tiny, gpus=a.gpus, solo_capacity=a.solo_capacity))
    os.chmod(a.write, 0o755)
    print(f"wrote {a.write}: {len(calls)} calls")
  return calls


if __name__ == "__main__":
  main()
