"""Elastic conversions: dense <-> Elastic (docs/schemes/elastic.md#semantics).

A converted layer keeps every dense parameter and gains a fresh `router` (task MLP + router MLP,
kernels N(0, 0.02), zero biases, drawn from model.scheme.seed); the model gains
params['scheme']['lagrange'] [2, tasks] ~ U(0, lambda_init_max). With routing 'fa' (every head
FA) the converted model computes the base model exactly. Functions take and return the model's
(stacked) layout or per-layer trees; a top-level 'params' key is kept. Plain arrays only.
"""
from __future__ import annotations

import numpy as np

from condattn_jax import attention
from condattn_jax.attention import configure, options
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


def tiny():
  """Scheme.tiny: a 2-layer qwen3 Elastic toy (SSA blocks of 4, 4 sinks, 8 local, 3 boundary
  tokens) with a sharpened router (a real FA / SSA mix)."""
  import jax
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, num_heads=4, num_kv_heads=2)
  cfg = configure(base, "elastic", block=4, sinks=4, local=8, boundary=3, seed=5)

  def make(seed: int = 0):
    dense = jax.tree.map(np.asarray, attention.init_dense(base, seed + 3))
    _, p = attention.convert(dense, base, "elastic", **dict(cfg.scheme_kwargs))
    r = p["layers"]["router"]["router_fc3"]
    r["kernel"] = r["kernel"] * 300.0
    return p
  return cfg, make
