"""Random-access document sources: jsonl, parquet, ArrayRecord.

Each source is a grain random-access data source (`__len__`, `__getitem__`) whose records
are dicts (jsonl, parquet, ArrayRecord 'json') or 1-D integer arrays (ArrayRecord raw
token records). `to_tokens` turns a record into the document's token ids.

Every source has `where(index) -> str`, the record's location for error messages: 'file:line'
(jsonl, 1-based physical line), 'file row r' (parquet, 1-based), 'file record r' (ArrayRecord).
`__getitem__` raises ValueError for a record it cannot decode; the pipeline adds `where`.

Random access is what makes per-process sharding cheap (a process reads only the records
of its own lanes) and resumption exact. jsonl files are indexed once by line offsets;
parquet is read one row group at a time through a small cache, so a globally shuffled
read of a large parquet corpus is slow: convert it with `write_array_record` first.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import threading
from typing import Any, Iterable, Sequence

import numpy as np

_GLOB_CHARS = set("*?[")


def resolve_paths(patterns: Sequence[str], field: str = "data.paths") -> list[str]:
  """Expands globs (sorted) and checks every file exists; errors name the missing one."""
  out: list[str] = []
  for pat in patterns:
    pat = os.path.expanduser(pat)
    if _GLOB_CHARS & set(pat):
      hits = sorted(glob.glob(pat))
      if not hits:
        raise FileNotFoundError(f"{field}: the glob {pat!r} matches no file")
      out.extend(hits)
    else:
      if not os.path.isfile(pat):
        raise FileNotFoundError(f"{field}: file {pat!r} does not exist")
      out.append(pat)
  if not out:
    raise FileNotFoundError(f"{field} names no files")
  return out


class _MultiFile:
  """Maps a global record index to (file index, local index)."""

  def _init_counts(self, counts: Sequence[int]):
    self._cum = np.cumsum(np.asarray(counts, np.int64))
    self._len = int(self._cum[-1]) if len(self._cum) else 0

  def __len__(self) -> int:
    return self._len

  def _locate(self, index: int) -> tuple[int, int]:
    index = int(index)
    if index < 0:
      index += self._len
    if not 0 <= index < self._len:
      raise IndexError(f"record {index} out of range [0, {self._len})")
    f = int(np.searchsorted(self._cum, index, side="right"))
    start = 0 if f == 0 else int(self._cum[f - 1])
    return f, index - start


def _line_index(path: str, chunk: int = 1 << 24) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(start, end) byte offsets and 1-based line numbers of every non-blank line of a text file."""
  newlines = []
  offset = 0
  with open(path, "rb") as f:
    while True:
      buf = f.read(chunk)
      if not buf:
        break
      arr = np.frombuffer(buf, np.uint8)
      newlines.append(np.flatnonzero(arr == 10).astype(np.int64) + offset)
      offset += len(buf)
  nl = np.concatenate(newlines) if newlines else np.zeros((0,), np.int64)
  starts = np.concatenate([[0], nl + 1]).astype(np.int64)
  ends = np.concatenate([nl, [offset]]).astype(np.int64)
  lines = np.arange(1, len(starts) + 1, dtype=np.int64)
  keep = ends - starts > 0
  starts, ends, lines = starts[keep], ends[keep], lines[keep]
  short = np.flatnonzero(ends - starts <= 8)
  if len(short):
    # Drop whitespace-only lines (e.g. a lone "\r" or spaces).
    with open(path, "rb") as f:
      blank = []
      for i in short:
        f.seek(int(starts[i]))
        blank.append(not f.read(int(ends[i] - starts[i])).strip())
    mask = np.ones(len(starts), bool)
    mask[short[np.asarray(blank, bool)]] = False
    starts, ends, lines = starts[mask], ends[mask], lines[mask]
  return starts, ends, lines


class JsonlSource(_MultiFile):
  """One JSON object per line; records are dicts."""

  def __init__(self, paths: Sequence[str]):
    self.paths = list(paths)
    self._index = [_line_index(p) for p in self.paths]
    self._init_counts([len(s) for s, _, _ in self._index])
    self._fds: dict[int, int] = {}
    self._lock = threading.Lock()

  def _fd(self, f: int) -> int:
    with self._lock:
      if f not in self._fds:
        self._fds[f] = os.open(self.paths[f], os.O_RDONLY)
      return self._fds[f]

  def where(self, index) -> str:
    f, i = self._locate(index)
    return f"{self.paths[f]}:{int(self._index[f][2][i])}"

  def __getitem__(self, index) -> dict[str, Any]:
    f, i = self._locate(index)
    starts, ends, _ = self._index[f]
    raw = os.pread(self._fd(f), int(ends[i] - starts[i]), int(starts[i]))
    try:
      rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(rec, dict):
      raise ValueError(f"not a JSON object (a {type(rec).__name__})")
    return rec

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_fds"], d["_lock"] = {}, None
    return d

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._lock = threading.Lock()

  def __del__(self, _close=os.close):
    for fd in getattr(self, "_fds", {}).values():
      try:
        _close(fd)
      except OSError:
        pass

  def __repr__(self) -> str:
    return f"JsonlSource({len(self.paths)} files, {len(self)} records)"


