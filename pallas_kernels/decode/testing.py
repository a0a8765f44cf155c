"""Test problems of the decode kernels (CPU interpret tests and tests/gpu share them)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def decode_problem(B=2, T=1, N=6, K=2, H=64, S=256, lengths=(200, 37), seed=0):
  """(q [B, T, N, H], k / v [B, S, K, H] bf16, MaskSpec fields) of T new tokens per row at the
  end of each row's fill `lengths`; the slots past a row's fill hold finite garbage (300), which
  a kernel must not let in. Standard normal draws on the host (numpy, a stream per seed): no
  program is compiled to make a problem."""
  rng = np.random.default_rng([seed, 2])
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  lens = np.asarray(lengths, np.int32)
  slot = np.arange(S, dtype=np.int32)[None]
  inside = (slot < lens[:, None])[..., None, None]
  q = draw(B, T, N, H)
  k = np.where(inside, draw(B, S, K, H), np.float32(300.0))
  v = np.where(inside, draw(B, S, K, H), np.float32(300.0))
  kvpos = np.broadcast_to(slot, (B, S))
  qpos = lens[:, None] - T + np.arange(T, dtype=np.int32)[None]
  bf16 = lambda x: jnp.asarray(x.astype(jnp.bfloat16))
  return bf16(q), bf16(k), bf16(v), dict(q_positions_BT=jnp.asarray(qpos),
                                         kv_positions_BS=jnp.asarray(kvpos),
                                         kv_lengths_B=jnp.asarray(lens))
