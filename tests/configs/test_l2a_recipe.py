"""configs/l2a_qwen.py: the recipes, required fields, trainable set, HF conversion through the run
loop, training + eval with theta as a knob, and the pruning report."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _programs
from _train_helpers import HF, recipe_loader
from condattn_jax import attention
from condattn_jax.attention import l2a
from condattn_jax.models import stacking
from condattn_jax.models.decoder import Decoder
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop
from condattn_jax.train import optimizer as opt_lib

recipe = recipe_loader("l2a_qwen.py")


def test_paper_recipes():
  c = recipe()
  m, s, t, d = c.model, c.model.scheme, c.train, c.data
  assert (m.family, m.rope_theta, m.dtype, m.param_dtype) == ("qwen2", 5e6, "bfloat16", "float32")
  assert (s.name, s.window, s.tau, s.theta, s.p_force, s.lambda_max, s.lambda_schedule) == (
      "l2a", 4096, 0.1, 0.5, 0.1, 1.3e-3, "ramp")
  assert (t.lr, t.warmup_frac, t.lr_schedule, t.grad_clip) == (5e-5, 0.05, "cosine", 1.0)
  assert d.seq_len == 131072 and d.batch_size * d.seq_len == 48 * 131072  # ~6M tokens / step
  assert abs(t.num_steps * 48 * 131072 - 25e9) < 48 * 131072  # 25B tokens
  assert s.lambda_warmup_steps == round(0.05 * t.num_steps) or s.lambda_warmup_steps == int(
      0.05 * t.num_steps)
  assert recipe("qwen2.5-1.5b").data.batch_size == 32  # 4M tokens
  q3 = recipe("qwen3-8b,steps=10,seq=4096")
  assert q3.model.family == "qwen3" and q3.train.num_steps == 10 and q3.data.seq_len == 4096
  # the lambda warmup follows a num_steps override made after get_config (command line)
  c.train.num_steps = 1000
  assert config_lib.scheme_fields(c)[1][
      [k for k, _ in config_lib.scheme_fields(c)[1]].index("lambda_warmup_steps")][1] == 50
  with pytest.raises(ValueError, match="unknown"):
    recipe("qwen2.5-7b,bogus=1")


def test_real_recipe_stops_at_once_naming_the_missing_field(tmp_path):
  c = recipe("qwen2.5-1.5b,steps=2,seq=64,batch=8")
  # every required field still unset, in the order the run needs them: the model first
  with pytest.raises(ValueError, match=r"model.init_from=.*data.paths=.*data.tokenizer="):
    config_lib.validate_config(c)
  f = tmp_path / "docs.jsonl"
  f.write_text(json.dumps({"text": "hello world"}) + "\n")
  c.data.paths = str(f)
  with pytest.raises(ValueError, match="config.model.init_from"):
    loop.build(c)
  c.model.init_from = os.path.join(HF, "qwen2")
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.model.scheme.window = 8
  loop.build(c)  # the model now builds; the tokenizer is the next field named
  from condattn_jax.data import make_train_iterator
  with pytest.raises(Exception, match="config.data.tokenizer"):
    next(make_train_iterator(c))


def test_trainable_set_is_attention_norms_router():
  c = recipe("tiny,freeze")
  mc, _ = config_lib.model_config(c)
  params = jax.eval_shape(lambda: Decoder(mc).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  labels = opt_lib.param_labels(jax.tree.map(lambda x: x, __import__("flax").linen.unbox(
      params["params"])), c.train)
  flat = {opt_lib.path_str(p): l for p, l in jax.tree_util.tree_flatten_with_path(labels)[0]}
  for path, label in flat.items():
    frozen = path.startswith(("embed_tokens", "lm_head")) or "/mlp/" in path
    assert (label == opt_lib.FROZEN) == frozen, path
  # (per-layer 'layers_0/...' or stacked 'layers/...' names: the router and global norm exist)
  for leaf in ("/router/kernel", "/global_layernorm/scale", "/global_attn/q_proj/kernel"):
    hits = [p for p in flat if p.startswith("layers") and p.endswith(leaf)]
    assert hits and all(flat[p] != opt_lib.FROZEN for p in hits), (leaf, hits)
  assert flat["norm/scale"] != opt_lib.FROZEN


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_init_from_hf_checkpoint_converts_to_l2a(family):
  """The run loop's init path (init_from -> scheme.from_dense): with the global branch off and
  w >= T the converted model reproduces the dense checkpoint's logits."""
  c = recipe("qwen2.5-1.5b,steps=2,seq=16,batch=8,window=16,routing=none")
  c.model.family = family
  c.model.init_from = os.path.join(HF, family)
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.data.source = "mqar"
  c.data.paths = None
  c.data.task.vocab_size = 64
  c.data.task.num_pairs = 2
  setup = loop.build(c)
  params = jax.device_get(loop.init_params(setup))
  layer = stacking.unstack_layers(params)["layers_0"]
  np.testing.assert_array_equal(layer["router"]["kernel"], 0.0)
  for a, b in zip(jax.tree.leaves(layer["global_attn"]), jax.tree.leaves(layer["self_attn"])):
    np.testing.assert_array_equal(a, b)
  from condattn_jax import convert
  dcfg, dparams = convert.load_hf_checkpoint(os.path.join(HF, family), dtype=np.float32)
  tok = jax.random.randint(jax.random.key(0), (2, 16), 0, dcfg.vocab_size)
  want, _ = _programs.apply(dcfg)(dparams, tok)  # jitted: eagerly op by op
  got, _ = _programs.apply(setup.model_cfg.replace(rope_theta=dcfg.rope_theta))(params, tok)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_tiny_recipe_trains_evaluates_and_prunes(tmp_path):
  c = recipe("tiny,steps=6,batch=8,seq=32,pairs=4,gap=8,window=4")
  c.train.log_every = 2
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.num_batches = 1
  # one device: the checks are about learning, not sharding (that is test_l2a_sharded.py)
  one = jax.devices()[:1]
  res = loop.run(c, str(tmp_path), devices=one)
  assert res["step"] == 6 and not res["stopped_early"] and np.isfinite(res["train"]["loss"])
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train_rows = [r for r in rows if "train/l2a/sparsity_layer_0" in r]
  assert train_rows, rows[:2]
  for k in ("train/l2a/sparsity", "train/l2a/router_p", "train/l2a/forced_frac",
            "train/l2a/sparsity_layer_1", "train/l2a/lambda"):
    assert k in train_rows[-1]
  ev = res["eval"]["results"][32]
  assert "aux/l2a/sparsity_layer_0" in ev
  # theta as a test-time knob: the checkpoint evaluated at other thresholds. An override that is
  # ignored gives the trained theta's (0.5) sparsity at every threshold.
  # (measured: sparsity 0.0 / 0.908 / 1.0 at theta 0.05 / 0.5 / 0.95)
  sp = {0.5: ev["aux/l2a/sparsity"]}
  for th in (0.05, 0.95):
    c2 = recipe("tiny,steps=6,batch=8,seq=32,pairs=4,gap=8,window=4")
    c2.model.scheme.theta = th
    c2.eval.num_batches = 1
    ev_th = loop.evaluate_checkpoint(c2, str(tmp_path), devices=one)
    sp[th] = ev_th["results"][32]["aux/l2a/sparsity"]
  assert sp[0.05] < sp[0.5] < sp[0.95], sp
  # the pruning report (script's library function), with a threshold between the two layers'
  # measured sparsities: exactly the sparser layer goes (measured: 0.863 / 0.953 -> layer 1)
  from condattn_jax.attention.l2a import report as l2a_report
  layer_sp = l2a_report.layer_sparsity(ev, 2)
  lo, hi = sorted(layer_sp)
  assert hi - lo > 0.02, layer_sp  # else no threshold separates them: the check would be void
  sparser = int(np.argmax(layer_sp))
  setup, params, step = loop.load_params(c, str(tmp_path), devices=one)
  assert l2a.prune(params, setup.model_cfg, layer_sp, hi + 1e-3)[2] == ()  # above both: none
  rep = l2a_report.prune_and_evaluate(c, params, setup.model_cfg, setup.mesh,
                                      threshold=(lo + hi) / 2, context_len=4096)
  r = rep["report"]
  np.testing.assert_allclose(r["layer_sparsity"], layer_sp, atol=1e-6)  # same held-out data
  assert r["pruned_layers"] == [sparser] and r["newly_pruned"] == [sparser], r["pruned_layers"]
  assert attention.options(rep["config"]).pruned_layers == (sparser,)
  per_layer = stacking.unstack_layers(jax.device_get(rep["params"]), 2)
  assert "global_attn" not in per_layer[f"layers_{sparser}"]
  assert "router" not in per_layer[f"layers_{sparser}"]
  assert "global_attn" in per_layer[f"layers_{1 - sparser}"]
  per_tok = 2 * 2 * 16 * 4  # K, V x kv heads x head_dim x float32
  assert r["kv_bytes_dense_base"] == 2 * 4096 * per_tok
  assert r["kv_bytes_before"] == 2 * (4096 + 4) * per_tok  # window ring + full cache per layer
  assert r["kv_bytes_after"] == ((4096 + 4) + 4) * per_tok  # the pruned layer keeps the ring only
  jp, mp = l2a_report.write(r, str(tmp_path / "eval"))
  assert "L2A pruning" in open(mp).read()
  assert os.path.getsize(tmp_path / "eval" / "l2a_prune_layers.png") > 0
