"""TPU kernels (Pallas Mosaic) for compacted-query attention.

Same contract as triton.py (compacted queries q_c [B, C, N, H], full K/V [B, S, K, H], per-tile
bounds from compaction.tile_bounds), laid out the TPU way: head-major tiles, per-query values
replicated over the 128 lanes, per-key values over 8 sublanes (the layout of
jax.experimental.pallas.ops.tpu.flash_attention).

The per-tile bounds are scalar-prefetched into SMEM. The innermost grid axis walks the tiles of
a tile's bounds: its index map returns lo + t (clamped to the last visible tile, so skipped steps
fetch nothing new) and the body runs only while lo + t < hi. The grid is bounded at run time: the
query-tile axis by the largest active count (tiles past it hold only padding and are never
visited), the innermost axis by the longest bounds range, so the work follows the active set and
not the bucket (the run-time-sized query-tile axis is 'arbitrary', not 'parallel': only static
extents can be split across cores). Every computed tile is masked (the
full / masked split of the Triton kernels does not pay on the VPU-light TPU path).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_tiles import (LANES, NEG_INF, NT_DIMS, SUBLANES, bcast_lanes, lanes,
                                           lse_safe, poison_buffers, rows)

from .common import BlockSizes


def _visible(qp_lanes, kp_row, qs_lanes, ks_row, window, bk):
  qp = bcast_lanes(qp_lanes, bk)
  vis = kp_row <= qp
  if window is not None:
    vis = jnp.logical_and(vis, (qp - kp_row) < window)
  if qs_lanes is not None:
    vis = jnp.logical_and(vis, bcast_lanes(qs_lanes, bk) == ks_row)
  return vis


def _step(bref, base, t):
  """(run?, tile index) for step t of bounds row `base` (lo at base, hi at base + 3)."""
  lo, hi = bref[base], bref[base + 3]
  return lo + t < hi, jnp.minimum(lo + t, jnp.maximum(hi - 1, 0))


def _prep(qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, S, B):
  kvpos = kvpos_BS if kvpos_BS is not None else jnp.broadcast_to(
      jnp.arange(S, dtype=jnp.int32), (B, S))
  return (lanes(qpos_BIC), None if qseg_BIC is None else lanes(qseg_BIC), rows(kvpos),
          None if kvseg_BS is None else rows(kvseg_BS))


def _dyn(n):
  """A run-time grid extent (int32 scalar, at least 1 so that every visited tile is written)."""
  return jnp.maximum(jnp.asarray(n, jnp.int32), 1)


def _grid_q(counts_BI, bq, nq):
  return jnp.minimum(_dyn(-(-jnp.max(counts_BI) // bq)), nq)


def _grid_steps(bounds):
  return _dyn(jnp.max(bounds[..., 3] - bounds[..., 0]))


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def _fwd_kernel(bref, *refs, has_seg, window, scale, bk, nq, I, n_poison):
  it = iter(refs)
  qp_ref = next(it)
  qs_ref = next(it) if has_seg else None
  kp_ref = next(it)
  ks_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  for _ in range(n_poison):
    next(it)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = it

  b, h, i, t = (pl.program_id(a) for a in range(4))
  base = ((b * I + (h if I > 1 else 0)) * nq + i) * 4
  run, _ = _step(bref, base, t)

  @pl.when(t == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q = q_ref[...]
    k = k_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale
    vis = _visible(qp_ref[...], kp_ref[:1, :], None if qs_ref is None else qs_ref[...],
                   None if ks_ref is None else ks_ref[:1, :], window, bk)
    s = jnp.where(vis, s, NEG_INF)
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    m_use = jnp.where(m_next == NEG_INF, 0.0, m_next)
    p = jnp.exp(s - bcast_lanes(m_use, bk))
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1)[:, None]
    m_sc[...] = m_next
    H = acc_sc.shape[-1]
    v = v_ref[...]
    acc_sc[...] = acc_sc[...] * bcast_lanes(alpha, H) + lax.dot(
        p.astype(v.dtype), v, preferred_element_type=jnp.float32)

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    l = l_sc[...]
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_sc[...] / bcast_lanes(l_safe, acc_sc.shape[-1])).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, m_sc[...] + jnp.log(l_safe))


def fwd(q_BCNH, k_BSKH, v_BSKH, qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, bounds_BIQ4, counts_BI, *,
        scale, window, bs: BlockSizes, interpret=False, poison=False):
  """Returns (out_c [B, C, N, H], lse [B, N, C] float32)."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  bq, bk = bs.block_q, bs.block_k
  nq = C // bq
  hs = (lambda h: h) if I > 1 else (lambda h: 0)
  has_seg = qseg_BIC is not None
  qp, qs, kp, ks = _prep(qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, S, B)

  def kv_block(b, h, i, t, bref):
    _, j = _step(bref, ((b * I + hs(h)) * nq + i) * 4, t)
    return j

  lanes_spec = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, t, bref: (b, hs(h), i, 0))
  rows_spec = pl.BlockSpec((None, SUBLANES, bk),
                           lambda b, h, i, t, bref: (b, 0, kv_block(b, h, i, t, bref)))
  args, specs = [qp], [lanes_spec]
  if has_seg:
    args.append(qs)
    specs.append(lanes_spec)
  args.append(kp)
  specs.append(rows_spec)
  if has_seg:
    args.append(ks)
    specs.append(rows_spec)
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, bref: (
      b, h // G, kv_block(b, h, i, t, bref), 0))
  args += [q_BCNH.transpose(0, 2, 1, 3), k_BSKH.transpose(0, 2, 1, 3),
           v_BSKH.transpose(0, 2, 1, 3)]
  specs += [pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, bref: (b, h, i, 0)), kv_spec,
            kv_spec]
  out_shapes = [jax.ShapeDtypeStruct((B, N, C, H), q_BCNH.dtype),
                jax.ShapeDtypeStruct((B, N, C, LANES), jnp.float32)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {1 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_fwd_kernel, has_seg=has_seg, window=window, scale=scale, bk=bk,
                             nq=nq, I=I, n_poison=len(pbufs))
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, N, _grid_q(counts_BI, bq, nq), _grid_steps(bounds_BIQ4)),
          in_specs=specs + pspecs,
          out_specs=[pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, bref: (b, h, i, 0)),
                     pl.BlockSpec((None, None, bq, LANES),
                                  lambda b, h, i, t, bref: (b, h, i, 0))],
          scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
      name="compact_attention_fwd_tpu",
  )(bounds_BIQ4.reshape(-1), *args, *pbufs)
  return out.transpose(0, 2, 1, 3), lse[..., 0]


