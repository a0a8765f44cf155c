"""export.py's library (condattn_jax/export.py): every registered scheme round-trips bit-exactly
through the Hugging Face directory + sidecar layout; L2A also through the authors' (awslabs)
layout (AHA's authors' layout: tests/export/test_aha_authors_parity.py); the base weights load as the dense family with the converter everyone uses; the errors
name the parameter / file. Params are random values in each scheme's tree (jax.eval_shape of the
init, no compilation), so every leaf carries information a wrong mapping would lose."""
import json
import os

import numpy as np
import pytest

from _train_helpers import ROOT
from condattn_jax import convert, export
from condattn_jax.attention import get_scheme
from condattn_jax.train import config as config_lib
from condattn_jax.train.cli import load_recipe

RECIPES = {
    "dense": "configs/tiny.py",
    "l2a": "configs/l2a_qwen.py:tiny",
    "aha": "configs/aha_olmo.py:tiny",
    "elastic": "configs/elastic_qwen.py:tiny",
    "segmented": "configs/segmented_llama.py:tiny",
    "match": "configs/match_qwen.py:tiny",
}


def model_cfg(scheme, **kw):
  c = load_recipe(os.path.join(ROOT, RECIPES[scheme]))
  cfg, _ = config_lib.model_config(c)
  return cfg.replace(**kw) if kw else cfg


def random_params(cfg, seed=0):
  import jax
  rng = np.random.default_rng(seed)
  abstract = export.abstract_params(cfg)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)


