"""convert.py: HF checkpoints -> Decoder params (logit parity with transformers), export round trips,
sharded and bf16 files, and the errors for broken checkpoints.

Fixtures come from tests/make_hf_fixtures.py (transformers 5.23, torch 2.13 CPU).
"""
import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from condattn_jax import convert
from condattn_jax.convert import CheckpointError, export_hf_checkpoint, load_hf_checkpoint
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FAMILIES = ["llama", "qwen2", "qwen3", "olmo2"]
TOL = 1e-4


def fixture(name):
  return os.path.join(HF, name)


def read_safetensors(path):
  """name -> array of every tensor in a checkpoint dir (single file or shards)."""
  out = {}
  for fn in sorted(os.listdir(path)):
    if fn.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, fn)))
  return out


def assert_trees_equal(a, b):
  la, ta = jax.tree.flatten_with_path(a)
  lb, tb = jax.tree.flatten_with_path(b)
  assert ta == tb
  for (path, x), (_, y) in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), x.dtype, y.dtype)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def loaded():
  return {f: load_hf_checkpoint(fixture(f)) for f in FAMILIES}


def _forward(cfg, params, *args):
  fn = jax.jit(lambda p, *a: Decoder(cfg).apply({"params": p}, *a)[0])
  return np.asarray(fn(params, *[jnp.asarray(a) for a in args]))


# --------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, loaded):
  cfg, params = loaded[family]
  e = np.load(os.path.join(fixture(family), "expected.npz"))
  assert cfg.family == family and cfg.param_dtype == "float32"
  cfg = cfg.replace(dtype="float32")
  logits = _forward(cfg, params, e["input_ids"])
  assert logits.shape == e["logits"].shape
  err = np.abs(logits - e["logits"]).max()
  assert err <= TOL, f"{family}: max |logits - HF| = {err}"
  # Packed documents with restarting positions: each document as if alone (padding not compared).
  seg = e["packed_segment_ids"]
  packed = _forward(cfg, params, e["packed_input_ids"], e["packed_positions"], seg)
  err = np.abs(packed - e["packed_logits"])[seg > 0].max()
  assert err <= TOL, f"{family} packed: max |logits - HF| = {err}"


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_matches_decoder_init(family, loaded):
  cfg, params = loaded[family]
  abstract = jax.eval_shape(Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  shapes = lambda t: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), t)
  assert shapes(convert.unbox(abstract)) == shapes(params)
  boxed = convert.box_like(params, abstract)
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  assert all(isinstance(x, nn.meta.AxisMetadata) for x in leaves)
  assert_trees_equal(convert.unbox(boxed), params)


def test_boxed_params_give_the_same_logits(loaded):
  cfg, params = loaded["qwen2"]
  e = np.load(os.path.join(fixture("qwen2"), "expected.npz"))
  abstract = jax.eval_shape(Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  boxed = convert.box_like(jax.tree.map(jnp.asarray, params), abstract)
  a = Decoder(cfg).apply({"params": boxed}, jnp.asarray(e["input_ids"][:1, :8]))[0]
  b = Decoder(cfg).apply({"params": params}, jnp.asarray(e["input_ids"][:1, :8]))[0]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_layouts(loaded):
  llama, _ = loaded["llama"]  # pre-v5 layout: rope_theta + rope_scaling
  assert dict(llama.rope_scaling) == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32)
  assert llama.rope_theta == 10000.0 and not llama.tie_word_embeddings
  qwen2, p2 = loaded["qwen2"]
  assert qwen2.tie_word_embeddings and qwen2.attention_bias and "lm_head" not in p2
  assert p2["layers"]["self_attn"]["q_proj"]["bias"].shape == (2, 4, 16)  # stacked: [L, N, H]
  olmo2, p = loaded["olmo2"]  # transformers 5 layout: rope_parameters
  assert olmo2.rope_theta == 500000.0 and olmo2.rope_scaling is None and olmo2.post_norm
  p = stacking.unstack_layers(p)
  assert p["layers_0"]["self_attn"]["q_norm"]["scale"].shape == (64,)
  assert p["layers_0"]["self_attn"]["k_norm"]["scale"].shape == (32,)
  qwen3, p = loaded["qwen3"]
  assert qwen3.rope_theta == 1e6 and qwen3.qk_norm == "head"
  assert stacking.unstack_layers(p)["layers_0"]["self_attn"]["q_norm"]["scale"].shape == (16,)
  assert convert.normalize_hf_config({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5.0,
                                                          "factor": 2.0}}) == {
      "rope_theta": 5.0, "rope_scaling": {"rope_type": "llama3", "factor": 2.0}}


