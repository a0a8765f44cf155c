"""Analytic sizes of scheme 'segmented': cache bytes and the attention-visible KV length."""
from __future__ import annotations

import jax.numpy as jnp

from condattn_jax.attention.segmented import core
from condattn_jax.attention import options
from condattn_jax.attention.segmented.options import head_groups
from condattn_jax.models.config import ModelConfig


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Bytes of every layer's state at `context_len` tokens (what `inference.Engine` allocates
  with cache_len=context_len): 'segment' (S K/V, all heads), 'tail' (M, local heads), 'pool'
  (every finished segment, long heads of long layers), 'retrieved' (R) and 'queries' (Lq), plus
  'total'. Only the pool grows with the context."""
  o = options(config)
  g = head_groups(config, o)
  dt = jnp.dtype(dtype or config.dtype)
  out = dict(segment=0, tail=0, pool=0, retrieved=0, queries=0, other=0)
  key = dict(seg_k="segment", seg_v="segment", tail_k="tail", tail_v="tail", pool_k="pool",
             pool_v="pool", ret_k="retrieved", ret_v="retrieved", qlast="queries")
  for i in range(config.num_layers):
    shapes = core.state_shapes(config, o, g, i in o.long_layers, batch, context_len, dt)
    for n, (s, d) in shapes.items():
      size = 1
      for x in s:
        size *= x
      out[key.get(n, "other")] += size * jnp.dtype(d).itemsize
  out["total"] = sum(out.values())
  return {k: int(v) for k, v in out.items()}


def visible_kv_length(config: ModelConfig) -> float:
  """Peak attention-visible KV length per head, S + alpha*M + beta*(1 - alpha)*R (alpha: local
  head fraction, beta: long-layer fraction; docs/schemes/segmented.md#inference)."""
  o = options(config)
  alpha = 1.0 - len(o.long_heads) / config.num_kv_heads
  beta = len(o.long_layers) / config.num_layers
  return o.segment_len + alpha * o.tail_len + beta * (1 - alpha) * o.retrieve_len
