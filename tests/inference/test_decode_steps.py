"""Engine.decode_greedy: k greedy decode steps in one jitted program (issue 33's host cost per
token) equal k single `decode_step`s fed the argmax of the previous logits, ragged rows and an
inactive row included; the scan carries every cache buffer in place. Engine(split_layers=True)
(each layer's weights their own arrays) generates what the stacked engine does. A one-token
write into a full cache equals the general dropping scatter."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax.inference import Engine
from condattn_jax.inference.engine import cache_bytes
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

B, S, K = 3, 32, 4


CFG = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, vocab_size=64, hidden_size=32,
                  intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def params():
  return nn.unbox(Decoder(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])


def test_split_layers_engine_generates_the_same(params):
  prompts = [[3, 9, 4, 1, 7], [5, 2]]
  a = Engine(CFG, params, cache_len=S).generate(prompts, 5, return_logits=True)
  split = Engine(CFG, params, cache_len=S, split_layers=True)
  assert isinstance(split.params["layers"], tuple) and len(split.params["layers"]) == 2
  b = split.generate(prompts, 5, return_logits=True)
  assert a.tokens == b.tokens
  for x, y in zip(a.logits, b.logits):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_decode_greedy_equals_single_steps(params):
  cfg = CFG
  eng = Engine(cfg, params, cache_len=S)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 64, n, dtype=np.int32) for n in (5, 9, 7)]  # ragged
  cache, logits, lengths, _ = eng._prefill(prompts)
  active = np.array([True, False, True])  # row 1 sits out: no write, logits kept

  c1, l1, pos, toks = jax.tree.map(jnp.copy, cache), logits, np.asarray(lengths), []
  for _ in range(K):
    t = np.asarray(jnp.argmax(l1, -1), np.int32)
    toks.append(t)
    c1, l1 = eng.decode_step(c1, t, pos, active, l1)
    pos = pos + active
  c2, l2, tokens_BK = eng.decode_greedy(cache, np.asarray(lengths), active, logits, K)
  np.testing.assert_array_equal(tokens_BK, np.stack(toks, 1))
  np.testing.assert_allclose(l2, l1, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(l2[1], logits[1])  # the inactive row's logits untouched
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), c1, c2)

  # the program carries every cache buffer in place through the scan
  m = eng._greedy_steps.lower(eng, eng.params, c1, jnp.zeros((B, 1), jnp.int32),
                              jnp.ones((B, 1), bool), l1, K).compile().memory_analysis()
  assert m.alias_size_in_bytes == cache_bytes(c1)
  with pytest.raises(ValueError, match="steps must be an int >= 1"):
    eng.decode_greedy(c1, pos, active, l1, 0)


@pytest.mark.parametrize("B", [1, 3])
def test_one_token_write_equals_the_dropping_scatter(B, monkeypatch):
  """A one-token write into a full cache (models.layers._ONE_TOKEN_WRITE: one in-place update
  per array, a dynamic-update-slice at B = 1, a scatter of B in-range slots else) leaves the
  cache exactly as the general scatter that drops padding, for ragged fills (slots past a row's
  length hold zeros) with an inactive row (nothing changes), and its program holds no
  scatter at B = 1 (a one-index scatter is a bounds check + old-value select on XLA:GPU)."""
  from condattn_jax.models import layers
  size, K, H = 5, 2, 8
  rng = np.random.default_rng(0)
  length = np.asarray([3, 0, 4][:B], np.int32)
  filled = (np.arange(size)[None] < length[:, None])
  cache = dict(key=jnp.asarray(rng.standard_normal((B, size, K, H)) * filled[..., None, None],
                               jnp.float32),
               value=jnp.asarray(rng.standard_normal((B, size, K, H)) * filled[..., None, None],
                                 jnp.float32),
               positions=jnp.asarray(np.where(filled, np.arange(size)[None], 0), jnp.int32),
               valid=jnp.asarray(filled, jnp.int32), length=jnp.asarray(length))
  k = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  pos = jnp.asarray(length[:, None])
  for valid in ([[True], [False], [True]][:B], [[False]] * B):
    valid = jnp.asarray(valid)

    def write():
      return layers.KVCache().apply({"cache": cache}, k, v, pos, valid, kind="full", size=size,
                                    mutable=["cache"])[1]["cache"]
    new = jax.jit(write)()
    if B == 1:
      assert "scatter" not in str(jax.make_jaxpr(write)())
    with monkeypatch.context() as m:
      m.setattr(layers, "_ONE_TOKEN_WRITE", False)
      ref = write()  # the scatter that drops out-of-range slots
    jax.tree.map(np.testing.assert_array_equal, new, ref)
    np.testing.assert_array_equal(new["length"], length + np.asarray(valid)[:, 0])
    if bool(valid[0, 0]):
      np.testing.assert_array_equal(new["key"][0, length[0]], k[0, 0])


def _same_generation(a, b):
  assert (a.tokens, a.finish_reason, a.text, a.steps) == (b.tokens, b.finish_reason, b.text, b.steps)
  for x, y in zip(a.stats, b.stats):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-9), x, y)


def test_generate_in_greedy_chunks_equals_one_step_calls():
  """With Engine(greedy_steps=8), a greedy generate that keeps no logits runs 8 steps a call
  (decode_greedy's program): the same tokens, text, finish reasons, per-row routing stats
  (L2A) and step count as one step a call, with rows that stop inside a chunk (a stop string, a
  stop token) beside a row that runs to max_new_tokens = 11 (not a multiple of 8)."""
  import os
  from condattn_jax.data.tokenizer import load_tokenizer
  from tests._train_helpers import ROOT
  from tests.inference.test_inference import _l2a
  cfg, p = _l2a()
  tok = load_tokenizer(os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen"))
  one, eight = (Engine(cfg, p, cache_len=24, greedy_steps=k) for k in (1, 8))
  assert eight.greedy_steps == 8
  one.tokenizer = eight.tokenizer = tok  # byte-level: decodes every id of the 256
  prompts = [[28, 38, 11], [27, 22, 66, 64], [5, 9]]
  free = one.generate(prompts, 11)
  _same_generation(free, eight.generate(prompts, 11))
  t2 = free.text[2]  # a stop string in the middle of row 2's text, not in row 0's
  stop = next(t2[i:i + 2] for i in range(2, len(t2) - 2)
              if "\ufffd" not in t2[i:i + 2] and t2[i:i + 2] not in free.text[0])
  kw = dict(stop_strings=(stop,), stop_tokens=(free.tokens[1][2],))
  a, b = one.generate(prompts, 11, **kw), eight.generate(prompts, 11, **kw)
  assert a.stats[0]["generated"]  # per-row routing stats exist
  _same_generation(a, b)
  assert a.finish_reason == ["length", "stop_token", "stop_string"]
  assert all(1 < len(t) < 8 for t in a.tokens[1:])  # both inside the first chunk
  with pytest.raises(ValueError, match="greedy_steps"):
    Engine(cfg, p, cache_len=24, greedy_steps=0)


def test_k_step_loop_traces_one_row_dots(params):
  """At B = 1 the one-step program pads its projections to 2-row dots (models.layers.
  _PAD_ONE_ROW: XLA:GPU keeps them GEMMs) while decode_greedy's loop traces one-row dots
  (inside XLA:GPU's while loop the 2-row GEMMs had the stacked weights copied every iteration),
  even after the one-step program was traced (jit caches traces)."""
  import re
  eng = Engine(CFG, params, cache_len=S)
  i32, on = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
  logits, cache = jnp.zeros((1, CFG.vocab_size)), eng.init_cache(1)
  two_row = lambda text: re.search(r"dot_general.*: \(tensor<2x", text) is not None
  assert two_row(eng._step.lower(eng, eng.params, cache, i32, i32, on, logits).as_text())
  assert not two_row(eng._greedy_steps.lower(eng, eng.params, cache, i32, on, logits, 2).as_text())


# The decode step's kernel cuts behind models.layers flags (off until timed on a GPU:
# bench/decode_program's trace sets 'o2d', 'fill1', 'kv1'): each flag's run against ONE
# baseline with every flag off (a module fixture: one compile of the baseline for the 3 tests).
_CUT_FLAGS = ("_O_PROJ_2D", "_SHARED_FILL", "_SHARED_KV_STATE")


def _cut_run(params, on=None):
  """Chunked ragged prefill (chunks of 4) + 3 greedy steps with an inactive row, with flag
  `on` of _CUT_FLAGS set (the others off): (cache, logits after the prefill and each step,
  the StableHLO of the B = 1 step)."""
  import contextlib
  from unittest import mock
  from condattn_jax.models import layers
  with contextlib.ExitStack() as stack:
    for name in _CUT_FLAGS:
      stack.enter_context(mock.patch.object(layers, name, name == on))
    jax.clear_caches()  # engines of one config share traces
    eng = Engine(CFG, params, cache_len=S, prefill_chunk=4)
    c, l, pos, _ = eng._prefill([[3, 9, 4, 1, 7, 2, 8], [5, 2], [8]])
    active, outs = np.array([True, False, True]), [l]
    for _ in range(3):
      c, l = eng.decode_step(c, np.asarray(jnp.argmax(l, -1), np.int32), pos, active, l)
      pos, outs = pos + active, outs + [l]
    i32, one = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    text = eng._step.lower(eng, eng.params, eng.init_cache(1), i32, i32, one,
                           jnp.zeros((1, CFG.vocab_size))).as_text()
  jax.clear_caches()
  return c, outs, text


@pytest.fixture(scope="module")
def cut_baseline(params):
  return _cut_run(params)


def _same_decode(base, run, cache_names=None):
  """Logits (1e-6) and caches of a flag's run == the baseline's (`cache_names(i)`: the names
  layer i's cache holds under the flag; default all)."""
  for x, y in zip(base[1], run[1]):
    np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
  for i in range(CFG.num_layers):
    a, b = base[0][f"layers_{i}"]["self_attn"]["cache"], run[0][f"layers_{i}"]["self_attn"]["cache"]
    assert sorted(b) == sorted(a if cache_names is None else cache_names(i))
    for name in b:
      np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-6)


def test_o_proj_2d_decodes_the_same(params, cut_baseline):
  """models.layers._O_PROJ_2D (the o_proj as a [..., N*H] x [N*H, D] dot for one token a row):
  the same logits / caches, and at B = 1 the padded one-row o_proj is the 2-D dot."""
  run = _cut_run(params, "_O_PROJ_2D")
  _same_decode(cut_baseline, run)
  o2d = "(tensor<2x32xf32>, tensor<32x32xf32>) -> tensor<2x32xf32>"  # o: [N*H, D]
  assert o2d in run[2] and o2d not in cut_baseline[2]


def test_shared_fill_decodes_the_same(params, cut_baseline):
  """models.layers._SHARED_FILL: every layer's decode attention reads its fill off one
  per-step value from layer 0's counter: the same logits / caches, and the traced step
  builds its fill once (one `minimum` fewer per layer after the first)."""
  run = _cut_run(params, "_SHARED_FILL")
  _same_decode(cut_baseline, run)
  mins = [r[2].count("stablehlo.minimum") for r in (cut_baseline, run)]
  assert mins[1] == mins[0] - (CFG.num_layers - 1), mins


def test_shared_kv_state_decodes_the_same(params, cut_baseline):
  """models.layers._SHARED_KV_STATE: a dense decode keeps positions / valid / length once
  (layers_0), the other layers write key / value at its slots: the same logits, key / value in
  every layer and bookkeeping as layer 0's (chunked prefill and steps), and the B = 1 step runs
  2 in-place updates a layer after the first (4 in layer 0)."""
  run = _cut_run(params, "_SHARED_KV_STATE")
  names = ["key", "length", "positions", "valid", "value"]
  _same_decode(cut_baseline, run, lambda i: names if i == 0 else ["key", "value"])
  L = CFG.num_layers
  dus = [r[2].count("stablehlo.dynamic_update_slice") for r in (cut_baseline, run)]
  assert dus == [4 * L, 4 + 2 * (L - 1)], dus
  from unittest import mock
  from condattn_jax.models import layers
  with mock.patch.object(layers, "_SHARED_KV_STATE", True), pytest.raises(
      ValueError, match="do not stack"):
    Engine(CFG, params, cache_len=S).stacked_cache(run[0])
