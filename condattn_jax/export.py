"""Checkpoints out and in: a trained model of any scheme <-> a Hugging Face directory.

  files = export_model(params, model_cfg, "out/", tokenizer_dir=None)        # our layout
  files = export_model(params, model_cfg, "out/", layout="authors")           # L2A, AHA (below)
  model_cfg, params = load_model("out/")                                      # either layout
  model_cfg, params = load_authors_l2a(dir) / load_authors_aha(dir)           # released, no sidecar
  (python export.py --checkpoint=DIR --out=OUT [--layout=condattn|authors] is the command line)

Layout "condattn" (every scheme: dense, l2a, aha, elastic, segmented, match):
  OUT/config.json                 the base family's Hugging Face config.json (llama | qwen2 |
                                  qwen3 | olmo2) plus a "condattn" entry naming the scheme and
                                  the sidecar files
  OUT/model.safetensors           every weight the base family has, under its Hugging Face
                                  names (`convert.export_hf_checkpoint`): the directory loads in
                                  transformers / vLLM as the dense base architecture. For L2A
                                  that is its LOCAL branch (self_attn) with full attention.
  OUT/condattn_scheme.json        the sidecar: format ("condattn-scheme/1"), scheme name, its
                                  options (`scheme_kwargs`: window, theta, pruned layers, ...), the
                                  whole ModelConfig, and the name / shape / dtype of every
                                  scheme-own parameter
  OUT/condattn_scheme.safetensors the scheme's own parameters (routers, global branches, Lagrange
                                  multipliers, ...) under their parameter-tree paths with the
                                  layer index ('layers_0/router/kernel'), as stored, no transpose
  OUT/tokenizer files             copied from the run's data.tokenizer directory when it has one
`load_model` puts both files back into the scheme's tree: the params and the ModelConfig come
back bit-exactly (every leaf, its dtype included).

Layout "authors" (L2A only): the awslabs hybrid-model-factory L2A-Qwen3 modelling code's
parameter names and config (model_type 'l2a_qwen3', architectures ['L2AQwen3ForCausalLM']):
  model.layers.i.self_attn.{q,k,v,o}_proj(.bias)          <- layers_i/self_attn (local, window w)
  model.layers.i.self_attn.{q,k}_norm                      <- layers_i/self_attn/{q,k}_norm
  model.layers.i.self_attn.{q,k,v,o}_proj_global(.bias)    <- layers_i/global_attn
  model.layers.i.self_attn.{q,k}_norm_global               <- layers_i/global_attn/{q,k}_norm
  model.layers.i.self_attn.sigmoid_linear.weight [1, D]    <- layers_i/router/kernel [D]
  model.layers.i.input_layernorm_global                    <- layers_i/global_layernorm
  config: sliding_window = w, sigmoid_temp = tau, sigmoid_threshold = theta, sigmoid_linear =
  true, sig_input_type = 'hidden_linearproj' (the router reads input_layernorm_global(x + local))
The awslabs code has Qwen3 modelling only; a qwen2 (Qwen2.5) model is written with the same
names, model_type 'l2a_qwen2' and attention_bias = true (the q/k/v biases under the same names).
What that layout cannot hold is refused with one line: pruned layers (no such notion there), a
router bias. The options the authors' config has no field for (L2A's training knobs: lambda,
p_force, ...) are kept in OUT/condattn_scheme.json, so an authors'-layout export loads back
bit-exactly too.

Layout "authors" for AHA: the router layout of the vLLM-AHA modelling code (vLLM's
olmo2_aha.py, "Adapted from OLMo2 for All-or-Here Attention", which loads the released
AHA-OLMo2 checkpoint): OLMo-2 names, with the router folded into q_proj as N extra output rows,
  model.layers.i.self_attn.q_proj.weight [N*H + N, D] = [q rows ; router rows]
  gate = sigmoid(router rows @ x) > 0.5 -> full attention, else a window of 128 tokens
(LOCAL_WINDOW_SIZE, fixed in that code), config.json = the OLMo-2 config with architectures
['Olmo2AHAForCausalLM']. That gate has no bias and a fixed threshold: our router
(sigmoid(x W + b) > tau) is written exactly when b = logit(tau) on every head (then
sigmoid(x W) > 0.5 is the same decision) and the window is 128; otherwise the export is refused
with one line saying by how much the bias is off (train with router_bias_init = logit(tau) and a
frozen bias, or export --layout=condattn). The bias itself travels in the sidecar, so the
round trip is bit-exact. The released checkpoint's own config file (a custom "FAOlmo" config)
was not obtainable here; `load_authors_aha` reads the OLMo-2 fields vLLM reads from it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import ml_dtypes  # noqa: F401  (bfloat16 for numpy / safetensors)
import numpy as np

from condattn_jax import convert
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig

SIDECAR_JSON = "condattn_scheme.json"
SIDECAR_WEIGHTS = "condattn_scheme.safetensors"
FORMAT = "condattn-scheme/1"
LAYOUTS = ("condattn", "authors")
# Tokenizer files a Hugging Face directory carries (copied when the run's tokenizer has them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")


class ExportError(ValueError):
  """The params / directory cannot be written or read in the asked layout (one line, naming
  the file or parameter and the fix)."""


# ------------------------------------------------------------------------------ tree helpers
def _flat(tree, prefix=()) -> dict[tuple[str, ...], Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict) or hasattr(v, "items"):
      out.update(_flat(v, prefix + (str(k),)))
    else:
      out[prefix + (str(k),)] = v
  return out


def _unflat(flat: dict[tuple[str, ...], Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def _host_per_layer(params, model_cfg: ModelConfig) -> dict:
  """Params (boxed or not, jax or numpy, stacked or per-layer) -> per-layer numpy tree."""
  import jax
  params = convert.unbox(params)
  if "params" in params and "embed_tokens" not in params:
    params = params["params"]
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
  return stacking.unstack_layers(params, model_cfg.num_layers)


def base_config(model_cfg: ModelConfig) -> ModelConfig:
  """The dense architecture whose Hugging Face layout holds the base weights."""
  return model_cfg.replace(scheme="dense", scheme_kwargs=(), sliding_window=None)


def _tuples(v):
  if isinstance(v, list):
    return tuple(_tuples(x) for x in v)
  return v


def config_to_json(cfg: ModelConfig) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_from_json(d: dict) -> ModelConfig:
  """A ModelConfig back from `config_to_json` (lists -> tuples, as the dataclass holds them)."""
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ExportError(f"{SIDECAR_JSON}: model_config has fields this version does not know: "
                      f"{unknown}.")
  return ModelConfig(**{k: _tuples(v) for k, v in d.items()})


def _copy_tokenizer(tokenizer_dir: str | None, out_dir: str) -> list[str]:
  if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
    return []
  written = []
  for name in TOKENIZER_FILES:
    src = os.path.join(tokenizer_dir, name)
    if os.path.isfile(src):
      dst = os.path.join(out_dir, name)
      shutil.copyfile(src, dst)
      written.append(dst)
  return written


# ------------------------------------------------------------------------------------ export
def export_model(params, model_cfg: ModelConfig, out_dir: str, *, layout: str = "condattn",
                 tokenizer_dir: str | None = None, base_hf_config: dict | None = None) -> list[str]:
  """Writes `params` of `model_cfg` (any scheme) to `out_dir` in `layout` (module docstring);
  returns the files written."""
  from safetensors.numpy import save_file
  if layout not in LAYOUTS:
    raise ExportError(f"layout={layout!r} is unknown; choose one of {list(LAYOUTS)}.")
  per_layer = _host_per_layer(params, model_cfg)
  flat = _flat(per_layer)
  if layout == "authors":
    return _export_authors(flat, model_cfg, out_dir, tokenizer_dir, base_hf_config)
  base = base_config(model_cfg)
  base_paths = {s.path: s.shape for s in convert.tensor_specs(base)}
  wrong = [f"{'/'.join(p)} {tuple(np.shape(flat[p]))} vs {shape}" for p, shape in base_paths.items()
           if p in flat and tuple(np.shape(flat[p])) != shape]
  if wrong:
    raise ExportError(f"scheme {model_cfg.scheme!r}: base parameters with another shape than the "
                      f"{base.family} layout: {wrong[:4]}.")
  base_flat = {p: v for p, v in flat.items() if p in base_paths}
  own = {p: v for p, v in flat.items() if p not in base_paths}
  os.makedirs(out_dir, exist_ok=True)
  files = convert.export_hf_checkpoint(_unflat(base_flat), base, out_dir,
                                       base_hf_config=base_hf_config)
  cfg_path = os.path.join(out_dir, convert.CONFIG_FILE)
  with open(cfg_path) as f:
    hf = json.load(f)
  hf["condattn"] = {"scheme": model_cfg.scheme, "sidecar": SIDECAR_JSON,
                    "weights": SIDECAR_WEIGHTS if own else None}
  with open(cfg_path, "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  files += _write_sidecar(out_dir, model_cfg, own, layout="condattn")
  return files + _copy_tokenizer(tokenizer_dir, out_dir)


def _write_sidecar(out_dir: str, model_cfg: ModelConfig, own: dict, layout: str) -> list[str]:
  from safetensors.numpy import save_file
  names = {"/".join(p): np.ascontiguousarray(v) for p, v in sorted(own.items())}
  meta = {
      "format": FORMAT,
      "layout": layout,
      "scheme": model_cfg.scheme,
      "scheme_kwargs": {k: v for k, v in model_cfg.scheme_kwargs},
      "model_config": config_to_json(model_cfg),
      "params": {k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in names.items()},
  }
  written = []
  if names:
    wp = os.path.join(out_dir, SIDECAR_WEIGHTS)
    save_file(names, wp, metadata={"format": "pt"})
    written.append(wp)
  jp = os.path.join(out_dir, SIDECAR_JSON)
  with open(jp, "w") as f:
    json.dump(meta, f, indent=2)
  written.append(jp)
  return written


# ------------------------------------------------------------------------------------ import
def is_export(path: str) -> bool:
  """True when `path` is a directory written by `export_model` (it has the sidecar)."""
  return os.path.isfile(os.path.join(path, SIDECAR_JSON))


def read_sidecar(path: str) -> dict:
  jp = os.path.join(path, SIDECAR_JSON)
  try:
    with open(jp) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} has no {SIDECAR_JSON}: not a directory written by export.py "
                            "(a plain Hugging Face checkpoint goes into model.init_from).") from None
  except ValueError as e:
    raise ExportError(f"{jp} is not valid JSON ({e}); export the model again.") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ExportError(f"{jp}: format {meta.get('format') if isinstance(meta, dict) else None!r} "
                      f"is not {FORMAT!r}.")
  for key in ("scheme", "model_config", "params", "layout"):
    if key not in meta:
      raise ExportError(f"{jp} lacks the key {key!r}; export the model again.")
  return meta


def _read_own(path: str, meta: dict) -> dict[tuple[str, ...], np.ndarray]:
  from safetensors import safe_open
  want = meta["params"]
  if not want:
    return {}
  wp = os.path.join(path, SIDECAR_WEIGHTS)
  if not os.path.isfile(wp):
    raise FileNotFoundError(f"{wp} is missing ({SIDECAR_JSON} lists {len(want)} scheme "
                            "parameters); copy the whole export directory.")
  out = {}
  with safe_open(wp, framework="np") as f:
    have = set(f.keys())
    missing = sorted(set(want) - have)
    if missing:
      raise ExportError(f"{wp} lacks {missing[:4]} listed in {SIDECAR_JSON}.")
    for name, spec in want.items():
      t = f.get_tensor(name)
      if list(t.shape) != spec["shape"] or t.dtype.name != spec["dtype"]:
        raise ExportError(f"{wp}: {name} is {t.dtype.name}{list(t.shape)}, {SIDECAR_JSON} says "
                          f"{spec['dtype']}{spec['shape']}.")
      out[tuple(name.split("/"))] = t
  return out


def load_model(path: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params in the Decoder's stacked layout, numpy) from a directory written by
  `export_model` (either layout). Checks the tree against the scheme's own init (paths, shapes,
  dtypes): a mismatch is an ExportError naming the parameters."""
  meta = read_sidecar(path)
  cfg = config_from_json(meta["model_config"])
  if meta["layout"] == "authors":
    flat = _read_authors(path, cfg)
  else:
    base_cfg, base = convert.load_hf_checkpoint(path)
    flat = _flat(stacking.unstack_layers(base, cfg.num_layers))
  own = _read_own(path, meta)
  clash = sorted("/".join(p) for p in set(own) & set(flat))
  if clash:
    raise ExportError(f"{path}: {clash[:4]} are in both the base weights and the sidecar.")
  flat.update(own)
  params = stacking.to_model_layout(_unflat(flat), cfg)
  check_tree(params, cfg, where=path)
  return cfg, params


