"""What bench/aha_repro.py and bench/elastic_repro.py share: pre-registered criteria, plateau
checks, seed statistics and a cached train-step runner over the project's train step.

Criteria: a module-level CRITERIA dict of each bench, {name: Criterion(metric, op, value,
doc)}, written before the bench runs; `judge(CRITERIA, metrics)` records each as
{metric, op, value, got, passed}. The verdicts live in the run's `recorded["criteria"]`
(never in the run's `claims`, which bench/results' check requires to pass): a pre-registered
criterion that fails is recorded as failed, and bench/claims re-derives every verdict from
the stored numbers (a changed number or a flipped verdict fails there).

Plateau (issue 34): an arm is at a plateau when its metric, smoothed over a tenth of the steps,
moved less than 1% (relative) over the last 20% of the steps (`plateau(curve)`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable

import numpy as np

OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
       "<": lambda a, b: a < b, "==": lambda a, b: a == b}


@dataclasses.dataclass(frozen=True)
class Criterion:
  metric: str      # key of the run's `metrics` (means over seeds unless the name says otherwise)
  op: str          # one of OPS
  value: float
  doc: str


def judge(criteria: dict, metrics: dict) -> dict:
  """{name: {metric, op, value, got, passed, doc}}: each pre-registered criterion on `metrics`
  (a metric that is missing or not a number fails its criterion)."""
  out = {}
  for name, c in criteria.items():
    if c.op not in OPS:
      raise ValueError(f"criterion {name}: op {c.op!r} is not one of {sorted(OPS)}")
    got = metrics.get(c.metric)
    if isinstance(got, bool):
      got = float(got)
    ok = isinstance(got, (int, float)) and math.isfinite(got) and bool(OPS[c.op](got, c.value))
    out[name] = dict(metric=c.metric, op=c.op, value=c.value, got=got, passed=bool(ok),
                     doc=c.doc)
  return out


def smooth(curve, window: int) -> np.ndarray:
  x = np.asarray(curve, np.float64)
  w = max(1, min(int(window), len(x)))
  c = np.cumsum(np.concatenate([[0.0], x]))
  out = np.empty_like(x)
  for i in range(len(x)):
    lo = max(0, i + 1 - w)
    out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
  return out


def plateau(curve, *, last: float = 0.2, rel: float = 0.01) -> dict:
  """{at_plateau, moved}: the curve smoothed over a tenth of its length; moved = |end - value at
  (1 - last) of the steps| / max(|that value|, 1e-3)."""
  n = len(curve)
  if n < 5:
    return dict(at_plateau=False, moved=None)
  sm = smooth(curve, max(1, n // 10))
  a, b = sm[int(round((1 - last) * n)) - 1], sm[-1]
  moved = abs(b - a) / max(abs(a), 1e-3)
  return dict(at_plateau=bool(moved < rel), moved=float(moved))


def seed_stats(values) -> dict:
  """{mean, std, min, max, n} of per-seed values (population std)."""
  v = np.asarray([x for x in values if x is not None], np.float64)
  if not len(v):
    return dict(mean=None, std=None, min=None, max=None, n=0)
  return dict(mean=float(v.mean()), std=float(v.std()), min=float(v.min()),
              max=float(v.max()), n=int(len(v)))


def thin(curve, points: int = 50) -> list:
  """The curve at <= `points` evenly spaced steps (recorded: [step, value] pairs, 1-based)."""
  n = len(curve)
  idx = sorted(set(np.linspace(0, n - 1, min(points, n)).round().astype(int).tolist()))
  return [[i + 1, round(float(curve[i]), 5)] for i in idx]


class _TC(dict):
  __getattr__ = dict.__getitem__


def train_config(*, steps, lr, seed, warmup_frac=0.05, schedule="cosine", end_lr_frac=0.1,
                 weight_decay=0.0, grad_clip=1.0, trainable=None, groups=None) -> _TC:
  """The train section the project's optimizer / step read (AdamW b1 .9, b2 .95)."""
  return _TC(num_steps=steps, lr=lr, warmup_frac=warmup_frac, warmup_steps=None,
             lr_schedule=schedule, end_lr_frac=end_lr_frac, grad_clip=grad_clip,
             weight_decay=weight_decay, b1=0.9, b2=0.95, eps=1e-8, trainable_regex=trainable,
             param_groups=groups or {}, seed=seed, microbatches=1, loss_chunk_size=0)


_STEPS: dict = {}


def _key(cfg, tc):
  return (cfg, tuple(sorted((k, repr(v)) for k, v in tc.items() if k != "seed")))


