"""bench/aha_sparse_vs_exact.py at tiny CPU shapes: the routing pattern it calibrates has the
asked usage (long-tailed over heads), the exact and sparse rows compute the same CE, every row is
timed and the speedups are derived from rows of the same run."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import aha_sparse_vs_exact as bench  # noqa: E402


def test_head_usages_long_tailed_with_mean_p():
  for p in (0.05, 0.12, 0.5, 0.9):
    u = bench.head_usages(p, 3, 16)
    assert u.shape == (3, 16) and (u >= 0).all() and (u <= 1).all()
    np.testing.assert_allclose(u.mean(axis=1), p, rtol=1e-9)
    s = np.sort(u[0])[::-1]
    if p <= 0.12:
      assert s[:3].sum() > 0.5 * s.sum()  # a few heavy heads carry most of the usage


def test_tiny_run_rows_and_calibration():
  s = bench.Settings(preset="tiny", T=64, layers=2, window=8, usages=(0.1, 0.5), reps=1,
                     loss_chunk=32)
  res = bench.run(s, log=lambda *_: None)
  rows = {r["name"]: r for r in res["rows"]}
  assert set(rows) == {"dense", "exact_u0.1", "sparse_u0.1", "exact_u0.5", "sparse_u0.5"}
  for p in (0.1, 0.5):
    ex, sp = rows[f"exact_u{p}"], rows[f"sparse_u{p}"]
    assert abs(ex["mu_f"] - p) < 0.05 and abs(sp["mu_f"] - p) < 0.05, (p, ex["mu_f"])
    assert sp["ce_first"] == pytest.approx(ex["ce_first"], abs=1e-4)
    assert sp["speedup_vs_exact"] == pytest.approx(ex["train_ms"] / sp["train_ms"])
    assert all(r["train_ms"] > 0 for r in (ex, sp))
  assert res["jax_version"] and res["date"] and res["device"]
