"""Scheme 'segmented' through inference.Engine: the cache is what kv_cache_bytes says and its
segment buffers do not grow with the context; a prefill chunk must divide segment_len. (Greedy
generation == the segmented training forward over ragged rows, one-shot and chunked, is
tests/schemes/test_conformance.py on the same options.)"""
import jax
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import segmented as sgm
from condattn_jax.inference import Engine, cache_bytes
from condattn_jax.models.config import ModelConfig

OPTS = dict(segment_len=8, tail_len=4, retrieve_len=8, long_heads=(1,), long_layers=(1,),
            query_len=8, summary_window=4, summary_stride=2, summary_tail=2, topk=3, anchors=2,
            expand=(-1, 2))
PROMPTS = [list(range(3, 22)), [9, 1, 4, 7, 30, 31], list(range(40, 52))]
NEW = 7  # rows cross segment boundaries while decoding (19 + 7, 12 + 7 tokens)


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm="head",
                    rope_theta=100.0)
  dp = host_init(cfg, 0)
  return attention.convert(dp, cfg, "segmented", **OPTS)


def test_cache_bytes_and_chunk_errors(model):
  """The engine's cache for 3 rows (Engine.init_cache: the tree every prefill / decode program
  takes and gives back; tests/schemes/test_conformance.py::test_engine_cache_bytes_equal_kv_
  cache_bytes[segmented] checks the same count at batch 1 and 3 on the same options)."""
  cfg, params = model
  eng = Engine(cfg, params, cache_len=32, prefill_chunk=8)
  cache = eng.init_cache(len(PROMPTS))
  assert cache_bytes(cache) == sgm.kv_cache_bytes(cfg, 32, batch=len(PROMPTS))["total"]
  cache = eng.stacked_cache(cache)  # one cache per layer, viewed with a leading layer axis
  loc = cache["layers_0_1"]
  assert loc["seg_k"].shape == (1, 3, 8, 2, 8) and "pool_k" not in loc  # S slots, no pool
  assert cache["layers_1_2"]["pool_k"].shape == (1, 3, 32, 1, 8)  # long layer, long head only
  big = sgm.kv_cache_bytes(cfg, 4096, batch=1)
  assert big["segment"] == sgm.kv_cache_bytes(cfg, 32, batch=1)["segment"]  # O(S), not O(T)
  with pytest.raises(ValueError, match="prefill_chunk"):
    Engine(cfg, params, cache_len=32, prefill_chunk=6).prefill(PROMPTS)
