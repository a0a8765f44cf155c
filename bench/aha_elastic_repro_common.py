"""What bench/aha_repro.py and bench/elastic_repro.py share: pre-registered criteria, plateau
checks, seed statistics and a cached train-step runner over the project's train step.

Criteria: a module-level CRITERIA dict of each bench, {name: Criterion(metric, op, value,
doc)}, written before the bench runs; `judge(CRITERIA, metrics)` records each as
{metric, op, value, got, passed}. The verdicts live in the run's `recorded["criteria"]`
(never in the run's `claims`, which bench/results' check requires to pass): a pre-registered
criterion that fails is recorded as failed, and bench/claims re-derives every verdict from
the stored numbers (a changed number or a flipped verdict fails there).

Plateau (issue 34): an arm is at a plateau when its metric, smoothed over a tenth of the steps,
moved less than 1% (relative) over the last 20% of the steps (`plateau(curve)`);
`train_to_plateau` trains until it holds or a cap (AHA's until-plateau rule; Elastic's arms run
their fixed steps through `train`, unchanged).
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


def _step_fn(cfg, tc, params):
  import jax
  from condattn_jax.train import optimizer as opt_lib
  from condattn_jax.train.step import make_train_step
  key = _key(cfg, tc)
  if key not in _STEPS:
    tx, labels, sched = opt_lib.make_optimizer(tc, params)
    _STEPS[key] = (tx, jax.jit(make_train_step(cfg, tc, tx, labels, sched), donate_argnums=(0,)))
  return _STEPS[key]


def _steps(step, state, batch_fn, start, stop, metrics, curves, name, log, log_every, t0):
  """Steps start..stop-1 of `step` on batch_fn(i), appending each metric to curves[k]."""
  import jax
  import jax.numpy as jnp
  pending = []
  for i in range(start, stop):
    state, m = step(state, jax.tree.map(jnp.asarray, batch_fn(i)))
    pending.append({k: m[k] for k in metrics})
    if len(pending) == 50 or i + 1 == stop:
      for row in jax.device_get(pending):
        for k in metrics:
          v = np.asarray(row[k])
          curves[k].append(float(v) if v.ndim == 0 else v.tolist())
      pending = []
      if (i + 1) % log_every == 0 or i + 1 == stop:
        log(f"[{name}] step {i + 1} " + " ".join(
            f"{k}={curves[k][-1]:.4g}" if isinstance(curves[k][-1], float)
            else f"{k}={np.round(curves[k][-1], 4).tolist()}" for k in metrics)
            + f" ({time.time() - t0:.0f}s)")
  return state


def _start(tx, params, resume: dict | None, fresh: dict):
  """(TrainState, progress dict): `resume`'s saved state and progress (a dict a save callback
  was given), or a fresh state at step 0 and `fresh`."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.train.state import TrainState
  if resume:
    st = dict(resume)
    return jax.tree.map(jnp.asarray, st.pop("state")), st
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params)), fresh


def _after_check(payload: Callable[[], dict], save, budget_s, t0: float, done: bool, name: str,
                 stop: int):
  """A resumable training's end of check: `save(payload())` (progress and host state); past
  `budget_s` seconds since t0 and not `done`, Budget (the state is saved: a rerun goes on from
  it)."""
  if save is not None:
    save(payload())
  if budget_s is not None and time.time() - t0 > budget_s and not done:
    raise Budget(f"{name}: stopped at step {stop} after {time.time() - t0:.0f} s (budget "
                 f"{budget_s:.0f} s), state saved: run the same part again to continue")


def train(cfg, params, tc, batch_fn: Callable[[int], dict], *, metrics=("accuracy",),
          name="", log=print, log_every=100):
  """`tc.num_steps` steps of the project's train step on batch_fn(i); the compiled step is
  cached per (config, train settings) across calls (seeds reuse it). Returns (params,
  {metric: per-step values}) for the metric names of the step's metrics dict (a scalar metric's
  values are floats, an array metric's lists)."""
  import jax
  tx, step = _step_fn(cfg, tc, params)
  state, curves = _start(tx, params, None, {m: [] for m in metrics})
  state = _steps(step, state, batch_fn, 0, tc.num_steps, metrics, curves, name, log, log_every,
                 time.time())
  return jax.device_get(state.params), curves


