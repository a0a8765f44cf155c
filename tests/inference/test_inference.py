"""Inference engine: greedy generation over ragged prompts equals one full forward per row
(sliding-window dense one-shot and chunked, context-free L2A one-shot; dense and learned-routing
L2A: tests/schemes/test_conformance.py; context-free L2A chunked:
tests/inference/test_decode_steps.py), chunked prefill equals
one-shot prefill, caches are per row and as large as the scheme's analytic count."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _programs
from _train_helpers import random_params
from condattn_jax import attention
from condattn_jax.attention import l2a
from condattn_jax.inference import Engine, cache_bytes
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 12, 200, 31, 8], [9, 1, 4], [250, 251, 3, 3, 60, 61, 62]]
NEW = 6


def _dense(**kw):
  """(cfg, params) of the qwen3 test model (2 layers) with the config overrides kw: built once
  per kw in a process (test_generation_api shares them); callers do not modify the params."""
  return _dense_once(tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _dense_once(kw):
  cfg = ModelConfig(family="qwen3", qk_norm="head", num_layers=2).replace(**dict(kw))
  tok = jnp.zeros((1, 8), jnp.int32)
  # host random values on the init's shapes (eval_shape: no init program compiled); norm
  # scales 1 + N(0, 0.1), every other leaf N(0, 0.1)
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(3), tok)))
  return cfg, random_params(shapes["params"], seed=3)


def _l2a(routing="learned", **kw):
  cfg, dp = _dense()
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4, routing=routing, theta=0.6, **kw)
  per = stacking.unstack_layers(lp)
  for i in range(cfg.num_layers):  # a random router: a real mix of global / local tokens
    if "router" in per[f"layers_{i}"]:
      k = per[f"layers_{i}"]["router"]["kernel"]
      per[f"layers_{i}"]["router"]["kernel"] = 0.1 * jax.random.normal(jax.random.PRNGKey(i), k.shape)
  return lcfg, stacking.to_model_layout(per, lcfg)


def _check_against_full_forward(cfg, params, gen):
  """One full forward over the batch of prompt + generated tokens (right-padded, padding marked
  by segment id 0; row order kept, so context-free draws keyed on (row, position) match)."""
  seqs = [prompt + gen.tokens[b][:-1] for b, prompt in enumerate(PROMPTS)]
  L = max(map(len, seqs))
  tok = np.zeros((len(seqs), L), np.int32)
  seg = np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  full, _ = _programs.apply(cfg)(params, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg))
  for b, prompt in enumerate(PROMPTS):
    want = np.asarray(full[b, len(prompt) - 1:len(seqs[b])])
    np.testing.assert_allclose(gen.logits[b], want, atol=1e-4, rtol=0)
    assert gen.tokens[b] == list(want.argmax(-1))


# dense (qwen3, 3 layers) and L2A with learned routing (layer 1 pruned, layers 0 and 2 routed by
# their routers, window 4): the schemes' tiny models, checked one-shot and in chunks of 4 by
# tests/schemes/test_conformance.py::test_generation_equals_the_declared_forward. Context-free
# L2A in chunks of 4: tests/inference/test_decode_steps.py::test_l2a_decode_equals_the_scanned_
# decode_and_the_forward (the engine's chunked prefill + decode == the full forward, 1e-5).
CASES = {
    ("dense_window", None): lambda: _dense(sliding_window=4),
    ("dense_window", 4): lambda: _dense(sliding_window=4),
    ("l2a_context_free", None): lambda: _l2a("bernoulli", bernoulli_q=0.4),
}


@pytest.mark.parametrize("case, chunk", sorted(CASES, key=str))
def test_generation_equals_full_forward_ragged(case, chunk):
  cfg, params = CASES[case, chunk]()
  eng = Engine(cfg, params, cache_len=32, prefill_chunk=chunk)
  gen = eng.generate(PROMPTS, NEW, return_logits=True)
  assert [len(t) for t in gen.tokens] == [NEW] * len(PROMPTS)
  _check_against_full_forward(cfg, params, gen)


def test_stop_tokens_end_rows_independently():
  """On the sliding-window dense model (the one-shot engine the generation test compiled)."""
  cfg, params = CASES["dense_window", None]()
  eng = Engine(cfg, params, cache_len=32)
  free = eng.generate(PROMPTS, NEW)
  stop = free.tokens[1][2]  # row 1 stops at its third token; others go on unless they hit it
  gen = eng.generate(PROMPTS, NEW, stop_tokens=(stop,))
  for b, toks in enumerate(free.tokens):
    want = toks[:toks.index(stop) + 1] if stop in toks else toks
    assert gen.tokens[b] == want


def test_cache_is_per_row_and_sized_like_the_schemes_count():
  lcfg, lp = CASES["l2a_context_free", None]()  # its prefill compiled by the generation test
  eng = Engine(lcfg, lp, cache_len=32)
  cache, _, lengths = eng.prefill(PROMPTS)
  cache = eng.stacked_cache(cache)  # one cache per layer, viewed with a leading layer axis
  glen = cache["layers"]["global_attn"]["cache"]["length"]  # [L, B]
  np.testing.assert_array_equal(glen, np.broadcast_to(lengths, glen.shape))
  ring = cache["layers"]["self_attn"]["cache"]
  assert ring["key"].shape[2] == 4  # the window ring holds w slots
  np.testing.assert_array_equal(ring["length"], np.broadcast_to(lengths, glen.shape))
  # bytes: the real cache vs the scheme's analytic count (+ positions / valid / length words)
  kv = l2a.kv_cache_bytes(lcfg, 32, batch=len(PROMPTS))["total"]
  assert kv <= cache_bytes(cache) <= 1.5 * kv


def test_bad_requests_are_clear():
  cfg, params = _dense()
  eng = Engine(cfg, params, cache_len=8)
  with pytest.raises(ValueError, match="cache_len=8"):
    eng.generate(PROMPTS, NEW)
  with pytest.raises(ValueError, match="empty prompt"):
    eng.prefill([[1, 2], []])


def test_chunked_prefill_compiles_its_step_once():
  """The chunk step runs on a fresh zero cache first and on its own (committed) outputs after:
  both must hit one executable (a second compile costs minutes at 7B scale on a GPU)."""
  cfg, params = _dense()
  eng = Engine(cfg, params, cache_len=64, prefill_chunk=4)
  before = Engine._step._cache_size()  # one jit cache for every engine (self is static)
  for _ in range(2):
    _, logits, _ = eng.prefill([PROMPTS[0], PROMPTS[1]])    # 3 chunks per prefill
    logits.block_until_ready()
  assert Engine._step._cache_size() == before + 1
