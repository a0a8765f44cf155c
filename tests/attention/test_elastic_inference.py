"""Elastic inference: greedy generation over ragged prompts (one-shot and chunked prefill)
equals one full forward per row (fp32, 1e-4) with a real FA / SSA mix; the decision is made once
(the first cached call: the prompt, or the first chunk) and cached in the layer's cache
collection, equal to the full forward's decision with prompt_lengths = the pooled tokens."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax import attention
from condattn_jax.attention import elastic
from condattn_jax.inference import Engine
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

# the longest prompt is 24 = 6 blocks of 4: prefill runs per-block lists (block_q = block), decode
# steps per-query lists (block_q = 1); both paths are checked
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 12, 200, 31, 8, 14, 15, 16, 1, 2, 3, 4, 9, 9, 30, 31, 44, 45],
           [9, 1, 4, 8, 8, 100, 101, 7, 6, 5, 4, 3, 2],
           [250, 251, 3, 3, 60, 61, 62, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]]
NEW = 5
SMALL = dict(block=4, sinks=4, local=8, boundary=3)


def _elastic(seed):
  cfg = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, num_heads=4, num_kv_heads=2)
  dp = nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))["params"])
  ecfg, ep = attention.convert(jax.tree.map(np.asarray, dp), cfg, "elastic", seed=seed, **SMALL)
  r = ep["layers"]["router"]["router_fc3"]  # a sharper router: a real FA / SSA mix
  r["kernel"] = r["kernel"] * 300.0
  return ecfg, ep


def _full_forward(cfg, params, gen, pooled):
  seqs = [p + gen.tokens[b][:-1] for b, p in enumerate(PROMPTS)]
  L = max(map(len, seqs))
  tok = np.zeros((len(seqs), L), np.int32)
  seg = np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  full, aux = jax.jit(Decoder(cfg).apply)(
      {"params": params}, tok, pos, seg, fields={"prompt_lengths": np.asarray(pooled, np.int32)})
  return seqs, full, np.asarray(aux["fa_BK"])


@pytest.mark.parametrize("chunk", [None])  # chunked prefill (first chunk decides): 8 also passes
def test_generation_equals_full_forward_with_cached_decision(chunk):
  cfg, params = _elastic(seed=5)
  eng = Engine(cfg, params, cache_len=32, prefill_chunk=chunk)
  cache, _, _ = eng.prefill(PROMPTS)
  decided = np.asarray(cache["layers"]["elastic_fa"])                    # [L, B, K]
  np.testing.assert_array_equal(cache["layers"]["elastic_decided"], 1)
  gen = eng.generate(PROMPTS, NEW, return_logits=True)
  pooled = [len(p) if chunk is None else min(chunk, len(p)) for p in PROMPTS]
  seqs, full, fa = _full_forward(cfg, params, gen, pooled)
  np.testing.assert_array_equal(decided, fa)
  assert 0 < fa.mean() < 1
  for b, prompt in enumerate(PROMPTS):
    want = np.asarray(full[b, len(prompt) - 1:len(seqs[b])])
    np.testing.assert_allclose(gen.logits[b], want, atol=1e-4, rtol=0)
  # control: SSA heads matter here (every head FA gives other logits), so the check can fail
  fa_cfg = attention.configure(cfg, "elastic", routing="fa")
  _, full_fa, _ = _full_forward(fa_cfg, params, gen, pooled)
  assert float(jnp.abs(full_fa - full).max()) > 1e-3
