"""The one attention dispatch point: `attention(q, k, v, mask, impl=...)`.

    mask = ops.MaskSpec(q_positions_BT=pos, kv_positions_BS=pos, q_segment_ids_BT=seg,
                        kv_segment_ids_BS=seg, contiguous=True)
    out_BTNH = ops.attention(q_BTNH, k_BSKH, v_BSKH, mask)                 # impl="auto"

`MaskSpec` says which (query, key) pairs are visible; `MaskSpec.dense_mask()` is the one mask
builder (pallas_kernels/compact_attention/reference.py, shared with the kernels' tests), and
impl="reference" is the one reference attention (same file).

Implementations (one vocabulary):
  reference  masked dense attention, float32 softmax, any mask. O(T*S) memory: CPU and tests.
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"): contiguous self-attention
             without segment ids, active set, sinks or block lists; bfloat16/float16. Also
             decode (`decode_reasons`): one query per row over a full cache with per-row fill
             (MaskSpec.kv_lengths_B), no window, an active set per row at most: the GQA group is
             folded into the query rows (each K/V tile read once for the group), and a row's
             kv length is its fill (1 slot for an inactive row: the L2A row routed local skips
             its global cache reads).
  tokamax    tokamax flash attention (Mosaic GPU, else Triton) with a per-query k_start
             (document start, window): contiguous (packed) self-attention without active set,
             sinks or block lists. Off GPU: tokamax's XLA implementation (tests).
  pallas     a Pallas kernel: pallas_kernels.compact_attention for any positions / segments /
             window / active set ([B, T] or per head [B, T, N]), e.g. caches, decode, chunked
             prefill, L2A, AHA; for a mask with block lists pallas_kernels.block_sparse (every
             MaskSpec field, sinks too; one launch for a layer's mixed full / block-sparse
             heads). The kernel is the resolver's pick for the lowering platform (below); on
             CPU the Triton kernel in Pallas interpret mode (tests).
  triton, mosaic_gpu, mosaic_tpu
             that Pallas kernel by name (Mosaic GPU: Hopper); lowered for a platform it does
             not compile for, a placeholder whose lowering raises; on CPU the kernel in Pallas
             interpret mode (tests).
  auto       picked for the platform the call is LOWERED for (jax.lax.platform_dependent), not
             the backend at trace time, so jax.export for GPU/TPU from a CPU host gets the GPU/TPU
             kernel:  cpu -> reference;
                      cuda -> decode over a full cache (kv_lengths_B, T = 1, no window, no
                              per-head active set): cudnn;
                              other decode over a cache (`decode_kernel_reasons`: a window,
                              sinks, a per-head active set, block lists, a few queries per row
                              with a fill):
                              the decode kernel (pallas_kernels.decode, the resolver's pick:
                              Mosaic GPU on Hopper; Mosaic TPU on tpu), forward only (its VJP
                              is the reference's); with the backend's
                              DecodeConfig(over_cudnn=True) it takes cuDNN's decode calls too;
                              contiguous self-attention without active/sinks: cudnn (no segment
                              ids) else tokamax (causal) or the Pallas kernel (with a window:
                              tokamax's backward does not skip out-of-window tiles); anything
                              else (active set, cache layout, decode, chunked prefill): the
                              Pallas kernel (with an all-true active set if none);
                      rocm, tpu -> the Pallas kernel.
The one resolver (`resolve`) picks the Pallas kernel: the first backend of the kernel package
(its BACKENDS, the pallas_kernels.backends interface) whose supports(shape, dtype, platform)
holds for the lowering platform and its device kind: Mosaic GPU on Hopper, Triton on other
CUDA / ROCm GPUs, Mosaic on TPU. Where no kernel takes the call (sinks without block lists, a
shape no kernel fits), auto uses the reference with a warning.
An explicit impl that cannot take the call raises ValueError naming the impl and why.

Only the branch for the lowering platform is lowered, and under jax.grad the other branches'
(zero-filled) residuals are dead code after lowering (tests/kernels/test_ops.py checks both on compiled
CPU HLO). All branches are traced, but only for platforms this process can lower for: its own
backend, plus the platform of an abstract device set with
jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice(...)))
(cross-lowering, e.g. exporting for cuda or tpu from a CPU host). A branch for any other platform
is a placeholder whose lowering raises that advice (never a silently wrong kernel).

Under a mesh (jax.sharding.get_abstract_mesh()), every Pallas and tokamax call runs per shard in
jax.shard_map over the mesh axes the rules table (condattn_jax/train/sharding.py) gives
attention's activations: activation_batch (data, fsdp), activation_heads (tensor), when the shapes
divide. Contiguous self-attention under a mesh that splits rows (activation_length -> sequence,
size > 1) runs sequence-parallel: condattn_jax/parallel/context.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

KERNEL_IMPLS = ("triton", "mosaic_gpu", "mosaic_tpu")  # one Pallas kernel, by name
IMPLS = ("auto", "reference", "cudnn", "tokamax", "pallas", *KERNEL_IMPLS)
_KERNELS = "pallas_kernels.compact_attention"
_BLOCK_SPARSE = "pallas_kernels.block_sparse"
_DECODE = "pallas_kernels.decode"


# ------------------------------------------------------------------------------------------------
# Mask description
# ------------------------------------------------------------------------------------------------

def _static(default=None):
  return dataclasses.field(default=default, metadata=dict(static=True))


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class BlockLists:
  """Per-(batch, head, query-block) kv block lists and per-head modes (the Pallas impls run
  pallas_kernels.block_sparse, whose tiles are these blocks).

  kv_blocks_BNQL: int32 [B, N, ceil(T / block_q), L]: the kv blocks (key slots
    [j * block_k, (j + 1) * block_k)) that query block i (query rows [i * block_q, ...)) of query
    head n may see; entries outside [0, ceil(S / block_k)) are padding (use -1).
  head_mode_BN: None (every head uses its list) or int32 [B, N]: HEAD_FULL (0) = the head ignores
    its list (full attention under the rest of the mask), HEAD_BLOCKS (1) = the head sees only its
    listed blocks, HEAD_WINDOW_BLOCKS (2) = the head sees the window (and sinks) OR its listed
    blocks whole (MATCH's "window OR retrieved chunks"). Lists never widen the rest of the mask
    (causal, documents, active; the window only for mode 2's listed blocks).
  window_blocks (static): the modes may hold HEAD_WINDOW_BLOCKS; only backends that run it are
    resolved (the Mosaic GPU kernel; elsewhere auto takes the reference). Required for mode 2.
  shared_by_kv_head (static): a promise that the query heads of each kv head carry the same
    lists and the same mode, HEAD_FULL or HEAD_BLOCKS (Elastic's SSA decode: one decision a kv
    head, lists from the positions alone). The decode kernels then plan the listed tiles from the
    lists alone and apply each kv head's mode after, so layers calling with the same positions
    share that plan (XLA merges the identical computations); results are the same.
  Heads whose queries are all HEAD_FULL can run apart in a dense kernel:
  condattn_jax/attention/elastic/composite.py (Elastic's composite).
  """
  kv_blocks_BNQL: Any
  head_mode_BN: Any = None
  block_q: int = _static(128)
  block_k: int = _static(128)
  window_blocks: bool = _static(False)
  shared_by_kv_head: bool = _static(False)


HEAD_FULL, HEAD_BLOCKS, HEAD_WINDOW_BLOCKS = 0, 1, 2


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class MaskSpec:
  """Which (query, key) pairs are visible; a pytree (arrays are leaves, the rest is static).

  q_positions_BT, kv_positions_BS: int32 token positions; key visible when kv_pos <= q_pos.
  q_segment_ids_BT, kv_segment_ids_BS: None or int32 document ids; 0 = padding / empty cache
    slot, never attended (a query of segment 0 sees nothing). Both: same nonzero id. kv ids
    alone (a cache's validity): the query chunk is one document and sees every valid slot.
  window (static): keys q_pos - window + 1 .. q_pos only.
  sinks (static): keys with kv_pos < sinks of the same document stay visible outside the window
    (StreamingLLM sink tokens).
  active: None, bool [B, T] (per token: L2A) or bool [B, T, N] (per query head: AHA): the
    queries to compute; the others come back as zeros.
  block_lists: None or BlockLists (per-head kv block lists; see there).
  kv_lengths_B: None or int32 [B]: a full cache's fill (models.layers.KVCache kind 'full' after
    its write). The caller promises that row b's keys are in slots < kv_lengths_B[b] (later slots
    are empty: never visible) and that a single query (T == 1) sees every one of them (cache
    positions <= the query's). The mask builder honours the first part; decode kernels read only
    those slots.
  contiguous (static): the caller promises q and kv are the same tokens laid out contiguously,
    positions restarting at 0 in each document (so T == S, and segment ids both or neither);
    only then may cudnn / tokamax run. False for caches, decode, chunked prefill.
  """
  q_positions_BT: Any
  kv_positions_BS: Any
  q_segment_ids_BT: Any = None
  kv_segment_ids_BS: Any = None
  active: Any = None
  block_lists: BlockLists | None = None
  kv_lengths_B: Any = None
  window: int | None = _static(None)
  sinks: int = _static(0)
  contiguous: bool = _static(False)

  def dense_mask(self):
    """bool [B, T, S], or [B, N, T, S] with a per-head active set or block lists."""
    ref = _kernel_module("reference")
    m = jax.tree.map(jnp.asarray, self)
    bl = m.block_lists
    build = ref.dense_mask
    if bl is not None and bl.window_blocks:  # dense_mask with HEAD_WINDOW_BLOCKS heads too
      build = _kernel_module("api", package=_BLOCK_SPARSE).reference_mask
    mask = build(
        m.q_positions_BT, m.kv_positions_BS, m.q_segment_ids_BT, m.kv_segment_ids_BS,
        window=m.window, sinks=m.sinks, active=m.active,
        kv_blocks_BNQL=None if bl is None else bl.kv_blocks_BNQL,
        head_mode_BN=None if bl is None else bl.head_mode_BN,
        block_q=None if bl is None else bl.block_q, block_k=None if bl is None else bl.block_k)
    if m.kv_lengths_B is None:
      return mask
    S = m.kv_positions_BS.shape[1]
    filled_BS = jnp.arange(S, dtype=jnp.int32)[None, :] < m.kv_lengths_B[:, None]
    return mask & (filled_BS[:, None, :] if mask.ndim == 3 else filled_BS[:, None, None, :])


def _check(q, k, v, mask: MaskSpec):
  """One-line ValueErrors for malformed calls (shapes are static)."""
  if not isinstance(mask, MaskSpec):
    raise ValueError(f"ops.attention: mask must be an ops.MaskSpec, got {type(mask).__name__}")
  _kernel_module("reference").check_qkv(q, k, v)
  B, T, N, _ = q.shape
  S = k.shape[1]
  for name, shape in (("q_positions_BT", (B, T)), ("kv_positions_BS", (B, S)),
                      ("q_segment_ids_BT", (B, T)), ("kv_segment_ids_BS", (B, S))):
    x = getattr(mask, name)
    if x is None and "positions" in name:
      raise ValueError(f"ops.attention: MaskSpec.{name} is required")
    if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
      raise ValueError(f"MaskSpec.{name} must be an int array of shape {shape}; got {x.dtype} "
                       f"{x.shape}")
  if mask.q_segment_ids_BT is not None and mask.kv_segment_ids_BS is None:
    raise ValueError("MaskSpec: q_segment_ids_BT without kv_segment_ids_BS; give kv ids too "
                     "(kv ids alone mean a cache's validity)")
  kl = mask.kv_lengths_B
  if kl is not None and (kl.shape != (B,) or not jnp.issubdtype(kl.dtype, jnp.integer)):
    raise ValueError(f"MaskSpec.kv_lengths_B must be an int array of shape {(B,)}; got "
                     f"{kl.dtype} {kl.shape}")
  a = mask.active
  if a is not None and (a.dtype != jnp.bool_ or a.shape not in ((B, T), (B, T, N))):
    raise ValueError(f"MaskSpec.active must be bool [B, T]={(B, T)} or [B, T, N]={(B, T, N)}; "
                     f"got {a.dtype} {a.shape}")
  if mask.window is not None and (int(mask.window) != mask.window or mask.window < 1):
    raise ValueError(f"MaskSpec.window must be an int >= 1 or None, got {mask.window!r}")
  if int(mask.sinks) != mask.sinks or mask.sinks < 0:
    raise ValueError(f"MaskSpec.sinks must be an int >= 0, got {mask.sinks!r}")
  if mask.contiguous:
    if T != S:
      raise ValueError(f"MaskSpec.contiguous=True promises q and kv are the same tokens, but "
                       f"T={T} != S={S}; set contiguous=False")
    if (mask.q_segment_ids_BT is None) != (mask.kv_segment_ids_BS is None):
      raise ValueError("MaskSpec.contiguous=True needs q_segment_ids_BT and kv_segment_ids_BS "
                       "both (the same ids) or neither")
  bl = mask.block_lists
  if bl is not None:
    nq = -(-T // bl.block_q)
    kb = bl.kv_blocks_BNQL
    if kb.ndim != 4 or kb.shape[:3] != (B, N, nq) or not jnp.issubdtype(kb.dtype, jnp.integer):
      raise ValueError(f"BlockLists.kv_blocks_BNQL must be int [B, N, ceil(T/block_q), L] = "
                       f"[{B}, {N}, {nq}, L]; got {kb.dtype} {kb.shape}")
    if bl.head_mode_BN is not None and bl.head_mode_BN.shape != (B, N):
      raise ValueError(f"BlockLists.head_mode_BN must be [B, N] = {(B, N)}; got "
                       f"{bl.head_mode_BN.shape}")


# ------------------------------------------------------------------------------------------------
# The kernel package (loud import) and what each implementation can take
# ------------------------------------------------------------------------------------------------

def _kernel_module(sub: str | None = None, package: str = _KERNELS):
  """pallas_kernels.compact_attention (or `package`), or its submodule `sub`; an import failure
  is an error."""
  name = package if sub is None else f"{package}.{sub}"
  try:
    return importlib.import_module(name)
  except ImportError as e:
    raise ImportError(f"condattn_jax.ops needs {name} (the attention kernels and the reference "
                      f"live there) but importing it failed: {e!r}; fix that import (install the "
                      "repo with `pip install -e .`)") from e


def _fused_reasons(q, mask: MaskSpec) -> list[str]:
  """Why cudnn / tokamax cannot take the call (empty: they can)."""
  why = []
  if not mask.contiguous:
    why.append("the mask is not contiguous self-attention (MaskSpec.contiguous=False: cache, "
               "decode or chunked-prefill layout)")
  if mask.active is not None:
    why.append("an active set (MaskSpec.active) needs impl='pallas'")
  if mask.sinks:
    why.append("sink tokens (MaskSpec.sinks) are not supported")
  if mask.block_lists is not None:
    why.append("block lists (MaskSpec.block_lists) are not supported")
  return why


def _cudnn_shape_reasons(q) -> list[str]:
  """What cuDNN's attention refuses in q's dtype and head_dim (both its paths)."""
  why = []
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    why.append(f"dtype {q.dtype} (cuDNN needs bfloat16 or float16)")
  H = q.shape[-1]
  if H % 8 or H > 256:
    why.append(f"head_dim {H} (cuDNN needs a multiple of 8, <= 256)")
  return why


def cudnn_reasons(q, mask: MaskSpec) -> list[str]:
  why = _fused_reasons(q, mask)
  if mask.kv_segment_ids_BS is not None:
    why.append("packed segment ids (use impl='tokamax')")
  return why + _cudnn_shape_reasons(q)


def decode_reasons(q, mask: MaskSpec) -> list[str]:
  """Why the cuDNN decode path cannot take the call (empty: it can): one query per row over a
  full cache with its fill (kv_lengths_B), no window / sinks / block lists / query segment ids,
  an active set per row at most; bfloat16 / float16, head_dim a multiple of 8 <= 256."""
  why = []
  if mask.kv_lengths_B is None:
    why.append("no cache fill (MaskSpec.kv_lengths_B): not a decode over a full cache")
  if q.shape[1] != 1:
    why.append(f"{q.shape[1]} queries per row (decode takes one)")
  if mask.window is not None or mask.sinks or mask.block_lists is not None:
    why.append("a window, sinks or block lists")
  if mask.q_segment_ids_BT is not None:
    why.append("query segment ids")
  if mask.active is not None and mask.active.ndim != 2:
    why.append("a per-head active set")
  return why + _cudnn_shape_reasons(q)


def decode_kernel_reasons(q, mask: MaskSpec) -> list[str]:
  """Why the decode kernels (pallas_kernels.decode) cannot take the call (empty: they can,
  shapes aside: their backends' supports() say that): a decode over a cache, i.e. a fill
  (kv_lengths_B) or a single query per row, not contiguous self-attention, no query segment
  ids. Window, sinks, an active set per row or per head and block lists (every head mode; the
  backends take blocks of a multiple of their kv tile) are theirs."""
  why = []
  if mask.contiguous:
    why.append("contiguous self-attention (not a decode over a cache)")
  if mask.kv_lengths_B is None and q.shape[1] != 1:
    why.append(f"{q.shape[1]} queries per row without a cache fill (MaskSpec.kv_lengths_B)")
  if mask.q_segment_ids_BT is not None:
    why.append("query segment ids")
  return why


def _pallas_reasons(mask: MaskSpec) -> list[str]:
  if mask.block_lists is not None:  # the block-sparse kernel takes every MaskSpec field
    return []
  why = []
  if mask.sinks:
    why.append("sink tokens (MaskSpec.sinks): the compacted kernel has no sink mask")
  return why


def cudnn_available() -> str | None:
  """None if cuDNN attention can be traced in this process, else why not."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    fa.check_cudnn_version()
  except (ImportError, RuntimeError) as e:
    return f"cuDNN is not available in this process ({e})"
  return None


# ------------------------------------------------------------------------------------------------
# Platforms: what each branch is lowered for
# ------------------------------------------------------------------------------------------------

_GPU = ("cuda", "rocm")


def _targets() -> dict:
  """{lowering platform: pallas_kernels.backends.Platform} for the platforms whose kernels this
  process can trace: its default backend's, plus the platform of the abstract device of the
  current abstract mesh (cross-lowering), with their device kinds."""
  Platform = _kernel_module(package="pallas_kernels.backends").Platform
  out = {}
  backend = jax.default_backend()
  if backend in ("gpu", "tpu"):
    from jax.extend import backend as jex_backend
    name = backend
    if backend == "gpu":
      rocm = "rocm" in jex_backend.get_backend().platform_version.lower()
      name = "rocm" if rocm else "cuda"
    out[name] = Platform(name, jax.devices()[0].device_kind)
  dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if dev is not None:
    name = dev.platform
    if name in ("gpu", *_GPU):
      amd = name == "rocm" or "amd" in str(dev.device_kind).lower()
      name = "rocm" if amd else "cuda"
    if name in ("cuda", "rocm", "tpu"):
      out[name] = Platform(name, str(dev.device_kind or ""))
  return out


_unavailable_p = jex_core.Primitive("condattn_attention_unavailable")
_unavailable_p.def_abstract_eval(lambda x, *, msg, aval: aval)


def _lower_unavailable(ctx, x, *, msg, aval):
  raise ValueError(msg)


mlir.register_lowering(_unavailable_p, _lower_unavailable)


def _batch_unavailable(args, dims, *, msg, aval):
  """vmap of a placeholder branch (a vmapped model traces every platform's branch): the
  placeholder of the batched shape, still raising `msg` if lowered."""
  (x,), (d,) = args, dims
  x = jnp.moveaxis(x, d, 0)
  out = jax.core.ShapedArray((x.shape[0], *aval.shape), aval.dtype)
  return _unavailable_p.bind(x, msg=msg, aval=out), 0


batching.primitive_batchers[_unavailable_p] = _batch_unavailable


def _unavailable(msg: str):
  """A branch that traces anywhere and whose lowering raises `msg` (never a wrong kernel)."""
  def branch(q, k, v, mask):
    avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]

    @jax.custom_vjp
    def f(q, k, v):
      return _unavailable_p.bind(q, msg=msg, aval=avals[0])

    def fwd(q, k, v):
      return f(q, k, v), None

    def bwd(_, ct):
      return tuple(_unavailable_p.bind(ct, msg=msg, aval=a) for a in avals)

    f.defvjp(fwd, bwd)
    return f(q, k, v)
  return branch


def _cross_lowering_msg(platform: str, what: str) -> str:
  return (f"ops.attention: cannot lower {what} for {platform!r}: it was traced in a process whose "
          f"backend is {jax.default_backend()!r}. Trace on a {platform} host, or cross-lower under "
          "jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice("
          f"device_kind=..., num_cores=..., platform={'gpu' if platform in _GPU else platform!r})))")


def _for_platform(platform: str, make_branch, what: str, targets: dict):
  """make_branch(Platform) -> fn(q, k, v, mask) if this process can lower for `platform`, else a
  placeholder whose lowering raises how to cross-lower."""
  if platform not in targets:
    return _unavailable(_cross_lowering_msg(platform, what))
  return make_branch(targets[platform])


def by_lowering_platform(q, k, v, mask: MaskSpec, *, default, **per_platform):
  """fn(q, k, v, mask) picked for the platform the call is LOWERED for: per_platform maps
  'cuda' / 'rocm' / 'tpu' to make(Platform) -> fn; `default` (a fn) runs everywhere else. A
  platform this process cannot trace for gets a placeholder whose lowering raises how to
  cross-lower. (The dispatch of `attention`, for composites built on it.)"""
  targets = _targets()
  branches = {p: _for_platform(p, make, "this attention branch", targets)
              for p, make in per_platform.items()}
  if not branches:
    return default(q, k, v, mask)
  return lax.platform_dependent(q, k, v, mask, default=default, **branches)


# ------------------------------------------------------------------------------------------------
# Per-shard execution under a mesh
# ------------------------------------------------------------------------------------------------

def _activation_axes() -> tuple[tuple[str, ...], str | None]:
  """(batch mesh axes, head mesh axis) of attention's activations, from the logical-axis rules
  table (condattn_jax/train/sharding.py: activation_batch, activation_heads)."""
  from condattn_jax.train import sharding
  rules = dict(sharding.RULES)
  batch = rules["activation_batch"]
  batch = () if batch is None else ((batch,) if isinstance(batch, str) else tuple(batch))
  return batch, rules["activation_heads"]


def _mesh_shards(B: int, N: int, K: int):
  """(mesh, batch axes, head axis, token axis) to run a kernel per shard on, or None (no /
  trivial mesh, axes already manual, or shapes the mesh does not divide). The rules table's
  size-1 axes are named too (batch, heads, tokens: the token axis only when it has size 1): an
  axis the specs leave out is one the inputs are replicated over, and shard_map's transpose
  sums their cotangents over it (an all-reduce of dQ / dK / dV per attention call, over groups
  of one device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size <= 1:
    return None
  sizes = {a: n for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
           if t != jax.sharding.AxisType.Manual}
  usable = {a: n for a, n in sizes.items() if n > 1}
  batch_axes, head_axis = _activation_axes()
  batch = tuple(a for a in batch_axes if a in usable)
  head = head_axis if head_axis in usable else None
  nb = 1
  for a in batch:
    nb *= usable[a]
  if B % nb or (head is not None and (N % usable[head] or K % usable[head])):
    return None
  if not batch and head is None:
    return None
  one = lambda a: isinstance(a, str) and sizes.get(a) == 1
  batch = tuple(a for a in batch_axes if a in usable or one(a))
  head = head if head is not None else (head_axis if one(head_axis) else None)
  from condattn_jax.train import sharding
  length = dict(sharding.RULES).get("activation_length")
  return mesh, (batch or None), head, (length if one(length) else None)


def per_shard(fn):
  """fn(q, k, v, mask) run per shard under the current mesh (batch and heads over the mesh axes
  the rules table gives attention activations), or as is when there is no usable mesh."""
  def run(q, k, v, mask):
    where = _mesh_shards(q.shape[0], q.shape[2], k.shape[2])
    if where is None:
      return fn(q, k, v, mask)
    mesh, batch, head, length = where
    P = jax.sharding.PartitionSpec
    heads, rows = P(batch, length, head, None), P(batch, length)
    act = mask.active
    bl = mask.block_lists
    mspec = dataclasses.replace(
        mask, q_positions_BT=rows, kv_positions_BS=rows,
        q_segment_ids_BT=None if mask.q_segment_ids_BT is None else rows,
        kv_segment_ids_BS=None if mask.kv_segment_ids_BS is None else rows,
        active=None if act is None else (rows if act.ndim == 2 else P(batch, length, head)),
        kv_lengths_B=None if mask.kv_lengths_B is None else P(batch),
        block_lists=None if bl is None else dataclasses.replace(
            bl, kv_blocks_BNQL=P(batch, head, length, None),
            head_mode_BN=None if bl.head_mode_BN is None else P(batch, head)))
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, mspec), out_specs=heads,
                         check_vma=False)(q, k, v, mask)
  return run


# ------------------------------------------------------------------------------------------------
# The one resolver: which kernel backend runs a call, per lowering platform
# ------------------------------------------------------------------------------------------------

def backends(kind: str) -> tuple:
  """The backends of kernel package `kind` ('compact' | 'block_sparse' | 'decode'): its BACKENDS,
  in preference order, the reference last."""
  if kind == "compact":
    return _kernel_module().BACKENDS
  if kind == "decode":
    return _kernel_module(package=_DECODE).BACKENDS
  return _kernel_module(package=_BLOCK_SPARSE).BACKENDS


def resolve(kind: str, impl: str, q_shape, kv_shape, dtype, platform, **static):
  """(backend, reasons): the backend of kernel package `kind` that runs `impl` lowered for
  `platform` (a pallas_kernels.backends.Platform). impl 'auto' / 'pallas': the first backend
  that supports the call (backend None where only the reference does; reasons then says why
  each kernel declined); a kernel name ('triton', 'mosaic_gpu', 'mosaic_tpu'): that backend, or
  None with its reason. static: the package's static call arguments (block_q, block_k)."""
  reasons = []
  for be in backends(kind):
    if be.name == "reference" or (impl in KERNEL_IMPLS and be.name != impl):
      continue
    if impl not in KERNEL_IMPLS and platform.name not in be.lowers_for:
      continue  # another platform's kernel: not a candidate, not worth a reason
    why = be.supports(q_shape, kv_shape, dtype, platform, **static)
    if why is None:
      return be, []
    reasons.append(f"{be.name}: {why}")
  if impl in KERNEL_IMPLS and not reasons:
    reasons.append(f"{impl}: not a backend of the {kind} kernels")
  return None, reasons


def _interpret_params(name: str):
  """Pallas interpret mode for kernel `name` (CPU)."""
  if name == "mosaic_tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return True


# ------------------------------------------------------------------------------------------------
# Implementations: fn(q, k, v, mask) -> out, for one lowering platform each
# ------------------------------------------------------------------------------------------------

def _reference(scale):
  ref = _kernel_module("reference")

  def fn(q, k, v, mask):
    return ref.reference_attention(q, k, v, mask.dense_mask(), scale=scale)[0]
  return fn


def _cudnn(scale):
  def fn(q, k, v, mask):
    local = None if mask.window is None else (mask.window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=local, implementation="cudnn")
  return fn


def merge_attention_parts(o, lse, axis: int):
  """Online-softmax merge of partial attentions stacked on `axis` (a non-negative axis of lse):
  o [..., P, ..., H] each normalised over its own keys, lse the same shape without H. A part
  with lse = -inf (no visible key) weighs 0; all parts empty -> zeros and lse -inf (no NaN).
  Returns (o without the P axis, lse of the union). (pallas_kernels.decode.merge_parts: the
  decode kernels' merge, the cuDNN decode path's and the context-parallel ring's.)"""
  return _kernel_module(package=_DECODE).merge_parts(o, lse, axis)


DECODE_CTAS = 264  # cuDNN decode: split the kv length until about 2 programs per H100 SM


def decode_splits(B: int, S: int, K: int) -> int:
  """Kv splits of the cuDNN decode path: the largest power of two P with B * K * P <=
  DECODE_CTAS, S % P == 0 and S / P >= 128 (cuDNN runs one program per (row, kv head, query
  tile) and walks the kv length in it: at B = 1 an unsplit call leaves most of the GPU idle);
  where no power of two above 1 divides S, the largest other divisor within the same bounds (a
  cache of 32907 slots splits 21 ways at B = 1, K = 2, instead of one program per kv head
  walking all of it); a prime S stays unsplit (Engine warns of such a cache on a GPU)."""
  most = min(DECODE_CTAS // max(B * K, 1), S // 128)
  P = 1
  while P * 2 <= most and S % (P * 2) == 0:
    P *= 2
  if P == 1:
    P = next((d for d in range(most, 1, -1) if S % d == 0), 1)
  return P


def _cudnn_decode(scale, implementation: str = "cudnn", splits: int | None = None):
  """One query per row over a full cache through cuDNN with per-row kv lengths.

  The GQA group is folded into the query rows: q [B, 1, K*G, H] -> [B, G, K, H] (G query rows
  per kv head, no causal mask: the whole fill is visible), so each K/V tile is read once for its
  group. The kv length is split into P = decode_splits(...) contiguous parts that run as extra
  rows ([B, S, K, H] -> [B*P, S/P, K, H], a free reshape), each with its own kv length (the part
  of the fill inside it; 1 where it is empty or the row inactive, then weighted 0), combined by
  their log-sum-exp. An inactive row gives zeros. implementation: jax.nn.dot_product_attention's
  ('xla': the same path on any backend, for tests)."""
  def fn(q, k, v, mask):
    B, _, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    P = decode_splits(B, S, K) if splits is None else splits
    Sp = S // P
    lengths_B = mask.kv_lengths_B.astype(jnp.int32)
    on_B = lengths_B > 0
    if mask.active is not None:
      on_B = on_B & mask.active[:, 0]
    q_BGKH = q.reshape(B, K, G, H).transpose(0, 2, 1, 3)
    q_XGKH = jnp.broadcast_to(q_BGKH[:, None], (B, P, G, K, H)).reshape(B * P, G, K, H)
    start_P = jnp.arange(P, dtype=jnp.int32) * Sp
    len_BP = jnp.clip(lengths_B[:, None] - start_P[None, :], 0, Sp)
    on_BP = (len_BP > 0) & on_B[:, None]
    o_XGKH, lse_XGK = jax.nn.dot_product_attention(
        q_XGKH, k.reshape(B * P, Sp, K, H), v.reshape(B * P, Sp, K, H), scale=scale,
        key_value_seq_lengths=jnp.where(on_BP, len_BP, 1).reshape(B * P),
        implementation=implementation, return_residual=True)
    # jax hands lse as [X, G, K] (a transpose of cuDNN's [X, K, G]): undone, XLA drops both;
    # the merge reorders only the weights (a part that did not run, or an inactive row's: -inf,
    # weighs 0; a row with none gives zeros)
    lse_BPKG = jnp.where(on_BP[:, :, None, None],
                         lse_XGK.transpose(0, 2, 1).reshape(B, P, K, G), -jnp.inf)
    o_BGKH = _kernel_module(package=_DECODE).merge_decode_parts(
        o_XGKH.reshape(B, P, G, K, H), lse_BPKG, axis=1, lse_perm=(0, 1, 3, 2))
    return o_BGKH.transpose(0, 2, 1, 3).reshape(B, 1, N, H).astype(q.dtype)
  return fn


def _segment_starts(segment_ids_BT):
  """Index of the first token of each token's (contiguous) document."""
  T = segment_ids_BT.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)[None, :]
  prev = jnp.concatenate([jnp.full_like(segment_ids_BT[:, :1], -1), segment_ids_BT[:, :-1]], axis=1)
  return lax.cummax(jnp.where(segment_ids_BT != prev, idx, 0), axis=1)


def _cross_compiled(op):
  """A tokamax op (and its VJP op, which runs at transpose time) without the check that this
  process has the op's device: for cross-lowering from another host."""
  vjp = getattr(op, "vjp", None)
  if vjp is not None and hasattr(vjp, "bypass_device_check"):
    op = dataclasses.replace(op, vjp=dataclasses.replace(vjp, bypass_device_check=True))
  return dataclasses.replace(op, bypass_device_check=True)


def _tokamax(scale, kernels: tuple[str, ...]):
  """tokamax attention with a per-query k_start (document start, window) and a causal mask; the
  first of `kernels` that takes the shape runs. Padding queries (segment 0) give zeros."""
  def fn(q, k, v, mask):
    try:  # lazy: heavy, only the fused path needs it
      from tokamax._src.ops.attention import api, base
    except ImportError as e:  # auto moves on to the compacted kernel; explicit impl names this
      raise NotImplementedError(f"tokamax cannot be imported ({e}); pip install tokamax==0.0.17 "
                                "(or use impl='auto' / 'pallas')") from e
    B, T = q.shape[:2]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    seg = mask.q_segment_ids_BT
    start = jnp.zeros((B, T), jnp.int32) if seg is None else _segment_starts(seg)
    if mask.window is not None:
      start = jnp.maximum(start, idx - mask.window + 1)
    tmask = base.Mask(k_start=start[:, None, :], is_causal=True)
    kw = {} if scale is None else dict(logits_scale=scale)
    cross = contextlib.nullcontext()
    if jax.default_backend() != "gpu" and kernels != ("xla",):
      import tokamax.config  # tokamax's documented switch for cross-compiling
      cross = tokamax.config.cross_compile(True)
    errors = []
    with cross:
      for name in kernels:
        op = api.IMPLEMENTATIONS[name]
        if jax.default_backend() != "gpu" and name != "xla":
          op = _cross_compiled(op)
        try:
          out = op(q, k, v, mask=tmask, **kw)
        except NotImplementedError as e:  # this kernel cannot take the shape: try the next one
          errors.append(f"{name}: {e}")
          continue
        return out if seg is None else jnp.where((seg != 0)[:, :, None, None], out,
                                                 0).astype(q.dtype)
    raise NotImplementedError("no tokamax kernel took this call: " + "; ".join(errors))
  return fn


def _pallas(scale, backend, interpret: Any = False):
  """A compacted-query backend (pallas_kernels.compact_attention.BACKENDS) with an all-true
  active set when none is given."""
  def fn(q, k, v, mask):
    B, T = q.shape[:2]
    active = jnp.ones((B, T), jnp.bool_) if mask.active is None else mask.active
    qseg, kvseg = mask.q_segment_ids_BT, mask.kv_segment_ids_BS
    if qseg is None and kvseg is not None:  # a cache's validity: the chunk is one document
      kvseg = (kvseg != 0).astype(jnp.int32)
      qseg = jnp.ones((B, T), jnp.int32)
    qpos, kvpos = mask.q_positions_BT, mask.kv_positions_BS
    if mask.contiguous and kvseg is None:  # one document per row: positions are arange(T)
      qpos = kvpos = None
    return backend(q, k, v, active, q_positions_BT=qpos, kv_positions_BS=kvpos,
                   q_segment_ids_BT=qseg, kv_segment_ids_BS=kvseg, window=mask.window,
                   scale=scale, interpret=interpret)
  return fn


def _block_sparse(scale, kernel_impl: str, interpret: Any = False):
  """pallas_kernels.block_sparse for a mask with block lists (its tiles are the lists' blocks)."""
  def fn(q, k, v, mask):
    bl = mask.block_lists
    return _kernel_module(package=_BLOCK_SPARSE).block_sparse_attention(
        q, k, v, bl.kv_blocks_BNQL, bl.head_mode_BN, block_q=bl.block_q, block_k=bl.block_k,
        q_positions_BT=mask.q_positions_BT, kv_positions_BS=mask.kv_positions_BS,
        q_segment_ids_BT=mask.q_segment_ids_BT, kv_segment_ids_BS=mask.kv_segment_ids_BS,
        window=mask.window, sinks=mask.sinks, active=mask.active, scale=scale,
        impl=kernel_impl, interpret=interpret)
  return fn


def _decode_kernel(scale, backend, interpret: Any = False):
  """fn(q, k, v, mask) running a decode backend (pallas_kernels.decode.BACKENDS), per shard under
  a mesh. The kernels run forward only: the VJP is the reference's (T is a few tokens)."""
  def fn(q, k, v, mask):
    @jax.custom_vjp
    def run(q, k, v, mask):
      bl = mask.block_lists
      lists = {} if bl is None else dict(
          kv_blocks_BNQL=bl.kv_blocks_BNQL, head_mode_BN=bl.head_mode_BN, block_q=bl.block_q,
          list_block_k=bl.block_k, lists_shared=bl.shared_by_kv_head)
      return backend(q, k, v, q_positions_BT=mask.q_positions_BT,
                     kv_positions_BS=mask.kv_positions_BS, kv_lengths_B=mask.kv_lengths_B,
                     kv_valid_BS=mask.kv_segment_ids_BS if mask.kv_lengths_B is None else None,
                     active=mask.active, window=mask.window, sinks=mask.sinks, scale=scale,
                     interpret=interpret, **lists)

    def run_fwd(q, k, v, mask):
      return run(q, k, v, mask), (q, k, v, mask)

    def run_bwd(res, ct):
      q, k, v, mask = res
      _, vjp = jax.vjp(lambda q, k, v: _reference(scale)(q, k, v, mask), q, k, v)
      zeros = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0)
                           if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_
                           else jnp.zeros_like(x), mask)
      return (*vjp(ct), zeros)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, mask)
  return per_shard(fn)


