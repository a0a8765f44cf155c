"""Mesh, logical-axis rules and the shardings of params, optimizer state and batches.

One table (`RULES`) maps every logical axis name used by the models to mesh axes:

  params       vocab -> tensor, embed -> (fsdp, sequence), q_heads/kv_heads -> tensor,
               mlp -> tensor, head_dim/norm -> replicated
  activations  activation_batch -> (data, fsdp), activation_length -> sequence,
               activation_heads/activation_mlp -> tensor, activation_embed -> replicated

so `data` is pure data parallelism, `fsdp` shards the batch AND the parameters / optimizer state
(ZeRO-3; params are all-gathered per layer by XLA), `sequence` is context parallelism (a row's
tokens split over devices in the load-balanced zigzag layout; attention runs per shard in
jax.shard_map: condattn_jax/parallel/context.py) and shards the parameters / optimizer state
like fsdp, `tensor` is Megatron-style head / MLP / vocab parallelism. A parameter dimension that a mesh axis does not divide falls back to
replicated on that axis (logged once), so odd head counts still run.

Flax reads the rules and the mesh from context: run model code inside `mesh_context(mesh)`
(`jax.set_mesh` + `nn.logical_axis_rules`). The mesh uses `AxisType.Auto` axes (GSPMD-style
propagation around the logical constraints).
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")

RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("activation_batch", BATCH_AXES),
    ("activation_length", "sequence"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # parameters
    ("vocab", "tensor"),
    ("embed", ("fsdp", "sequence")),  # ZeRO-3 over the sequence axis too (MaxText's rule)
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),  # the scanned layer axis of stacked params
)


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int, int]:
  """(data, fsdp, sequence, tensor) from `config.mesh` (a config without `sequence`, e.g. a
  saved run's, has sequence 1); at most one axis may be -1 (fill)."""
  sizes = [int(mesh_cfg.get(a, 1) if a == "sequence" else mesh_cfg[a]) for a in MESH_AXES]
  fill = [i for i, s in enumerate(sizes) if s == -1]
  if len(fill) > 1:
    raise ValueError(f"config.mesh: at most one of {MESH_AXES} may be -1 (fill), got "
                     f"{dict(zip(MESH_AXES, sizes))}.")
  for a, s in zip(MESH_AXES, sizes):
    if s != -1 and s < 1:
      raise ValueError(f"config.mesh.{a}={s}: use a positive size or -1 (fill).")
  known = math.prod(s for s in sizes if s != -1)
  if fill:
    if num_devices % known:
      raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))}: {num_devices} devices are not "
                       f"divisible by the fixed axes' product {known}.")
    sizes[fill[0]] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices} are available (jax.device_count()); set one axis to -1 "
                     "to fill.")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """The (data, fsdp, sequence, tensor) mesh over all devices (or `devices`).

  Devices are laid out in process order with `tensor` innermost, so the batch rows a process
  holds are one contiguous block (what per-process data loading needs; batches are replicated
  over `sequence`: every device of a row's sequence group reads the whole row).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  arr = np.asarray(devices, dtype=object).reshape(shape)
  return jax.sharding.Mesh(arr, MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def mesh_context(mesh, rules=RULES, *, sequence_attention: str = "all_gather"):
  """Mesh + logical rules in context: everything that traces the model runs in here.
  sequence_attention: how global attention runs over the `sequence` axis ('all_gather' |
  'ring', condattn_jax/parallel/context.py; config.mesh.sequence_attention)."""
  from condattn_jax.parallel import context
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), context.strategy(sequence_attention):
    yield


def init_context(rules=RULES):
  """Rules without a mesh, for `Decoder.init`: the init is sharded by its out_shardings."""
  return nn.logical_axis_rules(rules)


_warned: set = set()


def logical_to_spec(names, shape, mesh, rules=RULES) -> P:
  """PartitionSpec for an array with logical axis `names`; drops mesh axes that don't divide."""
  if names is None:
    return P()
  spec = list(nn.logical_to_mesh_axes(names, rules))
  for i, (axes, dim) in enumerate(zip(spec, shape)):
    if axes is None:
      continue
    if isinstance(axes, tuple):  # a group's size-1 axes dropped (all size 1: its first axis)
      kept = tuple(a for a in axes if mesh.shape[a] > 1) or axes[:1]
      axes = spec[i] = kept if len(kept) > 1 else kept[0]
    tup = axes if isinstance(axes, tuple) else (axes,)
    size = math.prod(mesh.shape[a] for a in tup)
    if dim % size:
      key = (tuple(names), tuple(shape), tup)
      if key not in _warned:
        _warned.add(key)
        logging.warning("sharding: dim %d (%s, size %d) of an array %s is not divisible by mesh "
                        "axes %s (size %d): replicated on them.", i, names[i], dim, tuple(shape),
                        tup, size)
      spec[i] = None
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def _is_box(x):
  return isinstance(x, nn.meta.AxisMetadata)


