"""pallas_kernels.block_sparse Mosaic TPU kernels on CPU: interpret mode vs the reference (forward,
lse, dq/dk/dv; mixed modes, GQA, documents, window + sinks, per-head active sets), and lowering to
Mosaic for TPU with jax.export (bad block shapes rejected)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.block_sparse import HEAD_BLOCKS, HEAD_FULL, api, block_sparse_attention
from pallas_kernels.block_sparse.testing import compare, make_problem, ssa_lists

MOSAIC = dict(impl="mosaic_tpu", interpret=pltpu.InterpretParams())


def test_mosaic_matches_reference_gqa_random_lists():
  """GQA 2:1 over 2 kv heads, bfloat16, random lists with -1 padding, duplicates and future blocks
  (dropped), one HEAD_FULL head beside three HEAD_BLOCKS heads. (This was the second of the
  hypothesis test's 2 derandomized draws, same seed and parameters; its first draw, float32 with
  one kv head and two HEAD_BLOCKS heads on the same kind of random lists, ran no path that this
  case and test_mosaic_ssa_heads_next_to_full_heads_and_empty_rows (float32, 2:1 GQA) do not.)"""
  p = make_problem(512, T=384, N=4, K=2, H=128, dtype=jnp.bfloat16, block_q=128, block_k=128,
                   L=2)
  errs, bad = compare(p, MOSAIC)
  assert not bad, errs


def test_mosaic_ssa_heads_next_to_full_heads_and_empty_rows():
  B, T, N, K = 1, 512, 2, 1
  p = make_problem(2, B=B, T=T, N=N, K=K, H=128, block_q=128, block_k=128, window=200, sinks=4)
  lists = ssa_lists(B, N, T, T, block_q=128, block_k=128, sink_blocks=1, local_blocks=2).copy()
  lists[0, 1, 0] = -1                                    # head 1, query block 0: sees nothing
  p.kw.update(kv_blocks_BNQL=jnp.asarray(lists),
              head_mode_BN=jnp.asarray([[HEAD_FULL, HEAD_BLOCKS]], jnp.int32))
  errs, bad, (o, lse, _) = compare(p, MOSAIC, outputs=True)
  assert not bad, errs
  assert np.all(np.asarray(o)[0, :128, 1] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :128, 1]))


def test_mosaic_lowers_for_tpu_and_rejects_bad_blocks(monkeypatch):
  """jax.export lowers forward, dq and dk/dv to Mosaic at a realistic shape (Qwen-like GQA, SSA
  lists, half the heads full); block sizes Mosaic cannot take are a ValueError."""
  monkeypatch.setattr(api, "_platform", lambda: "tpu")
  B, T, N, K, H, blk = 1, 8192, 8, 2, 128, 128
  lists = jnp.asarray(ssa_lists(B, N, T, T, block_q=blk, block_k=blk, sink_blocks=1,
                                local_blocks=16))
  mode = jnp.asarray([[HEAD_FULL, HEAD_BLOCKS] * (N // 2)], jnp.int32)
  sds = [jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)]

  def fwd_bwd(q, k, v):
    f = lambda q, k, v: block_sparse_attention(q, k, v, lists, mode, block_q=blk, block_k=blk,
                                               window=2048, sinks=128, impl="mosaic_tpu")
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(out)

  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(*sds).mlir_module()
  assert text.count("tpu_custom_call") == 3  # fwd, dq, dkv: one launch each for all heads
  lists64 = jnp.zeros((B, N, T // 64, 1), jnp.int32)
  with pytest.raises(ValueError, match="multiples of 128"):
    jax.export.export(jax.jit(lambda q, k, v: block_sparse_attention(
        q, k, v, lists64, block_q=64, block_k=128, impl="mosaic_tpu")), platforms=["tpu"])(*sds)
  with pytest.raises(ValueError, match="head_dim 96"):
    x = jax.ShapeDtypeStruct((B, 256, 2, 96), jnp.bfloat16)
    jax.export.export(jax.jit(lambda q: block_sparse_attention(
        q, q, q, jnp.zeros((B, 2, 2, 1), jnp.int32), impl="mosaic_tpu")), platforms=["tpu"])(x)
