"""GPU kernels (pl.pallas_call lowered to Triton) for compacted-query attention.

Three kernels, all on compacted queries q_c [B, C, N, H] (token-major, like the inputs) and the
full K/V [B, S, K, H] (GQA: query head h reads kv head h // (N // K); K/V are never repeated):
  forward  grid (N, B, q tile):  FlashAttention-2 loop over the kv tiles in the tile's bounds,
           masked tiles (causal on original positions / window / segments) apart from the
           unmasked ones; writes out_c and the log-sum-exp (natural log, -inf for empty rows).
  dq       grid (N, B, q tile):  same bounds, dq = scale * dS K.
  dk/dv    grid (K, B, kv tile): loops over the G query heads of the kv head and the query tiles in
           the kv tile's bounds (query tiles whose positions all precede the kv tile are skipped).
           Fused variant (dkv(..., dq_acc=zeros)): the same loop also adds dS K of each tile pair
           into a float32 dq accumulator with atomic adds, so the backward is one launch and five
           matrix products per tile pair instead of seven (dq's own kernel recomputes S and dP);
           the order of the float additions into dq then varies from run to run.
Per-tile bounds come from compaction.tile_bounds: (lo, full_lo, full_hi, hi). The tile axis is
the slowest grid axis and runs heaviest tiles first (latest query tiles; first kv tiles), so the
long programs of every head start early and the tail of the launch is short.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_tiles import LN2, LOG2E, NEG_INF, bwd_lse2, dot

from .common import BlockSizes

# The design card's GPU backend is the (deprecated) Pallas Triton lowering; silence that warning.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

def _kv_positions(kvpos_ref, start, bk):
  if kvpos_ref is None:
    return start + lax.iota(jnp.int32, bk)
  return kvpos_ref[pl.ds(start, bk)]


def _visible(qp, kp, qs, ks, window):
  """qp/qs: per-query [bq] as column, kp/ks: per-key [bk] as row -> [bq, bk] bool."""
  vis = kp[None, :] <= qp[:, None]
  if window is not None:
    vis &= (qp[:, None] - kp[None, :]) < window
  if qs is not None:
    vis &= qs[:, None] == ks[None, :]
  return vis


def _visible_T(qp, kp, qs, ks, window):
  """Transposed: [bk, bq]."""
  vis = kp[:, None] <= qp[None, :]
  if window is not None:
    vis &= (qp[None, :] - kp[:, None]) < window
  if qs is not None:
    vis &= ks[:, None] == qs[None, :]
  return vis


def _three_loops(bounds, body, carry):
  lo, flo, fhi, hi = bounds
  carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, has_seg, has_kvpos, window, scale, bq, bk, nq):
  it = iter(refs)
  count_ref, bounds_ref, qpos_ref = next(it), next(it), next(it)
  qseg_ref = next(it) if has_seg else None
  kvpos_ref = next(it) if has_kvpos else None
  kvseg_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  *_, o_ref, lse_ref = refs  # (poison inputs, if any, sit before the outputs)
  i = nq - 1 - pl.program_id(2)
  # Slots past the active count are padding: their tiles are skipped (outputs left unwritten, the
  # scatter drops them), so the work follows the active count, not the bucket.
  pl.when(i * bq < count_ref[...])(functools.partial(
      _fwd_tile, i, bounds_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, q_ref, k_ref, v_ref,
      o_ref, lse_ref, window=window, scale=scale, bk=bk))


def _fwd_tile(i, bounds_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, q_ref, k_ref, v_ref, o_ref,
              lse_ref, *, window, scale, bk):
  bounds = tuple(bounds_ref[i, c] for c in range(4))
  q = q_ref[...]
  qp = qpos_ref[...]
  qs = None if qseg_ref is None else qseg_ref[...]
  bq, H = q.shape
  qk_scale = scale * LOG2E

  def body(j, carry, *, masked):
    acc, m, l = carry
    start = j * bk
    k = k_ref[pl.ds(start, bk), :]
    s = dot(q, k, trans_b=True) * qk_scale
    if masked:
      kp = _kv_positions(kvpos_ref, start, bk)
      ks = None if kvseg_ref is None else kvseg_ref[pl.ds(start, bk)]
      s = jnp.where(_visible(qp, kp, qs, ks, window), s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    v = v_ref[pl.ds(start, bk), :]
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m_new, l

  acc = jnp.zeros((bq, H), jnp.float32)
  m = jnp.full((bq,), NEG_INF, jnp.float32)
  l = jnp.zeros((bq,), jnp.float32)
  acc, m, l = _three_loops(bounds, body, (acc, m, l))
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(l_safe)) * LN2)


def _hsel(per_head):
  return (lambda h: h) if per_head else (lambda h: 0)


def _poison_args(shapes, poison):
  if not poison:
    return [], []
  bufs = []
  for s in shapes:
    fill = jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -7
    bufs.append(jnp.full(s.shape, fill, s.dtype))
  return bufs, shapes


def fwd(q_BCNH, k_BSKH, v_BSKH, qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, bounds_BIQ4, counts_BI, *,
        scale, window, bs: BlockSizes, interpret=False, poison=False):
  """Returns (out_c [B, C, N, H], lse [B, N, C] float32); slots >= counts_BI are not written."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  I = qpos_BIC.shape[1]
  bq, bk = bs.block_q, bs.block_k
  nq = C // bq
  hs = _hsel(I > 1)
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  qi = lambda p: nq - 1 - p  # heavy (late) tiles first

  args = [counts_BI, bounds_BIQ4, qpos_BIC]
  specs = [pl.BlockSpec((None, None), lambda h, b, p: (b, hs(h))),
           pl.BlockSpec((None, None, nq, 4), lambda h, b, p: (b, hs(h), 0, 0)),
           pl.BlockSpec((None, None, bq), lambda h, b, p: (b, hs(h), qi(p)))]
  if has_seg:
    args.append(qseg_BIC)
    specs.append(pl.BlockSpec((None, None, bq), lambda h, b, p: (b, hs(h), qi(p))))
  if has_kvpos:
    args.append(kvpos_BS)
    specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  if has_seg:
    args.append(kvseg_BS)
    specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  args += [q_BCNH, k_BSKH, v_BSKH]
  specs += [pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0)),
            pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0)),
            pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0))]
  out_shapes = [jax.ShapeDtypeStruct((B, C, N, H), q_BCNH.dtype),
                jax.ShapeDtypeStruct((B, N, C), jnp.float32)]
  out_specs = [pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0)),
               pl.BlockSpec((None, None, bq), lambda h, b, p: (b, h, qi(p)))]
  pbufs, _ = _poison_args(out_shapes, poison)
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  specs += out_specs[:len(pbufs)]
  kernel = functools.partial(_fwd_kernel, has_seg=has_seg, has_kvpos=has_kvpos, window=window,
                             scale=scale, bq=bq, bk=bk, nq=nq)
  return pl.pallas_call(
      kernel, grid=(N, B, nq), in_specs=specs, out_specs=out_specs, out_shape=out_shapes,
      input_output_aliases=aliases, interpret=interpret, name="compact_attention_fwd",
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
  )(*args, *pbufs)


