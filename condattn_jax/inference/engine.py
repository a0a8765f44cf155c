"""The inference engine: batched ragged prefill, chunked prefill, decode and generation (greedy
or sampled, stop tokens / strings, per-row routing statistics) over any scheme's cache.

    engine = Engine.from_checkpoint("runs/l2a", cache_len=4096, theta=0.7)   # a train.py run
    engine = Engine(model_cfg, params, cache_len=4096, prefill_chunk=1024)   # or in memory
    out = engine.generate([[1, 5, 9], [4, 4]], max_new_tokens=32, stop_tokens=(2,))
    outs = engine.serve(many_prompts, max_new_tokens=32, slots=8)   # continuous batching
    outs = engine.serve([Request(p, temperature=0.8, seed=1), q], 32, slots=8)   # per request
    out.tokens        # per row: the generated ids (up to and including a stop token)
    out.text          # per row: the decoded text (with a tokenizer), cut before a stop string
    out.stats         # per row: the scheme's routing statistics, prompt and generated apart
    out.logits        # per row: [n, V] logits that chose them (with return_logits=True)

How it drives a scheme: every step is one `Decoder.apply(..., decode=True, cache_len,
mutable=['cache'])` on a chunk [B, C] with per-row positions and a validity mask (ragged rows are
right-padded; padding tokens are never written to a cache and never attended). Each layer owns
its cache, one per layer (`cache/layers_{i}`: the decoder's `unroll_layers` mode), donated to the
jitted step and written in place (`stacked_cache` views it in the scanned layout). A layer's
cache: `models.layers.KVCache` (per-row lengths, full or window ring; a dense model's layers
after the first hold key / value only, their positions / valid / length are layers_0's:
`models.layers.shares_kv_state`; L2A: a window ring for the local branch and a full cache for
the global branch, written for every token, read only by tokens routed global). Beyond that,
the layers of any scheme that hold one kind of cache (the same sub-path, the same shapes) share its
positions / valid / length too: the engine keeps them once, in the first such layer, and hands
that copy to every layer (`cache_shapes`; `stacked_cache` gives every layer's view). The engine
never names a scheme: it threads the 'cache' collection, whose
structure it reads off the model (`init_cache`: zeros of the abstract cache), collects the
per-row entries of the layers' aux (`Generation.stats`), and reads one optional declaration of
the scheme's layer class:
  `decode_chunk(config) -> int`  a decode call's chunk must divide this many tokens (segmented:
                                 segment_len); the engine then picks a valid prefill chunk itself.
Attention inside the chunk goes through `ops.attention` with the cache's kv positions, i.e. the
fused kernels on GPU/TPU (the reference on CPU). Decode runs one jitted step per token.

Bad input is a ValueError with a one-line message (token ids outside [0, vocab) or not integers,
an empty request list or prompt, max_new_tokens < 1, a prompt + new tokens longer than the cache,
sampling knobs out of range): never NaN logits or a silent wrong answer.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.inference import sampling
from condattn_jax.inference.text import TextStream
from condattn_jax.models.config import ModelConfig
from condattn_jax.models import stacking
from condattn_jax.models.decoder import Decoder

# Aux entries of a layer that hold one value per row: name ends in _B (+ more axes), [L, B, ...].
_ROW_AUX = re.compile(r"_B[A-Z]*$")


@dataclasses.dataclass
class Generation:
  """What `Engine.generate` returns (one entry per request row, in request order).

  tokens         generated ids (a stop token included; with a stop string, up to and including
                 the token that completed it)
  finish_reason  'stop_token' | 'stop_string' | 'length' (max_new_tokens reached)
  text           decoded generated text without a stop token, cut before a stop string (None
                 without a tokenizer)
  stats          the scheme's routing statistics: {'prompt': {...}, 'generated': {...}} per row,
                 each {'tokens': [L] tokens run through the layers, <aux name>: [L, ...]} for
                 every per-row aux entry of the scheme's layers (name ending in _B, _BN, ...):
                 when the aux counts tokens (it has `tokens_B`), each entry is its count per
                 token (L2A `global_tokens_B`: fraction of tokens routed global per layer; AHA
                 `full_BN`: full-attention usage per layer x head), else the mean over the
                 steps that ran the row (Elastic `fa_BK`: per-KV-head mode, 1 = full). The
                 generated part covers the generated tokens fed back (all but the last, which
                 is never run). {} for a scheme without per-row aux (dense). Entries are what
                 the layers' decode path returns (Elastic `rho_BN`: the fraction of the causal
                 (query, key) pairs a head skipped, per call, averaged over the calls).
                 The scheme module's per-row values (names ending in _B, ...) are under
                 'scheme': {'calls': calls that ran the row, <name>: their sum over those calls}
                 (MATCH `searches_B`: retrieval searches, i.e. recomputes of the retrieved K/V;
                 `retrieved_B`: retrieved chunks read, per query block of each call).
  logits         per row [n, V] float32 logits that chose the tokens (return_logits) or None
  prefill_s      wall seconds of the prefill (the time to the first token's logits)
  decode_s       wall seconds of the decode loop; steps: decode steps run
  cache_bytes    bytes of the cache the generation used (`cache_bytes`)
  ttft_s         (serve) per request: seconds from the call's start to its first token
  schedule       (serve) the calls in order: ('prefill', request, chunk) / ('decode', rows)
  counts         (serve) what the call ran: device_steps / host_steps (decode steps on the
                 device / through a host round trip), host_syncs (host waits on the device),
                 prefill_calls, prefill_row_tokens (rows x chunk tokens computed, padding
                 included), inserts, caches_made, idle_row_steps (free rows' steps while a
                 request waited or was being prefilled)
  """
  tokens: list[list[int]]
  finish_reason: list[str]
  text: list[str] | None
  stats: list[dict]
  logits: list[np.ndarray] | None
  prefill_s: float
  decode_s: float
  steps: int
  cache_bytes: int
  ttft_s: list[float] | None = None
  schedule: list[tuple] | None = None
  counts: dict | None = None


def cache_bytes(cache) -> int:
  """Bytes held by a cache pytree (what the device really allocates for it)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
  """The prompts as int32 arrays; a ValueError naming the row for an empty list, an empty or
  non-1-D prompt, a non-integer id or an id outside [0, vocab_size)."""
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
    raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}.")
  if len(prompts) == 0:
    raise ValueError("the request list is empty: give at least one prompt.")
  out = []
  for b, p in enumerate(prompts):
    if isinstance(p, (str, bytes)):
      raise ValueError(f"prompt {b} is text; tokenize it first (engine.tokenizer.encode).")
    a = np.asarray(p)
    if a.ndim != 1:
      raise ValueError(f"prompt {b} must be a flat list of token ids, got shape {a.shape}.")
    if a.size == 0:
      raise ValueError(f"prompt {b} is an empty prompt; every prompt needs >= 1 token.")
    items = [] if hasattr(p, "dtype") else list(p)  # (a list's bools pass np.asarray as ints)
    bad = next((x for x in items if isinstance(x, (bool, np.bool_))
                or not isinstance(x, (int, np.integer))), None)
    if bad is None and a.dtype.kind not in "iu":  # an array of floats / objects
      bad = a[0].item() if hasattr(a[0], "item") else a[0]
    if bad is not None:
      raise ValueError(f"prompt {b} holds a non-integer token id ({bad!r}); ids are ints in "
                       f"[0, {vocab_size}).")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab_size:
      raise ValueError(f"prompt {b} holds token id {lo if lo < 0 else hi}, outside the model's "
                       f"vocabulary [0, {vocab_size}).")
    out.append(a.astype(np.int32))
  return out


def _check_ids(name: str, ids, vocab_size: int) -> tuple[int, ...]:
  ids = tuple(ids)
  for t in ids:
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab_size:
      raise ValueError(f"{name} holds {t!r}: ids are ints in [0, {vocab_size}).")
  return tuple(int(t) for t in ids)


@dataclasses.dataclass(frozen=True)
class Request:
  """One request of `Engine.serve`: a prompt (token ids) and its own knobs; a field left None
  takes the value serve was called with."""
  prompt: Sequence[int]
  max_new_tokens: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  seed: int | None = None
  stop_tokens: Sequence[int] | None = None
  stop_strings: Sequence[str] | None = None


