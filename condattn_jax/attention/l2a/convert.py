"""L2A conversions: dense <-> L2A, pruning (docs/schemes/l2a.md#inference).

All functions take and return params in the model's (stacked) layout, or per-layer trees
(`layers_{i}`); a top-level 'params' key is kept. The per-layer edits happen on the per-layer
view (`models.stacking`), and the result is restacked for the target config's layer variants.
Plain arrays only (numpy or jax): unbox flax metadata first (`convert.unbox`).
"""
from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax import attention
from condattn_jax.attention import configure, options
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig

# ----------------------------------------------------------------------------------------------
# Conversion: dense <-> L2A, pruning
# ----------------------------------------------------------------------------------------------
def _copy_tree(tree):
  return jax.tree.map(lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a, tree)


def _restack(per_layer: dict) -> dict:
  """Stacks a per-layer L2A/dense tree; layers without a global branch form their own groups."""
  L = stacking.num_layers_of(per_layer)
  return stacking.restack(per_layer, ["global" if "global_attn" in per_layer[f"layers_{i}"]
                                      else "pruned" for i in range(L)])


def from_dense(params, config):
  """Dense params -> L2A params (docs/schemes/l2a.md#semantics): per layer `global_attn` = copy of `self_attn`,
  `global_layernorm` = copy of `input_layernorm`, `router` = zeros [D] (every token global at
  init). Layers in `pruned_layers` get no global branch. `config` is the target
  L2A ModelConfig (or the options)."""
  opts = options(config)
  inner, rewrap = stacking.per_layer(params)
  out = dict(inner)
  for i in range(stacking.num_layers_of(inner)):
    name = f"layers_{i}"
    layer = dict(inner[name])
    if "global_attn" in layer:
      raise ValueError(f"from_dense: {name} already has a global_attn (params are not dense).")
    if "input_layernorm" not in layer:
      raise ValueError(f"from_dense: {name} has no input_layernorm: L2A needs a pre-norm family.")
    if i not in opts.pruned_layers:
      layer["global_attn"] = _copy_tree(layer["self_attn"])
      layer["global_layernorm"] = _copy_tree(layer["input_layernorm"])
      scale = layer["input_layernorm"]["scale"]
      if isinstance(scale, np.ndarray):
        router = np.zeros(scale.shape, scale.dtype)
      else:
        router = jnp.zeros(scale.shape, scale.dtype)
      layer["router"] = {"kernel": router}
    out[name] = layer
  return rewrap(_restack(out))


GLOBAL_BRANCH = ("global_attn", "global_layernorm", "router")


def prune_params(params, layers: Iterable[int]):
  """Drops the global branch (global_attn, global_layernorm, router) of these layers."""
  inner, rewrap = stacking.per_layer(params)
  out = dict(inner)
  for i in layers:
    layer = {k: v for k, v in inner[f"layers_{i}"].items() if k not in GLOBAL_BRANCH}
    out[f"layers_{i}"] = layer
  return rewrap(_restack(out))


def to_dense(params, config: ModelConfig):
  """L2A -> dense: keep the LOCAL branch (self_attn) and drop every global branch.

  Returns (dense config with sliding_window = w, params): exactly the function of the L2A model
  with every layer pruned (or routing='none'), i.e. the reverse of `from_dense` up to the
  global weights. For window 0 there is no dense equivalent (a layer that attends to nothing)."""
  opts = options(config)
  if opts.window == 0:
    raise ValueError("to_dense: window=0 has no dense (sliding-window) equivalent.")
  inner, rewrap = stacking.strip_params(params)
  dense_params = prune_params(inner, range(stacking.num_layers_of(inner)))  # one group: the dense layout
  return config.replace(scheme="dense", scheme_kwargs=(), sliding_window=opts.window), \
      rewrap(dense_params)


def prune(params, config: ModelConfig, layer_sparsity, threshold: float = 0.95):
  """Post-training pruning: layers with sparsity >= threshold lose their global branch.

  Returns (pruned config, pruned params, the newly pruned layer indices)."""
  opts = options(config)
  sp = np.asarray(layer_sparsity, np.float64)
  new = tuple(int(i) for i in np.nonzero(sp >= threshold)[0] if int(i) not in opts.pruned_layers)
  cfg = configure(config, "l2a", pruned_layers=tuple(sorted(set(opts.pruned_layers) | set(new))))
  return cfg, prune_params(params, new), new


def tiny():
  """Scheme.tiny: a 3-layer qwen3 L2A toy (window 4, layer 1 pruned) with a random router (a
  real mix of global / local tokens at theta 0.6)."""
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=3)
  cfg = configure(base, "l2a", window=4, theta=0.6, pruned_layers=(1,))

  def make(seed: int = 0):
    _, p = attention.convert(attention.init_dense(base, seed + 3), base, "l2a",
                             **dict(cfg.scheme_kwargs))
    per, rewrap = stacking.per_layer(p)
    for i in range(cfg.num_layers):
      if "router" in per[f"layers_{i}"]:
        k = per[f"layers_{i}"]["router"]["kernel"]
        per[f"layers_{i}"]["router"]["kernel"] = 0.1 * jax.random.normal(
            jax.random.PRNGKey(seed + i), k.shape, k.dtype)
    return rewrap(_restack(per))
  return cfg, make