class ParquetSource(_MultiFile):
  """Rows of parquet files (only `columns` are read); records are dicts."""

  def __init__(self, paths: Sequence[str], columns: Sequence[str], cache_row_groups: int = 8):
    import pyarrow.parquet as pq
    self.paths = list(paths)
    self._rg_rows: list[np.ndarray] = []
    self.columns: list[list[str]] = []
    counts = []
    for p in self.paths:
      pf = pq.ParquetFile(p)
      meta = pf.metadata
      rows = np.array([meta.row_group(g).num_rows for g in range(meta.num_row_groups)],
                      np.int64)
      self._rg_rows.append(np.cumsum(rows))
      names = set(pf.schema_arrow.names)
      cols = [c for c in columns if c in names]
      if not cols:
        raise ValueError(f"parquet file {p!r} has none of the columns {list(columns)}; "
                         f"it has {sorted(names)} (set data.text_field / data.tokens_field)")
      self.columns.append(cols)
      counts.append(int(rows.sum()))
    self._init_counts(counts)
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._cache_size = cache_row_groups
    self._lock = threading.Lock()

  def _row_group(self, f: int, g: int) -> dict[str, list]:
    import pyarrow.parquet as pq
    key = (f, g)
    with self._lock:
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
    table = pq.ParquetFile(self.paths[f]).read_row_group(g, columns=self.columns[f])
    data = {c: table.column(c).to_pylist() for c in self.columns[f]}
    with self._lock:
      self._cache[key] = data
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    return data

  def where(self, index) -> str:
    f, i = self._locate(index)
    return f"{self.paths[f]} row {i + 1}"

  def __getitem__(self, index) -> dict[str, Any]:
    f, i = self._locate(index)
    cum = self._rg_rows[f]
    g = int(np.searchsorted(cum, i, side="right"))
    j = i - (0 if g == 0 else int(cum[g - 1]))
    data = self._row_group(f, g)
    return {c: v[j] for c, v in data.items()}

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_cache"], d["_lock"] = collections.OrderedDict(), None
    return d

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._lock = threading.Lock()

  def __repr__(self) -> str:
    return f"ParquetSource({len(self.paths)} files, {len(self)} records)"


class ArrayRecordSource:
  """ArrayRecord files; records decoded as JSON objects or raw token arrays."""

  def __init__(self, paths: Sequence[str], record_format: str = "json"):
    import grain
    self.paths = list(paths)
    self.record_format = record_format
    self._ds = grain.sources.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._ds)

  def where(self, index) -> str:
    name = self.paths[0] if len(self.paths) == 1 else f"{len(self.paths)} files {self.paths[:2]}..."
    return f"{name} record {int(index) + 1}"

  def __getitem__(self, index):
    raw = self._ds[int(index)]
    if self.record_format == "json":
      try:
        rec = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not valid JSON ({e}; set data.record_format to a dtype for raw token "
                         "records)") from None
      if not isinstance(rec, dict):
        raise ValueError("not a JSON object (set data.record_format to a dtype for raw token "
                         "records)")
      return rec
    return np.frombuffer(raw, dtype=np.dtype(self.record_format).newbyteorder("<"))

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self.paths)} files, {len(self)} records)"


def write_array_record(path: str, records: Iterable[Any], record_format: str = "json"):
  """Writes records (dicts for 'json', integer sequences for a dtype name) to `path`.

  The conversion path for large corpora: random access into ArrayRecord is cheap, so
  shuffled multi-process reading stays fast. Pre-tokenized 'int32' records skip the
  tokenizer at training time.
  """
  from array_record.python import array_record_module
  writer = array_record_module.ArrayRecordWriter(os.fspath(path), "group_size:1")
  try:
    for rec in records:
      if record_format == "json":
        writer.write(json.dumps(rec).encode("utf-8"))
      else:
        dt = np.dtype(record_format).newbyteorder("<")
        writer.write(np.asarray(rec).astype(dt).tobytes())
  finally:
    writer.close()


def open_source(source: str, paths: Sequence[str], *, text_field: str, tokens_field: str,
                record_format: str, field: str = "data.paths", task_field: str | None = None,
                prompt_fields: Sequence[str] = ()):
  """The record source; parquet reads only the token, text (and task, prompt / answer)
  columns."""
  files = resolve_paths(paths, field)
  if source == "jsonl":
    return JsonlSource(files)
  if source == "parquet":
    return ParquetSource(files, columns=[tokens_field, text_field] + (
        [task_field] if task_field else []) + list(prompt_fields))
  if source == "array_record":
    return ArrayRecordSource(files, record_format)
  raise ValueError(f"not a file source: {source!r}; valid: ['jsonl', 'parquet', 'array_record']")


