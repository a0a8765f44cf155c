"""MATCH's analytic decode-cache bytes."""
from __future__ import annotations

import jax.numpy as jnp

from condattn_jax.attention import options
from condattn_jax.attention.match.options import layer_kinds


def kv_cache_bytes(config, context_len: int, batch: int = 1, dtype: str | None = None):
  """Decode-cache bytes at `context_len` tokens: per SWA layer a ring of min(w, context) K/V
  slots + the retrieved-K/V cache (k*c slots and their int32 valid flags; k = options.slots);
  per full layer context_len slots; plus the raw tokens (4 bytes each) the retrieved chunks are recomputed
  from, two int32 words per row (length, current block), the current block's retrieved chunk
  ids (slots int32 words per row) and, for an embedding retriever (MiniLM: E = 384), the
  cached chunk embeddings (context_len // chunk x E float32: 12 bytes a token at c = 128).
  Exactly what `MatchInputs` and the layers allocate for `Engine(cache_len=context_len)`,
  less the engine's KVCache bookkeeping (length / positions / valid words of each ring and
  full cache)."""
  o = options(config)
  kinds = layer_kinds(config)
  per_tok = 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype or config.dtype).itemsize
  n_swa = sum(k == "swa" for k in kinds)
  window = n_swa * min(o.window, context_len) * per_tok * batch
  retrieved = (n_swa * o.slots * o.chunk * per_tok * batch) if o.top_k else 0
  full = (len(kinds) - n_swa) * context_len * per_tok * batch
  raw = 4 * context_len * batch
  J = context_len // o.chunk
  searched = o.top_k and J
  other = (8 + (n_swa * o.slots * o.chunk * 4 if o.top_k else 0)
           + (4 * o.slots if searched else 0)) * batch
  emb = J * embedding_dim(o) * 4 * batch if searched else 0
  return {"total": int(window + retrieved + full + raw + other + emb), "window": int(window),
          "retrieved": int(retrieved), "full": int(full), "raw_tokens": int(raw),
          "chunk_embeddings": int(emb), "other": int(other)}


def embedding_dim(o) -> int:
  """E of an embedding retriever (0 for a token retriever: nothing cached per chunk)."""
  if not o.top_k or o.retriever == "exact":
    return 0
  from condattn_jax.attention.match import retrieval
  r = retrieval.MiniLMRetriever if o.retriever == "minilm" else retrieval.make_retriever(o)
  return int(r.dim) if r.kind == "embedding" else 0
