"""The training run: build -> init (random or HF + scheme.from_dense) or resume -> steps -> eval.

  from condattn_jax.train import loop
  final = loop.run(config, workdir)            # dict: step, train metrics of the last log, eval
  report = loop.dry_run(config)                # AOT-compile the sharded step, sizes + memory
  results = loop.evaluate_checkpoint(config, workdir_or_checkpoint)

What `run` does, in order:
  1. validate the config; mesh (data, fsdp, tensor) over all devices;
  2. abstract params (`jax.eval_shape` of Decoder.init, logical-axis boxes) -> shardings by the
     rules table; optimizer (trainable mask, groups) -> its state's shardings;
  3. `jax.jit(train_step, in_shardings, out_shardings, donate_argnums=0)`;
  4. latest checkpoint in <workdir>/checkpoints ? restore params, optimizer and data iterator
     state : init (random from train.seed, or model.init_from -> scheme.from_dense);
  5. loop: per-process batches -> global arrays -> step. Every step's loss is checked one step
     later (no pipeline stall); a NaN / inf stops the run with NonFiniteLossError before that
     state can be saved, so the last checkpoint stays good. Checkpoints every
     train.checkpoint_every steps, at the end, and on SIGTERM (preemption) before returning;
  6. metrics: <workdir>/metrics.jsonl + TensorBoard <workdir>/tb + console progress bar;
  7. eval (config.eval) at the end: <workdir>/eval/eval_step<N>.{json,md}.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.attention import get_scheme
from condattn_jax.data import batch_spec, data_shard_for_sharding, make_global_batch, make_train_iterator
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder
from condattn_jax.train import config as config_lib
from condattn_jax.train import metrics as metrics_lib
from condattn_jax.train import optimizer as opt_lib
from condattn_jax.train import sharding as shd
from condattn_jax.train.state import TrainState
from condattn_jax.train.step import make_train_step


class NonFiniteLossError(RuntimeError):
  """The loss (or gradient norm) became NaN / inf; the run stopped without saving that state."""


@dataclasses.dataclass
class Setup:
  """Everything about a run that does not depend on array values."""
  config: Any
  mesh: jax.sharding.Mesh
  model_cfg: ModelConfig
  boxed_params: Any  # abstract params with logical-axis boxes
  abstract_params: Any  # unboxed ShapeDtypeStructs
  param_shardings: Any
  tx: Any
  labels: Any
  schedule: Any
  abstract_state: TrainState  # ShapeDtypeStructs with shardings
  state_shardings: TrainState
  batch_sharding: Any
  batch_abstract: dict  # global batch ShapeDtypeStructs with shardings

  @property
  def global_batch(self) -> int:
    return int(self.config.data.batch_size)

  @property
  def seq_len(self) -> int:
    return int(self.config.data.seq_len)


def _init_shape(config) -> tuple[int, int]:
  return (1, min(int(config.data.seq_len), 256))


def build(config, *, devices=None) -> Setup:
  """Mesh, model config, shardings, optimizer: no weights touched (init_from reads config.json)."""
  config_lib.validate_config(config)
  mesh = shd.make_mesh(config.mesh, devices)
  model_cfg, _ = config_lib.model_config(config, load_weights=False)
  B, T = int(config.data.batch_size), int(config.data.seq_len)
  if B % shd.batch_shards(mesh):
    raise ValueError(f"config.data.batch_size={B} (global) must be divisible by mesh "
                     f"data*fsdp={shd.batch_shards(mesh)} (mesh {dict(mesh.shape)}).")
  if (B // int(config.train.microbatches)) % shd.batch_shards(mesh):
    raise ValueError(f"a microbatch of data.batch_size/train.microbatches="
                     f"{B // int(config.train.microbatches)} rows must be divisible by mesh "
                     f"data*fsdp={shd.batch_shards(mesh)}.")
  model = Decoder(model_cfg)
  tok = jax.ShapeDtypeStruct(_init_shape(config), jnp.int32)
  with shd.init_context():
    boxed = jax.eval_shape(lambda t: model.init({"params": jax.random.key(0),
                                                 "router": jax.random.key(1)}, t), tok)["params"]
  abstract_params = nn.meta.unbox(boxed)
  param_sh = shd.param_shardings(boxed, mesh)
  tx, labels, schedule = opt_lib.make_optimizer(config.train, abstract_params)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  opt_sh = shd.opt_state_shardings(abstract_opt, param_sh, abstract_params, mesh)
  rep = shd.replicated(mesh)
  state_sh = TrainState(step=rep, params=param_sh, opt_state=opt_sh)
  abstract_state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                              opt_state=abstract_opt)
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract_state, state_sh)
  bsh = shd.batch_sharding(mesh)
  babs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh)
          for k, v in batch_spec(config).items()}
  return Setup(config=config, mesh=mesh, model_cfg=model_cfg, boxed_params=boxed,
               abstract_params=abstract_params, param_shardings=param_sh, tx=tx, labels=labels,
               schedule=schedule, abstract_state=abstract_state, state_shardings=state_sh,
               batch_sharding=bsh, batch_abstract=babs)


def jit_train_step(setup: Setup):
  fn = make_train_step(setup.model_cfg, setup.config.train, setup.tx, setup.labels, setup.schedule)
  bsh = {k: setup.batch_sharding for k in setup.batch_abstract}
  return jax.jit(fn, in_shardings=(setup.state_shardings, bsh),
                 out_shardings=(setup.state_shardings, shd.replicated(setup.mesh)),
                 donate_argnums=(0,))


# ------------------------------------------------------------------------------------ init
def _paths_shapes(tree) -> dict[str, tuple]:
  return {opt_lib.path_str(p): tuple(np.shape(x)) for p, x in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def load_initial_params(setup: Setup):
  """Dense HF weights (model.init_from) -> scheme.from_dense -> sharded params."""
  from condattn_jax import convert
  path = setup.config.model.init_from
  _, dense = convert.load_hf_checkpoint(path, dtype=setup.model_cfg.param_dtype)
  params = get_scheme(setup.model_cfg.scheme).from_dense(dense, setup.model_cfg)
  params = convert.unbox(params)
  want, got = _paths_shapes(setup.abstract_params), _paths_shapes(params)
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  bad = [f"{k}: {got[k]} vs {want[k]}" for k in sorted(set(want) & set(got)) if got[k] != want[k]]
  if missing or extra or bad:
    raise ValueError(f"model.init_from={path!r} after scheme {setup.model_cfg.scheme!r}.from_dense "
                     f"does not match the model: missing {missing[:8]}, unexpected {extra[:8]}, "
                     f"shape mismatches {bad[:8]}.")
  params = jax.tree.map(lambda x, a: np.asarray(x).astype(a.dtype), params, setup.abstract_params)
  return shd.shard_host_tree(params, setup.param_shardings)


def init_params(setup: Setup):
  """Step-0 params: random (key(train.seed)) or model.init_from converted by the scheme."""
  if setup.config.model.get("init_from"):
    return load_initial_params(setup)
  model = Decoder(setup.model_cfg)
  seed = int(setup.config.train.seed)
  tok = jnp.zeros(_init_shape(setup.config), jnp.int32)
  init = lambda: nn.meta.unbox(model.init({"params": jax.random.key(seed),
                                           "router": jax.random.key(seed + 1)}, tok)["params"])
  with shd.init_context():
    return jax.jit(init, out_shardings=setup.param_shardings)()


def init_state(setup: Setup) -> TrainState:
  """Step-0 state: `init_params` and a fresh optimizer state."""
  params = init_params(setup)
  with shd.mesh_context(setup.mesh):
    opt_state = jax.jit(setup.tx.init, in_shardings=(setup.param_shardings,),
                        out_shardings=setup.state_shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), setup.state_shardings.step)
  return TrainState(step=step, params=params, opt_state=opt_state)


# --------------------------------------------------------------------------------- dry run
def _fmt_bytes(n: float) -> str:
  for unit in ("TiB", "GiB", "MiB", "KiB"):
    d = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
    if n >= d:
      return f"{n / d:.2f} {unit}"
  return f"{int(n)} B"


def dry_run(config, *, devices=None, print_fn=print) -> dict[str, Any]:
  """Builds the mesh, shapes and the sharded train step, AOT lowers + compiles it and reports
  parameter counts and the compiler's per-device memory estimate. Allocates nothing big."""
  t0 = time.time()
  setup = build(config, devices=devices)
  step_fn = jit_train_step(setup)
  with shd.mesh_context(setup.mesh):
    lowered = step_fn.lower(setup.abstract_state, setup.batch_abstract)
    compiled = lowered.compile()
  counts = opt_lib.count_params(setup.abstract_params, setup.labels)
  mem = compiled.memory_analysis()
  report: dict[str, Any] = dict(mesh=dict(setup.mesh.shape), devices=setup.mesh.devices.size,
                                params=counts, model=dataclasses.asdict(setup.model_cfg),
                                global_batch=setup.global_batch, seq_len=setup.seq_len)
  if mem is not None:
    m = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                          "alias_size_in_bytes", "temp_size_in_bytes",
                                          "generated_code_size_in_bytes") if hasattr(mem, k)}
    m["peak_estimate_bytes"] = (m.get("argument_size_in_bytes", 0) + m.get("output_size_in_bytes", 0)
                                - m.get("alias_size_in_bytes", 0) + m.get("temp_size_in_bytes", 0))
    report["memory_per_device"] = m
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and "flops" in cost:
      report["flops_per_device"] = float(cost["flops"])
  except Exception:  # cost analysis is best effort on some backends
    pass
  report["compile_seconds"] = time.time() - t0
  if print_fn is not None:
    print_fn(format_dry_run(report))
  return report


