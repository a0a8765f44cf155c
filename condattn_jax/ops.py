"""The one place that picks an attention kernel.

`attention`: causal (optionally sliding-window) attention with packed-document masks.
  impl "xla"     : the reference (also the CPU path): masked softmax in float32, any layout.
  impl "cudnn"   : jax.nn.dot_product_attention(implementation="cudnn"); self-attention without
                   packing only.
  impl "tokamax" : tokamax.dot_product_attention with a per-query k_start mask (packed documents
                   stored contiguously); self-attention only.
  impl "auto"    : GPU -> tokamax (cudnn when unpacked), anything else -> xla. Layouts the fast
                   paths cannot take (caches, offsets) always use xla.
`compact_attention`: attention for a subset of queries (L2A global branch); see
  pallas_kernels.compact_attention.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30  # finite: a fully masked row gives zeros, never NaN


def attention_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT=None, kv_segment_ids_BS=None,
                   *, window: int | None = None):
  """Boolean mask [B, T, S]: same document, causal on positions, inside the window.

  Segment id 0 marks padding / empty cache slots: such keys are never attended.
  """
  qp = q_positions_BT[:, :, None]
  kp = kv_positions_BS[:, None, :]
  mask = kp <= qp
  if window is not None:
    mask &= (qp - kp) < window
  if kv_segment_ids_BS is not None:
    ks = kv_segment_ids_BS[:, None, :]
    mask &= ks != 0
    if q_segment_ids_BT is not None:
      mask &= q_segment_ids_BT[:, :, None] == ks
  return mask


def reference_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, *, scale=None):
  """Grouped-query attention without repeating K/V; float32 softmax; empty rows give zeros."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                      preferred_element_type=jnp.float32) * scale
  mask = mask_BTS[:, None, None, :, :]
  logits = jnp.where(mask, logits, NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - m) * mask
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v_BSKH.dtype), v_BSKH,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H).astype(q_BTNH.dtype)


def _segment_starts(segment_ids_BT):
  """Index of the first token of each token's (contiguous) document."""
  T = segment_ids_BT.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)[None, :]
  prev = jnp.concatenate([jnp.full_like(segment_ids_BT[:, :1], -1), segment_ids_BT[:, :-1]], axis=1)
  boundary = jnp.where(segment_ids_BT != prev, idx, 0)
  return lax.cummax(boundary, axis=1)


def _tokamax_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window, scale, implementations):
  """tokamax attention with a per-query k_start (document start, window) plus causal mask."""
  from tokamax._src.ops.attention import api, base  # lazy: heavy, only the fused path needs it
  T = q_BTNH.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)[None, :]
  start = jnp.zeros_like(idx) if segment_ids_BT is None else _segment_starts(segment_ids_BT)
  if window is not None:
    start = jnp.maximum(start, idx - window + 1)
  mask = base.Mask(k_start=start[:, None, :], is_causal=True)
  kw = {} if scale is None else dict(logits_scale=scale)
  errors = []
  for name in implementations:
    try:
      return api.IMPLEMENTATIONS[name](q_BTNH, k_BSKH, v_BSKH, mask=mask, **kw)
    except NotImplementedError as e:  # this kernel cannot take the shape: try the next one
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no tokamax attention kernel took this call: " + "; ".join(errors))


@functools.cache
def _warn_once(msg):
  logging.warning(msg)


def attention(q_BTNH, k_BSKH, v_BSKH, *, q_positions_BT, kv_positions_BS,
              q_segment_ids_BT=None, kv_segment_ids_BS=None, window: int | None = None,
              scale: float | None = None, impl: str = "auto", self_attention: bool = False):
  """Causal attention out[B, T, N, H] on original positions.

  Args:
    q_BTNH: queries; k_BSKH, v_BSKH: keys/values with K kv heads (N % K == 0).
    q_positions_BT, kv_positions_BS: token positions; a key is visible when kv_pos <= q_pos
      (and q_pos - kv_pos < window).
    q_segment_ids_BT, kv_segment_ids_BS: packed-document ids (0 = padding, never attended).
    self_attention: the caller promises q and kv are the same tokens laid out contiguously
      (training / full forward): positions restart at 0 per document and documents are
      contiguous. Only then may the fused GPU kernels run.
  """
  q_BTNH, k_BSKH, v_BSKH = map(jnp.asarray, (q_BTNH, k_BSKH, v_BSKH))
  if impl == "auto":
    impl = "xla"
    if self_attention and jax.default_backend() == "gpu":
      impl = "tokamax" if q_segment_ids_BT is not None else "cudnn"
  if impl != "xla" and not self_attention:
    _warn_once(f"ops.attention: impl={impl!r} needs self_attention layout; using the XLA reference.")
    impl = "xla"
  if impl == "cudnn":
    if q_segment_ids_BT is not None:
      raise ValueError("ops.attention impl='cudnn' cannot take packed segment ids; use "
                       "attention_impl='tokamax' or 'auto'.")
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=True,
                                        local_window_size=local, implementation="cudnn")
  if impl == "tokamax":
    impls = ("mosaic_gpu", "triton") if jax.default_backend() == "gpu" else ("xla",)
    return _tokamax_attention(q_BTNH, k_BSKH, v_BSKH, q_segment_ids_BT, window, scale, impls)
  if impl != "xla":
    raise ValueError(f"ops.attention: unknown impl {impl!r}; choose auto, xla, cudnn or tokamax.")
  mask = attention_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                        window=window)
  return reference_attention(q_BTNH, k_BSKH, v_BSKH, mask, scale=scale)


