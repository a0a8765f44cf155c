"""Packing documents into rows of T tokens, and the batch format.

A document of n tokens d_0..d_{n-1} becomes n - 1 (input, target) pairs
(d_j, d_{j+1}), all scored: targets never cross a document boundary and no slot is
spent on a token without a target. Documents with fewer than 2 tokens are dropped.
Rows are filled with grain's packers:

  'concat_then_split'  grain.experimental.ConcatThenSplitIterDataset: documents are
                       concatenated and cut every T pairs; no padding except at the end
                       of the stream. The piece after a cut is a new segment whose
                       positions restart at 0 (it cannot attend to the piece before).
  'first_fit'          grain.experimental.FirstFitPackIterDataset over `pack_bins` rows:
                       documents stay whole (padding fills the rest of a row); a
                       document longer than T is first cut into pieces of T pairs.
  'one_per_row'        'first_fit' with max_sequences_per_bin=1: every row holds one
                       document (or one piece of T pairs of a longer one), padded; for
                       schemes that declare packed_documents=False (train/config.py).

Row / batch format (numpy, one row shown; a batch stacks rows to [B, T]):
  inputs      int32    token ids (pad_id in padding)
  targets     int32    next token of the same document (pad_id in padding)
  segment_ids int32    0 = padding, documents 1, 2, ... within the row
  positions   int32    0, 1, ... restarting in every segment (0 in padding)
  loss_mask   float32  1 where the target is scored, 0 in padding
  task_ids    int32    [B] only with data.task_field: the row's task id (0 in empty rows)
  prompt_lengths int32 [B] only with data.prompt_field: the prompt's tokens at the start of the
                       row's one document (0 in empty rows); rows hold one document
                       ('one_per_row', refused otherwise)
The model attends q -> kv iff segment_ids equal (and nonzero) AND positions[kv] <=
positions[q]; `attention_mask` below is that rule in numpy, for tests.

Tasks (data.task_field set; first_fit only): a document's features carry its task id
(TASK_KEY, a scalar). A row's task is the task of every document in it: `pack(tasks=True)`
packs with a first fit in which each of the `pack_bins` bins takes the task of its first
document and then accepts only that task: a document goes to the first bin that is empty or
of its task and has room; when none has, all bins are emitted (grain's first-fit rule) and
the document starts new ones. Rows therefore never mix tasks (packed_to_row checks it) and
the iterator state is grain's own (unchanged: parent state + row). The cost is some padding
when a lane's documents come from more tasks than pack_bins (one task per row is what the
per-sample Lagrangian of Elastic needs). concat_then_split cuts documents across rows and
is refused with tasks.
"""

from __future__ import annotations

from typing import Any

import grain
from grain import experimental as gx
# grain's first-fit packer class (not re-exported; grain 0.2.18): subclassed for tasks.
from grain._src.python.dataset.transformations.packing_packed_batch import FirstFitPackedBatch
import numpy as np

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BATCH_DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
                "positions": np.int32, "loss_mask": np.float32}
TASK_KEY = "task_ids"  # [B] int32, only with data.task_field
PROMPT_KEY = "prompt_lengths"  # [B] int32, only with data.prompt_field
ROW_KEYS = (TASK_KEY, PROMPT_KEY)  # [B] keys: one value per row
KEY_DTYPES = {**BATCH_DTYPES, TASK_KEY: np.int32, PROMPT_KEY: np.int32}  # every key a batch may have
_PACKED = ("inputs", "targets", "loss_mask")


def batch_keys(with_tasks: bool = False, with_prompts: bool = False) -> tuple[str, ...]:
  """The keys of a batch: BATCH_KEYS (+ TASK_KEY with data.task_field, + PROMPT_KEY with
  data.prompt_field)."""
  return BATCH_KEYS + ((TASK_KEY,) if with_tasks else ()) + ((PROMPT_KEY,) if with_prompts
                                                             else ())


