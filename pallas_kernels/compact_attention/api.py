"""compact_attention: attention for a data-dependent subset of queries (L2A global branch, AHA).

    out_BTNH = compact_attention(q_BTNH, k_BSKH, v_BSKH, active_BT)             # L2A
    out_BTNH = compact_attention(q_BTNH, k_BSKH, v_BSKH, active_BTN)            # AHA (per head)
    out_BTNH, lse_BTN = compact_attention(..., return_lse=True)

Active queries are compacted (in order, original positions kept) into a static bucket: the
smallest of a short ladder of capacities (default T/4 and T) that holds the largest active count
of any row, chosen at run time by lax.switch over precompiled branches, so nothing recompiles per
step and no active query is ever dropped (the ladder always ends with a bucket that holds all T
queries). The kernels size their work by the actual count (tiles past it are skipped), so a
bucket larger than the count costs only gather / scatter traffic, not compute; on GPUs the
gathers and putting results back are Pallas kernels bounded by the count too (glue.py), so the
GPU path runs one full-T bucket and no lax.switch (CompactConfig.glue_kernels). The kernel
runs flash attention on the compacted queries with the causal / window / segment mask evaluated
on original positions, skipping kv tiles that no query of a tile can see; the backward pass
(custom_vjp, saving the log-sum-exp) skips query tiles that cannot see a kv tile. Results are
scattered back; inactive queries get zeros (and lse = -inf).

impl: 'reference' (the default), 'triton', 'mosaic_gpu' (Hopper: wgmma, TMA, warp
specialisation), 'mosaic_tpu': the kernel to run, by name; a kernel that cannot take a shape
raises ValueError naming why. Choosing a kernel per platform is condattn_jax.ops' job (its one
resolver reads `BACKENDS`, the pallas_kernels.backends interface); this package never looks at
the host platform. Tuning knobs (kernel variants) are fields of `CompactConfig`, passed per call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import compaction as cp
from . import glue
from pallas_kernels.backends import Platform, platform_reason

from .common import (GPU_BLOCK_SIZES, GPU_BLOCK_SIZES_F32, MGPU_BLOCK_SIZES, TPU_BLOCK_SIZES,
                     TRITON_SMEM_BYTES, BlockSizes, fit_triton_smem, triton_smem_estimate)
from .reference import reference_compact_attention

IMPLS = ("reference", "triton", "mosaic_gpu", "mosaic_tpu")
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _backend_module(name: str):
  if name == "triton":
    from . import triton as mod
  elif name == "mosaic_gpu":
    from . import mosaic_gpu as mod
  else:
    from . import mosaic_tpu as mod
  return mod


def kernel_support(impl: str, q_shape, kv_shape, dtype, bs: BlockSizes | None = None,
                   ) -> tuple[BlockSizes | None, str | None]:
  """(block sizes fitted to the shape, None) or (None, reason the kernel cannot take it).

  bs None = the backend's defaults, shrunk to fit; explicit block sizes are taken as given."""
  if bs is None:
    if impl == "mosaic_tpu":
      bs = TPU_BLOCK_SIZES
    elif impl == "mosaic_gpu":
      bs = MGPU_BLOCK_SIZES
    else:
      itemsize = jnp.dtype(dtype).itemsize
      bs = GPU_BLOCK_SIZES if itemsize <= 2 else GPU_BLOCK_SIZES_F32
      bs = fit_triton_smem(bs, q_shape[-1], itemsize) or bs
  H = q_shape[-1]
  S = kv_shape[1]
  if jnp.dtype(dtype) not in _FLOAT_DTYPES:
    return None, f"dtype {jnp.dtype(dtype).name} (supported: bfloat16, float16, float32)"
  blocks = ()
  b = bs
  while b is not None:
    blocks += (b.block_q, b.block_k, b.block_q_dq, b.block_k_dq, b.block_q_dkv, b.block_k_dkv)
    b = b.small
  if impl == "triton":
    if H & (H - 1) or not 16 <= H <= 256:
      return None, f"head_dim {H} (Triton kernel needs a power of two in [16, 256])"
    if any(b < 16 or b & (b - 1) for b in blocks):
      return None, f"block sizes {blocks} (Triton kernel needs powers of two >= 16)"
    fitted = bs.fit_kv(S, 16)
    if fitted is None:
      return None, f"kv length {S} (needs a multiple of 16)"
    smem = triton_smem_estimate(fitted, H, jnp.dtype(dtype).itemsize)
    if smem > TRITON_SMEM_BYTES:
      return None, (f"block sizes {blocks} with num_stages need ~{smem // 1024} KiB of shared "
                    f"memory at head_dim {H}, {jnp.dtype(dtype).name} (limit "
                    f"{TRITON_SMEM_BYTES // 1024} KiB)")
    return fitted, None
  if impl == "mosaic_gpu":
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      return None, f"dtype {jnp.dtype(dtype).name} (Mosaic GPU kernel: bfloat16 or float16)"
    if H not in (64, 128):
      return None, f"head_dim {H} (Mosaic GPU kernel needs 64 or 128)"
    if bs.block_q % 128 or any(b % 64 for b in blocks):
      return None, (f"block sizes {blocks} (Mosaic GPU kernel needs multiples of 64, block_q a "
                    "multiple of 128: two compute warpgroups)")
    fitted = bs.fit_kv(S, 64)
    if fitted is None:
      return None, f"kv length {S} (needs a multiple of 64)"
    return fitted, None
  if impl == "mosaic_tpu":
    if H % 128 and H != 64:
      return None, f"head_dim {H} (Mosaic kernel needs 64 or a multiple of 128)"
    if any(b % 128 for b in blocks):
      return None, f"block sizes {blocks} (Mosaic kernel needs multiples of 128)"
    fitted = bs.fit_kv(S, 128)
    if fitted is None:
      return None, f"kv length {S} (needs a multiple of 128)"
    return fitted, None
  raise ValueError(impl)


