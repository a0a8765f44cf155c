"""The base model's decoder layer: dense (optionally sliding-window) attention + MLP."""
from __future__ import annotations

import flax.linen as nn

from condattn_jax.attention import Scheme, register
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, make_norm, mlp_residual


class DenseLayer(nn.Module):
  """pre-norm : x + Attn(input_layernorm(x)), then the MLP half.
  post-norm (olmo2): x + post_attention_layernorm(Attn(x)), then the MLP half."""
  config: ModelConfig
  variant: object = None

  @nn.compact
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    attn = Attention(cfg, window=cfg.sliding_window, name="self_attn")
    if cfg.post_norm:
      x_BTD = x_BTD + make_norm(cfg, "post_attention_layernorm")(attn(x_BTD, ctx))
    else:
      x_BTD = x_BTD + attn(make_norm(cfg, "input_layernorm")(x_BTD), ctx)
    return mlp_residual(cfg, x_BTD), {}


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """K and V bytes of the decode cache at `context_len` tokens: a full cache per layer, or a
  ring of min(w, context_len) slots per layer for a sliding-window model."""
  import jax.numpy as jnp
  per_token = 2 * config.num_kv_heads * config.head_dim * jnp.dtype(
      dtype or config.dtype).itemsize * batch
  if config.sliding_window is not None:
    window = config.num_layers * min(config.sliding_window, context_len) * per_token
    return {"total": int(window), "full": 0, "window": int(window)}
  full = config.num_layers * context_len * per_token
  return {"total": int(full), "full": int(full), "window": 0}


def tiny():
  """A 3-layer qwen3 toy (Scheme.tiny)."""
  from condattn_jax.attention import init_dense
  cfg = ModelConfig(family="qwen3", qk_norm="head", num_layers=3)
  return cfg, lambda seed=0: init_dense(cfg, seed + 3)


DENSE = register(Scheme(name="dense", layer_cls=DenseLayer, kv_cache_bytes=kv_cache_bytes,
                        sequence_parallel=True, tiny=tiny))