# ----------------------------------------------------------------------------------------------
# backward: dq
# ----------------------------------------------------------------------------------------------

def _dq_kernel(*refs, has_seg, has_kvpos, window, scale, bq, bk, nq):
  it = iter(refs)
  count_ref, bounds_ref, qpos_ref = next(it), next(it), next(it)
  qseg_ref = next(it) if has_seg else None
  kvpos_ref = next(it) if has_kvpos else None
  kvseg_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  dq_ref = refs[-1]
  i = nq - 1 - pl.program_id(2)
  pl.when(i * bq < count_ref[...])(functools.partial(
      _dq_tile, i, bounds_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, q_ref, k_ref, v_ref,
      do_ref, lse_ref, delta_ref, dq_ref, window=window, scale=scale, bk=bk))


def _dq_tile(i, bounds_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, q_ref, k_ref, v_ref, do_ref,
             lse_ref, delta_ref, dq_ref, *, window, scale, bk):
  bounds = tuple(bounds_ref[i, c] for c in range(4))
  q = q_ref[...]
  do = do_ref[...]
  lse2 = bwd_lse2(lse_ref[...])
  delta = delta_ref[...]
  qp = qpos_ref[...]
  qs = None if qseg_ref is None else qseg_ref[...]
  qk_scale = scale * LOG2E

  def body(j, dq, *, masked):
    start = j * bk
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = dot(q, k, trans_b=True) * qk_scale
    if masked:
      kp = _kv_positions(kvpos_ref, start, bk)
      ks = None if kvseg_ref is None else kvseg_ref[pl.ds(start, bk)]
      s = jnp.where(_visible(qp, kp, qs, ks, window), s, NEG_INF)
    p = jnp.exp2(s - lse2[:, None])
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.astype(k.dtype), k)

  dq = _three_loops(bounds, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dq(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
       kvseg_BS, bounds_BIQ4, counts_BI, *, scale, window, bs: BlockSizes, interpret=False,
       poison=False):
  """dq_c [B, C, N, H]; slots >= counts_BI are not written."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  I = qpos_BIC.shape[1]
  bq, bk = bs.block_q_dq, bs.block_k_dq
  nq = C // bq
  hs = _hsel(I > 1)
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  qi = lambda p: nq - 1 - p

  args = [counts_BI, bounds_BIQ4, qpos_BIC]
  specs = [pl.BlockSpec((None, None), lambda h, b, p: (b, hs(h))),
           pl.BlockSpec((None, None, nq, 4), lambda h, b, p: (b, hs(h), 0, 0)),
           pl.BlockSpec((None, None, bq), lambda h, b, p: (b, hs(h), qi(p)))]
  if has_seg:
    args.append(qseg_BIC)
    specs.append(pl.BlockSpec((None, None, bq), lambda h, b, p: (b, hs(h), qi(p))))
  if has_kvpos:
    args.append(kvpos_BS)
    specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  if has_seg:
    args.append(kvseg_BS)
    specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  q_spec = pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0))
  kv_spec = pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda h, b, p: (b, h, qi(p)))
  args += [q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC]
  specs += [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  out_shapes = [jax.ShapeDtypeStruct((B, C, N, H), q_BCNH.dtype)]
  pbufs, _ = _poison_args(out_shapes, poison)
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  specs += [q_spec for _ in pbufs]
  kernel = functools.partial(_dq_kernel, has_seg=has_seg, has_kvpos=has_kvpos, window=window,
                             scale=scale, bq=bq, bk=bk, nq=nq)
  return pl.pallas_call(
      kernel, grid=(N, B, nq), in_specs=specs, out_specs=[q_spec], out_shape=out_shapes,
      input_output_aliases=aliases, interpret=interpret, name="compact_attention_dq",
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps_dq,
                                           num_stages=bs.num_stages_dq),
  )(*args, *pbufs)[0]


# ----------------------------------------------------------------------------------------------
# backward: dk, dv
# ----------------------------------------------------------------------------------------------

def _dkv_kernel(*refs, has_seg, has_kvpos, window, scale, bq, bk, G, per_head, fuse_dq):
  it = iter(refs)
  bounds_ref, qpos_ref = next(it), next(it)
  qseg_ref = next(it) if has_seg else None
  kvpos_ref = next(it) if has_kvpos else None
  kvseg_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  if fuse_dq:
    dk_ref, dv_ref, dq_ref = refs[-3:]
  else:
    (dk_ref, dv_ref), dq_ref = refs[-2:], None

  j = pl.program_id(2)
  k = k_ref[...]
  v = v_ref[...]
  kp = _kv_positions(kvpos_ref, j * bk, bk) if kvpos_ref is None else kvpos_ref[...]
  ks = None if kvseg_ref is None else kvseg_ref[...]
  qk_scale = scale * LOG2E

  def head(g, carry):
    hsel = g if per_head else 0
    bounds = tuple(bounds_ref[hsel, j, c] for c in range(4))

    def body(i, carry, *, masked):
      dk, dv = carry
      sl = pl.ds(i * bq, bq)
      q = q_ref[sl, g, :]
      do = do_ref[sl, g, :]
      lse2 = bwd_lse2(lse_ref[g, sl])
      delta = delta_ref[g, sl]
      sT = dot(k, q, trans_b=True) * qk_scale                      # [bk, bq]
      if masked:
        qp = qpos_ref[hsel, sl]
        qs = None if qseg_ref is None else qseg_ref[hsel, sl]
        sT = jnp.where(_visible_T(qp, kp, qs, ks, window), sT, NEG_INF)
      pT = jnp.exp2(sT - lse2[None, :])
      dv = dv + dot(pT.astype(do.dtype), do)
      dpT = dot(v, do, trans_b=True)                                 # [bk, bq]
      dsT = (pT * (dpT - delta[None, :])).astype(q.dtype)
      dk = dk + dot(dsT, q)
      if dq_ref is not None:  # this pair's share of dq (unscaled; the caller applies the scale)
        plgpu.atomic_add(dq_ref, (sl, g, slice(None)), dot(dsT, k, trans_a=True))
      return dk, dv

    return _three_loops(bounds, body, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def dkv(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
        kvseg_BS, boundsT_BIK4, *, scale, window, bs: BlockSizes, interpret=False, poison=False,
        dq_acc_BCNH=None):
  """(dk, dv); boundsT: per kv tile over query tiles, [B, I, S // block_k_dkv, 4].

  dq_acc_BCNH (float32 zeros [B, C, N, H]) fuses dq in: returns (dk, dv, dq_acc) with dq_acc the
  UNSCALED dq (sum of dS K; multiply by `scale`), accumulated with atomic adds (the buffer is
  donated to the kernel through input_output_aliases)."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  I = qpos_BIC.shape[1]
  per_head = I > 1
  bq, bk = bs.block_q_dkv, bs.block_k_dkv
  nk = S // bk
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  Gi = G if per_head else 1
  ksel = (lambda kh: kh) if per_head else (lambda kh: 0)

  args = [boundsT_BIK4, qpos_BIC]
  specs = [pl.BlockSpec((None, Gi, nk, 4), lambda kh, b, j: (b, ksel(kh), 0, 0)),
           pl.BlockSpec((None, Gi, C), lambda kh, b, j: (b, ksel(kh), 0))]
  if has_seg:
    args.append(qseg_BIC)
    specs.append(pl.BlockSpec((None, Gi, C), lambda kh, b, j: (b, ksel(kh), 0)))
  if has_kvpos:
    args.append(kvpos_BS)
    specs.append(pl.BlockSpec((None, bk), lambda kh, b, j: (b, j)))
  if has_seg:
    args.append(kvseg_BS)
    specs.append(pl.BlockSpec((None, bk), lambda kh, b, j: (b, j)))
  qg_spec = pl.BlockSpec((None, C, G, H), lambda kh, b, j: (b, 0, kh, 0))
  kv_spec = pl.BlockSpec((None, bk, None, H), lambda kh, b, j: (b, j, kh, 0))
  row_spec = pl.BlockSpec((None, G, C), lambda kh, b, j: (b, kh, 0))
  args += [q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC]
  specs += [qg_spec, kv_spec, kv_spec, qg_spec, row_spec, row_spec]
  out_shapes = [jax.ShapeDtypeStruct(k_BSKH.shape, k_BSKH.dtype),
                jax.ShapeDtypeStruct(v_BSKH.shape, v_BSKH.dtype)]
  out_specs = [kv_spec, kv_spec]
  pbufs, _ = _poison_args(out_shapes, poison)
  alias_specs = [kv_spec for _ in pbufs]
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  fuse_dq = dq_acc_BCNH is not None
  if fuse_dq:
    if dq_acc_BCNH.shape != q_BCNH.shape or dq_acc_BCNH.dtype != jnp.float32:
      raise ValueError(f"dq_acc_BCNH must be float32 {q_BCNH.shape}, got "
                       f"{dq_acc_BCNH.dtype} {dq_acc_BCNH.shape}")
    # Every program adds into the [C, G, H] slab of its kv head's query heads.
    out_shapes.append(jax.ShapeDtypeStruct(dq_acc_BCNH.shape, jnp.float32))
    out_specs.append(qg_spec)
    aliases[len(args) + len(pbufs)] = 2
    pbufs.append(dq_acc_BCNH)
    alias_specs.append(qg_spec)
  specs += alias_specs
  kernel = functools.partial(_dkv_kernel, has_seg=has_seg, has_kvpos=has_kvpos, window=window,
                             scale=scale, bq=bq, bk=bk, G=G, per_head=per_head, fuse_dq=fuse_dq)
  return pl.pallas_call(
      kernel, grid=(K, B, nk), in_specs=specs, out_specs=out_specs,
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      name="compact_attention_dkv_dq" if fuse_dq else "compact_attention_dkv",
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps_dkv,
                                           num_stages=bs.num_stages_dkv),
  )(*args, *pbufs)
