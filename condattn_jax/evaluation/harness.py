"""Generation-scored evaluation through the inference engine: batched, any scheme and dense,
answers parsed and scored per task, per-sample records, efficiency and routing maps in the same
run.

    model = load_model("runs/l2a", theta=0.7)          # Engine.from_checkpoint + test-time knobs
    res = evaluate_model(model, samples, batch_size=8)
    res["accuracy"]["niah_single_1"]["4096"]           # mean score in [0, 1]
    res["efficiency"]["4096"]                          # ttft_s, decode_tok_s, kv_cache_bytes ...
    res["routing"]["niah_single_1"]["4096"]            # the scheme's per-layer / head statistics
    res["records"]                                     # one per sample: id, answers, output, score

How a sample runs: one engine per context length (cache_len = the length: prompt +
max_new_tokens <= length by the suite's contract), prompts of one task and length batched
`batch_size` at a time (the last batch padded with copies of its last prompt, their outputs
dropped), greedy decoding of at most the sample's max_new_tokens, stopping at the tokenizer's EOS
(text tasks). Text outputs are decoded and post-processed as RULER does (newlines -> spaces,
stripped); token-level outputs are the generated ids. `scoring.score` gives each sample's score.

Efficiency per length (every batch timed; compilation is excluded by one warm-up generation per
length on the first batch, not timed; every prefill of a length runs in chunks of one size, the
`prefill_chunk` given or the one the engine picks for the whole length, so one compiled shape):
  ttft_s           median over batches of the prefill wall time (time to the first token of
                   every row of a batch of `batch_size`)
  decode_tok_s     tokens made by decode steps (all generated tokens but each row's first,
                   which the prefill makes) / decode wall seconds, summed over the batches
                   (rows of a batch decode together: batch_size tokens per step)
  kv_cache_bytes   the engine's cache for one row at this length (`engine.cache_shapes(1)`:
                   what the device allocates), and the scheme's analytic count when it has one
  peak_bytes       the device's peak bytes in use after the length ran (`memory_stats()`;
                   None where the backend does not report it, e.g. CPU); a process-wide
                   high-water mark, so it only grows across lengths and models
Routing (schemes whose layers report per-row statistics, `Generation.stats`): per task and
length, the mean over samples of each statistic over the prompt tokens ([L] per layer or
[L, N] per layer x head; L2A: fraction routed global, AHA: full-attention usage, Elastic: FA
mode per KV head).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from condattn_jax.evaluation import scoring
from condattn_jax.evaluation.tasks import Sample, json_lines


@dataclasses.dataclass
class EvalModel:
  """One model of an evaluation: its name in reports, the weights, and how to make an engine.

  make_engine(cache_len, prefill_chunk) -> an object with `generate(prompts, max_new_tokens,
  stop_tokens=...)` returning a `Generation` and `cache_shapes(batch)` (an `inference.Engine`).
  knobs: everything that shaped the model's results (checkpoint, step, scheme and options).
  """
  name: str
  model_cfg: Any
  tokenizer: Any
  knobs: dict
  make_engine: Callable[[int, int | None], Any]
  release: Callable[[], None] | None = None  # frees the device copy of the weights

  @property
  def vocab_size(self) -> int:
    return int(self.model_cfg.vocab_size)


def _scheme_knobs(model_cfg) -> dict:
  return {"name": model_cfg.scheme, **{k: v for k, v in model_cfg.scheme_kwargs}}


def model_from_params(name: str, model_cfg, params, *, tokenizer=None, knobs=None) -> EvalModel:
  """An EvalModel over weights in memory (tests, converted models)."""
  from condattn_jax.inference import Engine

  def make(cache_len, prefill_chunk):
    eng = Engine(model_cfg, params, cache_len=cache_len, prefill_chunk=prefill_chunk)
    eng.tokenizer = tokenizer
    return eng
  k = {"scheme": _scheme_knobs(model_cfg), **(knobs or {})}
  return EvalModel(name, model_cfg, tokenizer, k, make)


def load_model(path: str, *, name: str | None = None, step: int | None = None, tokenizer=None,
               **scheme_options) -> EvalModel:
  """An EvalModel over a train.py checkpoint (`Engine.from_checkpoint`: the weights, the config
  saved with them, the run's tokenizer), with test-time scheme options (e.g. theta=0.7).

  The weights wait in host memory: they go to the device at the model's first engine and leave
  it at `release()` (run_suite releases each model after its turn), so a head-to-head of several
  checkpoints holds one model's weights on the device at a time."""
  import os

  import jax

  from condattn_jax.inference import Engine
  base = Engine.from_checkpoint(path, step=step, tokenizer=tokenizer, cache_len=1,
                                **scheme_options)
  host_params = jax.device_get(base.params)
  cfg, tok, loaded = base.config, base.tokenizer, base.step
  del base
  held = {}

  def make(cache_len, prefill_chunk):
    if "params" not in held:
      held["params"] = jax.device_put(host_params, jax.local_devices()[0])
    eng = Engine(cfg, held["params"], cache_len=cache_len, prefill_chunk=prefill_chunk)
    eng.tokenizer = tok
    return eng
  knobs = {"checkpoint": os.path.abspath(path), "step": loaded,
           "scheme": _scheme_knobs(cfg), "overrides": dict(sorted(scheme_options.items()))}
  parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
  if parts[-1].isdigit() and len(parts) > 2 and parts[-2] == "checkpoints":
    run_name = f"{parts[-3]}:{parts[-1]}"  # <workdir>/checkpoints/<step>
  elif parts[-1] == "checkpoints" and len(parts) > 1:
    run_name = parts[-2]
  else:
    run_name = parts[-1]
  label = name or (run_name + (
      "@" + ",".join(f"{k}={v}" for k, v in sorted(scheme_options.items())) if scheme_options
      else ""))
  return EvalModel(label, cfg, tok, knobs, make, release=held.clear)


def postprocess(text: str) -> str:
  """RULER's postprocess_pred: newlines and tabs to spaces, stripped."""
  return " ".join(text.replace("\n", " ").replace("\t", " ").split())


def _encode(model: EvalModel, s: Sample) -> list[int]:
  if s.token_level:
    return list(s.prompt)
  if model.tokenizer is None:
    raise ValueError(f"{s.id} is a text sample but model {model.name} has no tokenizer; use a "
                     f"token-level suite (tiny, synthetic) or give the run's tokenizer.")
  return list(model.tokenizer.encode(s.prompt))


def _output(model: EvalModel, s: Sample, ids: list[int], stop: set[int]):
  if s.token_level:
    return [int(t) for t in ids]
  ids = [t for t in ids if t not in stop]
  return postprocess(model.tokenizer.decode(ids, skip_special_tokens=True))


def _peak_bytes() -> int | None:
  import jax
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # backends without memory stats
    return None
  return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def _tree_bytes(shapes) -> int:
  import jax
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))


