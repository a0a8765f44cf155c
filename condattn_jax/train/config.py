"""The run config schema (ml_collections), its validation, and config -> ModelConfig (+ weights).

A recipe (`configs/<name>.py`) starts from `default_config()` and sets fields; train.py / eval.py
lock it, so `--config.x.y=z` can only set fields that exist. `validate_config` also rejects
unknown fields that a recipe added by mistake. Sections:

  model  ModelConfig fields (None = from `init_from`'s config.json, else the ModelConfig default)
         + init_from: Hugging Face checkpoint dir (or None: random init)
         + scheme: ConfigDict(name='dense', **hyper-params of that scheme) -> ModelConfig(scheme=name,
           scheme_kwargs=sorted tuple of the rest)
  data   condattn_jax.data's section (source, seq_len, batch_size = GLOBAL rows, task, ...)
  train  num_steps, lr, warmup_frac | warmup_steps, lr_schedule, end_lr_frac, grad_clip,
         weight_decay, b1, b2, eps, trainable_regex, param_groups, seed, log_every,
         checkpoint_every, keep_checkpoints, eval_every, dry_run, dry_run_device, loss_chunk_size,
         microbatches, progress_bar
  mesh   data, fsdp, sequence, tensor (-1 = fill with the remaining devices),
         sequence_attention (condattn_jax/parallel/context.py)
  eval   context_lengths, num_batches, batch_size, seed, at_start, at_end
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from ml_collections import config_dict

from condattn_jax.models.config import ModelConfig

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                     if f.name not in ("scheme", "scheme_kwargs"))
_MODEL_TYPES = {f.name: f.type for f in dataclasses.fields(ModelConfig)}


def _placeholder_for(name: str):
  default = getattr(ModelConfig, name, None)
  if name == "rope_scaling":
    return None  # a dict; recipes set it, the command line cannot
  if isinstance(default, bool):
    return config_dict.placeholder(bool)
  if isinstance(default, int):
    return config_dict.placeholder(int)
  if isinstance(default, float):
    return config_dict.placeholder(float)
  return config_dict.placeholder(str)


def default_config() -> ml_collections.ConfigDict:
  """Every section with every field at its default."""
  from condattn_jax.data import default_data_config
  c = ml_collections.ConfigDict()
  m = ml_collections.ConfigDict({name: _placeholder_for(name) for name in MODEL_FIELDS})
  m.init_from = config_dict.placeholder(str)
  m.scheme = ml_collections.ConfigDict(dict(name="dense"))
  c.model = m
  c.data = default_data_config()
  c.train = ml_collections.ConfigDict(dict(
      num_steps=1000,
      lr=3e-4,
      warmup_frac=0.05,
      warmup_steps=config_dict.placeholder(int),  # overrides warmup_frac when set
      lr_schedule="cosine",  # cosine | linear | constant | rsqrt
      end_lr_frac=0.0,  # final lr = end_lr_frac * lr
      grad_clip=1.0,  # global norm over trainable grads; 0 = off
      weight_decay=0.01,  # on params with ndim >= 2
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      trainable_regex=config_dict.placeholder(str),  # re.fullmatch on 'a/b/kernel'; None = all
      param_groups=ml_collections.ConfigDict(),  # name -> {regex, lr, weight_decay, b1, b2, maximize}
      seed=0,  # params init and the step RNG fold_in(key(seed), step)
      log_every=10,
      checkpoint_every=500,  # 0 = only at the end / on SIGTERM
      keep_checkpoints=3,
      eval_every=0,  # 0 = no periodic eval
      dry_run=False,  # build + AOT-compile the sharded step, print sizes and memory, exit
      dry_run_device="",  # '' (this host) | v5p | h100 | h200: the verdict's accelerator
      loss_chunk_size=0,  # > 0: chunked CE over hidden states (no [B,T,V] logits)
      microbatches=1,  # gradient accumulation over this many microbatches
      progress_bar=True,
  ))
  c.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=-1, tensor=1,
      sequence=1,  # context parallelism: a row's tokens over this many devices (zigzag layout)
      sequence_attention="all_gather",  # all_gather | ring: global attention over `sequence`
  ))
  c.eval = ml_collections.ConfigDict(dict(
      context_lengths=(),  # () = data.seq_len only
      num_batches=4,
      batch_size=config_dict.placeholder(int),  # None = data.batch_size
      seed=1234,  # eval data draw and the router RNG at eval
      at_start=False,  # train.run evaluates the step-0 params (e.g. a converted checkpoint)
      at_end=True,  # train.run evaluates the final params
  ))
  return c


# --dry_run_device: name -> (what the dry run calls it, memory per device in bytes, platform).
# The nominal sizes are binary GB, as the devices report them (an H100 80GB shows 81559 MiB, the
# TPU compiler gives a v5p 95.73 GiB).
DRY_RUN_DEVICES = {
    "v5p": ("TPU v5p (95 GiB)", 95 * 2**30, "tpu"),
    "h100": ("NVIDIA H100 (80 GiB)", 80 * 2**30, "cuda"),
    "h200": ("NVIDIA H200 (141 GiB)", 141 * 2**30, "cuda"),
}


# Sections whose fields are not fixed here: the scheme's hyper-params, named param groups, and
# the data section (validated by condattn_jax.data.parse_data_config).
_FREE_FORM = {("model", "scheme"), ("train", "param_groups"), ("data",)}


def _check_fields(cfg, ref, path: tuple[str, ...] = ()):
  where = ".".join(("config",) + path)
  for k in cfg.keys():
    p = path + (k,)
    if p in _FREE_FORM:
      continue
    if k not in ref:
      raise ValueError(f"unknown config field '{where}.{k}'; valid fields of {where}: "
                       f"{sorted(ref.keys())}.")
    if isinstance(ref[k], ml_collections.ConfigDict):
      if not isinstance(cfg[k], ml_collections.ConfigDict):
        raise ValueError(f"config field '{where}.{k}' must be a section (ConfigDict).")
      _check_fields(cfg[k], ref[k], p)


def missing_required(config, *, needs_data: bool = True) -> list[str]:
  """The '--config.<field>=<what>' of every field a recipe marked REQUIRED (`required`) and the
  user has not set, in the order a run needs them: model (built first), then data."""
  from condattn_jax.data import REQUIRED_PREFIX, is_required_marker, missing_required as data_missing
  out = [config.model[f][len(REQUIRED_PREFIX):] for f in config.model.keys()
         if is_required_marker(config.model[f])]
  if needs_data:
    out += [config.data[f.split(".", 1)[1]][len(REQUIRED_PREFIX):]
            for f in data_missing(config.data)]
  return out


def validate_config(config: ml_collections.ConfigDict, *, needs_data: bool = True) -> None:
  """Raises ValueError naming the field for unknown fields, required fields not set, values out
  of range and inconsistent sections (eval lengths vs loss chunks / synthetic tasks, batch vs
  microbatches). needs_data=False (dry run): data files / tokenizer are not needed."""
  ref = default_config()
  _check_fields(config, ref)
  missing = missing_required(config, needs_data=needs_data)
  if missing:
    raise ValueError("required config field(s) not set: " + ", ".join(missing)
                     + " (the recipe's docstring says what they are).")
  from condattn_jax.data import parse_data_config
  dc = parse_data_config(config.data, needs_files=needs_data)
  t = config.train
  for f in ("num_steps", "log_every", "keep_checkpoints", "microbatches"):
    if int(t[f]) < 1:
      raise ValueError(f"config.train.{f}={t[f]} must be >= 1.")
  for f in ("checkpoint_every", "eval_every", "loss_chunk_size"):
    if int(t[f]) < 0:
      raise ValueError(f"config.train.{f}={t[f]} must be >= 0.")
  if str(t.get("dry_run_device") or "") not in ("", *DRY_RUN_DEVICES):
    raise ValueError(f"config.train.dry_run_device={t.dry_run_device!r}: choose one of "
                     f"{list(DRY_RUN_DEVICES)} (or '' for this host's devices).")
  if "name" not in config.model.scheme:
    raise ValueError("config.model.scheme.name is required (e.g. 'dense').")
  from condattn_jax.attention import get_scheme
  scheme = get_scheme(config.model.scheme.name)
  from condattn_jax.data.config import FILE_SOURCES
  # A scheme that runs a row as one document (packed_documents=False: Elastic decides once per
  # row, segmented runs a row as one sequence) needs one document per row, task ids or not.
  if (not scheme.packed_documents and dc.source in FILE_SOURCES
      and dc.packing != "one_per_row"):
    raise ValueError(f"config.data.packing={dc.packing!r} packs several documents in a row, but "
                     f"scheme {scheme.name!r} runs a row as one document "
                     "(packed_documents=False); set config.data.packing='one_per_row'.")
  if (not scheme.packed_documents and dc.source == "suite"
      and int(dict(dc.task or {}).get("pack", 1) or 1) > 1):
    raise ValueError(f"config.data.task.pack={dict(dc.task)['pack']} packs several samples in "
                     f"a row, but scheme {scheme.name!r} runs a row as one document "
                     "(packed_documents=False); set config.data.task.pack=1.")
  from condattn_jax.parallel import context
  context.check_config(config, int(config.mesh.get("sequence", 1)))
  seq_len = int(config.data.seq_len)
  if t.loss_chunk_size and seq_len % int(t.loss_chunk_size):
    raise ValueError(f"config.train.loss_chunk_size={t.loss_chunk_size} must divide "
                     f"config.data.seq_len={seq_len}.")
  if int(config.data.batch_size) % int(t.microbatches):
    raise ValueError(f"config.train.microbatches={t.microbatches} must divide "
                     f"config.data.batch_size={config.data.batch_size}.")
  _validate_eval(config, dc)


def _validate_eval(config, dc) -> None:
  """The eval section against the model / data / loss settings, so a run does not fail only
  after training (eval at the end)."""
  e = config.eval
  if int(e.num_batches) < 1:
    raise ValueError(f"config.eval.num_batches={e.num_batches} must be >= 1.")
  if e.get("batch_size") is not None and int(e.batch_size) < 1:
    raise ValueError(f"config.eval.batch_size={e.batch_size} must be >= 1 (or None: "
                     "data.batch_size).")
  lengths = [int(L) for L in (e.context_lengths or ())] or [int(config.data.seq_len)]
  chunk = int(config.train.loss_chunk_size)
  for L in lengths:
    if L < 2:
      raise ValueError(f"config.eval.context_lengths has {L}: every length must be >= 2.")
    if chunk and L % chunk:
      raise ValueError(f"config.eval.context_lengths has {L}, not divisible by "
                       f"config.train.loss_chunk_size={chunk}: use multiples of {chunk} (or "
                       "change loss_chunk_size).")
  if dc.is_synthetic:
    from condattn_jax.data import make_task
    make_task(dc.source, dc.task, int(config.data.seq_len))  # errors name data.task.<field>
    for L in lengths:
      try:
        make_task(dc.source, dc.task, L)
      except ValueError as err:
        raise ValueError(f"config.eval.context_lengths has {L}, too short for the "
                         f"{dc.source} task: {err}") from None


def _hashable(v):
  if isinstance(v, (list, tuple)):
    return tuple(_hashable(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
  return v


def scheme_fields(config) -> tuple[str, tuple[tuple[str, Any], ...]]:
  s = config.model.scheme.to_dict()
  name = s.pop("name")
  return name, tuple(sorted((k, _hashable(v)) for k, v in s.items()))


def _overrides(config) -> dict[str, Any]:
  m = config.model
  out = {}
  for f in MODEL_FIELDS:
    v = m.get(f)
    if v is None:
      continue
    if f == "rope_scaling":
      v = _hashable(v.to_dict() if hasattr(v, "to_dict") else dict(v))
    out[f] = v
  name, kwargs = scheme_fields(config)
  out.update(scheme=name, scheme_kwargs=kwargs)
  return out


def model_config(config, *, load_weights: bool = False):
  """(ModelConfig, params or None) from `config.model`.

  With `model.init_from`, the architecture comes from that checkpoint's config.json and the
  non-None `config.model` fields override it (dtype, remat, rope_theta, ...); with
  `load_weights=True` the dense weights are read (numpy, param_dtype if set) and NOT yet
  converted to the scheme (the caller applies `scheme.from_dense`).
  """
  over = _overrides(config)
  path = config.model.get("init_from")
  if not path:
    return ModelConfig(**over), None
  from condattn_jax import export as export_lib
  if export_lib.is_export(path) and not load_weights:
    # a directory written by export.py: the architecture (either layout) from its sidecar; the
    # weights are read by train.loop.load_initial_params
    saved = export_lib.config_from_json(export_lib.read_sidecar(path)["model_config"])
    fam = over.get("family")
    if fam is not None and fam != saved.family:
      raise ValueError(f"config.model.family={fam!r}, but the export in model.init_from={path!r} "
                       f"is a {saved.family!r} model; drop model.family or fix it.")
    base = {f.name: getattr(saved, f.name) for f in dataclasses.fields(ModelConfig)
            if f.name not in ("scheme", "scheme_kwargs")}
    return ModelConfig(**{**base, **over}), None
  hf = read_hf_config(path)
  fam = over.get("family")
  if fam is not None and hf.get("model_type") != fam:
    raise ValueError(f"config.model.family={fam!r}, but the checkpoint in model.init_from={path!r} "
                     f"is a {hf.get('model_type')!r} model (config.json model_type); drop "
                     "model.family or fix it.")
  from condattn_jax import convert
  if load_weights:
    return convert.load_hf_checkpoint(path, dtype=over.get("param_dtype"), **over)
  if "param_dtype" not in over and hf.get("torch_dtype") in ("float32", "bfloat16", "float16"):
    over["param_dtype"] = hf["torch_dtype"]
  return ModelConfig.from_hf_config(hf, **over), None


# The config.json keys ModelConfig.from_hf_config reads without a default.
HF_REQUIRED_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads")


def read_hf_config(path: str) -> dict[str, Any]:
  """`model.init_from`'s config.json (convert.read_hf_config) with one-line errors that name the
  file: a syntax error by line / column, missing keys by name."""
  import json
  import os
  from condattn_jax import convert
  cfg_path = os.path.join(path, convert.CONFIG_FILE)
  try:
    hf = convert.read_hf_config(path)
  except json.JSONDecodeError as e:
    raise ValueError(f"model.init_from: {cfg_path} is not valid JSON: {e.msg} at line {e.lineno} "
                     f"column {e.colno}; fix the file or download it again.") from None
  if not isinstance(hf, dict):
    raise ValueError(f"model.init_from: {cfg_path} must hold a JSON object.")
  missing = [k for k in HF_REQUIRED_KEYS if k not in hf]
  if missing:
    raise ValueError(f"model.init_from: {cfg_path} lacks the key(s) {', '.join(missing)} (a Hugging "
                     "Face config.json of the model family needs them); download it again or "
                     "copy the full config.json.")
  return hf


def split_variant(arg: str | None, variants, default: str) -> tuple[str, str]:
  """A recipe arg 'qwen3-8b,steps=100' -> ('qwen3-8b', 'steps=100'): a bare word naming one of
  `variants` (case-insensitive) picks the variant (else `default`); the rest goes to parse_arg."""
  variant, rest = default, []
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    if "=" not in part and part.lower() in variants:
      variant = part.lower()
    else:
      rest.append(part)
  _RECIPE_VARIANTS[:] = sorted(variants)
  return variant, ",".join(rest)


# The variants of the recipe whose get_config is running (set by split_variant, named by
# parse_arg's error for a bare word that is neither a variant nor an arg: 'tinny').
_RECIPE_VARIANTS: list[str] = []


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style `get_config(arg)` parsing: 'steps=200,seq=128,runlocal' -> fields typed like
  their defaults (a bare word sets a bool default to True). Unknown keys are errors."""
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    _RECIPE_VARIANTS[:] = []
    return out
  for part in arg.split(","):
    part = part.strip()
    if not part:
      continue
    key, eq, val = part.partition("=")
    key = key.strip()
    if key not in defaults:
      variants, _RECIPE_VARIANTS[:] = list(_RECIPE_VARIANTS), []
      if variants and not eq:
        import difflib
        close = difflib.get_close_matches(key.lower(), variants, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"config arg {key!r} is not a variant of this recipe: {hint}variants: "
                         f"{variants} (args take a value: {sorted(defaults)}).")
      raise ValueError(f"config arg {key!r} is unknown; valid: {sorted(defaults)}.")
    d = defaults[key]
    if not eq:
      if not isinstance(d, bool):
        raise ValueError(f"config arg {key!r} needs a value ({key}=...).")
      out[key] = True
    elif isinstance(d, bool):
      out[key] = val.strip().lower() in ("1", "true", "yes", "on")
    elif isinstance(d, int):
      out[key] = int(val)
    elif isinstance(d, float):
      out[key] = float(val)
    else:
      with out.ignore_type():
        out[key] = val.strip()
  _RECIPE_VARIANTS[:] = []
  return out