def _compact_kernel():
  """pallas_kernels.compact_attention.compact_attention, or None before that package exists."""
  try:
    from pallas_kernels.compact_attention import compact_attention as kernel
  except ImportError:
    return None
  return kernel


_BATCH_AXES = ("data", "fsdp")
_HEAD_AXIS = "tensor"


def _mesh_shards(B: int, N: int, K: int):
  """(mesh, batch axes, head axis) to shard a kernel call over, or None (no / trivial mesh,
  or shapes the mesh does not divide)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size <= 1:
    return None
  names = set(mesh.axis_names)
  batch = tuple(a for a in _BATCH_AXES if a in names and mesh.shape[a] > 1)
  head = _HEAD_AXIS if _HEAD_AXIS in names and mesh.shape[_HEAD_AXIS] > 1 else None
  nb = 1
  for a in batch:
    nb *= mesh.shape[a]
  if B % nb or (head is not None and (N % mesh.shape[head] or K % mesh.shape[head])):
    return None
  if not batch and head is None:
    return None
  return mesh, (batch or None), head


def compact_attention(q_BTNH, k_BSKH, v_BSKH, active_BT, *, q_positions_BT, kv_positions_BS,
                      q_segment_ids_BT=None, kv_segment_ids_BS=None, window: int | None = None,
                      scale: float | None = None, impl: str = "auto", shard: bool | None = None):
  """Causal attention for the active queries only (L2A's global branch); zeros elsewhere.

  Same masks as `attention` (positions, window, segment ids with 0 = never attended), plus
  `active_BT` (bool [B, T]): inactive query rows are not computed and come back as zeros.

  impl: 'auto'      -> pallas_kernels.compact_attention (Triton on GPU, Mosaic on TPU, its jnp
                       reference elsewhere; compaction into static buckets, no recompiles),
        'reference' -> that package's reference; 'triton' | 'mosaic_tpu' -> that kernel;
        'xla'       -> the masked dense reference of this module (no package needed).
  kv segment ids alone (decode: the cache's validity) are allowed: the query chunk is then
  taken as segment 1, i.e. one document, and sees every valid slot.
  """
  q_BTNH, k_BSKH, v_BSKH = map(jnp.asarray, (q_BTNH, k_BSKH, v_BSKH))
  active_BT = jnp.asarray(active_BT, jnp.bool_)
  kernel = None if impl == "xla" else _compact_kernel()
  if kernel is None:
    if impl not in ("auto", "xla", "reference"):
      raise ValueError(f"ops.compact_attention impl={impl!r} needs the pallas_kernels package "
                       "(not importable); use impl='xla'.")
    mask = attention_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                          window=window)
    return reference_attention(q_BTNH, k_BSKH, v_BSKH, mask & active_BT[:, :, None], scale=scale)
  if q_segment_ids_BT is not None and kv_segment_ids_BS is None:
    raise ValueError("ops.compact_attention: q_segment_ids_BT without kv_segment_ids_BS.")
  if q_segment_ids_BT is None and kv_segment_ids_BS is not None:
    kv_segment_ids_BS = (jnp.asarray(kv_segment_ids_BS) != 0).astype(jnp.int32)
    q_segment_ids_BT = jnp.ones(q_BTNH.shape[:2], jnp.int32)
  call = lambda q, k, v, a, qp, kp, qs, ks: kernel(
      q, k, v, a, q_positions_BT=qp, kv_positions_BS=kp, q_segment_ids_BT=qs,
      kv_segment_ids_BS=ks, window=window, scale=scale, impl=impl)
  args = (q_BTNH, k_BSKH, v_BSKH, active_BT, jnp.asarray(q_positions_BT, jnp.int32),
          jnp.asarray(kv_positions_BS, jnp.int32), q_segment_ids_BT, kv_segment_ids_BS)
  # A Pallas kernel is one opaque call: under a mesh run it per shard (batch over data/fsdp,
  # heads over tensor) instead of letting the partitioner gather its inputs.
  if shard is None:
    shard = impl not in ("reference", "xla") and jax.default_backend() in ("gpu", "tpu")
  B, N, K = q_BTNH.shape[0], q_BTNH.shape[2], k_BSKH.shape[2]
  where = _mesh_shards(B, N, K) if shard else None
  if where is None:
    return call(*args)
  mesh, batch, head = where
  P = jax.sharding.PartitionSpec
  heads, rows = P(batch, None, head, None), P(batch, None)
  specs = (heads, heads, heads, rows, rows, rows,
           None if q_segment_ids_BT is None else rows,
           None if kv_segment_ids_BS is None else rows)
  return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)