def _analytic_kv(model_cfg, length: int):
  from condattn_jax.attention import get_scheme
  fn = get_scheme(model_cfg.scheme).kv_cache_bytes
  if fn is None:
    return None
  try:
    return int(fn(model_cfg, length, 1)["total"])
  except Exception:  # an analytic count that does not apply to this config: not reported
    return None


def _routing_array(v) -> np.ndarray | None:
  """A statistic as a routing map ([L] per layer or [L, N] per layer x head, numeric), else None
  (a scheme's other per-row entries, e.g. nested dicts, are not maps)."""
  if isinstance(v, dict):
    return None
  try:
    a = np.asarray(v, np.float64)
  except (TypeError, ValueError):
    return None
  return a if a.ndim in (1, 2) else None


def _mean_stats(stats_list: list[dict]) -> dict:
  """Mean over samples of each prompt-part statistic that is a routing map ({name: [L] or
  [L, N] list}; others left out)."""
  acc: dict[str, list] = {}
  for st in stats_list:
    for k, v in (st or {}).get("prompt", {}).items():
      a = None if k == "tokens" else _routing_array(v)
      if a is not None:
        acc.setdefault(k, []).append(a)
  return {k: np.mean(np.stack(v), axis=0).tolist() for k, v in acc.items()
          if len({x.shape for x in v}) == 1}


