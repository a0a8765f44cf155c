"""Task names from data records (data.task_field): batches' task_ids, one task per row, errors,
resumption, eval padding, the per-process contract, and the Elastic train step reading them."""

import json
import os

import numpy as np
import pytest

from condattn_jax import data

TASKS = ("qa", "summ")


def _write(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def _cfg(path, *, T=8, batch_size=1, pack_bins=2, **kw):
  cfg = data.default_data_config()
  cfg.source = "jsonl"
  cfg.paths = path
  cfg.seq_len = T
  cfg.batch_size = batch_size
  cfg.packing = "first_fit"
  cfg.pack_bins = pack_bins
  cfg.append_separator = False
  cfg.prefetch = 0
  cfg.task_field = "task"
  cfg.task_names = TASKS
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _id_docs(n, seed=0, max_len=14):
  """Record i: tokens all equal to i + 1 (so a row's segments name their records), random task."""
  rng = np.random.default_rng(seed)
  return [{"tokens": [i + 1] * int(rng.integers(2, max_len)), "task": TASKS[int(rng.integers(2))]}
          for i in range(n)]


def _row_records(batch, r):
  """The record indices packed into row r (one per segment)."""
  seg, inp = batch["segment_ids"][r], batch["inputs"][r]
  return [int(inp[seg == s][0]) - 1 for s in np.unique(seg[seg > 0])]


def test_task_ids_follow_the_records_and_bins_keep_one_task(tmp_path):
  # T = 8 pairs per row, 2 bins, one lane, pairs per document in brackets. A qa [2] opens bin 0,
  # B summ [2] bin 1; C code [2] finds no empty bin and no code bin: both bins are emitted
  # (rows [A] qa, [B] summ) and C opens new ones; D qa [3] bin 1; E code [6] joins C (2 + 6 =
  # 8); F qa [5] joins D (3 + 5 = 8); the end emits [C, E] and [D, F].
  tasks = ("qa", "summ", "code")
  recs = [{"tokens": [1] * 3, "task": "qa"}, {"tokens": [2] * 3, "task": "summ"},
          {"tokens": [3] * 3, "task": "code"}, {"tokens": [4] * 4, "task": "qa"},
          {"tokens": [5] * 7, "task": "code"}, {"tokens": [6] * 6, "task": "qa"}]
  cfg = _cfg(_write(tmp_path / "d.jsonl", recs), shuffle_seed=None, num_epochs=1,
             task_names=tasks)
  batches = list(data.make_train_iterator(cfg))
  assert [b["task_ids"].tolist() for b in batches] == [[0], [1], [2], [0]]
  assert [_row_records(b, 0) for b in batches] == [[0], [1], [2, 4], [3, 5]]
  assert all(b["task_ids"].dtype == np.int32 and b["task_ids"].shape == (1,) for b in batches)
  cfg.task_field = None  # without tasks: plain first fit mixes them
  plain = list(data.make_train_iterator(cfg))
  assert "task_ids" not in plain[0] and _row_records(plain[0], 0) == [0, 1, 2]


def test_rows_never_mix_tasks_and_every_record_is_read_once(tmp_path):
  recs = _id_docs(60)
  cfg = _cfg(_write(tmp_path / "d.jsonl", recs), T=16, batch_size=4, pack_bins=3,
             shuffle_seed=3, num_epochs=1)
  seen = []
  for b in data.make_eval_batches(cfg, None, seed=3):
    for r in range(4):
      ids = _row_records(b, r)
      seen += ids
      if not ids:  # an exhausted lane's padding row: task 0, nothing scored
        assert b["task_ids"][r] == 0 and b["loss_mask"][r].sum() == 0
      assert {TASKS.index(recs[i]["task"]) for i in ids} <= {int(b["task_ids"][r])}
  assert sorted(seen) == list(range(60))


def test_resume_is_exact_with_task_ids(tmp_path):
  cfg = _cfg(_write(tmp_path / "d.jsonl", _id_docs(40)), T=16, batch_size=2, pack_bins=2,
             shuffle_seed=0)
  it = data.make_train_iterator(cfg)
  _ = [next(it) for _ in range(5)]
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(6)]
  it2 = data.make_train_iterator(cfg)
  it2.set_state(state)
  got = [next(it2) for _ in range(6)]
  for w, g in zip(want, got):
    assert set(w) == set(g) and "task_ids" in g
    for k in w:
      np.testing.assert_array_equal(w[k], g[k], err_msg=k)


def test_process_shards_concatenate_with_task_ids(tmp_path):
  cfg = _cfg(_write(tmp_path / "d.jsonl", _id_docs(40)), T=16, batch_size=4, shuffle_seed=0)
  full = [next(it) for it in [data.make_train_iterator(cfg)] for _ in range(4)]
  parts = [[next(it) for it in [data.make_train_iterator(cfg, process_index=p, process_count=2)]
            for _ in range(4)] for p in range(2)]
  for step, batch in enumerate(full):
    for k in batch:
      np.testing.assert_array_equal(np.concatenate([parts[p][step][k] for p in range(2)]),
                                    batch[k], err_msg=k)


def test_unknown_task_is_one_line_error_naming_record_task_and_known(tmp_path):
  recs = _id_docs(6)
  recs[2] = {"tokens": [3, 3, 3], "task": "poem"}
  path = _write(tmp_path / "d.jsonl", recs)
  for policy in ("error", "skip"):  # a wrong task list is not a bad record: never skipped
    with pytest.raises(ValueError, match=r"d\.jsonl:3: task 'poem' is not one of "
                                         r"model\.scheme\.task_names \['qa', 'summ'\]") as e:
      list(data.make_train_iterator(_cfg(path, on_bad_record=policy, num_epochs=1,
                                         shuffle_seed=None)))
    assert "\n" not in str(e.value)


