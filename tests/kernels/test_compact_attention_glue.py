"""pallas_kernels/compact_attention/glue.py: the GPU glue kernels (Pallas Triton and, for Hopper,
Pallas Mosaic GPU, run here in interpret mode) against the XLA compaction they replace, the count
bound they run under, and the GPU path's single bucket (no lax.switch); the Mosaic GPU copies
lowered for cuda."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compact_attention import CompactConfig, compact_attention, glue
from pallas_kernels.compact_attention import compaction as cp
from pallas_kernels.compact_attention.testing import make_problem

B, T, N, H = 2, 200, 3, 16


@functools.partial(jax.jit, static_argnames=("per_head", "T", "N", "H", "dtype"))
def _draw(seed, *, per_head, T, N, H, dtype):
  """(x, y [B, T, N, H], slot, idx, counts): row 0 ~30% active, row 1 empty (count 0), the
  compaction's arrays in a bucket of T rounded up to 16; one program per shape (eagerly, each
  random draw and compaction op is compiled alone), the seed an argument."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  x, y = (jax.random.normal(k, (B, T, N, H), dtype) for k in keys[:2])
  shape = (B, T, N) if per_head else (B, T)
  active = (jax.random.uniform(keys[2], shape) < 0.3).at[1].set(False)
  a_BIT, _ = cp.active_to_RT(active)
  slot = cp.compact_slots(a_BIT)
  return x, y, slot, cp.compact_indices(a_BIT, cp.round_up(T, 16), slot), cp.active_counts(a_BIT)


def _setup(per_head, seed=0):
  """_draw's arrays (float32, T = 200: a bucket C of 208) and C."""
  return *_draw(seed, per_head=per_head, T=T, N=N, H=H, dtype=jnp.float32), cp.round_up(T, 16)