def train(cfg, params, tc, batch_fn: Callable[[int], dict], *, metrics=("accuracy",),
          name="", log=print, log_every=100):
  """`tc.num_steps` steps of the project's train step on batch_fn(i); the compiled step is
  cached per (config, train settings) across calls (seeds reuse it). Returns (params,
  {metric: per-step values}) for the metric names of the step's metrics dict (a scalar metric's
  values are floats, an array metric's lists)."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.train import optimizer as opt_lib
  from condattn_jax.train.state import TrainState
  from condattn_jax.train.step import make_train_step
  key = _key(cfg, tc)
  if key not in _STEPS:
    tx, labels, sched = opt_lib.make_optimizer(tc, params)
    _STEPS[key] = (tx, jax.jit(make_train_step(cfg, tc, tx, labels, sched), donate_argnums=(0,)))
  tx, step = _STEPS[key]
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  curves = {m: [] for m in metrics}
  pending, t0 = [], time.time()
  for i in range(tc.num_steps):
    state, m = step(state, jax.tree.map(jnp.asarray, batch_fn(i)))
    pending.append({k: m[k] for k in metrics})
    if len(pending) == 50 or i + 1 == tc.num_steps:
      for row in jax.device_get(pending):
        for k in metrics:
          v = np.asarray(row[k])
          curves[k].append(float(v) if v.ndim == 0 else v.tolist())
      pending = []
      if (i + 1) % log_every == 0 or i + 1 == tc.num_steps:
        log(f"[{name}] step {i + 1} " + " ".join(
            f"{k}={curves[k][-1]:.4g}" if isinstance(curves[k][-1], float)
            else f"{k}={np.round(curves[k][-1], 4).tolist()}" for k in metrics)
            + f" ({time.time() - t0:.0f}s)")
  return jax.device_get(state.params), curves


_FORWARD: dict = {}


def correct_and_gates(cfg, params, rows: dict, *, chunk: int = 64):
  """(ok [rows, T] bool: argmax == target, gate [L, rows, T, N] bool for an AHA config, else
  None) of the decoder on `rows` (inputs / targets / positions / segment_ids; other keys
  ignored), `chunk` rows a call; the jitted forward is cached per config (the AHA benches'
  one eval step: bench/aha_repro.py, bench/aha_window_sweep.py)."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.models.decoder import Decoder
  aha = cfg.scheme == "aha"
  if cfg not in _FORWARD:
    m = Decoder(cfg)

    @jax.jit
    def f(params, b):
      (logits, _), st = m.apply({"params": params}, b["inputs"], b["positions"],
                                b["segment_ids"], mutable=["intermediates"])
      ok = jnp.argmax(logits, -1) == b["targets"]
      return ok, (st["intermediates"]["layers"]["gate"][0] if aha else jnp.zeros((1,)))
    _FORWARD[cfg] = f
  oks, gates = [], []
  for i in range(0, len(rows["inputs"]), chunk):
    b = {k: jnp.asarray(v[i:i + chunk]) for k, v in rows.items()
         if k in ("inputs", "targets", "positions", "segment_ids")}
    ok, g = jax.device_get(_FORWARD[cfg](params, b))
    oks.append(np.asarray(ok))
    gates.append(np.asarray(g))
  return np.concatenate(oks), (np.concatenate(gates, axis=1) if aha else None)


def history(curves: dict, every: int) -> list:
  """Per-step curves (rc.train's) as rows {step, <metric>: value} at every `every`-th step and
  the last (1-based steps)."""
  n = len(next(iter(curves.values())))
  return [dict(step=i + 1, **{k: v[i] for k, v in curves.items()})
          for i in range(n) if (i + 1) % every == 0 or i + 1 == n]


def define_flags(flag_values, presets, doc: str):
  """The two repro benches' flags: --preset (names from `presets`, `doc` for the page of its H100
  command) and --seeds (override the preset's seeds)."""
  from absl import flags
  flags.DEFINE_enum("preset", "cpu", sorted(presets), "size: cpu (recorded), ci (tests/bench), "
                    f"h100 (one H100, {doc}), test (seconds)", flag_values=flag_values)
  flags.DEFINE_list("seeds", None, "override the preset's seeds (e.g. 0: one seed a command on a "
                    "slow machine; the run is then named <preset>_seeds<list>)",
                    flag_values=flag_values)
  flags.DEFINE_list("merge", None, "result files of one-seed runs of --preset (--seeds=N each, e.g. "
                    "one per GPU): judge them together as one run named <preset>, no training",
                    flag_values=flag_values)


def merged_seeds(paths, preset: str) -> tuple[list[int], list[dict], float]:
  """(seeds, per-seed results, seconds) of the newest run of `preset` (or `preset_seeds...`) in
  each result file, ordered by seed; ValueError naming the file on a repeated seed or a run of
  other settings."""
  from bench import common
  by_seed, seconds, ref = {}, 0.0, None
  for path in paths:
    rec = [r for r in common.load(path)["runs"]
           if str(r["settings"].get("name", "")).split("_seeds")[0] == preset]
    if not rec:
      raise ValueError(f"{path}: no run of preset {preset!r} to merge")
    r = max(rec, key=lambda r: common._timestamp(r["date"]))["recorded"]
    other = {k: v for k, v in r["settings"].items() if k != "seeds"}
    if ref is not None and other != ref:
      raise ValueError(f"{path}: settings differ from the first file's; merge runs of one preset")
    ref = other
    for seed, res in zip(r["settings"]["seeds"], r["seeds"]):
      if seed in by_seed:
        raise ValueError(f"{path}: seed {seed} is already in another merged file")
      by_seed[seed] = res
    seconds += float(r.get("seconds", 0.0))
  order = sorted(by_seed)
  return order, [by_seed[k] for k in order], seconds


def main(bench: str, flag_values, presets, files, run, argv=None):
  """Parse the flags, run the preset (seeds overridden by --seeds, the run named after them; or
  --merge: judge one-seed runs together), append it to bench/results/<bench>.json (or
  --out_dir) and return the result. `run(settings, done=None)` trains every seed of the settings,
  or, given `done` (the per-seed results), only judges them."""
  from bench import common
  a = common.parse_flags(flag_values, argv)
  s, name = presets[a.preset], a.preset
  if a.merge:
    seeds, done, seconds = merged_seeds(a.merge, a.preset)
    res = run(dataclasses.replace(s, seeds=tuple(seeds)), done=done)
    res["seconds"], res["merged_from"] = seconds, list(a.merge)
  else:
    if a.seeds:
      s = dataclasses.replace(s, seeds=tuple(int(x) for x in a.seeds))
      name = f"{a.preset}_seeds{'_'.join(a.seeds)}"
    res = run(s)
  res["preset"] = name
  out = common.result_path(bench, a.out_dir, fixed=files.get(name))
  common.write_result(out, bench, res, name=name)
  print(f"wrote {out}")
  return res
