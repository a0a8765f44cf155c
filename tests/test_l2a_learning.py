"""L2A learning on MQAR, CPU-sized (bench/l2a_learning.py --preset=cpu), and the recorded full run.

The dense model (tests/fixtures/l2a/mqar_dense.npz) is the tiny decoder that
`python bench/l2a_learning.py --preset=full --save_dense=...` trains with full attention on MQAR
(T=32, 4 pairs, every query > 8 tokens after every pair). The CPU test converts it to L2A with
window 4 (local attention alone cannot answer), trains the L2A recipe for 1200 steps (attention +
norms + router; FFN and embeddings frozen) and the paper's context-free baseline (Bernoulli routing
at the L2A model's global fraction) for as many, and checks the direction of the paper's claims:
high sparsity, and far better accuracy than context-free routing at that sparsity.
Conversion at w >= 1 damages this tiny model (local + global add up: ~8% accuracy at step 0), so
L2A first re-learns the recall circuit, which takes ~4000 steps; within 1200 CPU-sized steps it is
still below the dense accuracy. The full run (16000 L2A steps) is where it meets the dense
accuracy, and `test_recorded_full_run` checks the result committed from it.
"""
import json
import os

import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "l2a", "mqar_dense.npz")
RESULT = os.path.join(ROOT, "bench", "results", "l2a_learning.json")
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def _stacked_fixture(bench, s, tmp_path):
  """The dense fixture (per-layer npz) in the Decoder's layout, as an npz run_experiment loads."""
  from condattn_jax.models import stacking
  dense = stacking.to_model_layout(bench.load_params(FIXTURE), bench.base_config(s))
  path = str(tmp_path / "mqar_dense_stacked.npz")
  bench.save_params(dense, path)
  return dense, path


@pytest.mark.slow
def test_l2a_learns_recall_cpu_sized(tmp_path):
  """The CPU preset of bench/l2a_learning.py, run here: every number below is measured in this
  test (the dense model is the fixture; conversion, both training phases and evals run here)."""
  from bench import l2a_learning as bench
  from condattn_jax.attention import l2a
  s = bench.PRESETS["cpu"]
  dense, path = _stacked_fixture(bench, s, tmp_path)
  # right after the conversion (window 4, both branches copied, zero router: every token global)
  # the local + global sum has broken the recall circuit: what L2A reaches below is learned here
  lcfg, lp = l2a.dense_to_l2a(dense, bench.base_config(s), **bench.l2a_options(s))
  at_conversion = bench.evaluate(lcfg, lp, bench.Data(s))
  res = bench.run_experiment(s, log=lambda m: None, dense_params=path)
  summary = {k: res[k] for k in ("dense_accuracy", "l2a_accuracy", "l2a_sparsity",
                                  "l2a_layer_sparsity", "context_free_accuracy",
                                  "context_free_sparsity")}
  summary["accuracy_at_conversion"] = at_conversion["accuracy"]
  assert res["dense_accuracy"] > 0.95, summary
  assert at_conversion["accuracy"] < 0.2 and at_conversion["sparsity"] == 0.0, summary
  # the router learned to skip global attention for most tokens ...
  assert res["l2a_sparsity"] >= 0.65, summary
  # ... where it is not needed: well above the context-free router at the same sparsity
  # (measured: CPU L2A 0.413 vs context-free 0.322 at sparsity 0.73, 2048 scored answers;
  #  H200, 3 seeds: L2A 0.453 / 0.456 / 0.455 vs 0.328 / 0.332 / 0.311)
  assert abs(res["context_free_sparsity"] - res["l2a_sparsity"]) < 0.05, summary
  assert res["l2a_accuracy"] >= res["context_free_accuracy"] + 0.05, summary
  assert res["l2a_accuracy"] >= 0.35, summary
  # the pruning section: layers at sparsity >= 0.95 lose their full cache (K, V x 2 kv heads x
  # head_dim 16 x float32 per token and layer; every layer keeps its window ring of 4 slots)
  pr = res["pruning"]
  assert pr["pruned_layers"] == [i for i, x in enumerate(res["l2a_layer_sparsity"]) if x >= 0.95]
  per_tok, ctx, L = 2 * 2 * 16 * 4, 131072, s.num_layers
  kv = pr["kv_bytes"][str(ctx)]
  assert kv["dense"] == L * ctx * per_tok
  assert kv["l2a"] == L * (ctx + s.window) * per_tok
  assert kv["l2a_pruned"] == (L * s.window + (L - len(pr["pruned_layers"])) * ctx) * per_tok


def test_recorded_full_run():
  """bench/results/l2a_learning.json (the full run) holds the issue's evidence."""
  with open(RESULT) as f:
    r = json.load(f)
  for k in ("dense_accuracy", "l2a_accuracy", "l2a_sparsity", "context_free_accuracy",
            "l2a_layer_sparsity", "task", "date", "settings"):
    assert k in r, k
  assert r["task"]["seq_len"] >= 4 * r["settings"]["window"]  # window much shorter than T
  assert r["l2a_accuracy"] >= r["dense_accuracy"] - 0.02
  assert r["l2a_sparsity"] >= 0.70
  assert r["l2a_accuracy"] >= r["context_free_accuracy"] + 0.1
  assert abs(r["context_free_sparsity"] - r["l2a_sparsity"]) < 0.05
