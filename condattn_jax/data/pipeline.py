"""Grain input pipeline: source -> shuffle -> pack -> batch, per-process, resumable.

Global order contract (multi-host):
  The global batch has B = data.batch_size rows. Row r of every global batch comes from
  LANE r: lane r reads the (shuffled, repeated) document stream at indices r, r + B,
  r + 2B, ... and packs those documents on its own, so the k-th row of lane r depends on
  nothing but (config, r, k). Process p of P owns the contiguous lanes
  [p * B/P, (p + 1) * B/P) and reads only their documents. Hence, for any P dividing B,

      concatenate([batch_k of process 0, ..., batch_k of process P-1], axis=0)
          == batch_k of a single process (P = 1)

  row for row, for every k; it is exactly the layout `jax.make_array_from_process_local_data`
  expects when the batch axis is sharded over processes in process order (check it with
  `data_shard_for_sharding`, which returns the (shard_index, shard_count) to pass as
  (process_index, process_count) for any sharding).

Resumption: `iterator.get_state()` is a JSON-serialisable dict (grain's
  `grain.checkpoint.CheckpointHandler` / `CheckpointSave` save it per process);
  `set_state(state)` on a fresh iterator built from the same config and the same
  (process_index, process_count) continues with exactly the batch that followed. A state
  from another process layout or batch size is refused with a clear error.

Finite epochs (`data.num_epochs` an int): lanes run out at different points; training
  stops at the first batch in which one of this process's lanes is exhausted. Processes
  may then disagree on the number of batches: for multi-host training leave
  num_epochs=None and bound the run by steps. `make_eval_batches` instead pads exhausted
  lanes with empty rows (segment_ids 0, loss_mask 0) so every document is used once.

Tasks (`data.task_field`): every record names its task; batches carry `task_ids` int32
  [B_local], row r's index into data.task_names (= model.scheme.task_names). Each lane packs
  one task per row (packing.py), so the lane contract and the resumable state above hold
  unchanged; empty (eval padding) rows have task 0 and loss_mask 0.

Prompts (`data.prompt_field` + `data.answer_field`): every record is a prompt and its answer;
  batches carry `prompt_lengths` int32 [B_local] (the prompt's tokens at the start of the row's
  one document; 0 in empty rows), rows hold one document ('one_per_row'), and with
  data.loss_on='answer' only the answer's targets are scored.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import weakref
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from condattn_jax.data import packing as packing_lib
from condattn_jax.data import sources
from condattn_jax.data import synthetic
from condattn_jax.data.config import DataConfig, parse_data_config

_STATE_VERSION = 1


# ----------------------------------------------------------------------------- sources

class _BadRecord:
  """Stands in for a record the source could not decode (the reason is kept)."""

  def __init__(self, reason: str):
    self.reason = reason


class _Located:
  """A source whose items are (index, record | _BadRecord): the map step can then name the
  record's file and line (`src.where(index)`) whatever shuffling / slicing happened."""

  def __init__(self, src):
    self.src = src

  def __len__(self) -> int:
    return len(self.src)

  def __getitem__(self, index):
    try:
      return int(index), self.src[index]
    except ValueError as e:
      return int(index), _BadRecord(str(e))

  def where(self, index) -> str:
    where = getattr(self.src, "where", None)
    return where(index) if where is not None else f"record {int(index) + 1}"


class BadRecordCounter:
  """Counts (and logs) records skipped with data.on_bad_record='skip'."""

  LOG_FIRST = 20

  def __init__(self):
    self.count = 0
    self._lock = threading.Lock()

  def add(self, where: str, reason: str) -> None:
    with self._lock:
      self.count += 1
      n = self.count
    if n <= self.LOG_FIRST or n % 1000 == 0:
      logging.warning("data: skipped bad record %s: %s (%d skipped so far; "
                      "data.on_bad_record='skip')", where, reason, n)

  def __getstate__(self):
    return {"count": self.count}

  def __setstate__(self, d):
    self.count = d["count"]
    self._lock = threading.Lock()


SKIPPED = BadRecordCounter()  # process-wide count of skipped records


