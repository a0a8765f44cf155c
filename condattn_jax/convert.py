"""Hugging Face safetensors checkpoints <-> condattn_jax parameter trees.

  config, params = load_hf_checkpoint("path/to/Qwen3-0.6B")          # dtype kept from the files
  logits, _ = Decoder(config).apply({"params": params}, tokens_BT)
  export_hf_checkpoint(params, config, "out/", max_shard_bytes=5 << 30)  # loads in transformers

Parameter tree (DEVELOPERS.md "Parameter tree"), per HF tensor:
  model.embed_tokens.weight [V,D]              -> embed_tokens/embedding [V,D]
  model.layers.i.self_attn.q_proj.weight [N*H,D] -> layers_i/self_attn/q_proj/kernel [D,N,H]
  model.layers.i.self_attn.{k,v}_proj.weight [K*H,D] -> .../{k,v}_proj/kernel [D,K,H]
  model.layers.i.self_attn.{q,k,v}_proj.bias    -> .../bias [N,H] / [K,H]           (qwen2)
  model.layers.i.self_attn.o_proj.weight [D,N*H] -> .../o_proj/kernel [N,H,D]
  model.layers.i.self_attn.{q,k}_norm.weight    -> .../{q,k}_norm/scale  [H] qwen3, [N*H]/[K*H] olmo2
  model.layers.i.{input,post_attention,post_feedforward}_layernorm.weight -> .../scale
  model.layers.i.mlp.{gate,up}_proj.weight [F,D] -> layers_i/mlp/{gate,up}_proj/kernel [D,F]
  model.layers.i.mlp.down_proj.weight [D,F]     -> layers_i/mlp/down_proj/kernel [F,D]
  model.norm.weight                             -> norm/scale
  lm_head.weight [V,D]                          -> lm_head/kernel [D,V]             (untied only)

Loaded params are plain host arrays (numpy, bfloat16 via ml_dtypes) in nested dicts: they go
straight into `Decoder.apply` (Linen unboxes `nn.Partitioned` metadata only when it is there);
`box_like` re-attaches the logical-axis metadata of an abstract init when a caller wants it
(e.g. to derive shardings), `unbox` strips it.

Dense -> scheme conversion is `condattn_jax.attention.convert` (the schemes own their weights).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: must precede safetensors numpy loading)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from condattn_jax.models import stacking
from condattn_jax.models.config import FAMILIES, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Tensors some published checkpoints carry that are buffers, not weights: skipped silently.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
  """A checkpoint on disk does not match what its config.json (or the params) say."""


# --------------------------------------------------------------------------------------------
# The name / layout map
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One HF tensor and where it lives in the param tree.

  kind: 'copy'   same array;  'linear' HF [out,in] <-> [in,out];
        'heads_in'  HF [N*H, D] <-> [D, N, H];  'heads_out' HF [D, N*H] <-> [N, H, D];
        'bias'   HF [N*H] <-> [N, H].
  """
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]
  kind: str

  def to_tree(self, w: np.ndarray) -> np.ndarray:
    if self.kind == "copy":
      return w
    if self.kind == "linear":
      return np.ascontiguousarray(w.T)
    if self.kind in ("heads_in", "heads_out"):
      return np.ascontiguousarray(w.T).reshape(self.shape)
    if self.kind == "bias":
      return w.reshape(self.shape)
    raise AssertionError(self.kind)

  def to_hf(self, p: np.ndarray) -> np.ndarray:
    if self.kind == "copy":
      return np.ascontiguousarray(p)
    if self.kind == "linear":
      return np.ascontiguousarray(p.T)
    if self.kind == "heads_in":
      return np.ascontiguousarray(p.reshape(self.shape[0], -1).T)
    if self.kind == "heads_out":
      return np.ascontiguousarray(p.reshape(-1, self.shape[-1]).T)
    if self.kind == "bias":
      return np.ascontiguousarray(p.reshape(-1))
    raise AssertionError(self.kind)


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
  """Every tensor of a dense checkpoint of this architecture, in HF order."""
  c = config
  V, D, F = c.vocab_size, c.hidden_size, c.intermediate_size
  N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
  specs = [TensorSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), (V, D), (V, D), "copy")]
  for i in range(c.num_layers):
    hf, tp = f"model.layers.{i}.", (f"layers_{i}",)
    a, at = hf + "self_attn.", tp + ("self_attn",)
    for proj, heads in (("q_proj", N), ("k_proj", K), ("v_proj", K)):
      specs.append(TensorSpec(a + proj + ".weight", at + (proj, "kernel"), (heads * H, D), (D, heads, H),
                              "heads_in"))
      if c.attention_bias:
        specs.append(TensorSpec(a + proj + ".bias", at + (proj, "bias"), (heads * H,), (heads, H), "bias"))
    specs.append(TensorSpec(a + "o_proj.weight", at + ("o_proj", "kernel"), (D, N * H), (N, H, D),
                            "heads_out"))
    if c.qk_norm != "none":
      for norm, heads in (("q_norm", N), ("k_norm", K)):
        width = H if c.qk_norm == "head" else heads * H
        specs.append(TensorSpec(a + norm + ".weight", at + (norm, "scale"), (width,), (width,), "copy"))
    norms = (["post_attention_layernorm", "post_feedforward_layernorm"] if c.post_norm
             else ["input_layernorm", "post_attention_layernorm"])
    for norm in norms:
      specs.append(TensorSpec(hf + norm + ".weight", tp + (norm, "scale"), (D,), (D,), "copy"))
    for proj, (fi, fo) in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D))):
      specs.append(TensorSpec(hf + "mlp." + proj + ".weight", tp + ("mlp", proj, "kernel"), (fo, fi),
                              (fi, fo), "linear"))
  specs.append(TensorSpec("model.norm.weight", ("norm", "scale"), (D,), (D,), "copy"))
  if not c.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (V, D), (D, V), "linear"))
  return specs


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------
def normalize_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
  """Brings a config.json dict to the `rope_theta` + `rope_scaling` layout.

  transformers >= 5 writes `rope_parameters` ({rope_type, rope_theta, factor, ...}) instead of
  the `rope_theta` / `rope_scaling` pair most published checkpoints carry.
  """
  hf = dict(hf)
  rp = hf.pop("rope_parameters", None)
  if rp is not None:
    rp = dict(rp)
    if "rope_theta" in rp:
      hf["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", rp.get("type", "default")) != "default":
      hf["rope_scaling"] = rp
    else:
      hf.setdefault("rope_scaling", None)
  return hf


