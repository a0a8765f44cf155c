"""MATCH's analytic decode-cache bytes."""
from __future__ import annotations

import jax.numpy as jnp

from condattn_jax.attention import options
from condattn_jax.attention.match.options import layer_kinds


def kv_cache_bytes(config, context_len: int, batch: int = 1, dtype: str | None = None):
  """Decode-cache bytes at `context_len` tokens: per SWA layer a ring of min(w, context) K/V
  slots + the retrieved-K/V cache (k*c slots and their int32 valid flags); per full layer
  context_len slots; plus the raw tokens (4 bytes each) the retrieved chunks are recomputed
  from and two int32 words per row (length, current block). MiniLM's cached chunk embeddings
  (retriever 'minilm') are not counted. The engine's KVCache bookkeeping (length / positions /
  valid words of each ring and full cache) is not counted either."""
  o = options(config)
  kinds = layer_kinds(config)
  per_tok = 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype or config.dtype).itemsize
  n_swa = sum(k == "swa" for k in kinds)
  window = n_swa * min(o.window, context_len) * per_tok * batch
  retrieved = (n_swa * o.kept_k * o.chunk * per_tok * batch) if o.top_k else 0
  full = (len(kinds) - n_swa) * context_len * per_tok * batch
  raw = 4 * context_len * batch
  other = (8 + (n_swa * o.kept_k * o.chunk * 4 if o.top_k else 0)) * batch
  return {"total": int(window + retrieved + full + raw + other), "window": int(window),
          "retrieved": int(retrieved), "full": int(full), "raw_tokens": int(raw),
          "other": int(other)}
