"""Pipeline: resumption, per-process sharding contract, file sources, config errors."""

import json
import os

import grain
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from condattn_jax import data
from condattn_jax.data import pipeline

T = 32
QWEN_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tokenizer", "qwen")


def _docs(n=80, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.integers(1, 5000, size=int(rng.integers(2, 3 * T)))).tolist() for _ in range(n)]


def _write_jsonl(path, docs, field="tokens"):
  with open(path, "w") as f:
    for d in docs:
      f.write(json.dumps({field: d, "meta": "x"}) + "\n")
  return str(path)


def _file_cfg(path, *, source="jsonl", packing="concat_then_split", batch_size=4, **kw):
  cfg = data.default_data_config()
  cfg.source = source
  cfg.paths = path
  cfg.seq_len = T
  cfg.batch_size = batch_size
  cfg.packing = packing
  cfg.separator_id = 0
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _mqar_cfg(batch_size=4, **task):
  cfg = data.default_data_config()
  cfg.source = "mqar"
  cfg.seq_len = 64
  cfg.batch_size = batch_size
  cfg.task.vocab_size = 128
  cfg.task.num_pairs = 4
  cfg.task.min_gap = 8
  for k, v in task.items():
    cfg.task[k] = v
  return cfg


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return len(a) == len(b) and all(
      set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.fixture
def jsonl_path(tmp_path):
  return _write_jsonl(tmp_path / "docs.jsonl", _docs())


# ----------------------------------------------------------------------------- resume

@pytest.mark.parametrize("kind", ["mqar", "mqar_finite", "niah", "cts", "first_fit"])
def test_state_restore_resumes_exact_stream(tmp_path, jsonl_path, kind):
  if kind == "mqar":
    cfg = _mqar_cfg()
  elif kind == "mqar_finite":
    cfg = _mqar_cfg(num_examples=10)  # shuffled epochs of a finite set
  elif kind == "niah":
    cfg = _mqar_cfg()
    cfg.source = "niah"
    cfg.task = {"vocab_size": 64, "kv_vocab_size": 8, "min_gap": 4}
  else:
    cfg = _file_cfg(jsonl_path, packing="concat_then_split" if kind == "cts" else "first_fit")
  it = data.make_train_iterator(cfg)
  _take(it, 3)
  state = it.get_state()
  # Through grain's Orbax handler (JSON on disk, one file per process).
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  grain.checkpoint.CheckpointHandler().save(ckpt, item=it)
  expected = _take(it, 7)  # crosses epoch boundaries for the finite sources
  it.close()

  fresh = data.make_train_iterator(cfg)
  grain.checkpoint.CheckpointHandler().restore(ckpt, item=fresh)
  assert _same(_take(fresh, 7), expected)
  fresh.close()
  fresh = data.make_train_iterator(cfg)
  fresh.set_state(json.loads(json.dumps(state)))
  assert _same(_take(fresh, 7), expected)
  fresh.close()


def test_state_from_other_process_layout_is_refused():
  cfg = _mqar_cfg()
  state = data.make_train_iterator(cfg, process_index=0, process_count=2).get_state()
  with pytest.raises(ValueError, match="same process_index/process_count"):
    data.make_train_iterator(cfg, process_index=1, process_count=2).set_state(state)
  with pytest.raises(ValueError, match="data.batch_size"):
    data.make_train_iterator(cfg).set_state(state)


# --------------------------------------------------------------- per-process contract

@pytest.mark.parametrize("kind", ["mqar", "cts", "first_fit"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_process_shards_concatenate_to_the_single_process_batch(jsonl_path, kind, nproc):
  if kind == "mqar":
    cfg = _mqar_cfg(batch_size=8)
  else:
    cfg = _file_cfg(jsonl_path, packing="concat_then_split" if kind == "cts" else "first_fit",
                    batch_size=8)
  cfg.prefetch = 0
  full = _take(data.make_train_iterator(cfg), 6)
  parts = [_take(data.make_train_iterator(cfg, process_index=p, process_count=nproc), 6)
           for p in range(nproc)]
  for step, batch in enumerate(full):
    for k in batch:
      local = [parts[p][step][k] for p in range(nproc)]
      assert all(x.shape == (8 // nproc, batch[k].shape[1]) for x in local)
      np.testing.assert_array_equal(np.concatenate(local, axis=0), batch[k])


def test_batch_size_must_divide_over_processes():
  with pytest.raises(ValueError, match="not divisible by process_count=3"):
    data.make_train_iterator(_mqar_cfg(batch_size=4), process_index=0, process_count=3)


def test_make_global_batch_and_shard_for_sharding():
  cfg = _mqar_cfg(batch_size=8)
  cfg.prefetch = 0
  batch = next(data.make_train_iterator(cfg))
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  assert data.data_shard_for_sharding(sharding, (8, 64)) == (0, 1)
  out = data.make_global_batch(batch, sharding, global_batch_size=8)
  for k, v in batch.items():
    assert out[k].shape == v.shape and out[k].dtype == v.dtype
    assert out[k].sharding == sharding
    np.testing.assert_array_equal(np.asarray(out[k]), v)
  inferred = data.make_global_batch(batch, {k: sharding for k in batch})
  assert all(inferred[k].shape == v.shape for k, v in batch.items())
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  assert data.data_shard_for_sharding(replicated, (8, 64)) == (0, 1)
  spec = data.batch_spec(cfg)
  assert {k: (s.shape, s.dtype) for k, s in spec.items()} == {
      k: (v.shape, v.dtype) for k, v in batch.items()}


# ---------------------------------------------------------------------- file sources

def _read_back(cfg, tokenizer=None):
  """All documents of one unshuffled epoch, reassembled from the packed rows."""
  cfg.shuffle_seed = None
  cfg.packing = "first_fit"
  cfg.seq_len = 4 * T  # no document is split
  docs = []
  for b in data.make_eval_batches(cfg, None, seed=0, tokenizer=tokenizer):
    for r in range(b["inputs"].shape[0]):
      seg = b["segment_ids"][r]
      for s in np.unique(seg[seg > 0]):
        idx = np.flatnonzero(seg == s)
        docs.append(b["inputs"][r][idx].tolist() + [int(b["targets"][r][idx[-1]])])
  return docs


def _check_round_trip(cfg, docs, tokenizer=None):
  got = _read_back(cfg, tokenizer)
  assert sorted(map(tuple, got)) == sorted(tuple(d + [0]) for d in docs)


def test_jsonl_round_trip(tmp_path):
  docs = _docs(30)
  a = _write_jsonl(tmp_path / "a.jsonl", docs[:12])
  with open(tmp_path / "b.jsonl", "w") as f:  # blank lines and CRLF are tolerated
    for d in docs[12:]:
      f.write(json.dumps({"ids": d}) + "\r\n\n")
  cfg = _file_cfg(a)
  _check_round_trip(cfg, docs[:12])
  cfg = _file_cfg(str(tmp_path / "b.jsonl"), tokens_field="ids")
  _check_round_trip(cfg, docs[12:])


def test_jsonl_glob_and_text_tokenized(tmp_path):
  class CharTokenizer:
    document_separator_id = 0
    eos_id = 0

    def encode(self, text):
      return [ord(c) for c in text]

  texts = ["hello world", "a", "the quick brown fox", "zz"]
  for i, t in enumerate(texts):
    _write_jsonl(tmp_path / f"part{i}.jsonl", [t], field="content")
  cfg = _file_cfg(str(tmp_path / "part*.jsonl"), text_field="content", separator_id=None)
  _check_round_trip(cfg, [[ord(c) for c in t] for t in texts], tokenizer=CharTokenizer())
  with pytest.raises(ValueError, match="records hold text in 'content'"):
    data.make_train_iterator(cfg)


@pytest.mark.skipif(not os.path.isdir(QWEN_DIR), reason="tokenizer fixture missing")
def test_text_with_project_tokenizer(tmp_path):
  from condattn_jax.data.tokenizer import load_tokenizer
  tok = load_tokenizer(QWEN_DIR)
  texts = ["Hello world, the fox!", "def f(x):\n    return x * 2\n"]
  cfg = _file_cfg(_write_jsonl(tmp_path / "t.jsonl", texts, field="text"), separator_id=None,
                  tokenizer=QWEN_DIR)
  got = _read_back(cfg)
  sep = tok.document_separator_id
  assert sorted(map(tuple, got)) == sorted(tuple(tok.encode(t) + [sep]) for t in texts)


def test_parquet_round_trip(tmp_path):
  docs = _docs(40)
  for i in range(2):  # two files, several row groups each
    part = docs[i * 20:(i + 1) * 20]
    table = pa.table({"tokens": pa.array(part, type=pa.list_(pa.int32())),
                      "other": [str(j) for j in range(len(part))]})
    pq.write_table(table, tmp_path / f"p{i}.parquet", row_group_size=6)
  _check_round_trip(_file_cfg(str(tmp_path / "p*.parquet"), source="parquet"), docs)


def test_parquet_text_column(tmp_path):
  pq.write_table(pa.table({"body": ["ab", "cde"]}), tmp_path / "t.parquet")

  class Tok:
    document_separator_id = 0

    def encode(self, text):
      return [ord(c) for c in text]

  cfg = _file_cfg(str(tmp_path / "t.parquet"), source="parquet", text_field="body")
  _check_round_trip(cfg, [[97, 98], [99, 100, 101]], tokenizer=Tok())
  with pytest.raises(ValueError, match="none of the columns"):
    data.make_train_iterator(_file_cfg(str(tmp_path / "t.parquet"), source="parquet"))


@pytest.mark.parametrize("fmt", ["json", "int32", "uint16"])
def test_array_record_round_trip(tmp_path, fmt):
  docs = _docs(25)
  recs = [{"tokens": d} for d in docs] if fmt == "json" else docs
  data.write_array_record(str(tmp_path / "a.arrayrecord"), recs[:10], record_format=fmt)
  data.write_array_record(str(tmp_path / "b.arrayrecord"), recs[10:], record_format=fmt)
  cfg = _file_cfg([str(tmp_path / "a.arrayrecord"), str(tmp_path / "b.arrayrecord")],
                  source="array_record", record_format=fmt)
  _check_round_trip(cfg, docs)


@pytest.mark.parametrize("source", ["jsonl", "parquet", "array_record"])
def test_missing_file_is_named(tmp_path, source):
  missing = str(tmp_path / "nope.data")
  with pytest.raises(FileNotFoundError, match="nope.data"):
    data.make_train_iterator(_file_cfg(missing, source=source))
  with pytest.raises(FileNotFoundError, match=r"glob .*\*.data.* matches no file"):
    data.make_train_iterator(_file_cfg(str(tmp_path / "*.data"), source=source))


# --------------------------------------------------------------------- epochs / eval

def test_finite_epochs_stop_and_eval_covers_every_document(jsonl_path):
  cfg = _file_cfg(jsonl_path, num_epochs=1)
  train = list(data.make_train_iterator(cfg))
  evals = data.make_eval_batches(cfg, None, seed=0)
  assert 0 < len(train) <= len(evals)
  total = sum(len(d) for d in _docs())  # pairs = tokens (with separator) - 1 = len(d)
  assert sum(float(b["loss_mask"].sum()) for b in evals) == total
  cfg.num_epochs = 2
  assert len(list(data.make_train_iterator(cfg))) >= 2 * len(train)


def test_eval_batches_fixed_and_distinct_from_train(jsonl_path):
  cfg = _mqar_cfg()
  a = data.make_eval_batches(cfg, 3, seed=0)
  assert len(a) == 3 and _same(a, data.make_eval_batches(cfg, 3, seed=0))
  assert not np.array_equal(a[0]["inputs"], data.make_eval_batches(cfg, 3, seed=1)[0]["inputs"])
  cfg.shuffle_seed = 0
  train = next(data.make_train_iterator(cfg))
  assert not np.array_equal(a[0]["inputs"], train["inputs"])
  halves = [data.make_eval_batches(cfg, 3, seed=0, process_index=p, process_count=2)
            for p in range(2)]
  np.testing.assert_array_equal(
      np.concatenate([halves[0][1]["inputs"], halves[1][1]["inputs"]]), a[1]["inputs"])
  # Finite synthetic set: num_batches=None takes the whole set once.
  cfg = _mqar_cfg(num_examples=10)
  assert len(data.make_eval_batches(cfg, None, seed=0)) == 3  # 10 rows over 4 lanes
  fcfg = _file_cfg(jsonl_path)
  e = data.make_eval_batches(fcfg, 2, seed=5)
  assert len(e) == 2 and _same(e, data.make_eval_batches(fcfg, 2, seed=5))


# --------------------------------------------------------------------------- config

def test_config_errors(tmp_path):
  cfg = data.default_data_config()
  cfg.source = "c4"
  with pytest.raises(ValueError, match=r"valid sources: \['mqar', 'niah', 'suite', 'jsonl'"):
    data.make_train_iterator(cfg)
  with pytest.raises(ValueError, match="unknown data.task parameter.*num_pair.*valid"):
    data.make_train_iterator(_mqar_cfg(num_pair=3))
  with pytest.raises(ValueError, match="unknown data config field.*seqlen"):
    data.parse_data_config({"source": "mqar", "seqlen": 3})
  with pytest.raises(ValueError, match="set data.paths"):
    data.parse_data_config({"source": "jsonl"})
  with pytest.raises(ValueError, match="data.packing='greedy' is unknown"):
    data.parse_data_config({"source": "mqar", "packing": "greedy"})
  with pytest.raises(ValueError, match="data.num_epochs needs a finite synthetic"):
    data.make_train_iterator({**_mqar_cfg().to_dict(), "num_epochs": 1})
  path = _write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3]])
  with pytest.raises(ValueError, match="needs a separator id"):
    data.make_train_iterator(_file_cfg(path, separator_id=None))
  # A whole run config with a `data` field is accepted too.
  import ml_collections
  run = ml_collections.ConfigDict({"data": _mqar_cfg(), "model": {"d": 1}})
  assert data.parse_data_config(run).source == "mqar"


def test_process_exits_cleanly_with_a_live_prefetching_iterator(jsonl_path):
  # Regression: a prefetch thread still working at interpreter exit used to abort the
  # process (exit code 134) under Python 3.13.
  import subprocess
  import sys
  code = ("from condattn_jax import data\n"
          f"cfg = dict(source='jsonl', paths={jsonl_path!r}, seq_len=32, batch_size=4, "
          "separator_id=0, prefetch=2)\n"
          "it = data.make_train_iterator(cfg)\n"
          "next(it)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
  assert proc.returncode == 0, proc.stderr.decode()[-2000:]


# --------------------------------------------------------------------------- bad records
def _write_lines(path, lines):
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return str(path)


def _rows_tokens(it, n):
  """Every token id of the inputs of n batches (0 = separator / padding removed)."""
  return {int(t) for b in _take(it, n) for t in b["inputs"].reshape(-1) if t != 0}


@pytest.mark.parametrize("read_threads", [0, 2])
def test_bad_jsonl_record_names_file_and_one_based_line(tmp_path, read_threads):
  # line 1 ok, line 2 blank (skipped by the index, still counted), line 4 broken JSON
  good = json.dumps({"tokens": list(range(1, 40))})
  path = _write_lines(tmp_path / "d.jsonl", [good, "", good, '{"tokens": [1, 2', good])
  cfg = _file_cfg(path, batch_size=4, read_threads=read_threads)
  with pytest.raises(ValueError, match=r"d\.jsonl:4: not valid JSON.*on_bad_record"):
    _take(data.make_train_iterator(cfg), 2)
  # a record without the text / tokens field: named too (line 3)
  path = _write_lines(tmp_path / "e.jsonl", [good, good, json.dumps({"body": "x"}), good])
  with pytest.raises(ValueError, match=r"e\.jsonl:3: record has neither data.tokens_field"):
    _take(data.make_train_iterator(_file_cfg(path, batch_size=4)), 2)


def test_bad_first_record_fails_at_construction(tmp_path):
  path = _write_lines(tmp_path / "d.jsonl", ["not json", json.dumps({"tokens": [1, 2, 3]})])
  with pytest.raises(ValueError, match=r"d\.jsonl:1: not valid JSON"):
    data.make_train_iterator(_file_cfg(path, batch_size=2))


def test_skip_bad_records_counts_and_keeps_good_ones(tmp_path, caplog):
  docs = [list(range(100 * i + 1, 100 * i + 40)) for i in range(1, 9)]
  lines = [json.dumps({"tokens": d}) for d in docs]
  lines[2] = '{"tokens": [1, 2'           # line 3: broken JSON
  lines[5] = json.dumps({"other": 1})      # line 6: no tokens / text field
  lines[6] = json.dumps({"tokens": [5, 99999]})  # line 7: id beyond the vocab
  path = _write_lines(tmp_path / "d.jsonl", lines)
  cfg = _file_cfg(path, batch_size=1, on_bad_record="skip", num_epochs=1, shuffle_seed=None)
  before = data.SKIPPED.count
  with caplog.at_level("WARNING"):
    it = pipeline.make_dataset(cfg, vocab_size=1000).__iter__()
    seen = set()
    for b in it:
      seen |= {int(t) for t in b["inputs"].reshape(-1) if t != 0}
  assert data.SKIPPED.count - before == 3
  kept = [d for i, d in enumerate(docs) if i not in (2, 5, 6)]
  assert seen == {t for d in kept for t in d}  # every good document, none of the bad ones
  for line in (3, 6, 7):
    assert f"d.jsonl:{line}" in caplog.text
  cfg.on_bad_record = "keep_going"
  with pytest.raises(ValueError, match=r"on_bad_record='keep_going' is unknown"):
    data.parse_data_config(cfg)


def test_token_ids_are_checked_against_the_model_vocab(tmp_path):
  path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"tokens": [1, 2, 3]}),
                                              json.dumps({"tokens": [4, 70, 5]})])
  cfg = _file_cfg(path, batch_size=2)
  with pytest.raises(ValueError, match=r"d\.jsonl:2: token id 70 is outside \[0, 63\].*vocab_size "
                     r"is 64"):
    _take(data.make_train_iterator(cfg, vocab_size=64), 1)
  with pytest.raises(ValueError, match=r"data.task.vocab_size=128 exceeds the model's vocab_size=64"):
    data.make_train_iterator(_mqar_cfg(), vocab_size=64)
  with pytest.raises(ValueError, match=r"tokenizer .* has \d+ tokens but the model's vocab_size is "
                     r"64"):
    data.make_train_iterator(_file_cfg(path, batch_size=2, tokenizer=QWEN_DIR), vocab_size=64)
  with pytest.raises(ValueError, match=r"separator id 70 .* outside the model's vocabulary"):
    data.make_train_iterator(_file_cfg(path, batch_size=2, separator_id=70), vocab_size=64)


def test_required_markers_are_named_only_when_data_is_read():
  cfg = _mqar_cfg()
  cfg.source = "jsonl"
  cfg.paths = data.required("data.paths", "files")
  assert data.missing_required(cfg) == ["data.paths"]
  with pytest.raises(ValueError, match=r"required field\(s\) not set: --config.data.paths=<files>"):
    data.parse_data_config(cfg)
  data.parse_data_config(cfg, needs_files=False)  # shapes only (dry run)
  assert data.batch_spec(cfg)["inputs"].shape == (4, 64)