def read_hf_config(path: str) -> dict[str, Any]:
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist (expected a Hugging Face "
                            f"model directory with {CONFIG_FILE} and {SINGLE_FILE} or {INDEX_FILE}).")
  cfg_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"No {CONFIG_FILE} in checkpoint directory {path!r}: a Hugging Face "
                            f"checkpoint needs {CONFIG_FILE} next to its safetensors files "
                            f"(found: {sorted(os.listdir(path))}).")
  with open(cfg_path) as f:
    hf = json.load(f)
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise CheckpointError(f"{cfg_path}: model_type={model_type!r} is not supported; supported families: "
                          f"{', '.join(FAMILIES)}.")
  return normalize_hf_config(hf)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _weight_files(path: str) -> dict[str, str]:
  """Maps every tensor name to the file holding it (single file or sharded with an index)."""
  index_path = os.path.join(path, INDEX_FILE)
  single_path = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_path} has no 'weight_map' (tensor name -> shard file).")
    missing_files = sorted({fn for fn in weight_map.values() if not os.path.isfile(os.path.join(path, fn))})
    if missing_files:
      raise FileNotFoundError(f"{index_path} names shard files that are not in {path!r}: {missing_files}.")
    out = {}
    for fn in sorted(set(weight_map.values())):
      fp = os.path.join(path, fn)
      with safe_open(fp, framework="np") as f:
        names = set(f.keys())
      listed = {k for k, v in weight_map.items() if v == fn}
      absent = sorted(listed - names)
      if absent:
        raise CheckpointError(f"{index_path} places {_fmt(absent)} in {fp}, but that file does not hold them.")
      for k in names:
        out.setdefault(k, fp)
    return out
  if os.path.isfile(single_path):
    with safe_open(single_path, framework="np") as f:
      return {k: single_path for k in f.keys()}
  found = sorted(os.listdir(path))
  hint = ""
  if any(fn.endswith(".bin") or fn.endswith(".pt") or fn.endswith(".pth") for fn in found):
    hint = (" Only safetensors checkpoints are read; re-save the model with "
            "`save_pretrained(dir, safe_serialization=True)`.")
  elif glob.glob(os.path.join(path, "model-*.safetensors")):
    hint = f" Shard files are present but {INDEX_FILE} is missing."
  raise FileNotFoundError(f"No safetensors weights in {path!r}: expected {SINGLE_FILE}, or {INDEX_FILE} "
                          f"with model-XXXXX-of-YYYYY.safetensors shards (found: {found}).{hint}")


