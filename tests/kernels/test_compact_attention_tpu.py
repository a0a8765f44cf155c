"""pallas_kernels.compact_attention Mosaic TPU kernels on CPU: interpret mode vs the reference
(forward, lse, dq/dk/dv), and lowering to Mosaic for TPU at realistic block shapes."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.compact_attention import BlockSizes, TPU_BLOCK_SIZES, compact_attention
from pallas_kernels.compact_attention.testing import compare, make_problem

T128 = BlockSizes(block_q=128, block_k=128, block_q_dq=128, block_k_dq=128, block_q_dkv=128,
                  block_k_dkv=128)
MOSAIC = dict(impl="mosaic_tpu", interpret=pltpu.InterpretParams(), block_sizes=T128)


# The named cases. They were the hypothesis test's 2 derandomized draws plus two edge cases; its
# first draw (float32, 2:1 GQA, every query active, ladder (0.5,)) ran the full bucket with a
# fully active row, which `empty_and_full_rows` runs too (row 0 fully active, the same shapes
# and ladder), so only its second draw stays, as `gqa_kv2_per_head_prefix`. Every case's largest
# count (256, 163, 143 of 256) takes the full bucket, so the ladder (0.5,) (a lax.switch over
# interpreted kernels: twice the compile, half the CPU time of a case) stays in
# `empty_and_full_rows` only; the other two run the full bucket alone (1.0,).
@pytest.mark.parametrize("name,kw,fracs", [
    # per-head active sets over 2 kv heads (no head sharing), 128 queries after a 128-key prefix
    ("gqa_kv2_per_head_prefix", dict(seed=2662, T=256, N=2, K=2, sparsity=0.39054722197534,
                                     per_head=True, q_offset=128), (1.0,)),
    ("empty_and_full_rows", dict(B=2, T=256, sparsity=0.0, empty_rows=(1,)), (0.5,)),
    ("aha_head_dim_64", dict(T=256, N=2, K=1, H=64, sparsity=0.5, per_head=True, segments=2,
                             window=60, packed_positions=True), (1.0,)),
])
def test_mosaic_edge_cases(name, kw, fracs):
  kw = dict(kw)
  p = make_problem(kw.pop("seed", 4), **{**dict(N=2, K=1, H=128), **kw})
  errs, bad = compare(p, dict(MOSAIC, bucket_fracs=fracs))
  assert not bad, (name, errs)


def test_mosaic_rejects_bad_blocks():
  p = make_problem(1, T=256, N=2, K=1, H=128)
  with pytest.raises(ValueError, match="multiples of 128"):
    compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_tpu",
                      interpret=pltpu.InterpretParams(), block_sizes=T128.with_(block_q=64))
  p = make_problem(1, T=256, N=2, K=1, H=96)
  with pytest.raises(ValueError, match="head_dim 96"):
    compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_tpu",
                      interpret=pltpu.InterpretParams())


@pytest.mark.parametrize("chip", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("per_head", [False, True])
def test_mosaic_lowers_for_tpu_at_realistic_shapes(chip, per_head):
  """The forward and backward kernels lower to Mosaic for TPU (the lowering jax.export runs;
  Mosaic rejects bad block shapes)."""
  B, T, N, K, H = 1, 8192, 28, 4, 128
  act = (B, T, N) if per_head else (B, T)
  sds = [jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct(act, jnp.bool_),
         jax.ShapeDtypeStruct((B, T), jnp.int32)]

  def fwd_bwd(q, k, v, a, seg):
    f = lambda q, k, v: compact_attention(q, k, v, a, impl="mosaic_tpu", window=4096,
                                          q_segment_ids_BT=seg, kv_segment_ids_BS=seg,
                                          bucket_fracs=(0.25,))
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(out)

  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind=chip, num_cores=1, platform="tpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    # the lowering jax.export runs (without its serialization)
    text = jax.jit(fwd_bwd).trace(*sds).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 6  # 2 buckets x (fwd, dq, dkv)
  assert TPU_BLOCK_SIZES.block_q == 256
