"""Attention schemes: each registers a `Scheme`; the decoder, train.py and eval.py only use the
registry.

A scheme is one module (plus a config): it calls `register(Scheme(...))` at import. Built-in
schemes are the modules and packages of this package (found by walking it, no list to keep);
any other module can register one too, and `model.scheme = "some.module:name"` imports
`some.module` (which registers `name`) before looking `name` up, so a scheme living outside the library (a test file, a
research repo) trains through train.py unchanged.

Options: a scheme declares a frozen dataclass (`Scheme.options`); `ModelConfig.scheme_kwargs`
holds (name, value) pairs of it, set by a run as `--config.model.scheme.<name>=...`. The one
parser is the registry's:
  options(config)                     the scheme's options of a ModelConfig (or a run config),
                                      parsed, type-coerced and checked once (cached)
  configure(base, scheme, **options)  `base` turned into `scheme` with these options (validated)
  convert(params, dense_config, scheme, **options)
                                      dense params -> (scheme config, scheme params): the one
                                      dense -> scheme entry point
Errors name the field as the command line spells it (`model.scheme.<name>`).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import functools
import numbers
from typing import Any, Callable, Protocol

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


class Forward(Protocol):
  """`Scheme.forward`: the training / eval forward when it is not one decoder pass."""

  def __call__(self, model, params, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
               train: bool = False, rngs=None, return_hidden: bool = False, task_ids_B=None,
               fields=None) -> tuple[Any, dict]:
    ...


class ServingForward(Protocol):
  """`Scheme.serving_forward`: the full forward that Engine generation equals."""

  def __call__(self, model, params, tokens_BT, positions_BT, segment_ids_BT,
               prefill_lengths_B) -> tuple[Any, dict]:
    ...


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """The options of a scheme that has none (dense)."""


@dataclasses.dataclass(frozen=True)
class Scheme:
  """What makes a routing scheme.

  layer_cls     Flax module `layer_cls(config, variant=...)` with `__call__(x_BTD, ctx)` ->
                `(x_BTD, aux)` (ctx: `condattn_jax.models.context.LayerContext`). `aux` is a dict
                of arrays; the decoder stacks it over layers (leading axis L), so per-head
                values come out [L, N]. Every layer of a scheme returns the same aux structure.
                The layer owns its decode cache: it creates its variables in the 'cache'
                collection (e.g. `models.layers.KVCache`) and reads/writes them when ctx.decode.
  options       a frozen dataclass of the scheme's options (`model.scheme.<field>`): defaults
                are the paper's, `__post_init__` checks the values alone. The registry parses
                `scheme_kwargs` into it (unknown names refused against the valid ones; values
                coerced to the default's type: list -> tuple, dict -> sorted (name, value)
                pairs, integral float -> int, int -> float).
  check         None or `(config, options) -> None`: checks that need the whole ModelConfig
                (L2A refuses post-norm families, the full-attention conversions refuse a
                `sliding_window`); raises ValueError naming the field.
  aux_loss      `(aux, batch, step, config) -> (scalar loss, metrics)` added to the CE; `batch`
                is the training batch dict (task ids, masks, ...), `config` the ModelConfig.
  from_dense    dense params -> scheme params, both in the model (stacked) layout, for a
                configured scheme ModelConfig (`convert` is the entry point that also configures).
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
  reports       name -> report, every report with ONE signature:
                `(model, params, batches, *, out_dir=None, name=<its file stem>, **knobs)
                -> dict`: model a Decoder with the scheme's config, params its params,
                batches an iterable of held-out batch dicts (`inputs` [+ `positions`,
                `segment_ids`, `task_ids`, fields]), knobs the report's test-time options
                (L2A theta, AHA tau, ...). Returns a JSON-ready dict (L2A's prune: plus the
                pruned config / params); with out_dir it also writes <out_dir>/<name>.json
                (and its plot / table) and returns their paths under 'json' (and 'png').
  module        None, or the scheme-level Flax module class: `module(config, name='scheme')`
                runs once per forward before the layers, `(tokens_BT, ctx) -> (extra tokens
                [B, A] or None, fields, aux)`. It owns params['scheme'] (parameters of the whole
                model, not of a layer: Elastic's per-task Lagrange multipliers) and
                cache['scheme'] (its decode state: MATCH's raw tokens and retrieval block);
                `fields` join ctx.fields for every layer; the extra tokens' embeddings ride
                after the T rows through every layer (the layers' x is [B, T + A, D]) and are
                dropped before the final norm (MATCH's auxiliary input); `aux` (no layer axis)
                reaches aux_loss as aux['scheme'].
  ascent_params regexes (re.fullmatch on '/'-joined param paths, e.g. 'scheme/lagrange') of the
                params the train step updates by gradient ASCENT (Lagrange multipliers): it
                flips their gradient before the optimizer, so no recipe can forget it (a
                `train.param_groups` group with maximize=True over them is refused).
  forward       None, or `(model, params, tokens_BT, positions_BT, segment_ids_BT, *, train,
                rngs, return_hidden, task_ids_B, fields) -> (out, aux)` used by the train and
                eval steps instead of `model.apply` (a training forward that is not one decoder
                pass, e.g. segmented: a scan over segments of the cached decoder).
  serving_forward None, or `(model, params, tokens_BT, positions_BT, segment_ids_BT,
                prefill_lengths_B) -> (logits_BTV, aux)`: the full forward that generation
                through `inference.Engine` equals (ragged rows, right padding = segment 0;
                prefill_lengths_B: the tokens of each row's first engine call, the whole prompt
                or its first prefill chunk). None: the training forward (`forward`, else
                `model.apply`). A scheme whose serving semantics differ from its training mask
                declares it (MATCH: retrieved chunks recomputed; Elastic: the decision pooled
                over the first call).
  packed_documents True: documents packed in one row (segment ids 1, 2, ...) are independent
                (each gets the outputs it gets alone); False: rows must hold one document (Elastic
                pools its routing decision over the row, segmented's segments run over it).
  sequence_parallel True: the scheme trains with a row's tokens split over the `sequence` mesh
                axis (condattn_jax/parallel/context.py: all its cross-token work goes through
                ops.attention's contiguous self-attention; tests/train/test_context_parallel.py
                checks loss and gradients against one device); a str: why it cannot (config
                validation refuses config.mesh.sequence > 1 with it); False: not declared (refused).
  loss_weights  None, or `(batch, config) -> weights_BT float32 | None`: per-token weights of the
                CE in the train step's objective, `sum(mask * w * CE) / sum(mask)` (computed on
                the whole batch before microbatching; None: 1). Segmented's
                `loss_normalisation='segment_mean'` (the authors' per-segment CE mean).
  tiny          None, or `() -> (config, make_params(seed) -> params)`: a small model of the
                scheme (fp32, a few layers, routing really mixed) that tests/schemes' conformance
                suite runs every check on; registering it is all a new scheme needs for them.
  """
  name: str
  layer_cls: type
  options: type = NoOptions
  check: Callable[[Any, Any], None] | None = None
  aux_loss: Callable[..., tuple[Any, dict]] = _no_aux_loss
  from_dense: Callable[[dict, Any], dict] = _identity
  to_dense: Callable[[dict, Any], tuple[Any, dict]] | None = None
  layer_variants: Callable[[Any], tuple] = _all_same_variant
  layer_flags: Callable[[Any], dict] = _no_flags
  headline_metric: str | None = None
  kv_cache_bytes: Callable[..., dict] | None = None
  reports: dict = dataclasses.field(default_factory=dict)
  module: type | None = None
  ascent_params: tuple[str, ...] = ()
  forward: Forward | None = None
  serving_forward: ServingForward | None = None
  packed_documents: bool = True
  loss_weights: Callable[[dict, Any], Any] | None = None
  sequence_parallel: bool | str = False
  tiny: Callable[[], tuple[Any, Callable[[int], Any]]] | None = None

  def __post_init__(self):
    if not (dataclasses.is_dataclass(self.options) and isinstance(self.options, type)):
      raise TypeError(f"Scheme {self.name!r}: options must be a dataclass type, got "
                      f"{self.options!r}.")

  @property
  def option_names(self) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(self.options))

  def parse_options(self, kwargs) -> Any:
    """`kwargs` (a dict or (name, value) pairs) -> this scheme's options dataclass: unknown
    names refused against the valid ones, values coerced to their field's type, then the
    dataclass's own checks. (The whole-config `check` runs in `options(config)`.)"""
    kw = dict(kwargs)
    fields = {f.name: f for f in dataclasses.fields(self.options)}
    unknown = sorted(set(kw) - set(fields))
    if unknown:
      valid = sorted(fields) or "none"
      raise ValueError(f"model.scheme has unknown option(s) {unknown} for scheme {self.name!r}; "
                       f"valid: {valid}.")
    return self.options(**{k: _coerce(k, _default(fields[k]), v) for k, v in kw.items()})


def _default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return None


def _as_tuple(v):
  if isinstance(v, dict):
    return tuple(sorted((k, _as_tuple(x)) for k, x in v.items()))
  if isinstance(v, (list, tuple, range)):
    return tuple(_as_tuple(x) for x in v)
  if isinstance(v, numbers.Integral) and not isinstance(v, bool):
    return int(v)
  return v


def _coerce(name: str, default, v):
  """`v` in the type of the field's default (the command line hands tuples as lists, ints as
  floats...); a value that cannot be is one error naming the field."""
  flag = f"model.scheme.{name}={v!r}"
  if isinstance(default, bool):
    if isinstance(v, bool):
      return v
    raise ValueError(f"{flag} must be True or False.")
  if isinstance(default, numbers.Integral):
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
      return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v).is_integer():
      return int(v)
    raise ValueError(f"{flag} must be an int.")
  if isinstance(default, numbers.Real):
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
      return float(v)
    raise ValueError(f"{flag} must be a number.")
  if isinstance(default, str):
    if isinstance(v, str):
      return v
    raise ValueError(f"{flag} must be a string.")
  if isinstance(default, tuple):
    if isinstance(v, dict):
      return _as_tuple(v)
    if not isinstance(v, str) and hasattr(v, "__iter__"):
      return _as_tuple(list(v))
    raise ValueError(f"{flag} must be a tuple.")
  return v


def refuse_sliding_window(config, options) -> None:
  """`Scheme.check` of the schemes that convert a full-attention model (their window, if any,
  is their own option)."""
  del options
  if config.sliding_window is not None:
    raise ValueError(f"model.sliding_window={config.sliding_window}: scheme {config.scheme!r} "
                     "converts a full-attention model; set model.sliding_window=None.")


def write_report_json(rep: dict, out_dir: str | None, name: str) -> dict:
  """A report's files step (`Scheme.reports`): with out_dir, writes `rep` (JSON-ready) to
  <out_dir>/<name>.json and returns it with that path under 'json'; else returns `rep`."""
  if out_dir is None:
    return rep
  import json
  import os
  os.makedirs(out_dir, exist_ok=True)
  rep = {**rep, "json": os.path.join(out_dir, f"{name}.json")}
  with open(rep["json"], "w") as f:
    json.dump(rep, f, indent=1)
  return rep


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


@functools.lru_cache(maxsize=512)
def _options_cached(config):
  return _options_uncached(config)


def _options_uncached(config):
  scheme = get_scheme(config.scheme)
  o = scheme.parse_options(config.scheme_kwargs)
  if scheme.check is not None:
    scheme.check(config, o)
  return o


def options(config) -> Any:
  """The options dataclass of `config`'s scheme: `config` is a ModelConfig (its scheme and
  scheme_kwargs, checked against the whole config), a run config (its `model.scheme` section),
  or already an options dataclass (returned as is)."""
  if hasattr(config, "scheme_kwargs"):
    try:
      return _options_cached(config)
    except TypeError:  # unhashable values: parse without the cache
      return _options_uncached(config)
  if hasattr(config, "model") and hasattr(config.model, "scheme"):
    from condattn_jax.train.config import scheme_fields
    name, kw = scheme_fields(config)
    return get_scheme(name).parse_options(kw)
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    return config
  raise TypeError(f"options() takes a ModelConfig, a run config or an options dataclass, got "
                  f"{type(config).__name__}.")


def configure(base, scheme: str, **opts):
  """`base` (a ModelConfig of any scheme) turned into `scheme` with these options: the base's
  own options are kept when it already is that scheme. Values are stored normalised (tuples,
  ints) and checked with the whole config."""
  s = get_scheme(scheme)
  kw = dict(base.scheme_kwargs) if get_scheme(base.scheme) is s else {}
  kw.update(opts)
  parsed = s.parse_options(kw)
  cfg = base.replace(scheme=scheme, scheme_kwargs=tuple(sorted((k, getattr(parsed, k))
                                                               for k in kw)))
  options(cfg)
  return cfg


def convert(params, dense_config, scheme: str, **opts):
  """Dense params of `dense_config` -> (the `scheme` ModelConfig with these options, its
  params): the one dense -> scheme entry point (`configure`, then the scheme's `from_dense`)."""
  if dense_config.scheme != "dense":
    raise ValueError(f"convert() takes a dense model, got model.scheme={dense_config.scheme!r} "
                     "(convert it to dense first: get_scheme(...).to_dense).")
  cfg = configure(dense_config, scheme, **opts)
  return cfg, get_scheme(scheme).from_dense(params, cfg)


def init_dense(config, seed: int = 0):
  """Random params of `config`'s dense base model (jitted init, unboxed): the start of the
  schemes' `tiny` params makers."""
  import flax.linen as nn
  import jax
  from condattn_jax.models.decoder import Decoder
  base = config.replace(scheme="dense", scheme_kwargs=())
  tok = jnp.zeros((1, 8), jnp.int32)
  return nn.unbox(jax.jit(Decoder(base).init)(jax.random.PRNGKey(seed), tok)["params"])