@dataclasses.dataclass(frozen=True)
class CompactConfig:
  """Tuning knobs of the compacted-query kernels, passed per call (static: a call with another
  config is another compiled program). The defaults are the measured choices
  (docs/performance.md says which measurements chose them).

  bwd_impl: the backward's kernel; None = the forward's. 'triton' under a 'mosaic_gpu' forward:
    the Mosaic GPU forward's out / lse feed the Triton backward.
  fused_triton_bwd: Triton backward in one launch: dq accumulated with float32 atomic adds inside
    the dk/dv kernel (its dq is not bit-reproducible: the order of the additions varies).
  uncompact_by_gather: results go back to their rows as a gather (each output row reads its slot,
    zeros for inactive rows) instead of an XLA scatter into zeros (XLA glue only).
  glue_kernels: GPU kernels (Triton, Mosaic GPU): the gathers and putting results back as Pallas
    kernels bounded by the active count (glue.py; Mosaic GPU copies in a pass whose kernel is
    Mosaic GPU, Triton copies in a Triton pass) and, unless the call gives bucket_fracs /
    capacity, ONE full-T bucket instead of the ladder (no lax.switch, whose predicate XLA reads on
    the host before the branch's kernels launch). Ignored where glue.supported(H) is False.
  mgpu_bwd_wgs: compute warpgroups per Mosaic GPU backward program (1 or 2).
  mgpu_named_barriers: the Mosaic GPU forward's hand-offs on hardware named barriers instead of
    mbarriers (interpret mode always uses mbarriers).
  glue_impl: the glue kernels' backend ('triton' / 'mosaic_gpu'); None: each pass's kernel's
    (Mosaic GPU next to Mosaic GPU, so Hopper runs no Triton call). For A/B timing.
  """
  bwd_impl: str | None = None
  fused_triton_bwd: bool = False
  uncompact_by_gather: bool = False
  glue_kernels: bool = True
  mgpu_bwd_wgs: int = 2
  mgpu_named_barriers: bool = True
  glue_impl: str | None = None

  def __post_init__(self):
    if self.bwd_impl not in (None, *IMPLS[1:]):
      raise ValueError(f"CompactConfig.bwd_impl={self.bwd_impl!r}: choose None or one of "
                       f"{IMPLS[1:]}")
    if self.glue_impl not in (None, *glue.KERNELS):
      raise ValueError(f"CompactConfig.glue_impl={self.glue_impl!r}: choose None or one of "
                       f"{glue.KERNELS}")
    if self.mgpu_bwd_wgs not in (1, 2):
      raise ValueError(f"CompactConfig.mgpu_bwd_wgs={self.mgpu_bwd_wgs!r}: choose 1 or 2")


