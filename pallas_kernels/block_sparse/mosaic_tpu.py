"""TPU kernels (Pallas Mosaic) for block-sparse attention with per-head modes.

Same contract as triton.py (tables from tables.py), laid out the TPU way (the layout of
pallas_kernels/compact_attention/mosaic_tpu.py): head-major tiles, per-query values replicated
over the 128 lanes, per-key values over 8 sublanes.

The visit tables (head modes, bounds, lists) are scalar-prefetched into SMEM. The innermost grid
axis walks the steps of a program's table: step t is index lo + t, whose kv tile (a HEAD_FULL
head: the index itself; a HEAD_BLOCKS head: its list entry) the index map returns, clamped to the
last valid step so that skipped steps fetch nothing new; the body runs only while lo + t < hi.
That axis is bounded at run time by the longest table (at most L for a layer of HEAD_BLOCKS
heads), so the work follows the lists. Every visited tile is masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Lane / sublane layout helpers shared with the compacted-query Mosaic kernel.
from pallas_kernels.flash_tiles import (LANES, NEG_INF, SUBLANES, NT_DIMS, bcast_lanes, lanes,
                                        lse_safe, poison_buffers, rows)


def _visible(qp_lanes, kp_row, qs_lanes, ks_row, *, window, sinks, bk):
  qp = bcast_lanes(qp_lanes, bk)
  vis = kp_row <= qp
  if window is not None:
    inside = (qp - kp_row) < window
    if sinks:
      inside = jnp.logical_or(inside, kp_row < sinks)
    vis = jnp.logical_and(vis, inside)
  if qs_lanes is not None:
    vis = jnp.logical_and(vis, bcast_lanes(qs_lanes, bk) == ks_row)
  return vis


def _step(full_ref, bounds_ref, list_ref, head, row, t, *, L, n_tiles):
  """(run?, tile) of step t of table row `row` (flat index into [B, N, n]) of head `head`
  (flat index into [B, N])."""
  lo, hi = bounds_ref[row * 4], bounds_ref[row * 4 + 3]
  idx = jnp.minimum(lo + t, jnp.maximum(hi - 1, 0))
  listed = list_ref[row * L + jnp.minimum(idx, L - 1)]
  tile = jnp.where(full_ref[head] != 0, idx, listed)
  return lo + t < hi, jnp.clip(tile, 0, n_tiles - 1)


def _dyn_steps(bounds):
  return jnp.maximum(jnp.max(bounds[..., 3] - bounds[..., 0]), 1).astype(jnp.int32)


def _meta_args(qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, q_spec_of, kv_spec):
  """(args, specs) of the lane / sublane replicated metadata."""
  has_seg = qseg_BIT is not None
  args, specs = [lanes(qpos_BT[:, None, :])], [q_spec_of(False)]
  if has_seg:
    args.append(lanes(qseg_BIT))
    specs.append(q_spec_of(qseg_BIT.shape[1] > 1))
  args.append(rows(kvpos_BS))
  specs.append(kv_spec)
  if has_seg:
    args.append(rows(kvseg_BS))
    specs.append(kv_spec)
  return args, specs


def _read_meta(it, has_seg):
  qp_ref = next(it)
  qs_ref = next(it) if has_seg else None
  kp_ref = next(it)
  ks_ref = next(it) if has_seg else None
  return qp_ref, qs_ref, kp_ref, ks_ref


def _mask(s, qp_ref, qs_ref, kp_ref, ks_ref, *, window, sinks, bk):
  vis = _visible(qp_ref[...], kp_ref[:1, :], None if qs_ref is None else qs_ref[...],
                 None if ks_ref is None else ks_ref[:1, :], window=window, sinks=sinks, bk=bk)
  return jnp.where(vis, s, NEG_INF)


def _tr(x):
  return x.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def _fwd_kernel(full_ref, bounds_ref, list_ref, *refs, has_seg, window, sinks, scale, bk, N, nq,
                nk, L, n_poison):
  it = iter(refs)
  qp_ref, qs_ref, kp_ref, ks_ref = _read_meta(it, has_seg)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  for _ in range(n_poison):
    next(it)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = it

  b, h, i, t = (pl.program_id(a) for a in range(4))
  run, _ = _step(full_ref, bounds_ref, list_ref, b * N + h, (b * N + h) * nq + i, t, L=L,
                 n_tiles=nk)

  @pl.when(t == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q, k = q_ref[...], k_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale
    s = _mask(s, qp_ref, qs_ref, kp_ref, ks_ref, window=window, sinks=sinks, bk=bk)
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    m_use = jnp.where(m_next == NEG_INF, 0.0, m_next)
    p = jnp.exp(s - bcast_lanes(m_use, bk))
    alpha = jnp.exp(m_prev - m_use)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1)[:, None]
    m_sc[...] = m_next
    v = v_ref[...]
    acc_sc[...] = acc_sc[...] * bcast_lanes(alpha, acc_sc.shape[-1]) + lax.dot(
        p.astype(v.dtype), v, preferred_element_type=jnp.float32)

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    l = l_sc[...]
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_sc[...] / bcast_lanes(l_safe, acc_sc.shape[-1])).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, m_sc[...] + jnp.log(l_safe))


def _row_specs(bq, bk, N, nq, nk, L, G):
  """Specs for the forward / dq grid (b, h, i, t) with the three prefetched tables."""
  def kv_tile(b, h, i, t, fr, br, lr):
    return _step(fr, br, lr, b * N + h, (b * N + h) * nq + i, t, L=L, n_tiles=nk)[1]

  q_lanes = lambda per_head: pl.BlockSpec(
      (None, None, bq, LANES),
      (lambda b, h, i, t, *_: (b, h, i, 0)) if per_head else (lambda b, h, i, t, *_: (b, 0, i, 0)))
  kv_rows = pl.BlockSpec((None, SUBLANES, bk),
                         lambda b, h, i, t, *tab: (b, 0, kv_tile(b, h, i, t, *tab)))
  return q_lanes, kv_rows, kv_tile


def fwd(q_BTNH, k_BSKH, v_BSKH, full_BN, bounds_BNQ4, list_BNQL, qpos_BT, qseg_BIT, kvpos_BS,
        kvseg_BS, *, scale, window, sinks, block_q, block_k, interpret=False, poison=False):
  """(out [B, T, N, H], lse [B, N, T] float32)."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, L = N // K, list_BNQL.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  has_seg = qseg_BIT is not None
  q_lanes, kv_rows, kv_tile = _row_specs(bq, bk, N, nq, nk, L, G)
  args, specs = _meta_args(qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, q_lanes, kv_rows)
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, *_: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, *tab: (
      b, h // G, kv_tile(b, h, i, t, *tab), 0))
  args += [_tr(q_BTNH), _tr(k_BSKH), _tr(v_BSKH)]
  specs += [q_spec, kv_spec, kv_spec]
  out_shapes = [jax.ShapeDtypeStruct((B, N, T, H), q_BTNH.dtype),
                jax.ShapeDtypeStruct((B, N, T, LANES), jnp.float32)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {3 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_fwd_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bk=bk, N=N, nq=nq, nk=nk, L=L, n_poison=len(pbufs))
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(B, N, nq, _dyn_steps(bounds_BNQ4)),
          in_specs=specs + pspecs,
          out_specs=[q_spec, q_lanes(True)],
          scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      name="block_sparse_fwd_tpu",
  )(full_BN.reshape(-1), bounds_BNQ4.reshape(-1), list_BNQL.reshape(-1), *args, *pbufs)
  return _tr(out), lse[..., 0]


# ----------------------------------------------------------------------------------------------
# backward: dq
# ----------------------------------------------------------------------------------------------

def _dq_kernel(full_ref, bounds_ref, list_ref, *refs, has_seg, window, sinks, scale, bk, N, nq,
               nk, L, n_poison):
  it = iter(refs)
  qp_ref, qs_ref, kp_ref, ks_ref = _read_meta(it, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  for _ in range(n_poison):
    next(it)
  dq_ref, dq_sc = it

  b, h, i, t = (pl.program_id(a) for a in range(4))
  run, _ = _step(full_ref, bounds_ref, list_ref, b * N + h, (b * N + h) * nq + i, t, L=L,
                 n_tiles=nk)

  @pl.when(t == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale
    s = _mask(s, qp_ref, qs_ref, kp_ref, ks_ref, window=window, sinks=sinks, bk=bk)
    p = jnp.exp(s - bcast_lanes(lse_safe(lse_ref[...]), bk))
    dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)
    ds = p * (dp - bcast_lanes(delta_ref[...], bk))
    dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def dq(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, full_BN, bounds_BNQ4, list_BNQL,
       qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
       interpret=False, poison=False):
  """dq [B, T, N, H]."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, L = N // K, list_BNQL.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  has_seg = qseg_BIT is not None
  q_lanes, kv_rows, kv_tile = _row_specs(bq, bk, N, nq, nk, L, G)
  args, specs = _meta_args(qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, q_lanes, kv_rows)
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, *_: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, *tab: (
      b, h // G, kv_tile(b, h, i, t, *tab), 0))
  args += [_tr(q_BTNH), _tr(k_BSKH), _tr(v_BSKH), _tr(do_BTNH), lanes(lse_BNT),
           lanes(delta_BNT)]
  specs += [q_spec, kv_spec, kv_spec, q_spec, q_lanes(True), q_lanes(True)]
  out_shapes = [jax.ShapeDtypeStruct((B, N, T, H), q_BTNH.dtype)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {3 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_dq_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bk=bk, N=N, nq=nq, nk=nk, L=L, n_poison=len(pbufs))
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(B, N, nq, _dyn_steps(bounds_BNQ4)),
          in_specs=specs + pspecs, out_specs=[q_spec],
          scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      name="block_sparse_dq_tpu",
  )(full_BN.reshape(-1), bounds_BNQ4.reshape(-1), list_BNQL.reshape(-1), *args, *pbufs)[0]
  return _tr(out)


# ----------------------------------------------------------------------------------------------
# backward: dk, dv
# ----------------------------------------------------------------------------------------------

def _dkv_kernel(full_ref, bounds_ref, list_ref, *refs, has_seg, window, sinks, scale, bk, N, G,
                nq, nk, M, n_poison):
  it = iter(refs)
  qp_ref, qs_ref, kp_ref, ks_ref = _read_meta(it, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  for _ in range(n_poison):
    next(it)
  dk_ref, dv_ref, dk_sc, dv_sc = it

  b, kh, j, g, t = (pl.program_id(a) for a in range(5))
  h = kh * G + g
  run, _ = _step(full_ref, bounds_ref, list_ref, b * N + h, (b * N + h) * nk + j, t, L=M,
                 n_tiles=nq)

  @pl.when(jnp.logical_and(g == 0, t == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(run)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, NT_DIMS, preferred_element_type=jnp.float32) * scale   # [bq, bk]
    s = _mask(s, qp_ref, qs_ref, kp_ref, ks_ref, window=window, sinks=sinks, bk=bk)
    p = jnp.exp(s - bcast_lanes(lse_safe(lse_ref[...]), bk))
    dv_sc[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, NT_DIMS, preferred_element_type=jnp.float32)
    ds = p * (dp - bcast_lanes(delta_ref[...], bk))
    dk_sc[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, t == pl.num_programs(4) - 1))
  def _finish():
    dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def dkv(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, full_BN, boundsT_BNK4, listT_BNKM,
        qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
        interpret=False, poison=False):
  """(dk, dv) [B, S, K, H]."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, M = N // K, listT_BNKM.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  has_seg = qseg_BIT is not None

  def q_tile(b, kh, j, g, t, fr, br, lr):
    h = kh * G + g
    return _step(fr, br, lr, b * N + h, (b * N + h) * nk + j, t, L=M, n_tiles=nq)[1]

  def q_lanes(per_head):
    if per_head:
      return pl.BlockSpec((None, None, bq, LANES), lambda b, kh, j, g, t, *tab: (
          b, kh * G + g, q_tile(b, kh, j, g, t, *tab), 0))
    return pl.BlockSpec((None, None, bq, LANES), lambda b, kh, j, g, t, *tab: (
        b, 0, q_tile(b, kh, j, g, t, *tab), 0))

  kv_rows = pl.BlockSpec((None, SUBLANES, bk), lambda b, kh, j, g, t, *_: (b, 0, j))
  args, specs = _meta_args(qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, q_lanes, kv_rows)
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, kh, j, g, t, *tab: (
      b, kh * G + g, q_tile(b, kh, j, g, t, *tab), 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, kh, j, g, t, *_: (b, kh, j, 0))
  args += [_tr(q_BTNH), _tr(k_BSKH), _tr(v_BSKH), _tr(do_BTNH), lanes(lse_BNT),
           lanes(delta_BNT)]
  specs += [q_spec, kv_spec, kv_spec, q_spec, q_lanes(True), q_lanes(True)]
  out_shapes = [jax.ShapeDtypeStruct((B, K, S, H), k_BSKH.dtype),
                jax.ShapeDtypeStruct((B, K, S, H), v_BSKH.dtype)]
  pbufs, pspecs = poison_buffers(out_shapes, poison)
  aliases = {3 + len(args) + n: n for n in range(len(pbufs))}
  kernel = functools.partial(_dkv_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bk=bk, N=N, G=G, nq=nq, nk=nk, M=M,
                             n_poison=len(pbufs))
  dk, dv = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(B, K, nk, G, _dyn_steps(boundsT_BNK4)),
          in_specs=specs + pspecs, out_specs=[kv_spec, kv_spec],
          scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)]),
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      name="block_sparse_dkv_tpu",
  )(full_BN.reshape(-1), boundsT_BNK4.reshape(-1), listT_BNKM.reshape(-1), *args, *pbufs)
  return _tr(dk), _tr(dv)