# ----------------------------------------------------------------------------------------------
# backward: dq
# ----------------------------------------------------------------------------------------------

def _dq_kernel(bref, *refs, has_seg, window, scale, bk, nq, I, n_poison):
  it = iter(refs)
  qp_ref = next(it)
  qs_ref = next(it) if has_seg else None
  kp_ref = next(it)
  ks_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  for _ in range(n_poison):
    next(it)
  dq_ref, dq_sc = it

  b, h, i, t = (pl.program_id(a) for a in range(4))
  run, _ = _step(bref, ((b * I + (h if I > 1 else 0)) * nq + i) * 4, t)

  @pl.when(t == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale
    vis = _visible(qp_ref[...], kp_ref[:1, :], None if qs_ref is None else qs_ref[...],
                   None if ks_ref is None else ks_ref[:1, :], window, bk)
    s = jnp.where(vis, s, NEG_INF)
    p = jnp.exp(s - bcast_lanes(lse_safe(lse_ref[...]), bk))
    dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)
    ds = p * (dp - bcast_lanes(delta_ref[...], bk))
    dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def dq(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
       kvseg_BS, bounds_BIQ4, counts_BI, *, scale, window, bs: BlockSizes, interpret=False,
       poison=False):
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  bq, bk = bs.block_q_dq, bs.block_k_dq
  nq = C // bq
  hs = (lambda h: h) if I > 1 else (lambda h: 0)
  has_seg = qseg_BIC is not None
  qp, qs, kp, ks = _prep(qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, S, B)

  def kv_block(b, h, i, t, bref):
    _, j = _step(bref, ((b * I + hs(h)) * nq + i) * 4, t)
    return j

  lanes_i = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, t, bref: (b, hs(h), i, 0))
  lanes_h = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, t, bref: (b, h, i, 0))
  rows_spec = pl.BlockSpec((None, SUBLANES, bk),
                           lambda b, h, i, t, bref: (b, 0, kv_block(b, h, i, t, bref)))
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, bref: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, bref: (
      b, h // G, kv_block(b, h, i, t, bref), 0))
  args, specs = [qp], [lanes_i]
  if has_seg:
    args.append(qs)
    specs.append(lanes_i)
  args.append(kp)
  specs.append(rows_spec)
  if has_seg:
    args.append(ks)
    specs.append(rows_spec)
  tr = lambda x: x.transpose(0, 2, 1, 3)
  args += [tr(q_BCNH), tr(k_BSKH), tr(v_BSKH), tr(do_BCNH), lanes(lse_BNC), lanes(delta_BNC)]
  specs += [q_spec, kv_spec, kv_spec, q_spec, lanes_h, lanes_h]
  out_shapes = [jax.ShapeDtypeStruct((B, N, C, H), q_BCNH.dtype)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {1 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_dq_kernel, has_seg=has_seg, window=window, scale=scale, bk=bk,
                             nq=nq, I=I, n_poison=len(pbufs))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, N, _grid_q(counts_BI, bq, nq), _grid_steps(bounds_BIQ4)),
          in_specs=specs + pspecs,
          out_specs=[q_spec], scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
      name="compact_attention_dq_tpu",
  )(bounds_BIQ4.reshape(-1), *args, *pbufs)[0]
  return tr(out)