def format_dry_run(r: dict) -> str:
  p = r["params"]
  lines = [f"dry run: mesh {r['mesh']} over {r['devices']} devices; global batch "
           f"{r['global_batch']} x seq_len {r['seq_len']}; model {r['model']['family']} / scheme "
           f"{r['model']['scheme']}",
           f"  params: total {p['total']:,}  trainable {p.get('trainable', p['total']):,}  "
           f"frozen {p.get('frozen', 0):,}"]
  for k, v in p.items():
    if k not in ("total", "trainable", "frozen", "default"):
      lines.append(f"    group {k}: {v:,}")
  m = r.get("memory_per_device")
  if m:
    lines.append("  compiler memory estimate per device: " + ", ".join(
        f"{k.replace('_size_in_bytes', '')} {_fmt_bytes(v)}" for k, v in m.items()
        if k != "peak_estimate_bytes") + f"; peak ~ {_fmt_bytes(m['peak_estimate_bytes'])}")
  if "flops_per_device" in r:
    lines.append(f"  flops per step per device: {r['flops_per_device']:.3e}")
  lines.append(f"  lower + compile: {r['compile_seconds']:.1f}s")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ preemption
class _Preemption:
  """SIGTERM -> a flag checked at step boundaries (single process). With jax.distributed, the
  coordination service's preemption sync point is used instead (all hosts stop at one step)."""

  def __init__(self, install: bool):
    self.flag = False
    self._old = None
    if install and threading.current_thread() is threading.main_thread():
      self._old = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self.flag = True
    logging.warning("SIGTERM: will save a checkpoint after this step and stop.")

  def restore(self):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)
      self._old = None


