"""Prompt / answer records (data.prompt_field + data.answer_field): batches carry
`prompt_lengths`, rows hold one document, data.loss_on='answer' scores the answer only; the
config errors; Elastic's router pools the prompt the pipeline reports (issue 34)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax import attention, data
from condattn_jax.data import packing, pipeline
from condattn_jax.models.config import ModelConfig

T = 24
SEP = 1


def _records(n=6, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = rng.integers(2, 100, size=int(rng.integers(3, 12))).tolist()
    a = rng.integers(2, 100, size=int(rng.integers(1, 8))).tolist()
    out.append({"prompt": p, "answer": a, "task": ["qa", "code"][i % 2]})
  return out


def _write(path, recs):
  with open(path, "w") as f:
    for r in recs:
      f.write(json.dumps(r) + "\n")
  return str(path)


def _cfg(path, **kw):
  cfg = data.default_data_config()
  cfg.source = "jsonl"
  cfg.paths = path
  cfg.seq_len = T
  cfg.batch_size = 2
  cfg.packing = "one_per_row"
  cfg.separator_id = SEP
  cfg.shuffle_seed = None
  cfg.num_epochs = 1
  cfg.prefetch = 0
  cfg.prompt_field = "prompt"
  cfg.answer_field = "answer"
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _rows(cfg):
  it = data.make_train_iterator(cfg)
  rows = []
  for b in it:
    for r in range(b["inputs"].shape[0]):
      rows.append({k: v[r] for k, v in b.items()})
  return rows


@pytest.mark.parametrize("loss_on", ["all", "answer"])
def test_prompt_lengths_and_answer_only_loss(tmp_path, loss_on):
  recs = _records()
  rows = _rows(_cfg(_write(tmp_path / "d.jsonl", recs), loss_on=loss_on, task_field="task",
                    task_names=("qa", "code")))
  assert len(rows) == len(recs)
  # lane r reads records r, r + B, ...: row order (batch k, lane r) = record 2k + r
  for rec, row in zip(recs, rows):
    p, a = rec["prompt"], rec["answer"]
    doc = p + a + [SEP]
    n = len(doc) - 1
    assert row["prompt_lengths"] == len(p)
    np.testing.assert_array_equal(row["inputs"][:n], doc[:-1])
    assert (row["segment_ids"][:n] == 1).all() and (row["segment_ids"][n:] == 0).all()
    want = np.zeros(T, np.float32)
    want[:n] = 1.0
    if loss_on == "answer":  # target j is token j + 1: scored iff it is past the prompt
      want[:len(p) - 1] = 0.0
    np.testing.assert_array_equal(row["loss_mask"], want)
    assert row["task_ids"] == ["qa", "code"].index(rec["task"])
  spec = pipeline.batch_spec(_cfg("x", loss_on=loss_on))
  assert spec["prompt_lengths"].shape == (2,) and spec["inputs"].shape == (2, T)


def test_prompt_config_errors_are_one_line(tmp_path):
  path = _write(tmp_path / "d.jsonl", _records())
  cases = [
      (dict(packing="first_fit"), r"data.prompt_field='prompt' needs data.packing='one_per_row'"),
      (dict(answer_field=None), r"data.prompt_field='prompt' and data.answer_field=None: set both"),
      (dict(prompt_field=None, answer_field=None, loss_on="answer"),
       r"data.loss_on='answer' needs data.prompt_field"),
      (dict(loss_on="prompt"), r"data.loss_on='prompt' is unknown"),
  ]
  for kw, msg in cases:
    with pytest.raises(ValueError, match=msg) as e:
      data.parse_data_config(_cfg(path, **kw))
    assert "\n" not in str(e.value)
  # a record longer than one row is a bad record naming its line, never cut
  long = _records()
  long[2]["answer"] = list(range(2, 2 + T))
  with pytest.raises(ValueError, match=r"d2.jsonl:3: prompt \+ answer = \d+ tokens, longer "
                                       r"than data.seq_len \+ 1 = 25"):
    _rows(_cfg(_write(tmp_path / "d2.jsonl", long)))
  with pytest.raises(ValueError, match="data.prompt_field needs data.packing='one_per_row'"):
    packing.pack(None, seq_len=T, packing="first_fit", prompts=True)


def test_elastic_pools_the_prompt_the_pipeline_reports(tmp_path):
  """Through the train step's field plumbing (context_fields): the router's decision depends on
  the prompt only; changing an answer token leaves fa_BK unchanged, changing a prompt token
  changes the pooled input. Without prompt_lengths the answer would be pooled."""
  from condattn_jax.attention.elastic import layer as elastic_layer
  from condattn_jax.train.step import context_fields
  recs = [{"prompt": list(range(2, 14)), "answer": [20, 21, 22, 23]}] * 2
  rows = _rows(_cfg(_write(tmp_path / "d.jsonl", recs), batch_size=2))
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  assert context_fields(batch)["prompt_lengths"].tolist() == [12, 12]
  o = attention.options(attention.configure(ModelConfig(), "elastic", boundary=4,
                                            pooling="boundary"))
  k_BTKH = jax.random.normal(jax.random.key(0), (2, T, 2, 8))
  valid = batch["segment_ids"] > 0
  fields = context_fields(batch)
  pooled = elastic_layer.pool_keys(k_BTKH, valid, fields["prompt_lengths"], o)
  # the reference: first 4 and last 4 of the 12 prompt tokens, nothing of the answer
  idx = [0, 1, 2, 3, 8, 9, 10, 11]
  np.testing.assert_allclose(pooled, jnp.mean(k_BTKH[:, idx], axis=1), rtol=1e-6)
  answer_moved = k_BTKH.at[:, 13].add(5.0)
  np.testing.assert_array_equal(
      elastic_layer.pool_keys(answer_moved, valid, fields["prompt_lengths"], o), pooled)
  without = elastic_layer.pool_keys(answer_moved, valid, None, o)
  assert not np.allclose(without, pooled)  # the row's end is the answer: pooled without it
