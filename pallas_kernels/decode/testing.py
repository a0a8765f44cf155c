"""Test problems of the decode kernels (CPU interpret tests and tests/gpu share them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_problem(B=2, T=1, N=6, K=2, H=64, S=256, lengths=(200, 37), seed=0):
  """(q [B, T, N, H], k / v [B, S, K, H] bf16, MaskSpec fields) of T new tokens per row at the
  end of each row's fill `lengths`; the slots past a row's fill hold finite garbage (300), which
  a kernel must not let in."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
  lens = jnp.asarray(lengths, jnp.int32)
  slot = jnp.arange(S, dtype=jnp.int32)[None]
  inside = (slot < lens[:, None])[..., None, None]
  k = jnp.where(inside, k, 300.0).astype(jnp.bfloat16)
  v = jnp.where(inside, v, 300.0).astype(jnp.bfloat16)
  kvpos = jnp.broadcast_to(slot, (B, S))
  qpos = lens[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]
  return q, k, v, dict(q_positions_BT=qpos, kv_positions_BS=kvpos, kv_lengths_B=lens)