def evaluate_model(model: EvalModel, samples: Sequence[Sample], *, batch_size: int = 8,
                   prefill_chunk: int | None = None, warmup: bool = True,
                   on_group: Callable[[str, int], None] | None = None) -> dict[str, Any]:
  """Runs every sample through the model's engine; see the module docstring for the result.
  on_group(task, length) is called after each (task, length) group (progress bars)."""
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1.")
  stop = set()
  if model.tokenizer is not None and getattr(model.tokenizer, "eos_id", None) is not None:
    stop.add(int(model.tokenizer.eos_id))
  by_len: dict[int, dict[str, list[Sample]]] = {}
  for s in samples:
    by_len.setdefault(int(s.length), {}).setdefault(s.task, []).append(s)
  records, acc, eff, routing = [], {}, {}, {}
  for L in sorted(by_len):
    engine = model.make_engine(L, None if prefill_chunk is None else min(int(prefill_chunk), L))
    if prefill_chunk is None:  # one prefill shape per length: the chunk the engine picks for L
      chunk = int(engine.chunk_for(L)) if hasattr(engine, "chunk_for") else L
      engine = model.make_engine(L, chunk)
    else:
      chunk = min(int(prefill_chunk), L)
    prefill_s, decode_s, new_tok, warmed = [], 0.0, 0, False
    for task, group in by_len[L].items():
      stop_t = set() if group[0].token_level else stop
      stats_list, scores = [], []
      for b0 in range(0, len(group), batch_size):
        batch = group[b0:b0 + batch_size]
        prompts = [_encode(model, s) for s in batch]
        for s, p in zip(batch, prompts):
          if len(p) + s.max_new_tokens > L:
            raise ValueError(f"{s.id}: {len(p)} prompt tokens + {s.max_new_tokens} new > "
                             f"length {L} (the suite was built with another tokenizer?).")
        n = len(prompts)
        prompts += [prompts[-1]] * (batch_size - n)  # one compiled batch shape
        max_new = max(s.max_new_tokens for s in batch)
        if warmup and not warmed:  # compiles the prefill chunk and the decode step
          engine.generate([p[:max(1, L - 2)] for p in prompts], max_new_tokens=2)
          warmed = True
        gen = engine.generate(prompts, max_new_tokens=max_new, stop_tokens=tuple(stop_t))
        prefill_s.append(float(gen.prefill_s))
        decode_s += float(gen.decode_s)
        new_tok += sum(max(len(t) - 1, 0) for t in gen.tokens[:n])  # the first: prefill's
        row_stats = list(getattr(gen, "stats", None) or [{}] * len(gen.tokens))
        for j, s in enumerate(batch):
          ids = list(gen.tokens[j])[:s.max_new_tokens]
          out = _output(model, s, ids, stop_t)
          sc = scoring.score(out, s.answers, s.metric)
          scores.append(sc)
          stats_list.append(row_stats[j])
          records.append(dict(id=s.id, task=s.task, length=L, index=s.index,
                              prompt_tokens=len(prompts[j]),
                              answers=[list(a) if s.token_level else a for a in s.answers],
                              output=out, score=sc, metric=s.metric))
      acc.setdefault(task, {})[str(L)] = float(np.mean(scores))
      st = _mean_stats(stats_list)
      if st:
        routing.setdefault(task, {})[str(L)] = st
      if on_group is not None:
        on_group(task, L)
    eff[str(L)] = dict(
        ttft_s=float(statistics.median(prefill_s)), batch_size=batch_size, prefill_chunk=chunk,
        decode_tok_s=float(new_tok / decode_s) if decode_s > 0 and new_tok else None,
        decoded_tokens=int(new_tok), batches=len(prefill_s),
        kv_cache_bytes=_tree_bytes(engine.cache_shapes(1)),
        kv_cache_bytes_analytic=_analytic_kv(model.model_cfg, L), peak_bytes=_peak_bytes())
  mean_by_len = {str(L): float(np.mean([acc[t][str(L)] for t in acc if str(L) in acc[t]]))
                 for L in sorted(by_len)}
  return dict(name=model.name, knobs=model.knobs, accuracy=acc, mean_accuracy=mean_by_len,
              efficiency=eff, routing=routing, records=records)