def assert_bitwise_equal(a, b):
  import jax
  fa, ta = jax.tree_util.tree_flatten_with_path(a)
  fb, tb = jax.tree_util.tree_flatten_with_path(b)
  assert ta == tb
  for (p, x), (_, y) in zip(fa, fb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(p)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(p)


def test_every_registered_scheme_has_a_round_trip_case():
  """Every built-in scheme (a scheme a test file registers, like test_scheme_contract's toy, in the
  same worker process is not the library's)."""
  from condattn_jax.attention import SCHEMES, _load_builtin
  _load_builtin()
  builtin = {n for n, s in SCHEMES.items() if s.layer_cls.__module__.startswith("condattn_jax.")}
  assert builtin <= set(RECIPES), sorted(builtin - set(RECIPES))


@pytest.mark.parametrize("scheme", sorted(RECIPES))
def test_condattn_layout_round_trip_is_bit_exact(scheme, tmp_path):
  cfg = model_cfg(scheme)
  assert cfg.scheme == scheme
  params = random_params(cfg)
  out = str(tmp_path / "out")
  files = export.export_model(params, cfg, out)
  names = {os.path.basename(f) for f in files}
  assert {"config.json", "model.safetensors", "condattn_scheme.json"} <= names
  cfg2, params2 = export.load_model(out)
  assert cfg2 == cfg
  assert_bitwise_equal(params, params2)
  # the base weights are a plain checkpoint of the family: the converter loads them as dense,
  # equal to the scheme's copy of them
  hf = json.load(open(os.path.join(out, "config.json")))
  assert hf["model_type"] == cfg.family and hf["condattn"]["scheme"] == scheme
  dense_cfg, dense = convert.load_hf_checkpoint(out)
  assert dense_cfg.scheme == "dense"
  flat_dense = export._flat(export.stacking.unstack_layers(dense, cfg.num_layers))
  flat = export._flat(export._host_per_layer(params, cfg))
  for p, v in flat_dense.items():
    assert v.tobytes() == flat[p].tobytes(), p
  sidecar = json.load(open(os.path.join(out, "condattn_scheme.json")))
  own = set(flat) - set(flat_dense)
  assert set(sidecar["params"]) == {"/".join(p) for p in own}
  assert sidecar["scheme_kwargs"] == json.loads(json.dumps(dict(cfg.scheme_kwargs)))
  if scheme in ("l2a", "aha", "elastic"):  # routers, global branches, Lagrange multipliers
    assert own
  if scheme in ("dense", "match"):  # MATCH's retriever is not a parameter of the model
    assert not own


def test_l2a_pruned_and_bf16_round_trip(tmp_path):
  """Pruned layers (other layer groups) and bfloat16 weights come back as they were."""
  cfg = model_cfg("l2a", param_dtype="bfloat16")
  kw = dict(cfg.scheme_kwargs)
  kw["pruned_layers"] = (1,)
  cfg = cfg.replace(scheme_kwargs=tuple(sorted(kw.items())))
  params = random_params(cfg, seed=1)
  assert any(np.asarray(x).dtype.name == "bfloat16" for x in __import__("jax").tree.leaves(params))
  export.export_model(params, cfg, str(tmp_path / "o"))
  cfg2, params2 = export.load_model(str(tmp_path / "o"))
  assert cfg2 == cfg
  assert_bitwise_equal(params, params2)
  with pytest.raises(export.ExportError, match="pruned layers"):
    export.export_model(params, cfg, str(tmp_path / "a"), layout="authors")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_l2a_authors_layout_round_trip_and_names(family, tmp_path):
  cfg = model_cfg("l2a")
  if family == "qwen3":
    cfg = cfg.replace(family="qwen3", qk_norm="head", attention_bias=False)
  params = random_params(cfg, seed=2)
  out = str(tmp_path / "o")
  export.export_model(params, cfg, out, layout="authors")
  hf = json.load(open(os.path.join(out, "config.json")))
  opts = dict(cfg.scheme_kwargs)
  assert hf["model_type"] == f"l2a_{family}"
  assert hf["sliding_window"] == opts["window"] and hf["sigmoid_temp"] == opts["tau"]
  assert hf["sigmoid_threshold"] == opts["theta"] and hf["sigmoid_linear"] is True
  from safetensors import safe_open
  with safe_open(os.path.join(out, "model.safetensors"), framework="np") as f:
    names = set(f.keys())
    router = f.get_tensor("model.layers.1.self_attn.sigmoid_linear.weight")
    qg = f.get_tensor("model.layers.0.self_attn.q_proj_global.weight")
  per_layer = export._host_per_layer(params, cfg)
  np.testing.assert_array_equal(router, per_layer["layers_1"]["router"]["kernel"][None, :])
  D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  np.testing.assert_array_equal(qg, per_layer["layers_0"]["global_attn"]["q_proj"]["kernel"]
                                .reshape(D, N * H).T)  # torch Linear [out, in]
  for i in range(cfg.num_layers):
    for n in ("input_layernorm_global.weight", "self_attn.o_proj_global.weight",
              "self_attn.k_proj.weight", "self_attn.sigmoid_linear.weight"):
      assert f"model.layers.{i}.{n}" in names
    if family == "qwen3":
      assert f"model.layers.{i}.self_attn.q_norm_global.weight" in names
    else:
      assert f"model.layers.{i}.self_attn.q_proj_global.bias" in names
  cfg2, params2 = export.load_model(out)
  assert cfg2 == cfg
  assert_bitwise_equal(params, params2)
  # a released checkpoint without our sidecar: architecture and window / tau / theta from the
  # authors' config.json, the same weights
  os.remove(os.path.join(out, "condattn_scheme.json"))
  cfg3, params3 = export.load_authors_l2a(out)
  o3 = dict(cfg3.scheme_kwargs)
  assert (o3["window"], o3["tau"], o3["theta"]) == (opts["window"], opts["tau"], opts["theta"])
  assert cfg3.family == cfg.family and cfg3.num_layers == cfg.num_layers
  assert_bitwise_equal(params, params3)


def test_authors_layout_refused_for_other_schemes_and_bad_sidecars(tmp_path):
  dense = model_cfg("dense")
  with pytest.raises(export.ExportError, match="only L2A and AHA have an authors' layout"):
    export.export_model(random_params(dense), dense, str(tmp_path / "d"), layout="authors")
  cfg = model_cfg("aha")
  params = random_params(cfg)
  with pytest.raises(export.ExportError, match="local window is fixed at 128 tokens; this model's "
                     "window is 8"):
    export.export_model(params, cfg, str(tmp_path / "a"), layout="authors")
  out = str(tmp_path / "o")
  export.export_model(params, cfg, out)
  os.remove(os.path.join(out, "condattn_scheme.safetensors"))
  with pytest.raises(FileNotFoundError, match="condattn_scheme.safetensors is missing"):
    export.load_model(out)
  with pytest.raises(FileNotFoundError, match="has no condattn_scheme.json"):
    export.load_model(str(tmp_path))


def test_the_runs_tokenizer_files_travel_with_the_export(tmp_path):
  cfg = model_cfg("dense")
  tok = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen")
  files = export.export_model(random_params(cfg), cfg, str(tmp_path / "o"), tokenizer_dir=tok)
  copied = sorted(os.path.basename(f) for f in files if os.path.dirname(f) == str(tmp_path / "o")
                  and os.path.basename(f) in export.TOKENIZER_FILES)
  assert copied == sorted(n for n in os.listdir(tok) if n in export.TOKENIZER_FILES) and copied
  for n in copied:
    assert open(os.path.join(tok, n), "rb").read() == open(tmp_path / "o" / n, "rb").read()