def _kind(mask: MaskSpec) -> str:
  return "compact" if mask.block_lists is None else "block_sparse"


def _static_args(mask: MaskSpec) -> dict:
  bl = mask.block_lists
  return {} if bl is None else dict(block_q=bl.block_q, block_k=bl.block_k,
                                    window_blocks=bl.window_blocks)


def _kernel(backend, mask: MaskSpec, scale, interpret: Any = False):
  """fn(q, k, v, mask) running `backend` (per shard under a mesh)."""
  if mask.block_lists is None:
    return per_shard(_pallas(scale, backend, interpret))
  return per_shard(_block_sparse(scale, backend.name, interpret))


@functools.cache
def _warn_once(msg):
  logging.warning(msg)


def _auto(scale, platform):
  """impl='auto' lowered for `platform` (a Platform): on cuda, cudnn (unpacked) or tokamax
  (packed, causal) for contiguous self-attention; else the resolver's kernel backend; a mask
  no kernel takes (sinks without block lists, a shape no kernel fits) uses the reference,
  warned once."""
  cudnn, tok = _cudnn(scale), per_shard(_tokamax(scale, ("mosaic_gpu", "triton")))
  cudnn_decode = per_shard(_cudnn_decode(scale))
  ref = _reference(scale)

  def fn(q, k, v, mask):
    decode_backend = None
    if not decode_kernel_reasons(q, mask):
      lb = None if mask.block_lists is None else mask.block_lists.block_k
      decode_backend, _ = resolve("decode", "auto", q.shape, k.shape, q.dtype, platform,
                                  list_block_k=lb)
    if (platform.name == "cuda" and not decode_reasons(q, mask)
        and cudnn_available() is None
        and not (decode_backend is not None and decode_backend.config.over_cudnn)):
      try:
        return cudnn_decode(q, k, v, mask)
      except NotImplementedError:  # this GPU / cuDNN cannot take the shape
        pass
    if decode_backend is not None:  # window / sinks / per-head active / lists / a few queries
      return _decode_kernel(scale, decode_backend)(q, k, v, mask)
    if platform.name == "cuda" and not _fused_reasons(q, mask):
      if not cudnn_reasons(q, mask) and cudnn_available() is None:
        try:
          return cudnn(q, k, v, mask)
        except NotImplementedError:  # this GPU / cuDNN cannot take the shape
          pass
      # Packed documents with a window: tokamax turns the window into a per-query k_start that
      # its backward masks but does not skip (docs/performance.md), while the compacted kernel's
      # tile bounds stop at the window. tokamax stays for causal packed documents.
      if mask.window is None or _pallas_reasons(mask):
        try:
          return tok(q, k, v, mask)
        except NotImplementedError:
          pass
    why = _pallas_reasons(mask)
    backend = None
    if not why:
      backend, why = resolve(_kind(mask), "auto", q.shape, k.shape, q.dtype, platform,
                             **_static_args(mask))
    if backend is None:
      _warn_once(f"ops.attention(impl='auto') on {platform.name}: no kernel takes this call "
                 f"({'; '.join(why)}); using the O(T*S) reference.")
      return ref(q, k, v, mask)
    return _kernel(backend, mask, scale)(q, k, v, mask)
  return fn