@dataclasses.dataclass
class _Knobs:
  """One row's checked generation knobs (`check`: one-line errors naming `who`)."""
  max_new_tokens: int
  stop_tokens: frozenset
  stop_strings: tuple
  temperature: float
  top_p: float
  seed: int
  row: int = 0  # the row index its generator is drawn for (sampling.row_rng(seed, row))

  @classmethod
  def check(cls, engine, max_new_tokens, stop_tokens, stop_strings, temperature, top_p, seed,
            who: str) -> "_Knobs":
    V = engine.config.vocab_size
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) \
        or max_new_tokens < 1:
      raise ValueError(f"{who}: max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    stop = frozenset(_check_ids(f"{who}: stop_tokens", stop_tokens, V))
    if isinstance(stop_strings, str):
      stop_strings = (stop_strings,)
    stop_strings = tuple(stop_strings)
    if any(not isinstance(x, str) or not x for x in stop_strings):
      raise ValueError(f"{who}: stop_strings={stop_strings!r} must be non-empty strings.")
    if stop_strings and engine.tokenizer is None:
      raise ValueError(f"{who}: stop_strings / on_text need a tokenizer: load the engine with "
                       "Engine.from_checkpoint(..., tokenizer=<dir>) or set engine.tokenizer.")
    try:
      sampling.check_sampling(temperature, top_p)
    except ValueError as e:
      raise ValueError(f"{who}: {e}") from None
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
      raise ValueError(f"{who}: seed={seed!r} must be an int.")
    return cls(int(max_new_tokens), stop, stop_strings, float(temperature), float(top_p),
               int(seed))


class _Output:
  """One row's generated tokens, text, finish reason and (sampling) generator."""

  def __init__(self, knobs: _Knobs, tokenizer, keep_logits: bool, on_text, index: int):
    self.k, self.keep_logits, self.on_text, self.index = knobs, keep_logits, on_text, index
    self.rng = sampling.row_rng(knobs.seed, knobs.row)
    self.stream = TextStream(tokenizer, knobs.stop_strings) if tokenizer is not None else None
    self.tokens: list[int] = []
    self.kept: list[np.ndarray] = []
    self.reason = "length"
    self.done = False

  @property
  def needs_logits(self) -> bool:
    """The host needs this row's logits (else the on-device argmax id does)."""
    return self.k.temperature > 0 or self.keep_logits

  def push(self, logits_V, greedy_id) -> bool:
    """Chooses the next token (from logits_V when `needs_logits`, else greedy_id), streams its
    text; returns True when the row is done."""
    k = self.k
    t = greedy_id if logits_V is None else sampling.choose(
        logits_V, temperature=k.temperature, top_p=k.top_p, rng=self.rng)
    t = int(t)
    self.tokens.append(t)
    if self.keep_logits:
      self.kept.append(np.array(logits_V, copy=True))
    s = self.stream
    if s is not None and t not in k.stop_tokens:  # a stop token's text is not output
      delta = s.push(t)
      if self.on_text is not None and delta:
        self.on_text(self.index, delta)
    if t in k.stop_tokens:
      self.done, self.reason = True, "stop_token"
    elif s is not None and s.stopped:
      self.done, self.reason = True, "stop_string"
    elif len(self.tokens) >= k.max_new_tokens:
      self.done = True
    if self.done and s is not None and self.on_text is not None:
      rest = s.flush()
      if rest:
        self.on_text(self.index, rest)
    return self.done


class _RowStats:
  """Per-row sums of the layers' per-row aux over the steps of one part (prompt / generated).
  The steps' aux stay on the device until the first `row()`: no host sync between steps."""

  def __init__(self):
    self.sums: dict[str, np.ndarray] = {}
    self.module_sums: dict[str, np.ndarray] = {}   # the scheme module's per-row values [B, ...]
    self.steps_B = None
    self._pending: list[tuple[dict, np.ndarray]] = []

  def add(self, row_aux: dict, n_B: np.ndarray) -> None:
    """row_aux: {name: [L, B, ...]} of one step (device or host arrays); n_B: the step's valid
    tokens per row."""
    self._pending.append((row_aux, n_B if isinstance(n_B, jax.Array) else np.asarray(n_B)))

  def add_sums(self, sums: dict, module_sums: dict, steps_B) -> None:
    """Totals summed elsewhere (`Engine._greedy_step`: on the device, the rows a step did not
    run adding 0): sums {name: [L, B, ...]}, module_sums {name: [B, ...]}, steps_B [B]."""
    self._flush()
    for k, v in sums.items():
      self.sums[k] = self.sums.get(k, 0.0) + np.asarray(v, np.float64)
    for k, v in module_sums.items():
      self.module_sums[k] = self.module_sums.get(k, 0.0) + np.asarray(v, np.float64)
    steps = np.asarray(steps_B, np.float64)
    self.steps_B = steps if self.steps_B is None else self.steps_B + steps

  def _flush(self) -> None:
    pending, self._pending = jax.device_get(self._pending), []
    for row_aux, n_B in pending:
      ran_B = (n_B > 0).astype(np.float64)
      row_aux = dict(row_aux)
      for k, v in row_aux.pop("scheme", {}).items():
        v = np.asarray(v, np.float64)
        v = np.where(ran_B.reshape((-1,) + (1,) * (v.ndim - 1)) > 0, v, 0.0)
        self.module_sums[k] = self.module_sums.get(k, 0.0) + v
      if self.steps_B is None:
        self.steps_B = np.zeros_like(ran_B)
      self.steps_B += ran_B
      for k, v in row_aux.items():  # only the rows this step ran (a row it did not: 0)
        v = np.asarray(v, np.float64)
        v = np.where(ran_B.reshape((1, -1) + (1,) * (v.ndim - 2)) > 0, v, 0.0)
        self.sums[k] = self.sums.get(k, 0.0) + v

  def row(self, b: int) -> dict[str, np.ndarray]:
    if self._pending:
      self._flush()
    out = self._layers_row(b)
    if self.module_sums:
      out["scheme"] = {"calls": float(self.steps_B[b]),
                       **{k: v[b] for k, v in self.module_sums.items()}}
    return out

  def _layers_row(self, b: int) -> dict[str, np.ndarray]:
    if not self.sums:
      return {}
    if "tokens_B" in self.sums:
      tok_L = self.sums["tokens_B"][:, b]
      den = np.maximum(tok_L, 1.0)
      out = {k: v[:, b] / den.reshape((-1,) + (1,) * (v.ndim - 2))
             for k, v in self.sums.items() if k != "tokens_B"}
      return {"tokens": tok_L, **out}
    den = max(self.steps_B[b], 1.0)
    return {k: v[:, b] / den for k, v in self.sums.items()}


# The engine keeps each kind of cache's bookkeeping (positions / valid / length) once, in the
# first layer that holds that cache (the same sub-path of a layer's cache, the same shapes), like
# a dense model's layers_0 (`models.layers.shares_kv_state`), for every scheme. The step hands
# that copy to every layer and keeps the first layer's result. Exact for an engine cache: every
# chunk, step, row reset and row insert writes every layer's cache of one kind alike (each layer
# writes its new tokens at the same slots). It cuts the buffers a step takes and returns (the
# host pays for each buffer a call takes: bench/decode_program --buffers_probe).
_BOOK = ("positions", "valid", "length")


def _book_owners(full_cache) -> dict:
  """{(layer name, sub-path of a KVCache dict): owner layer name} for every KVCache dict of a
  layer (`layers_{i}`) that holds bookkeeping, owner = the first layer holding the same sub-path
  with the same shapes. Other entries of the cache (a scheme module's: MATCH's) are not shared."""
  owners, first = {}, {}

  def walk(name, d, path):
    if isinstance(d, dict) and "key" in d and all(k in d for k in _BOOK):
      sig = (path, tuple((k, tuple(d[k].shape)) for k in _BOOK))
      owners[(name, path)] = first.setdefault(sig, name)
    elif isinstance(d, dict):
      for k, v in d.items():
        walk(name, v, path + (k,))
  layer_names = [n for n in full_cache if re.fullmatch(r"layers_\d+", n)]
  for name in sorted(layer_names, key=lambda n: int(n.split("_")[1])):
    walk(name, full_cache[name], ())
  return owners


def _get(d, path):
  for k in path:
    d = d[k]
  return d


def _with(d, path, value):
  return value if not path else {**d, path[0]: _with(d[path[0]], path[1:], value)}


def _compress_book(cache, owners):
  """The cache without the bookkeeping of the layers that do not own it."""
  cache = dict(cache)
  for (name, path), owner in owners.items():
    if owner != name:
      kv = _get(cache[name], path)
      cache[name] = _with(cache[name], path, {k: v for k, v in kv.items() if k not in _BOOK})
  return cache


def _expand_book(cache, owners):
  """Every layer's KVCache dicts with their bookkeeping (the owner's)."""
  cache = dict(cache)
  for (name, path), owner in owners.items():
    if owner != name:
      book = {k: v for k, v in _get(cache[owner], path).items() if k in _BOOK}
      cache[name] = _with(cache[name], path, {**_get(cache[name], path), **book})
  return cache


# What Engine._abstract traces off models (the abstract cache, a step's aux shapes; tracing a
# 32-layer model costs ~1 s): keyed by (config, the registered scheme object, cache_len, batch
# size (None: the first asked), the params' tree, shapes, dtypes, shardings, what), oldest
# dropped past _ABSTRACT_CACHES_MAX.
_ABSTRACT_CACHES: dict = {}
_ABSTRACT_CACHES_MAX = 64


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _warn_unsplit_cache(cache_len: int, num_kv_heads: int) -> None:
  """On a GPU, a long cache whose length no part count divides (ops.decode_splits: parts of >=
  128 slots) runs cuDNN's decode in one program per (row, kv head): say so, with a length that
  splits."""
  from condattn_jax import ops
  if cache_len < 4096 or not _on_gpu() or ops.decode_splits(1, cache_len, num_kv_heads) > 1:
    return
  fit = -(-cache_len // 128) * 128
  warnings.warn(f"Engine(cache_len={cache_len}): no part count divides {cache_len} slots, so "
                "the GPU decode attention reads each kv head's cache in one program (about 5x "
                f"slower at 32K); use a multiple of 128, e.g. cache_len={fit}.", stacklevel=3)


class Engine:
  """Prefill / decode / generate for one model (any scheme) and one cache size.

  cache_len: slots of every full cache (>= prompt length + new tokens of every row).
  prefill_chunk: prompt tokens per prefill call (None: the whole padded prompt at once); chunked
    prefill bounds activation memory at long context.
  split_layers: hold the params in `models.stacking.split_groups`' layout (default): each
    layer's weights arrays of their own, made once here, so no step slices a stacked weight
    (XLA:GPU copies such a slice feeding a matmul into a new buffer every step). The engine
    keeps only that copy (a caller that keeps the stacked tree holds the weights twice; pass
    split_layers=False to step on the caller's tree instead). `engine.params` is the tree the
    steps take; `stacked_params()` gives the model's stacked tree (for a scanned forward).
    Same tokens and logits as the stacked layout (tested).
  """

  def __init__(self, model_cfg: ModelConfig, params, *, cache_len: int,
               prefill_chunk: int | None = None, split_layers: bool = True):
    if cache_len <= 0:
      raise ValueError(f"Engine(cache_len={cache_len}) must be > 0.")
    if prefill_chunk is not None and prefill_chunk <= 0:
      raise ValueError(f"Engine(prefill_chunk={prefill_chunk}) must be > 0 or None.")
    self.config = model_cfg
    self.model = Decoder(model_cfg)
    if split_layers and params is not None and stacking.has_stacked_groups(params):
      # (a tree given split is kept as is; abstract params, e.g. a compile-only engine, stay
      # abstract)
      abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
      params = (jax.eval_shape(stacking.split_groups, params) if abstract
                else _split_groups(params))
    self.params = params
    self.cache_len = int(cache_len)
    _warn_unsplit_cache(self.cache_len, model_cfg.num_kv_heads)
    self.prefill_chunk = prefill_chunk
    self._cache_shapes: dict[int, object] = {}
    self.tokenizer = None   # set by from_checkpoint (None: token ids in and out)
    self.run_config = None  # the train.py run config (from_checkpoint)
    self.step = None        # the checkpoint step loaded (from_checkpoint)

  def stacked_params(self):
    """The params in the model's stacked layout (what `model.apply` without unroll_layers takes:
    a scanned forward); a new copy where the engine holds them split."""
    if not any(isinstance(v, (tuple, list)) for v in self.params.values()):
      return self.params
    return _join_groups(self.params)

  # The jitted step depends on self only through (config, cache_len): engines that share them
  # share its compiled programs (a second Engine over other params compiles nothing).
  def _key(self):
    return (self.config, self.cache_len)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return type(other) is type(self) and other._key() == self._key()

  # ----------------------------------------------------------------------- from a checkpoint
  @classmethod
  def from_checkpoint(cls, path: str, *, step: int | None = None, cache_len: int | None = None,
                      prefill_chunk: int | None = None, tokenizer=None, devices=None,
                      config=None,
                      **scheme_options) -> "Engine":
    """An Engine over a train.py checkpoint: the weights and the model config saved with it.

    path: a run's workdir (its newest readable checkpoint), its checkpoints/ directory, or one
      step directory (`<workdir>/checkpoints/<step>`); `step` picks a step explicitly.
    scheme_options: test-time overrides of the run's scheme options (`config.model.scheme.<name>`,
      e.g. `theta=0.7` for L2A, `tau=0.5` for AHA); the scheme checks their names and values.
    cache_len: cache slots per row (default: the run's data.seq_len, the context it trained at).
    prefill_chunk: as in `Engine(...)`.
    tokenizer: a `condattn_jax.data.tokenizer.Tokenizer`, a tokenizer directory, or None: the
      run's `data.tokenizer`, else `model.init_from` when it holds a tokenizer.json, else none
      (`engine.tokenizer` is None: token ids in and out, e.g. the synthetic-task runs).
    devices: the devices to load onto (default: the first local device; the engine runs its
      steps on one device).
    config: the run config to use instead of the one saved with the checkpoint (e.g. with
      command-line overrides applied, as generate.py does); scheme_options still apply.
    The run config (with the overrides) is `engine.run_config`, the step loaded `engine.step`.
    A missing path, a directory that is not a run, or an unreadable checkpoint is a
    FileNotFoundError / ValueError whose one-line message names the path.
    """
    from condattn_jax import checkpoint as ckpt_lib
    from condattn_jax.train import loop
    ckpt_lib.resolve_checkpoint_path(path)  # a missing path / a non-run directory: one line
    config = (loop.config_from_checkpoint(path, step) if config is None
              else copy.deepcopy(config))  # the caller's config is never changed
    with config.unlocked():
      for k, v in scheme_options.items():
        if k == "name":
          raise ValueError("Engine.from_checkpoint: the scheme of a checkpoint cannot be changed "
                           "(name=...); convert dense weights with attention.convert.")
        config.model.scheme[k] = v
      # One device: the engine's steps are single-device (the run's mesh may be larger).
      config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
      config.mesh.sequence = 1  # a run's sequence parallelism does not apply to one device
    from condattn_jax import attention
    from condattn_jax.train import config as config_lib
    attention.options(config_lib.model_config(config)[0])  # the scheme checks the overrides
    tok = run_tokenizer(config, tokenizer)  # before the weights: a bad path fails fast
    devices = list(devices) if devices is not None else jax.local_devices()[:1]
    setup, params, loaded = loop.load_params(config, path, step=step, devices=devices)
    eng = cls(setup.model_cfg, params,
              cache_len=int(cache_len if cache_len is not None else config.data.seq_len),
              prefill_chunk=prefill_chunk)
    del params
    eng.run_config, eng.step = config, int(loaded)
    tv = getattr(tok, "vocab_size", None)
    if tv is not None and tv > setup.model_cfg.vocab_size:
      raise ValueError(f"the tokenizer ({getattr(tok, 'source', tok)}) has {tv} tokens but the "
                       f"model's vocabulary has {setup.model_cfg.vocab_size}; use the run's own "
                       "tokenizer.")
    eng.tokenizer = tok
    return eng

  # ------------------------------------------------------------------------------ the step
  @functools.partial(jax.jit, static_argnums=0, static_argnames=("static_fields",),
                     donate_argnums=(2,))
  def _step(self, params, cache, tokens_BT, positions_BT, valid_BT, prev_logits_BV,
            prompt_len_B=None, static_fields=()):
    """One chunk: writes its valid tokens into the caches; returns (cache, logits of each row's
    last valid token [B, V] (prev_logits where a row has none in this chunk), the layers'
    per-row aux entries {name: [L, B, ...]}). prompt_len_B (prefill): each row's prompt length,
    handed to the layers as ctx.fields['prompt_len_B'] (MATCH retrieves for the last m only).
    static_fields: ((name, python value), ...) the scheme layer's `prefill_fields` (prefill) or
    `decode_fields` (a one-token step) gave for this call, added to ctx.fields (static: one
    program per value; MATCH: whether the call retrieves / the step enters a block)."""
    # the bookkeeping kept once: every layer's view of it for the model
    owners = _book_owners(self._full_cache_shapes(tokens_BT.shape[0]))
    cache = _expand_book(cache, owners)
    (hidden_BTD, aux), variables = self.model.apply(
        {"params": params, "cache": cache}, tokens_BT, positions_BT,
        valid_BT.astype(jnp.int32), decode=True, cache_len=self.cache_len, return_hidden=True,
        fields={**({} if prompt_len_B is None else {"prompt_len_B": prompt_len_B}),
                **dict(static_fields)} or None,
        unroll_layers=True, mutable=["cache"])
    B = tokens_BT.shape[0]
    row_aux = {k: v.astype(jnp.float32) for k, v in aux.items()
               if _ROW_AUX.search(k) and getattr(v, "ndim", 0) >= 2 and v.shape[1] == B}
    model_level = {k: v.astype(jnp.float32) for k, v in aux.get("scheme", {}).items()
                   if _ROW_AUX.search(k) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == B}
    if model_level:  # the scheme module's per-row values (MATCH: searches_B, retrieved_B)
      row_aux["scheme"] = model_level
    n_B = jnp.sum(valid_BT, axis=1)
    last_BD = jnp.take_along_axis(hidden_BTD, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)[:, 0]
    logits_BV = jnp.einsum("bd,dv->bv", last_BD.astype(self.config.compute_dtype),
                           self.model.output_embedding(params).astype(self.config.compute_dtype),
                           preferred_element_type=jnp.float32)
    logits_BV = jnp.where((n_B > 0)[:, None], logits_BV, prev_logits_BV)
    return _compress_book(variables["cache"], owners), logits_BV, row_aux

  def _full_cache_shapes(self, batch_size: int):
    """The model's own abstract cache for `batch_size` rows (every layer's bookkeeping), read
    off the model once per (config, cache_len, abstract params): engines over the same model
    share it (_ABSTRACT_CACHES). The first batch size asked for is traced; when it is > 1 and
    every leaf of its cache is batch-first (its leading axis that size: every scheme's cache,
    which `serve` and `reset_rows` need), another batch size is that cache with its leading axis
    replaced (no second trace of the model), else it is traced too."""
    if batch_size not in self._cache_shapes:
      b0, first = self._abstract(None, "cache", lambda: (batch_size,
                                                         self._traced_cache(batch_size)))
      if b0 == batch_size:
        shapes = first
      elif b0 > 1 and all(x.ndim and x.shape[0] == b0 for x in jax.tree.leaves(first)):
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (batch_size,) + tuple(x.shape[1:]), x.dtype, weak_type=x.weak_type), first)
      else:
        shapes = self._abstract(batch_size, "cache", lambda: self._traced_cache(batch_size))
      self._cache_shapes[batch_size] = shapes
    return self._cache_shapes[batch_size]

  def _traced_cache(self, batch_size: int):
    """The model's abstract cache for `batch_size` rows, traced (jax.eval_shape of a one-token
    decode call)."""
    tok = jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)
    return jax.eval_shape(
        lambda p, t: self.model.apply({"params": p}, t, decode=True, cache_len=self.cache_len,
                                      unroll_layers=True, mutable=["cache"])[1]["cache"],
        self.params, tok)

  def _abstract(self, batch_size: int, what, trace):
    """trace()'s result, kept in _ABSTRACT_CACHES under (config, the registered scheme object,
    cache_len, batch size (None: any), the params' tree, shapes, dtypes, shardings, what):
    engines over the same model share it."""
    from condattn_jax.attention import get_scheme
    scheme = get_scheme(self.config.scheme)   # a scheme registered again under its name
    leaves, treedef = jax.tree.flatten(self.params)
    key = (self.config, id(scheme), self.cache_len, batch_size, treedef,
           tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves),
           what)
    if key not in _ABSTRACT_CACHES:
      _ABSTRACT_CACHES[key] = (scheme, trace())   # (the scheme held: its id stays its)
      while len(_ABSTRACT_CACHES) > _ABSTRACT_CACHES_MAX:
        _ABSTRACT_CACHES.pop(next(iter(_ABSTRACT_CACHES)))
    return _ABSTRACT_CACHES[key][1]

  def cache_shapes(self, batch_size: int):
    """The abstract cache (ShapeDtypeStructs) for `batch_size` rows: the model's, less the
    bookkeeping of the layers that do not own it (kept once per kind of cache)."""
    full = self._full_cache_shapes(batch_size)
    return _compress_book(full, _book_owners(full))

  def _commit(self, tree):
    """`tree` placed on the params' device (when they all live on one). The step's outputs are
    committed arrays: inputs made by jnp.zeros are not, and jit compiles the step once for each
    kind, so a chunked prefill would compile its step twice (minutes for a 7B model on a GPU)."""
    devs = {d for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)
            for d in x.devices()}
    dev = devs.pop() if len(devs) == 1 else (jax.devices()[0] if not devs else None)
    return tree if dev is None else jax.device_put(tree, dev)

  def stacked_cache(self, cache):
    """A view of an engine cache (one cache per layer, `layers_{i}`) in the scanned layout of
    the model's parameters (`layers` / `layers_{start}_{stop}` groups, a leading layer axis),
    i.e. the caches of the scanned decode (`Decoder` without unroll_layers): for inspection;
    `per_layer_cache` goes back. A cache that keeps its bookkeeping in layers_0 only
    (`models.layers.shares_kv_state`) gets layer 0's positions / valid / length in every layer."""
    from condattn_jax.attention import get_scheme
    from condattn_jax.models import layers, stacking
    B = jax.tree.leaves(cache)[0].shape[0]
    cache = _expand_book(dict(cache), _book_owners(self._full_cache_shapes(B)))
    if layers.shares_kv_state(self.config):
      kv0 = cache["layers_0"]["self_attn"]["cache"]
      book = {k: v for k, v in kv0.items() if k not in ("key", "value")}
      cache = {name: {**c, "self_attn": {**c["self_attn"], "cache": {
          **c["self_attn"]["cache"], **book}}} for name, c in cache.items()}
    return stacking.stack_layers(cache, get_scheme(self.config.scheme).layer_variants(
        self.config))

  def per_layer_cache(self, stacked):
    """The engine's layout (one cache per layer) of a cache in the scanned layout (layers after
    the first without positions / valid / length when the engine keeps them in layers_0 only)."""
    from condattn_jax.models import layers, stacking
    cache = stacking.unstack_layers(dict(stacked), self.config.num_layers)
    B = jax.tree.leaves(cache)[0].shape[0]
    cache = _compress_book(cache, _book_owners(self._full_cache_shapes(B)))
    if layers.shares_kv_state(self.config):
      for i in range(1, self.config.num_layers):
        c = cache[f"layers_{i}"]
        kv = {k: v for k, v in c["self_attn"]["cache"].items() if k in ("key", "value")}
        cache[f"layers_{i}"] = {**c, "self_attn": {**c["self_attn"], "cache": kv}}
    return cache

  def init_cache(self, batch_size: int):
    """Zeros in the structure of every layer's cache (read off the model, not hard-coded),
    on the params' device."""
    return self._commit(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                     self.cache_shapes(batch_size)))

  def chunk_for(self, longest_prompt: int) -> int:
    """The prefill chunk for a batch whose longest prompt has this many tokens: `prefill_chunk`,
    else the whole prompt, except that a scheme whose layer declares `decode_chunk(config)` gets
    a chunk dividing it (the smallest divisor >= the prompt, else decode_chunk itself). An
    explicit prefill_chunk that does not divide it is refused."""
    limit_fn = _layer_hook(self.config, "decode_chunk")
    limit = None if limit_fn is None else int(limit_fn(self.config))
    if self.prefill_chunk is not None:
      if limit is not None and limit % self.prefill_chunk:
        raise ValueError(f"Engine(prefill_chunk={self.prefill_chunk}) must divide {limit} (this "
                         f"scheme's decode chunk limit); use a divisor or prefill_chunk=None.")
      return int(self.prefill_chunk)
    if limit is None:
      return int(longest_prompt)
    return next((d for d in range(longest_prompt, limit) if limit % d == 0), limit)

  # ------------------------------------------------------------------------------ prefill
  def prefill(self, prompts: Sequence[Sequence[int]]):
    """Ragged batched prefill. Returns (cache, logits_BV of each prompt's last token, lengths_B)."""
    cache, logits, lengths, _ = self._prefill(check_prompts(prompts, self.config.vocab_size))
    return cache, logits, lengths

  def _prefill(self, prompts: list[np.ndarray]):
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if lengths.max() > self.cache_len:
      raise ValueError(f"prompt {int(lengths.argmax())} has {lengths.max()} tokens, more than "
                       f"cache_len={self.cache_len}; raise cache_len.")
    B = len(prompts)
    C = self.chunk_for(int(lengths.max()))
    self._warn_serving_notes(C, int(lengths.max()))
    P = -(-int(lengths.max()) // C) * C
    tokens = np.zeros((B, P), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = p
    positions = np.broadcast_to(np.arange(P, dtype=np.int32), (B, P))
    valid = positions < lengths[:, None]
    cache = self.init_cache(B)
    logits = self._commit(jnp.zeros((B, self.config.vocab_size), jnp.float32))
    stats = _RowStats()
    for c in range(0, P, C):
      sl = slice(c, c + C)
      cache, logits, row_aux = self._step(self.params, cache, jnp.asarray(tokens[:, sl]),
                                          jnp.asarray(positions[:, sl]),
                                          jnp.asarray(valid[:, sl]), logits,
                                          self._commit(jnp.asarray(lengths)),
                                          static_fields=self._prefill_fields(c, C, lengths))
      stats.add(row_aux, valid[:, sl].sum(1))
    return cache, logits, lengths, stats

  def _prefill_fields(self, start: int, chunk: int, lengths) -> tuple:
    """The static fields of the prefill call of `chunk` tokens at positions start .. (every
    row's): the scheme layer's `prefill_fields(config, start, chunk, lengths)` as sorted
    (name, value) pairs; () for a scheme without one (its step is unchanged)."""
    fn = _layer_hook(self.config, "prefill_fields")
    if fn is None:
      return ()
    return tuple(sorted(fn(self.config, int(start), int(chunk), np.asarray(lengths)).items()))

  def _decode_fields(self, positions_B, active_B) -> tuple:
    """The static fields of a one-token decode step at these (host) positions for the active
    rows: the scheme layer's `decode_fields(config, positions_B, active_B)` as sorted (name,
    value) pairs; () for a scheme without one."""
    fn = _layer_hook(self.config, "decode_fields")
    if fn is None:
      return ()
    return tuple(sorted(fn(self.config, np.asarray(positions_B), np.asarray(active_B)).items()))

  def _warn_serving_notes(self, chunk: int, longest_prompt: int) -> None:
    """The scheme layer's `serving_notes(config, chunk, longest_prompt)` (what this engine call
    does not serve as trained), each warned once per Engine."""
    fn = _layer_hook(self.config, "serving_notes")
    if fn is None:
      return
    seen = self.__dict__.setdefault("_serving_notes_seen", set())
    for note in fn(self.config, chunk, longest_prompt):
      key = note.split(":")[0]
      if key not in seen:
        seen.add(key)
        warnings.warn(note, stacklevel=3)

  # ----------------------------------------------------------------- continuous batching
  def reset_rows(self, cache, rows_B):
    """`cache` with the rows where rows_B is True emptied (as `init_cache`'s rows: every
    scheme's cache starts at zeros), the others untouched; a ValueError names a cache leaf
    whose first axis is not the batch."""
    m = np.asarray(rows_B, bool)
    self._check_batch_first(cache, m.shape[0], "Engine.reset_rows")
    return _reset_rows(cache, jnp.asarray(m))

  @staticmethod
  def _check_batch_first(cache, B: int, who: str = "Engine.serve") -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
      if x.ndim == 0 or x.shape[0] != B:
        raise ValueError(f"{who}: cache leaf {jax.tree_util.keystr(path)} has shape "
                         f"{x.shape}, not batch-first with {B} rows.")

  def serve(self, requests: Sequence, max_new_tokens: int, *, slots: int,
            stop_tokens: Sequence[int] = (), stop_strings: Sequence[str] = (),
            temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
            return_logits: bool = False,
            on_text: Callable[[int, str], None] | None = None,
            admit: int | None = None) -> Generation:
    """Continuous batching: many requests through `slots` fixed rows of one cache.

    requests: prompts (token-id lists) or `Request`s (a prompt with its own max_new_tokens,
      temperature, top_p, seed, stop_tokens, stop_strings; a None field takes serve's argument).
    Schedule: when no prefill is under way and every prompt prefilled before has its row, the
    next n = min(waiting requests, `admit` (None: slots)) requests are admitted together, ahead
    of free rows: their prompts are prefilled as one ragged batch (its own cache of A rows, A =
    n rounded up to a power of two and capped at `admit`, so at most log2(admit) + 1 prefill
    programs compile; the padding rows hold no token; a later admission of A rows reuses that
    cache, emptied; at most slots + admit rows of cache at once) in chunks of
    `chunk_for(longest prompt of the call)`, ONE chunk per iteration, interleaved with the
    decode steps of the rows already generating (they never wait for a whole prompt). A prompt
    whose last chunk ran takes the first free row as soon as there is one, in request order
    (inserted into the batch cache: every leaf is batch-first, the row is overwritten whole, so
    nothing of the row's previous request survives; the admission's later chunks hold none of
    its tokens), and the row decodes with the others, one token per step ([slots, 1]: the
    decode program every scheme declares). A row whose request finished (stop token, stop
    string, its max_new_tokens) takes the next prefilled prompt at the next iteration, so its
    slot idles at most one step while prompts wait prefilled. admit=1: one prompt per prefill.
    How the steps run (SERVE_ON_DEVICE; off: a host round trip every decode step) never changes
    the schedule, the tokens, finish reasons, steps or statistics:
      planned (every request greedy without stop tokens or stop strings, no kept logits, no
        streamed text): no decision needs a token, so the whole schedule follows from the
        budgets and is queued with no host wait: `_greedy_step`s on one state that lives
        across the call (a row's first token is the argmax of its prefill's logits), each
        insert and each finished row's retirement written into the state on the device, the
        ids read one GREEDY_IDS_BLOCK buffer at a time and pushed (text included) in the host
        loop's order; a request's statistics are its row's sums since its insert.
      otherwise: while no row can change (nothing to admit, every active request greedy with
        its first token out, no kept logits, stop strings or streamed text), the decode steps
        run on the device (`_serve_run`: `_greedy_step`s up to the least budget left, stop
        tokens flagged there; Elastic and MATCH only without stop tokens), their ids read once
        a run; a host round trip a step elsewhere.
    Each request gets what `generate` gives it: request i without its own seed draws as row i
    of `generate(prompts, seed=seed)`; a Request with seed s draws as `generate([prompt],
    seed=s)` (greedy is exact either way, up to the float rounding of batch composition).
    Returns a `Generation` in request order (stats per request: its prompt and its generated
    tokens); prefill_s is the time to the first request's first token on the host, decode_s
    the rest, steps the decode steps; `ttft_s` per request (from the call's start to its first
    token on the host: planned, when the ids buffer holding it is read) and `schedule`
    (('prefill', request, chunk) / ('decode', active rows) events) say how the requests were
    interleaved (a batched prefill chunk: one 'prefill' event per request with a token in it);
    `counts` what the call ran: decode steps on the device / through the host, host waits on
    the device (host_syncs), prefill calls and the rows x tokens they computed (padding
    included), inserts, prefill caches made, and the row-steps free rows idled while a request
    waited or was being prefilled. on_text(request, text): as in `generate`.
    """
    V = self.config.vocab_size
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
      raise ValueError(f"requests must be a list of prompts or Requests, got "
                       f"{type(requests).__name__}.")
    reqs = [r if isinstance(r, Request) else Request(r) for r in requests]
    rows = check_prompts([r.prompt for r in reqs], V)
    if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool) or slots < 1:
      raise ValueError(f"Engine.serve(slots={slots!r}) must be an int >= 1.")
    admit = int(slots) if admit is None else admit
    if not isinstance(admit, (int, np.integer)) or isinstance(admit, bool) or admit < 1:
      raise ValueError(f"Engine.serve(admit={admit!r}) must be an int >= 1 (or None: slots).")
    admit = min(int(admit), int(slots))
    default = _Knobs.check(self, max_new_tokens, stop_tokens, stop_strings, temperature, top_p,
                           seed, "Engine.serve")
    knobs = []
    for i, r in enumerate(reqs):
      pick = lambda name: getattr(default, name) if getattr(r, name) is None else getattr(r, name)
      k = _Knobs.check(self, pick("max_new_tokens"), pick("stop_tokens"), pick("stop_strings"),
                       pick("temperature"), pick("top_p"), pick("seed"), f"request {i}")
      k.row = i if r.seed is None else 0  # the row of the generate call it draws as
      if len(rows[i]) + k.max_new_tokens > self.cache_len:
        raise ValueError(f"request {i}: prompt ({len(rows[i])}) + max_new_tokens "
                         f"({k.max_new_tokens}) exceeds cache_len={self.cache_len}; raise "
                         "cache_len.")
      knobs.append(k)
    if self.tokenizer is None and on_text is not None:
      raise ValueError("on_text needs a tokenizer: load the engine with "
                       "Engine.from_checkpoint(..., tokenizer=<dir>) or set engine.tokenizer.")
    B, C = int(slots), self.chunk_for(max(len(p) for p in rows))
    self._warn_serving_notes(C, max(len(p) for p in rows))
    # planned: no decision needs a token's value (every request greedy, no stop token / string,
    # no kept logits or streamed text), so the whole schedule follows from the budgets and the
    # decode steps, prefill chunks, inserts and retirements are queued with no host wait
    planned = (self.SERVE_ON_DEVICE and not return_logits and on_text is None
               and all(k.temperature == 0 and not k.stop_tokens and not k.stop_strings
                       for k in knobs))
    t0 = time.perf_counter()
    cache = self.init_cache(B)
    self._check_batch_first(cache, B)
    logits = self._commit(jnp.zeros((B, V), jnp.float32))
    outs = [_Output(k, self.tokenizer, return_logits, on_text, i) for i, k in enumerate(knobs)]
    prompt_stats: list = [None] * len(reqs)   # (the admission's _RowStats, its row) until the end
    ttft = [0.0] * len(reqs)
    log: list = []          # the decode steps' (row aux, active rows), device until needed
    log_host: list = []     # ... on the host; both start at decode step `base`
    base = 0
    started = [0] * B       # the decode step at which each row's request started
    gen_stats: list = [None] * len(reqs)
    waiting = list(range(len(reqs)))
    req: list[int | None] = [None] * B   # the request each row is decoding
    fresh = np.zeros(B, bool)            # rows whose logits hold a token not chosen yet
    pos = np.zeros(B, np.int32)
    pending = None                       # the batched prefill under way (_Admission)
    ready: list = []                     # (admission, its row) prefilled, waiting for a row
    staging: dict = {}                   # A -> a finished admission's cache, reused (reset)
    schedule: list[tuple] = []
    steps, t_first = 0, None
    counts = dict(host_syncs=0, host_steps=0, device_steps=0, prefill_calls=0,
                  prefill_row_tokens=0, inserts=0, caches_made=1, idle_row_steps=0)
    if planned:  # the greedy state lives across the call; rows start done (no request)
      state = dict(self._greedy_state(cache, logits, pos, self._decode_fields(
          pos, np.zeros(B, bool))), done=self._commit(jnp.ones((B,), bool)))
      stop_S, block = stop_ids(()), self.GREEDY_IDS_BLOCK
      ntok = [0] * len(reqs)          # tokens chosen so far per request (known: no stop)
      pushes: list = []               # (device step index, row, request) in push order
      first_at = [0] * len(reqs)      # the device step index of each request's first token
      snaps: dict = {}                # request -> its row's sums and last token (device)
      blocks: list = []               # full ids buffers, copied out (queued)
      read: list = []                 # ... read on the host, in order: ids [block, B] each
      i = 0                           # greedy steps dispatched (their ids' index)

    def finish(b):
      nonlocal base
      r = req[b]
      if len(log_host) < len(log):  # one transfer for every step not on the host yet
        log_host.extend(jax.device_get(log[len(log_host):]))
        counts["host_syncs"] += 1
        log[:len(log_host)] = [None] * len(log_host)
      st = _RowStats()
      for entry in log_host[started[b] - base:]:
        if len(entry) == 3:  # a run on the device (_serve_run): its steps' sums
          st.add_sums(*entry)
        else:
          st.add(*entry)
      gen_stats[r] = st.row(b)
      req[b] = None
      keep = min((started[x] for x in range(B) if req[x] is not None), default=base + len(log))
      del log[:keep - base], log_host[:keep - base]  # steps no running request needs
      base = keep

    def read_blocks(upto: int):  # full ids buffers before `upto` onto the host: first tokens
      while len(read) < min(upto, len(blocks)):
        read.append(np.asarray(blocks[len(read)]))
        blocks[len(read) - 1] = None
        counts["host_syncs"] += 1
        now = time.perf_counter()
        lo = (len(read) - 1) * block
        for r in range(len(reqs)):
          if ntok[r] and first_at[r] is not None and lo <= first_at[r] < lo + block:
            ttft[r] = now - t0

    while True:
      if pending is None and waiting and not ready:  # the next prompts, ahead of free rows
        rs = [waiting.pop(0) for _ in range(min(len(waiting), admit))]
        A = _Admission.size(len(rs), admit)
        part = staging.pop(A, None)
        counts["caches_made"] += part is None
        pending = _Admission(self, [rows[r] for r in rs], rs, C, admit,
                             None if part is None else _reset_rows(part, jnp.ones((A,), bool)))
      if pending is not None:  # one chunk of the admitted prompts
        a = pending
        c = a.c
        sl = slice(c, c + C)
        posn = np.broadcast_to(np.arange(c, c + C, dtype=np.int32), (a.A, C))
        valid = posn < a.lengths[:, None]
        a.cache, a.logits, aux = self._step(
            self.params, a.cache, jnp.asarray(a.tokens[:, sl]), jnp.asarray(posn),
            jnp.asarray(valid), a.logits, self._commit(jnp.asarray(a.lengths)),
            static_fields=self._prefill_fields(c, C, a.lengths))
        counts["prefill_calls"] += 1
        counts["prefill_row_tokens"] += a.A * C
        a.stats.add(aux, valid.sum(1))
        schedule.extend(("prefill", r, c // C) for j, r in enumerate(a.requests)
                        if c < a.lengths[j])
        ready.extend((a, j) for j in range(len(a.requests)) if c < a.lengths[j] <= c + C)
        a.c = c + C
        if a.c >= a.lengths.max():
          pending = None
      while ready and any(r is None for r in req):
        # a prompt that is in takes the first free row (later chunks hold none of its tokens)
        (a, j), b = ready.pop(0), req.index(None)
        r = a.requests[j]
        if planned:
          cache, lg = _insert_row(cache, a.cache, state["logits"], a.logits, jnp.int32(b),
                                  jnp.int32(j))
          state, _ = _serve_row(dict(state, logits=lg), jnp.int32(b),
                                jnp.int32(a.lengths[j]), jnp.bool_(True))
        else:
          cache, logits = _insert_row(cache, a.cache, logits, a.logits, jnp.int32(b),
                                      jnp.int32(j))
        counts["inserts"] += 1
        req[b], pos[b], fresh[b], started[b] = r, a.lengths[j], True, base + len(log)
        prompt_stats[r] = (a.stats, j)
        a.left -= 1
        if not a.left and a is not pending:  # every row of it inserted: its cache is free
          staging[a.A] = a.cache
      k = 0 if planned else self._serve_run_length(
          outs, req, fresh, pending is not None or bool(waiting and not ready)
          or bool(ready and any(r is None for r in req)))
      if k:  # greedy steps on the device until a row can change (then the host's turn)
        cache, logits, ids, ran_B, sums = self._serve_run(cache, logits, pos, req, outs, k)
        counts["host_syncs"] += 1
        counts["device_steps"] += k
        log.append(sums)
        for j in range(k):  # the host loop's pushes and steps, from the run's ids
          for b in range(B):
            if req[b] is not None and outs[req[b]].push(None, int(ids[j, b])):
              finish(b)  # a stop token (the device stopped the row there too)
          n_on = sum(r is not None for r in req)
          if n_on:  # (steps after every row stopped ran no row: not the host loop's)
            schedule.append(("decode", n_on))
            steps += 1
        pos = pos + ran_B
        fresh = np.asarray([r is not None for r in req])
      pushed = fresh.any()
      if pushed and planned:  # tokens the next step records at device index i, or the last
        for b in np.flatnonzero(fresh):
          r = req[b]
          ntok[r] += 1
          if ntok[r] >= knobs[r].max_new_tokens:  # its last token (the row is not run again)
            state, snaps[r] = _serve_row(state, jnp.int32(b), jnp.int32(0), jnp.bool_(False))
            pushes.append((None, b, r))
            req[b] = None
          else:
            pushes.append((i, b, r))
          if ntok[r] == 1:
            first_at[r] = i if req[b] is not None else None
        fresh[:] = False
      elif pushed:
        need_host = any(outs[req[b]].needs_logits for b in np.flatnonzero(fresh))
        host = np.asarray(logits) if need_host else None
        ids = None if need_host else np.asarray(_argmax(logits))
        counts["host_syncs"] += 1
        now = time.perf_counter()
        for b in np.flatnonzero(fresh):
          o = outs[req[b]]
          if not o.tokens:
            ttft[req[b]] = now - t0
            t_first = now if t_first is None else t_first
          if o.push(host[b] if host is not None else None,
                    None if ids is None else int(ids[b])):
            finish(b)
        fresh[:] = False
      active = np.asarray([r is not None for r in req])
      if active.any():
        if waiting or ready or pending is not None:
          counts["idle_row_steps"] += int(B - active.sum())
        if planned:
          cache, state = self._greedy_step(self.params, cache, state, stop_S,
                                           static_fields=self._decode_fields(pos, active))
          counts["device_steps"] += 1
        else:
          last = np.asarray([outs[r].tokens[-1] if r is not None else 0 for r in req], np.int32)
          cache, logits, aux = self._step(
              self.params, cache, jnp.asarray(last)[:, None], jnp.asarray(pos)[:, None],
              jnp.asarray(active)[:, None], logits,
              static_fields=self._decode_fields(pos, active))
          log.append((aux, active.astype(np.int32)))
          counts["host_steps"] += 1
        schedule.append(("decode", int(active.sum())))
        pos = pos + active
        fresh = active.copy()
        steps += 1
      if planned and active.any():
        i += 1
        if i % block == 0:  # a full buffer: copied out (queued, no host wait), then reused
          blocks.append(jnp.copy(state["ids"]))
          read_blocks(len(blocks) - 1)   # the one before: long done unless the host is ahead
      if not active.any() and pending is None and not waiting and not ready:
        break
    if planned:  # the ids onto the host, pushed in the host loop's order; the row sums
      read_blocks(len(blocks))
      tail = np.asarray(state["ids"][:i % block])
      counts["host_syncs"] += 1
      now = time.perf_counter()
      for r in range(len(reqs)):
        if first_at[r] is None or first_at[r] >= len(read) * block:
          ttft[r] = now - t0
      ids = np.concatenate([x for x in read] + [tail])
      snaps = jax.device_get(snaps)
      counts["host_syncs"] += bool(snaps)
      for j, b, r in pushes:
        outs[r].push(None, int(ids[j, b] if j is not None else snaps[r][3][0]))
      for r in range(len(reqs)):
        st = _RowStats()
        if knobs[r].max_new_tokens > 1:  # (a request of one token ran no step: no sums)
          st.add_sums(*snaps[r][:3])
        gen_stats[r] = st.row(0)
      t_first = t0 + min(ttft)
    t_end = time.perf_counter()
    t_first = t_end if t_first is None else t_first
    return Generation(
        tokens=[o.tokens for o in outs], finish_reason=[o.reason for o in outs],
        text=[o.stream.text for o in outs] if self.tokenizer is not None else None,
        stats=[{"prompt": s.row(j), "generated": gen_stats[r]}
               for r, (s, j) in enumerate(prompt_stats)],
        logits=[np.stack(o.kept) for o in outs] if return_logits else None,
        prefill_s=t_first - t0, decode_s=t_end - t_first, steps=steps,
        cache_bytes=cache_bytes(cache), ttft_s=ttft, schedule=schedule, counts=counts)

  # serve's decode steps between host decisions on the device while no row can change
  # (_serve_run_length); False: a host round trip every step (the A/B of bench/decode's rows).
  SERVE_ON_DEVICE = True

  def _serve_run_length(self, outs, req, fresh, admitting: bool) -> int:
    """How many greedy decode steps `serve` may run on the device from here with no host
    decision between them: > 1 only when nothing is to be admitted (`admitting`: a prefill under
    way or due, or a prefilled prompt and a free row), every active row's next token is not chosen yet
    (fresh) and it has its first token already (its time to first token is the host's), every
    active request is greedy without kept logits, stop strings or streamed text, all share one
    stop-token set (none where the scheme's steps take host facts: `decode_fields`); then the
    least budget left less one (no row is stepped after its last token), at most
    GREEDY_IDS_BLOCK. 0: the host loop."""
    act = [b for b, r in enumerate(req) if r is not None]
    if not self.SERVE_ON_DEVICE or admitting or not act or not all(fresh[b] for b in act):
      return 0
    os_ = [outs[req[b]] for b in act]
    if any(not o.tokens or o.needs_logits or o.k.stop_strings or o.on_text is not None
           for o in os_):
      return 0
    stops = {o.k.stop_tokens for o in os_}
    if len(stops) > 1 or (next(iter(stops))
                          and _layer_hook(self.config, "decode_fields") is not None):
      return 0
    k = min(min(o.k.max_new_tokens - len(o.tokens) for o in os_) - 1, self.GREEDY_IDS_BLOCK)
    return k if k > 1 else 0

  def _serve_run(self, cache, logits, pos, req, outs, k: int):
    """k `_greedy_step`s for serve's active rows (the others done from the start) at their
    positions: (cache, logits, ids [k, B] on the host, steps each row ran [B], the run's
    (sums, module_sums, steps_B) for serve's log)."""
    B = len(req)
    active = np.asarray([r is not None for r in req])
    stop = next(outs[r].k.stop_tokens for r in req if r is not None)  # (one set: checked)
    state = dict(self._greedy_state(cache, logits, pos, self._decode_fields(pos, active)),
                 done=self._commit(jnp.asarray(~active)))
    stop_S = stop_ids(stop)
    for j in range(k):
      cache, state = self._greedy_step(self.params, cache, state, stop_S,
                                       static_fields=self._decode_fields(pos + j, active))
    ids, ran_B, sums = jax.device_get(
        (state["ids"], state["steps_B"], (state["sums"], state["module_sums"], state["steps_B"])))
    return cache, state["logits"], np.asarray(ids), np.asarray(ran_B), sums

  # ------------------------------------------------------------------------------- decode
  def decode_step(self, cache, tokens_B, positions_B, active_B, prev_logits_BV):
    """One token per active row at its position. Returns (cache, logits_BV)."""
    cache, logits, _ = self._step(self.params, cache, jnp.asarray(tokens_B, jnp.int32)[:, None],
                                  jnp.asarray(positions_B, jnp.int32)[:, None],
                                  jnp.asarray(active_B, bool)[:, None], prev_logits_BV,
                                  static_fields=self._decode_fields(positions_B, active_B))
    return cache, logits

  # generate's greedy loop on the device where it can (_greedy_on_device); False: always the
  # host loop (a same-process A/B: bench/decode.py's serve rows).
  GREEDY_ON_DEVICE = True
  # Checks of the on-device greedy loop's done flags (a host sync): every this many steps.
  GREEDY_CHECK_EVERY = 16
  # The on-device loops' ids buffer (steps): one shape for every call (one compiled step);
  # generate copies it out when full, serve runs at most this many steps at a time.
  GREEDY_IDS_BLOCK = 64

  def _greedy_state(self, cache, logits, lengths, static_fields):
    """`greedy_state` with GREEDY_IDS_BLOCK ids and every aux name of a step with these static
    fields (`step_aux_shapes`, traced once per model, batch size and fields), so the state has
    one structure from its first step."""
    B = logits.shape[0]
    aux = self.step_aux_shapes(self.params, cache, B, static_fields)
    # committed like the step's outputs: else the second step compiles again (_commit)
    return self._commit(greedy_state(logits, lengths, self.GREEDY_IDS_BLOCK, aux))

  def _greedy_on_device(self, cache, logits, lengths, knobs: _Knobs, outs, gen_stats):
    """`generate`'s greedy loop without a host round trip a step: `_greedy_step` calls back to
    back on one donated state (each step's token the argmax of the last logits, stop-token done
    flags, positions, the ids and the routing sums all stay on the device, written in place:
    no new array enters a call, so XLA:GPU replays the step's command buffer without updating
    it); the host reads the done flags every GREEDY_CHECK_EVERY steps (an early end) and the ids
    and sums once at the end, then pushes the ids into `outs` as the host loop would (tokens,
    finish reasons, text). Steps past every row's end (at most GREEDY_CHECK_EVERY, no row
    active) change no statistic. The host loop's own static fields need the active rows: used
    only where the scheme has none (`decode_fields`) or every row stays active (no stop
    tokens). Returns (cache, steps: the steps the host loop would have run)."""
    B, n, block = len(outs), knobs.max_new_tokens, self.GREEDY_IDS_BLOCK
    stop = stop_ids(knobs.stop_tokens)
    pos_host = np.asarray(lengths).copy()
    fields = lambda: self._decode_fields(pos_host, np.ones(B, bool))
    state = self._greedy_state(cache, logits, lengths, fields())
    ran, ended, blocks = 0, False, []
    for i in range(n - 1):
      cache, state = self._greedy_step(self.params, cache, state, stop, static_fields=fields())
      pos_host, ran = pos_host + 1, ran + 1
      if ran % block == 0:  # a full buffer: copied out (queued, no host wait), then reused
        blocks.append(jnp.copy(state["ids"]))
      if (knobs.stop_tokens and i % self.GREEDY_CHECK_EVERY == self.GREEDY_CHECK_EVERY - 1
          and bool(jnp.all(state["done"]))):
        ended = True  # every row ended at a token of this step: no last pick
        break
    ids = jnp.concatenate(blocks + [state["ids"][:ran % block]])
    if not ended:
      ids = jnp.concatenate([ids, _argmax(state["logits"]).astype(jnp.int32)[None]])
    if ran:
      gen_stats.add_sums(*jax.device_get((state["sums"], state["module_sums"], state["steps_B"])))
    for row in np.asarray(ids):
      for b, o in enumerate(outs):
        if not o.done:
          o.push(None, int(row[b]))
    return cache, max(len(o.tokens) for o in outs) - 1

  def step_aux_shapes(self, params, cache, B: int, static_fields=()) -> dict:
    """The per-row aux a one-token step of B rows over this cache returns ({name:
    ShapeDtypeStruct}, the scheme module's under 'scheme'), traced, not run: `greedy_state`'s
    aux_shapes. Traced once per (model, B, static fields, the params' and cache's shapes and
    dtypes): `_abstract` (read only: greedy_state copies it)."""
    tok = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    fn = lambda *a: Engine._step.__wrapped__(self, *a, static_fields=static_fields)[2]
    avals = lambda t: (jax.tree.structure(t),
                       tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(t)))
    return self._abstract(B, ("step_aux", static_fields, avals(params), avals(cache)),
                          lambda: jax.eval_shape(
                              fn, params, cache, tok, tok, jax.ShapeDtypeStruct((B, 1), bool),
                              jax.ShapeDtypeStruct((B, self.config.vocab_size), jnp.float32)))

  @functools.partial(jax.jit, static_argnums=0, static_argnames=("static_fields",),
                     donate_argnums=(2, 3))
  def _greedy_step(self, params, cache, state, stop_S, static_fields=()):
    """One greedy decode step on `greedy_state`'s donated state: ids = argmax of its logits
    (recorded at ids[i]), a row done once an id is a stop token, one `_step` for the rows not
    done at their positions, then the rows it ran advance and their per-row aux are summed (in
    float32; a row it did not run adds 0). Returns (cache, state); every state leaf is written
    over its input (aliased), so a loop of these calls takes no new array. Step i's ids go to
    ids[i % len(ids)] (a loop longer than the buffer copies it out every len(ids) steps). The
    sums' keys are those the steps gave so far (a step with a new aux name adds it: one more
    trace; `_greedy_state` starts with every name)."""
    ids_B = jnp.argmax(state["logits"], axis=-1).astype(jnp.int32)
    done_B = state["done"] | jnp.any(ids_B[:, None] == stop_S[None, :], axis=-1)
    on_B = ~done_B
    cache, logits_BV, row_aux = Engine._step.__wrapped__(
        self, params, cache, ids_B[:, None], state["pos"][:, None], on_B[:, None],
        state["logits"], static_fields=static_fields)
    ran_B = on_B.astype(jnp.int32)
    sums, module_sums = dict(state["sums"]), dict(state["module_sums"])
    for k, v in row_aux.pop("scheme", {}).items():
      v = jnp.where(on_B.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0)
      module_sums[k] = module_sums.get(k, 0.0) + v
    for k, v in row_aux.items():
      v = jnp.where(on_B.reshape((1, -1) + (1,) * (v.ndim - 2)), v, 0.0)
      sums[k] = sums.get(k, 0.0) + v
    i = state["i"]
    return cache, dict(logits=logits_BV, done=done_B, pos=state["pos"] + ran_B, i=i + 1,
                       ids=jax.lax.dynamic_update_index_in_dim(
                           state["ids"], ids_B, i % state["ids"].shape[0], 0),
                       steps_B=state["steps_B"] + ran_B, sums=sums, module_sums=module_sums)

  def _decode_on_host(self, cache, logits, lengths, knobs: _Knobs, outs, gen_stats):
    """`generate`'s loop with a host round trip a step: each row's next token chosen on the host
    (`_Output.push`: sampling, kept logits, stop strings, streamed text), then one step for the
    rows not done. Returns (cache, steps)."""
    del knobs  # each row's own, in outs
    pos = np.asarray(lengths).copy()
    steps = 0
    while True:
      done = np.asarray([o.done for o in outs])
      if any(o.needs_logits for o in outs):
        host_logits = np.asarray(logits)
      else:  # greedy without logits: B ids cross to the host, not B x V floats
        host_logits, host_ids = None, np.asarray(_argmax(logits))
      for b, o in enumerate(outs):
        if not done[b]:
          o.push(None if host_logits is None else host_logits[b],
                 None if host_logits is not None else int(host_ids[b]))
      done = np.asarray([o.done for o in outs])
      if done.all():
        return cache, steps
      last = np.asarray([o.tokens[-1] for o in outs], np.int32)
      cache, logits, row_aux = self._step(self.params, cache, jnp.asarray(last)[:, None],
                                          jnp.asarray(pos)[:, None],
                                          jnp.asarray(~done)[:, None], logits,
                                          static_fields=self._decode_fields(pos, ~done))
      gen_stats.add(row_aux, (~done).astype(np.int32))
      pos = pos + (~done)
      steps += 1

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               stop_tokens: Sequence[int] = (), stop_strings: Sequence[str] = (),
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               return_logits: bool = False,
               on_text: Callable[[int, str], None] | None = None) -> Generation:
    """Generation for ragged prompts (lists of token ids); see `Generation` for the result.

    Each row stops at a stop token, a stop string or after max_new_tokens. temperature 0 (the
    default) is greedy (argmax, exact); > 0 samples from softmax(logits / temperature) cut to
    the top_p nucleus, from the row's own generator (seed, row): a row's sample does not
    depend on the other rows. stop_strings need a tokenizer (`engine.tokenizer`): the text is
    decoded as the tokens come, and a row stops as soon as its text contains one (the text is
    cut before it). on_text(row, text): called with each row's newly final text as it comes
    (a tokenizer is needed; text held back for a possible stop string comes later).
    """
    V = self.config.vocab_size
    rows = check_prompts(prompts, V)
    knobs = _Knobs.check(self, max_new_tokens, stop_tokens, stop_strings, temperature, top_p,
                         seed, "Engine.generate")
    tok = self.tokenizer
    if tok is None and on_text is not None:
      raise ValueError("stop_strings / on_text need a tokenizer: load the engine with "
                       "Engine.from_checkpoint(..., tokenizer=<dir>) or set engine.tokenizer.")
    longest = max(len(p) for p in rows)
    if longest + max_new_tokens > self.cache_len:
      raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"cache_len={self.cache_len}; raise cache_len.")
    t0 = time.perf_counter()
    cache, logits, lengths, prompt_stats = self._prefill(rows)
    logits.block_until_ready()
    t1 = time.perf_counter()
    B = len(rows)
    outs = [_Output(dataclasses.replace(knobs, row=b), tok, return_logits, on_text, b)
            for b in range(B)]
    gen_stats = _RowStats()
    on_device = (self.GREEDY_ON_DEVICE and knobs.temperature == 0 and not return_logits
                 and on_text is None and not knobs.stop_strings
                 and (not knobs.stop_tokens
                      or _layer_hook(self.config, "decode_fields") is None))
    loop = self._greedy_on_device if on_device else self._decode_on_host
    cache, steps = loop(cache, logits, lengths, knobs, outs, gen_stats)
    t2 = time.perf_counter()
    return Generation(
        tokens=[o.tokens for o in outs], finish_reason=[o.reason for o in outs],
        text=[o.stream.text for o in outs] if tok is not None else None,
        stats=[{"prompt": prompt_stats.row(b), "generated": gen_stats.row(b)} for b in range(B)],
        logits=[np.stack(o.kept) for o in outs] if return_logits else None,
        prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, cache_bytes=cache_bytes(cache))