@dataclasses.dataclass(frozen=True)
class _Config:
  backend: str
  scale: float
  window: int | None
  caps: tuple[int, ...]
  bs: BlockSizes
  interpret: Any
  poison: bool
  kv_default: bool  # kv positions are arange(S): the kernel computes them
  bwd_backend: str  # the backward pass may run on another kernel than the forward
  bs_bwd: BlockSizes
  fused_bwd: bool = False  # Triton backward: dq fused into the dk/dv kernel (atomic adds)
  # From CompactConfig (static: calls with other knobs never share a cached trace).
  uncompact_by_gather: bool = False
  mgpu_bwd_wgs: int = 2
  mgpu_named_barriers: bool = True
  glue_kernels: bool = False  # resolved: the config's switch and glue.supported(H)
  glue_impl: str | None = None


def _row_multiple(cfg: _Config) -> int:
  """The compacted rows every kernel reads come in whole tiles of this many rows (the forward and
  dq programs' query rows, the dk/dv query tiles)."""
  wgs = cfg.mgpu_bwd_wgs if cfg.bwd_backend == "mosaic_gpu" else 1
  return math.lcm(cfg.bs.q_multiple, cfg.bs_bwd.q_multiple, wgs * cfg.bs_bwd.block_q_dq)


def _glue_kernel(cfg: _Config, backend: str) -> str:
  """The row copies (glue.py) of a pass run as that pass's kernel does: Mosaic GPU next to the
  Mosaic GPU kernels (Hopper: no Triton call), else Triton; CompactConfig.glue_impl overrides."""
  if cfg.glue_impl is not None:
    return cfg.glue_impl
  return "mosaic_gpu" if backend == "mosaic_gpu" else "triton"


def _compact(C, active_BIT, qpos_BT, qseg_BT, slot_BIT=None):
  """(idx, valid, qpos_c, qseg_c) for bucket C: the active queries in order in slots [0, count),
  padding slots (idx == T) get the padding position, which sees no key. Always gathered, also when
  C == T, so that the tiles past the count are empty and the kernels skip them."""
  T = active_BIT.shape[-1]
  idx = cp.compact_indices(active_BIT, C, slot_BIT)
  valid = idx < T
  qpos_c = cp.gather_meta(qpos_BT, idx, cp.PAD_POS)
  qseg_c = None if qseg_BT is None else cp.gather_meta(qseg_BT, idx, 0)
  return idx, valid, qpos_c, qseg_c


def _gather(x, idx):
  return cp.gather_rows(x, idx)


def _scatter(cfg, x_c, idx, T, slot_BIT):
  if cfg.uncompact_by_gather:
    return cp.uncompact_rows(x_c, slot_BIT)
  return cp.scatter_rows(x_c, idx, T)


def _gather_BNT(x, idx):
  return cp.gather_BNT(x, idx)