# ---------------------------------------------------------------------------------- helpers
def _meta(setup: Setup, shard_count: int) -> dict:
  return dict(config=json.loads(setup.config.to_json_best_effort()),
              model_config=dataclasses.asdict(setup.model_cfg), mesh=dict(setup.mesh.shape),
              process_count=jax.process_count(), data_shard_count=shard_count)


def _host_metrics(m) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in jax.device_get(m).items()}


def _check_finite(step: int, m: dict, ckpt: ckpt_lib.Checkpointer | None):
  bad = {k: float(np.asarray(m[k]).reshape(-1)[0]) for k in ("loss", "grad_norm")
         if k in m and not np.all(np.isfinite(m[k]))}
  if bad:
    last = None
    if ckpt is not None:
      ckpt.wait()
      last = ckpt.latest_step()
    where = (f"the last good checkpoint is step {last} in {ckpt.directory} (untouched)"
             if last is not None else "no checkpoint was written")
    raise NonFiniteLossError(
        f"non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}: stopping "
        f"the run; {where}. Lower train.lr, raise train.warmup_frac, check the data, or use a "
        "float32 model.dtype to find the cause.")


class _Accumulator:
  def __init__(self):
    self.sums: dict[str, np.ndarray] = {}
    self.n = 0

  def add(self, m: dict):
    for k, v in m.items():
      self.sums[k] = self.sums.get(k, 0.0) + np.asarray(v, np.float64)
    self.n += 1

  def mean(self) -> dict:
    out = {k: v / max(self.n, 1) for k, v in self.sums.items()}
    if "tokens" in self.sums:
      out["tokens"] = self.sums["tokens"]
    return out