def test_layout_transforms(loaded):
  """kernel [D,N,H] = HF weight [N*H, D] transposed; o_proj [N,H,D] = HF [D, N*H] transposed."""
  _, params = loaded["llama"]
  params = stacking.unstack_layers(params)  # the one per-layer <-> stacked conversion
  hf = load_file(os.path.join(fixture("llama"), "model.safetensors"))
  q = hf["model.layers.1.self_attn.q_proj.weight"]  # [N*H, D]
  np.testing.assert_array_equal(params["layers_1"]["self_attn"]["q_proj"]["kernel"][:, 2, 5], q[2 * 16 + 5])
  o = hf["model.layers.1.self_attn.o_proj.weight"]  # [D, N*H]
  np.testing.assert_array_equal(params["layers_1"]["self_attn"]["o_proj"]["kernel"][3, 7], o[:, 3 * 16 + 7])
  np.testing.assert_array_equal(params["lm_head"]["kernel"], hf["lm_head.weight"].T)


# --------------------------------------------------------------------------------------------
# Export round trips
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_export_import_round_trip_is_bit_exact(family, loaded, tmp_path):
  cfg, params = loaded[family]
  out = str(tmp_path / family)
  written = export_hf_checkpoint(jax.tree.map(jnp.asarray, params), cfg, out)
  assert sorted(os.path.basename(w) for w in written) == ["config.json", "model.safetensors"]
  cfg2, params2 = load_hf_checkpoint(out)
  assert cfg2 == cfg
  assert_trees_equal(params2, params)
  # The exported tensors are exactly the transformers-written ones (names, dtypes, bytes).
  orig, new = read_safetensors(fixture(family)), read_safetensors(out)
  assert sorted(orig) == sorted(new)
  for name in orig:
    assert orig[name].dtype == new[name].dtype and orig[name].shape == new[name].shape, name
    assert orig[name].tobytes() == new[name].tobytes(), name
  with safe_open(os.path.join(out, "model.safetensors"), framework="np") as f:
    assert f.metadata() == {"format": "pt"}
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(fixture(family), "config.json")) as f:
    ref = convert.normalize_hf_config(json.load(f))
  for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
              "tie_word_embeddings"):
    assert hf[key] == ref[key], key
  assert hf.get("rope_scaling") == ref.get("rope_scaling")


def test_sharded_export_round_trip(loaded, tmp_path):
  cfg, params = loaded["olmo2"]
  out = str(tmp_path / "sharded")
  export_hf_checkpoint(params, cfg, out, max_shard_bytes=30_000)
  files = sorted(os.listdir(out))
  shards = [f for f in files if f.startswith("model-")]
  assert len(shards) >= 3 and "model.safetensors.index.json" in files and "model.safetensors" not in files
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_safetensors(out).values())
  _, params2 = load_hf_checkpoint(out)
  assert_trees_equal(params2, params)
  # Re-exporting unsharded into the same directory leaves no stale shards behind.
  export_hf_checkpoint(params, cfg, out)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_sharded_fixture_loads(loaded):
  cfg, params = load_hf_checkpoint(fixture("llama_sharded"))
  assert len([f for f in os.listdir(fixture("llama_sharded")) if f.startswith("model-")]) == 3
  ref_cfg, ref = loaded["llama"]
  assert cfg == ref_cfg
  assert_trees_equal(params, ref)


