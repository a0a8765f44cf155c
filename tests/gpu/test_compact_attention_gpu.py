"""GPU smoke test: the Triton and (on Hopper) Mosaic GPU compacted-query attention kernels vs the
jnp reference on the GPU.

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
    # (name, dtype, make_problem kwargs, compact_attention kwargs); each compiles 2 buckets.
    ("l2a_s05", "bfloat16", dict(T=1024, N=8, K=2, H=128, sparsity=0.5),
     dict(bucket_fracs=(0.6,))),
    ("aha_packed_window_f32", "float32",
     dict(T=1024, N=8, K=2, H=128, sparsity=0.6, per_head=True, segments=3, window=200,
          packed_positions=True), dict(bucket_fracs=(0.5,))),
    ("s095_empty_row_prefix_small_tiles", "bfloat16",
     dict(B=2, T=1024, N=4, K=1, H=128, sparsity=0.95, empty_rows=(1,), q_offset=512),
     dict(bucket_fracs=(0.1,), block_sizes=BlockSizes(
         block_q=64, block_k=32, block_q_dq=64, block_k_dq=32, block_q_dkv=32, block_k_dkv=64,
         num_warps=4, num_stages=2, num_warps_dq=4, num_stages_dq=2))),
]


def _hopper():
  return jax.devices()[0].device_kind.startswith(("NVIDIA H100", "NVIDIA H200", "NVIDIA H800"))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu", "auto"])
@pytest.mark.parametrize("name,dtype,pkw,kw", CASES, ids=[c[0] for c in CASES])
def test_kernels_vs_reference_gpu(impl, name, dtype, pkw, kw):
  """Forward, lse and dq/dk/dv vs the float32 jnp reference; Triton outputs poisoned with NaN
  first, inactive rows must be exactly zero. (Mosaic GPU: bf16 / f16, its own default tiles.)"""
  if impl != "triton" and not _hopper():
    pytest.skip("Mosaic GPU kernels need Hopper")
  if impl == "mosaic_gpu" and dtype == "float32":
    pytest.skip("Mosaic GPU kernels take bf16 / f16")
  if impl != "triton":
    kw = {k: x for k, x in kw.items() if k != "block_sizes"}
  p = make_problem(len(name), dtype=jnp.dtype(dtype), **pkw)
  if impl == "auto":  # the kernel condattn_jax.ops' resolver picks for this GPU
    from condattn_jax import ops
    from pallas_kernels.backends import Platform
    backend, why = ops.resolve("compact", "auto", p.q.shape, p.k.shape, p.q.dtype,
                               Platform("cuda", jax.devices()[0].device_kind))
    assert backend is not None, why
    impl = backend.name
  errs, bad = compare(p, dict(impl=impl, **kw))
  print(impl, name, dtype, errs)
  assert not bad, (impl, name, dtype, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["aha_packed_window", "s095_empty_row_prefix"])
def test_mosaic_gpu_named_barriers_give_the_same_bits(name):
  """The Mosaic GPU forward with its hand-offs on hardware named barriers (the default on the
  GPU; interpret mode cannot run them) and on mbarriers: the same arithmetic in the same order,
  so bit-identical outputs and lse, also with skipped steps (per-head sets, packed documents, a
  window, an empty row, a prefix) and no hang."""
  if not _hopper():
    pytest.skip("Mosaic GPU kernels need Hopper")
  from pallas_kernels.compact_attention import CompactConfig, compact_attention
  pkw = dict(CASES[1][2], dtype=jnp.bfloat16) if name == "aha_packed_window" else dict(
      CASES[2][2], dtype=jnp.bfloat16)
  p = make_problem(5, **pkw)
  outs = []
  for named in (True, False):
    outs.append(compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_gpu", return_lse=True,
                                  config=CompactConfig(mgpu_named_barriers=named), **p.kw))
  (o1, l1), (o0, l0) = outs
  assert bool(jnp.array_equal(o1, o0)) and bool(jnp.array_equal(l1, l0))
  assert not bool(jnp.isnan(o1).any())
