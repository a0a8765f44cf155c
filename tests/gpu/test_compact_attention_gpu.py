"""GPU smoke test: the Triton and (on Hopper) Mosaic GPU compacted-query attention kernels vs the
jnp reference on the GPU (one reference compile per case), the Mosaic GPU glue copies vs XLA,
and the Hopper program of 'auto' without Triton calls.

    make gpu-smoke        (= pytest -q tests/gpu; skipped without a GPU)
"""
import functools

import jax
import jax.numpy as jnp
import pytest

if jax.default_backend() != "gpu":
  pytest.skip("needs a GPU", allow_module_level=True)

from pallas_kernels.backends import HOPPER_DEVICE_KINDS  # noqa: E402
from pallas_kernels.compact_attention.testing import compare, make_problem, run  # noqa: E402

CASES = [
    # (name, dtype, make_problem kwargs, compact_attention kwargs): the GPU path's one full-T
    # bucket (the glue kernels; CPU interpret mode covers the ladders)
    ("l2a_s05", "bfloat16", dict(T=1024, N=8, K=2, H=128, sparsity=0.5), {}),
    ("aha_packed_window_f32", "float32",
     dict(T=1024, N=8, K=2, H=128, sparsity=0.6, per_head=True, segments=3, window=200,
          packed_positions=True), {}),
    ("s095_empty_row_prefix", "bfloat16",
     dict(B=2, T=1024, N=4, K=1, H=128, sparsity=0.95, empty_rows=(1,), q_offset=512), {}),
]


def _hopper():
  return jax.devices()[0].device_kind.startswith(HOPPER_DEVICE_KINDS)


hopper = pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels need Hopper")


@functools.cache
def _problem(name):
  """(problem, its reference run): one reference compile per case for both kernels."""
  _, dtype, pkw, _ = next(c for c in CASES if c[0] == name)
  p = make_problem(len(name), dtype=jnp.dtype(dtype), **pkw)
  return p, run(p, impl="reference")


# Which kernel runs which case: Mosaic GPU (Hopper's) on the bf16 cases; Triton (the non-Hopper
# path, whose CPU interpret cases cover the rest) on the float32 case.
RUNS = [("mosaic_gpu", "l2a_s05"), ("mosaic_gpu", "s095_empty_row_prefix"),
        ("triton", "aha_packed_window_f32")]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,case", RUNS, ids=[f"{i}-{c}" for i, c in RUNS])
def test_kernels_vs_reference_gpu(impl, case):
  """Forward, lse and dq/dk/dv vs the float32 jnp reference (the glue kernels included: Mosaic GPU
  row copies next to the Mosaic GPU kernels); Triton outputs poisoned with NaN first, inactive
  rows must be exactly zero. (Mosaic GPU: bf16 / f16, its own default tiles.)"""
  name, dtype, pkw, kw = next(c for c in CASES if c[0] == case)
  if impl != "triton" and not _hopper():
    pytest.skip("Mosaic GPU kernels need Hopper")
  p, ref = _problem(name)
  errs, bad = compare(p, dict(impl=impl, **kw), reference=ref)
  print(impl, name, dtype, errs)
  assert not bad, (impl, name, dtype, errs)


@pytest.mark.gpu
@hopper
def test_auto_on_hopper_is_mosaic_gpu_without_triton_calls_gpu():
  """condattn_jax.ops' resolver on this GPU: Hopper -> the Mosaic GPU kernel for bf16 (the run
  above); its forward + backward program lowered here holds Mosaic GPU calls only (attention
  and glue), no Pallas-Triton call."""
  import re
  from condattn_jax import ops
  from pallas_kernels.backends import Platform
  from pallas_kernels.compact_attention import compact_attention
  p, _ = _problem("l2a_s05")
  backend, why = ops.resolve("compact", "auto", p.q.shape, p.k.shape, p.q.dtype,
                             Platform("cuda", jax.devices()[0].device_kind))
  assert backend is not None and backend.name == "mosaic_gpu", why
  loss = lambda q, k, v: jnp.sum(compact_attention(q, k, v, p.active, impl=backend.name,
                                                   **p.kw).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(p.q, p.k, p.v).as_text()
  targets = re.findall(r"custom_call @([\w.$]+)", text)
  assert len([t for t in targets if t.startswith("mosaic_gpu")]) == 8, targets  # 3 + 5 glue
  assert not [t for t in targets if "triton" in t.lower()], targets


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("F,H", [(28 * 128, 128), (64, 64)], ids=["rows_28x128", "head_rows_64"])
def test_mosaic_gpu_glue_copies_equal_xla_gpu(F, H):
  """The Mosaic GPU row copies compiled for this GPU == XLA: copy_rows with zero rows (src < 0),
  rows past the count's programs untouched by the check; copy_rows_delta's rows and float32
  row dot products per head (28 heads: 4 rows of 112 sub-rows per program)."""
  import numpy as np
  from pallas_kernels.compact_attention import glue
  B, rows = 2, 1024
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(ks[0], (B, rows, F), jnp.bfloat16)
  y = jax.random.normal(ks[1], (B, rows, F), jnp.bfloat16)
  src = jax.random.randint(ks[2], (B, rows), -1, rows)
  n = jnp.asarray([rows, 300], jnp.int32)
  out = np.asarray(jax.jit(lambda x, s, n: glue.copy_rows(x, s, n, kernel="mosaic_gpu"))(
      x, src, n).astype(jnp.float32))
  s_np = np.asarray(src)
  want = np.where((s_np >= 0)[..., None], np.take_along_axis(
      np.asarray(x.astype(jnp.float32)), np.maximum(s_np, 0)[..., None], axis=1), 0)
  np.testing.assert_array_equal(out[0], want[0])
  np.testing.assert_array_equal(out[1, :300], want[1, :300])
  src = jnp.maximum(src, 0)
  o, d = jax.jit(lambda x, y, s, n: glue.copy_rows_delta(x, y, s, n, H, kernel="mosaic_gpu"))(
      x, y, src, n)
  gx = jnp.take_along_axis(x, src[..., None], axis=1)
  gy = jnp.take_along_axis(y, src[..., None], axis=1)
  dw = jnp.swapaxes(jnp.sum((gx.astype(jnp.float32) * gy.astype(jnp.float32)).reshape(
      B, rows, F // H, H), -1), 1, 2)
  np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(gx[0]))
  np.testing.assert_array_equal(np.asarray(o[1, :300]), np.asarray(gx[1, :300]))
  np.testing.assert_allclose(np.asarray(d[0]), np.asarray(dw[0]), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(d[1, :, :300]), np.asarray(dw[1, :, :300]), rtol=1e-5,
                             atol=1e-4)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["aha_packed_window", "s095_empty_row_prefix"])
def test_mosaic_gpu_named_barriers_give_the_same_bits(name):
  """The Mosaic GPU forward with its hand-offs on hardware named barriers (the default on the
  GPU; interpret mode cannot run them) and on mbarriers: the same arithmetic in the same order,
  so bit-identical outputs and lse, also with skipped steps (per-head sets, packed documents, a
  window, an empty row, a prefix) and no hang."""
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
