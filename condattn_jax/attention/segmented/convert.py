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
