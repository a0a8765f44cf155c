"""GPU smoke test: the Triton compacted-query attention kernels vs the jnp reference on the GPU.

    make gpu-smoke        (= pytest -q tests/gpu; skipped without a GPU)
"""
import jax
import jax.numpy as jnp
import pytest

if jax.default_backend() != "gpu":
  pytest.skip("needs a GPU", allow_module_level=True)

from pallas_kernels.compact_attention import BlockSizes  # noqa: E402
from pallas_kernels.compact_attention.testing import compare, make_problem  # noqa: E402

CASES = [
    # (name, make_problem kwargs, compact_attention kwargs); each case compiles 2 buckets.
    ("l2a_s0", dict(T=1024, N=8, K=2, H=128, sparsity=0.0), dict(bucket_fracs=(0.5,))),
    ("l2a_s05", dict(T=1024, N=8, K=2, H=128, sparsity=0.5), dict(bucket_fracs=(0.6,))),
    ("l2a_s095_empty_row", dict(B=2, T=2048, N=4, K=1, H=128, sparsity=0.95, empty_rows=(1,)),
     dict(bucket_fracs=(0.1,))),
    ("aha_per_head", dict(T=512, N=8, K=2, H=64, sparsity=0.7, per_head=True),
     dict(bucket_fracs=(0.5,))),
    ("packed_window", dict(T=1024, N=4, K=2, H=128, sparsity=0.5, segments=3, window=200,
                           packed_positions=True), dict(bucket_fracs=(0.6,))),
    ("prefix_offset", dict(T=512, N=4, K=4, H=128, sparsity=0.6, q_offset=256),
     dict(bucket_fracs=(0.5,))),
]
DTYPES = {"l2a_s05": ("bfloat16", "float32")}


@pytest.mark.gpu
@pytest.mark.parametrize("name,pkw,kw", CASES, ids=[c[0] for c in CASES])
def test_triton_vs_reference_gpu(name, pkw, kw):
  for dtype in DTYPES.get(name, ("bfloat16",)):
    p = make_problem(len(name), dtype=jnp.dtype(dtype), **pkw)
    errs, bad = compare(p, dict(impl="triton", **kw))
    print(name, dtype, errs)
    assert not bad, (name, dtype, errs)


@pytest.mark.gpu
def test_triton_small_tiles_gpu():
  p = make_problem(7, T=1024, N=8, K=2, H=128, sparsity=0.8, dtype=jnp.bfloat16)
  bs = BlockSizes(block_q=64, block_k=32, block_q_dq=64, block_k_dq=32, block_q_dkv=32,
                  block_k_dkv=64, num_warps=4, num_stages=2)
  errs, bad = compare(p, dict(impl="triton", block_sizes=bs, bucket_fracs=(0.3,)))
  assert not bad, errs