def _explicit_error(impl, why):
  return ValueError(f"ops.attention impl={impl!r} cannot take this call: {'; '.join(why)}. "
                    "Use impl='auto' (or 'reference').")


def _explicit_kernel(impl: str, scale, platform):
  """impl 'pallas' or a kernel name, lowered for `platform` (None: this host's CPU, the kernel in
  Pallas interpret mode: 'pallas' there is the Triton kernel)."""
  def fn(q, k, v, mask):
    if why := _pallas_reasons(mask):
      raise _explicit_error(impl, why)
    static = _static_args(mask)
    if platform is not None and not any(
        platform.name in b.lowers_for for b in backends(_kind(mask))
        if b.name != "reference" and impl in ("pallas", b.name)):
      return _unavailable(f"ops.attention impl={impl!r}: no {_kind(mask)} kernel of that name "
                          f"lowers for {platform.name}; use impl='auto' or 'pallas'")(q, k, v, mask)
    if platform is None:
      name = "triton" if impl == "pallas" else impl
      backend = next((b for b in backends(_kind(mask)) if b.name == name), None)
      if backend is None:
        raise _explicit_error(impl, [f"{name}: not a backend of the {_kind(mask)} kernels"])
      run = _kernel(backend, mask, scale, _interpret_params(name))
    else:
      backend, why = resolve(_kind(mask), impl, q.shape, k.shape, q.dtype, platform, **static)
      if backend is None:
        raise _explicit_error(impl, why)
      run = _kernel(backend, mask, scale)
    try:
      return run(q, k, v, mask)
    except ValueError as e:  # the kernel's own ValueError (e.g. a head_dim it cannot take)
      raise _explicit_error(impl, [str(e)]) from e
  return fn


