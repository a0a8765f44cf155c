"""Attention schemes: each registers a `Scheme`; the decoder, train.py and eval.py only use the
registry.

A scheme is one module (plus a config): it calls `register(Scheme(...))` at import. Built-in
schemes are the modules and packages of this package (found by walking it, no list to keep);
any other module can register one too, and `model.scheme = "some.module:name"` imports
`some.module` (which registers `name`) before looking `name` up, so a scheme living outside the library (a test file, a
research repo) trains through train.py unchanged.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable

import jax.numpy as jnp


def _no_aux_loss(aux, batch, step, config):
  del aux, batch, step, config
  return jnp.zeros((), jnp.float32), {}


def _identity(params, config):
  del config
  return params


def _all_same_variant(config):
  return (None,) * config.num_layers


def _no_flags(config):
  del config
  return {}


@dataclasses.dataclass(frozen=True)
class Scheme:
  """What makes a routing scheme.

  layer_cls     Flax module `layer_cls(config, variant=...)` with `__call__(x_BTD, ctx)` ->
                `(x_BTD, aux)` (ctx: `condattn_jax.models.context.LayerContext`). `aux` is a dict
                of arrays; the decoder stacks it over layers (leading axis L), so per-head
                values come out [L, N]. Every layer of a scheme returns the same aux structure.
                The layer owns its decode cache: it creates its variables in the 'cache'
                collection (e.g. `models.layers.KVCache`) and reads/writes them when ctx.decode.
  aux_loss      `(aux, batch, step, config) -> (scalar loss, metrics)` added to the CE; `batch`
                is the training batch dict (task ids, masks, ...), `config` the ModelConfig.
  from_dense    dense params -> scheme params, both in the model (stacked) layout.
  to_dense      scheme params -> (dense ModelConfig, dense params), or None.
  layer_variants `config -> tuple` of one hashable per layer: consecutive layers with equal
                variants are scanned together, a layer module gets its variant as an attribute
                (L2A: 'global' | 'pruned'; MATCH: 'swa' | 'full'). Use for structural
                differences (different params or caches); everything else is a flag.
  layer_flags   `config -> {name: array [L]}`: per-layer values scanned into
                `ctx.layer_flags[name]` (one compiled layer body for all of them).
  headline_metric name of the aux_loss metric to show on progress bars (e.g. 'l2a/sparsity').
  kv_cache_bytes `(config, context_len, batch) -> {'total', ...}` analytic cache bytes at a
                context length (reports); the inference engine also measures its real cache.
  reports       name -> callable producing the scheme's reports (pruning, plots, ...).
  input_module  None or a Flax module class `input_module(config)(tokens_BT, ctx) -> (extra
                tokens [B, A] or None, fields)`, run by the decoder once before the layers (its
                variables: 'cache' collection, under `scheme_inputs`): `fields` join ctx.fields;
                the extra tokens' embeddings ride after the T rows through every layer (the
                layers' x is [B, T + A, D]) and are dropped before the final norm (MATCH's
                retrieval and auxiliary input).
  model_params  `config -> {name: (shape, initializer)}`: parameters of the whole model, not of
                a layer (Elastic's per-task Lagrange multipliers). The decoder creates them
                (float32) as params['scheme'][name] and hands their values to aux_loss as
                aux['model_params'][name] (no layer axis). None / {}: none.
  forward       None, or `(model, params, tokens_BT, positions_BT, segment_ids_BT, *, train,
                rngs, return_hidden, task_ids_B, fields) -> (out, aux)` used by the train and
                eval steps instead of `model.apply` (a training forward that is not one decoder
                pass, e.g. segmented: a scan over segments of the cached decoder).
  """
  name: str
  layer_cls: type
  aux_loss: Callable[..., tuple[Any, dict]] = _no_aux_loss
  from_dense: Callable[[dict, Any], dict] = _identity
  to_dense: Callable[[dict, Any], tuple[Any, dict]] | None = None
  layer_variants: Callable[[Any], tuple] = _all_same_variant
  layer_flags: Callable[[Any], dict] = _no_flags
  headline_metric: str | None = None
  kv_cache_bytes: Callable[..., dict] | None = None
  reports: dict = dataclasses.field(default_factory=dict)
  input_module: type | None = None
  model_params: Callable[[Any], dict] | None = None
  forward: Callable[..., tuple[Any, Any]] | None = None


SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
  """Adds `scheme` to the registry (a later registration of the same name replaces it)."""
  if not isinstance(scheme, Scheme):
    raise TypeError(f"register() takes a Scheme, got {type(scheme).__name__}.")
  SCHEMES[scheme.name] = scheme
  return scheme


_LOADED = False


def _load_builtin():
  """Imports every module / package of this package once. An import error is raised as is:
  a broken scheme module must never make its scheme silently unknown."""
  global _LOADED
  if _LOADED:
    return
  for info in pkgutil.iter_modules(__path__):
    if not info.name.startswith("_"):
      importlib.import_module(f"{__name__}.{info.name}")
  _LOADED = True


def get_scheme(name: str) -> Scheme:
  """The registered scheme `name`; 'pkg.module:name' imports pkg.module first."""
  _load_builtin()
  if ":" in name:
    module, key = name.split(":", 1)
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name != module and not module.startswith(f"{e.name}."):
        raise
      raise ValueError(f"model.scheme={name!r}: module {module!r} cannot be imported ({e}); "
                       f"put it on PYTHONPATH or use a registered scheme: {sorted(SCHEMES)}.") from e
    if key in SCHEMES:
      return SCHEMES[key]
  if name not in SCHEMES:
    raise ValueError(f"model.scheme={name!r} is unknown; registered schemes: {sorted(SCHEMES)} "
                     f"(or 'some.module:name' for a scheme registered by another module).")
  return SCHEMES[name]