# -------------------------------------------------------------------------------------- run
def run(config, workdir: str, *, stop_after: int | None = None,
        on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
  """Trains to `config.train.num_steps` (resuming from <workdir>/checkpoints if present).

  stop_after: stop (with a checkpoint) after this many steps in THIS call, as a preemption
    would; the next call resumes. on_step(step, host_metrics) is called after each step's
    metrics reach the host (one step late). Returns {'step', 'train': last logged means,
    'eval': eval results at the end or None, 'eval_start': at step 0 (eval.at_start) or None,
    'stopped_early': bool, 'dry_run': report or None}.
  """
  if config.train.dry_run:
    return dict(step=0, train={}, eval=None, stopped_early=True, dry_run=dry_run(config))
  setup = build(config)
  tc = config.train
  is_host0 = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if is_host0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  B, T = setup.global_batch, setup.seq_len
  shard_index, shard_count = data_shard_for_sharding(setup.batch_sharding, (B, T))
  data_it = make_train_iterator(config, process_index=shard_index, process_count=shard_count)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=int(tc.keep_checkpoints))
  train_step = jit_train_step(setup)

  latest = ckpt.latest_step()
  if latest is not None:
    logging.info("resuming from %s/%d", ckpt.directory, latest)
    state = ckpt.restore_state(setup.abstract_state, latest)
    data_it.set_state(ckpt.restore_data_state(latest, shard_index, shard_count))
  else:
    state = init_state(setup)
  start = int(jax.device_get(state.step))
  total = int(tc.num_steps)
  meta = _meta(setup, shard_count)

  counts = opt_lib.count_params(setup.abstract_params, setup.labels)
  if is_host0:
    logging.info("mesh %s, params %s, global batch %d x %d, steps %d -> %d", dict(setup.mesh.shape),
                 counts, B, T, start, total)
  writer = metrics_lib.MetricWriter(workdir, enabled=is_host0)
  bar = metrics_lib.ProgressBar(total, start, enabled=is_host0 and bool(tc.progress_bar))
  multiproc = jax.process_count() > 1
  preempt = _Preemption(install=not multiproc)
  result: dict[str, Any] = dict(step=start, train={}, eval=None, eval_start=None,
                                stopped_early=False, dry_run=None)
  acc = _Accumulator()
  t_log, steps_since_log = time.time(), 0
  last_saved = latest
  pending = None

  def process(p):
    nonlocal t_log, steps_since_log
    s, m = p
    m = _host_metrics(m)
    _check_finite(s, m, ckpt)
    acc.add(m)
    if on_step is not None:
      on_step(s, m)
    if s % int(tc.log_every) == 0 or s == total:
      dt = max(time.time() - t_log, 1e-9)
      means = acc.mean()
      means["tokens_per_s"] = steps_since_log * B * T / dt
      means["steps_per_s"] = steps_since_log / dt
      writer.write(s, means, prefix="train/")
      bar.update(s, float(means["loss"]), means["tokens_per_s"],
                 {"acc": float(means["accuracy"])})
      result["train"] = metrics_lib.to_python(means)
      acc.__init__()
      t_log, steps_since_log = time.time(), 0

  def save(s):
    nonlocal last_saved
    if last_saved == s:
      return
    ckpt.save(s, state, data_it.get_state(), meta)
    last_saved = s

  with shd.mesh_context(setup.mesh):
    try:
      if config.eval.get("at_start") and start == 0:
        result["eval_start"] = _run_eval(config, setup, state, 0, workdir, writer, is_host0)
      step = start
      while step < total:
        batch = make_global_batch(next(data_it), setup.batch_sharding, B)
        state, m = train_step(state, batch)
        step += 1
        steps_since_log += 1
        if pending is not None:
          process(pending)
        pending = (step, m)
        reason = ("SIGTERM" if preempt.flag else
                  "preemption" if multiproc and ckpt.mgr.reached_preemption(step) else
                  "stop_after" if stop_after is not None and step - start >= stop_after else None)
        stop = reason is not None
        periodic = int(tc.checkpoint_every) and step % int(tc.checkpoint_every) == 0
        evaluate_now = int(tc.eval_every) and step % int(tc.eval_every) == 0 and step < total
        if periodic or stop or step == total or evaluate_now:
          process(pending)
          pending = None
        if periodic or stop or step == total:
          save(step)
        if evaluate_now:
          _run_eval(config, setup, state, step, workdir, writer, is_host0)
        if stop:
          result["stopped_early"] = step < total
          logging.warning("stopping at step %d (%s); checkpoint saved.", step, reason)
          break
      if pending is not None:
        process(pending)
      result["step"] = step
      ckpt.wait()
      if step == total and not result["stopped_early"] and config.eval.get("at_end", True):
        result["eval"] = _run_eval(config, setup, state, step, workdir, writer, is_host0)
    finally:
      preempt.restore()
      bar.close()
      writer.close()
      ckpt.close()
  return result


