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
