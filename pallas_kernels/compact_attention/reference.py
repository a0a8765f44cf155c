"""The one reference attention and the one mask builder of the tree (also the CPU path).

`dense_mask` turns a mask description (positions, documents, window, sink tokens, active queries,
block lists) into a dense boolean mask; `reference_attention` is masked dense attention with a
float32 softmax. Obviously right rather than fast: it materialises [B, K, G, T, S] logits.
condattn_jax.ops (MaskSpec, impl='reference') and every kernel test use these two functions;
`visibility_mask` and `reference_compact_attention` are the compacted-query kernel's views of them.
Importable without condattn_jax.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Per-head modes of a block list (`dense_mask(head_mode_BN=...)`).
HEAD_FULL = 0    # the head attends with the base mask; its block list is ignored
HEAD_BLOCKS = 1  # the head sees only the kv blocks listed for its query block (and the base mask)


def dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT=None, kv_segment_ids_BS=None, *,
               window=None, sinks=0, active=None, kv_blocks_BNQL=None, head_mode_BN=None,
               block_q=None, block_k=None):
  """Which (query, key) pairs are visible: bool [B, T, S], or [B, N, T, S] when anything is per head.

  Query t of row b sees key slot s iff all of:
    causal      kv_pos <= q_pos;
    document    with both segment id arrays: q_seg == kv_seg and kv_seg != 0 (0 = padding / empty
                cache slot, never attended; a query of segment 0 sees nothing). With kv ids alone
                (a cache's validity): kv_seg != 0, the query chunk is one document;
    window      q_pos - kv_pos < window, or, with `sinks`, kv_pos < sinks (the first `sinks`
                tokens of the document stay visible outside the window: StreamingLLM sinks);
    active      active[b, t] (bool [B, T]) or active[b, t, n] (bool [B, T, N], per query head):
                inactive queries see nothing (their outputs are zeros);
    block list  for query head n with head_mode_BN[b, n] == HEAD_BLOCKS: the key's block
                s // block_k is one of kv_blocks_BNQL[b, n, t // block_q, :] (int32
                [B, N, ceil(T / block_q), L]; entries outside [0, ceil(S / block_k)) are padding).
                Heads with head_mode_BN[b, n] == HEAD_FULL keep the other conditions only;
                head_mode_BN None = every head uses its list.
  Blocks index key slots and query rows (not positions), so a kernel can skip whole tiles.
  """
  qp = q_positions_BT[:, :, None]
  kp = kv_positions_BS[:, None, :]
  m = kp <= qp
  if window is not None:
    inside = (qp - kp) < window
    if sinks:
      inside |= kp < sinks
    m &= inside
  if q_segment_ids_BT is not None and kv_segment_ids_BS is None:
    raise ValueError("dense_mask: q_segment_ids_BT without kv_segment_ids_BS; give kv ids too "
                     "(or kv ids alone for a cache's validity)")
  if kv_segment_ids_BS is not None:
    ks = kv_segment_ids_BS[:, None, :]
    m &= ks != 0
    if q_segment_ids_BT is not None:
      m &= q_segment_ids_BT[:, :, None] == ks
  per_head = (active is not None and active.ndim == 3) or kv_blocks_BNQL is not None
  if not per_head:
    return m if active is None else m & active[:, :, None]
  m = m[:, None]                                                         # [B, 1, T, S]
  if active is not None:
    a = active[:, None, :, None] if active.ndim == 2 else jnp.moveaxis(active, 2, 1)[..., None]
    m = m & a                                                            # [B, N|1, T, S]
  if kv_blocks_BNQL is not None:
    m = m & _block_list_mask(kv_blocks_BNQL, head_mode_BN, m.shape[2], m.shape[3],
                             block_q, block_k)
  return m


def _block_list_mask(kv_blocks_BNQL, head_mode_BN, T, S, block_q, block_k):
  """[B, N, T, S] bool: key slot s is in a block listed for query t's block (or the head is full)."""
  if block_q is None or block_k is None:
    raise ValueError("dense_mask: kv_blocks_BNQL needs block_q and block_k")
  B, N, nq, _ = kv_blocks_BNQL.shape
  if nq != -(-T // block_q):
    raise ValueError(f"kv_blocks_BNQL has {nq} query blocks; T={T} with block_q={block_q} needs "
                     f"{-(-T // block_q)}")
  nk = -(-S // block_k)
  listed = kv_blocks_BNQL[..., None] == jnp.arange(nk, dtype=kv_blocks_BNQL.dtype)  # [B,N,nq,L,nk]
  allowed = jnp.any(listed, axis=3)                                      # [B, N, nq, nk]
  if head_mode_BN is not None:
    allowed |= (head_mode_BN == HEAD_FULL)[:, :, None, None]
  allowed = jnp.repeat(jnp.repeat(allowed, block_q, axis=2)[:, :, :T], block_k, axis=3)
  return allowed[:, :, :, :S]


def check_qkv(q_BTNH, k_BSKH, v_BSKH):
  """One-line ValueError unless q is [B, T, N, H] and k, v are [B, S, K, H] with N % K == 0."""
  q, k, v = q_BTNH, k_BSKH, v_BSKH
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be 4-D [B, T, N, H] / [B, S, K, H]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  B, _, N, H = q.shape
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
    raise ValueError(f"k and v must both be [B={B}, S, K, H={H}]; got {k.shape}, {v.shape}")
  if N % k.shape[2]:
    raise ValueError(f"query heads {N} must be a multiple of kv heads {k.shape[2]}")


def reference_attention(q_BTNH, k_BSKH, v_BSKH, mask, *, scale=None):
  """Masked dense attention: (out [B, T, N, H] in q's dtype, lse [B, T, N] float32).

  k_BSKH, v_BSKH have K kv heads (N % K == 0; query head n uses kv head n // (N // K), K/V are not
  repeated). mask: bool [B, T, S] (shared by heads) or [B, N, T, S], e.g. from `dense_mask`.
  float32 softmax at HIGHEST precision; queries that see no key give zeros and lse = -inf.
  """
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  hi = lax.Precision.HIGHEST
  q = q_BTNH.astype(jnp.float32).reshape(B, T, K, G, H)
  k = k_BSKH.astype(jnp.float32)
  v = v_BSKH.astype(jnp.float32)
  s = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=hi) * scale
  if mask.ndim == 3:
    mask = mask[:, None, None]                                           # [B, 1, 1, T, S]
  else:
    mask = mask.reshape(B, K, G, T, mask.shape[-1])                      # [B, K, G, T, S]
  s = jnp.where(mask, s, -jnp.inf)
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  out = jnp.einsum("bkgts,bskh->btkgh", p / l_safe, v, precision=hi)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]          # [B, K, G, T]
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, T, N)
  return out.reshape(B, T, N, H).astype(q_BTNH.dtype), lse


def visibility_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT=None,
                    kv_segment_ids_BS=None, *, window=None):
  """[B, T, S] bool: kv_pos <= q_pos, q_pos - kv_pos < window, same nonzero segment id.

  The compacted kernel's contract: segment ids come both or neither (`dense_mask` is the general
  builder)."""
  if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None):
    raise ValueError("give both q_segment_ids_BT and kv_segment_ids_BS, or neither")
  return dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                    window=window)


def reference_compact_attention(q_BTNH, k_BSKH, v_BSKH, active, *, q_positions_BT,
                                kv_positions_BS, q_segment_ids_BT=None, kv_segment_ids_BS=None,
                                window=None, scale=None):
  """Returns (out [B, T, N, H] in q's dtype, lse [B, T, N] float32).

  `active` is [B, T] (shared by heads) or [B, T, N] (per head). Inactive queries, and queries that
  see no key, give zeros and lse = -inf.
  """
  if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None):
    raise ValueError("give both q_segment_ids_BT and kv_segment_ids_BS, or neither")
  mask = dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                    window=window, active=active)
  return reference_attention(q_BTNH, k_BSKH, v_BSKH, mask, scale=scale)
