"""The base model's decoder layer: dense (optionally sliding-window) attention + MLP."""
from __future__ import annotations

import flax.linen as nn

from condattn_jax.attention import Scheme, register
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.layers import Attention, make_norm, mlp_residual


class DenseLayer(nn.Module):
  """pre-norm : x + Attn(input_layernorm(x)), then the MLP half.
  post-norm (olmo2): x + post_attention_layernorm(Attn(x)), then the MLP half."""
  config: ModelConfig
  layer_idx: int = 0

  @nn.compact
  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, train=False, decode=False,
               cache_len=None):
    cfg = self.config
    attn = Attention(cfg, window=cfg.sliding_window, name="self_attn")
    kw = dict(decode=decode, cache_len=cache_len)
    if cfg.post_norm:
      x_BTD = x_BTD + make_norm(cfg, "post_attention_layernorm")(
          attn(x_BTD, positions_BT, segment_ids_BT, **kw))
    else:
      x_BTD = x_BTD + attn(make_norm(cfg, "input_layernorm")(x_BTD), positions_BT, segment_ids_BT, **kw)
    return mlp_residual(cfg, x_BTD), {}


DENSE = register(Scheme(name="dense", layer_cls=DenseLayer))
