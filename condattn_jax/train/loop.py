"""The training run: build -> init (random or HF + scheme.from_dense) or resume -> steps -> eval.

  from condattn_jax.train import loop
  final = loop.run(config, workdir)            # dict: step, train metrics of the last log, eval
  report = loop.dry_run(config)                # AOT-compile the sharded step: model, per-device
                                               # memory (labelled), verdict (train.dry_run_device)
  results = loop.evaluate_checkpoint(config, workdir_or_checkpoint)

What `run` does, in order:
  1. validate the config (every check that can fail before the first step); lock the workdir
     (<workdir>/run.lock: one run per workdir); mesh (data, fsdp, tensor) over all devices (or
     run(devices=...)),
     the default mesh / microbatches / eval batch derived where the batch does not divide it
     (sharding.derive_layout, logged);
  2. abstract params (`jax.eval_shape` of Decoder.init, logical-axis boxes) -> shardings by the
     rules table; optimizer (trainable mask, groups) -> its state's shardings;
  3. `jax.jit(train_step, in_shardings, out_shardings, donate_argnums=0)`;
  4. latest readable checkpoint in <workdir>/checkpoints ? restore params, optimizer and data
     iterator state (corrupt steps skipped with a warning) : init (random from train.seed, or
     model.init_from -> scheme.from_dense); then <workdir>/config.json is written;
  5. loop: per-process batches -> global arrays -> step. A NaN / inf loss or grad norm drops
     that step's update inside the jitted step (guards.skip_nonfinite); the host checks every
     step one step later (no pipeline stall) and stops the run with NonFiniteLossError before
     that state can be saved; a checkpoint written just before, whose params produced the NaN,
     is set aside (<step>.nonfinite). Checkpoints every train.checkpoint_every steps, at the end,
     and on SIGTERM / Ctrl-C (a second Ctrl-C exits at once) before returning;
  6. metrics: <workdir>/metrics.jsonl + TensorBoard <workdir>/tb + console progress bar;
  7. eval (config.eval) at the end: <workdir>/eval/eval_step<N>.{json,md}.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
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
from condattn_jax.parallel import context
from condattn_jax.train import config as config_lib
from condattn_jax.train import guards
from condattn_jax.train import metrics as metrics_lib
from condattn_jax.train import optimizer as opt_lib
from condattn_jax.train import sharding as shd
from condattn_jax.train import workdir as workdir_lib
from condattn_jax.train.state import TrainState
from condattn_jax.train.step import make_train_step


NonFiniteLossError = guards.NonFiniteLossError  # raised by run(); train.py exits with code 3


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
  layout_notes: tuple = ()  # what shd.derive_layout changed in `config` for this mesh

  @property
  def global_batch(self) -> int:
    return int(self.config.data.batch_size)

  @property
  def seq_len(self) -> int:
    return int(self.config.data.seq_len)

  def mesh_context(self):
    """shd.mesh_context of this setup's mesh, with config.mesh.sequence_attention."""
    return shd.mesh_context(
        self.mesh, sequence_attention=str(self.config.mesh.get("sequence_attention", "all_gather")))


def _init_shape(config) -> tuple[int, int]:
  return (1, min(int(config.data.seq_len), 256))


def build(config, *, devices=None, needs_data: bool = False) -> Setup:
  """Mesh, model config, shardings, optimizer: no weights touched (init_from reads config.json
  only, so a directory holding just config.json describes a model). Where the batch does not
  divide the mesh, the mesh / microbatches / eval batch are derived (shd.derive_layout; logged,
  in `Setup.layout_notes`) and `Setup.config` is the derived config: use it, not the input.
  Checks the config against the mesh and the model (divisibility, the synthetic task's token
  ids vs vocab_size); needs_data=True also requires the data fields (validate_config)."""
  config_lib.validate_config(config, needs_data=needs_data)
  model_cfg, _ = config_lib.model_config(config, load_weights=False)
  n_devices = len(jax.devices() if devices is None else devices)
  config, layout_notes = shd.derive_layout(config, n_devices, num_heads=model_cfg.num_heads,
                                           num_kv_heads=model_cfg.num_kv_heads)
  for note in layout_notes:
    logging.warning("layout: %s", note)
  mesh = shd.make_mesh(config.mesh, devices)
  from condattn_jax.data import check_vocab, parse_data_config
  check_vocab(parse_data_config(config.data, needs_files=False), model_cfg.vocab_size)
  shd.check_batch_layout(config, mesh.shape["data"], mesh.shape["fsdp"])
  context.check_config(config, mesh.shape["sequence"])  # sequence = -1 resolved by the mesh
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
               batch_sharding=bsh, batch_abstract=babs, layout_notes=tuple(layout_notes))


def jit_train_step(setup: Setup):
  """The sharded, donating train step; a non-finite loss / grad norm leaves the state unchanged
  (guards.skip_nonfinite)."""
  fn = guards.skip_nonfinite(
      make_train_step(setup.model_cfg, setup.config.train, setup.tx, setup.labels, setup.schedule))
  bsh = {k: setup.batch_sharding for k in setup.batch_abstract}
  return jax.jit(fn, in_shardings=(setup.state_shardings, bsh),
                 out_shardings=(setup.state_shardings, shd.replicated(setup.mesh)),
                 donate_argnums=(0,))


