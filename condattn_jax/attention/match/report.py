"""MATCH conversions (dense <-> MATCH: the same parameters, regrouped by layer variant) and the
analytic decode-cache bytes."""
from __future__ import annotations

import jax.numpy as jnp

from condattn_jax.attention.match.options import layer_kinds, match_options
from condattn_jax.models import stacking


def _strip(params):
  if "params" in params and "embed_tokens" not in params:
    return params["params"], lambda p: {**params, "params": p}
  return params, lambda p: p


def from_dense(params, config):
  """Dense params -> MATCH params: every parameter kept (MATCH adds none), regrouped into the
  scanned groups of the SWA / full layer pattern."""
  inner, rewrap = _strip(params)
  return rewrap(stacking.stack_layers(stacking.unstack_layers(inner, config.num_layers),
                                      layer_kinds(config)))


def to_dense(params, config):
  """MATCH -> (dense full-attention ModelConfig, its params): the base model."""
  inner, rewrap = _strip(params)
  dense = config.replace(scheme="dense", scheme_kwargs=())
  return dense, rewrap(stacking.stack_layers(stacking.unstack_layers(inner, config.num_layers),
                                             (None,) * config.num_layers))


def kv_cache_bytes(config, context_len: int, batch: int = 1, dtype: str | None = None):
  """Decode-cache bytes at `context_len` tokens: per SWA layer a ring of min(w, context) K/V
  slots + the retrieved-K/V cache (k*c slots); per full layer context_len slots; plus the raw
  tokens (4 bytes each) the retrieved chunks are recomputed from."""
  o = match_options(config)
  kinds = layer_kinds(config)
  per_tok = 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype or config.dtype).itemsize
  n_swa = sum(k == "swa" for k in kinds)
  window = n_swa * min(o.window, context_len) * per_tok * batch
  retrieved = (n_swa * o.kept_k * o.chunk * per_tok * batch) if o.top_k else 0
  full = (len(kinds) - n_swa) * context_len * per_tok * batch
  raw = 4 * context_len * batch if o.top_k else 0
  return {"total": int(window + retrieved + full + raw), "window": int(window),
          "retrieved": int(retrieved), "full": int(full), "raw_tokens": int(raw)}
