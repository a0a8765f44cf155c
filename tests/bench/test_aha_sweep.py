"""bench/aha_window_sweep.py: the synthetic task is what it claims (every scored query's fact sits
`distance` tokens back, distances log-uniform: a long tail), and the recorded sweep
(bench/results/aha_window_sweep.json) holds the issue's evidence: full-attention usage falling as
the window grows at accuracy within 2 points of the dense model."""
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import aha_window_sweep as sweep  # noqa: E402



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
