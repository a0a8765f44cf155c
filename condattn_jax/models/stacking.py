"""The one place that converts between per-layer and stacked (scanned) parameter trees.

Per-layer layout (Hugging Face-like, used by checkpoint conversion and scheme conversions):
    {'embed_tokens': ..., 'layers_0': {...}, 'layers_1': {...}, ..., 'norm': ..., 'lm_head': ...}
Stacked layout (the Decoder's own: `nn.scan` over layers, leading layer axis on every leaf):
    one group   -> {'layers': {... [L, ...]}}
    several     -> {'layers_0_3': {... [3, ...]}, 'layers_3_4': {... [1, ...]}, ...}
A group is a run of consecutive layers with the same scheme variant (`Scheme.layer_variants`),
e.g. L2A's pruned layers have no global branch, so they form groups of their own.
Both functions take plain arrays (numpy or jax) in nested dicts; they leave non-layer entries
alone, and accept trees already in the wanted layout (idempotent).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_PER_LAYER = re.compile(r"layers_(\d+)$")
_GROUP = re.compile(r"layers_(\d+)_(\d+)$")


def layer_groups(variants: Sequence[Any]) -> list[tuple[int, int, Any]]:
  """[(start, stop, variant)] for the runs of equal consecutive variants."""
  groups: list[tuple[int, int, Any]] = []
  for i, v in enumerate(variants):
    if groups and groups[-1][2] == v:
      groups[-1] = (groups[-1][0], i + 1, v)
    else:
      groups.append((i, i + 1, v))
  return groups


def group_name(start: int, stop: int, num_groups: int) -> str:
  return "layers" if num_groups == 1 else f"layers_{start}_{stop}"


def is_per_layer(params: dict) -> bool:
  return any(_PER_LAYER.match(k) for k in params)


def _group_ranges(params: dict, num_layers: int | None) -> list[tuple[str, int, int]]:
  out = []
  for k, v in params.items():
    if k == "layers":
      n = jax.tree.leaves(v)[0].shape[0]
      out.append((k, 0, n))
    else:
      m = _GROUP.match(k)
      if m:
        out.append((k, int(m.group(1)), int(m.group(2))))
  out.sort(key=lambda r: r[1])
  if num_layers is not None and out and out[-1][2] != num_layers:
    raise ValueError(f"stacked params cover layers 0..{out[-1][2]} but the model has "
                     f"{num_layers} layers.")
  return out


def _stack(xs):
  if all(isinstance(x, np.ndarray) for x in xs):
    return np.stack(xs)
  return jnp.stack(xs)


def stack_layers(params: dict, variants: Sequence[Any]) -> dict:
  """Per-layer tree -> stacked tree grouped by `variants` (one per layer)."""
  if not is_per_layer(params):
    return unstack_then(params, variants)
  L = len(variants)
  have = sorted(int(_PER_LAYER.match(k).group(1)) for k in params if _PER_LAYER.match(k))
  if have != list(range(L)):
    raise ValueError(f"per-layer params hold layers {have[:4]}...{have[-4:]} but the model has "
                     f"{L} layers (model.num_layers).")
  out = {k: v for k, v in params.items() if not _PER_LAYER.match(k)}
  groups = layer_groups(variants)
  for start, stop, _ in groups:
    trees = [params[f"layers_{i}"] for i in range(start, stop)]
    s0 = jax.tree.structure(trees[0])
    for i, t in zip(range(start, stop), trees):
      if jax.tree.structure(t) != s0:
        raise ValueError(f"layers_{i} has other params than layers_{start} but both are in one "
                         f"scanned group (variant {variants[start]!r}); the scheme's "
                         f"layer_variants must separate them.")
    out[group_name(start, stop, len(groups))] = jax.tree.map(lambda *xs: _stack(xs), *trees)
  return out


def unstack_layers(params: dict, num_layers: int | None = None) -> dict:
  """Stacked tree -> per-layer tree ('layers_{i}'); a per-layer tree is returned as is."""
  if is_per_layer(params):
    return params
  ranges = _group_ranges(params, num_layers)
  out = {k: v for k, v in params.items() if k not in {r[0] for r in ranges}}
  for name, start, stop in ranges:
    for j, i in enumerate(range(start, stop)):
      out[f"layers_{i}"] = jax.tree.map(lambda x, j=j: x[j], params[name])
  return out


def split_groups(params: dict) -> dict:
  """A stacked tree with every scanned group (`layers`, `layers_{start}_{stop}`) replaced by a
  tuple of its layers' trees (leaves without the layer axis): the layout the Decoder's
  `unroll_layers` (decode) mode takes as is, so each layer's weights reach the compiled step as
  arguments of their own instead of slices of the stacked leaves. Other entries, and groups
  already split, are kept. (Allocates the layers' copies: call it once, outside
  the step, and drop the stacked tree to keep one copy of the weights.)"""
  out = dict(params)
  for name, start, stop in _group_ranges(
      {k: v for k, v in params.items() if not isinstance(v, (tuple, list))}, None):
    out[name] = tuple(jax.tree.map(lambda x, j=j: x[j], params[name])
                      for j in range(stop - start))
  return out


def has_stacked_groups(params: dict) -> bool:
  """Whether any scanned group of `params` is held stacked (what `split_groups` would split)."""
  return bool(_group_ranges({k: v for k, v in params.items()
                             if not isinstance(v, (tuple, list))}, None))


def join_groups(params: dict) -> dict:
  """`split_groups` undone: every group held as a tuple of per-layer trees stacked back into
  its leaves (a new copy); other entries kept."""
  return {k: (jax.tree.map(lambda *xs: _stack(xs), *v) if isinstance(v, (tuple, list)) else v)
          for k, v in params.items()}


def unstack_then(params: dict, variants: Sequence[Any]) -> dict:
  """A stacked tree regrouped for `variants` (e.g. after pruning changed the groups)."""
  return stack_layers(unstack_layers(params, len(variants)), variants)


def to_model_layout(params: dict, config) -> dict:
  """`params` (per-layer or stacked, possibly under a top-level 'params' key) in the stacked
  layout the Decoder of `config` expects."""
  from condattn_jax.attention import get_scheme
  if "params" in params and "embed_tokens" not in params:
    return {**params, "params": to_model_layout(params["params"], config)}
  variants = get_scheme(config.scheme).layer_variants(config)
  return stack_layers(unstack_layers(params, config.num_layers), variants)


def num_layers_of(params: dict) -> int:
  """Layer count of a per-layer or stacked tree."""
  if is_per_layer(params):
    return sum(1 for k in params if _PER_LAYER.match(k))
  ranges = _group_ranges(params, None)
  return ranges[-1][2] if ranges else 0


def strip_params(params: dict):
  """(inner params, rewrap) for a tree given with or without a top-level 'params' key:
  `rewrap(new_inner)` puts the result back the way it came."""
  if "params" in params and "embed_tokens" not in params:
    return params["params"], lambda p: {**params, "params": p}
  return params, lambda p: p


def per_layer(params: dict):
  """(per-layer inner tree 'layers_{i}', rewrap) for a stacked or per-layer tree, with or
  without a top-level 'params' key: the view scheme conversions edit layer by layer."""
  inner, rewrap = strip_params(params)
  return unstack_layers(inner), rewrap


def restack(per_layer_params: dict, variants: Sequence[Any] | None = None) -> dict:
  """A per-layer tree stacked into scanned groups by `variants` (one per layer; None: one
  group, the layout of schemes without layer variants)."""
  if variants is None:
    variants = (None,) * num_layers_of(per_layer_params)
  return stack_layers(per_layer_params, variants)
