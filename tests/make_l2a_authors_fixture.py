"""Writes tests/fixtures/l2a_authors/: a tiny random L2A-Qwen3 checkpoint in the L2A authors'
layout and the logits of the AUTHORS' modelling code on it (logit parity of our import).

Runs in the Python 3.11 venv with the CPU build of torch and transformers (tests/make_hf_fixtures.py
says how to make it), against a checkout of the authors' repository (awslabs/hybrid-model-factory,
not vendored here):

  .venv311/bin/python tests/make_l2a_authors_fixture.py \
      --authors_model_dir=<hybrid-model-factory>/examples/research/L2A/model

Made with the authors' code at commit 04b6242b8a87e4496e4ade65eb2ec6a8b23b262a ("Add L2A
training, construction, and HF inference code"), transformers 5.24.0, torch 2.13.0+cpu.

The authors' modelling_qwen3.py is imported as is; only what a CPU cannot run is replaced:
  * flash_attn.flash_attn_func (CUDA only) -> an eager float64 softmax attention with the same
    arguments and masking (causal; window_size=(left, 0): key j visible to query i iff
    i - left <= j <= i);
  * torch.cuda.device(...) (a context the code enters around its attention calls) -> no-op;
  * the training-only helpers it imports from the repository's `hmf` package (sequence-parallel
    gathers, HybridCache) -> empty stand-ins (never called: no sequence parallelism, no cache);
  * the Triton qsparse prefill kernel is not importable on a CPU, so the code takes its own
    fallback (dense global attention times the router mask d).
The model runs in eval mode (hard decisions: sigmoid_linear(h) >= sigmoid_temp * logit(threshold))
in float64; the router weights are scaled so both decisions occur in every layer.

Outputs (numpy / safetensors only; the test never imports torch):
  config.json        the authors' L2AQwen3Config (model_type l2a_qwen3)
  model.safetensors  float32 weights under the authors' names
  expected.npz       input_ids int32 [2, 24]; logits f32 [2, 24, V] (float64 forward of the
                     float32 weights); decisions int32 [L, 2, 24] (the router's d per layer)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "l2a_authors")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), **_):
  """Eager stand-in for flash_attn.flash_attn_func: q [B, T, N, H], k / v [B, S, N, H]."""
  assert dropout_p == 0.0
  B, T, N, H = q.shape
  S = k.shape[1]
  scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(H)
  s = torch.einsum("btnh,bsnh->bnts", q.double(), k.double()) * scale
  i = torch.arange(T)[:, None] + (S - T)
  j = torch.arange(S)[None, :]
  ok = torch.ones(T, S, dtype=torch.bool)
  if causal:
    ok &= j <= i
  left, right = window_size
  if left >= 0:
    ok &= j >= i - left
  if right >= 0:
    ok &= j <= i + right
  s = s.masked_fill(~ok, float("-inf"))
  p = torch.softmax(s, dim=-1)
  return torch.einsum("bnts,bsnh->btnh", p, v.double()).to(q.dtype)


def _stub_modules():
  # transformers probes for flash_attn when these load: load them before the stand-in exists
  import transformers.activations  # noqa: F401
  import transformers.modeling_utils  # noqa: F401
  try:
    import transformers.modeling_attn_mask_utils  # noqa: F401  (transformers <= 5.3, the pin)
  except ImportError:  # later transformers dropped it; the modelling code only imports the name
    m = types.ModuleType("transformers.modeling_attn_mask_utils")
    m.AttentionMaskConverter = None
    sys.modules[m.__name__] = m
  fa = types.ModuleType("flash_attn")
  fa.flash_attn_func = flash_attn_func
  fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # transformers probes it
  sys.modules["flash_attn"] = fa
  names = ["hmf", "hmf.model", "hmf.model.hybrid_zoo", "hmf.model.hybrid_zoo.layers",
           "hmf.model.hybrid_zoo.layers.sp_p2p_utils", "hmf.model.model_utils",
           "hmf.model.model_utils.allgather_sp_helper", "hmf.model.hybrid_zoo.models",
           "hmf.model.hybrid_zoo.models.cache"]
  for n in names:
    m = types.ModuleType(n)
    m.__path__ = []
    sys.modules[n] = m
  sys.modules["hmf.model.hybrid_zoo.layers.sp_p2p_utils"].reorder_for_ssm_p2p = None
  helper = sys.modules["hmf.model.model_utils.allgather_sp_helper"]
  helper.ZigZagGatherScatter = helper.ZigZagScatter = None

  class HybridCache:  # never instantiated (use_cache=False)
    pass
  sys.modules["hmf.model.hybrid_zoo.models.cache"].HybridCache = HybridCache
  torch.cuda.device = lambda *a, **k: contextlib.nullcontext()


def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


def load_authors(model_dir: str):
  """The authors' configuration / modelling modules under a package of our own (their
  model/__init__.py registers with AutoModel and is not needed)."""
  _stub_modules()
  for pkg, path in (("l2a_authors", model_dir), ("l2a_authors.l2a_qwen3",
                                                 os.path.join(model_dir, "l2a_qwen3")),
                    ("l2a_authors.layers", None)):
    m = types.ModuleType(pkg)
    m.__path__ = [] if path is None else [path]  # layers: qsparse_prefill is not importable
    sys.modules[pkg] = m
  d = os.path.join(model_dir, "l2a_qwen3")
  cfg_mod = _load("l2a_authors.l2a_qwen3.configuration_qwen3", os.path.join(d, "configuration_qwen3.py"))
  _load("l2a_authors.l2a_qwen3.cache", os.path.join(d, "cache.py"))
  mdl = _load("l2a_authors.l2a_qwen3.modeling_qwen3", os.path.join(d, "modeling_qwen3.py"))
  assert not mdl.QSPARSE_AVAILABLE
  return cfg_mod, mdl


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--authors_model_dir", required=True)
  args = ap.parse_args()
  cfg_mod, mdl = load_authors(args.authors_model_dir)
  torch.manual_seed(0)
  cfg = cfg_mod.L2AQwen3Config(
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      use_sliding_window=False, sliding_window=4, l2a_initfrombase=True,
      sig_input_type="hidden_linearproj", sigmoid_temp=0.1, sigmoid_linear=True,
      sigmoid_threshold=0.5)
  model = mdl.L2AQwen3ForCausalLM(cfg).eval()
  rng = np.random.default_rng(0)
  sd = model.state_dict()
  new = {}
  for name, t in sd.items():
    if name.endswith("sigmoid_linear.weight"):
      w = rng.standard_normal(t.shape)  # logits ~ N(0, D): both decisions, far from 0
    elif "norm" in name:
      w = 1.0 + 0.2 * rng.standard_normal(t.shape)
    else:
      w = 0.2 * rng.standard_normal(t.shape)
    new[name] = torch.tensor(w, dtype=torch.float32)
  model.load_state_dict(new)
  os.makedirs(OUT, exist_ok=True)
  from safetensors.torch import save_file
  save_file({k: v.contiguous() for k, v in new.items()}, os.path.join(OUT, "model.safetensors"),
            metadata={"format": "pt"})
  hf = cfg.to_dict()
  hf = {k: v for k, v in hf.items() if not k.startswith("_")}
  with open(os.path.join(OUT, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)

  decisions = []  # the router's hard decision per layer (eval mode: logit >= 0 at theta 0.5)
  for layer in model.model.layers:
    attn = layer.self_attn
    fg = attn.forward_global
    def wrapped(hidden_states, *a, _fg=fg, _attn=attn, **k):
      z = _attn.sigmoid_linear(hidden_states).squeeze(-1)
      decisions.append((z >= 0).int().numpy())
      return _fg(hidden_states, *a, **k)
    attn.forward_global = wrapped
  model = model.double()
  ids = torch.tensor(rng.integers(0, cfg.vocab_size, size=(2, 24)), dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=ids, use_cache=False)
  logits = out.logits.float().numpy()
  dec = np.stack(decisions).astype(np.int32)
  print("decisions per layer (fraction global):", dec.reshape(dec.shape[0], -1).mean(-1))
  assert 0.1 < dec.mean() < 0.9, dec.mean()
  np.savez(os.path.join(OUT, "expected.npz"), input_ids=ids.numpy().astype(np.int32),
           logits=logits, decisions=dec)
  print("wrote", OUT)


if __name__ == "__main__":
  main()