class RecordToTokens:
  """Record -> int32 token ids of one document (+ separator)."""

  def __init__(self, *, text_field: str, tokens_field: str, tokenizer=None,
               separator_id: int | None = None, vocab_size: int | None = None):
    self.text_field = text_field
    self.tokens_field = tokens_field
    self.tokenizer = tokenizer
    self.separator_id = separator_id
    self.vocab_size = vocab_size  # ids must be < vocab_size (the model's) when set

  def needs_tokenizer(self, record) -> bool:
    return isinstance(record, dict) and record.get(self.tokens_field) is None

  def __call__(self, record, separator: bool = True) -> np.ndarray:
    if isinstance(record, dict):
      toks = record.get(self.tokens_field)
      if toks is None:
        text = record.get(self.text_field)
        if text is None:
          raise ValueError(
              f"record has neither data.tokens_field={self.tokens_field!r} nor "
              f"data.text_field={self.text_field!r}; its fields: {sorted(record)[:10]}")
        if not isinstance(text, str):
          raise ValueError(f"data.text_field={self.text_field!r} holds a "
                           f"{type(text).__name__}, not a string")
        if self.tokenizer is None:
          raise ValueError("records hold text: pass tokenizer=... (an object with "
                           "encode(text) -> list[int], e.g. condattn_jax.data.tokenizer)")
        toks = self.tokenizer.encode(text)
      try:
        ids = np.asarray(toks, dtype=np.int64)
      except (TypeError, ValueError, OverflowError):
        raise ValueError(f"data.tokens_field={self.tokens_field!r} is not a list of token "
                         "ids") from None
    else:
      ids = np.asarray(record, dtype=np.int64)
    if ids.ndim != 1:
      raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    hi = np.iinfo(np.int32).max if self.vocab_size is None else self.vocab_size - 1
    if ids.size and (ids.min() < 0 or ids.max() > hi):
      bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
      raise ValueError(f"token id {bad} is outside [0, {hi}]" + (
          f" (the model's vocab_size is {self.vocab_size}: ids beyond it have no embedding)"
          if self.vocab_size is not None else ""))
    ids = ids.astype(np.int32)
    if separator and self.separator_id is not None:
      ids = np.concatenate([ids, np.array([self.separator_id], np.int32)])
    return ids

  def prompt_answer(self, record, prompt_field: str, answer_field: str) -> tuple[np.ndarray, int]:
    """A prompt / answer record -> (int32 ids of prompt + answer (+ separator), the prompt's
    token count). Each field holds text (the answer is encoded without a BOS) or token ids."""
    if not isinstance(record, dict) or prompt_field not in record or answer_field not in record:
      fields = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
      raise ValueError(f"record lacks data.prompt_field={prompt_field!r} or data.answer_field="
                       f"{answer_field!r}; its fields: {fields}")
    parts = []
    for name, value, bos in ((prompt_field, record[prompt_field], None),
                             (answer_field, record[answer_field], False)):
      if isinstance(value, str):
        if self.tokenizer is None:
          raise ValueError(f"record field {name!r} holds text: pass tokenizer=... or set "
                           "data.tokenizer")
        try:
          value = self.tokenizer.encode(value, add_bos=bos)
        except TypeError:  # a plain encode(text) tokenizer (no BOS switch)
          value = self.tokenizer.encode(value)
      parts.append(self({self.tokens_field: value}, separator=False))
    ids = np.concatenate(parts + ([np.array([self.separator_id], np.int32)]
                                  if self.separator_id is not None else []))
    return ids.astype(np.int32), int(parts[0].shape[0])


class UnknownTask(ValueError):
  """A record's task name is not in the task list: a config / data mismatch, never skipped."""


def task_id(name, task_names: Sequence[str]) -> int:
  """A task name -> its index in `task_names` (model.scheme.task_names = data.task_names);
  an unknown name is an UnknownTask (ValueError) naming it and the known ones, on one line."""
  try:
    return list(task_names).index(name)
  except ValueError:
    raise UnknownTask(f"task {name!r} is not one of model.scheme.task_names "
                      f"{list(task_names)}; add it there (with its target) or fix the "
                      "record's task field.") from None


class RecordToTask:
  """Record -> its task id: record[field] (a task name) mapped by `task_id`."""

  def __init__(self, field: str, task_names: Sequence[str]):
    self.field = field
    self.task_names = tuple(task_names)

  def __call__(self, record) -> int:
    if not isinstance(record, dict) or self.field not in record:
      fields = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
      raise ValueError(f"record has no task field data.task_field={self.field!r}; its fields: "
                       f"{fields}")
    return task_id(record[self.field], self.task_names)
