"""MATCH conversions: dense <-> MATCH, the same parameters regrouped by layer variant."""
from __future__ import annotations

from condattn_jax.attention.match.options import layer_kinds
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
