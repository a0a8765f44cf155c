"""bench/aha_window_sweep.py: the synthetic task is what it claims (every scored query's fact sits
`distance` tokens back, distances log-uniform: a long tail), and the recorded sweep
(bench/results/aha_window_sweep.json) holds the issue's evidence: full-attention usage falling as
the window grows at accuracy within 2 points of the dense model."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from bench import aha_window_sweep as sweep  # noqa: E402

RESULT = os.path.join(ROOT, "bench", "results", "aha_window_sweep.json")


def test_fused_recall_rows_and_long_tailed_distances():
  s = sweep.Settings(seq_len=256, num_queries=8)
  task = sweep.FusedRecall(s)
  b = task.batch(0, 200, stream=1)
  K, V = s.num_keys, s.num_values
  rows, ts = np.nonzero(b["loss_mask"])
  assert len(rows) == 200 * s.num_queries  # every query scored, nothing else
  d = b["distance"][rows, ts]
  fact = b["inputs"][rows, ts - d]
  k = b["inputs"][rows, ts] - task.query0
  v = b["targets"][rows, ts] - task.answer0
  assert ((k >= 0) & (k < K) & (v >= 0) & (v < V)).all()
  np.testing.assert_array_equal(fact, 1 + k * V + v)  # the fact of the query's key, d back
  # keys are distinct within a row, so the fact is the only token answering the query
  for r in range(5):
    ks = b["inputs"][r][b["loss_mask"][r] > 0]
    assert len(set(ks.tolist())) == s.num_queries
  # log-uniform distances: the fraction beyond w falls like 1 - log(w) / log(T - 2)
  for w in (16, 32, 64, 128):
    want = 1 - np.log(w) / np.log(s.seq_len - 2)
    assert abs((d >= w).mean() - want) < 0.05, (w, (d >= w).mean(), want)
  assert b["inputs"].max() < task.vocab_size
  # a pure function of (seed, stream, index)
  np.testing.assert_array_equal(task.batch(3, 2, 1)["inputs"], b["inputs"][3:5])



def test_recorded_sweep():
  """bench/results/aha_window_sweep.json (CPU preset, fused recall at T=256): at every window the
  AHA model stays within 2 points of the dense model's accuracy while running full attention for
  a small fraction of (token, head) pairs, and at the query tokens (where the long-range need is)
  the full-attention usage falls as the window grows. Overall mu_f is NOT monotone here (it is
  dominated by a small off-query baseline): recorded as is, see the issue's closing note."""
  doc = common.read_result(RESULT)
  assert doc["date"] and doc["jax_version"] and doc["task"]["distance"].startswith("log-uniform")
  ws = sorted(int(w) for w in doc["per_window"])
  assert ws == [16, 32, 64, 128], ws
  dense = doc["dense_accuracy"]
  assert dense >= 0.98
  at_q = []
  for w in ws:
    r = doc["per_window"][str(w)]
    assert r["accuracy"] >= dense - 0.02, (w, r["accuracy"], dense)
    assert r["mu_f"] < 0.05, (w, r["mu_f"])
    # the window alone loses the facts beyond it: routing buys the accuracy
    assert r["local_only_accuracy_at_conversion"] <= r["accuracy"] - 0.1, w
    at_q.append(r["usage_at_queries"])
  assert all(a > b for a, b in zip(at_q, at_q[1:])), at_q


def test_recorded_sweep_with_observable_distance():
  """bench/results/aha_window_sweep_hint.json ('cpu_hint': the query token carries its distance
  bucket, so the router can see the need): full-attention usage falls as the window grows, at
  every window within 2 points of the dense model's accuracy (the paper's long-tail finding)."""
  doc = common.read_result(os.path.join(ROOT, "bench", "results", "aha_window_sweep_hint.json"))
  assert doc["settings"]["distance_hint"] is True and doc["preset"] == "cpu_hint"
  ws = sorted(int(w) for w in doc["per_window"])
  assert ws == [16, 32, 64, 128], ws
  dense = doc["dense_accuracy"]
  assert dense >= 0.98
  mu = [doc["per_window"][str(w)]["mu_f"] for w in ws]
  for w in ws:
    r = doc["per_window"][str(w)]
    assert r["accuracy"] >= dense - 0.02, (w, r["accuracy"], dense)
    assert r["local_only_accuracy_at_conversion"] <= r["accuracy"] - 0.1, w
  assert all(a > b for a, b in zip(mu, mu[1:])), mu
  assert mu[-1] < 0.5 * mu[0], mu  # a long tail: 8x the window, under half the usage


def test_distance_hint_tokens_carry_the_bucket():
  s = sweep.Settings(seq_len=256, num_keys=16, num_queries=16, distance_hint=True)
  task = sweep.FusedRecall(s)
  b = task.batch(0, 50, stream=1)
  rows, ts = np.nonzero(b["loss_mask"])
  code = b["inputs"][rows, ts] - task.query0
  d = b["distance"][rows, ts]
  np.testing.assert_array_equal(code % task.buckets, np.floor(np.log2(d)).astype(int))
  fact = b["inputs"][rows, ts - d]
  np.testing.assert_array_equal((fact - 1) // s.num_values, code // task.buckets)  # same key
  assert b["inputs"].max() < task.vocab_size and b["targets"].max() < task.vocab_size