def param_shardings(boxed_abstract, mesh, rules=RULES):
  """NamedShardings (unboxed tree) for params carrying `nn.LogicallyPartitioned` boxes."""
  def one(x):
    if _is_box(x):
      names = x.get_partition_spec()
      return NamedSharding(mesh, logical_to_spec(tuple(names), x.value.shape, mesh, rules))
    return NamedSharding(mesh, P())
  return jax.tree.map(one, boxed_abstract, is_leaf=_is_box)


def logical_names(boxed_abstract):
  """The logical axis names of every param (unboxed tree of tuples; None when unnamed)."""
  return jax.tree.map(lambda x: tuple(x.get_partition_spec()) if _is_box(x) else None,
                      boxed_abstract, is_leaf=_is_box)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  """Sharding of a [B, T] batch array: rows over (data, fsdp), columns replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def _dict_keys(path):
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def opt_state_shardings(abstract_opt_state, params_shardings, abstract_params, mesh):
  """Shardings for an optax state: a leaf whose key path ends with a param's path (and has its
  shape) follows that param (Adam's mu / nu, also under multi_transform / masked); the rest
  (counts, scalars) is replicated."""
  by_path = {}
  for (path, s), (_, a) in zip(jax.tree_util.tree_flatten_with_path(params_shardings)[0],
                               jax.tree_util.tree_flatten_with_path(abstract_params)[0]):
    by_path[_dict_keys(path)] = (s, tuple(a.shape))
  rep = replicated(mesh)

  def one(path, leaf):
    keys = _dict_keys(path)
    shape = tuple(getattr(leaf, "shape", ()))
    for k in range(len(keys), 0, -1):
      hit = by_path.get(keys[-k:])
      if hit is not None and hit[1] == shape:
        return hit[0]
    return rep
  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def shard_host_tree(tree, shardings):
  """Host (numpy) arrays, identical on every process -> global jax.Arrays with `shardings`."""
  def put(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree.map(put, tree, shardings)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def derive_layout(config, num_devices: int, *, num_heads: int = 0,
                  num_kv_heads: int = 0) -> tuple[Any, list[str]]:
  """(config, notes): the config laid out on `num_devices` where its batch does not divide the
  mesh, and one note per derived field (the input config is not changed; the first item is a
  copy when anything was derived).

  Only what would otherwise stop the run is derived, in this order:
    mesh         the default mesh (data=1, fsdp=-1, tensor=1, any sequence) when
                 data.batch_size does not divide the devices left after `sequence`: fsdp = the
                 largest divisor of them that divides the batch, tensor = the rest (heads / MLP /
                 vocab split instead of rows; a head count tensor does not divide is replicated
                 on it, said in a note). Rows are split over `sequence` only as configured.
    microbatches train.microbatches -> the largest k <= it whose microbatch of
                 data.batch_size / k rows divides data*fsdp (the same gradient; more rows per
                 device per microbatch). With sequence > 1 and train.microbatches left at 1:
                 one row per data*fsdp shard per microbatch (k = data.batch_size / (data*fsdp)):
                 a row is split over `sequence` because one row is what a device group holds,
                 so a microbatch of several rows per shard would multiply the activations the
                 split was meant to divide (the same CE gradient; a scheme's batch-level aux
                 term, e.g. L2A's regulariser on the mean routing rate, is per microbatch).
    eval batch   eval.batch_size (or data.batch_size) rounded up to a multiple of data*fsdp, and
                 eval.num_batches lowered so the rows evaluated do not shrink.
  A mesh set by hand that does not divide the batch is left alone (build() names the fields).
  """
  import copy
  cfg = config
  notes: list[str] = []
  data, fsdp, seq, tensor = mesh_shape(config.mesh, num_devices)
  B = int(config.data.batch_size)
  m = int(config.train.microbatches)
  default_mesh = (int(config.mesh.data), int(config.mesh.fsdp), int(config.mesh.tensor)) == (1, -1, 1)
  rest = num_devices // seq  # the devices of one sequence position

  def edit():
    nonlocal cfg
    if cfg is config:
      cfg = copy.deepcopy(config)
    return cfg

  if B % (data * fsdp) and default_mesh:
    g = max(d for d in _divisors(rest) if B % d == 0)
    fsdp, tensor = g, rest // g
    c = edit()
    with c.unlocked():
      c.mesh.fsdp, c.mesh.tensor = fsdp, tensor
    where = f"{num_devices} devices" if seq == 1 else f"{rest} devices (x sequence={seq})"
    note = (f"mesh: data.batch_size={B} rows do not divide {where}: fsdp={fsdp} x "
            f"tensor={tensor} (rows over fsdp, heads / MLP / vocab over tensor)")
    bad = [f"{n} {what}" for n, what in ((num_heads, "query heads"), (num_kv_heads, "KV heads"))
           if n and n % tensor]
    if bad:
      note += (f"; tensor={tensor} does not divide {' and '.join(bad)}: those projections are "
               "replicated on tensor (a batch that is a multiple of the device count avoids it)")
    notes.append(note)
  S = data * fsdp
  if seq > 1 and m == 1 and B % S == 0 and B // S > 1:
    c = edit()
    with c.unlocked():
      c.train.microbatches = m = B // S
    notes.append(f"train.microbatches 1 -> {m}: mesh sequence={seq} splits a row over {seq} "
                 f"devices, so a microbatch holds one row per data*fsdp={S} shard instead of "
                 f"{m}; the same CE gradient, batch-level aux terms per microbatch (set "
                 "train.microbatches > 1 to choose)")
  if B % S == 0 and (B // m) % S:
    k = max(d for d in _divisors(B) if d <= m and (B // d) % S == 0)
    c = edit()
    with c.unlocked():
      c.train.microbatches = k
    notes.append(f"train.microbatches {m} -> {k}: a microbatch of {B // m} rows does not divide "
                 f"data*fsdp={S}; {B // k} rows per microbatch ({B // k // S} per device), the "
                 "same gradient")
  B_eval = int(config.eval.get("batch_size") or B)
  if B_eval % S:
    nb = int(config.eval.num_batches)
    be = -(-B_eval // S) * S
    nb2 = max(1, -(-B_eval * nb // be))
    c = edit()
    with c.unlocked():
      c.eval.batch_size, c.eval.num_batches = be, nb2
    notes.append(f"eval.batch_size {B_eval} -> {be} (a multiple of data*fsdp={S}), "
                 f"eval.num_batches {nb} -> {nb2}")
  return cfg, notes


def check_batch_layout(config, data: int, fsdp: int) -> None:
  """ValueError naming the field when the train batch, a microbatch or the eval batch does not
  divide data*fsdp (what build() requires after derive_layout)."""
  S = data * fsdp
  mesh = f"mesh data*fsdp={S} (data={data}, fsdp={fsdp})"
  B, k = int(config.data.batch_size), int(config.train.microbatches)
  if B % S:
    raise ValueError(f"config.data.batch_size={B} (global) must be divisible by {mesh}; the "
                     "default mesh (data=1, fsdp=-1, tensor=1) is laid out automatically.")
  if (B // k) % S:
    raise ValueError(f"a microbatch of data.batch_size/train.microbatches={B // k} rows must be "
                     f"divisible by {mesh}.")
  B_eval = int(config.eval.get("batch_size") or B)
  if B_eval % S:
    raise ValueError(f"the eval batch (config.eval.batch_size or data.batch_size) = {B_eval} rows "
                     f"must be divisible by {mesh}.")
