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


def test_o_proj_2d_decodes_the_same(params, monkeypatch):
  """models.layers._O_PROJ_2D (off; the o_proj as a [..., N*H] x [N*H, D] dot, for
  bench/decode_program's 'o2d' A/B): the same B = 2 decode step (logits 1e-6, caches), and at
  B = 1 the padded one-row o_proj is the 2-D dot."""
  from condattn_jax.models import layers
  eng = Engine(CFG, params, cache_len=S)
  cache, logits, lengths, _ = eng._prefill([[3, 9, 4, 1, 7], [5, 2]])
  step = lambda: eng.decode_step(jax.tree.map(jnp.copy, cache), [2, 6], lengths, [True, True],
                                 logits)
  monkeypatch.setattr(layers, "_O_PROJ_2D", False)
  c1, l1 = step()
  monkeypatch.setattr(layers, "_O_PROJ_2D", True)
  jax.clear_caches()  # engines of one config share traces
  c2, l2 = step()
  jax.clear_caches()
  np.testing.assert_allclose(l2, l1, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), c1, c2)
  i32 = jnp.zeros((1, 1), jnp.int32)
  text = eng._step.lower(eng, eng.params, eng.init_cache(1), i32, i32, jnp.ones((1, 1), bool),
                         logits[:1]).as_text()
  jax.clear_caches()
  assert "(tensor<2x32xf32>, tensor<32x32xf32>) -> tensor<2x32xf32>" in text  # o: [N*H, D]


def test_shared_fill_decodes_the_same(params, monkeypatch):
  """models.layers._SHARED_FILL (off; bench/decode_program's 'fill1' A/B): every layer's decode
  attention reads its fill off one per-step value from layer 0's counter. Ragged rows and an
  inactive row: the same logits (1e-6) and caches over 3 greedy steps, and the traced step
  builds its fill once (one `minimum` fewer per layer after the first)."""
  from condattn_jax.models import layers
  eng = Engine(CFG, params, cache_len=S)
  cache, logits, lengths, _ = eng._prefill([[3, 9, 4, 1, 7], [5, 2], [8]])
  active = np.array([True, False, True])
  i32, on = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)

  def run():
    jax.clear_caches()  # engines of one config share traces
    c, l, pos, outs = jax.tree.map(jnp.copy, cache), logits, np.asarray(lengths), []
    for _ in range(3):
      c, l = eng.decode_step(c, np.asarray(jnp.argmax(l, -1), np.int32), pos, active, l)
      pos, outs = pos + active, outs + [l]
    text = eng._step.lower(eng, eng.params, eng.init_cache(1), i32, i32, on,
                           jnp.zeros((1, CFG.vocab_size))).as_text()
    return c, outs, text.count("stablehlo.minimum")
  monkeypatch.setattr(layers, "_SHARED_KV_STATE", False)  # (it shares the fill too)
  monkeypatch.setattr(layers, "_SHARED_FILL", False)
  c1, l1, mins_off = run()
  monkeypatch.setattr(layers, "_SHARED_FILL", True)
  c2, l2, mins_on = run()
  jax.clear_caches()
  for x, y in zip(l1, l2):
    np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), c1, c2)
  assert mins_on == mins_off - (CFG.num_layers - 1), (mins_off, mins_on)


def test_shared_kv_state_decodes_the_same(params, monkeypatch):
  """models.layers._SHARED_KV_STATE (off; bench/decode_program's 'kv1' A/B): a dense decode
  keeps positions / valid / length once (layers_0), the other layers write key / value at its
  slots. Chunked ragged prefill (chunks of 4) + 3 greedy steps with an inactive row: the same
  logits (1e-6), key / value in every layer and bookkeeping as layer 0's; the B = 1 step runs
  2 in-place updates a layer after the first (4 in layer 0)."""
  from condattn_jax.models import layers
  prompts, active = [[3, 9, 4, 1, 7, 2, 8], [5, 2], [8]], np.array([True, False, True])
  i32, on = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)

  def run():
    jax.clear_caches()  # engines of one config share traces
    eng = Engine(CFG, params, cache_len=S, prefill_chunk=4)
    c, l, pos, _ = eng._prefill(prompts)
    outs = [l]
    for _ in range(3):
      c, l = eng.decode_step(c, np.asarray(jnp.argmax(l, -1), np.int32), pos, active, l)
      pos, outs = pos + active, outs + [l]
    text = eng._step.lower(eng, eng.params, eng.init_cache(1), i32, i32, on,
                           jnp.zeros((1, CFG.vocab_size))).as_text()
    return c, outs, text.count("stablehlo.dynamic_update_slice")
  monkeypatch.setattr(layers, "_SHARED_KV_STATE", False)
  c1, l1, dus_off = run()
  monkeypatch.setattr(layers, "_SHARED_KV_STATE", True)
  c2, l2, dus_on = run()
  jax.clear_caches()
  for x, y in zip(l1, l2):
    np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
  for i in range(CFG.num_layers):
    a, b = c1[f"layers_{i}"]["self_attn"]["cache"], c2[f"layers_{i}"]["self_attn"]["cache"]
    assert sorted(b) == (sorted(a) if i == 0 else ["key", "value"])
    for name in b:
      np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-6)
  L = CFG.num_layers
  assert (dus_off, dus_on) == (4 * L, 4 + 2 * (L - 1))
