"""GPU smoke test: the block-sparse kernels (forward, dq, dk/dv; Triton, and Mosaic GPU on Hopper)
compiled for the GPU vs the jnp reference, outputs poisoned with NaN first (Triton); the Hopper
program of 'auto' holds Mosaic GPU calls and no Triton call.

    make gpu-smoke        (= pytest -q tests/gpu; skipped without a GPU)
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
  pytest.skip("needs a GPU", allow_module_level=True)

from pallas_kernels.block_sparse import HEAD_BLOCKS, HEAD_FULL, api  # noqa
from pallas_kernels.block_sparse.tables import HEAD_WINDOW_BLOCKS  # noqa: E402
from pallas_kernels.block_sparse.testing import compare, make_problem, run, ssa_lists  # noqa: E402

# Two problems, each compiled once for the reference (shared by the kernels that run it).
PROBLEMS = {
    # every head mode in one launch (4 query heads on one kv head), window + sinks, packed
    # documents, per-head active sets, 128-key tiles: Mosaic GPU only (Triton rejects mode 2)
    "all_modes_window_sinks_packed_bf16": (
        dict(T=1024, N=4, K=1, H=128, L=3, segments=3, window=300, sinks=8, active="head",
             dtype=jnp.bfloat16),
        [HEAD_FULL, HEAD_BLOCKS, HEAD_WINDOW_BLOCKS, HEAD_WINDOW_BLOCKS]),
    # a ragged cache (T, S no multiples of the tiles, sorted positions, a validity mask), GQA
    # 2:1, random FULL / BLOCKS heads, float16, 64-key tiles: both kernels
    "ragged_cache_f16_k64": (
        dict(T=1000, S=1500, N=4, K=2, H=64, L=5, kv_positions=True, block_k=64,
             dtype=jnp.float16), None),
}


@functools.cache
def _problem(name):
  pkw, modes = PROBLEMS[name]
  p = make_problem(len(name), **{**dict(block_q=128, block_k=128), **pkw})
  if modes is not None:
    p.kw["head_mode_BN"] = jnp.asarray([modes] * p.q.shape[0], jnp.int32)
  return p, run(p, impl="reference")


@pytest.mark.gpu
def test_block_sparse_triton_vs_reference_gpu():
  """The Pallas-Triton kernels (the non-Hopper GPU path; CPU interpret mode covers their cases)
  compiled for this GPU, outputs poisoned with NaN first."""
  name = "ragged_cache_f16_k64"
  p, ref = _problem(name)
  errs, bad = compare(p, dict(impl="triton"), reference=ref)
  print(name, errs)
  assert not bad, (name, errs)


@pytest.mark.gpu
def test_full_heads_on_cudnn_split_matches_reference_gpu():
  """Elastic's composite (dense_full_heads): FA KV heads through one cuDNN call,
  SSA heads through the block-sparse kernel (rows with 1 and 3 FA KV heads), vs the reference,
  forward and gradients (bf16)."""
  from condattn_jax import ops
  from condattn_jax.attention.elastic import composite
  B, T, N, K, H = 2, 1024, 8, 4, 128
  rng = np.random.default_rng(0)
  q, k, v, ct = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  lists = jnp.asarray(ssa_lists(B, N, T, T, block_q=128, block_k=128, sink_blocks=1,
                                local_blocks=3))
  mode = np.full((B, N), HEAD_BLOCKS, np.int32)
  mode[0, 2:4] = HEAD_FULL
  mode[1, 0:2] = mode[1, 4:8] = HEAD_FULL
  bl = ops.BlockLists(lists, jnp.asarray(mode), block_q=128, block_k=128)
  mask = ops.MaskSpec(pos, pos, block_lists=bl, contiguous=True)
  run = lambda q, k, v, impl="auto": composite.attention(q, k, v, mask, impl=impl,
                                                        dense_full_heads=True)
  f = lambda impl: jax.jit(jax.value_and_grad(
      lambda q, k, v: jnp.sum(run(q, k, v, impl).astype(jnp.float32) * ct), argnums=(0, 1, 2)))
  hlo = jax.jit(run).lower(q, k, v).as_text()
  assert "cudnn" in hlo.lower()
  (val, g), (val_ref, g_ref) = f("auto")(q, k, v), f("reference")(q, k, v)
  assert abs(float(val) - float(val_ref)) < 1e-2 * abs(float(val_ref)) + 1.0
  for a, b in zip(g, g_ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) < 2e-2 * np.max(np.abs(b)), np.max(np.abs(a - b))


hopper = pytest.mark.skipif(not api._is_hopper(), reason="Mosaic GPU kernels need a Hopper GPU")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_block_sparse_mosaic_gpu_vs_reference_gpu(name):
  """Forward, lse and dq / dk / dv (the dq and dk/dv kernels) against the reference."""
  p, ref = _problem(name)
  errs, bad = compare(p, dict(impl="mosaic_gpu"), reference=ref)
  print(name, errs)
  assert not bad, (name, errs)


@pytest.mark.gpu
@hopper
def test_block_sparse_auto_on_hopper_holds_no_triton_call_gpu():
  """'auto' forward + backward lowered on this Hopper GPU: three Mosaic GPU custom calls (forward,
  dq, dk/dv), none of the Pallas-Triton backend."""
  import re
  B, T, N, K, H = 1, 1024, 8, 2, 128
  q = jnp.ones((B, T, N, H), jnp.bfloat16)
  kv = jnp.ones((B, T, K, H), jnp.bfloat16)
  lists = jnp.asarray(ssa_lists(B, N, T, T, block_q=128, block_k=128, sink_blocks=1,
                                local_blocks=2))
  mode = jnp.asarray([[HEAD_FULL, HEAD_BLOCKS] * (N // 2)], jnp.int32)
  from pallas_kernels.block_sparse import block_sparse_attention
  loss = lambda q, k, v: jnp.sum(block_sparse_attention(q, k, v, lists, mode).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).as_text()
  targets = re.findall(r"custom_call @([\w.]+)", text)
  assert len([t for t in targets if t.startswith("mosaic_gpu")]) == 3, targets
  assert not [t for t in targets if "triton" in t.lower()], targets


@pytest.mark.gpu
@hopper
def test_match_block_sparse_path_equals_gathered_path_gpu():
  """MATCH's SWA layer on this Hopper GPU, bf16, chunk 128, window 256, top-2 exact-match
  retrieval over 2048 tokens with two packed documents, retrieved K/V from the row and
  recomputed: the block-sparse path (one Mosaic GPU launch per kernel) vs the gathered path
  (compacted kernel), both in bf16, against the gathered path in float32 (the truth): the
  block-sparse path's logits and parameter gradients are no further from it than the bf16
  gathered path's (<= 1.5x its relative Frobenius error + 2e-3), the two bf16 paths' logits agree
  within 2e-2, and the retrieved chunks matter (the SWA model's logits differ by more). (Gradients
  of two bf16 paths can differ by more than 2e-2 from each other: 0.024 on an H100.)"""
  import flax.linen as nn
  from condattn_jax import attention
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, vocab_size=64,
                     hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     head_dim=128, dtype="bfloat16")
  cfg = attention.configure(base, "match", window=256, chunk=128, top_k=2)
  B, T = 2, 2048
  tok = jax.random.randint(jax.random.PRNGKey(1), (B, T), 1, 12)
  seg = np.ones((B, T), np.int32)
  seg[1, 1200:] = 2
  pos = np.stack([np.arange(T), np.r_[np.arange(1200), np.arange(T - 1200)]]).astype(np.int32)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0), tok[:, :8]))["params"]
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) /
                           jnp.linalg.norm(b.astype(jnp.float32)))

  def run(c):
    def loss(p):
      out, aux = Decoder(c).apply({"params": p}, tok, pos, seg)
      return jnp.mean(out.astype(jnp.float32) ** 2), (out, aux["retrieved"])
    (_, (out, frac)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, frac, g

  with_ = lambda **kw: cfg.replace(scheme_kwargs=dict(cfg.scheme_options, **kw))
  swa = jax.jit(lambda p: Decoder(with_(top_k=0)).apply({"params": p}, tok, pos, seg)[0])(params)
  gerr = lambda g, h: max(rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(h)))
  for kv in ("sequence", "recompute"):  # retrieved K/V: the row's, or recomputed and appended
    want, frac, g_want = run(with_(attention_path="gathered", retrieved_kv=kv))
    got, _, g_got = run(with_(attention_path="block_sparse", retrieved_kv=kv))
    truth, _, g_truth = run(with_(attention_path="gathered", retrieved_kv=kv).replace(
        dtype="float32"))
    assert float(jnp.min(frac)) > 0.2
    err = rel(got, want)
    e_got, e_want = rel(got, truth), rel(want, truth)
    ge_got, ge_want = gerr(g_got, g_truth), gerr(g_want, g_truth)
    print(kv, "logits rel to f32: block_sparse", e_got, "gathered", e_want, "| grads rel to f32:",
          ge_got, ge_want, "| bf16 paths", err, gerr(g_got, g_want), "| swa", rel(swa, want))
    assert e_got <= 1.5 * e_want + 2e-3 and ge_got <= 1.5 * ge_want + 2e-3
    assert err <= 2e-2
    assert rel(swa, want) > 5 * err