def abstract_params(cfg: ModelConfig):
  """The scheme's param tree of `cfg` as ShapeDtypeStructs (no compute)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from condattn_jax.models.decoder import Decoder
  tok = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  tree = jax.eval_shape(lambda t: Decoder(cfg).init({"params": jax.random.key(0),
                                                     "router": jax.random.key(1)}, t), tok)
  return nn.meta.unbox(tree["params"])


def check_tree(params, cfg: ModelConfig, where: str = "") -> None:
  want = {p: (tuple(x.shape), np.dtype(x.dtype).name) for p, x in _flat(abstract_params(cfg)).items()}
  got = {p: (tuple(np.shape(x)), np.asarray(x).dtype.name) for p, x in _flat(params).items()}
  missing = sorted("/".join(p) for p in set(want) - set(got))
  extra = sorted("/".join(p) for p in set(got) - set(want))
  bad = [f"{'/'.join(p)} {got[p]} vs {want[p]}" for p in sorted(set(want) & set(got))
         if got[p] != want[p]]
  if missing or extra or bad:
    raise ExportError(f"{where}: the loaded params do not fit scheme {cfg.scheme!r}: missing "
                      f"{missing[:4]}, unexpected {extra[:4]}, shape/dtype {bad[:4]}.")


# ------------------------------------------------------------------- the L2A authors' layout
_L2A_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


AHA_WINDOW = 128  # vLLM-AHA's LOCAL_WINDOW_SIZE


def _authors_specs(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], convert.TensorSpec]]:
  """(authors' name, our per-layer path, the TensorSpec that converts it) for every tensor."""
  if cfg.scheme == "aha":
    return _aha_specs(cfg)
  if cfg.scheme != "l2a":
    raise ExportError(f"--layout=authors: only L2A and AHA have an authors' layout (the awslabs "
                      f"L2A and the vLLM-AHA modelling code); scheme {cfg.scheme!r} exports with "
                      "--layout=condattn.")
  if cfg.family not in ("qwen3", "qwen2"):
    raise ExportError(f"--layout=authors: the L2A authors' code is Qwen3 (and Qwen2.5) only; this "
                      f"model is {cfg.family!r}. Use --layout=condattn.")
  opts = dict(cfg.scheme_kwargs)
  if tuple(opts.get("pruned_layers", ())):
    raise ExportError(f"--layout=authors: pruned layers {tuple(opts['pruned_layers'])} have no "
                      "place in the authors' L2A layout (every layer has a global branch there); "
                      "use --layout=condattn.")
  base = convert.tensor_specs(base_config(cfg))
  out = []
  for s in base:
    out.append((s.hf_name, s.path, s))
    if len(s.path) >= 3 and s.path[1] == "self_attn":
      i = s.path[0].split("_")[1]
      name = s.hf_name.replace(f"model.layers.{i}.self_attn.", "")
      stem, _, suffix = name.partition(".")  # q_proj.weight -> q_proj, weight
      gpath = (s.path[0], "global_attn") + s.path[2:]
      gname = f"model.layers.{i}.self_attn.{stem}_global.{suffix}"
      out.append((gname, gpath, dataclasses.replace(s, hf_name=gname, path=gpath)))
    if len(s.path) == 3 and s.path[1] == "input_layernorm":
      i = s.path[0].split("_")[1]
      gname = f"model.layers.{i}.input_layernorm_global.weight"
      gpath = (s.path[0], "global_layernorm", "scale")
      out.append((gname, gpath, dataclasses.replace(s, hf_name=gname, path=gpath)))
  D = cfg.hidden_size
  for i in range(cfg.num_layers):
    name = f"model.layers.{i}.self_attn.sigmoid_linear.weight"
    path = (f"layers_{i}", "router", "kernel")
    out.append((name, path, convert.TensorSpec(name, path, (1, D), (D,), "router")))
  return out


def _aha_specs(cfg: ModelConfig):
  """AHA in vLLM-AHA's layout: the OLMo-2 tensors, q_proj with the router's N rows appended."""
  if cfg.family != "olmo2":
    raise ExportError(f"--layout=authors: the AHA authors' layout is OLMo-2's; this model is "
                      f"{cfg.family!r}. Use --layout=condattn.")
  opts = dict(cfg.scheme_kwargs)
  if int(opts.get("window", AHA_WINDOW)) != AHA_WINDOW:
    raise ExportError(f"--layout=authors: vLLM-AHA's local window is fixed at {AHA_WINDOW} "
                      f"tokens; this model's window is {opts.get('window')}. Use --layout=condattn.")
  out = []
  D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  for s in convert.tensor_specs(base_config(cfg)):
    if s.path[1:] == ("self_attn", "q_proj", "kernel"):
      # one authors' tensor from two of ours: (q kernel [D, N, H], router kernel [D, N])
      out.append((s.hf_name, s.path, convert.TensorSpec(s.hf_name, s.path, (N * H + N, D),
                                                        (D, N, H), "aha_q")))
    else:
      out.append((s.hf_name, s.path, s))
  return out


def _router_path(path):
  return (path[0], "router", "kernel")


def _to_authors(spec: convert.TensorSpec, p: np.ndarray, flat=None) -> np.ndarray:
  if spec.kind == "router":
    return np.ascontiguousarray(np.asarray(p).reshape(1, -1))
  if spec.kind == "aha_q":
    q = np.asarray(p).reshape(spec.shape[0], -1).T  # [N*H, D]
    r = np.asarray(flat[_router_path(spec.path)]).T  # [N, D]
    if r.dtype != q.dtype:
      raise ExportError(f"--layout=authors: {'/'.join(_router_path(spec.path))} is {r.dtype}, "
                        f"q_proj is {q.dtype}; one q_proj tensor holds both.")
    return np.ascontiguousarray(np.concatenate([q, r], axis=0))
  return spec.to_hf(np.asarray(p))


def _from_authors(spec: convert.TensorSpec, w: np.ndarray, out=None) -> np.ndarray:
  if spec.kind == "router":
    return np.ascontiguousarray(w.reshape(spec.shape))
  if spec.kind == "aha_q":
    D, N, H = spec.shape
    out[_router_path(spec.path)] = np.ascontiguousarray(w[N * H:].T)
    return np.ascontiguousarray(w[:N * H].T).reshape(D, N, H)
  return spec.to_tree(w)


def _check_aha_gate(flat, cfg: ModelConfig) -> None:
  """vLLM-AHA's gate is sigmoid(x W) > 0.5: ours, sigmoid(x W + b) > tau, is the same decision
  only when b = logit(tau) on every head."""
  tau = float(dict(cfg.scheme_kwargs).get("tau", 0.5))
  want = np.float32(np.log(tau / (1.0 - tau)))
  worst = 0.0
  for p, v in flat.items():
    if p[1:] == ("router", "bias"):
      worst = max(worst, float(np.max(np.abs(np.asarray(v, np.float32) - want))))
  if worst > 0.0:
    raise ExportError(f"--layout=authors: vLLM-AHA's gate has no bias and a 0.5 threshold; this "
                      f"router's bias differs from logit(tau={tau}) = {float(want):.6g} by up to "
                      f"{worst:.3g}, so the authors' gate would route differently. Use "
                      "--layout=condattn (or train with router_bias_init = logit(tau), bias frozen).")


def authors_hf_config(cfg: ModelConfig, base_hf_config: dict | None = None) -> dict:
  """The awslabs L2AQwen3Config dict of an L2A ModelConfig."""
  opts = dict(cfg.scheme_kwargs)
  hf = convert.normalize_hf_config(dict(base_hf_config or {}))
  hf.pop("rope_scaling", None)
  hf.update(base_config(cfg).to_hf_config())
  qwen3 = cfg.family == "qwen3"
  hf.update({
      "model_type": "l2a_qwen3" if qwen3 else "l2a_qwen2",
      "architectures": ["L2AQwen3ForCausalLM" if qwen3 else "L2AQwen2ForCausalLM"],
      "attention_bias": bool(cfg.attention_bias),
      "sliding_window": int(opts.get("window", 0)),
      "use_sliding_window": False,
      "sigmoid_temp": float(opts.get("tau", 1.0)),
      "sigmoid_threshold": float(opts.get("theta", 0.5)),
      "sigmoid_linear": True,
      "sig_input_type": "hidden_linearproj",
      "l2a_initfrombase": True,
  })
  return hf


def _export_authors(flat, cfg: ModelConfig, out_dir, tokenizer_dir, base_hf_config) -> list[str]:
  from safetensors.numpy import save_file
  specs = _authors_specs(cfg)
  if cfg.scheme == "aha":
    _check_aha_gate(flat, cfg)
  elif any(p[1] == "router" and p[2] == "bias" for p in flat):
    raise ExportError("--layout=authors: this L2A router has a bias; the authors' sigmoid_linear "
                      "has none. Use --layout=condattn.")
  tensors, used = {}, set()
  for name, path, spec in specs:
    if path not in flat:
      raise ExportError(f"--layout=authors: the params lack {'/'.join(path)} ({name}).")
    p = np.asarray(flat[path])
    if tuple(p.shape) != spec.shape:
      raise ExportError(f"--layout=authors: {'/'.join(path)} has shape {tuple(p.shape)}, the "
                        f"authors' {name} needs {spec.shape}.")
    tensors[name] = _to_authors(spec, p, flat)
    used.add(path)
    if spec.kind == "aha_q":
      used.add(_router_path(path))
  own = {p: v for p, v in flat.items() if p not in used}  # nothing for today's L2A
  os.makedirs(out_dir, exist_ok=True)
  for stale in (convert.SINGLE_FILE, convert.INDEX_FILE, SIDECAR_WEIGHTS):
    if os.path.exists(os.path.join(out_dir, stale)):
      os.remove(os.path.join(out_dir, stale))
  hf = authors_hf_config(cfg, base_hf_config) if cfg.scheme == "l2a" else \
      aha_hf_config(cfg, base_hf_config)
  dtypes = {t.dtype.name for t in tensors.values()}
  if len(dtypes) == 1:
    hf["torch_dtype"] = dtypes.pop()
  hf["condattn"] = {"scheme": cfg.scheme, "sidecar": SIDECAR_JSON,
                    "weights": SIDECAR_WEIGHTS if own else None}
  cp = os.path.join(out_dir, convert.CONFIG_FILE)
  with open(cp, "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  wp = os.path.join(out_dir, convert.SINGLE_FILE)
  save_file(tensors, wp, metadata={"format": "pt"})
  files = [cp, wp] + _write_sidecar(out_dir, cfg, own, layout="authors")
  return files + _copy_tokenizer(tokenizer_dir, out_dir)


def _read_authors(path: str, cfg: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
  from safetensors import safe_open
  wp = os.path.join(path, convert.SINGLE_FILE)
  if not os.path.isfile(wp):
    raise FileNotFoundError(f"{wp} is missing: an authors'-layout export holds its weights in "
                            f"{convert.SINGLE_FILE}.")
  out = {}
  with safe_open(wp, framework="np") as f:
    have = set(f.keys())
    for name, p, spec in _authors_specs(cfg):
      if name not in have:
        raise ExportError(f"{wp} lacks {name} (the authors' {cfg.scheme} layout of this config).")
      w = f.get_tensor(name)
      if tuple(w.shape) != spec.hf_shape:
        raise ExportError(f"{wp}: {name} has shape {tuple(w.shape)}, expected {spec.hf_shape}.")
      out[p] = _from_authors(spec, w, out)
  return out


def config_from_authors(hf: dict, **overrides) -> ModelConfig:
  """An L2A ModelConfig from an awslabs L2AQwen3Config dict (a released L2A checkpoint without
  our sidecar): architecture from the Qwen fields, window / tau / theta from sliding_window /
  sigmoid_temp / sigmoid_threshold; the other options keep the scheme's defaults."""
  base = dict(hf)
  mt = base.get("model_type", "")
  if mt not in ("l2a_qwen3", "l2a_qwen2"):
    raise ExportError(f"config.json model_type={mt!r} is not an L2A authors' config "
                      "(l2a_qwen3 / l2a_qwen2).")
  base["model_type"] = mt[len("l2a_"):]
  base.pop("use_sliding_window", None)
  cfg = ModelConfig.from_hf_config(convert.normalize_hf_config(base), **overrides)
  kw = dict(cfg.scheme_kwargs)
  kw.update(window=int(hf["sliding_window"]), tau=float(hf.get("sigmoid_temp", 1.0)),
            theta=float(hf.get("sigmoid_threshold", 0.5)))
  return cfg.replace(scheme="l2a", scheme_kwargs=tuple(sorted(kw.items())))


def load_authors_l2a(path: str, **overrides) -> tuple[ModelConfig, dict]:
  """A released L2A checkpoint in the authors' layout (config.json with model_type l2a_qwen3,
  model.safetensors), without our sidecar -> (ModelConfig, params)."""
  with open(os.path.join(path, convert.CONFIG_FILE)) as f:
    hf = json.load(f)
  cfg = config_from_authors(hf, **overrides)
  params = stacking.to_model_layout(_unflat(_read_authors(path, cfg)), cfg)
  return cfg, params


# ------------------------------------------------------------------- the AHA authors' layout
def aha_hf_config(cfg: ModelConfig, base_hf_config: dict | None = None) -> dict:
  """The OLMo-2 config.json vLLM-AHA reads, with its architecture name."""
  hf = convert.normalize_hf_config(dict(base_hf_config or {}))
  hf.pop("rope_scaling", None)
  hf.update(base_config(cfg).to_hf_config())
  hf["architectures"] = ["Olmo2AHAForCausalLM"]
  return hf


def config_from_aha(hf: dict, **overrides) -> ModelConfig:
  """An AHA ModelConfig from vLLM-AHA's OLMo-2 config: window 128, tau 0.5 (its gate threshold),
  learned routing; the other options keep the scheme's defaults."""
  base = dict(hf)
  base["model_type"] = "olmo2"
  cfg = ModelConfig.from_hf_config(convert.normalize_hf_config(base), **overrides)
  kw = dict(cfg.scheme_kwargs)
  kw.update(window=AHA_WINDOW, tau=0.5, router_bias_init=0.0, routing="learned")
  return cfg.replace(scheme="aha", scheme_kwargs=tuple(sorted(kw.items())))


def load_authors_aha(path: str, **overrides) -> tuple[ModelConfig, dict]:
  """A checkpoint in vLLM-AHA's layout (OLMo-2 names, router rows in q_proj) without our
  sidecar -> (ModelConfig, params); the router bias is 0 (the authors' gate has none)."""
  with open(os.path.join(path, convert.CONFIG_FILE)) as f:
    hf = json.load(f)
  cfg = config_from_aha(hf, **overrides)
  flat = _read_authors(path, cfg)
  dtype = [x.dtype for p, x in _flat(abstract_params(cfg)).items() if p[-2:] == ("router", "bias")][0]
  for i in range(cfg.num_layers):
    flat[(f"layers_{i}", "router", "bias")] = np.zeros((cfg.num_heads,), dtype)
  params = stacking.to_model_layout(_unflat(flat), cfg)
  check_tree(params, cfg, where=path)
  return cfg, params
