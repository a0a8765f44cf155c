"""GPU kernels (pl.pallas_call lowered to Triton) for block-sparse attention with per-head modes.

Inputs are token-major like the op ([B, T, N, H] queries, [B, S, K, H] keys / values, GQA: query
head h reads kv head h // (N // K), K/V never repeated); tiles are the block lists' blocks.
  forward  grid (N, B, q tile): FlashAttention-2 over the tile's visit table (tables.py): a
           HEAD_FULL head walks kv tiles [lo, hi) (masked / unmasked / masked), a HEAD_BLOCKS head
           walks its `count` listed tiles (masked). One launch for every head of a layer. Kv
           tiles are walked in sub-tiles of sub_k keys (like dq).
  dq       grid (N, B, q tile): same tables, dq = scale * dS K, kv tiles walked in sub-tiles of
           block_k_dq keys (fewer live registers than a block_k x H product).
  dk/dv    grid (K, B, kv sub-tile of block_kv_dkv keys): loops over the G query heads of the kv
           head, each over its transposed table (HEAD_FULL: the query tiles that can see the kv
           tile; HEAD_BLOCKS: the query tiles whose lists hold it), in query sub-tiles of
           block_q_dkv rows. Sub-tiles divide the lists' blocks; a table step covers a block's
           sub-tiles in turn (index idx -> block idx // r, sub-tile idx % r).
The element mask inside a tile: kv_pos <= q_pos, window (or a sink key), q_seg == kv_seg (the
api folds documents, a cache's validity and the active set into these ids).
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Tile math shared with the compacted-query Triton kernel.
from pallas_kernels.flash_tiles import LN2, LOG2E, NEG_INF, bwd_lse2, dot

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)


def visible(qp, kp, qs, ks, *, window, sinks):
  """qp/qs per query [bq], kp/ks per key [bk] -> [bq, bk] bool."""
  vis = kp[None, :] <= qp[:, None]
  if window is not None:
    inside = (qp[:, None] - kp[None, :]) < window
    if sinks:
      inside |= kp[None, :] < sinks
    vis &= inside
  if qs is not None:
    vis &= qs[:, None] == ks[None, :]
  return vis


def _loops(bounds, body, carry):
  lo, flo, fhi, hi = bounds
  carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _poison_args(shapes, poison):
  if not poison:
    return []
  return [jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -7, s.dtype)
          for s in shapes]


def _meta_specs(has_seg, I, S, T, qtile):
  """Specs of (qpos [B, T], qseg [B, I, T]?, kvpos [B, S], kvseg [B, S]?) for grid (h, b, p)."""
  hs = (lambda h: h) if I > 1 else (lambda h: 0)
  specs = [pl.BlockSpec((None, T), lambda h, b, p: (b, 0))]
  if has_seg:
    specs.append(pl.BlockSpec((None, None, T), lambda h, b, p: (b, hs(h), 0)))
  specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  if has_seg:
    specs.append(pl.BlockSpec((None, S), lambda h, b, p: (b, 0)))
  return specs


def _read_meta(it, has_seg):
  qpos_ref = next(it)
  qseg_ref = next(it) if has_seg else None
  kvpos_ref = next(it)
  kvseg_ref = next(it) if has_seg else None
  return qpos_ref, qseg_ref, kvpos_ref, kvseg_ref


def _kv_tile(full, list_ref, i, idx, L, nk, masked=True):
  """The kv tile of table index idx. The unmasked range exists only for HEAD_FULL heads (a
  HEAD_BLOCKS head's bounds are (0, 0, 0, count)), so there idx is the tile: an affine address
  that Triton's pipeliner can prefetch without waiting on a list load."""
  if not masked:
    return idx
  j = jnp.where(full, idx, list_ref[i, jnp.minimum(idx, L - 1)])
  return jnp.clip(j, 0, nk - 1)


def _scaled(bounds, r):
  """Table bounds in blocks -> in sub-tiles (r sub-tiles per block)."""
  return tuple(b * r for b in bounds)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, has_seg, window, sinks, scale, bq, bk, bks, nq, nk, L):
  it = iter(refs)
  full_ref, bounds_ref, list_ref = next(it), next(it), next(it)
  qpos_ref, qseg_ref, kvpos_ref, kvseg_ref = _read_meta(it, has_seg)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  *_, o_ref, lse_ref = refs
  i = nq - 1 - pl.program_id(2)
  full = full_ref[...] != 0
  bounds = tuple(bounds_ref[i, c] for c in range(4))
  q = q_ref[...]
  qp = qpos_ref[pl.ds(i * bq, bq)]
  qs = None if qseg_ref is None else qseg_ref[pl.ds(i * bq, bq)]
  H = q.shape[-1]
  qk_scale = scale * LOG2E

  r = bk // bks

  def body(idx, carry, *, masked):
    acc, m, l = carry
    tile = _kv_tile(full, list_ref, i, idx // r, L, nk, masked)
    start = pl.multiple_of(tile * bk + (idx % r) * bks, bks)
    k = k_ref[pl.ds(start, bks), :]
    s = dot(q, k, trans_b=True) * qk_scale
    if masked:
      kp = kvpos_ref[pl.ds(start, bks)]
      ks = None if kvseg_ref is None else kvseg_ref[pl.ds(start, bks)]
      s = jnp.where(visible(qp, kp, qs, ks, window=window, sinks=sinks), s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    v = v_ref[pl.ds(start, bks), :]
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m_new, l

  acc = jnp.zeros((bq, H), jnp.float32)
  m = jnp.full((bq,), NEG_INF, jnp.float32)
  l = jnp.zeros((bq,), jnp.float32)
  acc, m, l = _loops(_scaled(bounds, r), body, (acc, m, l))
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(l_safe)) * LN2)


