"""GPU: decode attention over a full cache (ops.attention with MaskSpec.kv_lengths_B, one query
per row) runs cuDNN with the GQA group folded into the query rows, and equals the float32
reference; the engine's decode step with it equals the engine on the reference attention.

    pytest -q tests/gpu/test_decode_gpu.py     (skipped without a GPU)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
  pytest.skip("needs a GPU", allow_module_level=True)

from condattn_jax import ops  # noqa: E402


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("K,G,S,active", [(2, 6, 8192, True), (16, 1, 4096, False),
                                          (8, 4, 1000, True)])
def test_cudnn_decode_vs_reference(K, G, S, active):
  """Qwen2.5-1.5B's GQA 6 with an L2A-style inactive row (rows 0, 2, 3 dense), no GQA, and a
  cache length no multiple of a tile; one compile each (the compiled program's text is read and
  the same executable runs)."""
  B, H = 4, 128
  ks = jax.random.split(jax.random.PRNGKey(S + K), 4)
  q = jax.random.normal(ks[0], (B, 1, K * G, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
  lengths = jnp.asarray([S, S // 3, 1, S - 5], jnp.int32)
  slot = jnp.arange(S, dtype=jnp.int32)[None]
  valid = (slot < lengths[:, None]).astype(jnp.int32)
  # finite garbage past the fill (the engine's empty slots are zeros; cuDNN multiplies the
  # masked tail of its last tile by 0, so NaN there would leak): must not reach the result
  k = jnp.where(valid[..., None, None] == 1, k, 300.0)
  v = jnp.where(valid[..., None, None] == 1, v, 300.0)
  act = jnp.asarray([[True], [False], [True], [True]]) if active else None
  mask = ops.MaskSpec(q_positions_BT=(lengths - 1)[:, None],
                      kv_positions_BS=jnp.broadcast_to(slot, (B, S)), kv_segment_ids_BS=valid,
                      active=act, kv_lengths_B=lengths)
  f = jax.jit(lambda q, k, v, m: ops.attention(q, k, v, m)).lower(q, k, v, mask).compile()
  assert "cudnn" in f.as_text().lower()  # the decode path really took cuDNN
  out = f(q, k, v, mask)
  ref = ops.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask,
                      impl="reference")
  bad = ~np.isfinite(np.asarray(out, np.float32)).all(axis=(1, 2, 3))
  assert not bad.any(), f"rows {np.flatnonzero(bad)} not finite (lengths {lengths})"
  assert _rel(out, ref) < 1e-2
  if active:
    assert float(jnp.abs(out[1].astype(jnp.float32)).max()) == 0.0


@pytest.mark.gpu
def test_engine_decode_with_cudnn_equals_reference_attention():
  import flax.linen as nn
  from condattn_jax.inference import Engine
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  base = dict(family="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
              num_layers=2, num_heads=12, num_kv_heads=2, head_dim=128, attention_bias=True,
              tie_word_embeddings=True, dtype="bfloat16", param_dtype="bfloat16")
  cfg = ModelConfig(**base)
  params = nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 512, n).astype(np.int32) for n in (300, 77, 512)]
  outs = []
  for impl in ("auto", "reference"):
    eng = Engine(cfg.replace(attention_impl=impl), params, cache_len=640)
    cache, logits, lengths = eng.prefill(prompts)
    tok = np.asarray(logits).argmax(-1)
    outs.append(np.asarray(eng.decode_step(cache, tok, lengths, np.ones(3, bool), logits)[1]))
  assert _rel(outs[0], outs[1]) < 2e-2