def test_record_without_the_task_field_names_the_field(tmp_path):
  recs = _id_docs(6)
  recs[4] = {"tokens": [5, 5, 5]}
  path = _write(tmp_path / "d.jsonl", recs)
  with pytest.raises(ValueError, match=r"d\.jsonl:5: record has no task field "
                                       r"data\.task_field='task'; its fields: \['tokens'\]"):
    list(data.make_train_iterator(_cfg(path, num_epochs=1, shuffle_seed=None)))
  before = data.SKIPPED.count  # with on_bad_record='skip' it is a bad record like any other
  batches = list(data.make_train_iterator(_cfg(path, num_epochs=1, shuffle_seed=None,
                                               on_bad_record="skip")))
  assert data.SKIPPED.count - before == 1
  assert sorted({i for b in batches for i in _row_records(b, 0)}) == [0, 1, 2, 3, 5]


def test_config_checks_and_batch_spec(tmp_path):
  path = _write(tmp_path / "d.jsonl", _id_docs(4))
  spec = data.batch_spec(_cfg(path, batch_size=4))
  assert spec["task_ids"].shape == (4,) and spec["task_ids"].dtype == np.int32
  assert spec["inputs"].shape == (4, 8)
  assert "task_ids" not in data.batch_spec(_cfg(path, task_field=None))
  for kw, msg in ((dict(packing="concat_then_split"), "needs data.packing='first_fit'"),
                  (dict(task_names=None), "needs data.task_names"),
                  (dict(task_names=("qa", "qa")), "duplicates"),
                  (dict(source="mqar"), "file sources only")):
    with pytest.raises(ValueError, match=msg):
      data.parse_data_config(_cfg(path, **kw))
  as_str = dict(_cfg(path).to_dict(), task_names="qa, summ")  # a command-line string
  assert data.parse_data_config(as_str).task_names == TASKS
  from ml_collections import ConfigDict
  run = ConfigDict({"model": {"scheme": {"task_names": ("summ", "qa")}}, "data": _cfg(path)})
  with pytest.raises(ValueError, match=r"differs from model\.scheme\.task_names"):
    data.parse_data_config(run)


def test_elastic_recipe_reads_task_names_from_the_scheme():
  from condattn_jax.train.cli import load_recipe
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  c = load_recipe(os.path.join(root, "configs", "elastic_qwen.py"))
  assert c.data.task_field == "task" and c.data.task_names == c.model.scheme.task_names
  c.model.scheme.task_names = ("a", "b", "c", "d")  # the command line moves both
  assert data.parse_data_config(c, needs_files=False).task_names == ("a", "b", "c", "d")


def test_elastic_train_step_counts_the_batches_tasks(tmp_path):
  """The tiny Elastic recipe on a two-task jsonl file through train.loop.run: the logged
  per-task sample counts (elastic/samples_task) are the tasks of the pipeline's batches."""
  from condattn_jax.train import loop
  from condattn_jax.train.cli import load_recipe
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  c = load_recipe(os.path.join(root, "configs", "elastic_qwen.py") + ":tiny,steps=3")
  s = c.model.scheme
  s.task_names, s.targets = TASKS, (0.7, 1.0)
  rng = np.random.default_rng(1)
  recs = [{"tokens": rng.integers(1, 64, size=int(rng.integers(20, 60))).tolist(),
           "task": TASKS[int(rng.integers(2))]} for _ in range(64)]
  d = c.data
  d.source, d.paths, d.packing, d.separator_id = "jsonl", _write(tmp_path / "d.jsonl", recs), \
      "one_per_row", 0  # Elastic: one document per row
  d.task_field, d.task_names = "task", s.get_ref("task_names")
  d.task = {}
  c.train.log_every = 1
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.at_end = True  # the eval batches (make_eval_batches) carry task_ids too
  c.eval.num_batches = 1
  want = [np.bincount(b["task_ids"], minlength=2).tolist()
          for it in [data.make_train_iterator(c)] for b in [next(it) for _ in range(3)]]
  assert np.min(np.sum(want, axis=0)) > 0 and len({tuple(w) for w in want}) > 1, want
  loop.run(c, str(tmp_path / "run"))
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  got = [r["train/elastic/samples_task"] for r in rows if "train/elastic/samples_task" in r]
  assert got == want, (got, want)
  from condattn_jax.evaluation.perplexity import eval_data_config
  (eb,) = data.make_eval_batches(eval_data_config(c, 64), 1, int(c.eval.seed))
  ev = [r for r in rows if "eval/L64/aux/elastic/samples_task" in r]
  assert ev[-1]["eval/L64/aux/elastic/samples_task"] == np.bincount(eb["task_ids"],
                                                                    minlength=2).tolist()


def test_parquet_reads_the_task_column(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  recs = _id_docs(12, max_len=8)
  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.table({"tokens": [r["tokens"] for r in recs],
                           "task": [r["task"] for r in recs], "other": list(range(12))}), path)
  cfg = _cfg(path, source="parquet", shuffle_seed=None, num_epochs=1)
  for b in data.make_train_iterator(cfg):
    assert {TASKS.index(recs[i]["task"]) for i in _row_records(b, 0)} == {int(b["task_ids"][0])}
