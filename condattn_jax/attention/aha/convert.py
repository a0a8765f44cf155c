"""AHA conversions: dense <-> AHA (docs/schemes/aha.md#semantics).

A converted layer keeps every dense parameter (one attention serves both paths) and gains
`router` = {kernel [D, N] zeros, bias [N] = router_bias_init}. Functions take and return the
model's (stacked) layout or per-layer trees (`layers_{i}`); a top-level 'params' key is kept.
Plain arrays only (numpy or jax): unbox flax metadata first (`convert.unbox`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from condattn_jax import attention
from condattn_jax.attention import configure, options
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig


def from_dense(params, config):
  """Dense params -> AHA params: per layer `router` = {kernel: zeros [D, N], bias: [N] filled
  with router_bias_init}; every other parameter is kept as is (both paths use them). With the
  default bias (+2: sigmoid 0.88 > tau 0.5) the converted model computes the base model.
  `config` is the target AHA ModelConfig (it gives N and the options)."""
  opts = options(config)
  inner, rewrap = stacking.per_layer(params)
  out = dict(inner)
  for i in range(stacking.num_layers_of(inner)):
    name = f"layers_{i}"
    layer = dict(inner[name])
    if "router" in layer:
      raise ValueError(f"from_dense: {name} already has a router (params are not dense).")
    attn = layer.get("self_attn", {})
    if "q_proj" not in attn:
      raise ValueError(f"from_dense: {name} has no self_attn/q_proj: not a dense decoder layer.")
    q = attn["q_proj"]["kernel"]  # [D, N, H]
    D, N = q.shape[0], q.shape[1]
    if N != config.num_heads:
      raise ValueError(f"from_dense: {name}/self_attn/q_proj has {N} heads, model.num_heads="
                       f"{config.num_heads}.")
    xp = np if isinstance(q, np.ndarray) else jnp
    layer["router"] = {"kernel": xp.zeros((D, N), q.dtype)}
    if opts.router_bias:
      layer["router"]["bias"] = xp.full((N,), opts.router_bias_init, q.dtype)
    out[name] = layer
  return rewrap(stacking.restack(out))


def to_dense(params, config: ModelConfig, *, keep: str = "full"):
  """AHA -> (dense ModelConfig, dense params): the router is dropped.

  keep='full'  : full attention for every head (the base model; exact inverse of `from_dense`;
                 = the AHA model with routing 'all').
  keep='local' : sliding-window attention (window w) for every head (= routing 'none')."""
  if keep not in ("full", "local"):
    raise ValueError(f"to_dense(keep={keep!r}): choose 'full' or 'local'.")
  opts = options(config)
  inner, rewrap = stacking.per_layer(params)
  out = dict(inner)
  for i in range(stacking.num_layers_of(inner)):
    out[f"layers_{i}"] = {k: v for k, v in inner[f"layers_{i}"].items() if k != "router"}
  window = None if keep == "full" else opts.window
  return (config.replace(scheme="dense", scheme_kwargs=(), sliding_window=window),
          rewrap(stacking.restack(out)))


def tiny():
  """Scheme.tiny: a 3-layer OLMo-2 (post-norm) AHA toy, window 4, with a random router (a real
  mix of full / local heads)."""
  import jax
  base = ModelConfig(family="olmo2", qk_norm="full", post_norm=True, num_layers=3)
  cfg = configure(base, "aha", window=4)

  def make(seed: int = 0):
    _, p = attention.convert(attention.init_dense(base, seed + 3), base, "aha", window=4)
    r = p["layers"]["router"]
    r["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(seed), r["kernel"].shape)
    r["bias"] = jnp.zeros_like(r["bias"])
    return p
  return cfg, make
