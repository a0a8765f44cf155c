"""configs/elastic_qwen.py: the paper's recipe numbers (frozen backbone, router lr 5e-4, lambda
ascent group, 300 steps at 64K, targets 0.7 / 1.0), variants, required fields, and the tiny CPU
variant through train.loop.run: only the router and the multipliers are trained (labels), lambda1
falls while Omega is below the target (signed Lagrangian), the router's FA probability falls and Omega rises toward the target."""
import json

import jax
import numpy as np
import pytest

from _train_helpers import recipe_loader
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop
from condattn_jax.train import optimizer as opt_lib

recipe = recipe_loader("elastic_qwen.py")


def test_paper_recipe_and_variants():
  c = recipe()
  m, s, t, d = c.model, c.model.scheme, c.train, c.data
  assert (m.family, m.dtype, s.name, s.modes, s.pooling) == (
      "qwen3", "bfloat16", "elastic", "fa_ssa", "boundary")
  assert (s.boundary, s.sinks, s.local, s.block, s.xa_stride, s.xa_threshold) == (
      100, 128, 2048, 128, 16, 0.9)
  assert (s.tau_start, s.tau_end, s.anneal_steps, s.tau_schedule) == (1.5, 1.0, 180, "cosine")
  assert (t.num_steps, d.seq_len, t.lr, t.b1, t.b2, t.grad_clip) == (300, 65536, 5e-4, 0.9, 0.95,
                                                                      5.0)
  # paper Table 8: warmup 0.2 + cosine, weight decay 0.1, global batch 48; eq. 8 signed
  assert (t.warmup_frac, t.lr_schedule, t.end_lr_frac, t.weight_decay, d.batch_size) == (
      0.2, "cosine", 0.0, 0.1, 48)
  assert s.lagrangian == "signed" and recipe("lagrangian=abs").model.scheme.lagrangian == "abs"
  assert s.lambda_init_max == 0.0 and recipe("lam_init=0.5").model.scheme.lambda_init_max == 0.5
  # real data: prompt / answer records, one document per row, CE on the answers, the router
  # pooling the prompt the batches report
  assert (d.prompt_field, d.answer_field, d.loss_on, d.packing, s.prompt_field) == (
      "prompt", "answer", "answer", "one_per_row", "prompt_lengths")
  c.model.init_from, c.data.paths, c.data.tokenizer = "/ckpt", "/data/*.jsonl", "/ckpt"
  config_lib.validate_config(c, needs_data=False)
  c.data.packing = "first_fit"  # several documents, one decision: refused in one line
  with pytest.raises(ValueError, match=r"data.prompt_field='prompt' needs data.packing="
                                       r"'one_per_row'.*'first_fit' packs several documents"):
    config_lib.validate_config(c, needs_data=False)
  c.data.prompt_field = c.data.answer_field = None  # task rows of plain text: still refused
  c.data.loss_on = "all"
  with pytest.raises(ValueError, match=r"config.data.packing='first_fit' packs several documents "
                                       r"in a row, but scheme 'elastic' runs a row as one"):
    config_lib.validate_config(c, needs_data=False)
  assert dict(zip(s.task_names, s.targets)) == {"qa": 0.7, "summarization": 1.0, "code": 1.0,
                                                "in_context_learning": 1.0}
  g = t.param_groups.lagrange
  assert (g.regex, g.get("maximize"), g.lr, g.weight_decay) == ("scheme/lagrange", None, 1e-3,
                                                                0.1)
  # the ascent is the scheme's declaration, not the recipe's (a recipe cannot forget it)
  from condattn_jax.attention import get_scheme
  assert get_scheme("elastic").ascent_params == ("scheme/lagrange",)
  labels = opt_lib.param_labels(
      {"layers": {"router": {"task_fc1": {"kernel": np.zeros((2, 2))}},
                  "self_attn": {"q_proj": {"kernel": np.zeros((2, 2))}}},
       "scheme": {"lagrange": np.zeros((2, 4))}, "embed_tokens": {"embedding": np.zeros((2, 2))}},
      t)
  assert labels["layers"]["router"]["task_fc1"]["kernel"] == "default"
  assert labels["layers"]["self_attn"]["q_proj"]["kernel"] == "frozen"
  assert labels["embed_tokens"]["embedding"] == "frozen"
  assert labels["scheme"]["lagrange"] == "lagrange"
  for variant, family in (("qwen3-8b", "qwen3"), ("llama3.1-8b", "llama")):
    v = recipe(f"{variant},modes=fa_xa,t_sensitive=0.5")
    assert v.model.family == family and v.model.scheme.modes == "fa_xa"
    assert v.model.scheme.targets[0] == 0.5
  mc, _ = config_lib.model_config(recipe("tiny"))
  assert mc.scheme == "elastic" and mc.family == "qwen3"
  with pytest.raises(ValueError, match="unknown"):
    recipe("qwen3-4b,bogus=1")
  with pytest.raises(ValueError, match=r"model.init_from=.*data.paths=.*data.tokenizer="):
    config_lib.validate_config(recipe("qwen3-4b,steps=2,seq=64,batch=8"))


def test_tiny_run_moves_omega_toward_the_target(tmp_path):
  """40 steps (target 0.7, router init N(0, 0.02): p_FA ~ 0.5, Omega ~ 0.55; lambdas init 0).
  Signed Lagrangian (paper eq. 8): the ascent lowers lambda1 while Omega < t (its term then pulls
  Omega up) and raises lambda2; under 'abs' lambda1 would grow here too (the old test's
  'lambda grows' held whatever Omega did). Measured on CPU: p_FA 0.50 -> 0.29, Omega 0.55
  (steps 5-15) -> 0.61 (steps 30-40), lambda1 0 -> -0.033, lambda2 0 -> 0.034."""
  c = recipe("tiny,steps=40")
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.num_batches = 1
  c.eval.at_end = False
  # one device: the checks are about learning, not sharding
  res = loop.run(c, str(tmp_path), devices=jax.devices()[:1])
  assert res["step"] == 40 and not res["stopped_early"] and np.isfinite(res["train"]["loss"])
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [r for r in rows if "train/elastic/omega_msr" in r]
  assert len(train) == 8
  p_fa = [r["train/elastic/p_fa/mean"] for r in train]
  lam1 = np.asarray([r["train/elastic/lambda1"] for r in train])
  lam2 = np.asarray([r["train/elastic/lambda2"] for r in train])
  omega = [r["train/elastic/omega_msr"] for r in train]
  below = np.asarray(omega[:-1]) < 0.7                   # rows before the last: below target
  assert below.all(), omega
  assert (np.diff(lam1, axis=0) < 0).all(), lam1         # so lambda1 falls (signed) ...
  assert (np.diff(lam2, axis=0) > 0).all(), lam2         # ... and lambda2 grows
  assert p_fa[-1] < p_fa[0] - 0.1, p_fa
  assert np.mean(omega[-3:]) > np.mean(omega[:3]) + 0.05, omega
  assert train[-1]["train/elastic/tau"] == 1.0 and train[0]["train/elastic/tau"] > 1.4