# ----------------------------------------------------------------------------------------------
# backward: dk, dv
# ----------------------------------------------------------------------------------------------

def _dkv_kernel(bref, *refs, has_seg, window, scale, bk, nk, I, G, n_poison):
  it = iter(refs)
  qp_ref = next(it)
  qs_ref = next(it) if has_seg else None
  kp_ref = next(it)
  ks_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  for _ in range(n_poison):
    next(it)
  dk_ref, dv_ref, dk_sc, dv_sc = it

  b, kh, j, g, t = (pl.program_id(a) for a in range(5))
  hsel = kh * G + g if I > 1 else 0
  run, _ = _step(bref, ((b * I + hsel) * nk + j) * 4, t)

  @pl.when(jnp.logical_and(g == 0, t == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale   # [bq, bk]
    vis = _visible(qp_ref[...], kp_ref[:1, :], None if qs_ref is None else qs_ref[...],
                   None if ks_ref is None else ks_ref[:1, :], window, bk)
    s = jnp.where(vis, s, NEG_INF)
    p = jnp.exp(s - bcast_lanes(lse_safe(lse_ref[...]), bk))
    dv_sc[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)
    ds = p * (dp - bcast_lanes(delta_ref[...], bk))
    dk_sc[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, t == pl.num_programs(4) - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def dkv(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
        kvseg_BS, boundsT_BIK4, *, scale, window, bs: BlockSizes, interpret=False, poison=False):
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  bq, bk = bs.block_q_dkv, bs.block_k_dkv
  nk = S // bk
  has_seg = qseg_BIC is not None
  qp, qs, kp, ks = _prep(qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, S, B)
  hs = (lambda kh, g: kh * G + g) if I > 1 else (lambda kh, g: 0)

  def q_block(b, kh, j, g, t, bref):
    _, i = _step(bref, ((b * I + hs(kh, g)) * nk + j) * 4, t)
    return i

  lanes_i = pl.BlockSpec((None, None, bq, LANES), lambda b, kh, j, g, t, bref: (
      b, hs(kh, g), q_block(b, kh, j, g, t, bref), 0))
  lanes_h = pl.BlockSpec((None, None, bq, LANES), lambda b, kh, j, g, t, bref: (
      b, kh * G + g, q_block(b, kh, j, g, t, bref), 0))
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, kh, j, g, t, bref: (
      b, kh * G + g, q_block(b, kh, j, g, t, bref), 0))
  rows_spec = pl.BlockSpec((None, SUBLANES, bk), lambda b, kh, j, g, t, bref: (b, 0, j))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, kh, j, g, t, bref: (b, kh, j, 0))
  args, specs = [qp], [lanes_i]
  if has_seg:
    args.append(qs)
    specs.append(lanes_i)
  args.append(kp)
  specs.append(rows_spec)
  if has_seg:
    args.append(ks)
    specs.append(rows_spec)
  tr = lambda x: x.transpose(0, 2, 1, 3)
  args += [tr(q_BCNH), tr(k_BSKH), tr(v_BSKH), tr(do_BCNH), lanes(lse_BNC), lanes(delta_BNC)]
  specs += [q_spec, kv_spec, kv_spec, q_spec, lanes_h, lanes_h]
  out_shapes = [jax.ShapeDtypeStruct((B, K, S, H), k_BSKH.dtype),
                jax.ShapeDtypeStruct((B, K, S, H), v_BSKH.dtype)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {1 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_dkv_kernel, has_seg=has_seg, window=window, scale=scale, bk=bk,
                             nk=nk, I=I, G=G, n_poison=len(pbufs))
  dk, dv = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, K, nk, G, _grid_steps(boundsT_BIK4)),
          in_specs=specs + pspecs,
          out_specs=[kv_spec, kv_spec],
          scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      name="compact_attention_dkv_tpu",
  )(boundsT_BIK4.reshape(-1), *args, *pbufs)
  return tr(dk), tr(dv)
