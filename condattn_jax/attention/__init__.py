"""Attention schemes. Each registers a `Scheme`; the decoder and train.py only use the registry."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp


def _no_aux_loss(aux, step, config):
  del aux, step, config
  return jnp.zeros((), jnp.float32), {}


def _identity_convert(params, config):
  del config
  return params


@dataclasses.dataclass(frozen=True)
class Scheme:
  """What makes a routing scheme.

  layer_cls : Flax module `(config, layer_idx)` whose `__call__(x_BTD, positions_BT, segment_ids_BT,
              train, decode, cache_len)` returns `(x_BTD, aux)`; `aux` is a dict of arrays that the
              decoder stacks over layers (leading axis L).
  aux_loss  : `(aux, step, config) -> (loss scalar, metrics dict)` added to cross-entropy.
  from_dense: dense params -> scheme params (weight copies, router init).
  """
  name: str
  layer_cls: type
  aux_loss: Callable[[dict, Any, Any], tuple[Any, dict]] = _no_aux_loss
  from_dense: Callable[[dict, Any], dict] = _identity_convert


SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
  SCHEMES[scheme.name] = scheme
  return scheme


def get_scheme(name: str) -> Scheme:
  _load_builtin()
  if name not in SCHEMES:
    raise ValueError(f"model.scheme={name!r} is unknown; registered schemes: {sorted(SCHEMES)}.")
  return SCHEMES[name]


def _load_builtin():
  import importlib
  for mod in ("dense", "l2a"):
    try:
      importlib.import_module(f"condattn_jax.attention.{mod}")
    except ModuleNotFoundError as e:  # a scheme module not written yet
      if e.name != f"condattn_jax.attention.{mod}":
        raise
