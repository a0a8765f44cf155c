"""MATCH conversions: dense <-> MATCH, the same parameters regrouped by layer variant (SWA /
full). Trees with or without a top-level 'params' key, per-layer or stacked."""
from __future__ import annotations

from condattn_jax.models import stacking


def from_dense(params, config):
  """Dense params -> MATCH params: every parameter kept (MATCH adds none), regrouped into the
  scanned groups of the SWA / full layer pattern of `config`."""
  return stacking.to_model_layout(params, config)


def to_dense(params, config):
  """MATCH -> (dense full-attention ModelConfig, its params): the base model."""
  dense = config.replace(scheme="dense", scheme_kwargs=())
  return dense, stacking.to_model_layout(params, dense)


def tiny():
  """Scheme.tiny: a 3-layer qwen3 MATCH toy over 16 tokens (window 6, chunks of 3, top-2
  exact-match retrieval, layers SWA, SWA, full)."""
  from condattn_jax import attention
  from condattn_jax.models.config import ModelConfig
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=3, vocab_size=16)
  cfg = attention.configure(base, "match", window=6, chunk=3, top_k=2, swa_ratio=0.7)
  return cfg, lambda seed=0: from_dense(attention.init_dense(base, seed), cfg)


def serving_forward(model, params, tokens_BT, positions_BT, segment_ids_BT, prefill_lengths_B,
                    *, prompt_lengths_B=None):
  """Scheme.serving_forward: decode recomputes the retrieved chunks (its window cache has no old
  K/V), so generation equals the full forward with retrieved_kv='recompute' in which only the
  blocks holding the last `prefill_last` prompt positions and the generated tokens retrieve
  (inputs.block_retrieves; the engine passes each row's prompt length to its prefill).
  prompt_lengths_B: each row's prompt length; None: prefill_lengths_B (the first engine call's
  tokens: the prompt for a one-shot prefill; with a chunked prefill and prefill_last shorter than
  the prompt, pass the prompt lengths)."""
  if prompt_lengths_B is None:
    prompt_lengths_B = prefill_lengths_B
  import jax.numpy as jnp
  from condattn_jax import attention
  from condattn_jax.models.decoder import Decoder
  rc = Decoder(attention.configure(model.config, "match", retrieved_kv="recompute"))
  return rc.apply({"params": params}, tokens_BT, positions_BT, segment_ids_BT,
                  fields={"prompt_len_B": jnp.asarray(prompt_lengths_B, jnp.int32)})