def _scatter_lse(cfg, x_BNC, idx, T, slot_BIT):
  """[B, N, C] -> [B, T, N], -inf where no slot maps."""
  if cfg.uncompact_by_gather:
    return cp.uncompact_BNC(x_BNC, slot_BIT, -jnp.inf)
  return jnp.swapaxes(cp.scatter_BNT(x_BNC, idx, T, -jnp.inf), 1, 2)


def _kernel_seg(qseg_c):
  # Queries of segment 0 (and padding) must match no key: kv segment ids are >= 0.
  return None if qseg_c is None else jnp.where(qseg_c == 0, -1, qseg_c).astype(jnp.int32)


def _switch(caps, count_max, branch_fn, *ops):
  if len(caps) == 1:
    return branch_fn(caps[0])(*ops)
  return lax.switch(cp.pick_bucket(count_max, caps), [branch_fn(c) for c in caps], *ops)


def _forward_impl(cfg: _Config, q, k, v, active, qpos, kvpos, qseg, kvseg):
  B, T, N, H = q.shape
  S = k.shape[1]
  mod = _backend_module(cfg.backend)
  active_BIT, _ = cp.active_to_RT(active)
  count_max = jnp.max(jnp.sum(active_BIT.astype(jnp.int32), axis=-1))
  kvpos_arr = kvpos if kvpos is not None else jnp.broadcast_to(
      jnp.arange(S, dtype=jnp.int32), (B, S))
  kvpos_k = None if cfg.kv_default else kvpos

  def branch(C):
    def f(q, k, v, active_BIT, qpos, kvpos_arr, kvpos_k, qseg, kvseg):
      slot = cp.compact_slots(active_BIT)
      idx, valid, qpos_c, qseg_c = _compact(C, active_BIT, qpos, qseg, slot)
      bs = cfg.bs.for_capacity(C, T)
      # Mosaic GPU: bounds per compute warpgroup (two per query tile)
      bq = bs.block_q // 2 if cfg.backend == "mosaic_gpu" else bs.block_q
      bounds = cp.tile_bounds(qpos_c, valid, qseg_c, kvpos_arr, kvseg, window=cfg.window,
                              block_q=bq, block_k=bs.block_k)
      counts = cp.active_counts(active_BIT)
      if cfg.glue_kernels:
        q_c = glue.gather_rows(q, idx, counts, _row_multiple(cfg), interpret=bool(cfg.interpret),
                               kernel=_glue_kernel(cfg, cfg.backend))
      else:
        q_c = _gather(q, idx)
      extra = (dict(named_barriers=cfg.mgpu_named_barriers) if cfg.backend == "mosaic_gpu"
               else {})
      out_c, lse_c = mod.fwd(q_c, k, v, qpos_c, _kernel_seg(qseg_c), kvpos_k, kvseg,
                             bounds, counts, scale=cfg.scale, window=cfg.window, bs=bs,
                             interpret=cfg.interpret, poison=cfg.poison, **extra)
      if cfg.glue_kernels:
        return (glue.uncompact_rows(out_c, slot, interpret=bool(cfg.interpret),
                                    kernel=_glue_kernel(cfg, cfg.backend)),
                cp.uncompact_BNC(lse_c, slot, -jnp.inf))
      return _scatter(cfg, out_c, idx, T, slot), _scatter_lse(cfg, lse_c, idx, T, slot)
    return f

  return _switch(cfg.caps, count_max, branch, q, k, v, active_BIT, qpos, kvpos_arr, kvpos_k,
                 qseg, kvseg)


