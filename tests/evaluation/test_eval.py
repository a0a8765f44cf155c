"""Evaluation: perplexity at several context lengths + exact match, JSON + markdown, eval.py."""
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import PY, ROOT, subprocess_env, tiny
from condattn_jax import evaluation
from condattn_jax.train import loop
from condattn_jax.train.step import exact_match_counts

STEPS = 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("evalrun"))
  c = tiny(f"steps={STEPS},layers=1")  # one layer: nothing here depends on depth
  c.eval.at_end = True
  c.eval.context_lengths = (64, 128)
  c.eval.num_batches = 2
  c.train.eval_every = 10
  r = loop.run(c, wd, devices=jax.devices()[:1])  # nothing here is about sharding
  return wd, c, r


def test_run_writes_eval_at_end(trained):
  wd, c, r = trained
  res = r["eval"]["results"]
  assert sorted(res) == [64, 128]
  for L, m in res.items():
    assert np.isclose(m["ppl"], np.exp(m["ce"]))
    assert 0 <= m["token_acc"] <= 1 and 0 <= m["exact_match"] <= 1
    assert m["tokens"] == 2 * 16 * 8  # 2 batches x 16 rows x 8 MQAR answers
    assert m["seqs"] == 32
  j = json.load(open(os.path.join(wd, "eval", f"eval_step{STEPS}.json")))
  assert j["step"] == STEPS and set(j["results"]) == {"64", "128"}
  md = open(os.path.join(wd, "eval", f"eval_step{STEPS}.md")).read()
  assert "| context length | ppl |" in md and "\n| 128 |" in md
  logged = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [rec["step"] for rec in logged if "eval/L128/ppl" in rec] == [10, STEPS]  # eval_every
  assert os.path.isdir(os.path.join(wd, "tb"))


def test_evaluate_checkpoint_reproduces_run_eval(trained, tmp_path):
  wd, c, r = trained
  res = loop.evaluate_checkpoint(c, wd, out_dir=str(tmp_path))
  assert res["step"] == STEPS
  for L in (64, 128):
    for k in ("ce", "token_acc", "exact_match"):
      np.testing.assert_allclose(res["results"][L][k], r["eval"]["results"][L][k], rtol=1e-6)
  assert os.path.exists(tmp_path / f"eval_step{STEPS}.md")


def test_eval_cli_uses_config_saved_with_checkpoint(trained, tmp_path):
  wd, _, r = trained
  p = subprocess.run([PY, "eval.py", f"--checkpoint={wd}/checkpoints/{STEPS}",
                      f"--out_dir={tmp_path}"],
                     cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=180)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "| context length |" in p.stdout
  j = json.load(open(tmp_path / f"eval_step{STEPS}.json"))
  np.testing.assert_allclose(j["results"]["64"]["ce"], r["eval"]["results"][64]["ce"], rtol=1e-5)


def test_exact_match_counts():
  correct = jnp.array([[1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]], jnp.float32)
  mask = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
  ok, n = exact_match_counts(correct, mask)
  assert (float(ok), float(n)) == (1.0, 2.0)


def test_markdown_table_with_per_layer_metrics():
  res = {"step": 7, "results": {128: dict(ce=1.0, ppl=np.e, token_acc=0.5, exact_match=0.25,
                                          tokens=10, **{"aux/sparsity": [0.2, 0.4]})}}
  md = evaluation.markdown_table(res, "t")
  assert "| context length | ppl | CE | token acc | exact match | scored tokens | sparsity |" in md
  assert "| 128 | 2.718 | 1.0000 | 0.500 | 0.250 | 10 | 0.3000 |" in md


def test_eval_files_record_knobs_and_never_overwrite_other_knobs(tmp_path):
  res = {"step": 5, "results": {64: dict(ce=1.0, ppl=np.e, token_acc=0.5, exact_match=0.25,
                                         tokens=10)}}
  run = {"model.scheme": {"name": "l2a", "theta": 0.5}, "eval": {"num_batches": 4}}
  knobs = lambda **kw: {"model.scheme": {**run["model.scheme"], **kw}, "eval": run["eval"]}
  jp, _ = evaluation.write_results({**res, "knobs": knobs()}, str(tmp_path), reference_knobs=run)
  assert os.path.basename(jp) == "eval_step5.json"
  jp2, _ = evaluation.write_results({**res, "knobs": knobs(theta=0.7)}, str(tmp_path),
                                    reference_knobs=run)
  assert os.path.basename(jp2) == "eval_step5_theta=0.7.json"
  assert json.load(open(jp2))["knobs"]["model.scheme"]["theta"] == 0.7
  assert json.load(open(jp))["knobs"]["model.scheme"]["theta"] == 0.5  # untouched
  # no reference (e.g. --init): an existing file with other knobs is kept, a hash tells them apart
  jp3, _ = evaluation.write_results({**res, "knobs": knobs(theta=0.9)}, str(tmp_path))
  assert os.path.basename(jp3).startswith("eval_step5_") and jp3 not in (jp, jp2)
  # the same knobs again: the same file
  assert evaluation.write_results({**res, "knobs": knobs()}, str(tmp_path))[0] == jp