STOP_SLOTS = 8


def stop_ids(stop_tokens) -> jax.Array:
  """`Engine._greedy_step`'s stop_S: the stop-token ids sorted, padded with -1 (no id) to a
  multiple of STOP_SLOTS, so that greedy decoding with no stop token and with up to STOP_SLOTS
  of them runs one compiled step (the set's size is part of the step's shape)."""
  ids = sorted(int(t) for t in stop_tokens)
  n = max(-(-len(ids) // STOP_SLOTS), 1) * STOP_SLOTS
  return jnp.asarray(ids + [-1] * (n - len(ids)), jnp.int32)


def greedy_state(logits_BV, lengths_B, n: int, aux_shapes: dict | None = None) -> dict:
  """`Engine._greedy_step`'s state for up to n generated tokens after a prefill that left
  logits_BV and rows of lengths_B tokens: the logits (donated: pass a copy to keep them), no row
  done, the positions, the step index, the ids [n, B], the steps each row ran, and the sums:
  empty (each step adds the names it gives), or zeros for every name of aux_shapes
  (`Engine.step_aux_shapes`: the state keeps one structure from the first call, as a step
  compiled ahead of time needs)."""
  B = logits_BV.shape[0]
  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)
  aux = dict(aux_shapes or {})
  return dict(logits=logits_BV, done=jnp.zeros((B,), bool),
              pos=jnp.asarray(np.asarray(lengths_B), jnp.int32), i=jnp.zeros((), jnp.int32),
              ids=jnp.zeros((n, B), jnp.int32), steps_B=jnp.zeros((B,), jnp.int32),
              module_sums=zeros(aux.pop("scheme", {})), sums=zeros(aux))


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_rows(cache, rows_B):
  """Zeros in the rows where rows_B is True, for every batch-first leaf (in place: donated)."""
  return jax.tree.map(
      lambda x: jnp.where(rows_B.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x),
      cache)


class _Admission:
  """Engine.serve's batched prefill under way: the admitted requests' prompts as one ragged
  batch of A rows (`size`: a power of two >= their count, <= admit; padding rows have length 0),
  its cache (zeros: made, or an earlier admission's of A rows reset) and last logits, the next
  chunk's start `c`, how many of its rows are not inserted yet."""

  def __init__(self, engine, prompts, requests, chunk: int, admit: int, cache=None):
    n = len(prompts)
    self.A = self.size(n, admit)
    self.requests, self.left = list(requests), n   # left: rows not inserted yet
    self.lengths = np.zeros(self.A, np.int32)
    self.lengths[:n] = [len(p) for p in prompts]
    P = -(-int(self.lengths.max()) // chunk) * chunk
    self.tokens = np.zeros((self.A, P), np.int32)
    for j, p in enumerate(prompts):
      self.tokens[j, :len(p)] = p
    self.cache = engine.init_cache(self.A) if cache is None else cache
    self.logits = engine._commit(jnp.zeros((self.A, engine.config.vocab_size), jnp.float32))
    self.stats = _RowStats()
    self.c = 0

  @staticmethod
  def size(n: int, admit: int) -> int:
    """The rows of a prefill of n prompts: n rounded up to a power of two, at most admit."""
    return min(1 << (n - 1).bit_length(), admit)


@functools.partial(jax.jit, donate_argnums=(0, 2))
def _insert_row(cache, part, logits_BV, part_logits_AV, b, j):
  """Row b of the batch cache (and logits) overwritten by row j of another cache (a batched
  prefill's; in place: the batch cache is donated)."""
  put = lambda x, y: _put_row(x, b, jax.lax.dynamic_index_in_dim(y, j, 0, keepdims=False))
  return jax.tree.map(put, cache, part), put(logits_BV, part_logits_AV)


def _put_row(x, b, row, axis: int = 0):
  """x with its index b along `axis` replaced by row (that axis dropped)."""
  return jax.lax.dynamic_update_index_in_dim(x, row.astype(x.dtype), b, axis)


@functools.partial(jax.jit, donate_argnums=(0,))
def _serve_row(state, b, length, start):
  """serve's planned loop, row b of the greedy state (in place: donated). start: a request
  starts there (its prefill's logits already in the state's: `_insert_row`): position `length`,
  not done, no step run, sums zero. Else the row's request ends: done (its last token is the
  argmax of its logits: no step runs it again). Returns (state, the row's (sums [L, 1, ...],
  module_sums [1, ...], steps_B [1]) since its request started, that last token [1])."""
  row = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, b, 1, axis)
  snap = (jax.tree.map(lambda x: row(x, 1), state["sums"]),
          jax.tree.map(lambda x: row(x, 0), state["module_sums"]), row(state["steps_B"], 0),
          jnp.argmax(row(state["logits"], 0), axis=-1).astype(jnp.int32))
  keep = lambda x, axis: jnp.where(start, _put_row(x, b, jnp.zeros(
      x.shape[:axis] + x.shape[axis + 1:], x.dtype), axis), x)
  return dict(
      state, pos=jnp.where(start, _put_row(state["pos"], b, length), state["pos"]),
      done=_put_row(state["done"], b, ~start), steps_B=keep(state["steps_B"], 0),
      sums=jax.tree.map(lambda x: keep(x, 1), state["sums"]),
      module_sums=jax.tree.map(lambda x: keep(x, 0), state["module_sums"])), snap


_split_groups = jax.jit(stacking.split_groups)
_join_groups = jax.jit(stacking.join_groups)


@jax.jit
def _argmax(logits_BV):
  """Greedy ids [B] (the first index among equal maxima, as np.argmax)."""
  return jnp.argmax(logits_BV, axis=-1)


def _layer_hook(config: ModelConfig, name: str):
  """The scheme layer class's declaration `name` (decode_chunk, prefill_fields, decode_fields,
  serving_notes), or None where the scheme declares none."""
  from condattn_jax.attention import get_scheme
  return getattr(get_scheme(config.scheme).layer_cls, name, None)


def run_tokenizer(config, tokenizer=None):
  """The tokenizer of a run config: `tokenizer` (a Tokenizer or a directory) if given, else the
  run's data.tokenizer, else model.init_from when it holds a tokenizer.json, else None."""
  import os
  if tokenizer is None:
    src = config.data.get("tokenizer")
    init = config.model.get("init_from")
    if src is None and init and os.path.isfile(os.path.join(init, "tokenizer.json")):
      src = init
    tokenizer = src
  if tokenizer is None:
    return None
  if isinstance(tokenizer, str):
    from condattn_jax.data import tokenizer as tokenizer_lib
    if not os.path.exists(tokenizer):
      raise FileNotFoundError(f"tokenizer {tokenizer} does not exist; pass tokenizer=<dir with "
                              "tokenizer.json> to Engine.from_checkpoint.")
    tokenizer = tokenizer_lib.load_tokenizer(tokenizer)
  return tokenizer