def load_documents(path: str, tokenizer=None) -> list[list[int]]:
  """Documents for perplexity by position, as token ids: a .jsonl file of rows {"text": str}
  (encoded with `tokenizer`, BOS by its rule) or {"tokens": [ids]}, else a plain text file
  holding one document."""
  import os
  if not os.path.isfile(path):
    raise FileNotFoundError(f"ppl_docs={path} does not exist.")
  with open(path) as f:
    raw = f.read()
  rows = json_lines(raw, path) if path.endswith(".jsonl") else [{"text": raw}]
  out = []
  for i, r in enumerate(rows):
    if "tokens" in r:
      out.append([int(t) for t in r["tokens"]])
    elif "text" in r:
      if tokenizer is None:
        raise ValueError(f"{path}: row {i + 1} is text but the model has no tokenizer; give "
                         f"token rows {{\"tokens\": [...]}} or --tokenizer.")
      out.append(list(tokenizer.encode(r["text"])))
    else:
      raise ValueError(f"{path}: row {i + 1} needs 'text' or 'tokens'.")
  return out


def _bins(length: int, num_bins: int) -> list[tuple[int, int]]:
  edges = np.linspace(0, length, num_bins + 1).astype(int)
  return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def perplexity_by_position(model_cfg, params, documents: Sequence[Sequence[int]], length: int, *,
                           num_bins: int = 8, batch_size: int = 4) -> dict[str, Any]:
  """Perplexity by position on user-given documents (token ids): each document longer than
  `length` contributes its first `length` + 1 tokens (shorter ones are skipped); the NLL of
  every next-token prediction is averaged per position bin (num_bins equal bins of [0, length)).
  One teacher-forced forward per batch (`train.step.forward_ce`, any scheme, train=False).
  Returns {'length', 'documents', 'bins': [{'start', 'end', 'nll', 'ppl', 'tokens'}], 'nll',
  'ppl'}."""
  import jax
  import jax.numpy as jnp

  from condattn_jax.models.decoder import Decoder
  from condattn_jax.train.step import forward_ce
  rows = [list(d[:length + 1]) for d in documents if len(d) > length]
  if not rows:
    raise ValueError(f"no document has more than {length} tokens; give longer documents or a "
                     f"shorter length.")
  model = Decoder(model_cfg)
  fn = jax.jit(lambda p, b: forward_ce(model, p, b, train=False, rng=jax.random.key(0))[0])
  nll_sum = np.zeros(length)
  count = 0
  for b0 in range(0, len(rows), batch_size):
    chunk = rows[b0:b0 + batch_size]
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - n)
    a = np.asarray(chunk, np.int32)
    B = a.shape[0]
    batch = dict(inputs=jnp.asarray(a[:, :-1]), targets=jnp.asarray(a[:, 1:]),
                 positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (B, length)),
                 segment_ids=jnp.ones((B, length), jnp.int32),
                 loss_mask=jnp.ones((B, length), jnp.float32))
    ce = np.asarray(fn(params, batch), np.float64)[:n]
    nll_sum += ce.sum(0)
    count += n
  out_bins = []
  for s, e in _bins(length, num_bins):
    nll = float(nll_sum[s:e].sum() / (count * (e - s)))
    out_bins.append(dict(start=s, end=e, nll=nll, ppl=float(np.exp(min(nll, 700.0))),
                         tokens=count * (e - s)))
  nll = float(nll_sum.sum() / (count * length))
  return dict(length=int(length), documents=count, bins=out_bins, nll=nll,
              ppl=float(np.exp(min(nll, 700.0))))
