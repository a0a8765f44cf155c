"""Hopper decode kernel (Pallas Mosaic GPU): one program per (kv part, kv head, row).

grid (P, K, B), rows launched fastest; a (row, kv head) uses api.part_count(its entries) <= P of
its P programs (about part_tiles tiles each), the others write an empty part (o 0, lse -inf)
without loading anything. A program holds the 64 folded query rows of its
(row, kv head) (api.fold_queries: T tokens x G query heads, padding rows at NO_QUERY) in shared
memory and walks its part of the (row, kv head)'s tile runs (api.part_range / entry_tile): a
memory warpgroup streams the K / V tiles (block_k slots of kv head k, [block_k, H] each, TMA)
through `num_stages` slots; the compute warpgroup runs S = Q K^T (wgmma, fp32), masks each score
exactly (slot < the row's fill, kv_valid, causal / window / sinks on positions), base-2 online
softmax, and O += P V (wgmma, P in registers). It writes its first out_rows rows of O
(normalised, q's dtype) and their natural-log lse; api.decode_attention merges the parts.
A cache length S that is no multiple of block_k ends in a ragged tile: it loads the last block_k
slots (api.tile_start: TMA stays in bounds) and masks those below its own first slot.

Interpret mode (CPU): flash_tiles' helpers (wgmma with a register operand through
compact_attention/mgpu_interpret.py, the register accumulate `acc_update`).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_tiles import COL as _COL
from pallas_kernels.flash_tiles import LN2, LOG2E, NEG_INF, acc_update, kv_pipeline, mgpu_interpret
from pallas_kernels.flash_tiles import swizzled
from pallas_kernels.flash_tiles import ROW as _ROW
from pallas_kernels.flash_tiles import WGMMA as _WGMMA

from .api import (NO_QUERY, entry_tile, num_entries, num_tiles, part_count, part_range,
                  tile_start)


def decode_parts(q_BKRH, k_BSKH, v_BSKH, qpos_BKR, kvpos_BS, kvvalid_BS, lengths_B, runs_BK4, *,
                 scale, window, sinks, parts, out_rows, block_k, num_stages, interpret=False,
                 lists=None, per_block=1, part_tiles=None):
  """(o [B, K, parts, out_rows, H] in q's dtype, lse [B, K, parts, out_rows] float32): each part's
  attention normalised over its own keys (lse -inf and o 0 where it sees none). kvpos_BS None:
  every slot below the fill is visible to every active row (api.decode_attention's fill-only
  case), positions are not read. lists: None or api.plan's (lists_BKRL, mode_BKR, listed_BKE):
  the listed tiles are read after the runs, and a row sees a key per its head mode (HEAD_FULL:
  the usual mask; HEAD_BLOCKS: and its block, tile // per_block, listed in the row's list;
  HEAD_WINDOW_BLOCKS: causal and valid, and inside the window or listed). part_tiles (static):
  a (row, kv head) splits its entries into api.part_count(n, parts, part_tiles) parts (None:
  `parts` each)."""
  B, K, R, H = q_BKRH.shape
  S = k_BSKH.shape[1]
  dtype = q_BKRH.dtype
  bk, P = block_k, parts
  stages = max(1, min(num_stages, num_tiles(S, bk)))
  ragged = S % bk != 0  # the last tile loads slots [S - bk, S): those of the tile before masked
  qk_scale = scale * LOG2E
  has_valid, has_pos = kvvalid_BS is not None, kvpos_BS is not None
  has_lists = lists is not None
  if has_lists:
    lists_BKRL, mode_BKR, listed_BKE = lists
    L = lists_BKRL.shape[-1]
    lists_BKLR = lists_BKRL.transpose(0, 1, 3, 2)   # a row vector per list entry
  else:
    L = 1
    lists_BKLR = jnp.zeros((1, 1, 1, R), jnp.int32)
    mode_BKR = jnp.zeros((1, 1, R), jnp.int32)
    listed_BKE = jnp.zeros((1, 1, 1), jnp.int32)

  def kernel(q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, kvvalid_ref, len_ref, runs_ref, lists_ref,
             mode_ref, listed_ref, out_ref, lse_ref, scoped):
    (qo_smem, k_smem, v_smem, lse_smem), (k_bar, v_bar, q_bar), (k_used, v_used) = scoped
    p = lax.axis_index("part")
    kh = lax.axis_index("heads")
    b = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    runs = tuple(runs_ref[b, kh, c] for c in range(4))
    listed_at = (lambda i: listed_ref[b, kh, i]) if has_lists else None
    n_parts = P if part_tiles is None else part_count(num_entries(runs), P, part_tiles)
    lo, hi = part_range(runs, p, n_parts)
    hi = jnp.where(p < n_parts, hi, lo)   # a part past the (row, kv head)'s count: empty
    nsteps = hi - lo

    @pl.when(wg == 0)
    def _compute():
      @pl.when(nsteps > 0)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, kh], qo_smem, q_bar.at[0])
      qp = plgpu.load(qpos_ref.at[b, kh], layout=_ROW, optimized=False)
      fill = len_ref[b]
      if has_lists:  # each row's list (one row vector per entry) and head mode
        lv = [plgpu.load(lists_ref.at[b, kh, l], layout=_ROW, optimized=False) for l in range(L)]
        mv = plgpu.load(mode_ref.at[b, kh], layout=_ROW, optimized=False)

      @pl.when(nsteps > 0)
      def _():
        plgpu.barrier_wait(q_bar.at[0])
      m_i = plgpu.layout_cast(jnp.full((R,), NEG_INF, jnp.float32), _ROW)
      l_i = plgpu.layout_cast(jnp.zeros((R,), jnp.float32), _ROW)
      acc = plgpu.layout_cast(jnp.zeros((R, H), jnp.float32), _WGMMA)

      def step(e, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(e - lo, stages)
        tile = entry_tile(runs, e, listed_at)
        start = tile_start(tile, S, bk)
        # the tile's positions / validity: plain global loads, issued before the K wait
        kp_t = ok_t = None
        if has_pos:
          kp_t = plgpu.load(kvpos_ref.at[b, pl.ds(start, bk)], layout=_COL, optimized=False)
        if has_valid:
          ok_t = plgpu.load(kvvalid_ref.at[b, pl.ds(start, bk)], layout=_COL, optimized=False)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(ref):
          plgpu.wgmma(ref, qo_smem, k_smem.at[slot].T)
          return ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((R, bk), jnp.float32))
        plgpu.barrier_arrive(k_used.at[slot])
        shape = s.shape
        qpb = lax.broadcast_in_dim(qp, shape, [0])
        idx = start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA)
        vis = idx < fill
        if ragged:
          vis = vis & (idx >= tile * bk)
        if has_pos:
          kp = lax.broadcast_in_dim(kp_t, shape, [1])
          vis = vis & (kp <= qpb)
          inside = None
          if window is not None:
            inside = qpb - kp < window
            if sinks:
              inside = inside | (kp < sinks)
          if has_lists:
            jb = lax.div(tile, per_block)
            hit = lv[0] == jb
            for x in lv[1:]:
              hit = hit | (x == jb)
            lst = lax.broadcast_in_dim(hit.astype(jnp.int32), shape, [0]) != 0
            md = lax.broadcast_in_dim(mv, shape, [0])
            if inside is None:  # no window: HEAD_FULL / HEAD_WINDOW_BLOCKS see every key
              sel = (md != 1) | lst
            else:
              sel = (((md == 0) & inside) | ((md == 1) & inside & lst)
                     | ((md == 2) & (inside | lst)))
            vis = vis & sel
          elif inside is not None:
            vis = vis & inside
        else:
          vis = vis & (qpb != NO_QUERY)
        if has_valid:
          vis = vis & (lax.broadcast_in_dim(ok_t, shape, [1]) != 0)
        s = jnp.where(vis, s, NEG_INF)
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        pr = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_use, shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + pr.sum(axis=1)
        p16 = pr.astype(dtype)
        plgpu.barrier_wait(v_bar.at[slot])
        acc = acc_update(acc, p16, v_smem.at[slot], interpret)
        plgpu.barrier_arrive(v_used.at[slot])
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(lo, hi, step, (acc, m_i, l_i))
      empty = l_i == 0.0
      l_safe = jnp.where(empty, 1.0, l_i)
      acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      qo_smem[...] = acc.astype(dtype)
      lse_smem[...] = jnp.where(empty, NEG_INF, (m_i + jnp.log2(l_safe)) * LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem.at[pl.ds(0, out_rows)], out_ref.at[b, kh, p])
      plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, out_rows)], lse_ref.at[b, kh, p])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
      kv_pipeline(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_used, v_used, b=b, kh=kh,
                  rows_of=lambda t: pl.ds(tile_start(entry_tile(runs, lo + t, listed_at), S,
                                                     bk), bk),
                  nsteps=nsteps, stages=stages)

  def entry(*refs):
    scratch = (
        (swizzled((R, H), dtype), swizzled((stages, bk, H), dtype),
         swizzled((stages, bk, H), dtype), plgpu.SMEM((R,), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=1)),
        (plgpu.Barrier(num_arrivals=1, num_barriers=stages),) * 2,
    )
    pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, collective_axes="wg")

  def entry_sel(q_ref, k_ref, v_ref, qpos_ref, kvpos_ref, kvvalid_ref, len_ref, runs_ref,
                lists_ref, mode_ref, listed_ref, out_ref, lse_ref):
    entry(q_ref, k_ref, v_ref, qpos_ref, kvpos_ref if has_pos else None,
          kvvalid_ref if has_valid else None, len_ref, runs_ref, lists_ref, mode_ref,
          listed_ref, out_ref, lse_ref)

  out_shape = [jax.ShapeDtypeStruct((B, K, P, out_rows, H), dtype),
               jax.ShapeDtypeStruct((B, K, P, out_rows), jnp.float32)]
  call = plgpu.kernel(
      entry_sel, out_type=out_shape, grid=(P, K, B), grid_names=("part", "heads", "batch"),
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=mgpu_interpret(interpret),
      kernel_name="decode_attention_mgpu")
  return call(q_BKRH, k_BSKH, v_BSKH, qpos_BKR,
              kvpos_BS if has_pos else jnp.zeros((1, 1), jnp.int32),
              kvvalid_BS if has_valid else jnp.zeros((1, 1), jnp.int32), lengths_B, runs_BK4,
              lists_BKLR, mode_BKR, listed_BKE)