class Budget(Exception):
  """A gated training stopped at its wall-clock budget; its state is saved (rerun to go on)."""


def train_to_gate(cfg, params, tc, batch_fn, gate: Callable, *, check_every: int,
                  resume: dict | None = None, save: Callable | None = None,
                  budget_s: float | None = None, name="", log=print, log_every=100):
  """Train until `gate(params)` (called every `check_every` steps: (passed, value)) passes or
  `tc.num_steps` (the cap) is reached. Deterministic however it is split: with `resume` (a
  dict `save` was given) it goes on from that check; `save(state_dict)` is called after every
  check; past `budget_s` seconds it raises Budget after saving. Returns (params, dict(curve,
  checks [[step, value]], steps, passed))."""
  import jax
  tx, step = _step_fn(cfg, tc, params)
  state, st = _start(tx, params, resume, dict(curve=[], checks=[], steps=0, passed=False))
  t0 = time.time()
  while not st["passed"] and st["steps"] < tc.num_steps:
    stop = min(st["steps"] + check_every, tc.num_steps)
    curves = {"accuracy": st["curve"]}
    state = _steps(step, state, batch_fn, st["steps"], stop, ("accuracy",), curves, name, log,
                   log_every, t0)
    st["steps"] = stop
    ok, value = gate(jax.device_get(state.params))
    st["checks"].append([stop, value])
    st["passed"] = bool(ok)
    log(f"[{name}] gate at step {stop}: {value:.4f} ({'passed' if ok else 'not yet'})")
    _after_check(lambda: dict(st, state=jax.device_get(state)), save, budget_s, t0,
                 st["passed"] or st["steps"] >= tc.num_steps, name, stop)
  return jax.device_get(state.params), dict(curve=st["curve"], checks=st["checks"],
                                            steps=st["steps"], passed=st["passed"])


def plateau_arms_loop(sts: list, advance: Callable, *, recipe_steps: int, cap: int,
                      check_every: int, after_check: Callable | None = None, log=print,
                      names=None) -> list:
  """The until-plateau rule's loop for several arms on one step counter (train_to_plateau's and
  train_arms_to_plateau's, on any curves): `advance(on, start, stop)` appends steps
  start..stop-1 to sts[i]["curves"] ({metric: values}) of every arm i in `on` (the arms still
  training); each arm is checked at recipe_steps and every check_every steps after it, and
  stops when `plateau` holds for every one of its curves (on the whole curve from step 1) or at
  `cap`; a stopped arm is left out of `on` (masked) while the others go on. sts (fresh: steps 0,
  checks [], at_plateau False, curves) are updated in place; after_check(sts, stop) runs after
  every check (recording, saving, a budget's exception). Returns [st + {cap, check_every,
  stopped: 'plateau' | 'cap'}] in sts' order."""
  if cap < recipe_steps or check_every < 1:
    raise ValueError(f"{names}: cap {cap} must be >= the recipe's {recipe_steps} steps and "
                     f"check_every {check_every} >= 1")
  names = names or [str(i) for i in range(len(sts))]
  live = lambda st: not st["at_plateau"] and st["steps"] < cap
  while any(live(st) for st in sts):
    on = [i for i, st in enumerate(sts) if live(st)]
    start = sts[on[0]]["steps"]
    if any(sts[i]["steps"] != start for i in on):
      raise ValueError(f"{names}: the arms still training are at different steps "
                       f"{[sts[i]['steps'] for i in on]}")
    stop = recipe_steps if start < recipe_steps else min(start + check_every, cap)
    advance(on, start, stop)
    for i in on:
      st = sts[i]
      st["steps"] = stop
      p = {k: plateau(v) for k, v in st["curves"].items()}
      st["checks"].append([stop, {k: v["moved"] for k, v in p.items()}])
      st["at_plateau"] = all(v["at_plateau"] for v in p.values())
      log(f"[{names[i]}] plateau check at step {stop}: " + ", ".join(
          f"{k} moved {v['moved']:.4f}" if v["moved"] is not None else f"{k} moved n/a"
          for k, v in p.items()) + (" (at plateau)" if st["at_plateau"] else ""))
    if after_check is not None:
      after_check(sts, stop)
  return [dict(st, cap=cap, check_every=check_every,
               stopped="plateau" if st["at_plateau"] else "cap") for st in sts]


