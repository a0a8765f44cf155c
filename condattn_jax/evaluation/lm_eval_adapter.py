"""An lm-evaluation-harness model over the inference engine (optional extra `lm_eval`).

    from condattn_jax.evaluation.lm_eval_adapter import CondattnLM
    lm = CondattnLM.from_checkpoint("runs/l2a", max_length=4096, theta=0.7)
    lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

`CondattnLM` is a `lm_eval.api.model.TemplateLM` (lm-eval's own context / continuation split and
empty-context rule) implementing:
  loglikelihood          (context, continuation) -> (sum of the continuation's log-probs,
                         whether greedy decoding would produce it): one teacher-forced forward
                         (`train.step.forward_ce`, any scheme, train=False) per batch
  loglikelihood_rolling  a document's total log-prob, in lm-eval's disjoint rolling windows of
                         max_length (`lm_eval.utils.get_rolling_token_windows`)
  generate_until         greedy (or sampled, `do_sample` / `temperature`) generation through
                         `inference.Engine.generate`, stopping at EOS or any `until` string (the
                         text is cut before it), at most `max_gen_toks` tokens

BOS and truncation (what lm-eval users trip over):
  * The context is encoded with the tokenizer's own BOS rule (`Tokenizer.encode`: BOS for
    Llama 3, none for Qwen); a continuation never gets one. An empty context is replaced by
    `prefix_token_id`: BOS when the tokenizer has one, else EOS (lm-eval's rule).
  * Rolling log-likelihood encodes the document WITHOUT BOS: the first window is conditioned on
    `prefix_token_id` instead, so BOS is never counted twice; every document token is scored
    exactly once.
  * Truncation is from the LEFT (the oldest context tokens go): loglikelihood keeps the last
    max_length tokens of context + continuation (the continuation is always scored whole; a
    continuation longer than max_length is an error); generate_until keeps the last
    max_length - max_gen_toks tokens of the context.
`max_length` is the engine's cache length (the context the model serves), `batch_size` the rows
per forward / generate call.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

try:
  from lm_eval.api.model import TemplateLM
  from lm_eval import utils as lm_utils
except ImportError as e:  # pragma: no cover - the extra is installed in CI
  raise ImportError("condattn_jax.evaluation.lm_eval_adapter needs lm-eval: "
                    "pip install 'condattn-jax[lm_eval]' (see scripts/bootstrap.sh for a "
                    "minimal install without its heavy dependencies).") from e


def _bucket(n: int, multiple: int = 32) -> int:
  return -(-n // multiple) * multiple


class CondattnLM(TemplateLM):
  """lm-eval model over an `inference.Engine` (its params, config, tokenizer and cache length)."""

  def __init__(self, engine, *, tokenizer=None, max_length: int | None = None,
               batch_size: int = 8, max_gen_toks: int = 256, seed: int = 0):
    super().__init__()
    import jax

    from condattn_jax.models.decoder import Decoder
    from condattn_jax.models import stacking
    from condattn_jax.train.step import forward_ce
    self.engine = engine
    self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    if self.tokenizer is None:
      raise ValueError("CondattnLM needs a text tokenizer (tokenizer=<Tokenizer or dir>, or an "
                       "engine loaded with one); token-only models have no lm-eval tasks.")
    if isinstance(self.tokenizer, str):
      from condattn_jax.data.tokenizer import load_tokenizer
      self.tokenizer = load_tokenizer(self.tokenizer)
    if getattr(engine, "tokenizer", None) is None:
      engine.tokenizer = self.tokenizer  # the engine decodes and matches stop strings with it
    if self.tokenizer.eos_id is None and self.tokenizer.bos_id is None:
      raise ValueError(f"{self.tokenizer.source}: the tokenizer has neither EOS nor BOS; lm-eval "
                       f"needs one as the prefix of an empty context.")
    self._max_length = int(max_length or engine.cache_len)
    if self._max_length > engine.cache_len:
      raise ValueError(f"max_length={self._max_length} exceeds the engine's cache_len="
                       f"{engine.cache_len}.")
    self.batch_size = int(batch_size)
    self._max_gen_toks = int(max_gen_toks)
    self.seed = int(seed)
    model = Decoder(engine.config)
    # the engine's params (split per layer by default) stacked back inside the program: a
    # temporary of the scoring call, not a second copy of the weights held
    self._forward = jax.jit(lambda p, b: forward_ce(model, stacking.join_groups(p), b,
                                                    train=False, rng=jax.random.key(seed))[:2])

  @classmethod
  def from_checkpoint(cls, path: str, *, max_length: int, tokenizer=None, batch_size: int = 8,
                      step: int | None = None, **scheme_options) -> "CondattnLM":
    """A train.py checkpoint (`Engine.from_checkpoint`, test-time scheme options)."""
    from condattn_jax.inference import Engine
    eng = Engine.from_checkpoint(path, step=step, cache_len=max_length, tokenizer=tokenizer,
                                 **scheme_options)
    return cls(eng, max_length=max_length, batch_size=batch_size)

  # ------------------------------------------------------------------ lm-eval's contract
  @property
  def eot_token_id(self) -> int:
    t = self.tokenizer
    return int(t.eos_id if t.eos_id is not None else t.bos_id)

  @property
  def prefix_token_id(self) -> int:
    t = self.tokenizer
    return int(t.bos_id if t.bos_id is not None else t.eos_id)

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self.tokenizer, "source", "tokenizer")).replace("/", "__")

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The tokenizer's BOS rule (add_special_tokens=None), or none (False) / forced (True)."""
    return list(self.tokenizer.encode(string, add_bos=add_special_tokens))

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  # ------------------------------------------------------------------ scoring
  def _score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """rows: (tokens, n): the log-prob of the last n tokens of `tokens` given the ones before,
    and whether each is the argmax. One forward per batch of `batch_size` rows, right-padded
    to a multiple of 32 (padding: segment 0, never attended or scored)."""
    import jax.numpy as jnp
    out = []
    for b0 in range(0, len(rows), self.batch_size):
      chunk = rows[b0:b0 + self.batch_size]
      T = _bucket(max(len(t) - 1 for t, _ in chunk))
      B = self.batch_size
      inp = np.zeros((B, T), np.int32)
      tgt = np.zeros((B, T), np.int32)
      seg = np.zeros((B, T), np.int32)
      for i, (toks, _) in enumerate(chunk):
        n = len(toks) - 1
        inp[i, :n], tgt[i, :n], seg[i, :n] = toks[:-1], toks[1:], 1
      pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
      batch = dict(inputs=jnp.asarray(inp), targets=jnp.asarray(tgt),
                   positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg),
                   loss_mask=jnp.asarray(seg, jnp.float32))
      ce, correct = (np.asarray(x) for x in self._forward(self.engine.params, batch))
      for i, (toks, n) in enumerate(chunk):
        end = len(toks) - 1
        sl = slice(end - n, end)
        out.append((float(-ce[i, sl].astype(np.float64).sum()), bool(np.all(correct[i, sl] > 0))))
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    rows = []
    for _, ctx, cont in requests:
      if len(cont) > self.max_length:
        raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length="
                         f"{self.max_length}; it cannot be scored whole.")
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]  # truncated from the left
      rows.append((whole, len(cont)))
    res = self._score(rows)
    for (key, _, _), r in zip(requests, res):
      self.cache_hook.add_partial("loglikelihood", key, r)
    return res

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    out = []
    for req in requests:
      (string,) = req.args
      windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string, add_special_tokens=False),
          prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)]
      scores = self._score([(list(a) + list(b), len(b)) for a, b in windows])
      total = float(sum(s for s, _ in scores))
      self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
      out.append(total)
    return out

  # ------------------------------------------------------------------ generation
  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    eos = self.tok_decode([self.eot_token_id])
    for idx in groups.values():
      kw = normalize_gen_kwargs(dict(requests[idx[0]].args[1]), self.max_gen_toks)
      until = handle_stop_sequences(kw.pop("until", None), eos=eos)
      max_gen = int(kw.pop("max_gen_toks"))
      if max_gen >= self.max_length:
        raise ValueError(f"max_gen_toks={max_gen} must be < max_length={self.max_length}.")
      temperature = float(kw.get("temperature", 0.0) or 0.0) if kw.get("do_sample") else 0.0
      for b0 in range(0, len(idx), self.batch_size):
        part = idx[b0:b0 + self.batch_size]
        prompts = []
        for i in part:
          ids = self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]
          prompts.append(ids[-(self.max_length - max_gen):])  # left truncation
        gen = self.engine.generate(prompts, max_new_tokens=max_gen,
                                   stop_tokens=(self.eot_token_id,),
                                   stop_strings=tuple(s for s in until if s),
                                   temperature=temperature, seed=self.seed)
        for j, i in enumerate(part):
          text = gen.text[j] if gen.text is not None else self.tok_decode(gen.tokens[j])
          for s in until:  # the engine cuts at a stop string; EOS text too
            if s and s in text:
              text = text[:text.index(s)]
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out  # type: ignore[return-value]


def simple_evaluate(lm: CondattnLM, tasks: Sequence[Any], **kwargs) -> dict:
  """`lm_eval.simple_evaluate(model=lm, tasks=tasks, **kwargs)`."""
  import lm_eval
  return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), **kwargs)
