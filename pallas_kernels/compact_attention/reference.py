"""Pure-jnp reference for compacted-query attention (also the CPU path).

Masked dense attention over all queries, float32 softmax, then inactive rows zeroed. Obviously
right rather than fast: it materialises [B, K, G, T, S] logits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def visibility_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT=None,
                    kv_segment_ids_BS=None, *, window=None):
  """[B, T, S] bool: kv_pos <= q_pos, q_pos - kv_pos < window, same nonzero segment id."""
  qp = q_positions_BT[:, :, None]
  kp = kv_positions_BS[:, None, :]
  m = kp <= qp
  if window is not None:
    m &= (qp - kp) < window
  if q_segment_ids_BT is not None or kv_segment_ids_BS is not None:
    if q_segment_ids_BT is None or kv_segment_ids_BS is None:
      raise ValueError("give both q_segment_ids_BT and kv_segment_ids_BS, or neither")
    qs = q_segment_ids_BT[:, :, None]
    ks = kv_segment_ids_BS[:, None, :]
    m &= (qs == ks) & (ks != 0)
  return m


def reference_compact_attention(q_BTNH, k_BSKH, v_BSKH, active, *, q_positions_BT,
                                kv_positions_BS, q_segment_ids_BT=None, kv_segment_ids_BS=None,
                                window=None, scale=None):
  """Returns (out [B, T, N, H] in q's dtype, lse [B, T, N] float32).

  `active` is [B, T] (shared by heads) or [B, T, N] (per head). Inactive queries, and queries that
  see no key, give zeros and lse = -inf.
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
  vis = visibility_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                        window=window)                                   # [B, T, S]
  if active.ndim == 2:
    act = active[:, None, None, :, None]
  else:
    act = jnp.transpose(active.reshape(B, T, K, G), (0, 2, 3, 1))[..., None]
  mask = vis[:, None, None, :, :] & act                                  # [B, K, G, T, S]
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