def _backward_impl(cfg: _Config, res, dout, dlse):
  q, k, v, active, qpos, kvpos, qseg, kvseg, out, lse = res
  B, T, N, H = q.shape
  S = k.shape[1]
  active_BIT, _ = cp.active_to_RT(active)
  count_max = jnp.max(jnp.sum(active_BIT.astype(jnp.int32), axis=-1))
  kvpos_arr = kvpos if kvpos is not None else jnp.broadcast_to(
      jnp.arange(S, dtype=jnp.int32), (B, S))
  kvpos_k = None if cfg.kv_default else kvpos
  mod = _backend_module(cfg.bwd_backend)
  lse_BNT = jnp.swapaxes(lse, 1, 2)
  dlse_BNT = jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)

  def branch(C):
    def f(q, k, v, dout, out, lse_BNT, dlse_BNT, active_BIT, qpos, kvpos_arr, kvpos_k, qseg,
          kvseg):
      slot = cp.compact_slots(active_BIT)
      idx, valid, qpos_c, qseg_c = _compact(C, active_BIT, qpos, qseg, slot)
      counts = cp.active_counts(active_BIT)
      if cfg.glue_kernels:
        mult, interp = _row_multiple(cfg), bool(cfg.interpret)
        gk = _glue_kernel(cfg, cfg.bwd_backend)
        q_c = glue.gather_rows(q, idx, counts, mult, interpret=interp, kernel=gk)
        do_c, delta = glue.gather_rows_delta(dout, out, idx, counts, mult, interpret=interp,
                                             kernel=gk)
      else:
        q_c = _gather(q, idx)
        do_c = _gather(dout, idx)
        o_c = _gather(out, idx)
        delta = jnp.sum(o_c.astype(jnp.float32) * do_c.astype(jnp.float32), axis=-1)  # [B, C, N]
        delta = jnp.swapaxes(delta, 1, 2)
      delta = delta - _gather_BNT(dlse_BNT, idx)
      lse_c = _gather_BNT(lse_BNT, idx)
      seg_k = _kernel_seg(qseg_c)
      bs = cfg.bs_bwd.for_capacity(C, T)
      b_dq = None if cfg.fused_bwd else cp.tile_bounds(
          qpos_c, valid, qseg_c, kvpos_arr, kvseg, window=cfg.window, block_q=bs.block_q_dq,
          block_k=bs.block_k_dq)
      b_dkv = cp.tile_bounds(qpos_c, valid, qseg_c, kvpos_arr, kvseg, window=cfg.window,
                             block_q=bs.block_q_dkv, block_k=bs.block_k_dkv, transpose=True)
      kw = dict(scale=cfg.scale, window=cfg.window, bs=bs, interpret=cfg.interpret,
                poison=cfg.poison)
      if cfg.bwd_backend == "mosaic_gpu":
        kw["compute_wgs"] = cfg.mgpu_bwd_wgs
      if cfg.fused_bwd:
        dk, dv, dq_acc = mod.dkv(q_c, k, v, do_c, lse_c, delta, qpos_c, seg_k, kvpos_k, kvseg,
                                 b_dkv, dq_acc_BCNH=jnp.zeros(q_c.shape, jnp.float32), **kw)
        dq_c = (dq_acc * cfg.scale).astype(q_c.dtype)
      else:
        dq_c = mod.dq(q_c, k, v, do_c, lse_c, delta, qpos_c, seg_k, kvpos_k, kvseg, b_dq,
                      counts, **kw)
        dk, dv = mod.dkv(q_c, k, v, do_c, lse_c, delta, qpos_c, seg_k, kvpos_k, kvseg, b_dkv,
                         **kw)
      if cfg.glue_kernels:
        return glue.uncompact_rows(dq_c, slot, interpret=bool(cfg.interpret), kernel=gk), dk, dv
      return _scatter(cfg, dq_c, idx, T, slot), dk, dv
    return f

  return _switch(cfg.caps, count_max, branch, q, k, v, dout, out, lse_BNT, dlse_BNT, active_BIT,
                 qpos, kvpos_arr, kvpos_k, qseg, kvseg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(cfg, q, k, v, active, qpos, kvpos, qseg, kvseg):
  return _forward_impl(cfg, q, k, v, active, qpos, kvpos, qseg, kvseg)


def _kernel_attention_fwd(cfg, q, k, v, active, qpos, kvpos, qseg, kvseg):
  out, lse = _forward_impl(cfg, q, k, v, active, qpos, kvpos, qseg, kvseg)
  return (out, lse), (q, k, v, active, qpos, kvpos, qseg, kvseg, out, lse)


def _kernel_attention_bwd(cfg, res, cts):
  dout, dlse = cts
  dq, dk, dv = _backward_impl(cfg, res, dout, dlse)
  return dq, dk, dv, None, None, None, None, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)
