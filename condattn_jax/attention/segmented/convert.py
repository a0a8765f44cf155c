"""Dense <-> segmented conversions: the identity on weights (the layers keep the dense names);
only the scanned grouping changes (long / local layer variants). Trees with or without a
top-level 'params' key, per-layer or stacked."""
from __future__ import annotations

from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig


def from_dense(params, config: ModelConfig):
  """Dense params -> segmented params (same arrays, grouped by `config`'s layer variants)."""
  return stacking.to_model_layout(params, config)


def to_dense(params, config: ModelConfig):
  """Segmented -> (dense ModelConfig, dense params): the exact inverse of `from_dense`."""
  dense = config.replace(scheme="dense", scheme_kwargs=())
  return dense, stacking.to_model_layout(params, dense)


def tiny():
  """Scheme.tiny: a 2-layer qwen3 toy, segments of 8, tail 4, long head 1 in layer 1."""
  from condattn_jax import attention
  base = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm="head",
                     rope_theta=100.0)
  cfg = attention.configure(
      base, "segmented", segment_len=8, tail_len=4, retrieve_len=8, long_heads=(1,),
      long_layers=(1,), query_len=8, summary_window=4, summary_stride=2, summary_tail=2, topk=3,
      anchors=2, expand=(-1, 2))
  return cfg, lambda seed=0: from_dense(attention.init_dense(base, seed), cfg)