def plateau_loop(st: dict, advance: Callable, *, recipe_steps: int, cap: int, check_every: int,
                 after_check: Callable | None = None, log=print, name="") -> dict:
  """plateau_arms_loop for one arm: `advance(start, stop)`, after_check(st, stop); returns st +
  {cap, check_every, stopped}."""
  return plateau_arms_loop(
      [st], lambda on, a, b: advance(a, b), recipe_steps=recipe_steps, cap=cap,
      check_every=check_every, log=log, names=[name],
      after_check=(lambda sts, stop: after_check(sts[0], stop)) if after_check else None)[0]


def train_to_plateau(cfg, params, tc, batch_fn, *, metrics, cap: int, check_every: int,
                     at_recipe_end: Callable | None = None, resume: dict | None = None,
                     save: Callable | None = None, budget_s: float | None = None, name="",
                     log=print, log_every=100):
  """Until-plateau training (issue 34's "every arm trained to a plateau"): the recipe's
  `tc.num_steps` steps (its warmup and decay, as `train` runs them), then on at the schedule's
  end lr (optax holds a decayed schedule at its end value) until `plateau(curve)` holds for
  EVERY metric of `metrics` or `cap` steps (`plateau_loop`: checked at tc.num_steps and every
  `check_every` steps after; `plateau`'s definition, not loosened: moved < 1% relative over the
  last 20% of the steps taken). `at_recipe_end(params)` (a JSON-able dict) is recorded at step
  tc.num_steps (the fixed-step recipe's result, beside the plateau's). resume / save / budget_s
  as `train_to_gate` (state saved after every check; past budget_s: Budget after saving).
  Returns (params, curves {metric: per-step values}, info {steps, cap, check_every, stopped:
  'plateau' | 'cap', at_plateau, checks [[step, {metric: moved}]], recipe_steps, recipe_end})."""
  import jax
  tx, step = _step_fn(cfg, tc, params)
  box = {}
  box["state"], st = _start(tx, params, resume, dict(
      curves={m: [] for m in metrics}, checks=[], steps=0, at_plateau=False, recipe_end=None))
  t0 = time.time()

  def advance(start, stop):
    box["state"] = _steps(step, box["state"], batch_fn, start, stop, metrics, st["curves"], name,
                          log, log_every, t0)

  def after_check(st, stop):
    if stop == tc.num_steps and at_recipe_end is not None:
      st["recipe_end"] = at_recipe_end(jax.device_get(box["state"].params))
    _after_check(lambda: dict(st, state=jax.device_get(box["state"])), save, budget_s, t0,
                 st["at_plateau"] or st["steps"] >= cap, name, stop)
  out = plateau_loop(st, advance, recipe_steps=tc.num_steps, cap=cap, check_every=check_every,
                     after_check=after_check, log=log, name=name)
  info = {k: out[k] for k in ("steps", "cap", "check_every", "stopped", "at_plateau", "checks",
                              "recipe_end")}
  return jax.device_get(box["state"].params), st["curves"], dict(info,
                                                                   recipe_steps=tc.num_steps)


@dataclasses.dataclass
class Arm:
  """One arm of `train_arms_to_plateau`: what `train_to_plateau` takes for one training. Arms
  whose `data` keys are equal read the same batches (batch_fn of the first, called once a
  step: e.g. an AHA window's lambda-sweep arms, or its static fine-tunes' lr sweep)."""
  name: str
  cfg: object                       # ModelConfig
  tc: dict                          # train_config(...)
  params: object
  batch_fn: Callable[[int], dict]   # step -> batch (a pure function of the step)
  metrics: tuple = ("accuracy",)
  data: object = None               # None: this arm's own batches
  at_recipe_end: Callable | None = None   # params -> JSON-able dict, recorded at the recipe's end


