"""The decoder layer of scheme 'segmented' (docs/schemes/segmented.md#semantics).

Same parameters as the dense layer (from_dense is the identity on weights); the attention core
is `core.segment_step` on the pre-RoPE q/k/v of `Attention.project`:
  ctx.decode  : the chunk's tokens through the segment operator with the layer's state held in
                the 'cache' collection (variables named as in `core.state_shapes`). This is the
                path of inference (`inference.Engine`, prefill in chunks dividing segment_len,
                decode one token per row) AND of training (`forward.forward` runs the decoder
                one segment at a time in this mode, carrying the cache through a lax.scan).
  otherwise   : `core.full_sequence` (a scan of the same operator over the row's segments, this
                layer only): the same values, for analysis / evaluation through Decoder.apply.
Rows are single documents at positions 0..T-1 (right padding = segment id 0); packed rows
(several documents per row) are not supported: the scheme declares packed_documents=False and
train/config.py refuses a file-source packing other than data.packing='one_per_row'.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from condattn_jax.attention.segmented import core
from condattn_jax.attention import options
from condattn_jax.attention.segmented.options import head_groups
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, make_norm, mlp_residual


# ctx.fields entry [B] (bool) the training forward sets on the streams that restart empty
# (options.tbptt_boundary == 'empty_restart'; forward.py); absent everywhere else.
RESTART_FIELD = "segmented_restart"


class SegmentedLayer(nn.Module):
  """pre-norm : x + Attn_seg(input_layernorm(x)), then the MLP half (post-norm olmo2 as dense).
  variant: 'long' (holds a retrieval pool) | 'local'. aux: {} (no per-layer metrics)."""
  config: ModelConfig
  variant: object = "local"

  @staticmethod
  def decode_chunk(config: ModelConfig) -> int:
    """inference.Engine's declaration: a decode call's chunk must divide segment_len (the engine
    picks its default prefill chunk from it)."""
    return options(config).segment_len

  @nn.compact
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    o = options(cfg)
    groups = head_groups(cfg, o)
    long_layer = self.variant == "long"
    attn = Attention(cfg, window=None, name="self_attn")
    x_in = x_BTD if cfg.post_norm else make_norm(cfg, "input_layernorm")(x_BTD)
    q, k, v = attn.project(x_in)
    kw = dict(config=cfg, o=o, groups=groups, long_layer=long_layer)
    if ctx.decode:
      if ctx.cache_len is None:
        raise ValueError("decode=True needs cache_len (the longest sequence to decode).")
      B, T = x_BTD.shape[:2]
      if o.segment_len % T:
        raise ValueError(f"a decode chunk of {T} tokens must divide segment_len={o.segment_len} "
                         "(set Engine(prefill_chunk=...) to a divisor of segment_len).")
      shapes = core.state_shapes(cfg, o, groups, long_layer, B, ctx.cache_len, k.dtype)
      var = {n: self.variable("cache", n, jnp.zeros, s, d)
             for n, (s, d) in shapes.items()}
      out, state = core.segment_step({n: v_.value for n, v_ in var.items()}, q, k, v,
                                     ctx.positions_BT, ctx.valid_BT,
                                     restart_B=ctx.fields.get(RESTART_FIELD), **kw)
      for n, v_ in var.items():
        v_.value = state[n]
    else:
      out = core.full_sequence(q, k, v, ctx.valid_BT, **kw)
    out_BTD = attn.project_out(out)
    if cfg.post_norm:
      x_BTD = x_BTD + make_norm(cfg, "post_attention_layernorm")(out_BTD)
    else:
      x_BTD = x_BTD + out_BTD
    return mlp_residual(cfg, x_BTD), {}