def document_features(tokens: np.ndarray, prompt_len: int | None = None,
                      answer_only: bool = False) -> dict[str, np.ndarray] | None:
  """Token ids of one document -> per-pair features (None if < 2 tokens). prompt_len: the
  first prompt_len tokens are the prompt (PROMPT_KEY, a scalar); answer_only: targets inside
  the prompt (target index < prompt_len) are not scored."""
  tokens = np.asarray(tokens, np.int32)
  if tokens.shape[0] < 2:
    return None
  n = tokens.shape[0] - 1
  feats = {"inputs": tokens[:-1], "targets": tokens[1:], "loss_mask": np.ones((n,), np.float32)}
  if prompt_len is not None:
    feats[PROMPT_KEY] = np.int32(prompt_len)
    if answer_only:
      feats["loss_mask"] = (np.arange(1, n + 1) >= prompt_len).astype(np.float32)
  return feats


class _SplitLong(gx.FlatMapTransform):
  """Cuts a document's pairs into pieces of at most T (first_fit only)."""

  max_fan_out = 1 << 20

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, element):
    n = element["inputs"].shape[0]
    if n <= self.seq_len:
      return [element]
    return [{k: v[i:i + self.seq_len] if k in _PACKED else v for k, v in element.items()}
            for i in range(0, n, self.seq_len)]  # pieces keep the document's task


class _RefuseLong(_SplitLong):
  """Documents with a prompt stay whole: one longer than T pairs is an error (cut, a piece
  would lose its answer or its prompt's start)."""

  def flat_map(self, element):
    n = element["inputs"].shape[0]
    if n > self.seq_len:
      raise ValueError(f"a prompt / answer record of {n + 1} tokens is longer than "
                       f"data.seq_len + 1 = {self.seq_len + 1}: raise data.seq_len or drop it")
    return [element]


class _OneTaskFirstFit(FirstFitPackedBatch):
  """grain's first fit where a bin takes the task of its first document: a document goes to the
  first bin that is empty or holds its task and has room; when none has, all bins are emitted
  (grain's rule for a document that fits nowhere) and it starts new ones. The other tasks' bins
  are shown to grain's first fit as full for the duration of the call."""

  def try_add_to_batch(self, element):
    task = int(element[TASK_KEY])
    if getattr(self, "_row_task", None) is None:
      self._row_task = np.full((self._num_packing_bins,), -1, np.int64)
    other = (self._row_task >= 0) & (self._row_task != task)
    free = self._flat_first_free_cell_per_row       # per feature: next free cell of each bin
    saved = [f[other].copy() for f in free]
    for f, cap in zip(free, self._capacities):
      f[other] = cap                                # full: no document (>= 1 pair) fits
    before = self._num_examples_per_row.copy()
    try:
      failing = super().try_add_to_batch(element)
    finally:
      for f, v in zip(free, saved):
        f[other] = v
    if failing is None:
      self._row_task[np.flatnonzero(self._num_examples_per_row != before)[0]] = task
    return failing


class _OneTaskFirstFitPackIterDataset(gx.FirstFitPackIterDataset):
  """grain's FirstFitPackIterDataset (iteration, state) with the `_OneTaskFirstFit` packer."""

  def __init__(self, parent, meta_features=(TASK_KEY,), **kw):
    super().__init__(parent, meta_features=meta_features, **kw)
    self._packer_cls = _OneTaskFirstFit


