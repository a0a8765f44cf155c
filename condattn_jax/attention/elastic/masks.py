"""Elastic's sparse-attention (SA) modes as `ops.BlockLists` (docs/schemes/elastic.md#semantics).

Blocks index key SLOTS and query ROWS (ops.BlockLists' convention): in self-attention slot =
row = token index of the row; over a full KV cache slot = position (the cache writes position p
to slot p). Lists are sorted ascending, padded with -1, without duplicates (a kernel may sum over
them).

  SSA (streaming): the query's key block kb(q) = q_slot // block sees the sink blocks
      [0, ceil(sinks / block)) and the local blocks kb(q) - local / block + 1 .. kb(q)
      (causality inside the diagonal block comes from the rest of the mask).
  XA (XAttention): per (row, query head, query block) the first and the diagonal key blocks,
      then the other key blocks in decreasing strided anti-diagonal score mass until the mass
      taken (the first and diagonal blocks' counted first) reaches `threshold` of the total.

Rows are expected to hold one document (Elastic decides per sample): sinks are the row's first
tokens, and the ESR pair counts assume the row's valid tokens come first.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _sorted_lists(keep_XK):
  """bool [..., nk] -> int32 [..., nk]: the kept block ids ascending, then -1."""
  nk = keep_XK.shape[-1]
  ids = jnp.where(keep_XK, jnp.arange(nk, dtype=jnp.int32), nk)
  ids = jnp.sort(ids, axis=-1)
  return jnp.where(ids == nk, -1, ids).astype(jnp.int32)


def ssa_lists(q_slot_BQ, *, sinks: int, local: int, block: int, q_last_BQ=None):
  """SSA kv block lists [B, Q, L] for query groups (a query block, or one query with
  block_q = 1) whose first query has key block q_slot_BQ // block: the sink blocks and the
  local / block most recent blocks (L = sink blocks + local blocks). With q_last_BQ (the group's
  last query slot) the local range runs to q_last // block (L + 1 entries): exact for groups
  inside one key block, a superset by one block for a group straddling two."""
  n_sink = -(-sinks // block)
  n_local = max(local // block, 1)
  kb = (q_slot_BQ // block).astype(jnp.int32)[..., None]                  # [B, Q, 1]
  last = kb if q_last_BQ is None else (q_last_BQ // block).astype(jnp.int32)[..., None]
  B, Q = q_slot_BQ.shape
  sink = jnp.broadcast_to(jnp.arange(n_sink, dtype=jnp.int32), (B, Q, n_sink))
  extra = 0 if q_last_BQ is None else 1
  loc = kb - n_local + 1 + jnp.arange(n_local + extra, dtype=jnp.int32)   # [B, Q, n_local(+1)]
  loc = jnp.where((loc >= n_sink) & (loc <= last), loc, -1)               # covered by sinks / < 0
  sink = jnp.where(sink <= last, sink, -1)                                # never past the query
  return jnp.concatenate([sink, loc], axis=-1)


def threshold_select(mass_XK, forced_XK, threshold: float):
  """bool [..., nk]: XAttention's block selection (find_blocks_chunked, causal prefill): the
  forced blocks (first and diagonal), then the other blocks in decreasing mass, each kept while
  the mass taken before it - the forced blocks' mass first, then the larger others' - is
  < threshold * the row's total mass."""
  total = jnp.sum(mass_XK, axis=-1, keepdims=True)
  forced_mass = jnp.sum(jnp.where(forced_XK, mass_XK, 0.0), axis=-1, keepdims=True)
  other = jnp.where(forced_XK, 0.0, mass_XK)
  order = jnp.argsort(jnp.where(forced_XK, 1.0, -other), axis=-1)       # others by mass, forced last
  o_sorted = jnp.take_along_axis(other, order, axis=-1)
  before = jnp.cumsum(jnp.concatenate([forced_mass, o_sorted[..., :-1]], axis=-1), axis=-1)
  keep_sorted = before < threshold * total
  keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
  return keep | forced_XK


