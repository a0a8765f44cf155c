"""bench/e2e.py kept working on CPU (its core at tiny shapes, T=64: the rows at one layer, the
sanity check at TINY's two) and its recorded GPU results checked for fields and self-consistency
(speedups = ratios of the file's own ms)."""
from __future__ import annotations

import copy
import math

import jax
import pytest

from bench import e2e

TINY_1L = dict(e2e.TINY, num_layers=1)


@pytest.fixture(scope="module")
def tiny_rows():
  """dense and L2A q=0.2 rows of the real per-row code path, tiny model at one layer (a row
  measures phases: nothing in it depends on depth; its compiles grow with it), one CPU device."""
  rows = [e2e.run_row(64, s, shapes=TINY_1L, reps=1, decode_steps=1, window=16,
                      forward=(s != "dense"), devices=jax.devices()[:1])
          for s in ("dense", "l2a_q0.2")]
  e2e.add_speedups(rows)
  return rows


def _doc(rows):
  return dict(device="cpu", jax_version=jax.__version__, date="2026-01-01T00:00:00+00:00",
              layers=TINY_1L["num_layers"], rows=copy.deepcopy(rows))


def test_rows_measure_every_phase(tiny_rows):
  dense, l2a = tiny_rows
  for r in tiny_rows:
    assert r["status"] == "ok", r.get("traceback")
    assert r["layers"] == 1 and r["T"] == 64
    for k in ("compile_s", "train_ms", "prefill_ms", "decode_ms", "init_s"):
      assert r[k] > 0 and math.isfinite(r[k]), k
    assert r["loss_finite"] and r["prefill_logits_finite"] and r["decode_logits_finite"]
    assert len(r["train_ms_all"]) == 1 and len(r["decode_ms_all"]) == 1
  # the L2A row really routes ~20% of its tokens global (64 draws: 0.8 +- 0.05)
  assert 0.65 < l2a["sparsity"] < 0.95
  assert "sparsity" not in dense
  assert l2a["forward_ms"] > 0 and "forward_ms" not in dense  # the optional cache-free forward
  # L2A keeps a window ring beside the full global cache: more bytes than dense, unpruned
  assert l2a["kv_cache_bytes"] > dense["kv_cache_bytes"]
  assert l2a["routing"] == "bernoulli" and l2a["bernoulli_q"] == 0.2 and l2a["p_force"] == 0.1
  assert dense["speedup_train"] == 1.0
  assert l2a["speedup_train"] == pytest.approx(dense["train_ms"] / l2a["train_ms"])
  assert l2a["speedup_prefill"] == pytest.approx(dense["prefill_ms"] / l2a["prefill_ms"])


def test_check_results_accepts_consistent_and_names_each_break(tiny_rows):
  e2e.check_results(_doc(tiny_rows))
  bad = _doc(tiny_rows)
  bad["rows"][1]["speedup_train"] *= 1.1
  with pytest.raises(ValueError, match="speedup_train"):
    e2e.check_results(bad)
  bad = _doc(tiny_rows)
  del bad["rows"][0]["prefill_ms"]
  with pytest.raises(ValueError, match="prefill_ms"):
    e2e.check_results(bad)
  bad = _doc(tiny_rows)
  bad["rows"] = [r for r in bad["rows"] if r["scheme"] != "dense"]  # a speedup without its baseline
  with pytest.raises(ValueError, match="without both ms"):
    e2e.check_results(bad)
  bad = _doc(tiny_rows)
  del bad["jax_version"]
  with pytest.raises(ValueError, match="jax_version"):
    e2e.check_results(bad)


def test_pforce_expectation_is_checked(tiny_rows):
  full = dict(tiny_rows[1], scheme="l2a_all", train_ms=2 * tiny_rows[1]["train_ms"])
  doc = _doc(list(tiny_rows) + [full])
  e2e.add_speedups(doc["rows"])
  q = doc["rows"][1]
  assert q["train_ms_pforce"] == pytest.approx(0.9 * q["train_ms"] + 0.1 * full["train_ms"])
  e2e.check_results(doc)
  q["speedup_train_pforce"] *= 0.9
  with pytest.raises(ValueError, match="speedup_train_pforce"):
    e2e.check_results(doc)


def test_sanity_check_passes_at_tiny_shapes():
  """The GPU run's first step, on CPU in fp32: L2A (routing all, window 0) == dense, the engine's
  prefill / decode logits == the cache-free forward's."""
  out = e2e.sanity(shapes=e2e.TINY, T=64, window=16, dtype="float32", tol=1e-4)
  assert out["ok"], out
  assert out["engine_decode_vs_forward_l2a_q0.2"] <= 1e-4


def test_merge_keeps_speedups_within_each_run(tiny_rows):
  """Runs of one device merged (one command per T): a row's speedup uses its own run's dense."""
  a = _doc(tiny_rows)
  b = _doc(tiny_rows)
  b["date"] = "2026-01-02T00:00:00+00:00"
  b["rows"][0]["train_ms"] *= 3  # run b's dense is slower: its L2A speedup must use it
  e2e.add_speedups(b["rows"])
  merged = e2e.merge_results([a, b])
  assert len(merged["rows"]) == 4 and len(merged["runs"]) == 2
  by_run = {(r["run_date"], r["scheme"]): r for r in merged["rows"]}
  for d in (a, b):
    dense, l2a = by_run[(d["date"], "dense")], by_run[(d["date"], "l2a_q0.2")]
    assert l2a["speedup_train"] == pytest.approx(dense["train_ms"] / l2a["train_ms"])
  assert by_run[(b["date"], "l2a_q0.2")]["speedup_train"] == pytest.approx(
      3 * by_run[(a["date"], "l2a_q0.2")]["speedup_train"])
  other = _doc(tiny_rows)
  other["device"] = "another device"
  with pytest.raises(ValueError, match="keep them apart"):
    e2e.merge_results([a, other])