def test_bf16_checkpoint_loads_as_bf16(loaded, tmp_path):
  cfg, params = load_hf_checkpoint(fixture("qwen3_bf16"))
  assert cfg.param_dtype == "bfloat16"
  assert {np.asarray(x).dtype for x in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
  _, ref = loaded["qwen3"]  # the same weights in float32, rounded by torch
  assert_trees_equal(params, jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), ref))
  cfg32, params32 = load_hf_checkpoint(fixture("qwen3_bf16"), dtype=jnp.float32)
  assert cfg32.param_dtype == "float32"
  assert {x.dtype for x in jax.tree.leaves(params32)} == {np.dtype(np.float32)}
  # bf16 export round trip, and the tensors match the transformers-written bf16 file.
  export_hf_checkpoint(jax.tree.map(jnp.asarray, params), cfg, str(tmp_path / "bf16"))
  orig, new = read_safetensors(fixture("qwen3_bf16")), read_safetensors(str(tmp_path / "bf16"))
  assert sorted(orig) == sorted(new)
  assert all(orig[k].dtype == new[k].dtype and orig[k].tobytes() == new[k].tobytes() for k in orig)
  with open(tmp_path / "bf16" / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  # It runs (float32 compute on bf16 weights) and is close to the float32 model.
  e = np.load(os.path.join(fixture("qwen3"), "expected.npz"))
  logits = _forward(cfg, params, e["input_ids"][:1, :16])
  assert np.abs(logits - e["logits"][:1, :16]).max() < 1.0


def test_load_casts_to_requested_dtype():
  cfg, params = load_hf_checkpoint(fixture("qwen2"), dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
  with pytest.raises(ValueError, match="int32"):
    load_hf_checkpoint(fixture("qwen2"), dtype=np.int32)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
def copy_fixture(tmp_path, name="llama"):
  dst = tmp_path / name
  shutil.copytree(fixture(name), dst)
  if (dst / "expected.npz").exists():
    os.remove(dst / "expected.npz")
  return dst


def rewrite_weights(dst, fn):
  path = dst / "model.safetensors"
  tensors = load_file(str(path))
  fn(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})
  return str(path)


def test_missing_directory_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"nope.*does not exist"):
    load_hf_checkpoint(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match=r"No config\.json in checkpoint directory"):
    load_hf_checkpoint(str(tmp_path))
  dst = copy_fixture(tmp_path)
  os.remove(dst / "model.safetensors")
  with pytest.raises(FileNotFoundError) as e:
    load_hf_checkpoint(str(dst))
  msg = str(e.value)
  assert str(dst) in msg and "model.safetensors" in msg and "model.safetensors.index.json" in msg
  (dst / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="Only safetensors checkpoints are read"):
    load_hf_checkpoint(str(dst))


def test_missing_shard_file(tmp_path):
  dst = copy_fixture(tmp_path, "llama_sharded")
  os.remove(dst / "model-00002-of-00003.safetensors")
  with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json names shard files .*"
                                              r"model-00002-of-00003\.safetensors"):
    load_hf_checkpoint(str(dst))
  os.remove(dst / "model.safetensors.index.json")
  with pytest.raises(FileNotFoundError, match="index.json is missing"):
    load_hf_checkpoint(str(dst))


def test_index_pointing_at_the_wrong_shard(tmp_path):
  dst = copy_fixture(tmp_path, "llama_sharded")
  with open(dst / "model.safetensors.index.json") as f:
    index = json.load(f)
  index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
  with open(dst / "model.safetensors.index.json", "w") as f:
    json.dump(index, f)
  with pytest.raises(CheckpointError, match=r"places lm_head\.weight in .*model-00001-of-00003"):
    load_hf_checkpoint(str(dst))


def test_missing_tensor(tmp_path):
  dst = copy_fixture(tmp_path)
  path = rewrite_weights(dst, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError) as e:
    load_hf_checkpoint(str(dst))
  msg = str(e.value)
  assert path in msg and "missing 1 tensor" in msg and "model.layers.1.mlp.up_proj.weight" in msg


def test_untied_checkpoint_without_lm_head(tmp_path):
  dst = copy_fixture(tmp_path)
  rewrite_weights(dst, lambda t: t.pop("lm_head.weight"))
  with pytest.raises(CheckpointError, match=r"tie_word_embeddings=False.*lm_head\.weight"):
    load_hf_checkpoint(str(dst))