def _bound(counts, b, multiple):
  return int(-(-int(counts[b].max()) // multiple) * multiple)


@pytest.mark.parametrize("per_head", [False, True], ids=["l2a", "aha"])
def test_gather_rows_is_the_xla_gather_on_the_rows_kernels_read(per_head):
  """Slots below the row's largest count rounded up to the tile equal compaction.gather_rows
  (padding slots read row T - 1); the rest are never written (NaN in interpret mode), so the
  work follows the active count, not the bucket; an empty row writes nothing."""
  x, _, _, idx, counts, C = _setup(per_head)
  got, want = jax.device_get(jax.jit(lambda x, idx, counts: (  # one program (eagerly: op by op)
      glue.gather_rows(x, idx, counts, 32, interpret=True), cp.gather_rows(x, idx)))(
          x, idx, counts))
  assert got.shape == want.shape == (B, C, N, H)
  n0 = _bound(counts, 0, 32)
  assert 0 < n0 < C
  np.testing.assert_array_equal(got[0, :n0], want[0, :n0])
  assert np.isnan(got[0, n0:]).all() and np.isnan(got[1]).all()


@pytest.mark.parametrize("per_head", [False, True], ids=["l2a", "aha"])
def test_uncompact_rows_equals_the_scatter_into_zeros(per_head):
  """One pass (no zero fill first): exactly compaction.scatter_rows, zeros for inactive rows,
  unwritten compacted slots (NaN) never read."""
  x, _, slot, idx, counts, C = _setup(per_head)

  @jax.jit  # one program (eagerly: op by op)
  def got_want(x, slot, idx, counts):
    x_c = cp.gather_rows(x, idx)
    valid = jnp.arange(C)[None, None, :, None] < counts[:, :, None, None]  # [B, I, C, 1]
    valid = jnp.swapaxes(valid[..., 0], 1, 2)[..., None]                    # [B, C, I, 1]
    x_c = jnp.where(valid, x_c, jnp.nan)
    return glue.uncompact_rows(x_c, slot, interpret=True), cp.scatter_rows(x_c, idx, T)
  got, want = jax.device_get(got_want(x, slot, idx, counts))
  np.testing.assert_array_equal(got, want)
  assert not np.isnan(got).any() and (got[1] == 0).all()


@pytest.mark.parametrize("per_head", [False, True], ids=["l2a", "aha"])
def test_gather_rows_delta_is_do_gathered_and_the_rowwise_dot(per_head):
  """do_c as gather_rows, delta [B, N, C] = sum over H of o_c * do_c in float32, on the rows the
  kernels read."""
  do, o, _, idx, counts, _ = _setup(per_head, seed=1)

  @jax.jit  # one program (eagerly: op by op)
  def got_want(do, o, idx, counts):
    do, o = do.astype(jnp.bfloat16), o.astype(jnp.bfloat16)
    do_c, delta = glue.gather_rows_delta(do, o, idx, counts, 32, interpret=True)
    want = jnp.swapaxes(jnp.sum(cp.gather_rows(do, idx).astype(jnp.float32)
                                * cp.gather_rows(o, idx).astype(jnp.float32), -1), 1, 2)
    return do_c, delta, cp.gather_rows(do, idx), want
  do_c, delta, want_do, want = got_want(do, o, idx, counts)
  n0 = _bound(counts, 0, 32)
  assert do_c.dtype == jnp.bfloat16 and delta.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(do_c[0, :n0]), np.asarray(want_do[0, :n0]))
  np.testing.assert_allclose(np.asarray(delta[0, :, :n0]), np.asarray(want[0, :, :n0]),
                             rtol=1e-6, atol=1e-5)


def test_copy_rows_bound_is_whole_programs():
  """copy_rows writes the programs (16 rows) that start below nrows and nothing after them."""
  x = jnp.arange(2 * 8 * 32, dtype=jnp.float32).reshape(2, 8, 32)
  src = jnp.tile(jnp.arange(48)[None] % 8, (2, 1)).at[:, 3].set(-1)
  out = np.asarray(glue.copy_rows(x, src, jnp.array([5, 20]), interpret=True))
  written = ~np.isnan(out).any(-1)
  assert written[0].tolist() == [True] * 16 + [False] * 32
  assert written[1].tolist() == [True] * 32 + [False] * 16
  np.testing.assert_array_equal(out[1, :32], np.where(
      (np.asarray(src[1, :32]) >= 0)[:, None], np.asarray(x[1])[np.asarray(src[1, :32]) % 8], 0))


def test_gpu_path_runs_one_bucket_without_a_switch():
  """The GPU kernels (here Triton in interpret mode) run with one full-T bucket and no lax.switch
  (whose predicate XLA reads on the host); a ladder the caller asks for still switches, and the
  XLA glue (CompactConfig(glue_kernels=False)) keeps the default ladder. The one-bucket and the
  XLA glue's gradients agree (a ladder with the glue kernels is traced only here: it runs against
  the reference in test_compact_attention.py's test_triton_matches_reference, bucket_fracs
  (0.25,)). The XLA glue's default ladder is traced; its gradients run with the full bucket
  alone (1.0,), the bucket the glue kernels run, so both glues fill the same slots (a ladder's
  smaller bucket under the XLA glue runs in test_compact_attention_mgpu.py's
  odd_kv_tiles_window)."""
  p = make_problem(3, T=128, N=2, K=1, H=32, sparsity=0.7)

  def jaxpr_and_grads(run=True, **kw):
    def loss(q, k, v):
      return jnp.sum(compact_attention(q, k, v, p.active, impl="triton", interpret=True,
                                       **kw) ** 2)
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(p.q, p.k, p.v)  # traced once
    return str(traced.jaxpr), run and traced.lower().compile()(p.q, p.k, p.v)
  # the forward and dq kernels are traced once per bucket (each bucket is a branch of the switch)
  n_fwd = lambda text: text.count("compact_attention_fwd")
  text, g = jaxpr_and_grads()
  assert n_fwd(text) == 1 and "compact_attention_copy_rows" in text
  text_ladder, _ = jaxpr_and_grads(run=False, bucket_fracs=(0.25, 1.0))
  assert n_fwd(text_ladder) == 2 and "compact_attention_copy_rows" in text_ladder
  text_xla, _ = jaxpr_and_grads(run=False, config=CompactConfig(glue_kernels=False))
  assert n_fwd(text_xla) == 2 and "compact_attention_copy_rows" not in text_xla
  _, g_xla = jaxpr_and_grads(config=CompactConfig(glue_kernels=False), bucket_fracs=(1.0,))
  for a, c in zip(g, g_xla):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


def test_supported_head_dims():
  assert glue.supported(64) and glue.supported(128) and glue.supported(16)
  assert not glue.supported(48) and not glue.supported(8) and not glue.supported(2048)


# Mosaic GPU row copies (Hopper: the Mosaic GPU kernels' glue, no Triton call), Pallas' GPU
# interpret mode: bf16 heads of 64 (rows of 128 bytes, TMA's shared-memory alignment).
MGPU_T, MGPU_N, MGPU_H = 96, 3, 64


def _setup_mgpu(per_head, seed=0):
  """_draw's arrays (bfloat16, T = 96: a bucket C of 96) and C."""
  return (*_draw(seed, per_head=per_head, T=MGPU_T, N=MGPU_N, H=MGPU_H, dtype=jnp.bfloat16),
          MGPU_T)


@pytest.mark.parametrize("per_head", [False, True], ids=["l2a", "aha"])
def test_mosaic_gpu_row_copies_equal_the_xla_compaction(per_head):
  """kernel='mosaic_gpu': gather_rows == compaction.gather_rows on the rows the kernels read (the
  programs past the count write nothing: NaN in interpret mode; an empty row writes nothing),
  uncompact_rows == the scatter into zeros on every row, gather_rows_delta's dO rows and float32
  delta [B, N, C] == the gathered rows' dot products (3 heads: sub-rows padded to a 64-row
  tile inside the program)."""
  x, y, slot, idx, counts, C = _setup_mgpu(per_head)
  mg = dict(interpret=True, kernel="mosaic_gpu")

  @jax.jit  # one program (eagerly: op by op)
  def got_want(x, y, slot, idx, counts):
    f32 = lambda a: a.astype(jnp.float32)
    x_c, o_c = cp.gather_rows(x, idx), cp.gather_rows(y, idx)
    return dict(
        gathered=f32(glue.gather_rows(x, idx, counts, 32, **mg)), x_c=x_c,
        back=f32(glue.uncompact_rows(x_c, slot, **mg)),
        back_want=f32(cp.scatter_rows(x_c, idx, MGPU_T)),
        do_delta=glue.gather_rows_delta(x, y, idx, counts, 32, **mg),
        delta_want=jnp.swapaxes(jnp.sum(f32(x_c) * f32(o_c), -1), 1, 2))
  r = got_want(x, y, slot, idx, counts)
  got, want = np.asarray(r["gathered"]), np.asarray(r["x_c"].astype(jnp.float32))
  n0 = _bound(counts, 0, 32)
  assert 0 < n0 < C
  np.testing.assert_array_equal(got[0, :n0], want[0, :n0])
  written = ~np.isnan(got).any(axis=(2, 3))
  assert not written[1].any() and not written[0, -16:].any()

  np.testing.assert_array_equal(np.asarray(r["back"]), np.asarray(r["back_want"]))

  (do_c, delta), x_c, want = r["do_delta"], r["x_c"], r["delta_want"]
  assert do_c.dtype == jnp.bfloat16 and delta.shape == (B, MGPU_N, C)
  np.testing.assert_array_equal(np.asarray(do_c[0, :n0]), np.asarray(x_c[0, :n0]))
  np.testing.assert_allclose(np.asarray(delta[0, :, :n0]), np.asarray(want[0, :, :n0]),
                             rtol=1e-6, atol=1e-5)


def test_mosaic_gpu_rows_per_program_divide_the_rows_and_fit():
  """Every Mosaic GPU program size is a power of two dividing the output rows (a grid of
  rows_out // R programs covers every row), its buffer fits the program's shared memory, its
  copies fit a TMA box (<= 256 per dimension), delta's float32 row sums are whole 16 bytes."""
  for F in range(64, 64 * 70, 64):
    for rows_out in (1, 6, 64, 96, 208, 1000, 4096, 28 * 4096):
      R = glue._mgpu_copy_rows(F, 2, rows_out)
      m = F // glue._pow2_divisor(F, glue._MGPU_BOX)
      assert R & (R - 1) == 0 and rows_out % R == 0, (F, rows_out, R)
      assert R == 1 or R * F * 2 <= glue._MGPU_SMEM_BYTES
      assert R * m <= 256 and F // m <= 256
  for heads in range(1, 140):
    for rows_out in (64, 96, 128, 4096):
      R = glue._mgpu_delta_rows(heads, rows_out)
      if R is None:
        assert heads > 64 and heads % 4, heads   # R * heads would pass 256
        continue
      assert rows_out % R == 0 and R & (R - 1) == 0 and (R * heads) % 4 == 0
      assert R * heads <= 256


def test_mosaic_gpu_delta_falls_back_to_xla_where_the_kernel_cannot_take_the_heads(monkeypatch):
  """A head count copy_rows_delta's Mosaic GPU kernel cannot take (glue.mgpu_supported False):
  dO by the Mosaic GPU row copy, delta by XLA; the same values; the kernel itself refuses with a
  one-line reason."""
  x, y, _, idx, counts, _ = _setup_mgpu(False, seed=2)
  monkeypatch.setattr(glue, "_mgpu_delta_rows", lambda heads, rows_out: None)

  @jax.jit  # one program (eagerly: op by op)
  def got_want(x, y, idx, counts):
    do_c, delta = glue.gather_rows_delta(x, y, idx, counts, 32, interpret=True,
                                         kernel="mosaic_gpu")
    x_c, o_c = cp.gather_rows(x, idx), cp.gather_rows(y, idx)
    return do_c, delta, x_c, jnp.swapaxes(
        jnp.sum(x_c.astype(jnp.float32) * o_c.astype(jnp.float32), -1), 1, 2)
  do_c, delta, x_c, want = got_want(x, y, idx, counts)
  n0 = _bound(counts, 0, 32)
  np.testing.assert_array_equal(np.asarray(do_c[0, :n0]), np.asarray(x_c[0, :n0]))
  np.testing.assert_allclose(np.asarray(delta[0, :, :n0]), np.asarray(want[0, :, :n0]),
                             rtol=1e-6, atol=1e-5)
  with pytest.raises(ValueError, match="copy_rows_delta \\(mosaic_gpu\\).*mgpu_supported"):
    rows = lambda a: a.reshape(B, MGPU_T, -1)
    glue.copy_rows_delta(rows(x), rows(y), idx[:, 0], counts[:, 0], MGPU_H, kernel="mosaic_gpu")


def test_mosaic_gpu_row_copies_lower_for_hopper():
  """The Mosaic GPU copies lower (jax.export for cuda: Mosaic GPU custom calls, no Triton call)
  at a Qwen2.5-7B layer's rows (28 heads of 128: a row is 16 TMA sub-rows of 224 values; delta
  4 rows of 28 heads per program) and per-head rows."""
  S = jax.ShapeDtypeStruct
  bf16, i32 = jnp.bfloat16, jnp.int32
  for F, rows in ((28 * 128, 1024), (128, 28 * 1024)):
    x = S((1, rows, F), bf16)
    f = lambda x, y, s, n: (glue.copy_rows(x, s, n, kernel="mosaic_gpu"),
                            glue.copy_rows_delta(x, y, s, n, 128, kernel="mosaic_gpu"))
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(
        x, x, S((1, rows), i32), S((1,), i32)).mlir_module()
    targets = re.findall(r"custom_call @([\w$.]+)", text)
    assert targets == ["mosaic_gpu_v2"] * 2, targets