class _ToFeatures:
  """(index, record) -> document_features(tokens) (None for documents of < 2 tokens and for
  skipped bad records), + the task id (packing.TASK_KEY) when `to_task` is given. Errors name
  the record's file and 1-based line; an unknown task name is an error even with
  on_bad_record='skip' (the task list is wrong, not the record)."""

  def __init__(self, to_tokens: sources.RecordToTokens, located: _Located, on_bad_record: str,
               to_task: sources.RecordToTask | None = None, prompt_answer: tuple = (),
               answer_only: bool = False, seq_len: int | None = None):
    self.to_tokens = to_tokens
    self.located = located
    self.on_bad_record = on_bad_record
    self.to_task = to_task
    self.prompt_answer = tuple(prompt_answer)  # (prompt_field, answer_field) or ()
    self.answer_only = answer_only
    self.seq_len = seq_len

  def __call__(self, item):
    index, record = item
    try:
      if isinstance(record, _BadRecord):
        raise ValueError(record.reason)
      task = None if self.to_task is None else self.to_task(record)
      if self.prompt_answer:
        ids, n_prompt = self.to_tokens.prompt_answer(record, *self.prompt_answer)
        if self.seq_len is not None and ids.shape[0] > self.seq_len + 1:
          raise ValueError(f"prompt + answer = {ids.shape[0]} tokens, longer than data.seq_len "
                           f"+ 1 = {self.seq_len + 1} (one document per row; cut, it would lose "
                           "its answer)")
        feats = packing_lib.document_features(ids, n_prompt, self.answer_only)
      else:
        feats = packing_lib.document_features(self.to_tokens(record))
      if feats is not None and task is not None:
        feats[packing_lib.TASK_KEY] = np.int32(task)
      return feats
    except sources.UnknownTask as e:
      raise ValueError(f"{self.located.where(index)}: {e}") from None
    except ValueError as e:
      where = self.located.where(index)
      if self.on_bad_record == "skip":
        SKIPPED.add(where, str(e))
        return None
      raise ValueError(f"{where}: {e} (fix the record, or set data.on_bad_record=skip to skip "
                       "bad records)") from None


def _separator_id(dc: DataConfig, tokenizer) -> int | None:
  if not dc.append_separator:
    return None
  if dc.separator_id is not None:
    return int(dc.separator_id)
  sep = getattr(tokenizer, "document_separator_id", None) if tokenizer is not None else None
  if sep is None:
    raise ValueError("data.append_separator=True needs a separator id: set data.separator_id, "
                     "pass a tokenizer with document_separator_id, or set "
                     "data.append_separator=False")
  return int(sep)


def _resolve_tokenizer(dc: DataConfig, tokenizer):
  """An explicit tokenizer wins; else data.tokenizer (a path) is loaded with
  condattn_jax.data.tokenizer.load_tokenizer."""
  if tokenizer is not None or dc.tokenizer is None:
    return tokenizer
  if not isinstance(dc.tokenizer, str):
    return dc.tokenizer
  from condattn_jax.data import tokenizer as tokenizer_lib
  try:
    return tokenizer_lib.load_tokenizer(dc.tokenizer)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"data.tokenizer={dc.tokenizer}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except  (tokenizers' parse errors)
    raise ValueError(f"data.tokenizer={dc.tokenizer}: cannot load the tokenizer "
                     f"({type(e).__name__}: {e}).") from None


def check_vocab(dc: DataConfig, vocab_size: int | None, tokenizer=None) -> None:
  """Token ids the data can produce vs the model's vocab_size (ids >= vocab_size have no
  embedding: the loss is NaN at step 1). Raises ValueError naming the fields."""
  if not vocab_size:
    return
  if dc.pad_id is not None and not 0 <= int(dc.pad_id) < vocab_size:
    raise ValueError(f"data.pad_id={dc.pad_id} is outside the model's vocabulary "
                     f"[0, {vocab_size}).")
  if dc.is_synthetic:
    task = synthetic.make_task(dc.source, dc.task, dc.seq_len)
    if task.vocab_size > vocab_size:
      raise ValueError(f"data.task.vocab_size={task.vocab_size} exceeds the model's vocab_size="
                       f"{vocab_size}: token ids >= {vocab_size} have no embedding. Set "
                       f"data.task.vocab_size <= {vocab_size} or a larger model.vocab_size.")
    return
  tv = getattr(tokenizer, "vocab_size", None)
  if tv is not None and int(tv) > vocab_size:
    raise ValueError(f"the tokenizer (data.tokenizer={dc.tokenizer}) has {tv} tokens but the model's "
                     f"vocab_size is {vocab_size} (model.vocab_size / init_from's config.json): use "
                     "the model's own tokenizer.")