def test_unexpected_tensor(tmp_path):
  dst = copy_fixture(tmp_path)
  path = rewrite_weights(dst, lambda t: t.update({
      "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32),
      "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32)}))  # the latter: ignored
  with pytest.raises(CheckpointError) as e:
    load_hf_checkpoint(str(dst))
  msg = str(e.value)
  assert path in msg and "model.layers.0.self_attn.q_proj.bias" in msg and "inv_freq" not in msg


def test_ignored_buffers_and_duplicate_tied_head(tmp_path):
  dst = copy_fixture(tmp_path, "qwen2")
  rewrite_weights(dst, lambda t: t.update({
      "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32),
      "lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  cfg, params = load_hf_checkpoint(str(dst))
  assert cfg.tie_word_embeddings and "lm_head" not in params


def test_wrong_shape(tmp_path):
  dst = copy_fixture(tmp_path)
  path = rewrite_weights(dst, lambda t: t.update(
      {"model.layers.0.self_attn.k_proj.weight": np.zeros((48, 32), np.float32)}))
  with pytest.raises(CheckpointError) as e:
    load_hf_checkpoint(str(dst))
  msg = str(e.value)
  assert "model.layers.0.self_attn.k_proj.weight" in msg and path in msg
  assert "(48, 32)" in msg and "(32, 32)" in msg and "num_key_value_heads=2" in msg


def test_wrong_family(tmp_path):
  dst = copy_fixture(tmp_path)
  with open(dst / "config.json") as f:
    hf = json.load(f)
  hf["model_type"] = "gpt2"
  with open(dst / "config.json", "w") as f:
    json.dump(hf, f)
  with pytest.raises(CheckpointError) as e:
    load_hf_checkpoint(str(dst))
  msg = str(e.value)
  assert "model_type='gpt2'" in msg and "llama, qwen2, qwen3, olmo2" in msg and "config.json" in msg


def test_export_errors(loaded, tmp_path):
  cfg, params = loaded["qwen3"]
  params = stacking.unstack_layers(params)  # export takes per-layer trees as well as stacked
  broken = jax.tree.map(lambda x: x, params)
  del broken["layers_1"]["self_attn"]["k_norm"]
  with pytest.raises(CheckpointError, match=r"params lack layers_1/self_attn/k_norm/scale"):
    export_hf_checkpoint(broken, cfg, str(tmp_path / "a"))
  broken = jax.tree.map(lambda x: x, params)
  broken["norm"]["scale"] = np.zeros(31, np.float32)
  with pytest.raises(CheckpointError, match=r"norm/scale has shape \(31,\), expected \(32,\)"):
    export_hf_checkpoint(broken, cfg, str(tmp_path / "b"))
  extra = jax.tree.map(lambda x: x, params)
  extra["layers_0"]["router"] = {"kernel": np.zeros((32, 4), np.float32)}
  with pytest.raises(CheckpointError, match=r"layers_0/router/kernel.*ignore_extra=True"):
    export_hf_checkpoint(extra, cfg, str(tmp_path / "c"))
  export_hf_checkpoint(extra, cfg, str(tmp_path / "c"), ignore_extra=True)
  assert_trees_equal(stacking.unstack_layers(load_hf_checkpoint(str(tmp_path / "c"))[1]), params)
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_config_from_modelconfig_round_trip():
  cfg = ModelConfig(family="llama", rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                  ("low_freq_factor", 1.0),
                                                  ("original_max_position_embeddings", 32)))
  assert ModelConfig.from_hf_config(convert.normalize_hf_config(cfg.to_hf_config())) == cfg


def test_export_keeps_other_keys_of_a_base_config(loaded, tmp_path):
  cfg, params = loaded["olmo2"]
  base = convert.read_hf_config(fixture("olmo2"))
  export_hf_checkpoint(params, cfg, str(tmp_path), base_hf_config=base)
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  assert hf["eos_token_id"] == 1 and hf["max_position_embeddings"] == 256
  assert "rope_parameters" not in hf and hf["rope_theta"] == 500000.0 and "rope_scaling" not in hf
  assert hf["torch_dtype"] == hf["dtype"] == "float32"
  assert load_hf_checkpoint(str(tmp_path))[0] == cfg
