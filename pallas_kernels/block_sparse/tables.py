"""Visit tables: which kv tiles each (batch, query head, query tile) program visits, and back.

Layouts (names carry shapes; tiles are the block lists' blocks, block_q x block_k):
  full_BN      int32 [B, N]: 1 = the head is HEAD_FULL (its list is ignored), 0 = HEAD_BLOCKS.
  bounds_BNQ4  int32 [B, N, nq, 4] = (lo, full_lo, full_hi, hi) in *index space*: the program of
               query tile i runs masked over [lo, full_lo), unmasked over [full_lo, full_hi) and
               masked over [full_hi, hi). Index idx is kv tile idx for a HEAD_FULL head (the
               causally visible range of compaction.tile_bounds) and kv tile list_BNQL[.., idx]
               for a HEAD_BLOCKS head, whose bounds are (0, 0, 0, count): always masked.
  list_BNQL    int32 [B, N, nq, L]: the listed kv tiles that can hold a visible pair, sorted,
               deduplicated, entries past the count clamped into [0, nk) (never visited).
  boundsT_BNK4, listT_BNKM (M = nq): the transposed tables for dk/dv, per kv tile over query
               tiles (HEAD_FULL: transposed tile bounds; HEAD_BLOCKS: the query tiles whose lists
               hold the kv tile).
Padding (-1 or any entry outside [0, nk)), duplicates, and listed tiles that no pair of the tile
can see (future tiles, other documents, outside the window and not a sink tile) are dropped here,
so the kernels only ever do useful tiles.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.compact_attention import compaction as cp

# Head mode of the Mosaic GPU kernel and the reference: the window (and sinks) OR the listed
# blocks (MATCH's "window OR retrieved chunks", segmented prefixes); HEAD_FULL = 0 and
# HEAD_BLOCKS = 1 are reference.py's.
HEAD_WINDOW_BLOCKS = 2


def tile_visibility(qpos_BT, kvpos_BS, qseg_BT, kvseg_BS, valid_BIT, *, window, sinks,
                    block_q, block_k):
  """(vis, full) bool [B, I, nq, nk] under the element mask (causal, documents, window, sinks).

  qseg_BT / kvseg_BS: None or normalised ids (both given; 0 never attended). valid_BIT: queries
  that may see anything ([B, 1, T] or per head [B, N, T]). vis: the tile pair may hold a visible
  pair; full: every pair is visible (no mask needed)."""
  B, I, T = valid_BIT.shape
  qpos = jnp.broadcast_to(qpos_BT[:, None, :], (B, I, T))
  qseg = None if qseg_BT is None else jnp.broadcast_to(qseg_BT[:, None, :], (B, I, T))
  kw = dict(block_q=block_q, block_k=block_k)
  vis, full = cp.tile_visibility(qpos, valid_BIT, qseg, kvpos_BS, kvseg_BS, window=window, **kw)
  if window is not None and sinks:
    # Sink keys (kv_pos < sinks) stay visible outside the window: tiles holding one are visible
    # wherever they are causally visible; `full` keeps the window's (stricter) answer.
    vis_causal, _ = cp.tile_visibility(qpos, valid_BIT, qseg, kvpos_BS, kvseg_BS, window=None,
                                       **kw)
    kmin = jnp.min(kvpos_BS.reshape(B, -1, block_k), axis=-1)          # [B, nk]
    vis = vis | (vis_causal & (kmin < sinks)[:, None, None, :])
  return vis, full & vis


def forward_tables(kv_blocks_BNQL, full_BN, vis_BIQK, full_BIQK):
  """(bounds_BNQ4, list_BNQL) for the forward and dq kernels (full_BN: 1 = HEAD_FULL)."""
  B, N, nq, L = kv_blocks_BNQL.shape
  nk = vis_BIQK.shape[-1]
  lst = kv_blocks_BNQL.astype(jnp.int32)
  ok = (lst >= 0) & (lst < nk)
  vis = jnp.broadcast_to(vis_BIQK, (B, N, nq, nk))
  ok &= jnp.take_along_axis(vis, jnp.clip(lst, 0, nk - 1), axis=-1)
  s = jnp.sort(jnp.where(ok, lst, nk), axis=-1)
  dup = jnp.concatenate([jnp.zeros_like(s[..., :1], bool), s[..., 1:] == s[..., :-1]], axis=-1)
  s = jnp.sort(jnp.where(dup, nk, s), axis=-1)
  count = jnp.sum(s < nk, axis=-1, dtype=jnp.int32)                       # [B, N, nq]
  zero = jnp.zeros_like(count)
  sparse = jnp.stack([zero, zero, zero, count], axis=-1)
  dense = jnp.broadcast_to(cp._ranges(vis_BIQK, full_BIQK), (B, N, nq, 4))
  bounds = jnp.where(full_BN[:, :, None, None] == 1, dense, sparse)
  return bounds, jnp.minimum(s, nk - 1)


def transposed_tables(full_BN, bounds_BNQ4, list_BNQL, vis_BIQK, full_BIQK):
  """(boundsT_BNK4, listT_BNKM) for the dk/dv kernel (M = nq)."""
  B, N, nq, L = list_BNQL.shape
  nk = vis_BIQK.shape[-1]
  listed = jnp.arange(L, dtype=jnp.int32) < bounds_BNQ4[..., 3:4]        # [B, N, nq, L]
  cols = jnp.where(listed, list_BNQL, nk)
  b = jnp.arange(B)[:, None, None, None]
  n = jnp.arange(N)[None, :, None, None]
  i = jnp.arange(nq)[None, None, :, None]
  allowed = jnp.zeros((B, N, nk, nq), bool).at[b, n, cols, i].set(True, mode="drop")
  rows = jnp.sort(jnp.where(allowed, jnp.arange(nq, dtype=jnp.int32), nq), axis=-1)
  count = jnp.sum(allowed, axis=-1, dtype=jnp.int32)                      # [B, N, nk]
  zero = jnp.zeros_like(count)
  sparse = jnp.stack([zero, zero, zero, count], axis=-1)
  dense = jnp.broadcast_to(cp._ranges(jnp.swapaxes(vis_BIQK, -1, -2),
                                      jnp.swapaxes(full_BIQK, -1, -2)), (B, N, nk, 4))
  boundsT = jnp.where(full_BN[:, :, None, None] == 1, dense, sparse)
  return boundsT, jnp.minimum(rows, nq - 1)


# ----------------------------------------------------------------------------------------------
# Step tables of the Mosaic GPU (Hopper) kernels: every program walks an explicit list of steps.
# ----------------------------------------------------------------------------------------------

# A step entry is tile * 4 + kind; kind 0: every pair of the tile pair is visible (no mask),
# KIND_WINDOW: the element mask with the window / sinks, KIND_LISTED: the element mask without
# the window (a listed tile of a HEAD_WINDOW_BLOCKS head: its blocks are seen whole).
KIND_FULL, KIND_WINDOW, KIND_LISTED = 0, 1, 2


def step_tables(kv_blocks_BNQL, mode_BN, vis_w_BIQK, full_w_BIQK, vis_c_BIQK, full_c_BIQK):
  """(steps_BNQX, count_BNQ) for the Mosaic GPU forward and dq kernels (X = nk).

  mode_BN: int [B, N] head modes (HEAD_FULL / HEAD_BLOCKS / HEAD_WINDOW_BLOCKS). vis_w / full_w:
  tile visibility under the whole element mask (window and sinks included); vis_c / full_c: the
  same without the window (causal, documents, active). Program (b, n, i) visits, in ascending
  tile order, count_BNQ[b, n, i] entries steps_BNQX[b, n, i, :count] = tile * 4 + kind:
    HEAD_FULL          the tiles that can hold a visible pair (sinks and window exact: tiles
                       between the sink tiles and the window are not visited);
    HEAD_BLOCKS        the listed tiles among them (padding, duplicates dropped);
    HEAD_WINDOW_BLOCKS the window's tiles and the listed tiles visible without the window
                       (KIND_LISTED: their pairs need no window test).
  kind 0 where every pair of the tile pair is visible. Entries past the count are 0."""
  from pallas_kernels.compact_attention.reference import HEAD_BLOCKS as _HB, HEAD_FULL as _HF
  B, N, nq, L = kv_blocks_BNQL.shape
  nk = vis_w_BIQK.shape[-1]
  shape = (B, N, nq, nk)
  lst = kv_blocks_BNQL.astype(jnp.int32)
  ok = (lst >= 0) & (lst < nk)
  b = jnp.arange(B)[:, None, None, None]
  n = jnp.arange(N)[None, :, None, None]
  i = jnp.arange(nq)[None, None, :, None]
  listed = jnp.zeros(shape, bool).at[b, n, i, jnp.where(ok, lst, nk)].set(True, mode="drop")
  vis_w, full_w, vis_c, full_c = (jnp.broadcast_to(x, shape) for x in
                                  (vis_w_BIQK, full_w_BIQK, vis_c_BIQK, full_c_BIQK))
  mode = mode_BN.astype(jnp.int32)[:, :, None, None]
  lst2 = (mode == HEAD_WINDOW_BLOCKS) & listed & vis_c
  take = jnp.where(mode == _HF, vis_w, jnp.where(mode == _HB, listed & vis_w, vis_w | lst2))
  unmasked = jnp.where(lst2, full_c, full_w)
  kind = jnp.where(unmasked, KIND_FULL, jnp.where(lst2, KIND_LISTED, KIND_WINDOW))
  entry = jnp.arange(nk, dtype=jnp.int32) * 4 + kind
  pos = jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1
  steps = jnp.zeros(shape, jnp.int32).at[b, n, i, jnp.where(take, pos, nk)].set(
      entry, mode="drop")
  return steps, jnp.sum(take, axis=-1, dtype=jnp.int32)


def transposed_step_tables(steps_BNQX, count_BNQ, num_kv_heads):
  """(tsteps_BKJY, tcount_BKJ) for the Mosaic GPU dk/dv kernel (Y = G * nq): per kv head and kv
  tile j, the (query head g of the kv head, query tile i) pairs whose forward tables visit j, in
  ascending (g, i) order, as entries (g * nq + i) * 4 + kind; entries past the count are 0."""
  B, N, nq, nk = steps_BNQX.shape
  K = num_kv_heads
  G = N // K
  live = jnp.arange(nk, dtype=jnp.int32) < count_BNQ[..., None]
  tile = jnp.where(live, steps_BNQX // 4, nk)
  b = jnp.arange(B)[:, None, None, None]
  n = jnp.arange(N)[None, :, None, None]
  i = jnp.arange(nq)[None, None, :, None]
  kindT = jnp.full((B, N, nk, nq), -1, jnp.int32).at[b, n, tile, i].set(steps_BNQX % 4,
                                                                          mode="drop")
  kindT = jnp.transpose(kindT.reshape(B, K, G, nk, nq), (0, 1, 3, 2, 4)).reshape(
      B, K, nk, G * nq)
  take = kindT >= 0
  entry = jnp.arange(G * nq, dtype=jnp.int32) * 4 + jnp.maximum(kindT, 0)
  pos = jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1
  bb = jnp.arange(B)[:, None, None, None]
  kk = jnp.arange(K)[None, :, None, None]
  jj = jnp.arange(nk)[None, None, :, None]
  tsteps = jnp.zeros((B, K, nk, G * nq), jnp.int32).at[
      bb, kk, jj, jnp.where(take, pos, G * nq)].set(entry, mode="drop")
  return tsteps, jnp.sum(take, axis=-1, dtype=jnp.int32)
