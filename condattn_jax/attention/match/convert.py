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
