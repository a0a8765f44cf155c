"""Synthetic long-context tasks, generated on the fly.

Example `i` of a task is a pure function of (seed, stream, i):
`np.random.default_rng([seed, stream, i])` draws it (stream 0 = training, 1 = evaluation),
so any example can be regenerated and a restored iterator resumes exactly.

Every example is one row of exactly `seq_len` tokens (no packing):
  a token stream `s` of length T + 1; `inputs = s[:T]`, `targets = s[1:]`,
  `segment_ids = 1`, `positions = 0..T-1`, and `loss_mask` is 1 ONLY where the target is
  an answer token.

MQAR (multi-query associative recall, Zoology / Arora et al. 2024; MATCH App. B.3):
  vocabulary: 0 = filler, keys from [1, V/2), values from [V/2, V) (needs V >= 4).
  s = k_1 v_1 k_2 v_2 ... k_N v_N | filler ... query slots ... filler
  The query region starts at R0 = 2N + min_gap; it is cut into 2-token slots
  (R0 + 2j, R0 + 2j + 1). `num_queries` distinct keys are placed in randomly chosen
  slots as `k v` (key followed by its value), so the value is the next-token target of the
  key, and only that target is scored. Every query key sits at least `min_gap + 1`
  tokens after the value of its pair (in fact after every pair): a sliding window of
  w <= min_gap + 1 tokens at the query cannot see any pair, and L layers of window w
  reach at most L * (w - 1) back, so choose min_gap >= L * w for a multi-layer model.
  The slots are drawn uniformly (`query_power` None), or as Zoology's generator draws them
  (`query_power` = its power_a, 0.01 there): slot j (0-based) with probability proportional
  to (j + 1) ** (query_power - 1), without replacement, so most queries sit near the pairs.
  params: vocab_size, num_pairs, num_queries (None = num_pairs), min_gap, query_power,
  num_examples.

NIAH (needle in a haystack):
  vocabulary: 0 unused, 1 = NEEDLE marker, 2 = QUERY marker, 3 reserved,
  key/value tokens from [4, 4 + kv_vocab_size), filler from [4 + kv_vocab_size, V).
  s = filler ... NEEDLE key value ... filler ... QUERY key value      (s ends at the value)
  `num_needles` needles with distinct keys (the others are distractors) are placed
  without overlap in the haystack, each ending at least `min_gap` tokens before the
  query; the query asks the key of one of them and the `value_len` value tokens are the
  only scored targets. `depth` in [0, 1] pins the (single) needle's start to that
  fraction of the allowed range (None: uniform).
  params: vocab_size, kv_vocab_size, key_len, value_len, num_needles, depth, min_gap,
  num_examples.

`num_examples` None means an unbounded stream (index i is just the i-th draw); an int
makes a finite dataset that is shuffled and repeated by epochs like a file source.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

UNBOUNDED = 2**40  # length used for an unbounded synthetic stream


def _check_params(name: str, params: Mapping[str, Any], defaults: Mapping[str, Any]):
  unknown = sorted(set(params) - set(defaults))
  if unknown:
    raise ValueError(f"unknown data.task parameter(s) {unknown} for task {name!r}; "
                     f"valid: {sorted(defaults)}")
  return {**defaults, **params}


def _row(s: np.ndarray, loss_positions: np.ndarray) -> dict[str, np.ndarray]:
  t = s.shape[0] - 1
  loss_mask = np.zeros((t,), np.float32)
  loss_mask[loss_positions] = 1.0
  return {
      "inputs": s[:-1].astype(np.int32),
      "targets": s[1:].astype(np.int32),
      "segment_ids": np.ones((t,), np.int32),
      "positions": np.arange(t, dtype=np.int32),
      "loss_mask": loss_mask,
  }


@dataclasses.dataclass(frozen=True)
class MQAR:
  seq_len: int
  vocab_size: int = 8192
  num_pairs: int = 8
  num_queries: int | None = None
  min_gap: int = 0
  num_examples: int | None = None
  query_power: float | None = None  # None: uniform query slots; a > 0: p(j) ~ (j + 1)^(a - 1)

  DEFAULTS = dict(vocab_size=8192, num_pairs=8, num_queries=None, min_gap=0,
                  num_examples=None, query_power=None)

  def __post_init__(self):
    v, n, q = self.vocab_size, self.num_pairs, self.queries
    if v < 4:
      raise ValueError(f"data.task.vocab_size={v} must be >= 4 for mqar")
    if n < 1 or n > min(v // 2 - 1, v - v // 2):
      raise ValueError(f"data.task.num_pairs={n} must be in [1, {min(v // 2 - 1, v - v // 2)}] "
                       f"(distinct keys from [1, V/2), distinct values from [V/2, V) with "
                       f"vocab_size={v})")
    if not 1 <= q <= n:
      raise ValueError(f"data.task.num_queries={q} must be in [1, num_pairs={n}]")
    if self.min_gap < 0:
      raise ValueError(f"data.task.min_gap={self.min_gap} must be >= 0")
    if self.query_power is not None and not self.query_power > 0:
      raise ValueError(f"data.task.query_power={self.query_power} must be > 0 (Zoology: 0.01) "
                       "or None (uniform query slots)")
    if self.num_slots < q:
      need = 2 * n + self.min_gap + 2 * q - 1
      raise ValueError(
          f"mqar does not fit: 2*num_pairs + min_gap + 2*num_queries - 1 = {need} > "
          f"seq_len={self.seq_len}; lower num_pairs/num_queries/min_gap or raise seq_len")

  @property
  def queries(self) -> int:
    return self.num_pairs if self.num_queries is None else self.num_queries

  @property
  def query_start(self) -> int:
    return 2 * self.num_pairs + self.min_gap

  @property
  def num_slots(self) -> int:
    return max(0, (self.seq_len + 1 - self.query_start) // 2)

  def __len__(self) -> int:
    return UNBOUNDED if self.num_examples is None else self.num_examples

  def _slot_p(self) -> np.ndarray | None:
    """Probabilities of the query slots (None: uniform)."""
    if self.query_power is None:
      return None
    p = np.arange(1, self.num_slots + 1, dtype=np.float64) ** (self.query_power - 1.0)
    return p / p.sum()

  def example(self, seed: int, index: int, stream: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, stream, index])
    v, n, q = self.vocab_size, self.num_pairs, self.queries
    keys = rng.choice(np.arange(1, v // 2), size=n, replace=False)
    values = rng.choice(np.arange(v // 2, v), size=n, replace=False)
    s = np.zeros((self.seq_len + 1,), np.int32)
    s[0:2 * n:2] = keys
    s[1:2 * n:2] = values
    asked = rng.choice(n, size=q, replace=False)
    slots = rng.choice(self.num_slots, size=q, replace=False, p=self._slot_p())
    qpos = self.query_start + 2 * slots
    s[qpos] = keys[asked]
    s[qpos + 1] = values[asked]
    return _row(s, np.sort(qpos))


@dataclasses.dataclass(frozen=True)
class NIAH:
  seq_len: int
  vocab_size: int = 8192
  kv_vocab_size: int = 256
  key_len: int = 4
  value_len: int = 4
  num_needles: int = 1
  depth: float | None = None
  min_gap: int = 0
  num_examples: int | None = None

  DEFAULTS = dict(vocab_size=8192, kv_vocab_size=256, key_len=4, value_len=4,
                  num_needles=1, depth=None, min_gap=0, num_examples=None)
  NEEDLE, QUERY, FIRST_KV = 1, 2, 4

  def __post_init__(self):
    if self.kv_vocab_size < 2:
      raise ValueError(f"data.task.kv_vocab_size={self.kv_vocab_size} must be >= 2")
    if self.vocab_size < self.FIRST_KV + self.kv_vocab_size + 1:
      raise ValueError(f"data.task.vocab_size={self.vocab_size} leaves no filler tokens: "
                       f"need > 4 + kv_vocab_size = {self.FIRST_KV + self.kv_vocab_size}")
    if self.key_len < 1 or self.value_len < 1:
      raise ValueError("data.task.key_len and value_len must be >= 1")
    if self.num_needles < 1:
      raise ValueError(f"data.task.num_needles={self.num_needles} must be >= 1")
    if self.kv_vocab_size ** self.key_len < self.num_needles:
      raise ValueError("data.task: too few distinct keys for num_needles; raise "
                       "kv_vocab_size or key_len")
    if self.depth is not None and not (0.0 <= self.depth <= 1.0 and self.num_needles == 1):
      raise ValueError("data.task.depth must be in [0, 1] and needs num_needles == 1")
    if self.min_gap < 0:
      raise ValueError(f"data.task.min_gap={self.min_gap} must be >= 0")
    if self.free_haystack < 0:
      raise ValueError(
          f"niah does not fit in seq_len={self.seq_len}: num_needles * needle_len "
          f"({self.num_needles} * {self.needle_len}) + min_gap ({self.min_gap}) + query "
          f"({self.needle_len}) > seq_len + 1")

  @property
  def needle_len(self) -> int:
    return 1 + self.key_len + self.value_len

  @property
  def query_start(self) -> int:
    return self.seq_len + 1 - self.needle_len

  @property
  def free_haystack(self) -> int:
    # Slots for needle starts once needles and the gap are accounted for.
    return self.query_start - self.min_gap - self.num_needles * self.needle_len

  def __len__(self) -> int:
    return UNBOUNDED if self.num_examples is None else self.num_examples

  def example(self, seed: int, index: int, stream: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, stream, index])
    n, kl, vl = self.num_needles, self.key_len, self.value_len
    s = rng.integers(self.FIRST_KV + self.kv_vocab_size, self.vocab_size,
                     size=(self.seq_len + 1,), dtype=np.int64).astype(np.int32)
    keys: list[tuple[int, ...]] = []
    while len(keys) < n:
      k = tuple(rng.integers(0, self.kv_vocab_size, size=kl).tolist())
      if k not in keys:
        keys.append(k)
    keys_a = np.asarray(keys, np.int32) + self.FIRST_KV
    values = rng.integers(0, self.kv_vocab_size, size=(n, vl)).astype(np.int32) + self.FIRST_KV
    if self.depth is not None:
      offsets = np.array([int(round(self.depth * self.free_haystack))])
    else:
      offsets = np.sort(rng.integers(0, self.free_haystack + 1, size=n))
    starts = offsets + np.arange(n) * self.needle_len
    for j, p in enumerate(starts):
      s[p] = self.NEEDLE
      s[p + 1:p + 1 + kl] = keys_a[j]
      s[p + 1 + kl:p + self.needle_len] = values[j]
    target = int(rng.integers(0, n))
    q = self.query_start
    s[q] = self.QUERY
    s[q + 1:q + 1 + kl] = keys_a[target]
    s[q + 1 + kl:] = values[target]
    # Inputs whose next token is a value token: positions q + kl .. q + kl + vl - 1.
    return _row(s, np.arange(q + kl, q + kl + vl))


@dataclasses.dataclass(frozen=True)
class SuiteMix:
  """A mixture of the evaluation suite's token-level tasks (`condattn_jax.evaluation.tasks`):
  training rows of the tasks that `eval.py --suite=synthetic` / `--suite=tiny` ask, so a
  tokenizer-less model can be trained on them.

  Example i: a task drawn uniformly from `tasks` (None: every token-level task of `suite`), its
  sample built at length seq_len + 1 with the suite's parameters, as one row: inputs = the
  prompt and the answers, targets shifted by one, loss only on the answer tokens (MQAR's
  shorter prompt is right-padded with 0, unscored). Draws are keyed by (seed, stream, index) and
  never equal an evaluation sample (those are keyed by (eval seed, task, length, index)).
  pack (training only): `pack` samples of seq_len // pack ids each in one row, as packed
  documents (segment ids 1..pack, positions from 0 in each): `pack` times the scored answers of
  a row at the same row length (a model whose scheme runs a row as one document refuses it:
  train/config.py).
  params: vocab_size, suite, tasks, num_examples, pack.
  """
  seq_len: int
  vocab_size: int = 8192
  suite: str = "synthetic"
  tasks: tuple | None = None
  num_examples: int | None = None
  pack: int = 1

  DEFAULTS = dict(vocab_size=8192, suite="synthetic", tasks=None, num_examples=None, pack=1)

  def __post_init__(self):
    from condattn_jax.evaluation import tasks as suite_lib
    if self.pack < 1 or self.seq_len % self.pack:
      raise ValueError(f"data.task.pack={self.pack} must be >= 1 and divide data.seq_len="
                       f"{self.seq_len}.")
    names = suite_lib.suite_tasks(self.suite, tasks=self.tasks, token_level=True)
    if not names:
      raise ValueError(f"data.task: suite {self.suite!r} with tasks={self.tasks} has no "
                       f"token-level task; valid: {list(suite_lib.TOKEN_TASKS)}")
    object.__setattr__(self, "tasks", tuple(names))

  def __len__(self) -> int:
    return UNBOUNDED if self.num_examples is None else self.num_examples

  def example(self, seed: int, index: int, stream: int = 0) -> dict[str, np.ndarray]:
    if self.pack == 1:
      return self._sample_row(self.seq_len, seed, index, stream, index)
    n = self.seq_len // self.pack
    parts = [self._sample_row(n, seed, index * self.pack + j, stream, (index, j))
             for j in range(self.pack)]
    row = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    row["segment_ids"] = np.repeat(np.arange(1, self.pack + 1, dtype=np.int32), n)
    return row

  def _sample_row(self, length, seed, index, stream, key):
    from condattn_jax.evaluation import tasks as suite_lib
    rng = np.random.default_rng([seed, stream, *np.atleast_1d(key)])
    name = self.tasks[int(rng.integers(len(self.tasks)))]
    sample = suite_lib.token_sample(name, length + 1, index, seed=f"data/{seed}/{stream}",
                                    vocab_size=self.vocab_size, suite=self.suite)
    ids, mask = suite_lib.training_example(sample)
    s = np.zeros((length + 1,), np.int32)
    s[:len(ids)] = ids
    answer_pos = np.nonzero(np.asarray(mask))[0]
    return _row(s, answer_pos - 1)


TASKS = {"mqar": MQAR, "niah": NIAH, "suite": SuiteMix}


def make_task(name: str, params: Mapping[str, Any], seq_len: int):
  """Builds a task from its name and `data.task` params (missing ones default)."""
  if name not in TASKS:
    raise ValueError(f"unknown synthetic task {name!r}; valid tasks: {sorted(TASKS)}")
  cls = TASKS[name]
  full = _check_params(name, params, cls.DEFAULTS)
  if name == "suite" and full.get("tasks") is not None:
    full["tasks"] = tuple(full["tasks"])
  return cls(seq_len=seq_len, **full)


class SyntheticSource:
  """grain random-access source: `source[i]` is example i of `task` for (seed, stream)."""

  def __init__(self, task, seed: int, stream: int = 0):
    self.task = task
    self.seed = int(seed)
    self.stream = int(stream)

  def __len__(self) -> int:
    return len(self.task)

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    return self.task.example(self.seed, int(index), self.stream)

  def __repr__(self) -> str:
    return f"SyntheticSource({self.task!r}, seed={self.seed}, stream={self.stream})"
