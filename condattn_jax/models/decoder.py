"""One Flax Linen decoder for the llama | qwen2 | qwen3 | olmo2 families.

embed -> num_layers x scheme layer (attention scheme + MLP) -> final RMSNorm -> logits.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from condattn_jax.attention import get_scheme
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.layers import INIT_STD, make_norm

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Decoder(nn.Module):
  """Causal LM.

  __call__(tokens_BT, positions_BT=None, segment_ids_BT=None, *, train, decode, cache_len,
           return_hidden) -> (logits_BTV float32 | hidden_BTD, aux)
  `aux` holds the scheme's per-layer outputs stacked on a leading layer axis.
  Decoding: pass decode=True, cache_len and mutable=["cache"]; the first call (prefill) creates
  the caches, later calls continue from them.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, train: bool = False,
               decode: bool = False, cache_len: int | None = None, return_hidden: bool = False):
    cfg = self.config
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embed = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                                    ("vocab", "embed")),
        name="embed_tokens")
    x_BTD = embed(tokens_BT)
    x_BTD = nn.with_logical_constraint(x_BTD, ("activation_batch", "activation_length", "activation_embed"))

    layer_cls = get_scheme(cfg.scheme).layer_cls
    if cfg.remat_policy != "none":
      layer_cls = nn.remat(layer_cls, policy=REMAT_POLICIES[cfg.remat_policy],
                           static_argnums=(4, 5, 6), prevent_cse=True)
    per_layer = []
    for i in range(cfg.num_layers):
      x_BTD, aux = layer_cls(cfg, layer_idx=i, name=f"layers_{i}")(
          x_BTD, positions_BT, segment_ids_BT, train, decode, cache_len)
      x_BTD = nn.with_logical_constraint(x_BTD, ("activation_batch", "activation_length", "activation_embed"))
      per_layer.append(aux)
    x_BTD = make_norm(cfg, "norm")(x_BTD)
    aux = {k: jnp.stack([a[k] for a in per_layer]) for k in per_layer[0]} if per_layer[0] else {}
    if return_hidden:
      return x_BTD, aux
    if cfg.tie_word_embeddings:
      logits = embed.attend(x_BTD)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                        param_dtype=cfg.weight_dtype,
                        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                                                 ("embed", "vocab")),
                        name="lm_head")(x_BTD)
    return logits.astype(jnp.float32), aux

  def output_embedding(self, params):
    """[D, V] matrix mapping final hidden states to logits (for chunked / fused losses)."""
    if self.config.tie_word_embeddings:
      return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]