XA_Q_CHUNK = 16  # query blocks scored together (ElasticOptions.xa_chunk's default)


def xa_keep(q_BTNH, k_BTKH, valid_BT, *, block: int, stride: int, threshold: float,
            q_chunk: int = XA_Q_CHUNK):
  """bool [B, N, nq, nk]: XAttention's kept (query block, key block) pairs, self-attention of
  a row (T tokens, padded here to a multiple of `block`).

  Score: with Q'[t'] = concat_s q[t' S + s] and K'[j'] = concat_s k[j' S + S - 1 - s]
  (S = stride), Q'[t'].K'[j'] is the sum over the anti-diagonal of the S x S tile (t', j');
  softmax over causal j' <= t' of Q'.K' / (sqrt(H) S); block mass = mean over the block's
  strided rows of the summed probabilities in the key block. Selection: `threshold_select`
  (XAttention's find_blocks_chunked). No gradient flows through the selection.

  Memory: the strided scores are computed `q_chunk` query blocks at a time (lax.map over
  groups of query blocks, each slicing its queries out of q_BTNH), so beyond the strided keys
  (float32 [B, K, T/S, S H], the size of k) the peak is O(B N q_chunk (block / S) (T / S))
  instead of O(B N (T / S)^2). Every query block's scores, softmax and selection depend on that
  block alone, so the kept set does not depend on q_chunk (the tests compare chunk sizes and the
  former unchunked code bit for bit on CPU; a backend whose matmul picks its summation order by
  shape could move a score by an ulp, i.e. decide an exact tie differently)."""
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  G = N // K
  if block % stride:
    raise ValueError(f"model.scheme.block={block} must be a multiple of xa_stride={stride}")
  if q_chunk < 1:
    raise ValueError(f"xa_keep: q_chunk={q_chunk} must be >= 1 (query blocks per chunk)")
  nq = -(-T // block)
  c = min(int(q_chunk), nq)
  n_chunks = -(-nq // c)
  Tp = nq * block
  r = block // stride
  Ts = Tp // stride
  # keys padded to the block grid; queries further, to whole chunks (extra blocks are dropped)
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - T)] + [(0, 0)] * (x.ndim - 2))
  # padding tokens' q / k are zeroed: a stride group straddling a row's end must not score
  # whatever the padding computed (the engine and the full forward fill it differently)
  vmask = jnp.asarray(valid_BT, bool)[:, :, None, None]
  q = lax.stop_gradient(pad(jnp.where(vmask, q_BTNH, 0), n_chunks * c * block))
  k = lax.stop_gradient(pad(jnp.where(vmask, k_BTKH, 0), Tp).astype(jnp.float32))
  ks_BKSD = k.reshape(B, Ts, stride, K, H)[:, :, ::-1].transpose(0, 3, 1, 2, 4).reshape(
      B, K, Ts, stride * H)
  kvalid_BS = pad(valid_BT, Tp).reshape(B, Ts, stride)[:, :, 0]          # first token of the group
  scale = jnp.sqrt(jnp.float32(H)) * stride
  j_blocks = jnp.arange(nq)

  def chunk_keep(i0):
    """Query blocks i0 .. i0 + c - 1 -> keep [B, N, c, nk]."""
    q_BCNH = lax.dynamic_slice_in_dim(q, i0 * block, c * block, axis=1).astype(jnp.float32)
    qs_BKGCD = q_BCNH.reshape(B, c * r, stride, K, G, H).transpose(0, 3, 4, 1, 2, 5).reshape(
        B, K, G, c * r, stride * H)
    rows = i0 * r + jnp.arange(c * r)                                    # strided query rows
    logits = jnp.einsum("bkgtd,bksd->bkgts", qs_BKGCD, ks_BKSD,
                        precision=lax.Precision.HIGHEST).reshape(B, N, c * r, Ts)
    logits = logits / scale
    ok = (jnp.arange(Ts)[None, :] <= rows[:, None])[None, None] & kvalid_BS[:, None, None, :]
    logits = jnp.where(ok, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(ok, p, 0.0)
    mass = p.reshape(B, N, c, r, nq, r).sum(axis=(3, 5)) / r              # [B, N, c, nk]
    i = i0 + jnp.arange(c)
    causal = j_blocks[None, :] <= i[:, None]                             # [c, nk]
    forced = (j_blocks[None, :] == i[:, None]) | (j_blocks[None, :] == 0)
    keep = threshold_select(mass, jnp.broadcast_to(forced, mass.shape), threshold)
    return keep & causal[None, None]

  if n_chunks == 1:
    return chunk_keep(0)[:, :, :nq]
  keep_XBNCK = lax.map(chunk_keep, jnp.arange(n_chunks, dtype=jnp.int32) * c)
  return keep_XBNCK.transpose(1, 2, 0, 3, 4).reshape(B, N, n_chunks * c, nq)[:, :, :nq]


def xa_lists(q_BTNH, k_BTKH, valid_BT, *, block: int, stride: int, threshold: float,
             q_chunk: int = XA_Q_CHUNK):
  """XA kv block lists [B, N, nq, nk] (see `xa_keep`; q_chunk bounds its memory)."""
  return _sorted_lists(xa_keep(q_BTNH, k_BTKH, valid_BT, block=block, stride=stride,
                               threshold=threshold, q_chunk=q_chunk))


def pad_lists(x, L: int):
  """int32 [..., l] -> [..., L] padded with -1 (l <= L)."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, L - x.shape[-1])], constant_values=-1)


def block_pairs(n_valid_B, T: int, block: int):
  """float32 [B, nq, nk]: causal (query, key) pairs between query block i and key block j of a
  row whose first n_valid tokens are valid (rows = slots)."""
  nk = -(-T // block)
  q = jnp.arange(nk * block)
  n = n_valid_B.astype(jnp.int32)[:, None, None]
  hi = jnp.minimum(q[None, :, None] + 1, n)                               # keys 0..hi-1 visible
  lo = jnp.arange(nk)[None, None, :] * block
  per_q = jnp.clip(hi - lo, 0, block) * (q[None, :, None] < n)           # [B, Tp, nk]
  return per_q.reshape(-1, nk, block, nk).sum(axis=2).astype(jnp.float32)


def skipped_fraction(kv_blocks_BNQL, head_mode_BN, n_valid_B, T: int, block: int):
  """float32 [B, N]: fraction of a head's causal (query, key) pairs its block list skips (0 for
  HEAD_FULL heads): the per-head pruning ratio rho of Omega_ESR (paper Def. 2.2). Memory
  O(B N nq max(L, nk)) (lists sorted, unique, -1 padded)."""
  from condattn_jax import ops
  pairs = block_pairs(n_valid_B, T, block)                                # [B, nq, nk]
  B, N, nq, L = kv_blocks_BNQL.shape
  # the lists hold no duplicates (module docstring): the pairs seen are the listed blocks' pairs,
  # gathered per list entry ([B, N, nq, L], not a [B, N, nq, L, nk] membership test)
  at_BNQL = jnp.take_along_axis(jnp.broadcast_to(pairs[:, None], (B, N) + pairs.shape[1:]),
                                jnp.maximum(kv_blocks_BNQL, 0), axis=-1)
  seen = jnp.sum(jnp.where(kv_blocks_BNQL >= 0, at_BNQL, 0.0), axis=(2, 3))
  total = jnp.maximum(jnp.sum(pairs, axis=(1, 2)), 1.0)[:, None]
  rho = jnp.clip(1.0 - seen / total, 0.0, 1.0)
  if head_mode_BN is not None:
    rho = jnp.where(head_mode_BN == ops.HEAD_FULL, 0.0, rho)
  return rho
