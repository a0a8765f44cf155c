"""configs/segmented_llama.py: the paper's recipe numbers (S, M, R, K, lists, lr schedule, batch 1
x accumulation 8), variants, the HF LLaMA fixture converted through the run loop == transformers
logits at S >= T, and the tiny CPU variant trained through train.loop (Scheme.forward: the
segment-major TBPTT forward) with a falling CE."""
import json
import os

import jax
import numpy as np
import pytest

import _programs
from _train_helpers import HF, recipe_loader
from condattn_jax import attention
from condattn_jax.attention import segmented as sgm
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop, optimizer

recipe = recipe_loader("segmented_llama.py")


def test_paper_recipe_and_variants():
  c = recipe()
  s, t, d = c.model.scheme, c.train, c.data
  assert (s.name, s.segment_len, s.tail_len, s.retrieve_len, s.tbptt) == (
      "segmented", 4096, 512, 512, 1)
  assert tuple(s.long_heads) == (0, 1, 2, 4, 9, 12, 14, 15, 16, 18, 19, 22, 23, 26, 29, 30)
  assert tuple(s.long_layers) == (6, 8, 11, 18)
  assert (t.lr, t.warmup_steps, t.lr_schedule, t.num_steps, t.trainable_regex) == (
      2e-5, 20, "constant", 1000, None)
  assert (d.batch_size, t.microbatches, d.seq_len) == (8, 8, 8192)  # 1 x 8; (K+1) S
  sched = optimizer.make_schedule(t)
  assert float(sched(10)) == pytest.approx(1e-5, rel=1e-6)
  assert float(sched(20)) == float(sched(999)) == pytest.approx(2e-5, rel=1e-6)
  assert c.model.family == "llama" and c.model.dtype == "bfloat16"
  assert recipe("llama2-7b-80k").model.scheme.segment_len == 4096
  assert recipe("llama2-7b-32k,tbptt=2").data.seq_len == 12288
  for variant, family in (("qwen2.5-7b", "qwen2"), ("qwen3-8b", "qwen3")):
    assert recipe(variant).model.family == family
  llama2 = ModelConfig(family="llama", num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, hidden_size=4096, vocab_size=32000)
  full_cfg = attention.configure(llama2, "segmented", **{k: v for k, v in s.to_dict().items() if k != "name"})
  assert sgm.visible_kv_length(full_cfg) == 4096 + 0.5 * 512 + (4 / 32) * 0.5 * 512  # S+aM+b(1-a)R
  mc, _ = config_lib.model_config(recipe("tiny"))
  assert mc.scheme == "segmented" and attention.options(mc).segment_len == 16
  with pytest.raises(ValueError, match=r"model.init_from=.*data.paths=.*data.tokenizer="):
    config_lib.validate_config(recipe("llama2-7b-32k,steps=2,segment=8,tail=4,retrieve=512"))


def test_llama_checkpoint_through_the_run_loop_is_the_hf_model():
  """init_from -> from_dense (identity on weights): with S >= T the model is the checkpoint."""
  c = recipe("llama2-7b-32k,steps=2,warmup=1,batch=8,accum=1,segment=64,tail=8,retrieve=512")
  c.model.init_from = os.path.join(HF, "llama")
  c.model.scheme.long_heads = (1,)
  c.model.scheme.long_layers = (1,)
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.data.source = "mqar"
  c.data.paths = None
  c.data.task.vocab_size = 64
  c.data.task.num_pairs = 2
  setup = loop.build(c)
  params = jax.device_get(loop.init_params(setup))
  e = np.load(os.path.join(HF, "llama", "expected.npz"))
  got, _ = _programs.apply(setup.model_cfg)(params, e["input_ids"])  # jitted: eagerly op by op
  np.testing.assert_allclose(got, e["logits"], atol=1e-4, rtol=0)


def test_tiny_recipe_trains_through_the_segmented_forward(tmp_path):
  """30 steps of the tiny variant (2 segments of 16 per row, K=1): the CE falls."""
  c = recipe("tiny,steps=30,batch=8")
  c.train.log_every = 5
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.num_batches = 1
  # one device: the checks are about learning, not sharding
  res = loop.run(c, str(tmp_path), devices=jax.devices()[:1])
  assert res["step"] == 30 and not res["stopped_early"] and np.isfinite(res["train"]["loss"])
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [r for r in rows if "train/ce" in r]
  assert train[-1]["train/ce"] < train[0]["train/ce"] - 0.3, (train[0]["train/ce"],
                                                              train[-1]["train/ce"])


def test_train_and_eval_steps_call_the_scheme_forward(monkeypatch):
  """forward_ce goes through Scheme.forward (the TBPTT scan), not one decoder pass."""
  import dataclasses

  import jax.numpy as jnp

  from condattn_jax import attention
  from condattn_jax.train import step as step_lib
  calls = []

  def counting(*a, **kw):
    calls.append(kw["train"])
    return sgm.forward(*a, **kw)

  monkeypatch.setitem(attention.SCHEMES, "segmented",
                      dataclasses.replace(attention.get_scheme("segmented"), forward=counting))
  mc, _ = config_lib.model_config(recipe("tiny,layers=2,width=32"))
  # shapes only (the forward below is traced by eval_shape): no eager init's op-by-op compiles
  params = jax.eval_shape(lambda: Decoder(mc).init(jax.random.PRNGKey(0),
                                                   jnp.zeros((1, 8), jnp.int32)))["params"]
  t = jnp.ones((1, 24), jnp.int32)
  batch = dict(inputs=t, targets=t, positions=None, segment_ids=t, loss_mask=t)
  ce, _, _ = jax.eval_shape(lambda p: step_lib.forward_ce(Decoder(mc), p, batch, train=True,
                                                          rng=None), params)
  assert calls == [True] and ce.shape == (1, 24)
