"""Elastic conversions: dense <-> Elastic (SCHEMES.md section 3).

A converted layer keeps every dense parameter and gains a fresh `router` (task MLP + router MLP,
kernels N(0, 0.02), zero biases, drawn from model.scheme.seed); the model gains
params['scheme']['lagrange'] [2, tasks] ~ U(0, lambda_init_max). With routing 'fa' (every head
FA) the converted model computes the base model exactly. Functions take and return the model's
(stacked) layout or per-layer trees; a top-level 'params' key is kept. Plain arrays only.
"""
from __future__ import annotations

import numpy as np

from condattn_jax.attention import options
from condattn_jax.attention.elastic.layer import router_shapes
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig


def from_dense(params, config):
  """Dense params -> Elastic params (router per layer, lagrange at the top); `config` is the
  target Elastic ModelConfig."""
  o = options(config)
  inner, rewrap = stacking.per_layer(params)
  if "scheme" in inner:
    raise ValueError("from_dense: params already have a 'scheme' entry (not dense params).")
  rng = np.random.default_rng(o.seed)
  out = dict(inner)
  for i in range(stacking.num_layers_of(inner)):
    name = f"layers_{i}"
    layer = dict(inner[name])
    if "router" in layer:
      raise ValueError(f"from_dense: {name} already has a router (params are not dense).")
    k = layer.get("self_attn", {}).get("k_proj", {}).get("kernel")
    if k is None:
      raise ValueError(f"from_dense: {name} has no self_attn/k_proj: not a dense decoder layer.")
    if k.shape[1:] != (config.num_kv_heads, config.head_dim):
      raise ValueError(f"from_dense: {name}/self_attn/k_proj is {k.shape}, model.num_kv_heads="
                       f"{config.num_kv_heads}, head_dim={config.head_dim}.")
    dtype = np.dtype(config.param_dtype)
    layer["router"] = {n: {"kernel": (0.02 * rng.standard_normal(ks)).astype(dtype),
                           "bias": np.zeros(bs, dtype)}
                       for n, (ks, bs) in router_shapes(config).items()}
    out[name] = layer
  out["scheme"] = {"lagrange": rng.uniform(0.0, o.lambda_init_max, (2, o.num_tasks))
                   .astype(np.float32)}
  return rewrap(stacking.restack(out))


def to_dense(params, config: ModelConfig):
  """Elastic -> (dense ModelConfig, dense params): routers and lagrange dropped (every head FA:
  the exact inverse of `from_dense`)."""
  inner, rewrap = stacking.per_layer(params)
  out = {k: v for k, v in inner.items() if k != "scheme"}
  for i in range(stacking.num_layers_of(inner)):
    out[f"layers_{i}"] = {k: v for k, v in inner[f"layers_{i}"].items() if k != "router"}
  return config.replace(scheme="dense", scheme_kwargs=()), rewrap(stacking.restack(out))
