"""Query compaction shared by every backend: bucket ladder, gather, scatter, per-tile bounds.

Layouts (names carry shapes):
  idx_BCI   int32 [B, C, I]: original query index of compacted slot c (I = 1 when the active set is
            shared by all query heads (L2A), I = N for per-(row, head) sets (AHA)); padding = T.
  q_BCNH    compacted queries, token-major like the inputs.
  *_BIC     per-query metadata, head-major: positions, segment ids, validity.
  bounds    int32 [B, I, n_tiles, 4] = (lo, full_lo, full_hi, hi): the tile loop runs masked over
            [lo, full_lo), unmasked over [full_lo, full_hi) and masked over [full_hi, hi); tiles
            outside [lo, hi) cannot hold a visible (query, key) pair and are skipped.

The compacted slot order keeps the original order, so with default positions a query tile's
largest position is its last query's; the bounds do not rely on that (they take per-tile min/max),
which keeps packed documents (positions restarting per document) and arbitrary kv positions right.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Padding slots get this position: no key (kv positions are >= PAD_POS + 1) is at or before it.
PAD_POS = -(2 ** 30)
# The kernels size their work by the actual active count (empty query tiles are skipped, the TPU
# grid is bounded at run time), so a bucket only bounds the memory traffic of the gather / scatter
# and of the empty tiles' launch: two buckets, not a fine ladder (each bucket compiles every
# kernel). The GPU kernels use one bucket: their gathers are bounded by the count too (glue.py).
DEFAULT_BUCKET_FRACS = (1 / 4, 1.0)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def bucket_capacities(T: int, *, bucket_fracs: Sequence[float] | None = None,
                      capacity: int | None = None, multiple: int = 128) -> tuple[int, ...]:
  """Static compacted lengths (each a multiple of `multiple`), ascending; the last one holds T.

  Every count 0..T fits some bucket, so no active query is ever dropped: `capacity` is the bucket
  used when it fits, and a full-T bucket takes any overflow.
  """
  full = round_up(max(T, 1), multiple)
  if capacity is not None:
    if capacity <= 0:
      raise ValueError(f"capacity must be positive, got {capacity}")
    caps = {min(round_up(capacity, multiple), full), full}
  else:
    fracs = DEFAULT_BUCKET_FRACS if bucket_fracs is None else tuple(bucket_fracs)
    if not fracs or any(not (0 < f <= 1) for f in fracs):
      raise ValueError(f"bucket_fracs must be fractions in (0, 1], got {fracs}")
    caps = {min(round_up(max(1, math.ceil(f * T)), multiple), full) for f in fracs} | {full}
  return tuple(sorted(caps))


def pick_bucket(count_max, caps: Sequence[int]):
  """Index of the smallest capacity >= count_max (traced)."""
  return jnp.searchsorted(jnp.asarray(caps, jnp.int32), count_max.astype(jnp.int32), side="left")


def active_to_RT(active) -> tuple[jax.Array, int]:
  """[B, T] or [B, T, N] bool -> ([B, I, T], I)."""
  if active.ndim == 2:
    return active[:, None, :], 1
  if active.ndim == 3:
    return jnp.swapaxes(active, 1, 2), active.shape[2]
  raise ValueError(f"active must be [B, T] (shared by heads) or [B, T, N] (per head), got shape "
                   f"{active.shape}")


def mask_from_indices(idx_BC, T: int):
  """Active mask [B, T] from an index list [B, C] (entries outside [0, T) are ignored)."""
  B = idx_BC.shape[0]
  idx = jnp.where((idx_BC >= 0) & (idx_BC < T), idx_BC, T)
  m = jnp.zeros((B, T), bool)
  return m.at[jnp.arange(B)[:, None], idx].set(True, mode="drop")


def active_counts(active_BIT):
  """Active queries per (row, head set): int32 [B, I]. The compacted slots [0, count) are valid."""
  return jnp.sum(active_BIT.astype(jnp.int32), axis=-1)


def compact_slots(active_BIT):
  """Slot of each query in the compacted buffer, int32 [B, I, T]: its rank among the active
  queries of its row (and head set); -1 for inactive queries."""
  slot = jnp.cumsum(active_BIT.astype(jnp.int32), axis=-1) - 1
  return jnp.where(active_BIT, slot, -1)


def compact_indices(active_BIT, C: int, slot_BIT=None):
  """Original indices of the active queries, in order, padded with T: [B, I, C] int32."""
  T = active_BIT.shape[-1]
  slot = compact_slots(active_BIT) if slot_BIT is None else slot_BIT
  slot = jnp.where(slot < 0, C, slot)  # inactive (and overflow, never reached) -> dropped
  src = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), active_BIT.shape)
  idx = jnp.full(active_BIT.shape[:-1] + (C,), T, jnp.int32)
  bi = jnp.arange(active_BIT.shape[0])[:, None, None]
  ii = jnp.arange(active_BIT.shape[1])[None, :, None]
  return idx.at[bi, ii, slot].set(src, mode="drop")


def gather_rows(x_BTN_, idx_BIC):
  """x [B, T, N, ...] -> x_c [B, C, N, ...]; slot c of head n reads row idx[b, n or 0, c].

  Padding slots (idx == T) read row T-1 (callers mask them by position / validity)."""
  B, T, N = x_BTN_.shape[:3]
  I = idx_BIC.shape[1]
  idx = jnp.minimum(idx_BIC, T - 1)
  if I == 1:
    return jnp.take_along_axis(x_BTN_, idx[:, 0, :].reshape((B, -1) + (1,) * (x_BTN_.ndim - 2)),
                               axis=1)
  idx_BCN = jnp.swapaxes(idx, 1, 2).reshape((B, -1, N) + (1,) * (x_BTN_.ndim - 3))
  return jnp.take_along_axis(x_BTN_, idx_BCN, axis=1)


def distinct_padding(idx_BIC, T: int):
  """Padding slots (idx == T) -> distinct out-of-range indices T + slot: a scatter with
  mode='drop' still drops them, and the indices are unique (and stay sorted where they were)."""
  C = idx_BIC.shape[-1]
  return jnp.where(idx_BIC < T, idx_BIC, T + jnp.arange(C, dtype=idx_BIC.dtype))


def scatter_rows(x_c_BCN_, idx_BIC, T: int):
  """Inverse of gather_rows: rows to their original places, zeros elsewhere; padding dropped.

  idx_BIC as compact_indices makes it (active indices ascending, then padding = T): padding slots
  are sent to distinct out-of-range rows (T + slot, still dropped), so XLA is told the indices
  are unique (and, for one active set per row, sorted), which makes the scatter faster
  (docs/performance.md)."""
  B, C, N = x_c_BCN_.shape[:3]
  I = idx_BIC.shape[1]
  out = jnp.zeros((B, T) + x_c_BCN_.shape[2:], x_c_BCN_.dtype)
  idx_BIC = distinct_padding(idx_BIC, T)
  bi = jnp.arange(B)[:, None]
  if I == 1:
    return out.at[bi, idx_BIC[:, 0, :]].set(x_c_BCN_, mode="drop", unique_indices=True,
                                            indices_are_sorted=True)
  idx_BCN = jnp.swapaxes(idx_BIC, 1, 2)
  ni = jnp.arange(N)[None, None, :]
  return out.at[bi[:, :, None], idx_BCN, ni].set(x_c_BCN_, mode="drop", unique_indices=True)


def uncompact_rows(x_c_BCN_, slot_BIT):
  """scatter_rows written as a gather (one read per output row, no scatter): out[b, t, n] =
  x_c[b, slot[b, n or 0, t], n], zeros where slot < 0. slot from compact_slots."""
  B, C, N = x_c_BCN_.shape[:3]
  I = slot_BIT.shape[1]
  tail = (1,) * (x_c_BCN_.ndim - 3)
  if I == 1:
    slot = slot_BIT[:, 0, :].reshape((B, -1, 1) + tail)
  else:
    slot = jnp.swapaxes(slot_BIT, 1, 2).reshape((B, -1, N) + tail)
  g = jnp.take_along_axis(x_c_BCN_, jnp.clip(slot, 0, C - 1), axis=1, mode="promise_in_bounds")
  return jnp.where(slot >= 0, g, jnp.zeros((), x_c_BCN_.dtype))


def uncompact_BNC(x_BNC, slot_BIT, fill):
  """scatter_BNT written as a gather, transposed: [B, N, C] -> [B, T, N], `fill` where slot < 0."""
  B, N, C = x_BNC.shape
  slot = jnp.broadcast_to(slot_BIT, (B, N, slot_BIT.shape[-1]))
  g = jnp.take_along_axis(x_BNC, jnp.clip(slot, 0, C - 1), axis=2, mode="promise_in_bounds")
  return jnp.swapaxes(jnp.where(slot >= 0, g, jnp.asarray(fill, x_BNC.dtype)), 1, 2)


def gather_meta(x_BT, idx_BIC, fill):
  """Per-query metadata [B, T] -> [B, I, C]; padding slots get `fill`."""
  T = x_BT.shape[1]
  g = jnp.take_along_axis(x_BT[:, None, :], jnp.minimum(idx_BIC, T - 1), axis=2)
  return jnp.where(idx_BIC < T, g, jnp.asarray(fill, x_BT.dtype))


def gather_BNT(x_BNT, idx_BIC):
  """Per-(query, head) values [B, N, T] -> [B, N, C] (padding reads row T-1)."""
  T = x_BNT.shape[-1]
  idx = jnp.minimum(idx_BIC, T - 1)
  idx = jnp.broadcast_to(idx, (x_BNT.shape[0], x_BNT.shape[1], idx.shape[-1]))
  return jnp.take_along_axis(x_BNT, idx, axis=2)


def scatter_BNT(x_BNC, idx_BIC, T: int, fill):
  """[B, N, C] -> [B, N, T] with `fill` at positions no slot maps to."""
  B, N, C = x_BNC.shape
  idx = jnp.broadcast_to(idx_BIC, (B, N, C))
  out = jnp.full((B, N, T), fill, x_BNC.dtype)
  return out.at[jnp.arange(B)[:, None, None], jnp.arange(N)[None, :, None], idx].set(
      x_BNC, mode="drop")


# ----------------------------------------------------------------------------------------------
# Per-tile bounds
# ----------------------------------------------------------------------------------------------

def _tile_minmax(x, valid, tile: int, big: int):
  """min / max of x over the valid entries of each tile along the last axis; empty -> (big, -big)."""
  shp = x.shape[:-1] + (x.shape[-1] // tile, tile)
  xv = x.reshape(shp)
  vv = valid.reshape(shp)
  mn = jnp.min(jnp.where(vv, xv, big), axis=-1)
  mx = jnp.max(jnp.where(vv, xv, -big), axis=-1)
  return mn, mx


def _first_true(m, default):
  """Index of the first True along the last axis, or `default` (broadcastable) if none."""
  any_ = jnp.any(m, axis=-1)
  return jnp.where(any_, jnp.argmax(m, axis=-1).astype(jnp.int32), default)


def _ranges(vis, full):
  """vis/full [..., n_a, n_b] -> int32 [..., n_a, 4] (lo, full_lo, full_hi, hi) along b."""
  n_b = vis.shape[-1]
  j = jnp.arange(n_b, dtype=jnp.int32)
  any_ = jnp.any(vis, axis=-1)
  lo = jnp.where(any_, jnp.argmax(vis, axis=-1).astype(jnp.int32), 0)
  hi = jnp.where(any_, n_b - jnp.argmax(vis[..., ::-1], axis=-1).astype(jnp.int32), 0)
  in_range = (j >= lo[..., None]) & (j < hi[..., None])
  full = full & in_range
  flo = _first_true(full, hi)
  fhi = _first_true((~full) & (j >= flo[..., None]) & in_range, hi)
  fhi = jnp.maximum(fhi, flo)
  return jnp.stack([lo, flo, fhi, hi], axis=-1)


def tile_visibility(q_pos_BIC, q_valid_BIC, q_seg_BIC, kv_pos_BS, kv_seg_BS, *, window,
                    block_q: int, block_k: int):
  """(vis, full) bool [B, I, n_q, n_k]: may a tile pair hold a visible pair / are all pairs visible.

  A pair (query, key) is visible iff key_pos <= query_pos, query_pos - key_pos < window (if any),
  and (with segment ids) both have the same nonzero segment id. Padding queries see nothing.
  """
  big = 2 ** 30
  B = q_pos_BIC.shape[0]
  qmin, qmax = _tile_minmax(q_pos_BIC, q_valid_BIC, block_q, big)        # [B, I, nq]
  q_all_valid = jnp.all(q_valid_BIC.reshape(q_valid_BIC.shape[:-1] + (-1, block_q)), axis=-1)
  q_nonempty = jnp.any(q_valid_BIC.reshape(q_valid_BIC.shape[:-1] + (-1, block_q)), axis=-1)
  kv_ok = jnp.ones(kv_pos_BS.shape, bool)
  kmin, kmax = _tile_minmax(kv_pos_BS, kv_ok, block_k, big)              # [B, nk]
  qmin, qmax = qmin[..., :, None], qmax[..., :, None]
  kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
  vis = q_nonempty[..., None] & (kmin <= qmax)
  full = q_all_valid[..., None] & (kmax <= qmin)
  if window is not None:
    vis &= kmax > qmin - window
    full &= kmin > qmax - window
  if q_seg_BIC is not None:
    seg_valid = q_valid_BIC & (q_seg_BIC != 0)
    qsmin, qsmax = _tile_minmax(q_seg_BIC, seg_valid, block_q, big)
    q_seg_all = jnp.all(seg_valid.reshape(seg_valid.shape[:-1] + (-1, block_q)), axis=-1)
    kv_nz = kv_seg_BS != 0
    ksmin, ksmax = _tile_minmax(kv_seg_BS, kv_nz, block_k, big)
    k_seg_all = jnp.all(kv_nz.reshape(B, -1, block_k), axis=-1)
    qsmin, qsmax = qsmin[..., :, None], qsmax[..., :, None]
    ksmin, ksmax = ksmin[:, None, None, :], ksmax[:, None, None, :]
    vis &= (ksmin <= qsmax) & (ksmax >= qsmin)
    full &= (q_seg_all[..., None] & k_seg_all[:, None, None, :] & (qsmin == qsmax)
             & (ksmin == ksmax) & (qsmin == ksmin))
  full &= vis
  return vis, full


def tile_bounds(q_pos_BIC, q_valid_BIC, q_seg_BIC, kv_pos_BS, kv_seg_BS, *, window,
                block_q: int, block_k: int, transpose: bool = False):
  """Loop bounds per query tile over key tiles (or, transpose=True, per key tile over query
  tiles): int32 [B, I, n, 4]."""
  vis, full = tile_visibility(q_pos_BIC, q_valid_BIC, q_seg_BIC, kv_pos_BS, kv_seg_BS,
                              window=window, block_q=block_q, block_k=block_k)
  if transpose:
    vis, full = jnp.swapaxes(vis, -1, -2), jnp.swapaxes(full, -1, -2)
  return _ranges(vis, full)


def bounds_numpy_check(bounds) -> None:
  """Sanity check used by tests: lo <= full_lo <= full_hi <= hi."""
  b = np.asarray(bounds)
  assert np.all(b[..., 0] <= b[..., 1]) and np.all(b[..., 1] <= b[..., 2])
  assert np.all(b[..., 2] <= b[..., 3])