class BatchPool:
  """Training batches made ahead in worker processes: get(key, i) = fns[key](i), with the next
  `ahead` steps of that key already submitted to `workers` spawned processes (the functions
  must pickle, e.g. functools.partial(aha_repro.task_batch, task, n, stream)); workers=0: made
  here when asked. The same batches either way (a pure function of the step): the pool only
  moves the host's data generation off the training loop's thread. Use as a context manager."""

  def __init__(self, fns: dict, *, workers: int = 0, ahead: int = 8):
    self.fns, self.ahead, self._futures = fns, ahead, {}
    self._ex = None
    if workers > 0:
      import concurrent.futures
      import multiprocessing
      self._ex = concurrent.futures.ProcessPoolExecutor(
          workers, mp_context=multiprocessing.get_context("spawn"))

  def get(self, key, i: int):
    if self._ex is None:
      return self.fns[key](i)
    for j in range(i, i + self.ahead):
      if (key, j) not in self._futures:
        self._futures[(key, j)] = self._ex.submit(self.fns[key], j)
    return self._futures.pop((key, i)).result()

  def close(self):
    if self._ex is not None:
      for f in self._futures.values():
        f.cancel()
      self._ex.shutdown(wait=True, cancel_futures=True)
      self._ex = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _rng_free(cfg) -> bool:
  """The train step of `cfg` never draws from the step RNG (its seed then changes nothing):
  dense, or AHA in exact mode (the RNG feeds only sparse mode's forced-global draws)."""
  if cfg.scheme == "dense":
    return True
  if cfg.scheme == "aha":
    from condattn_jax.attention import options
    return options(cfg).mode == "exact"
  return False


def arm_groups(arms) -> list[list[int]]:
  """Indices of `arms` grouped into vmapped groups: one model config and train settings (the
  seed too, unless the step is RNG-free: then arms of every seed share a group), params of one
  shape; in first-appearance order."""
  import jax
  groups: dict = {}
  for i, a in enumerate(arms):
    tc = dict(a.tc) if _rng_free(a.cfg) else dict(a.tc, seed_group=a.tc["seed"])
    shape = jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype.str), a.params)
    groups.setdefault((_key(a.cfg, tc), repr(shape)), []).append(i)
  return list(groups.values())


_PROGRAMS: dict = {}