def _branches(impl: str, q, mask: MaskSpec, scale):
  """{lowering platform or 'default': fn(q, k, v, mask)} for `impl`; raises for calls it cannot
  take."""
  if impl not in IMPLS:
    raise ValueError(f"ops.attention: unknown impl {impl!r}; choose one of {IMPLS}")
  if impl == "reference":
    return dict(default=_reference(scale))
  if impl == "cudnn" and not decode_reasons(q, mask):
    if (unavailable := cudnn_available()) is not None:
      raise _explicit_error(impl, [unavailable + "; trace on a CUDA GPU host"])
    return dict(default=per_shard(_cudnn_decode(scale)))
  if impl == "cudnn":
    why = cudnn_reasons(q, mask)
    if not why and (unavailable := cudnn_available()) is not None:
      why = [unavailable + "; trace on a CUDA GPU host"]
    if why:
      raise _explicit_error(impl, why)
    return dict(default=_cudnn(scale))
  if impl == "tokamax":
    if why := _fused_reasons(q, mask):
      raise _explicit_error(impl, why)
    gpu = per_shard(_tokamax(scale, ("mosaic_gpu", "triton")))

    def on_gpu(*args):
      try:
        return gpu(*args)
      except NotImplementedError as e:
        raise _explicit_error(impl, [str(e)]) from e
    return dict(default=per_shard(_tokamax(scale, ("xla",))),
                cuda=_for_platform("cuda", lambda _: on_gpu, "impl='tokamax'", _targets()))
  default = _reference(scale) if impl == "auto" else _explicit_kernel(impl, scale, None)
  targets = _targets()
  if impl in ("mosaic_gpu", "mosaic_tpu") and targets:
    # Pallas' Mosaic interpreters use ordered callbacks, which a cond lowered for one platform
    # cannot carry in another branch: the CPU branch is a placeholder when a GPU / TPU is traced.
    default = _unavailable(f"ops.attention impl={impl!r}: the CPU branch (Pallas' Mosaic "
                           "interpreter) is not lowered beside a GPU / TPU branch; run it on CPU "
                           "without an abstract device mesh")
  make = ((lambda p: _auto(scale, p)) if impl == "auto"
          else (lambda p: _explicit_kernel(impl, scale, p)))
  what = "ops.attention" if impl == "auto" else f"impl={impl!r}"
  return dict(default=default, **{p: _for_platform(p, make, what, targets)
                                  for p in ("cuda", "rocm", "tpu")})


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------

def attention(q_BTNH, k_BSKH, v_BSKH, mask: MaskSpec, *, impl: str = "auto",
              scale: float | None = None):
  """Attention out[B, T, N, H] (q's dtype) under `mask` (an ops.MaskSpec).

  q_BTNH: queries; k_BSKH, v_BSKH: keys / values with K kv heads (N % K == 0; grouped-query
  attention without repeating K/V). Queries that see no key (padding, inactive, empty window)
  give zeros. impl: see the module docstring. scale: logits scale (default H ** -0.5).
  """
  if not isinstance(mask, MaskSpec):
    raise TypeError(f"ops.attention: mask must be an ops.MaskSpec, got {type(mask).__name__}")
  q, k, v = map(jnp.asarray, (q_BTNH, k_BSKH, v_BSKH))
  mask = jax.tree.map(jnp.asarray, mask)
  _check(q, k, v, mask)
  from condattn_jax.parallel import context  # rows split over the `sequence` mesh axis
  if context.applies(mask):
    return context.attention(q, k, v, mask, impl=impl, scale=scale)
  branches = _branches(impl, q, mask, scale)
  default = branches.pop("default")
  if not branches:
    return default(q, k, v, mask)
  return lax.platform_dependent(q, k, v, mask, default=default, **branches)