def _fmt(names, limit=8) -> str:
  names = sorted(names)
  s = ", ".join(names[:limit])
  return s + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
  for k in path:
    tree = tree[k]
  return tree


def load_hf_checkpoint(path: str, *, dtype=None, **config_overrides) -> tuple[ModelConfig, dict]:
  """Reads a Hugging Face llama | qwen2 | qwen3 | olmo2 checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json +
      shards).
    dtype: cast every weight to this dtype (e.g. jnp.float32, "bfloat16"); None keeps the dtype
      stored in the files.
    **config_overrides: ModelConfig fields to set on top of config.json (dtype, scheme, ...).

  Returns:
    (config, params): `config.param_dtype` is the dtype of the returned weights; params is a
    nested dict of numpy arrays in the layout of `Decoder`: the per-layer names of the module
    docstring, stacked over layers under `layers` (`models.stacking`).
  Raises:
    FileNotFoundError naming the path and the expected files; CheckpointError naming missing,
    unexpected or mis-shaped tensors and the file they were read from.
  """
  hf = read_hf_config(path)
  if dtype is not None:
    dtype = np.dtype(dtype)
    if dtype.name not in _DTYPES:
      raise ValueError(f"load_hf_checkpoint(dtype={dtype.name!r}): choose one of {sorted(_DTYPES)} or None.")
  files = _weight_files(path)
  probe = ModelConfig.from_hf_config(hf, **config_overrides)
  specs = tensor_specs(probe)
  expected = {s.hf_name for s in specs}
  where = os.path.join(path, INDEX_FILE if os.path.isfile(os.path.join(path, INDEX_FILE)) else SINGLE_FILE)
  missing = expected - files.keys()
  if missing:
    raise CheckpointError(f"{where} is missing {len(missing)} tensor(s) that config.json "
                          f"(model_type={probe.family}, num_hidden_layers={probe.num_layers}, "
                          f"tie_word_embeddings={probe.tie_word_embeddings}) requires: {_fmt(missing)}.")
  unexpected = {k for k in files.keys() - expected if not k.endswith(_IGNORED_SUFFIXES)}
  if probe.tie_word_embeddings:
    unexpected.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
  if unexpected:
    raise CheckpointError(f"{where} holds {len(unexpected)} tensor(s) that a {probe.family} model with this "
                          f"config.json does not have: {_fmt(unexpected)}.")

  params: dict = {}
  handles: dict[str, Any] = {}
  weight_dtype = None
  try:
    for s in specs:
      fp = files[s.hf_name]
      if fp not in handles:
        handles[fp] = safe_open(fp, framework="np").__enter__()
      f = handles[fp]
      shape = tuple(f.get_slice(s.hf_name).get_shape())
      if shape != s.hf_shape:
        raise CheckpointError(f"Tensor {s.hf_name} in {fp} has shape {shape}, but config.json "
                              f"(hidden_size={probe.hidden_size}, num_attention_heads={probe.num_heads}, "
                              f"num_key_value_heads={probe.num_kv_heads}, head_dim={probe.head_dim}, "
                              f"intermediate_size={probe.intermediate_size}, vocab_size={probe.vocab_size}) "
                              f"implies {s.hf_shape}.")
      w = f.get_tensor(s.hf_name)
      if dtype is not None and w.dtype != dtype:
        w = w.astype(dtype)
      if weight_dtype is None:
        weight_dtype = w.dtype
      _set(params, s.path, s.to_tree(w))
  finally:
    for f in handles.values():
      f.__exit__(None, None, None)
  if ("param_dtype" not in config_overrides and weight_dtype is not None
      and weight_dtype.name in _DTYPES):
    probe = probe.replace(param_dtype=weight_dtype.name)
  return probe, stacking.to_model_layout(params, probe)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def export_hf_checkpoint(params: dict, config: ModelConfig, path: str, *,
                         max_shard_bytes: int | None = None, ignore_extra: bool = False,
                         base_hf_config: dict[str, Any] | None = None) -> list[str]:
  """Writes params (+ config.json) as a Hugging Face checkpoint that transformers can load.

  Args:
    params: the Decoder param tree (plain or `nn.Partitioned`-boxed arrays, numpy or jax),
      stacked or per-layer.
    config: its ModelConfig (a dense architecture of one of the four families).
    path: output directory (created).
    max_shard_bytes: split into model-XXXXX-of-YYYYY.safetensors + model.safetensors.index.json
      when the weights exceed this many bytes; None writes one model.safetensors.
    ignore_extra: leave out params the dense architecture does not have (e.g. a scheme's router)
      instead of raising.
    base_hf_config: a config.json dict (e.g. `read_hf_config(source_dir)`) whose other keys
      (bos/eos_token_id, max_position_embeddings, ...) are kept; the architecture keys always
      come from `config`.
  Returns: the files written.
  """
  params = unbox(params)
  if "params" in params and "embed_tokens" not in params:
    params = params["params"]
  params = stacking.unstack_layers(params, config.num_layers)
  specs = tensor_specs(config)
  missing, bad_shape = [], []
  tensors: dict[str, np.ndarray] = {}
  for s in specs:
    try:
      p = _get(params, s.path)
    except (KeyError, TypeError):
      missing.append("/".join(s.path))
      continue
    p = np.asarray(p)
    if tuple(p.shape) != s.shape:
      bad_shape.append(f"{'/'.join(s.path)} has shape {tuple(p.shape)}, expected {s.shape}")
      continue
    tensors[s.hf_name] = s.to_hf(p)
  if missing:
    raise CheckpointError(f"export_hf_checkpoint: params lack {_fmt(missing)} required by the "
                          f"{config.family} config.")
  if bad_shape:
    raise CheckpointError("export_hf_checkpoint: " + "; ".join(bad_shape) + ".")
  known = {s.path for s in specs}
  extra = sorted("/".join(p) for p in _leaf_paths(params) if p not in known)
  if extra and not ignore_extra:
    raise CheckpointError(f"export_hf_checkpoint: params hold {_fmt(extra)}, which a dense {config.family} "
                          "checkpoint has no place for; pass ignore_extra=True to drop them.")

  os.makedirs(path, exist_ok=True)
  for stale in [SINGLE_FILE, INDEX_FILE] + [os.path.basename(p) for p in
                                            glob.glob(os.path.join(path, "model-*-of-*.safetensors"))]:
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  hf = normalize_hf_config(base_hf_config or {})
  hf.pop("rope_scaling", None)
  hf.update(config.to_hf_config())
  dtypes = {t.dtype.name for t in tensors.values()}
  if len(dtypes) == 1 and (dt := dtypes.pop()) in _DTYPES:
    hf["torch_dtype"] = dt
    if "dtype" in hf:  # transformers >= 5 spelling
      hf["dtype"] = dt
  written = [os.path.join(path, CONFIG_FILE)]
  with open(written[0], "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)

  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  total = sum(t.nbytes for t in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    fp = os.path.join(path, SINGLE_FILE)
    save_file(tensors, fp, metadata=metadata)
    return written + [fp]
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fn), metadata=metadata)
    written.append(os.path.join(path, fn))
    weight_map.update({name: fn for name in shard})
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))},
              f, indent=2)
  written.append(os.path.join(path, INDEX_FILE))
  return written


def _leaf_paths(tree, prefix=()):
  if isinstance(tree, dict) or hasattr(tree, "items"):
    for k, v in tree.items():
      yield from _leaf_paths(v, prefix + (str(k),))
  else:
    yield prefix


# --------------------------------------------------------------------------------------------
# Logical-axis metadata
# --------------------------------------------------------------------------------------------
def unbox(tree):
  """Strips flax `nn.Partitioned` / `LogicallyPartitioned` boxes: plain arrays in nested dicts."""
  import flax.linen as nn
  return nn.meta.unbox(tree)


def box_like(params, boxed_template):
  """Puts plain `params` into the metadata boxes of `boxed_template` (e.g. the output of
  `jax.eval_shape(Decoder(cfg).init, ...)["params"]`), so logical axis names travel with them."""
  import flax.linen as nn
  import jax
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  return jax.tree.map(lambda box, p: box.replace_boxed(p) if is_box(box) else p,
                      boxed_template, params, is_leaf=is_box)