def _program(arms, groups):
  """(txs, program): program(states, batches, active) -> (states, metrics), one jitted call
  that runs every group's train step vmapped over its arms (group g: states[g] and batches[g]
  stacked on a leading arm axis, active[g] [k] bool); an inactive arm's state is returned
  unchanged (select: exact), its metrics are computed and ignored."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.train import optimizer as opt_lib
  from condattn_jax.train.step import make_train_step
  first = [arms[g[0]] for g in groups]
  key = tuple((_key(a.cfg, a.tc), a.metrics, len(g)) for a, g in zip(first, groups))
  if key not in _PROGRAMS:
    txs, steps = [], []
    for a in first:
      tx, labels, sched = opt_lib.make_optimizer(a.tc, a.params)
      txs.append(tx)
      steps.append(make_train_step(a.cfg, a.tc, tx, labels, sched))
    metrics = [a.metrics for a in first]

    def program(states, batches, active):
      out_s, out_m = [], []
      for step, st, b, on, names in zip(steps, states, batches, active, metrics):
        new, m = jax.vmap(step)(st, b)
        keep = lambda n, o: jnp.where(on.reshape(on.shape + (1,) * (n.ndim - 1)), n, o)
        out_s.append(jax.tree.map(keep, new, st))
        out_m.append({k: m[k] for k in names})
      return out_s, out_m
    _PROGRAMS[key] = (txs, jax.jit(program, donate_argnums=(0,)))
  return _PROGRAMS[key]


def train_arms_to_plateau(arms, *, cap: int, check_every: int, resume: dict | None = None,
                          save: Callable | None = None, budget_s: float | None = None,
                          workers: int = 0, ahead: int = 8, log=print, log_every=100,
                          name="arms"):
  """`train_to_plateau` for several arms in ONE jitted program a step (arm_groups: the arms of
  one config vmapped, the groups side by side in the program): each arm's numbers are those of
  its own training (to float tolerance: vmapped matmuls), its curves and checks
  `plateau_arms_loop`'s (every arm has the same recipe steps, so its checks fall on the same
  steps); an arm at plateau is masked (its state is no longer updated, its curves stop) while the
  others go on, until every arm is at plateau or the cap. resume / save / budget_s as
  train_to_plateau (saved after every check: every arm's progress and the stacked states, host
  arrays; a resumed run equals an uninterrupted one); an arm's at_recipe_end(params) is
  recorded at the recipe's end as train_to_plateau's. workers / ahead: the batches are made
  by a BatchPool of that many processes (0: in this loop; the same batches). Returns [(params,
  curves, info)] in `arms`' order (info as train_to_plateau's)."""
  import jax
  import jax.numpy as jnp
  recipe = {a.tc["num_steps"] for a in arms}
  if len(recipe) != 1:
    raise ValueError(f"{name}: arms of one program need one recipe length, got {sorted(recipe)}")
  recipe_steps = recipe.pop()
  groups = arm_groups(arms)
  txs, program = _program(arms, groups)
  if resume:
    sts = [dict(x) for x in resume["arms"]]
    box = {"states": [jax.tree.map(jnp.asarray, s) for s in resume["states"]]}
  else:
    sts = [dict(curves={m: [] for m in a.metrics}, checks=[], steps=0, at_plateau=False,
                recipe_end=None) for a in arms]
    box = {"states": []}
    for tx, g in zip(txs, groups):
      one = [_start(tx, arms[i].params, None, None)[0] for i in g]
      box["states"].append(jax.tree.map(lambda *x: jnp.stack([jnp.asarray(v) for v in x]), *one))
  data = [a.data if a.data is not None else ("arm", i) for i, a in enumerate(arms)]
  filler: dict = {}   # a masked arm's batch (its output is discarded): its step-0 batch
  t0 = time.time()

  def advance(on, start, stop):
    live = set(on)
    active = [np.asarray([i in live for i in g]) for g in groups]
    pending = []
    for j in range(start, stop):
      got: dict = {}
      for i in on:
        if data[i] not in got:
          got[data[i]] = box["pool"].get(data[i], j)
      for i in range(len(arms)):
        if i not in live and i not in filler:
          filler[i] = arms[i].batch_fn(0)
      batches = [jax.tree.map(lambda *x: np.stack(x), *[
          got[data[i]] if i in live else filler[i] for i in g]) for g in groups]
      box["states"], m = program(box["states"], batches, active)
      pending.append(m)
      if len(pending) == 50 or j + 1 == stop:
        for row in jax.device_get(pending):
          for g, mg in zip(groups, row):
            for r, i in enumerate(g):
              if i in live:
                for k in arms[i].metrics:
                  v = np.asarray(mg[k][r])
                  sts[i]["curves"][k].append(float(v) if v.ndim == 0 else v.tolist())
        pending = []
        if (j + 1) % log_every == 0 or j + 1 == stop:
          log(f"[{name}] step {j + 1}: {len(on)} of {len(arms)} arms training "
              f"({time.time() - t0:.0f}s)")

  def after_check(sts, stop):
    if stop == recipe_steps and any(a.at_recipe_end for a in arms):
      for i, p in arm_params(jax.device_get(box["states"])).items():
        if arms[i].at_recipe_end is not None:
          sts[i]["recipe_end"] = arms[i].at_recipe_end(p)
    _after_check(lambda: dict(arms=sts, states=jax.device_get(box["states"])), save, budget_s,
                 t0, all(st["at_plateau"] or st["steps"] >= cap for st in sts), name, stop)

  def arm_params(host) -> dict:
    """{arm index: its params} from the groups' stacked host states."""
    return {i: jax.tree.map(lambda x, r=r: x[r], st_g.params)
            for g, st_g in zip(groups, host) for r, i in enumerate(g)}
  fns = {}
  for i, a in enumerate(arms):
    fns.setdefault(data[i], a.batch_fn)
  with BatchPool(fns, workers=workers, ahead=ahead) as box["pool"]:
    outs = plateau_arms_loop(sts, advance, recipe_steps=recipe_steps, cap=cap,
                             check_every=check_every, after_check=after_check, log=log,
                             names=[a.name for a in arms])
  params = arm_params(jax.device_get(box["states"]))
  keys = ("steps", "cap", "check_every", "stopped", "at_plateau", "checks", "recipe_end")
  return [(params[i], sts[i]["curves"], dict({k: o[k] for k in keys}, recipe_steps=recipe_steps))
          for i, o in enumerate(outs)]


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


