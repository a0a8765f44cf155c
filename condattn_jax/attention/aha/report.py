"""AHA measurements: KV-cache bytes (SCHEMES.md section 2)."""
from __future__ import annotations

from condattn_jax.models.config import ModelConfig


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Decode KV-cache bytes of an AHA model at `context_len` tokens (K and V only): ONE full cache
  of context_len slots per layer, shared by both paths (routed-local heads read only its last w
  slots). Returns {'total', 'full', 'window'} (window = 0: there is no separate ring)."""
  from condattn_jax.attention import dense
  full = dense.kv_cache_bytes(config.replace(scheme="dense", scheme_kwargs=(),
                                             sliding_window=None),
                              context_len, batch, dtype)["total"]
  return {"total": int(full), "full": int(full), "window": 0}
