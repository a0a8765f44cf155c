"""Synthetic tasks: answers correct, only answers scored, gaps respected, deterministic."""

import numpy as np
import pytest

from condattn_jax import data
from condattn_jax.data import packing, synthetic


def _check_lm_row(row, T):
  assert row["inputs"].shape == (T,) and row["inputs"].dtype == np.int32
  np.testing.assert_array_equal(row["targets"][:-1], row["inputs"][1:])
  np.testing.assert_array_equal(row["segment_ids"], np.ones(T, np.int32))
  np.testing.assert_array_equal(row["positions"], np.arange(T))
  assert row["loss_mask"].dtype == np.float32
  assert set(np.unique(row["loss_mask"])) <= {0.0, 1.0}


@pytest.mark.parametrize("params", [
    dict(vocab_size=64, num_pairs=8, min_gap=0),
    dict(vocab_size=8192, num_pairs=16, num_queries=5, min_gap=100),
    dict(vocab_size=40, num_pairs=19, min_gap=3),  # every key of the vocabulary used
])
def test_mqar_answers_and_gaps(params):
  T = 256
  task = synthetic.make_task("mqar", params, T)
  n, q, gap = task.num_pairs, task.queries, task.min_gap
  for i in range(50):
    row = task.example(seed=3, index=i)
    _check_lm_row(row, T)
    inp, tgt, lm = row["inputs"], row["targets"], row["loss_mask"]
    keys, values = inp[0:2 * n:2], inp[1:2 * n:2]
    assert len(set(keys.tolist())) == n and len(set(values.tolist())) == n
    assert keys.min() >= 1 and keys.max() < task.vocab_size // 2
    assert values.min() >= task.vocab_size // 2 and values.max() < task.vocab_size
    table = dict(zip(keys.tolist(), values.tolist()))
    scored = np.flatnonzero(lm)
    assert len(scored) == q
    asked = [int(inp[t]) for t in scored]
    assert len(set(asked)) == q  # distinct keys queried
    for t in scored:
      assert tgt[t] == table[int(inp[t])]  # the answer is the pair's value
      pair_value_pos = 2 * list(keys).index(inp[t]) + 1
      assert t - pair_value_pos >= gap + 1
      assert t >= 2 * n + gap
    # Everything outside the pairs and the queries is filler 0, never scored.
    query_tokens = np.zeros(T, bool)
    query_tokens[scored] = True
    query_tokens[scored[scored + 1 < T] + 1] = True  # the value (s[T] is only a target)
    rest = np.ones(T, bool)
    rest[:2 * n] = False
    rest &= ~query_tokens
    assert np.all(inp[rest] == 0)


def test_mqar_window_cannot_see_pairs():
  T, gap = 512, 64
  task = synthetic.make_task("mqar", dict(vocab_size=256, num_pairs=16, min_gap=gap), T)
  row = task.example(0, 7)
  mask = packing.attention_mask(row["segment_ids"][None], row["positions"][None],
                                window=gap + 1)[0]
  for t in np.flatnonzero(row["loss_mask"]):
    assert not mask[t, :2 * task.num_pairs].any()
  full = packing.attention_mask(row["segment_ids"][None], row["positions"][None])[0]
  assert all(full[t, :2 * task.num_pairs].all() for t in np.flatnonzero(row["loss_mask"]))


@pytest.mark.parametrize("params", [
    dict(vocab_size=100, kv_vocab_size=10, key_len=3, value_len=2),
    dict(vocab_size=300, kv_vocab_size=4, key_len=6, value_len=5, num_needles=5, min_gap=60),
    dict(vocab_size=64, kv_vocab_size=16, key_len=2, value_len=1, depth=0.0),
    dict(vocab_size=64, kv_vocab_size=16, key_len=2, value_len=1, depth=1.0, min_gap=10),
])
def test_niah_answers(params):
  T = 200
  task = synthetic.make_task("niah", params, T)
  kl, vl, nl = task.key_len, task.value_len, task.needle_len
  for i in range(40):
    row = task.example(seed=1, index=i)
    _check_lm_row(row, T)
    s = np.concatenate([row["inputs"], row["targets"][-1:]])
    q = task.query_start
    assert s[q] == task.QUERY and np.sum(s == task.QUERY) == 1
    key, value = s[q + 1:q + 1 + kl], s[q + 1 + kl:]
    assert len(value) == vl
    starts = np.flatnonzero(s == task.NEEDLE)
    assert len(starts) == task.num_needles
    assert np.all(np.diff(starts) >= nl)  # no overlap
    assert starts[-1] + nl <= q - task.min_gap
    needle_keys = [tuple(s[p + 1:p + 1 + kl]) for p in starts]
    assert len(set(needle_keys)) == task.num_needles  # distractors have other keys
    j = needle_keys.index(tuple(key))
    np.testing.assert_array_equal(s[starts[j] + 1 + kl:starts[j] + nl], value)
    # Filler never contains the marker or key/value tokens.
    kv = np.zeros(T + 1, bool)
    for p in list(starts) + [q]:
      kv[p:p + nl] = True
    assert np.all(s[~kv] >= task.FIRST_KV + task.kv_vocab_size)
    # Scored = exactly the value tokens of the query.
    scored = np.flatnonzero(row["loss_mask"])
    np.testing.assert_array_equal(scored, np.arange(q + kl, q + kl + vl))
    np.testing.assert_array_equal(row["targets"][scored], value)
    if task.depth is not None:
      assert starts[0] == round(task.depth * task.free_haystack)


def test_deterministic_in_seed_and_index():
  task = synthetic.make_task("mqar", {}, 128)
  a, b = task.example(5, 11), task.example(5, 11)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a["inputs"], task.example(6, 11)["inputs"])
  assert not np.array_equal(a["inputs"], task.example(5, 12)["inputs"])
  assert not np.array_equal(a["inputs"], task.example(5, 11, stream=1)["inputs"])


def test_pipeline_batches_are_examples_in_index_order():
  cfg = data.default_data_config()
  cfg.source, cfg.seq_len, cfg.batch_size, cfg.shuffle_seed = "niah", 64, 4, 9
  cfg.task = {"vocab_size": 64, "kv_vocab_size": 8}
  it = data.make_train_iterator(cfg)
  task = synthetic.make_task("niah", cfg.task, 64)
  for step in range(3):
    b = next(it)
    for r in range(4):
      ex = task.example(9, step * 4 + r)
      assert all(np.array_equal(b[k][r], ex[k]) for k in ex)
  it.close()


def test_invalid_task_params():
  with pytest.raises(ValueError, match="mqar does not fit"):
    synthetic.make_task("mqar", dict(num_pairs=8, min_gap=100), 64)
  with pytest.raises(ValueError, match="num_pairs"):
    synthetic.make_task("mqar", dict(vocab_size=16, num_pairs=8), 64)
  with pytest.raises(ValueError, match="num_queries"):
    synthetic.make_task("mqar", dict(num_pairs=4, num_queries=5), 64)
  with pytest.raises(ValueError, match="niah does not fit"):
    synthetic.make_task("niah", dict(num_needles=10, key_len=4, value_len=4), 64)
  with pytest.raises(ValueError, match="depth"):
    synthetic.make_task("niah", dict(num_needles=2, depth=0.5), 256)
  with pytest.raises(ValueError, match=r"valid tasks: \['mqar', 'niah', 'suite'\]"):
    synthetic.make_task("copy", {}, 64)
