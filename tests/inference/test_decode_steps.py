"""Engine.decode_greedy: k greedy decode steps in one jitted program (issue 33's host cost per
token) equal k single `decode_step`s fed the argmax of the previous logits, ragged rows and an
inactive row included; the scan carries every cache buffer in place. Engine(split_layers=True)
(each layer's weights their own arrays) generates what the stacked engine does."""
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


@pytest.mark.parametrize("kind", ["full", "window"])
def test_one_token_cache_write_equals_the_dropping_scatter(kind, monkeypatch):
  """A one-token write (one in-range slot per row; an inactive row rewrites its slot's value)
  leaves the cache exactly as the general scatter that drops out-of-range slots: a full row
  (length == size) that is inactive keeps its last key, an active row writes at its length
  (a ring: length mod size; a full cache: nothing past its end)."""
  from condattn_jax.models import layers
  B, size, K, H = 3, 4, 2, 8
  rng = np.random.default_rng(0)
  cache = dict(key=jnp.asarray(rng.standard_normal((B, size, K, H)), jnp.float32),
               value=jnp.asarray(rng.standard_normal((B, size, K, H)), jnp.float32),
               positions=jnp.asarray(rng.integers(0, 9, (B, size)), jnp.int32),
               valid=jnp.ones((B, size), jnp.int32), length=jnp.asarray([4, 2, 5], jnp.int32))
  k = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  pos, valid = jnp.asarray([[4], [2], [5]]), jnp.asarray([[False], [True], [True]])

  def write():
    return layers.KVCache().apply({"cache": cache}, k, v, pos, valid, kind=kind, size=size,
                                  mutable=["cache"])[1]["cache"]
  ref = write()  # the default: the scatter that drops out-of-range slots
  monkeypatch.setattr(layers, "_IN_RANGE_DECODE_WRITE", True)
  new = write()
  jax.tree.map(np.testing.assert_array_equal, new, ref)
  np.testing.assert_array_equal(new["key"][0], cache["key"][0])  # inactive full row untouched
  np.testing.assert_array_equal(new["key"][1, 2], k[1, 0])
  np.testing.assert_array_equal(new["length"], [4, 3, 6])
  if kind == "window":
    np.testing.assert_array_equal(new["value"][2, 1], v[2, 0])  # slot 5 mod 4


@pytest.mark.manual
def test_projection_2d_generates_the_same(params, monkeypatch):
  """models.layers._PROJECTION_2D (q / k / v / o as 2-D matmuls, off by default): the same
  tokens and logits (float32, 1e-5) as the dot_general path. Manual (19 CPU-s): the flag stays
  off after its H100 A/B (docs/performance.md), so `make test` runs only the default path, which
  tests/schemes/test_conformance.py::test_generation_equals_the_declared_forward covers; run this
  before switching the flag on."""
  from condattn_jax.models import layers
  prompts = [[3, 9, 4, 1, 7], [5, 2]]
  a = Engine(CFG, params, cache_len=S).generate(prompts, 4, return_logits=True)
  monkeypatch.setattr(layers, "_PROJECTION_2D", True)
  jax.clear_caches()  # engines of one config share traces
  b = Engine(CFG, params, cache_len=S).generate(prompts, 4, return_logits=True)
  jax.clear_caches()
  assert a.tokens == b.tokens
  for x, y in zip(a.logits, b.logits):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
