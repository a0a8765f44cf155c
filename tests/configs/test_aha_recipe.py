"""configs/aha_olmo.py: the paper's recipe numbers, required fields, the HF OLMo-2 checkpoint
converted through the run loop reproducing the transformers logits at step 0, and the tiny CPU
variant training: the loss falls and the router learns (usage leaves 1.0, differs by layer)."""
import json
import os

import jax
import numpy as np
import pytest

import _programs
from _train_helpers import HF, recipe_loader
from condattn_jax.models import stacking
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop
from condattn_jax.train import optimizer as opt_lib

recipe = recipe_loader("aha_olmo.py")


def test_paper_recipe_and_variants():
  c = recipe()
  m, s, t, d = c.model, c.model.scheme, c.train, c.data
  assert (m.family, m.dtype, m.param_dtype) == ("olmo2", "bfloat16", "float32")
  assert (s.name, s.window, s.tau, s.lam, s.mode, s.router_bias_init) == (
      "aha", 128, 0.5, 3e-4, "exact", 2.0)
  assert (t.lr, t.b1, t.b2, t.warmup_frac, t.lr_schedule, t.weight_decay) == (
      3e-5, 0.9, 0.95, 0.03, "linear", 0.0)
  assert d.batch_size == 128 and t.trainable_regex is None
  assert s.router_bias is True
  # router lr multiplier (default 100): a param group over every layer's router at lr x mult
  v = c
  g = v.train.param_groups.router
  assert g.lr == pytest.approx(3e-3)
  assert "router" not in recipe("router_lr_mult=1").train.param_groups  # the paper's one lr
  labels = opt_lib.param_labels(
      {"layers": {"router": {"kernel": np.zeros((2, 2)), "bias": np.zeros(2)},
                  "self_attn": {"q_proj": {"kernel": np.zeros((2, 2))}}}}, v.train)
  assert labels["layers"]["router"]["kernel"] == labels["layers"]["router"]["bias"] == "router"
  assert labels["layers"]["self_attn"]["q_proj"]["kernel"] == "default"
  nb = recipe("router_bias=False").model.scheme
  assert (nb.router_bias, nb.router_bias_init) == (False, 0.0)  # the paper's eq. 1
  assert t.num_steps == -(-939_344 // 128)  # one epoch of Tulu-3 SFT at 128 rows a step
  for variant, family in (("qwen2.5-1.5b", "qwen2"), ("qwen3-1.7b", "qwen3"),
                          ("llama3.2-1b", "llama")):
    v = recipe(f"{variant},window=256,lam=1e-3,mode=sparse")
    assert v.model.family == family
    assert (v.model.scheme.window, v.model.scheme.lam, v.model.scheme.mode) == (256, 1e-3, "sparse")
  mc, _ = config_lib.model_config(recipe("tiny"))
  assert mc.scheme == "aha" and mc.post_norm and mc.family == "olmo2"
  with pytest.raises(ValueError, match="unknown"):
    recipe("olmo2-1b,bogus=1")
  with pytest.raises(ValueError, match=r"model.init_from=.*data.paths=.*data.tokenizer="):
    config_lib.validate_config(recipe("olmo2-1b,steps=2,seq=64,batch=8"))


def test_olmo2_checkpoint_converted_by_the_run_loop_is_the_hf_model():
  """init_from -> scheme 'aha'.from_dense: at step 0 the AHA model gives the transformers
  logits of the checkpoint (every head full: router 0, bias +2)."""
  c = recipe("olmo2-1b,steps=2,seq=16,batch=8,window=4")
  c.model.init_from = os.path.join(HF, "olmo2")
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.data.source = "mqar"
  c.data.paths = None
  c.data.task.vocab_size = 64
  c.data.task.num_pairs = 2
  setup = loop.build(c)
  params = jax.device_get(loop.init_params(setup))
  r = stacking.unstack_layers(params)["layers_0"]["router"]
  np.testing.assert_array_equal(r["kernel"], 0.0)
  np.testing.assert_array_equal(r["bias"], 2.0)
  e = np.load(os.path.join(HF, "olmo2", "expected.npz"))
  got, aux = _programs.apply(setup.model_cfg)(params, e["input_ids"])  # jitted: eagerly op by op
  np.testing.assert_allclose(got, e["logits"], atol=1e-4, rtol=0)
  np.testing.assert_array_equal(aux["usage_N"], 1.0)


def test_tiny_recipe_router_learns(tmp_path):
  """60 steps of the tiny variant (random init, every head full at step 0): the CE falls, the
  regulariser moves usage off 1.0, and it moves differently per layer (a learned decision, not a
  uniform drift). Measured on CPU: ce 4.07 -> 3.46, mu_f 1.0 -> 0.50 -> 0.55, usage per layer
  [1.0, 0.11] at step 60. Then tau, a test-time knob, changes the evaluated usage."""
  c = recipe("tiny,steps=60")
  c.train.log_every = 5
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.num_batches = 1
  one = jax.devices()[:1]  # one device: the checks are about learning, not sharding
  res = loop.run(c, str(tmp_path), devices=one)
  assert res["step"] == 60 and not res["stopped_early"] and np.isfinite(res["train"]["loss"])
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [r for r in rows if "train/aha/mu_f" in r]
  assert len(train) == 12
  first, last = train[0], train[-1]
  assert np.shape(last["train/aha/usage"]) == (c.model.num_layers, c.model.num_heads)
  assert first["train/aha/mu_f"] > 0.95  # every head starts full
  assert last["train/ce"] < first["train/ce"] - 0.3, (first["train/ce"], last["train/ce"])
  assert min(r["train/aha/mu_f"] for r in train) < 0.8
  layer = np.asarray(last["train/aha/usage_layer"])
  assert np.ptp(layer) > 0.3, layer
  ev = res["eval"]["results"][c.data.seq_len]
  c2 = recipe("tiny,steps=60,tau=0.95")
  c2.eval.num_batches = 1
  ev2 = loop.evaluate_checkpoint(c2, str(tmp_path), devices=one)["results"][c.data.seq_len]
  assert ev2["aux/aha/mu_f"] < ev["aux/aha/mu_f"] - 0.05, (ev["aux/aha/mu_f"], ev2["aux/aha/mu_f"])