def _document_dataset(dc: DataConfig, paths: Sequence[str], *, tokenizer, seed: int | None,
                      num_epochs: int | None, field: str,
                      vocab_size: int | None = None) -> grain.MapDataset:
  tokenizer = _resolve_tokenizer(dc, tokenizer)
  check_vocab(dc, vocab_size, tokenizer)
  src = sources.open_source(dc.source, paths, text_field=dc.text_field,
                            tokens_field=dc.tokens_field, record_format=dc.record_format,
                            field=field, task_field=dc.task_field,
                            prompt_fields=(dc.prompt_field, dc.answer_field) if dc.with_prompts
                            else ())
  if len(src) == 0:
    raise ValueError(f"{field}: the files {list(paths)} hold no records")
  to_tokens = sources.RecordToTokens(text_field=dc.text_field, tokens_field=dc.tokens_field,
                                     tokenizer=tokenizer, vocab_size=vocab_size)
  located = _Located(src)
  first = _first_record(located, dc)
  if first is not None and dc.with_prompts:
    if tokenizer is None and any(isinstance(first.get(f), str)
                                 for f in (dc.prompt_field, dc.answer_field)):
      raise ValueError(f"{field}: records hold text in data.prompt_field={dc.prompt_field!r} / "
                       "answer_field: set data.tokenizer or pass tokenizer=...")
  elif first is not None and to_tokens.needs_tokenizer(first):
    if dc.text_field not in first:
      raise ValueError(f"{located.where(0)}: records have neither data.tokens_field="
                       f"{dc.tokens_field!r} nor data.text_field={dc.text_field!r}; "
                       f"fields of this record: {sorted(first)[:10]}")
    if tokenizer is None:
      raise ValueError(f"{field}: records hold text in {dc.text_field!r}: set data.tokenizer "
                       "(a tokenizer directory), pass tokenizer=..., or pre-tokenize into "
                       f"{dc.tokens_field!r}")
  to_tokens.separator_id = _separator_id(dc, tokenizer)
  if vocab_size and to_tokens.separator_id is not None and to_tokens.separator_id >= vocab_size:
    raise ValueError(f"the document separator id {to_tokens.separator_id} (data.separator_id or "
                     f"the tokenizer's) is outside the model's vocabulary [0, {vocab_size}).")
  ds = grain.MapDataset.source(located)
  if seed is not None:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  to_task = sources.RecordToTask(dc.task_field, dc.task_names) if dc.with_tasks else None
  prompt_answer = (dc.prompt_field, dc.answer_field) if dc.with_prompts else ()
  return ds.map(_ToFeatures(to_tokens, located, dc.on_bad_record, to_task, prompt_answer,
                            answer_only=dc.loss_on == "answer", seq_len=dc.seq_len))


def _first_record(located: _Located, dc: DataConfig, probe: int = 100):
  """The first decodable record (its fields decide tokenizer needs); with on_bad_record='error'
  a bad first record is an error naming its line."""
  for i in range(min(len(located), probe)):
    _, rec = located[i]
    if not isinstance(rec, _BadRecord):
      return rec
    if dc.on_bad_record == "error":
      raise ValueError(f"{located.where(i)}: {rec.reason} (fix the record, or set "
                       "data.on_bad_record=skip to skip bad records)")
  return None


def _synthetic_dataset(dc: DataConfig, *, seed: int, stream: int,
                       num_epochs: int | None) -> grain.MapDataset:
  task = synthetic.make_task(dc.source, dc.task, dc.seq_len)
  src = synthetic.SyntheticSource(task, seed, stream=stream)
  ds = grain.MapDataset.source(src)
  if task.num_examples is None:
    if num_epochs is not None:
      raise ValueError("data.num_epochs needs a finite synthetic dataset: set "
                       "data.task.num_examples (or leave num_epochs=None)")
    return ds
  ds = ds.shuffle(seed=seed)
  return ds.repeat(num_epochs)


# ------------------------------------------------------------------------------- lanes