def pack(ds: grain.IterDataset, *, seq_len: int, packing: str, pack_bins: int = 4,
         seed: int = 0, tasks: bool = False, prompts: bool = False) -> grain.IterDataset:
  """Packs a stream of `document_features` dicts into grain packed rows. tasks=True: the dicts
  also hold TASK_KEY (a scalar task id) and no row mixes tasks (first_fit only; module
  docstring). prompts=True: the dicts hold PROMPT_KEY and every row holds one document
  ('one_per_row' only; a document longer than seq_len pairs is refused, not cut)."""
  lengths = {k: seq_len for k in _PACKED}
  one = dict(max_sequences_per_bin=1) if packing == "one_per_row" else {}
  if prompts and packing != "one_per_row":
    raise ValueError(f"data.prompt_field needs data.packing='one_per_row' (one document per "
                     f"row), not {packing!r}")
  split = _RefuseLong(seq_len) if prompts else _SplitLong(seq_len)
  if tasks or prompts:
    if packing not in ("first_fit", "one_per_row"):
      raise ValueError(f"packing {packing!r} cannot keep one task per row: use 'first_fit'")
    ds = gx.FlatMapIterDataset(ds, split)
    meta = ((TASK_KEY,) if tasks else ()) + ((PROMPT_KEY,) if prompts else ())
    cls = _OneTaskFirstFitPackIterDataset if tasks else gx.FirstFitPackIterDataset
    return cls(ds, length_struct=lengths, num_packing_bins=pack_bins, seed=seed,
               shuffle_bins=False, meta_features=meta, **one)
  if packing == "concat_then_split":
    return gx.ConcatThenSplitIterDataset(ds, length_struct=lengths,
                                         split_full_length_features=True)
  if packing in ("first_fit", "one_per_row"):
    ds = gx.FlatMapIterDataset(ds, _SplitLong(seq_len))
    return gx.FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=pack_bins,
                                      seed=seed, shuffle_bins=False, **one)
  raise ValueError(f"unknown packing {packing!r}; valid: ['concat_then_split', 'first_fit', "
                   "'one_per_row']")


def packed_to_row(packed: dict[str, Any], pad_id: int = 0) -> dict[str, np.ndarray]:
  """A grain packed element -> one row of the batch format."""
  seg = np.asarray(packed["inputs_segment_ids"], np.int32)
  pad = seg == 0
  inputs = np.asarray(packed["inputs"], np.int32)
  targets = np.asarray(packed["targets"], np.int32)
  if pad_id != 0 and pad.any():
    inputs = np.where(pad, pad_id, inputs).astype(np.int32)
    targets = np.where(pad, pad_id, targets).astype(np.int32)
  row = {
      "inputs": inputs,
      "targets": targets,
      "segment_ids": seg,
      "positions": np.where(pad, 0, np.asarray(packed["inputs_positions"], np.int32)),
      "loss_mask": np.where(pad, 0.0, np.asarray(packed["loss_mask"], np.float32)).astype(
          np.float32),
  }
  if TASK_KEY in packed:  # the row's documents' task ids (a list): one task per row
    tasks = {int(t) for t in packed[TASK_KEY]}
    if len(tasks) != 1:
      raise AssertionError(f"a packed row holds documents of tasks {sorted(tasks)}")
    row[TASK_KEY] = np.int32(tasks.pop())
  if PROMPT_KEY in packed:  # one document per row: one prompt length
    (n,) = [int(x) for x in packed[PROMPT_KEY]]
    row[PROMPT_KEY] = np.int32(n)
  return row


def empty_row(seq_len: int, pad_id: int = 0, with_tasks: bool = False,
              with_prompts: bool = False) -> dict[str, np.ndarray]:
  """An all-padding row (nothing attended, nothing scored; task 0 with_tasks, prompt length 0
  with_prompts)."""
  row = {"inputs": np.full((seq_len,), pad_id, np.int32),
         "targets": np.full((seq_len,), pad_id, np.int32),
         "segment_ids": np.zeros((seq_len,), np.int32),
         "positions": np.zeros((seq_len,), np.int32),
         "loss_mask": np.zeros((seq_len,), np.float32)}
  if with_tasks:
    row[TASK_KEY] = np.int32(0)
  if with_prompts:
    row[PROMPT_KEY] = np.int32(0)
  return row


def attention_mask(segment_ids: np.ndarray, positions: np.ndarray,
                   window: int | None = None) -> np.ndarray:
  """[..., T] -> [..., T(q), T(kv)] bool: same nonzero segment AND kv_pos <= q_pos
  (AND q_pos - kv_pos < window). The model's own rule: the one mask builder (ops.MaskSpec)."""
  from pallas_kernels.compact_attention.reference import dense_mask  # lazy: jax, tests only
  seg, pos = np.asarray(segment_ids), np.asarray(positions)
  lead, T = seg.shape[:-1], seg.shape[-1]
  seg, pos = seg.reshape(-1, T), pos.reshape(-1, T)
  return np.asarray(dense_mask(pos, pos, seg, seg, window=window)).reshape(*lead, T, T)
