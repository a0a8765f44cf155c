"""TPU decode kernel (Pallas Mosaic TPU): one (row, kv head, kv part) per grid point, its tiles
streamed by the pipeline.

grid (B, K, P, L), L = ceil(tiles / P) the most tiles a part can hold; the (row, kv head)'s tile
runs and fills are scalar-prefetched, and the K / V index maps send step j of part p to its tile
(api.part_range / entry_tile); a step past the part's count repeats the last tile's index (the
pipeline does not fetch a block again) and is skipped. K / V are read as [B, S, K * H] (a free
reshape) in [block_k, H] blocks of kv head k. The folded query rows (api.fold_queries, padded to
a multiple of 8) attend with an exact per-score mask (fill, kv_valid, causal / window / sinks on
positions) and an online softmax in VMEM scratch; the last step writes O (normalised) and lse.
A cache length S that is no multiple of block_k ends in a partial block: the pipeline leaves its
slots past S unspecified, the fill mask (lengths <= S) drops their scores and their V rows are
zeroed (0 * NaN would not be 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .api import NO_QUERY, entry_tile, num_tiles, part_range

NEG_INF = float("-inf")
_LANES = 128


def decode_parts(q_BKRH, k_BSKH, v_BSKH, qpos_BKR, kvpos_BS, kvvalid_BS, lengths_B, runs_BK4, *,
                 scale, window, sinks, parts, out_rows, block_k, num_stages=None,
                 interpret=False, lists=None, per_block=1):
  """(o [B, K, parts, out_rows, H] in q's dtype, lse [B, K, parts, out_rows] float32); see
  mosaic_gpu.decode_parts."""
  del num_stages  # the Pallas TPU pipeline double-buffers
  B, K, R, H = q_BKRH.shape
  S = k_BSKH.shape[1]
  bk, P = block_k, parts
  nT = num_tiles(S, bk)
  ragged = S % bk != 0  # the last block runs past S: the pipeline leaves its tail unspecified
  L = -(-nT // P)  # listed tiles are distinct and outside the runs: <= nT entries in all
  has_valid, has_pos = kvvalid_BS is not None, kvpos_BS is not None
  has_lists = lists is not None
  dtype = q_BKRH.dtype
  if has_lists:
    lists_BKRL, mode_BKR, listed_BKE = lists
  else:
    lists_BKRL = jnp.zeros((1, 1, R, 1), jnp.int32)
    mode_BKR = jnp.zeros((1, 1, R), jnp.int32)
    listed_BKE = jnp.zeros((1, 1, 1), jnp.int32)
  E = listed_BKE.shape[-1]
  Lp = -(-lists_BKRL.shape[-1] // _LANES) * _LANES   # the lists' lanes (padding: -1)
  lists_BKRL = jnp.pad(lists_BKRL, ((0, 0), (0, 0), (0, 0), (0, Lp - lists_BKRL.shape[-1])),
                       constant_values=-1)

  def runs_of(runs_ref, b, kh):
    return tuple(runs_ref[(b * K + kh) * 4 + c] for c in range(4))

  def listed_of(listed_ref, b, kh):
    return (lambda i: listed_ref[(b * K + kh) * E + i]) if has_lists else None

  def tile_of(b, kh, p, j, runs_ref, listed_ref):
    runs = runs_of(runs_ref, b, kh)
    lo, hi = part_range(runs, p, P)
    e = lo + jnp.minimum(j, jnp.maximum(hi - lo - 1, 0))
    return entry_tile(runs, e, listed_of(listed_ref, b, kh))

  def kv_map(b, kh, p, j, runs_ref, len_ref, listed_ref):
    return b, tile_of(b, kh, p, j, runs_ref, listed_ref), kh

  def pos_map(b, kh, p, j, runs_ref, len_ref, listed_ref):
    return b, 0, tile_of(b, kh, p, j, runs_ref, listed_ref)

  def kernel(runs_ref, len_ref, listed_ref, q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, valid_ref,
             lists_ref, mode_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc):
    b, kh, p, j = (pl.program_id(i) for i in range(4))
    runs = runs_of(runs_ref, b, kh)
    lo, hi = part_range(runs, p, P)

    @pl.when(j == 0)
    def _init():
      m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j < hi - lo)
    def _step():
      tile = entry_tile(runs, lo + j, listed_of(listed_ref, b, kh))
      start = tile * bk
      s = lax.dot_general(q_ref[0, 0], k_ref[0], (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32) * scale          # [R, bk]
      qp = qpos_ref[0, 0]                                                       # [R, 128]
      qp = qp if bk == _LANES else jnp.concatenate([qp] * (bk // _LANES), axis=1)
      idx = start + lax.broadcasted_iota(jnp.int32, (R, bk), 1)
      vis = idx < len_ref[b]
      if has_pos:
        kp = jnp.broadcast_to(kvpos_ref[0], (R, bk))
        vis = vis & (kp <= qp)
        inside = None
        if window is not None:
          inside = qp - kp < window
          if sinks:
            inside = inside | (kp < sinks)
        if has_lists:  # the row's head mode and whether its list holds this tile's block
          lst = lists_ref[0, 0]                                                 # [R, Lp]
          hit = jnp.max(jnp.where(lst == lax.div(tile, per_block), 1, 0), axis=1, keepdims=True)
          lst = jnp.broadcast_to(hit, (R, bk)) != 0
          md = mode_ref[0, 0]                                                   # [R, 128]
          md = md if bk == _LANES else jnp.concatenate([md] * (bk // _LANES), axis=1)
          if inside is None:  # no window: HEAD_FULL / HEAD_WINDOW_BLOCKS see every key
            sel = (md != 1) | lst
          else:
            sel = (((md == 0) & inside) | ((md == 1) & inside & lst)
                   | ((md == 2) & (inside | lst)))
          vis = vis & sel
        elif inside is not None:
          vis = vis & inside
      else:
        vis = vis & (qp != NO_QUERY)
      if has_valid:
        vis = vis & (jnp.broadcast_to(valid_ref[0], (R, bk)) != 0)
      s = jnp.where(vis, s, NEG_INF)
      m_prev = m_sc[...]                                                        # [R, 128]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
      alpha = jnp.exp(m_prev - m_use)
      pr = jnp.exp(s - m_use[:, :1])
      l_sc[...] = alpha * l_sc[...] + jnp.sum(pr, axis=1, keepdims=True)
      v = v_ref[0]
      if ragged:  # P is 0 there, but 0 * NaN is not: zero the rows past S
        v = jnp.where(start + lax.broadcasted_iota(jnp.int32, v.shape, 0) < S, v, 0)
      acc_sc[...] = acc_sc[...] * alpha[:, :1] + jnp.dot(
          pr.astype(dtype), v, preferred_element_type=jnp.float32)
      m_sc[...] = m_new

    @pl.when(j == L - 1)
    def _finish():
      l = l_sc[...]
      empty = l == 0.0
      l_safe = jnp.where(empty, 1.0, l)
      o_ref[0, 0, 0] = (acc_sc[...] / l_safe[:, :1]).astype(o_ref.dtype)
      lse_ref[0, 0, 0] = jnp.where(empty, NEG_INF, m_sc[...] + jnp.log(l_safe))

  kv_spec = pl.BlockSpec((1, bk, H), kv_map)
  in_specs = [
      pl.BlockSpec((1, 1, R, H), lambda b, kh, p, j, *_: (b, kh, 0, 0)),
      kv_spec, kv_spec,
      pl.BlockSpec((1, 1, R, _LANES), lambda b, kh, p, j, *_: (b, kh, 0, 0)),
      pl.BlockSpec((1, 1, bk), pos_map if has_pos else lambda *_: (0, 0, 0)),
      pl.BlockSpec((1, 1, bk), pos_map if has_valid else lambda *_: (0, 0, 0)),
      pl.BlockSpec((1, 1, R, Lp), lambda b, kh, p, j, *_: (b if has_lists else 0,
                                                          kh if has_lists else 0, 0, 0)),
      pl.BlockSpec((1, 1, R, _LANES), lambda b, kh, p, j, *_: (b if has_lists else 0,
                                                              kh if has_lists else 0, 0, 0)),
  ]
  out_specs = [pl.BlockSpec((1, 1, 1, R, H), lambda b, kh, p, j, *_: (b, kh, p, 0, 0)),
               pl.BlockSpec((1, 1, 1, R, _LANES), lambda b, kh, p, j, *_: (b, kh, p, 0, 0))]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(B, K, P, L), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((R, _LANES), jnp.float32), pltpu.VMEM((R, _LANES), jnp.float32),
                      pltpu.VMEM((R, H), jnp.float32)])
  out_shape = [jax.ShapeDtypeStruct((B, K, P, R, H), dtype),
               jax.ShapeDtypeStruct((B, K, P, R, _LANES), jnp.float32)]
  if interpret is True:
    interpret = pltpu.InterpretParams()
  call = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret or False, name="decode_attention_tpu")
  qpos4 = jnp.broadcast_to(qpos_BKR[..., None], (B, K, R, _LANES))
  dummy = jnp.zeros((1, 1, bk), jnp.int32)
  valid = kvvalid_BS.reshape(B, 1, S) if has_valid else dummy
  o, lse = call(runs_BK4.reshape(-1).astype(jnp.int32), lengths_B.astype(jnp.int32),
                listed_BKE.reshape(-1), q_BKRH,
                k_BSKH.reshape(B, S, K * H), v_BSKH.reshape(B, S, K * H), qpos4,
                kvpos_BS.reshape(B, 1, S) if has_pos else dummy, valid, lists_BKRL,
                jnp.broadcast_to(mode_BKR[..., None], mode_BKR.shape + (_LANES,)))
  return o[..., :out_rows, :], lse[..., :out_rows, 0]
