"""The engine's step writes each layer's new K/V into that layer's cache in place: its compiled
program (CPU) aliases every cache buffer to its output and holds no cache-sized temporary
(peak = params + one cache + O(one layer's attention)); the scanned decoder layout, which carries
the stacked cache through the layer loop, does (the control)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax.inference import Engine
from condattn_jax.inference.engine import cache_bytes
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

L, B, S, N = 8, 2, 4096, 4


@pytest.fixture(scope="module")
def engine():
  cfg = ModelConfig(family="qwen3", qk_norm="head", num_layers=L, vocab_size=64, hidden_size=32,
                    intermediate_size=64, num_heads=N, num_kv_heads=2, head_dim=8)
  # zeros of the init's shapes (eval_shape: no init program compiled): the memory analysis
  # depends on shapes only
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(0),
                                                             jnp.zeros((1, 8), jnp.int32))))
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes["params"])
  return Engine(cfg, params, cache_len=S)


def _memory(eng, cache, C):
  args = (eng.params, cache, jnp.zeros((B, C), jnp.int32), jnp.zeros((B, C), jnp.int32),
          jnp.ones((B, C), bool), jnp.zeros((B, eng.config.vocab_size), jnp.float32))
  return Engine._step.lower(eng, *args).compile().memory_analysis()


@pytest.mark.parametrize("C", [1, 8])  # a decode step, a chunked-prefill step
def test_step_writes_caches_in_place(engine, C):
  cache = engine.init_cache(B)
  assert sorted(cache) == [f"layers_{i}" for i in range(L)]  # one cache per layer
  total = cache_bytes(cache)
  per_layer = total // L
  m = _memory(engine, cache, C)
  assert m.alias_size_in_bytes == total  # every cache buffer donated and written in place
  # the temporaries: one layer's attention at a time (the CPU reference reads a transposed copy
  # of that layer's K / V and holds float32 scores [B, N, C, S]), never a cache-sized buffer
  scores = B * N * C * S * 4
  assert m.temp_size_in_bytes < 1.25 * per_layer + 2.5 * scores, (m.temp_size_in_bytes, total)
  assert m.temp_size_in_bytes < total / 2


def test_scanned_layout_copies_the_cache(engine):
  """The control: the same step over the scanned layers' stacked cache holds more than a
  whole cache in temporaries (the copy the unrolled layout removes)."""
  model, cfg = engine.model, engine.config
  shapes = jax.eval_shape(lambda p: model.apply(
      {"params": p}, jnp.zeros((B, 1), jnp.int32), decode=True, cache_len=S,
      mutable=["cache"])[1]["cache"], engine.stacked_params())
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, t, decode=True,
                                             cache_len=S, mutable=["cache"])[1]["cache"],
                 donate_argnums=1)
  m = step.lower(engine.stacked_params(), cache, jnp.zeros((B, 1), jnp.int32)).compile(
      ).memory_analysis()
  assert m.temp_size_in_bytes > cache_bytes(cache)