# One jitted entry keyed on the static config: calls with new active sets (new values, same
# shapes) reuse the compiled kernels also outside an enclosing jit (eager calls, tests).
_kernel_attention_jit = jax.jit(_kernel_attention, static_argnums=(0,))


# The kv-length multiple each kernel's tiles need (the wrapper pads other lengths).
_KV_GRANULE = {"reference": 1, "triton": 16, "mosaic_gpu": 64, "mosaic_tpu": 128}


def _resolve_impl(impl, q_shape, kv_shape, dtype, bs, config: CompactConfig):
  """(forward kernel, its block sizes, backward kernel, its block sizes); ValueError naming why a
  kernel cannot take the call."""
  if impl not in IMPLS:
    raise ValueError(f"compact_attention: unknown impl {impl!r}; choose one of {IMPLS}")
  if impl == "reference":
    return impl, None, impl, None
  bwd = config.bwd_impl or impl
  fitted = {}
  for name in dict.fromkeys((impl, bwd)):
    if name == "reference":
      raise ValueError(f"compact_attention: CompactConfig.bwd_impl='reference' under impl={impl!r}:"
                       " the reference has no kernel backward; choose a kernel or None")
    # explicit block sizes are the forward's; a backward on another kernel takes its defaults
    fitted[name], reason = kernel_support(name, q_shape, kv_shape, dtype,
                                          bs if name == impl else None)
    if reason is not None:
      raise ValueError(f"compact_attention: the {name} kernel cannot take this call: {reason}. "
                       "Use impl='reference' (or other block sizes).")
  return impl, fitted[impl], bwd, fitted[bwd]