class _LaneBatchIterDataset(grain.IterDataset):
  """Stacks one row from each lane into a [num_lanes, T] batch (+ task_ids [num_lanes] with
  with_tasks)."""

  def __init__(self, lanes: Sequence[grain.IterDataset], *, lane_start: int,
               global_batch_size: int, seq_len: int, pad_id: int, pad_exhausted: bool,
               with_tasks: bool = False, with_prompts: bool = False):
    super().__init__(list(lanes))
    self._meta = dict(lane_start=lane_start, global_batch_size=global_batch_size,
                      seq_len=seq_len, pad_id=pad_id, pad_exhausted=pad_exhausted,
                      with_tasks=with_tasks, with_prompts=with_prompts)

  def __iter__(self):
    return _LaneBatchIterator([p.__iter__() for p in self._parents], **self._meta)

  def __str__(self) -> str:
    return (f"LaneBatchIterDataset(lanes={len(self._parents)}, "
            f"lane_start={self._meta['lane_start']})")


class _LaneBatchIterator(grain.DatasetIterator):

  def __init__(self, parents, *, lane_start, global_batch_size, seq_len, pad_id,
               pad_exhausted, with_tasks=False, with_prompts=False):
    super().__init__(parents)
    self._with_tasks = with_tasks
    self._with_prompts = with_prompts
    self._lane_start = lane_start
    self._global_batch_size = global_batch_size
    self._seq_len = seq_len
    self._pad_id = pad_id
    self._pad_exhausted = pad_exhausted
    self._exhausted = [False] * len(parents)
    self._step = 0

  def __next__(self) -> dict[str, np.ndarray]:
    rows = []
    for i, it in enumerate(self._parents):
      if self._exhausted[i]:
        rows.append(None)
        continue
      try:
        rows.append(next(it))
      except StopIteration:
        self._exhausted[i] = True
        rows.append(None)
    if all(self._exhausted) or (not self._pad_exhausted and any(self._exhausted)):
      raise StopIteration
    empty = packing_lib.empty_row(self._seq_len, self._pad_id, self._with_tasks,
                                  self._with_prompts)
    rows = [empty if r is None else r for r in rows]
    self._step += 1
    return {k: np.stack([r[k] for r in rows]).astype(packing_lib.KEY_DTYPES[k])
            for k in packing_lib.batch_keys(self._with_tasks, self._with_prompts)}

  def get_state(self) -> dict[str, Any]:
    return {
        "version": _STATE_VERSION,
        "lane_start": self._lane_start,
        "num_lanes": len(self._parents),
        "global_batch_size": self._global_batch_size,
        "step": self._step,
        "exhausted": list(self._exhausted),
        # JSON-native (lists, not tuples): identical before and after a checkpoint.
        "lanes": json.loads(json.dumps([it.get_state() for it in self._parents])),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    mine = (self._lane_start, len(self._parents), self._global_batch_size)
    theirs = (state.get("lane_start"), state.get("num_lanes"),
              state.get("global_batch_size"))
    if state.get("version") != _STATE_VERSION or mine != theirs:
      raise ValueError(
          "data iterator state does not match this iterator: saved (lane_start, num_lanes, "
          f"global_batch_size) = {theirs}, this iterator has {mine}. Restore with the same "
          "data.batch_size and the same process_index/process_count it was saved with.")
    for it, s in zip(self._parents, state["lanes"]):
      it.set_state(_restore_tuples(s))
    self._exhausted = [bool(x) for x in state["exhausted"]]
    self._step = int(state["step"])


def _restore_tuples(state):
  """grain 0.2.18's ConcatThenSplit compares `remainder_slices` entries with the tuple
  (-1, -1); after a JSON round trip they are lists and the restore silently diverges.
  Turn them back into tuples."""
  if isinstance(state, dict):
    return {k: ({f: tuple(v) for f, v in s.items()} if k == "remainder_slices"
                and isinstance(s, dict) else _restore_tuples(s)) for k, s in state.items()}
  if isinstance(state, list):
    return [_restore_tuples(s) for s in state]
  return state


def _shard(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"bad process_index={process_index} / process_count={process_count}")
  if batch_size % process_count:
    raise ValueError(f"data.batch_size={batch_size} (global) is not divisible by "
                     f"process_count={process_count}")
  local = batch_size // process_count
  return process_index * local, local


def make_dataset(cfg, *, process_index: int = 0, process_count: int = 1, tokenizer=None,
                 seed: int | None = None, num_epochs: int | None | str = "config",
                 paths: Sequence[str] | None = None, pad_exhausted: bool = False,
                 stream: int = 0, prefetch: int | None = None,
                 vocab_size: int | None = None) -> grain.IterDataset:
  """The grain IterDataset of this process's batches ([B / process_count, T] dicts).

  `seed` overrides data.shuffle_seed, `num_epochs` data.num_epochs, `paths` data.paths,
  `prefetch` data.prefetch; `stream` separates synthetic train (0) and eval (1) draws.
  `vocab_size` (the model's): token ids are checked against it (`check_vocab` at once, every
  document's ids when read), so a mismatch is an error naming the field / file and line.
  """
  dc = parse_data_config(cfg)
  seed = dc.shuffle_seed if seed is None else seed
  epochs = dc.num_epochs if num_epochs == "config" else num_epochs
  lane_start, local = _shard(dc.batch_size, process_index, process_count)
  B = dc.batch_size
  if dc.is_synthetic:
    check_vocab(dc, vocab_size)
    docs = _synthetic_dataset(dc, seed=0 if seed is None else seed, stream=stream,
                              num_epochs=epochs)
  else:
    field = "data.paths" if paths is None else "data.eval_paths"
    docs = _document_dataset(dc, dc.paths if paths is None else paths, tokenizer=tokenizer,
                             seed=seed, num_epochs=epochs, field=field, vocab_size=vocab_size)
  read = grain.ReadOptions(num_threads=dc.read_threads,
                           prefetch_buffer_size=max(1, 4 * dc.read_threads))
  lanes = []
  for lane in range(lane_start, lane_start + local):
    ds = docs[lane::B].to_iter_dataset(read)
    if not dc.is_synthetic:
      ds = packing_lib.pack(ds, seq_len=dc.seq_len, packing=dc.packing,
                            pack_bins=dc.pack_bins, seed=lane, tasks=dc.with_tasks,
                            prompts=dc.with_prompts)
      ds = ds.map(_PackedToRow(dc.pad_id))
    lanes.append(ds)
  out = _LaneBatchIterDataset(lanes, lane_start=lane_start, global_batch_size=B,
                              seq_len=dc.seq_len, pad_id=dc.pad_id,
                              pad_exhausted=pad_exhausted, with_tasks=dc.with_tasks,
                              with_prompts=dc.with_prompts)
  n_prefetch = dc.prefetch if prefetch is None else prefetch
  if n_prefetch > 0:
    out = grain.experimental.ThreadPrefetchIterDataset(out, prefetch_buffer_size=n_prefetch)
  return out


class _PackedToRow:

  def __init__(self, pad_id: int):
    self.pad_id = pad_id

  def __call__(self, packed):
    return packing_lib.packed_to_row(packed, self.pad_id)


# --------------------------------------------------------------------------- public API

def make_train_iterator(cfg, *, process_index: int = 0, process_count: int = 1,
                        tokenizer=None, vocab_size: int | None = None) -> grain.DatasetIterator:
  """Iterator over this process's share of every global training batch.

  Yields dicts of numpy arrays [data.batch_size // process_count, data.seq_len]:
  inputs, targets, segment_ids, positions (int32) and loss_mask (float32); with
  data.task_field also task_ids int32 [data.batch_size // process_count] (each row's index
  into data.task_names; rows never mix tasks, see packing.py). Has
  get_state() / set_state(state) (JSON-serialisable; see the module docstring).
  `tokenizer` (encode(text) -> list[int], document_separator_id) is needed only for
  file records holding text; `vocab_size` see make_dataset.
  """
  it = iter(make_dataset(cfg, process_index=process_index, process_count=process_count,
                         tokenizer=tokenizer, vocab_size=vocab_size))
  _LIVE_ITERATORS.add(it)
  return it


# The prefetch thread is a daemon thread. If it is still inside numpy/C++ code when the
# interpreter finalizes, Python 3.13 kills it with a forced unwind and the process aborts
# ("terminate called without an active exception", exit code 134). Stop every live
# iterator's threads at exit, before finalization.
_LIVE_ITERATORS: "weakref.WeakSet[grain.DatasetIterator]" = weakref.WeakSet()


@atexit.register
def _close_live_iterators():
  for it in list(_LIVE_ITERATORS):
    try:
      it.close()
    except Exception:  # pylint: disable=broad-except
      pass


def make_eval_batches(cfg, num_batches: int | None, seed: int, *, process_index: int = 0,
                      process_count: int = 1, tokenizer=None,
                      vocab_size: int | None = None) -> list[dict[str, np.ndarray]]:
  """A fixed list of evaluation batches (this process's rows), identical on every call.

  Synthetic sources draw from an eval stream separate from training (seed, stream 1).
  File sources read data.eval_paths (else data.paths) once, shuffled with `seed`;
  exhausted lanes are padded with empty rows (task id 0 with data.task_field, loss_mask 0);
  `num_batches=None` takes them all, and
  fewer than `num_batches` available is logged as a warning.
  """
  dc = parse_data_config(cfg)
  if dc.is_synthetic:
    finite = synthetic.make_task(dc.source, dc.task, dc.seq_len).num_examples is not None
    if num_batches is None and not finite:
      raise ValueError("make_eval_batches(num_batches=None) needs a finite synthetic set: "
                       "set data.task.num_examples or pass num_batches")
    ds = make_dataset(dc, process_index=process_index, process_count=process_count,
                      seed=seed, num_epochs=1 if finite else None, pad_exhausted=True,
                      stream=1, prefetch=0, vocab_size=vocab_size)
  else:
    ds = make_dataset(dc, process_index=process_index, process_count=process_count,
                      tokenizer=tokenizer, seed=seed, num_epochs=1,
                      paths=dc.eval_paths, pad_exhausted=True, prefetch=0,
                      vocab_size=vocab_size)
  out = []
  it = iter(ds)
  for batch in it:
    out.append(batch)
    if num_batches is not None and len(out) >= num_batches:
      break
  if num_batches is not None and len(out) < num_batches:
    logging.warning("make_eval_batches: only %d of the %d requested batches exist",
                    len(out), num_batches)
  return out


def batch_spec(cfg, *, global_batch: bool = True, process_count: int = 1) -> dict[str, Any]:
  """{key: jax.ShapeDtypeStruct} of a global (or per-process) batch: [b, T] per key, and
  task_ids [b] with data.task_field, prompt_lengths [b] with data.prompt_field."""
  import jax
  dc = parse_data_config(cfg, needs_files=False)
  b = dc.batch_size if global_batch else _shard(dc.batch_size, 0, process_count)[1]
  return {k: jax.ShapeDtypeStruct((b,) if k in packing_lib.ROW_KEYS else (b, dc.seq_len),
                                  np.dtype(packing_lib.KEY_DTYPES[k]))
          for k in packing_lib.batch_keys(dc.with_tasks, dc.with_prompts)}


def data_shard_for_sharding(sharding, global_shape: Sequence[int]) -> tuple[int, int]:
  """(shard_index, shard_count) of the batch rows this process's devices hold.

  Pass them as (process_index, process_count) to make_train_iterator. Raises if the rows
  a process holds are not one contiguous block of equal-size blocks.
  """
  B = int(global_shape[0])
  rows: set[int] = set()
  for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
    sl = idx[0] if idx else slice(None)
    rows.update(range(*sl.indices(B)))
  if not rows:
    raise ValueError("this process holds no rows of the batch")
  start, stop = min(rows), max(rows) + 1
  size = stop - start
  if len(rows) != size or B % size or start % size:
    raise ValueError(f"this process's batch rows {sorted(rows)[:8]}... are not a contiguous "
                     f"block of size dividing {B}; use a mesh whose batch axis is ordered "
                     "by process")
  return start // size, B // size


def make_global_batch(batch: Mapping[str, np.ndarray], sharding,
                      global_batch_size: int | None = None) -> dict[str, Any]:
  """Host batch (this process's rows) -> global jax.Arrays via
  `jax.make_array_from_process_local_data`.

  `sharding` is one jax.sharding.Sharding for every key or a {key: Sharding} mapping.
  `global_batch_size` defaults to what jax infers from the sharding (rows split over
  processes); pass data.batch_size to be explicit.
  """
  import jax
  out = {}
  for k, x in batch.items():
    s = sharding[k] if isinstance(sharding, Mapping) else sharding
    gshape = None if global_batch_size is None else (global_batch_size, *x.shape[1:])
    out[k] = jax.make_array_from_process_local_data(s, np.asarray(x), gshape)
  return out