def _run_eval(config, setup: Setup, state, step, workdir, writer, is_host0):
  from condattn_jax import evaluation
  res = evaluation.evaluate(config, state.params, setup.model_cfg, setup.mesh, step=int(step),
                            param_shardings=setup.param_shardings)
  writer.write(int(step), evaluation.flat_metrics(res), prefix="eval/")
  if is_host0:
    _, md = evaluation.write_results(res, os.path.join(workdir, "eval"))
    logging.info("eval at step %d:\n%s", step, open(md).read())
  return res


# ------------------------------------------------------------------------------------- eval
def load_params(config, path: str, *, step: int | None = None, devices=None):
  """(setup, params, step) from a workdir / checkpoints dir / step dir, into this config's mesh."""
  directory, step_from_path = ckpt_lib.resolve_checkpoint_path(path)
  step = step if step is not None else step_from_path
  setup = build(config, devices=devices)
  ck = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    step = ck._require(step)
    with shd.mesh_context(setup.mesh):
      params = ck.restore_params(jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
          setup.abstract_params, setup.param_shardings), step)
  finally:
    ck.close()
  return setup, params, step


def config_from_checkpoint(path: str, step: int | None = None):
  """The run config saved with a checkpoint (for eval without --config)."""
  import ml_collections
  directory, step_from_path = ckpt_lib.resolve_checkpoint_path(path)
  ck = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    meta = ck.restore_meta(step if step is not None else step_from_path)
  finally:
    ck.close()
  base = config_lib.default_config()
  saved = ml_collections.ConfigDict(meta["config"])
  _merge(base, saved)
  return base


def _merge(base, new):
  import ml_collections
  for k in new.keys():
    v = new[k]
    if isinstance(v, ml_collections.ConfigDict) and k in base and isinstance(
        base[k], ml_collections.ConfigDict):
      _merge(base[k], v)
    else:
      with base.unlocked():
        if isinstance(v, list):
          v = tuple(v)
        if k in base and base[k] is not None and v is not None and not isinstance(
            base[k], ml_collections.ConfigDict):
          v = type(base[k])(v) if isinstance(base[k], (int, float, str, bool, tuple)) else v
        base[k] = v


def evaluate_checkpoint(config, path: str | None = None, *, step: int | None = None,
                        out_dir: str | None = None, devices=None) -> dict[str, Any]:
  """Evaluates a checkpoint (`path`: workdir / checkpoints dir / step dir) or, with path=None,
  the initial params (random, or model.init_from converted by the scheme). Writes
  <out_dir>/eval_step<N>.{json,md} when out_dir is given."""
  from condattn_jax import evaluation
  if path is None:
    setup = build(config, devices=devices)
    params = init_params(setup)
    step = 0
  else:
    setup, params, step = load_params(config, path, step=step, devices=devices)
  res = evaluation.evaluate(config, params, setup.model_cfg, setup.mesh, step=int(step),
                            param_shardings=setup.param_shardings)
  if out_dir is not None and jax.process_index() == 0:
    evaluation.write_results(res, out_dir)
  return res