def compact_attention(q_BTNH, k_BSKH, v_BSKH, active, *, q_positions_BT=None,
                      kv_positions_BS=None, q_offset=0, q_segment_ids_BT=None,
                      kv_segment_ids_BS=None, window: int | None = None,
                      bucket_fracs=None, capacity: int | None = None,
                      block_q: int | None = None, block_k: int | None = None,
                      block_sizes: BlockSizes | None = None, impl: str = "reference",
                      config: CompactConfig | None = None, interpret: Any = False, scale: float | None = None,
                      return_lse: bool = False, poison: bool = False):
  """Attention for the active queries only; zeros elsewhere.

  Args:
    q_BTNH: queries [B, T, N, H]; k_BSKH, v_BSKH: [B, S, K, H] with N % K == 0 (GQA, K/V not
      repeated: query head h uses kv head h // (N // K)).
    active: bool [B, T] (one active set per batch row, L2A) or [B, T, N] (per row and head, AHA).
      `compaction.mask_from_indices` turns an index list into this mask.
    q_positions_BT: query positions (default arange(T) + q_offset, so a prefix of S - T keys can
      precede the queries). kv_positions_BS: key positions (default arange(S)).
    q_segment_ids_BT, kv_segment_ids_BS: packed documents: a query sees only keys with its own
      segment id; 0 = padding, never attended. Give both or neither.
    window: a query at p sees keys at positions in (p - window, p].
    bucket_fracs: ladder of capacities as fractions of T (default (1/4, 1); with the GPU glue
      kernels (1,), one bucket); or `capacity`, a fixed bucket (plus a full-T bucket for
      overflow, so nothing is ever dropped).
    block_q, block_k: forward tiles; block_sizes: all tiles and Triton launch parameters.
    impl: 'reference' | 'triton' | 'mosaic_gpu' | 'mosaic_tpu' (module docstring); interpret:
      Pallas interpret mode (True for Triton and Mosaic GPU, pltpu.InterpretParams() for Mosaic
      TPU) to run the kernels on CPU. A kernel lowered for a platform it does not compile for
      fails at lowering (condattn_jax.ops checks the lowering platform first).
    config: CompactConfig (kernel variants; default CompactConfig()).
    scale: logits scale (default H ** -0.5).
    return_lse: also return the log-sum-exp [B, T, N] float32 (-inf where nothing is attended);
      it is differentiable too.
    poison: testing aid: kernel outputs start as NaN, so an element the kernel fails to write
      shows up as NaN.

  Returns:
    out [B, T, N, H] in q's dtype (and lse if return_lse).
  """
  q, k, v = q_BTNH, k_BSKH, v_BSKH
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be 4-D [B, T, N, H] / [B, S, K, H]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
    raise ValueError(f"k and v must both be [B={B}, S, K, H={H}]; got {k.shape}, {v.shape}")
  if N % K:
    raise ValueError(f"query heads {N} must be a multiple of kv heads {K}")
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  active = jnp.asarray(active)
  if active.dtype != jnp.bool_ or active.shape not in ((B, T), (B, T, N)):
    raise ValueError(f"active must be bool [B, T]={B, T} or [B, T, N]={B, T, N}; got "
                     f"{active.dtype} {active.shape}")
  if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None):
    raise ValueError("give both q_segment_ids_BT and kv_segment_ids_BS, or neither")
  if window is not None and window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  scale = float(H ** -0.5 if scale is None else scale)

  kv_default = kv_positions_BS is None
  if q_positions_BT is None:
    qpos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + jnp.asarray(q_offset, jnp.int32),
                            (B, T))
  else:
    qpos = jnp.asarray(q_positions_BT, jnp.int32)
  kvpos = None if kv_default else jnp.asarray(kv_positions_BS, jnp.int32)
  qseg = None if q_segment_ids_BT is None else jnp.asarray(q_segment_ids_BT, jnp.int32)
  kvseg = None if kv_segment_ids_BS is None else jnp.asarray(kv_segment_ids_BS, jnp.int32)
  for name, x, shp in (("q_positions_BT", qpos, (B, T)), ("kv_positions_BS", kvpos, (B, S)),
                       ("q_segment_ids_BT", qseg, (B, T)), ("kv_segment_ids_BS", kvseg, (B, S))):
    if x is not None and x.shape != shp:
      raise ValueError(f"{name} must have shape {shp}, got {x.shape}")

  bs = block_sizes
  if block_q is not None or block_k is not None:
    bs = (bs or BlockSizes()).with_(**{n: b for n, b in (("block_q", block_q), ("block_k", block_k))
                                       if b is not None})
  config = CompactConfig() if config is None else config
  if not isinstance(config, CompactConfig):
    raise ValueError(f"compact_attention: config must be a CompactConfig, got "
                     f"{type(config).__name__}")
  granule = math.lcm(*(_KV_GRANULE.get(i, 1) for i in (impl, config.bwd_impl or impl)))
  if impl in IMPLS and S % granule:
    # A kv length the kernel's tiles cannot divide (a window ring of window + 1 slots, a decode
    # cache of odd length): pad with slots no query sees (segment id 0) instead of falling back
    # to the O(T*S) reference. Gradients of the padded slots are sliced off by jnp.pad's VJP.
    pad = -S % granule
    if qseg is None:
      qseg, kvseg = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
    kvseg = jnp.pad(kvseg, ((0, 0), (0, pad)))
    if kvpos is not None:
      kvpos = jnp.concatenate(
          [kvpos, kvpos.max(axis=1, keepdims=True) + 1 + jnp.arange(pad, dtype=jnp.int32)], axis=1)
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    S += pad
  impl, bs, bwd_impl, bs_bwd = _resolve_impl(impl, q.shape, k.shape, q.dtype, bs, config)

  if impl == "reference":
    kvpos_arr = kvpos if kvpos is not None else jnp.broadcast_to(
        jnp.arange(S, dtype=jnp.int32), (B, S))
    out, lse = reference_compact_attention(
        q, k, v, active, q_positions_BT=qpos, kv_positions_BS=kvpos_arr, q_segment_ids_BT=qseg,
        kv_segment_ids_BS=kvseg, window=window, scale=scale)
  else:
    use_glue = (config.glue_kernels and impl in ("triton", "mosaic_gpu")
                and bwd_impl in ("triton", "mosaic_gpu") and glue.supported(H))
    if use_glue and bucket_fracs is None and capacity is None:
      bucket_fracs = (1.0,)  # one bucket: no lax.switch (CompactConfig.glue_kernels)
    caps = cp.bucket_capacities(T, bucket_fracs=bucket_fracs, capacity=capacity,
                                multiple=math.lcm(bs.q_multiple, bs_bwd.q_multiple))
    cfg = _Config(backend=impl, scale=scale, window=window, caps=caps, bs=bs,
                  interpret=interpret, poison=poison, kv_default=kv_default,
                  bwd_backend=bwd_impl, bs_bwd=bs_bwd,
                  fused_bwd=bwd_impl == "triton" and config.fused_triton_bwd,
                  uncompact_by_gather=config.uncompact_by_gather,
                  mgpu_bwd_wgs=config.mgpu_bwd_wgs if bwd_impl == "mosaic_gpu" else 2,
                  mgpu_named_barriers=impl != "mosaic_gpu" or config.mgpu_named_barriers,
                  glue_kernels=use_glue, glue_impl=config.glue_impl)
    out, lse = _kernel_attention_jit(cfg, q, k, v, active, qpos, kvpos, qseg, kvseg)
  return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class CompactBackend:
  """One compacted-query kernel as a backend (the pallas_kernels.backends interface)."""
  name: str
  lowers_for: tuple[str, ...] = ()
  needs_hopper: bool = False
  config: CompactConfig = CompactConfig()

  def supports(self, q_shape, kv_shape, dtype, platform: Platform) -> str | None:
    """None if this kernel takes [B, T, N, H] queries / [B, S, K, H] keys of `dtype` lowered for
    `platform`, else why not. The reference takes everything."""
    if self.name == "reference":
      return None
    why = platform_reason(self.name, self.lowers_for, platform, self.needs_hopper)
    if why is not None:
      return why
    names = dict.fromkeys((self.name, self.config.bwd_impl or self.name))
    # compact_attention pads a kv length its tiles cannot divide (slots no query sees): judge
    # the padded length, so an odd cache length (a serve cache of prompt + budget slots) runs
    # the kernel instead of the O(T*S) reference
    S = kv_shape[1]
    granule = math.lcm(*(_KV_GRANULE.get(n, 1) for n in names))
    kv_shape = (kv_shape[0], S + (-S % granule), *kv_shape[2:])
    for name in names:
      why = kernel_support(name, q_shape, kv_shape, dtype)[1]
      if why is not None:
        return why
    return None

  def __call__(self, q_BTNH, k_BSKH, v_BSKH, active, **kw):
    return compact_attention(q_BTNH, k_BSKH, v_BSKH, active, impl=self.name, config=self.config,
                             **kw)


# Preference order: the first backend that supports a call runs it (Hopper: Mosaic GPU both ways;
# other CUDA / ROCm GPUs: Triton; TPU: Mosaic TPU; anything else: the reference).
BACKENDS = (CompactBackend("mosaic_gpu", ("cuda",), needs_hopper=True),
            CompactBackend("triton", ("cuda", "rocm")),
            CompactBackend("mosaic_tpu", ("tpu",)),
            CompactBackend("reference"))