class Store:
  """One seed's unit results (and saved trees, e.g. the dense checkpoint) of a run: in memory (a
  whole run in one process) or in `work_dir` (one part a job: `<bench>_<preset>_s<seed>_<unit>
  .json` / `.pkl`, each result with the settings it ran under; a file of other settings is a
  ValueError naming it)."""

  def __init__(self, bench: str, preset: str, settings, seed: int, work_dir: str | None = None):
    self.bench, self.preset, self.seed, self.work_dir = bench, preset, seed, work_dir
    self.settings = _settings_json(settings)
    self.budget_s = None   # a gated dense training's wall-clock budget (--dense_budget_s)
    self._mem: dict = {}

  def path(self, unit: str, ext: str = "json") -> str:
    return os.path.join(self.work_dir, f"{self.bench}_{self.preset}_s{self.seed}_{unit}.{ext}")

  def _hint(self, unit):
    return (f"run `python -m bench.{self.bench} --preset={self.preset} --seeds={self.seed} "
            f"--part={unit} --work_dir={self.work_dir}` first")

  def has(self, unit: str) -> bool:
    if self.work_dir is None:
      return ("json", unit) in self._mem
    return os.path.exists(self.path(unit))

  def put(self, unit: str, result: dict, seconds: float) -> None:
    if self.work_dir is None:
      self._mem[("json", unit)] = dict(result=result, seconds=seconds)
      return
    import datetime
    import json
    import jax
    from bench import common
    os.makedirs(self.work_dir, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _atomic(self.path(unit), json.dumps(dict(settings=self.settings, seed=self.seed,
                                             unit=unit, seconds=round(seconds, 2),
                                             device=str(jax.devices()[0].device_kind),
                                             platform=jax.default_backend(),
                                             commit=common.git_commit(), date=date,
                                             result=result)).encode())

  def _read(self, unit: str) -> dict:
    if self.work_dir is None:
      if ("json", unit) not in self._mem:
        raise ValueError(f"seed {self.seed}: unit {unit!r} has not run")
      return self._mem[("json", unit)]
    import json
    path = self.path(unit)
    if not os.path.exists(path):
      raise ValueError(f"{path}: missing; {self._hint(unit)}")
    d = json.load(open(path))
    if d["settings"] != self.settings:
      raise ValueError(f"{path}: written under other settings than preset {self.preset!r} now; "
                       "remove it or use another --work_dir")
    return d

  def get(self, unit: str) -> dict:
    return self._read(unit)["result"]

  def seconds(self, unit: str) -> float:
    return float(self._read(unit)["seconds"])

  def put_tree(self, name: str, tree) -> None:
    """A tree of arrays: a model's params (nested dicts: msgpack, flax.serialization) or a
    training state (pickle: only a rerun on the same machine reads it)."""
    if self.work_dir is None:
      self._mem[("tree", name)] = tree
      return
    import json
    os.makedirs(self.work_dir, exist_ok=True)
    if _plain(tree):
      from flax import serialization
      _atomic(self.path(name, "msgpack"), serialization.msgpack_serialize(
          dict(settings=json.dumps(self.settings), tree=tree)))
    else:
      import pickle
      _atomic(self.path(name, "pkl"), pickle.dumps(dict(settings=self.settings, tree=tree)))

  def get_tree(self, name: str, missing_ok: bool = False):
    if self.work_dir is None:
      return self._mem.get(("tree", name)) if missing_ok else self._mem[("tree", name)]
    import json
    path = self.path(name, "msgpack")
    if os.path.exists(path):
      from flax import serialization
      with open(path, "rb") as f:
        d = serialization.msgpack_restore(f.read())
      d["settings"] = json.loads(d["settings"])
    elif os.path.exists(self.path(name, "pkl")):
      import pickle
      path = self.path(name, "pkl")
      with open(path, "rb") as f:
        d = pickle.load(f)
    elif missing_ok:
      return None
    else:
      raise ValueError(f"{path}: missing; {self._hint(name)}")
    if d["settings"] != self.settings:
      raise ValueError(f"{path}: written under other settings than preset {self.preset!r} now; "
                       "remove it or use another --work_dir")
    return d["tree"]


def _plain(tree) -> bool:
  """Nested dicts of numpy arrays (what msgpack restores as it was saved)."""
  if isinstance(tree, dict):
    return all(isinstance(k, str) and _plain(v) for k, v in tree.items())
  return isinstance(tree, np.ndarray)


# Settings fields added after stores were written (committed fixtures, earlier calls' units):
# left out of a store's settings while they hold their empty default, so those stores match
OPTIONAL_FIELDS = ("dense_lrs",)


def _settings_json(settings) -> dict:
  """The settings a store's files carry: without OPTIONAL_FIELDS while empty, nor the fields a
  Settings class names in its STORE_DEFAULTS ({field: value}) while at that value (fields added
  after its committed fixtures / work dirs were written, e.g. AHA's dense gate)."""
  import json
  d = json.loads(json.dumps(dataclasses.asdict(settings)))
  late = json.loads(json.dumps(getattr(type(settings), "STORE_DEFAULTS", {})))
  return {k: v for k, v in d.items() if not (k in OPTIONAL_FIELDS and v == [])
          and not (k in late and v == late[k])}


def _atomic(path: str, data: bytes) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class Bench:
  """What a repro bench gives the part runner: units(s, seed) (the seed's unit names, 'dense'
  first), run_unit(s, seed, unit, store, log) -> a JSON-able result (reads the units it needs
  from `store`), assemble(s, seed, store) -> the seed's record (what run() / summarize read)."""
  name: str
  units: Callable
  run_unit: Callable
  assemble: Callable


def run_units(b: Bench, s, seed: int, store: Store, units=None, log=print) -> None:
  """Run `units` (default: all of the seed's, in order) into `store`, skipping those already
  stored (a rerun of a part after a timeout goes on where it stopped)."""
  known = b.units(s, seed)
  for u in units or known:
    if u not in known:
      raise ValueError(f"--part: unit {u!r} is not one of seed {seed}'s units {known}")
    if store.has(u):
      log(f"[s{seed} {u}] done already ({store.path(u) if store.work_dir else 'memory'})")
      continue
    t0 = time.time()
    res = b.run_unit(s, seed, u, store, log)
    store.put(u, res, time.time() - t0)
    log(f"[s{seed} {u}] {time.time() - t0:.1f} s")


def run_seeds(b: Bench, s, preset: str, log=print) -> list[dict]:
  """Every seed of `s`, every unit, in memory: the seeds' records."""
  out = []
  for seed in s.seeds:
    store = Store(b.name, preset, s, seed)
    run_units(b, s, seed, store, log=log)
    out.append(b.assemble(s, seed, store))
  return out


def merged_parts(b: Bench, s, preset: str, work_dir: str) -> tuple[list[dict], dict, dict]:
  """(seeds' records, {seed: {unit: seconds}}, provenance) assembled from the part files in
  `work_dir`; ValueError naming the first missing file and the part command that writes it.
  provenance = {device, platform: those of the units that ran the most seconds (a seed NOT
  JUDGED at its dense gate leaves its other units empty, returned at once wherever the merge
  runs), ties by unit count; devices {device: units}; commits (sorted,
  of the units that record one); first_date / last_date (ISO, units that record one)}: units of
  one run may come from several calls on different cards (an x2 call that came as H200)."""
  seeds, secs, where, busy, commits, dates = [], {}, {}, {}, set(), []
  for seed in s.seeds:
    store = Store(b.name, preset, s, seed, work_dir)
    secs[str(seed)] = {u: store.seconds(u) for u in b.units(s, seed)}
    for u in b.units(s, seed):
      d = store._read(u)
      key = (d.get("device"), d.get("platform"))
      where[key] = where.get(key, 0) + 1
      busy[key] = busy.get(key, 0.0) + secs[str(seed)][u]
      if d.get("commit"):
        commits.add(d["commit"])
      if d.get("date"):
        dates.append(d["date"])
    seeds.append(b.assemble(s, seed, store))
  (device, platform) = max(where, key=lambda k: (busy[k], where[k], str(k)))
  prov = dict(device=device, platform=platform,
              devices={str(k[0]): n for k, n in sorted(where.items(), key=str)},
              commits=sorted(commits), first_date=min(dates) if dates else None,
              last_date=max(dates) if dates else None)
  return seeds, secs, prov


def define_flags(flag_values, presets, doc: str):
  """The two repro benches' flags: --preset (names from `presets`, `doc` for the page of its H100
  command) and --seeds (override the preset's seeds)."""
  from absl import flags
  flags.DEFINE_string("preset", "cpu", f"one of {sorted(presets)}: cpu (recorded), ci "
                      f"(tests/bench), h100 (one H100, {doc}), test (seconds)",
                      flag_values=flag_values)
  flags.DEFINE_list("seeds", None, "override the preset's seeds (e.g. 0: one seed a command on a "
                    "slow machine; the run is then named <preset>_seeds<list>)",
                    flag_values=flag_values)
  flags.DEFINE_list("merge", None, "result files of one-seed runs of --preset (--seeds=N each, e.g. "
                    "one per GPU): judge them together as one run named <preset>, no training",
                    flag_values=flag_values)
  flags.DEFINE_list("part", None, "run only these units of --seeds (default: the preset's "
                    "seeds) into --work_dir, e.g. dense, then the arms that reuse its checkpoint "
                    "(`--part=list` prints every seed's units); no result file: --merge_parts "
                    "judges them", flag_values=flag_values)
  flags.DEFINE_string("work_dir", None, "--part: directory of the dense checkpoints and unit "
                      "results (<bench>_<preset>_s<seed>_<unit>.json / .pkl)",
                      flag_values=flag_values)
  flags.DEFINE_string("merge_parts", None, "a --work_dir whose parts cover every unit of every "
                      "seed of --preset: assemble and judge them as one run named <preset> (no "
                      "training; with --part, after it)", flag_values=flag_values)
  flags.DEFINE_float("dense_budget_s", None, "--part: a gated dense training (Elastic) stops "
                     "after this many seconds at its next check, saves its state and exits 3; "
                     "the same command goes on from there", flag_values=flag_values)


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


def main(bench: str, flag_values, presets, files, run, argv=None, parts: Bench | None = None):
  """Parse the flags, run the preset (seeds overridden by --seeds, the run named after them; or
  --merge: judge one-seed runs together; or --part: run some units into --work_dir; or
  --merge_parts: judge a --work_dir's units as one run), append it to
  bench/results/<bench>.json (or --out_dir) and return the result. `run(settings, done=None)`
  trains every seed of the settings, or, given `done` (the per-seed results), only judges them."""
  from bench import common
  a = common.parse_flags(flag_values, argv)
  if a.preset not in presets:
    raise ValueError(f"--preset={a.preset!r}: choose one of {sorted(presets)}")
  s, name = presets[a.preset], a.preset
  if a.part:
    if a.part == ["list"]:
      units = {seed: parts.units(s, seed) for seed in s.seeds}
      for seed, u in units.items():
        print(f"seed {seed}: {','.join(u)}")
      return units
    if not a.work_dir:
      raise ValueError("--part needs --work_dir (where the dense checkpoints and units live)")
    seeds = [int(x) for x in a.seeds] if a.seeds else list(s.seeds)
    bad = [x for x in seeds if x not in s.seeds]
    if bad:
      raise ValueError(f"--seeds={bad}: not seeds of preset {a.preset!r} {tuple(s.seeds)}")
    t0 = time.time()
    for seed in seeds:
      store = Store(bench, a.preset, s, seed, a.work_dir)
      store.budget_s = a.dense_budget_s
      try:
        run_units(parts, s, seed, store, a.part)
      except Budget as e:
        print(f"BUDGET: {e}")
        raise SystemExit(3)
    print(f"part {','.join(a.part)} of seeds {seeds}: {time.time() - t0:.1f} s")
    if not a.merge_parts:
      return dict(part=a.part, seeds=seeds, seconds=time.time() - t0)
  if a.merge_parts:   # judged here (e.g. on a CPU), recorded as run where the units ran
    done, secs, prov = merged_parts(parts, s, a.preset, a.merge_parts)
    device = prov["device"]
    res = run(s, done=done)
    res["unit_seconds"] = secs
    res["seconds"] = round(sum(v for d in secs.values() for v in d.values()), 1)
    res["merged_from"] = a.merge_parts
    res["device"], res["platform"], res["preset"] = device, prov["platform"], name
    res["units_ran"] = prov   # devices, commits and dates of the units (the run: the merge's)
    out = common.result_path(bench, a.out_dir, device=device, fixed=files.get(name))
    r = common.make_run(bench, res, name=name)
    r["device"] = device
    common.append_run(out, r)
    print(f"wrote {out}")
    return res
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