def fwd(q_BTNH, k_BSKH, v_BSKH, full_BN, bounds_BNQ4, list_BNQL, qpos_BT, qseg_BIT, kvpos_BS,
        kvseg_BS, *, scale, window, sinks, block_q, block_k, num_warps, num_stages,
        sub_k=None, interpret=False, poison=False, name="block_sparse_fwd"):
  """(out [B, T, N, H], lse [B, N, T] float32 natural log, -inf where nothing is visible);
  sub_k: keys per inner step (divides block_k; default block_k)."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, L = N // K, list_BNQL.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  has_seg = qseg_BIT is not None
  I = qseg_BIT.shape[1] if has_seg else 1
  qi = lambda p: nq - 1 - p  # heavy (late) tiles first

  args = [full_BN, bounds_BNQ4, list_BNQL, qpos_BT] + ([qseg_BIT] if has_seg else [])
  args += [kvpos_BS] + ([kvseg_BS] if has_seg else []) + [q_BTNH, k_BSKH, v_BSKH]
  specs = [pl.BlockSpec((None, None), lambda h, b, p: (b, h)),
           pl.BlockSpec((None, None, nq, 4), lambda h, b, p: (b, h, 0, 0)),
           pl.BlockSpec((None, None, nq, L), lambda h, b, p: (b, h, 0, 0)),
           *_meta_specs(has_seg, I, S, T, bq),
           pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0)),
           pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0)),
           pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0))]
  out_shapes = [jax.ShapeDtypeStruct((B, T, N, H), q_BTNH.dtype),
                jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  out_specs = [pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0)),
               pl.BlockSpec((None, None, bq), lambda h, b, p: (b, h, qi(p)))]
  pbufs = _poison_args(out_shapes, poison)
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  specs += out_specs[:len(pbufs)]
  kernel = functools.partial(_fwd_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bq=bq, bk=bk, bks=sub_k or bk, nq=nq, nk=nk, L=L)
  return pl.pallas_call(
      kernel, grid=(N, B, nq), in_specs=specs, out_specs=out_specs, out_shape=out_shapes,
      input_output_aliases=aliases, interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(*args, *pbufs)


# ----------------------------------------------------------------------------------------------
# backward: dq
# ----------------------------------------------------------------------------------------------

def _dq_kernel(*refs, has_seg, window, sinks, scale, bq, bk, bks, nq, nk, L):
  it = iter(refs)
  full_ref, bounds_ref, list_ref = next(it), next(it), next(it)
  qpos_ref, qseg_ref, kvpos_ref, kvseg_ref = _read_meta(it, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  dq_ref = refs[-1]
  i = nq - 1 - pl.program_id(2)
  full = full_ref[...] != 0
  bounds = tuple(bounds_ref[i, c] for c in range(4))
  q, do = q_ref[...], do_ref[...]
  lse2 = bwd_lse2(lse_ref[...])
  delta = delta_ref[...]
  qp = qpos_ref[pl.ds(i * bq, bq)]
  qs = None if qseg_ref is None else qseg_ref[pl.ds(i * bq, bq)]
  qk_scale = scale * LOG2E

  r = bk // bks

  def body(idx, dq, *, masked):
    tile = _kv_tile(full, list_ref, i, idx // r, L, nk, masked)
    start = pl.multiple_of(tile * bk + (idx % r) * bks, bks)
    k = k_ref[pl.ds(start, bks), :]
    v = v_ref[pl.ds(start, bks), :]
    s = dot(q, k, trans_b=True) * qk_scale
    if masked:
      kp = kvpos_ref[pl.ds(start, bks)]
      ks = None if kvseg_ref is None else kvseg_ref[pl.ds(start, bks)]
      s = jnp.where(visible(qp, kp, qs, ks, window=window, sinks=sinks), s, NEG_INF)
    p = jnp.exp2(s - lse2[:, None])
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.astype(k.dtype), k)

  dq = _loops(_scaled(bounds, r), body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dq(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, full_BN, bounds_BNQ4, list_BNQL,
       qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
       num_warps, num_stages, sub_k=None, interpret=False, poison=False):
  """dq [B, T, N, H]; sub_k: keys per inner step (divides block_k; default block_k)."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, L = N // K, list_BNQL.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  has_seg = qseg_BIT is not None
  I = qseg_BIT.shape[1] if has_seg else 1
  qi = lambda p: nq - 1 - p

  q_spec = pl.BlockSpec((None, bq, None, H), lambda h, b, p: (b, qi(p), h, 0))
  kv_spec = pl.BlockSpec((None, S, None, H), lambda h, b, p: (b, 0, h // G, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda h, b, p: (b, h, qi(p)))
  args = [full_BN, bounds_BNQ4, list_BNQL, qpos_BT] + ([qseg_BIT] if has_seg else [])
  args += [kvpos_BS] + ([kvseg_BS] if has_seg else [])
  args += [q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT]
  specs = [pl.BlockSpec((None, None), lambda h, b, p: (b, h)),
           pl.BlockSpec((None, None, nq, 4), lambda h, b, p: (b, h, 0, 0)),
           pl.BlockSpec((None, None, nq, L), lambda h, b, p: (b, h, 0, 0)),
           *_meta_specs(has_seg, I, S, T, bq),
           q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  out_shapes = [jax.ShapeDtypeStruct((B, T, N, H), q_BTNH.dtype)]
  pbufs = _poison_args(out_shapes, poison)
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  specs += [q_spec for _ in pbufs]
  kernel = functools.partial(_dq_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bq=bq, bk=bk, bks=sub_k or bk, nq=nq, nk=nk, L=L)
  return pl.pallas_call(
      kernel, grid=(N, B, nq), in_specs=specs, out_specs=[q_spec], out_shape=out_shapes,
      input_output_aliases=aliases, interpret=interpret, name="block_sparse_dq",
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(*args, *pbufs)[0]


# ----------------------------------------------------------------------------------------------
# backward: dk, dv
# ----------------------------------------------------------------------------------------------

def _dkv_kernel(*refs, has_seg, window, sinks, scale, bq, bqs, rk, nq, G, per_head):
  it = iter(refs)
  full_ref, bounds_ref, list_ref = next(it), next(it), next(it)
  qpos_ref = next(it)
  qseg_ref = next(it) if has_seg else None
  kvpos_ref = next(it)
  kvseg_ref = next(it) if has_seg else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(6))
  dk_ref, dv_ref = refs[-2], refs[-1]

  j = pl.program_id(2) // rk             # the lists' kv block of this program's sub-tile
  k, v = k_ref[...], v_ref[...]
  kp = kvpos_ref[...]
  ks = None if kvseg_ref is None else kvseg_ref[...]
  qk_scale = scale * LOG2E

  def head(g, carry):
    full = full_ref[g] != 0
    bounds = tuple(bounds_ref[g, j, c] for c in range(4))
    M = nq
    r = bq // bqs

    def body(idx, carry, *, masked):
      dk, dv = carry
      blk = idx // r
      if masked:
        i = jnp.clip(jnp.where(full, blk, list_ref[g, j, jnp.minimum(blk, M - 1)]), 0, nq - 1)
      else:  # the unmasked range is HEAD_FULL's (see _kv_tile)
        i = blk
      sl = pl.ds(pl.multiple_of(i * bq + (idx % r) * bqs, bqs), bqs)
      q = q_ref[sl, g, :]
      do = do_ref[sl, g, :]
      lse2 = bwd_lse2(lse_ref[g, sl])
      delta = delta_ref[g, sl]
      sT = dot(k, q, trans_b=True) * qk_scale                      # [bk, bq]
      if masked:
        qp = qpos_ref[sl]
        qs = None if qseg_ref is None else qseg_ref[g if per_head else 0, sl]
        vis = visible(qp, kp, qs, ks, window=window, sinks=sinks)
        sT = jnp.where(vis.T, sT, NEG_INF)
      pT = jnp.exp2(sT - lse2[None, :])
      dv = dv + dot(pT.astype(do.dtype), do)
      dpT = dot(v, do, trans_b=True)                                 # [bk, bq]
      dsT = pT * (dpT - delta[None, :])
      dk = dk + dot(dsT.astype(q.dtype), q)
      return dk, dv

    return _loops(_scaled(bounds, r), body, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def dkv(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, full_BN, boundsT_BNK4, listT_BNKM,
        qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
        num_warps, num_stages, sub_q=None, sub_k=None, interpret=False, poison=False):
  """(dk, dv) [B, S, K, H]; a program owns sub_k keys (divides block_k) and walks queries in
  sub_q rows (divides block_q); defaults: the blocks."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, M = N // K, listT_BNKM.shape[-1]
  bq, bk = block_q, block_k
  nq, nk = T // bq, S // bk
  bkp = sub_k or bk
  nkp = S // bkp
  has_seg = qseg_BIT is not None
  per_head = has_seg and qseg_BIT.shape[1] > 1
  Gi = G if per_head else 1
  ksel = (lambda kh: kh) if per_head else (lambda kh: 0)

  args = [full_BN, boundsT_BNK4, listT_BNKM, qpos_BT] + ([qseg_BIT] if has_seg else [])
  specs = [pl.BlockSpec((None, G), lambda kh, b, j: (b, kh)),
           pl.BlockSpec((None, G, nk, 4), lambda kh, b, j: (b, kh, 0, 0)),
           pl.BlockSpec((None, G, nk, M), lambda kh, b, j: (b, kh, 0, 0)),
           pl.BlockSpec((None, T), lambda kh, b, j: (b, 0))]
  if has_seg:
    specs.append(pl.BlockSpec((None, Gi, T), lambda kh, b, j: (b, ksel(kh), 0)))
  args.append(kvpos_BS)
  specs.append(pl.BlockSpec((None, bkp), lambda kh, b, j: (b, j)))
  if has_seg:
    args.append(kvseg_BS)
    specs.append(pl.BlockSpec((None, bkp), lambda kh, b, j: (b, j)))
  qg_spec = pl.BlockSpec((None, T, G, H), lambda kh, b, j: (b, 0, kh, 0))
  kv_spec = pl.BlockSpec((None, bkp, None, H), lambda kh, b, j: (b, j, kh, 0))
  row_spec = pl.BlockSpec((None, G, T), lambda kh, b, j: (b, kh, 0))
  args += [q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT]
  specs += [qg_spec, kv_spec, kv_spec, qg_spec, row_spec, row_spec]
  out_shapes = [jax.ShapeDtypeStruct(k_BSKH.shape, k_BSKH.dtype),
                jax.ShapeDtypeStruct(v_BSKH.shape, v_BSKH.dtype)]
  pbufs = _poison_args(out_shapes, poison)
  aliases = {len(args) + n: n for n in range(len(pbufs))}
  specs += [kv_spec for _ in pbufs]
  kernel = functools.partial(_dkv_kernel, has_seg=has_seg, window=window, sinks=sinks,
                             scale=scale, bq=bq, bqs=sub_q or bq, rk=bk // bkp, nq=nq, G=G,
                             per_head=per_head)
  return pl.pallas_call(
      kernel, grid=(K, B, nkp), in_specs=specs, out_specs=[kv_spec, kv_spec],
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret,
      name="block_sparse_dkv",
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(*args, *pbufs)