_EXPORT_DEVICES = {
    "tpu": ("TPU v5 lite", "tpu"),
    "cuda": ("NVIDIA H100 80GB HBM3", "cuda"),
}


def export_train_step(setup: Setup, platform: str = "tpu", device_kind: str | None = None):
  """The sharded train step (`jit_train_step`) exported for `platform` from any host:
  `jax.export.Exported` whose module holds the kernels `ops` picks for that platform (Mosaic TPU
  on 'tpu'), not the ones of this host. The step's shardings are moved onto an AbstractMesh with
  an abstract device of `platform` (same axes and sizes as `setup.mesh`), which is how `ops`
  learns which platform's kernels it may trace here (cross-lowering)."""
  from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding
  if platform not in _EXPORT_DEVICES:
    raise ValueError(f"export_train_step: platform {platform!r} is not one of "
                     f"{sorted(_EXPORT_DEVICES)}")
  kind, plat = _EXPORT_DEVICES[platform]
  dev = AbstractDevice(device_kind=device_kind or kind, num_cores=None, platform=plat)
  mesh = AbstractMesh(tuple(setup.mesh.axis_sizes), tuple(setup.mesh.axis_names),
                      axis_types=tuple(setup.mesh.axis_types), abstract_device=dev)
  move = lambda s: NamedSharding(mesh, s.spec)
  state_sh = jax.tree.map(move, setup.state_shardings)
  batch_sh = {k: move(setup.batch_sharding) for k in setup.batch_abstract}
  fn = guards.skip_nonfinite(
      make_train_step(setup.model_cfg, setup.config.train, setup.tx, setup.labels, setup.schedule))
  step = jax.jit(fn, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, move(shd.replicated(setup.mesh))))
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  state = jax.tree.map(sds, setup.abstract_state, state_sh)
  batch = {k: sds(a, batch_sh[k]) for k, a in setup.batch_abstract.items()}
  # Triton kernels (Pallas on CUDA) are custom calls without jax.export's compatibility
  # guarantee: the module is for inspection / same-version use, so the check is waived for them
  checks = ([jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            if platform == "cuda" else [])
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(shd.RULES):
    return jax.export.export(step, platforms=[platform], disabled_checks=checks)(state, batch)


# ------------------------------------------------------------------------------------ init
def _paths_shapes(tree) -> dict[str, tuple]:
  return {opt_lib.path_str(p): tuple(np.shape(x)) for p, x in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_safetensors_files(path: str) -> None:
  """Every *.safetensors file in `path` holds the bytes its header promises (a truncated or
  partial download is an error naming the file, before any weight is read)."""
  import glob
  for fp in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
    size = os.path.getsize(fp)
    try:
      with open(fp, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
          raise ValueError("header incomplete")
        header = json.loads(f.read(n))
      end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
      raise ValueError(f"model.init_from: {fp} is not a readable safetensors file ({e}; "
                       f"{size} bytes): truncated or partial download? Download it again.") from None
    if 8 + n + end > size:
      raise ValueError(f"model.init_from: {fp} is truncated: {size} bytes, its header needs "
                       f"{8 + n + end}. Download it again.")


def load_initial_params(setup: Setup):
  """Dense HF weights (model.init_from) -> scheme.from_dense -> sharded params."""
  from condattn_jax import convert
  from condattn_jax import export as export_lib
  path = setup.config.model.init_from
  check_safetensors_files(path)
  exported = export_lib.read_sidecar(path) if export_lib.is_export(path) else None
  if exported is not None and exported["scheme"] == setup.model_cfg.scheme:
    # export.py's directory of this scheme: its own parameters are kept, bit for bit
    _, params = export_lib.load_model(path)
  else:
    if exported is not None and exported["layout"] != "condattn":
      raise ValueError(f"model.init_from={path} is an export of scheme {exported['scheme']!r} in "
                       f"the authors' layout; a {setup.model_cfg.scheme!r} run can start from "
                       "a --layout=condattn export (its base weights) only.")
    try:
      _, dense = convert.load_hf_checkpoint(path, dtype=setup.model_cfg.param_dtype)
    except (ValueError, OSError):
      raise
    except Exception as e:  # pylint: disable=broad-except  (safetensors' own errors name no file)
      raise ValueError(f"model.init_from={path}: cannot read the checkpoint "
                       f"({type(e).__name__}: {e}).") from e
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


def init_state(setup: Setup, params=None) -> TrainState:
  """Step-0 state: `params` (default `init_params`; a given tree is placed by the setup's
  parameter shardings) and a fresh optimizer state."""
  params = (init_params(setup) if params is None
            else jax.device_put(params, setup.param_shardings))
  with setup.mesh_context():
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


def _tpu_topology_devices(n: int, chip: str = "v5p"):
  """Compile-only devices of an n-chip TPU topology (jax.experimental.topologies, as MaxText's
  train_compile does), or (None, why) when libtpu is not installed / cannot describe it."""
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    return None, ("libtpu is not installed (pip install 'libtpu==0.0.48.*', the version jax "
                  f"{jax.__version__} pins)")
  if n < 1 or n & (n - 1):
    return None, f"{n} devices: a {chip} topology here has a power-of-two chip count"
  dims = [1, 1, 1] if n < 4 else [2, 2, 1]
  while dims[0] * dims[1] * dims[2] < n:
    i = max(j for j in range(3) if dims[j] == min(dims))  # double the last smallest axis
    dims[i] *= 2
  host = tuple(min(d, h) for d, h in zip(dims, (2, 2, 1)))
  for k, v in (("TPU_ACCELERATOR_TYPE", f"{chip}-{2 * n}"), ("TPU_WORKER_HOSTNAMES", "localhost")):
    os.environ.setdefault(k, v)  # silences libtpu's metadata-server probes on a non-TPU host
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{chip}:{'x'.join(map(str, dims))}",
        chip_config_name="megacore", chips_per_host_bounds=host, num_slices=1,
        wrap=(False, False, False))
  except Exception as e:  # pylint: disable=broad-except  (libtpu's errors vary by version)
    return None, f"libtpu cannot describe a {chip} topology of {n} chips ({type(e).__name__}: {e})"
  return list(topo.devices), f"{chip}:{'x'.join(map(str, dims))}"


def _tpu_oom_temp_bytes(msg: str) -> int | None:
  """The temporaries' bytes from the TPU compiler's RESOURCE_EXHAUSTED error ('... required for
  HLO temporaries (102.13G) exceeds available HBM (95.73G)'; G = GiB), or None."""
  import re
  hit = re.search(r"RESOURCE_EXHAUSTED.*?temporaries \(([\d.]+)([KMGT])\)", msg, re.S)
  if not hit:
    return None
  return int(float(hit.group(1)) * 2 ** (10 * "KMGT".index(hit.group(2)) + 10))


def _per_device_bytes(abstract, shardings) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs under `shardings`."""
  leaves = zip(jax.tree.leaves(abstract), jax.tree.leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
  return int(sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                 for a, s in leaves))


def _activation_bytes(setup: Setup) -> int:
  """Layer-boundary activations one device keeps for the backward of one microbatch: the
  [rows, T, D] input of every layer in the compute dtype (what remat_policy='full' saves; the
  other policies save more, inside the compiler's temp)."""
  c, mc = setup.config, setup.model_cfg
  rows = int(c.data.batch_size) // int(c.train.microbatches) // shd.batch_shards(setup.mesh)
  tokens = setup.seq_len // setup.mesh.shape["sequence"]  # a row's shard under sequence parallelism
  return (int(mc.num_layers) * max(rows, 1) * tokens * int(mc.hidden_size)
          * np.dtype(mc.dtype).itemsize)


def _model_line(setup: Setup, counts: dict) -> str:
  mc = setup.model_cfg
  src = setup.config.model.get("init_from")
  where = f"architecture from {src}/config.json" if src else "architecture from the recipe"
  return (f"  model: {mc.family}, {mc.num_layers} layers, width {mc.hidden_size}, "
          f"{mc.num_heads} heads, {mc.num_kv_heads} kv heads (head_dim {mc.head_dim}), "
          f"mlp {mc.intermediate_size}, vocab {mc.vocab_size}, scheme {mc.scheme}; "
          f"{counts['total'] / 1e9:.3g}B params ({counts['total']:,}); {where}")


def _suggestions(setup: Setup) -> list[str]:
  """The knobs that lower per-device memory, as overrides, for what this config still has."""
  c, mc = setup.config, setup.model_cfg
  out = []
  if mc.remat_policy != "full":
    out.append("--config.model.remat_policy=full")
  mesh = dict(setup.mesh.shape)
  if mesh["data"] > 1:
    out.append("--config.mesh.data=1 --config.mesh.fsdp=-1 (shard params / optimizer)")
  B, k = int(c.data.batch_size), int(c.train.microbatches)
  rows = B // k // shd.batch_shards(setup.mesh)
  if rows > 1:
    out.append(f"--config.train.microbatches={k * rows} (one row per device per microbatch)")
  if not int(c.train.loss_chunk_size):
    out.append("--config.train.loss_chunk_size=4096 (no [B, T, vocab] logits)")
  seq, dev = mesh["sequence"], setup.mesh.devices.size
  if (get_scheme(mc.scheme).sequence_parallel is True and dev % (2 * seq) == 0
      and setup.seq_len % (4 * seq) == 0):
    out.append(f"--config.mesh.sequence={2 * seq} (a row's tokens over {2 * seq} devices)")
  if setup.seq_len > 1024:
    out.append(f"--config.data.seq_len={setup.seq_len // 2}")
  return out


def dry_run(config, *, devices=None, print_fn=print) -> dict[str, Any]:
  """Builds the mesh, shapes and the sharded train step, compiles it ahead of time and reports
  the model, parameter counts, per-device memory and a verdict against an accelerator.
  Allocates nothing big and reads no weights (model.init_from's config.json is enough).

  config.train.dry_run_device picks what is compiled and judged (loop docstring, README):
    'v5p'          compiled for an n-chip TPU v5p topology from this host (n = this host's
                   device count; needs the libtpu wheel); without libtpu the step is only
                   lowered for TPU (jax.export): no memory figure, said on the line.
    'h100'|'h200'  compiled on this host's GPUs when it has them; on a CPU host the figure is a
                   'CPU-lowering estimate (reference attention)'.
    ''             this host's devices, no verdict.
  report['memory_per_device']: params / optimizer / batch (the state's shards), activations (an
  estimate of the layer inputs kept for the backward, part of temp), the compiler's argument /
  output / alias / temp sizes and peak = argument + output - alias + temp.
  report['collectives'] (more than one device): condattn_jax.parallel.hlo.summary of the
  compiled step: per collective op its count and result bytes x loop trips, their total, and
  how many sit under a conditional."""
  t0 = time.time()
  target = str(config.train.get("dry_run_device") or "")
  label, capacity, platform = config_lib.DRY_RUN_DEVICES.get(target, (None, None, None))
  n = len(jax.devices() if devices is None else devices)
  backend = jax.default_backend()
  mode, why, topo = "host", None, None
  if platform == "tpu" and backend != "tpu":
    tpu_devices, info = _tpu_topology_devices(n)
    if tpu_devices is None:
      mode, why = "export", info
    else:
      mode, devices, topo = "tpu_aot", tpu_devices, info
  setup = build(config, devices=devices, needs_data=False)
  counts = opt_lib.count_params(setup.abstract_params, setup.labels)
  report: dict[str, Any] = dict(mesh=dict(setup.mesh.shape), devices=setup.mesh.devices.size,
                                params=counts, model=dataclasses.asdict(setup.model_cfg),
                                global_batch=setup.global_batch, seq_len=setup.seq_len,
                                microbatches=int(setup.config.train.microbatches),
                                layout_notes=list(setup.layout_notes), device=target or None,
                                model_line=_model_line(setup, counts))
  compiled = None
  if mode == "export":
    try:
      export_train_step(setup, "tpu", device_kind="TPU v5")
      report["memory_source"] = f"lowered for TPU with jax.export only: no memory figure ({why})"
    except Exception as e:  # pylint: disable=broad-except  (e.g. host callbacks need devices)
      mode = "host"
      why = (f"{why}; jax.export cannot lower this step for TPU without devices "
             f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
  oom_temp = None
  if mode != "export":
    step_fn = jit_train_step(setup)
    with setup.mesh_context():
      lowered = step_fn.lower(setup.abstract_state, setup.batch_abstract)
      try:
        compiled = lowered.compile()
      except jax.errors.JaxRuntimeError as e:
        oom_temp = _tpu_oom_temp_bytes(str(e)) if mode == "tpu_aot" else None
        if oom_temp is None:
          raise
        report["memory_note"] = ("the TPU compiler refused the step: "
                                 + str(e).split("RESOURCE_EXHAUSTED: ", 1)[-1].split(". HLO module")[0])
    if mode == "tpu_aot":
      report["memory_source"] = (f"TPU compiler for {topo} ahead of time (libtpu): out of memory"
                                 if oom_temp is not None else
                                 f"compiled for TPU {topo} ahead of time (libtpu)")
    elif backend == "cpu":
      report["memory_source"] = "CPU-lowering estimate (reference attention)"
      if why:
        report["memory_note"] = f"not a TPU figure: {why}"
    else:
      report["memory_source"] = f"compiled on {jax.devices()[0].device_kind}"
  state_sh = setup.state_shardings
  m = dict(params_bytes=_per_device_bytes(setup.abstract_state.params, state_sh.params),
           optimizer_bytes=_per_device_bytes(setup.abstract_state.opt_state, state_sh.opt_state),
           batch_bytes=_per_device_bytes(setup.batch_abstract,
                                         {k: setup.batch_sharding for k in setup.batch_abstract}),
           activations_estimate_bytes=_activation_bytes(setup))
  if compiled is not None:
    m.update(compiled_memory(compiled))
  if oom_temp is not None:  # the TPU compiler's own figure for the temporaries
    m["temp_size_in_bytes"] = oom_temp
    m["peak_estimate_bytes"] = (m["params_bytes"] + m["optimizer_bytes"] + m["batch_bytes"]
                                + oom_temp)
  report["memory_per_device"] = m
  if capacity and "peak_estimate_bytes" in m:
    spare = capacity - m["peak_estimate_bytes"]
    report["verdict"] = dict(device=label, capacity_bytes=capacity, fits=spare >= 0,
                             spare_bytes=spare, try_=[] if spare >= 0 else _suggestions(setup))
  if compiled is not None and setup.mesh.devices.size > 1:
    from condattn_jax.parallel import hlo
    report["collectives"] = hlo.summary(hlo.collectives(compiled.as_text()))
  if compiled is not None:
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


def compiled_memory(compiled) -> dict:
  """A compiled step's memory_analysis per device (argument / output / alias / temp / code bytes)
  and the dry run's peak prediction from it: peak_estimate_bytes = arguments + outputs - aliased
  (donated) + temporaries. {} where the backend gives no analysis."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  m = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                         "alias_size_in_bytes", "temp_size_in_bytes",
                                         "generated_code_size_in_bytes") if hasattr(mem, k)}
  m["peak_estimate_bytes"] = (m.get("argument_size_in_bytes", 0) + m.get("output_size_in_bytes", 0)
                              - m.get("alias_size_in_bytes", 0) + m.get("temp_size_in_bytes", 0))
  return m


def format_dry_run(r: dict) -> str:
  p, mc = r["params"], r["model"]
  lines = [f"dry run: mesh {r['mesh']} over {r['devices']} devices; global batch "
           f"{r['global_batch']} x seq_len {r['seq_len']} in {r.get('microbatches', 1)} "
           f"microbatch(es)"]
  lines += [f"  layout: {n}" for n in r.get("layout_notes", ())]
  lines.append(r.get("model_line") or
               f"  model: {mc['family']}, {mc['num_layers']} layers, width {mc['hidden_size']}, "
               f"{mc['num_heads']} heads, {mc['num_kv_heads']} kv heads (head_dim "
               f"{mc['head_dim']}), mlp {mc['intermediate_size']}, vocab {mc['vocab_size']}, "
               f"scheme {mc['scheme']}; {p['total'] / 1e9:.3g}B params")
  lines.append(f"  params: total {p['total']:,}  trainable {p.get('trainable', p['total']):,}  "
               f"frozen {p.get('frozen', 0):,}")
  for k, v in p.items():
    if k not in ("total", "trainable", "frozen", "default"):
      lines.append(f"    group {k}: {v:,}")
  m = r.get("memory_per_device", {})
  if m:
    lines.append(f"  per device: params {_fmt_bytes(m['params_bytes'])}, optimizer "
                 f"{_fmt_bytes(m['optimizer_bytes'])}, batch {_fmt_bytes(m['batch_bytes'])}, "
                 f"activations ~{_fmt_bytes(m['activations_estimate_bytes'])} (layer inputs of "
                 "one microbatch, part of temp)")
  src = r.get("memory_source", "")
  if "peak_estimate_bytes" in m and "argument_size_in_bytes" not in m:
    lines.append(f"  memory per device [{src}]: temp {_fmt_bytes(m['temp_size_in_bytes'])} "
                 f"(the compiler's figure); peak ~ {_fmt_bytes(m['peak_estimate_bytes'])} "
                 "(params + optimizer + batch + temp)")
  elif "peak_estimate_bytes" in m:
    lines.append(f"  memory per device [{src}]: argument "
                 f"{_fmt_bytes(m.get('argument_size_in_bytes', 0))}, output "
                 f"{_fmt_bytes(m.get('output_size_in_bytes', 0))}, alias "
                 f"{_fmt_bytes(m.get('alias_size_in_bytes', 0))}, temp "
                 f"{_fmt_bytes(m.get('temp_size_in_bytes', 0))}; peak ~ "
                 f"{_fmt_bytes(m['peak_estimate_bytes'])}")
  else:
    lines.append(f"  memory per device: {src}")
  if r.get("memory_note"):
    lines.append(f"    ({r['memory_note']})")
  col = r.get("collectives")
  if col:
    ops = ", ".join(f"{k} {v['count']} ({_fmt_bytes(v['bytes'])})" for k, v in col["ops"].items())
    lines.append(f"  collectives per step [{src}]: {_fmt_bytes(col['total_bytes'])} of results x "
                 f"loop trips; {ops or 'none'}"
                 + (f"; {col['in_conditional']} under a conditional" if col["in_conditional"]
                    else ""))
  v = r.get("verdict")
  if v:
    gib = abs(v["spare_bytes"]) / 2**30
    if v["fits"]:
      lines.append(f"  verdict on {v['device']} [{src}]: fits with {gib:.2f} GiB to spare")
    else:
      lines.append(f"  verdict on {v['device']} [{src}]: short by {gib:.2f} GiB, try "
                   + ("; ".join(v["try_"]) or "more devices"))
  elif r.get("device") and "peak_estimate_bytes" not in m:
    lines.append(f"  verdict on {r['device']}: none (no memory figure)")
  if "flops_per_device" in r:
    lines.append(f"  flops per step per device: {r['flops_per_device']:.3e}")
  lines.append(f"  lower + compile: {r['compile_seconds']:.1f}s")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------- helpers
def _meta(setup: Setup, shard_count: int) -> dict:
  return dict(config=json.loads(setup.config.to_json_best_effort()),
              model_config=dataclasses.asdict(setup.model_cfg), mesh=dict(setup.mesh.shape),
              process_count=jax.process_count(), data_shard_count=shard_count)


def _host_metrics(m) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in jax.device_get(m).items()}


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
        on_step: Callable[[int, dict], None] | None = None,
        time_budget_s: float | None = None, devices=None) -> dict[str, Any]:
  """Trains to `config.train.num_steps` (resuming from <workdir>/checkpoints if present).

  devices: the devices the mesh is laid over (default `jax.devices()`: every device of every
    process), as in `build`: a one-process run may train on a subset of its local devices (e.g.
    `jax.devices()[:1]`). The train step, the evaluations and the checkpoint restore all use
    that mesh; a checkpoint written on other devices restores onto it, and one written here
    resumes on any other mesh.

  stop_after: stop (with a checkpoint) after this many steps in THIS call, as a preemption
    would; the next call resumes. time_budget_s: the same, once this call has run that many
    seconds (counted from entering run: setup, restore and compilation included; checked after
    every step, so the save and the step in flight come on top). on_step(step, host_metrics)
    is called after each step's metrics reach the host (one step late). Returns {'step',
    'train': last logged means, 'eval': eval results at the end or None, 'eval_start': at step 0
    (eval.at_start) or None, 'stopped_early': bool, 'dry_run': report or None}.

  Before the first step: every config check (validate_config, build, the data against the
  model's vocabulary), the workdir lock (workdir.WorkdirBusyError if another run holds it), the
  restore (a corrupt step is skipped with a warning and moved to <step>.corrupt; a config that
  does not fit the checkpoints is an error). Only then is <workdir>/config.json written.
  """
  if config.train.dry_run:
    return dict(step=0, train={}, eval=None, stopped_early=True,
                dry_run=dry_run(config, devices=devices))
  config_lib.validate_config(config)
  _no_persistent_cache_for_cpu_collectives(devices)
  is_host0 = jax.process_index() == 0
  _warn_eval_on_training_files(config, evaluates=bool(
      config.eval.get("at_end", True) or config.eval.get("at_start") or int(config.train.eval_every)))
  deadline = None if time_budget_s is None else time.time() + float(time_budget_s)
  workdir = workdir_lib.prepare(workdir) if is_host0 else os.path.abspath(workdir)
  lock = _lock_workdir(workdir, is_host0)
  try:
    return _run_locked(config, workdir, lock, stop_after=stop_after, on_step=on_step,
                       deadline=deadline, devices=devices)
  finally:
    if lock is not None:
      lock.release()


# The XLA:CPU flag under which a multi-device program loaded from jax's persistent cache runs
# its collectives in one order on every device (_no_persistent_cache_for_cpu_collectives).
CPU_CACHE_SAFE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _no_persistent_cache_for_cpu_collectives(devices=None) -> None:
  """jax's persistent compilation cache off (one warning line) for a run on several CPU devices
  (`devices`, default every local one; a run on one device has no collectives):
  with jax 0.11.2 a multi-device CPU program compiled under XLA:CPU's concurrency-optimized
  scheduler (its default) and loaded from that cache can deadlock in its collectives'
  rendezvous (devices wait at different collectives of one execution; the run aborts after
  minutes of 'may be stuck' messages), and one compiled afresh runs. With CPU_CACHE_SAFE_FLAG in
  XLA_FLAGS (one process; the same values, ops scheduled in program order) loaded programs run
  (tests/train/test_cpu_cache_guard.py), and the cache stays on. Effective while the process
  has compiled nothing (train.py's case)."""
  n_devices = jax.local_device_count() if devices is None else len(devices)
  if (jax.default_backend() != "cpu" or n_devices < 2 or
      not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache):
    return
  if jax.process_count() == 1 and CPU_CACHE_SAFE_FLAG in os.environ.get("XLA_FLAGS", "").split():
    return
  jax.config.update("jax_enable_compilation_cache", False)
  logging.warning("jax's persistent compilation cache (%s) is off for this run: on a CPU with %d "
                  "devices a program loaded from it can deadlock in its collectives (jax %s); "
                  "XLA_FLAGS=%s keeps it (one process).",
                  jax.config.jax_compilation_cache_dir, n_devices, jax.__version__,
                  CPU_CACHE_SAFE_FLAG)


def _warn_eval_on_training_files(config, evaluates: bool = True) -> None:
  from condattn_jax.data.config import eval_reads_training_files
  msg = eval_reads_training_files(config) if evaluates else None
  if msg and jax.process_index() == 0:
    logging.warning("%s", msg)


def _all_processes_ok(ok: bool) -> bool:
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _lock_workdir(workdir: str, is_host0: bool):
  lock, err = None, None
  if is_host0:
    try:
      lock = workdir_lib.WorkdirLock.acquire(workdir)
    except OSError as e:
      err = e
  if not _all_processes_ok(err is None):
    if lock is not None:
      lock.release()
    raise err if err is not None else workdir_lib.WorkdirBusyError(
        f"process 0 could not take the lock of workdir {workdir} (see its log).")
  return lock


def _restore_or_init(setup: Setup, ckpt: ckpt_lib.Checkpointer, data_it, shard_index: int,
                     shard_count: int, is_host0: bool):
  """(state, restored step or None): the newest readable checkpoint, else a fresh init."""
  skipped = []
  for s in sorted(ckpt.all_steps(), reverse=True):
    try:
      state = ckpt.restore_state(setup.abstract_state, s)
      data_state = ckpt.restore_data_state(s, shard_index, shard_count)
    except ckpt_lib.CorruptCheckpointError as e:
      logging.warning("skipping checkpoint step %d: %s", s, e)
      skipped.append((s, e))
      continue
    data_it.set_state(data_state)
    if skipped:
      if is_host0:
        for bad, _ in skipped:
          logging.warning("moved the unreadable checkpoint %s to %s", ckpt.step_dir(bad),
                          ckpt.quarantine(bad))
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("condattn_quarantine")
        ckpt.mgr.reload()
      logging.warning("resumed from step %d, the newest readable checkpoint in %s.", s,
                      ckpt.directory)
    else:
      logging.info("resuming from %s/%d", ckpt.directory, s)
    return state, s
  if skipped:
    raise ckpt_lib.CorruptCheckpointError(
        f"no readable checkpoint in {ckpt.directory}: " + "; ".join(str(e) for _, e in skipped)
        + " Repair or remove them (or use a new --workdir) to start over.")
  return init_state(setup), None


def headline_metric(scheme_name: str) -> str | None:
  """The scheme's progress-bar metric (Scheme.headline_metric, e.g. 'l2a/sparsity'), if any."""
  return getattr(get_scheme(scheme_name), "headline_metric", None)


def _bar_extra(means: dict, headline: str | None) -> dict[str, float]:
  """Accuracy, and the headline metric (its mean over layers) under its last name part."""
  extra = {"acc": float(means["accuracy"])}
  if headline and headline in means:
    extra[headline.rsplit("/", 1)[-1]] = float(np.mean(means[headline]))
  return extra


def _run_locked(config, workdir: str, lock, *, stop_after, on_step, deadline=None,
                devices=None) -> dict[str, Any]:
  setup = build(config, devices=devices, needs_data=True)
  config = setup.config  # with the layout derived for this mesh
  tc = config.train
  is_host0 = jax.process_index() == 0
  B, T = setup.global_batch, setup.seq_len
  shard_index, shard_count = data_shard_for_sharding(setup.batch_sharding, (B, T))
  data_it = make_train_iterator(config, process_index=shard_index, process_count=shard_count,
                                vocab_size=setup.model_cfg.vocab_size)
  _check_checkpoints_writable(os.path.join(workdir, "checkpoints"), is_host0)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=int(tc.keep_checkpoints))
  try:
    state, latest = _restore_or_init(setup, ckpt, data_it, shard_index, shard_count, is_host0)
  except BaseException:
    ckpt.close()
    raise
  if is_host0:  # the run is accepted: record its config, drop the records a resume redoes
    record_config(workdir, config, latest)
    metrics_lib.drop_records_after(workdir, latest)
  train_step = jit_train_step(setup)
  start = int(jax.device_get(state.step))
  total = int(tc.num_steps)
  meta = _meta(setup, shard_count)

  writer = metrics_lib.MetricWriter(workdir, enabled=is_host0,
                                   purge_step=None if latest is None else latest + 1)
  bar = metrics_lib.ProgressBar(total, start, enabled=is_host0 and bool(tc.progress_bar))
  headline = headline_metric(setup.model_cfg.scheme)
  multiproc = jax.process_count() > 1
  stop_signals = guards.StopSignals(install=not multiproc,
                                    on_hard_exit=lock.release if lock is not None else None)
  counts = opt_lib.count_params(setup.abstract_params, setup.labels)
  if is_host0:  # logged once SIGTERM / Ctrl-C save (tests wait for this line)
    logging.info("mesh %s, params %s, global batch %d x %d, steps %d -> %d", dict(setup.mesh.shape),
                 counts, B, T, start, total)
  result: dict[str, Any] = dict(step=start, train={}, eval=None, eval_start=None,
                                stopped_early=False, dry_run=None)
  acc = _Accumulator()
  t_log, steps_since_log = time.time(), 0
  last_saved = latest
  saved_this_run: set[int] = set()
  pending = None

  def process(p):
    nonlocal t_log, steps_since_log
    s, m = p
    m = _host_metrics(m)
    guards.check_finite(s, m, ckpt, saved_this_run=saved_this_run, primary=is_host0)
    acc.add(m)
    if on_step is not None:
      on_step(s, m)
    if s % int(tc.log_every) == 0 or s == total:
      dt = max(time.time() - t_log, 1e-9)
      means = acc.mean()
      means["tokens_per_s"] = steps_since_log * B * T / dt
      means["steps_per_s"] = steps_since_log / dt
      writer.write(s, means, prefix="train/")
      bar.update(s, float(means["loss"]), means["tokens_per_s"], _bar_extra(means, headline))
      result["train"] = metrics_lib.to_python(means)
      acc.__init__()
      t_log, steps_since_log = time.time(), 0

  def save(s):
    nonlocal last_saved
    if last_saved == s:
      return
    err = None
    if is_host0:
      try:
        ckpt.check_writable()  # before orbax, which would wait ~300 s for the step directory
      except ckpt_lib.CheckpointWriteError as e:
        err = e
    try:
      if not _all_processes_ok(err is None):
        raise err or ckpt_lib.CheckpointWriteError("process 0 cannot write the checkpoints")
      ckpt.save(s, state, data_it.get_state(), meta)
    except ckpt_lib.CheckpointWriteError as e:
      try:
        ckpt.wait()  # the save in flight, if any, may have failed the same way
      except ckpt_lib.CheckpointWriteError:
        pass
      good = max(ckpt.all_steps(), default=None)
      kept = (f"the last good checkpoint is step {good}" if good is not None else
              "no checkpoint was written")
      raise ckpt_lib.CheckpointWriteError(
          f"cannot save the checkpoint of step {s}, the run stopped: {e.cause}. Kept: {kept} "
          f"and metrics.jsonl up to step {s}; make {ckpt.directory} writable (chmod u+w / "
          "chattr -i / free disk space) and re-run the same command to resume.") from e
    last_saved = s
    saved_this_run.add(s)

  failed = False
  with setup.mesh_context():
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
        reason = (stop_signals.reason if stop_signals.flag else
                  "preemption" if multiproc and ckpt.mgr.reached_preemption(step) else
                  "stop_after" if stop_after is not None and step - start >= stop_after else
                  "time_budget_s" if deadline is not None and not _all_processes_ok(
                      time.time() < deadline) else None)
        stop = reason is not None
        periodic = int(tc.checkpoint_every) and step % int(tc.checkpoint_every) == 0
        evaluate_now = int(tc.eval_every) and step % int(tc.eval_every) == 0 and step < total
        if periodic or stop or step == total or evaluate_now:
          process(pending)  # a non-finite step raises here, before its state can be saved
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
    except BaseException:
      failed = True
      raise
    finally:
      stop_signals.restore()
      bar.close()
      writer.close()
      try:
        ckpt.close()
      except ckpt_lib.CheckpointWriteError:
        if not failed:  # else the error being raised already says what was kept
          raise
      if is_host0:
        _write_plot(workdir, headline)
  return result


def _write_plot(workdir: str, headline: str | None) -> None:
  """<workdir>/metrics.png from metrics.jsonl (end of a run, stop, error): never fails the run."""
  try:
    metrics_lib.plot_metrics(workdir, headline=headline)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("could not write %s/metrics.png: %s", workdir, e)


def _check_checkpoints_writable(directory: str, is_host0: bool) -> None:
  """CheckpointWriteError before the first step (and before orbax touches it) when
  <workdir>/checkpoints cannot be written."""
  err = None
  if is_host0:
    try:
      ckpt_lib.check_writable(directory)
    except ckpt_lib.CheckpointWriteError as e:
      err = e
  if not _all_processes_ok(err is None):
    raise err if err is not None else ckpt_lib.CheckpointWriteError(
        f"process 0 cannot write the checkpoint directory {directory} (see its log).")


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_changes(old: dict, new: dict) -> list[str]:
  """'train.lr: 0.003 -> 0.1' for every field whose value differs between two config.json dicts
  (lists and tuples compare equal)."""
  norm = lambda v: list(v) if isinstance(v, tuple) else v
  a, b = _flat(old), _flat(new)
  return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in sorted(set(a) | set(b))
          if norm(a.get(k)) != norm(b.get(k))]


def record_config(workdir: str, config, resumed_step: int | None) -> None:
  """Writes <workdir>/config.json. A resume whose config differs from the recorded one is
  accepted (a longer run, another lr...) and said in a warning listing the changed fields; the
  previous config.json is kept as config.step<N>.json (N: the step resumed from) and the lr
  schedule follows the new values from step N on."""
  path = os.path.join(workdir, "config.json")
  text = config.to_json_best_effort(indent=2)
  if resumed_step is not None and os.path.isfile(path):
    try:
      with open(path) as f:
        old = json.load(f)
    except (OSError, ValueError):
      old = None
    changes = config_changes(old, json.loads(text)) if isinstance(old, dict) else []
    if changes:
      kept = os.path.join(workdir, f"config.step{resumed_step}.json")
      os.replace(path, kept)
      logging.warning("resuming from step %d with a changed config (%s); the lr schedule and "
                      "every changed setting apply from step %d on; the previous config is kept "
                      "in %s.", resumed_step, "; ".join(changes), resumed_step, kept)
  with open(path, "w") as f:
    f.write(text)


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
def _readable(ck: ckpt_lib.Checkpointer, step: int | None, read: Callable[[int], Any]):
  """(read(step), step): an explicit step must be readable; without one the newest readable
  checkpoint is used (corrupt newer ones are skipped with a warning naming them)."""
  if step is not None:
    return read(ck._require(step)), step
  steps = sorted(ck.all_steps(), reverse=True)
  if not steps:
    ck._require(None)  # raises CheckpointNotFoundError
  errors = []
  for s in steps:
    try:
      out = read(s)
    except ckpt_lib.CorruptCheckpointError as e:
      logging.warning("skipping checkpoint step %d: %s", s, e)
      errors.append(str(e))
      continue
    if errors:
      logging.warning("using step %d, the newest readable checkpoint in %s.", s, ck.directory)
    return out, s
  raise ckpt_lib.CorruptCheckpointError(f"no readable checkpoint in {ck.directory}: "
                                        + "; ".join(errors))


def load_params(config, path: str, *, step: int | None = None, devices=None):
  """(setup, params, step) from a workdir / checkpoints dir / step dir, into this config's mesh.
  Without a step (in `step` or the path) the newest readable checkpoint is used."""
  directory, step_from_path = ckpt_lib.resolve_checkpoint_path(path)
  step = step if step is not None else step_from_path
  setup = build(config, devices=devices)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        setup.abstract_params, setup.param_shardings)
  ck = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    with setup.mesh_context():
      params, step = _readable(ck, step, lambda s: ck.restore_params(target, s))
  finally:
    ck.close()
  return setup, params, step


def config_from_checkpoint(path: str, step: int | None = None):
  """The run config saved with a checkpoint (for eval without --config)."""
  import ml_collections
  directory, step_from_path = ckpt_lib.resolve_checkpoint_path(path)
  ck = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    meta, _ = _readable(ck, step if step is not None else step_from_path, ck.restore_meta)
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
  the initial params (random, or model.init_from converted by the scheme).

  The results record their knobs (evaluation.eval_knobs). With out_dir, writes
  <out_dir>/eval_step<N>[_<tag>].{json,md}: the tag names the knobs that differ from the config
  saved with the checkpoint (e.g. a test-time theta), so an earlier eval with other knobs is
  never overwritten; res['files'] lists the paths written."""
  from condattn_jax import evaluation
  config_lib.validate_config(config, needs_data=True)
  _warn_eval_on_training_files(config)
  reference = None
  if path is None:
    setup = build(config, devices=devices)
    params = init_params(setup)
    step = 0
  else:
    setup, params, step = load_params(config, path, step=step, devices=devices)
    try:
      reference = evaluation.eval_knobs(config_from_checkpoint(path, step))
    except (ValueError, OSError, KeyError) as e:
      logging.warning("cannot read the config saved with checkpoint %d (%s): eval files are "
                      "named by their knobs' hash.", step, e)
  config = setup.config  # eval batch derived for this mesh
  res = evaluation.evaluate(config, params, setup.model_cfg, setup.mesh, step=int(step),
                            param_shardings=setup.param_shardings)
  if out_dir is not None and jax.process_index() == 0:
    res["files"] = list(evaluation.write_results(res, out_dir, reference_knobs=reference))
  return res
