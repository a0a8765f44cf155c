"""GPU glue of compacted-query attention: row gathers bounded by the active count, and putting
results back in one pass, as Pallas Triton kernels (other GPUs) or Pallas Mosaic GPU kernels
(Hopper: the Mosaic GPU attention kernels' glue, so that no Triton call is left there).

With these the GPU path needs no bucket ladder: the compacted buffers have the full T rows, and
every kernel, these included, sizes its work by the actual active count at run time. There is no
lax.switch, whose predicate XLA reads on the host (a device -> host copy and a stall before the
branch's kernels launch; measured with `bench/compact_attention.py --profile`), and the traffic of
gathers and of putting results back is proportional to the count, not to a bucket.

All three work on rows: x [B, rows_in, F] (F contiguous values per row) and an int32 source row
per output row, src [B, rows_out]:

  copy_rows        out[b, r] = x[b, src[b, r]] (zeros where src < 0), for the rows r < nrows[b]
                   (rounded up to the program's R rows); rows past that are NOT written.
  copy_rows_delta  the same copy of dO rows, and delta[b, h, r] = sum over head h's H values of
                   dO * O (float32; O gathered by the same src), the backward's row term.

Each takes kernel='triton' (Pallas Triton: gathered loads, 16 rows per program) or
kernel='mosaic_gpu' (Pallas Mosaic GPU, one warpgroup per program: one bulk async copy
(cp.async.bulk) per row into shared memory, the program's rows back to global memory in one bulk
copy; delta from the shared-memory rows in registers). Both are bounded by nrows per program;
`mgpu_supported` says which row widths the Mosaic GPU kernels take.

The compaction-level wrappers (gather_rows, uncompact_rows, gather_rows_delta) build src from the
compaction's idx / slot arrays for one active set per row (I = 1: a row is the N * H values of a
token) or per (row, head) (I = N: a row is one head's H values).
"""
from __future__ import annotations

import functools
import warnings

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

_MAX_ROWS = 16      # rows per program
_MAX_CHUNK = 1024   # values per row moved by one load / store


def _pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two dividing n, at most cap."""
  return min(n & -n, cap)


def _pow2_floor(n: int) -> int:
  """Largest power of two <= n (n >= 1)."""
  return 1 << (n.bit_length() - 1)


def supported(H: int) -> bool:
  """Heads of H values can be moved as Triton tensors (a power of two, 16 .. 1024)."""
  return H & (H - 1) == 0 and 16 <= H <= _MAX_CHUNK


KERNELS = ("triton", "mosaic_gpu")
_MGPU_SMEM_BYTES = 32 * 1024         # shared memory per Mosaic GPU copy program (one buffer)
_MGPU_BOX = 256                      # TMA: at most 256 elements per box dimension
_MGPU_DELTA_SUBROWS = 128            # copy_rows_delta: about this many H-value sub-rows per program


def mgpu_supported(F: int, itemsize: int, H: int | None = None, rows_out: int = 64) -> bool:
  """Rows of F values (itemsize bytes each) can be moved by the Mosaic GPU copies: each row lands
  at a 128-byte aligned shared-memory address (TMA's alignment) as at most 256 sub-rows of at
  most 256 values; with H (copy_rows_delta, rows_out output rows): heads of H in {64, 128}
  whose sub-rows a program can hold (_mgpu_delta_rows)."""
  if F * itemsize % 128 or F // _pow2_divisor(F, _MGPU_BOX) > _MGPU_BOX:
    return False
  if H is None:
    return True
  if F % H or H not in (64, 128):
    return False
  return _mgpu_delta_rows(F // H, rows_out) is not None


def _mgpu_copy_rows(F: int, itemsize: int, rows_out: int) -> int:
  """Rows per copy_rows program: a power of two dividing rows_out, at most 64, whose rows fit
  the program's buffer (_MGPU_SMEM_BYTES; at least one row)."""
  fit = max(1, _MGPU_SMEM_BYTES // (F * itemsize))
  return _pow2_divisor(rows_out, _pow2_floor(min(64, fit)))


def _mgpu_delta_rows(heads: int, rows_out: int) -> int | None:
  """Rows per copy_rows_delta program, or None: a power of two dividing rows_out whose
  R * heads sub-rows are about _MGPU_DELTA_SUBROWS, a multiple of 4 (the float32 row sums go
  out as whole 16-byte units) and at most 256 (one TMA box)."""
  R = _pow2_divisor(rows_out, _pow2_floor(max(1, _MGPU_DELTA_SUBROWS // heads)))
  while (R * heads) % 4 and rows_out % (2 * R) == 0:
    R *= 2
  return R if (R * heads) % 4 == 0 and R * heads <= _MGPU_BOX else None


def _check_kernel(kernel):
  if kernel not in KERNELS:
    raise ValueError(f"glue kernel {kernel!r}: choose one of {KERNELS}")


def _copy_kernel(nrows_ref, src_ref, x_ref, out_ref, *, R, F, chunk):
  i = pl.program_id(1)

  @pl.when(i * R < nrows_ref[...])
  def _():
    src = src_ref[...]
    ok = (src >= 0)[:, None]
    rows = jnp.maximum(src, 0)
    for c in range(F // chunk):
      v = x_ref[rows, pl.ds(c * chunk, chunk)]
      out_ref[:, pl.ds(c * chunk, chunk)] = jnp.where(ok, v, jnp.zeros((), v.dtype))


def _copy_delta_kernel(nrows_ref, src_ref, x_ref, y_ref, out_ref, delta_ref, *, R, heads, H):
  i = pl.program_id(1)

  @pl.when(i * R < nrows_ref[...])
  def _():
    rows = jnp.maximum(src_ref[...], 0)
    for h in range(heads):
      x = x_ref[rows, pl.ds(h * H, H)]
      y = y_ref[rows, pl.ds(h * H, H)]
      out_ref[:, pl.ds(h * H, H)] = x
      delta_ref[h, :] = jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32), axis=1)


def _launch(rows_out, chunk):
  """(rows per program, warps): up to 16 rows, about 1024 values per warp and load."""
  R = _pow2_divisor(rows_out, _MAX_ROWS)
  warps = max(1, min(8, R * chunk // 1024))
  return R, warps


def copy_rows(x_BRF, src_BR, nrows_B, *, interpret=False, kernel="triton"):
  """out [B, rows_out, F]: out[b, r] = x[b, src[b, r]] (0 where src < 0) for r < nrows[b]
  (rounded up to whole programs); the other rows are left unwritten."""
  _check_kernel(kernel)
  if kernel == "mosaic_gpu":
    return _copy_rows_mgpu(x_BRF, src_BR, nrows_B, interpret=interpret)
  B, rows_in, F = x_BRF.shape
  rows_out = src_BR.shape[1]
  chunk = _pow2_divisor(F, _MAX_CHUNK)
  R, warps = _launch(rows_out, chunk)
  kernel = functools.partial(_copy_kernel, R=R, F=F, chunk=chunk)
  return pl.pallas_call(
      kernel, grid=(B, rows_out // R),
      in_specs=[pl.BlockSpec((None, None), lambda b, i: (b, 0)),
                pl.BlockSpec((None, R), lambda b, i: (b, i)),
                pl.BlockSpec((None, rows_in, F), lambda b, i: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, R, F), lambda b, i: (b, i, 0)),
      out_shape=jax.ShapeDtypeStruct((B, rows_out, F), x_BRF.dtype),
      interpret=interpret, name="compact_attention_copy_rows",
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
  )(nrows_B.reshape(B, 1).astype(jnp.int32), src_BR.astype(jnp.int32), x_BRF)


def copy_rows_delta(x_BRF, y_BRF, src_BR, nrows_B, H: int, *, interpret=False,
                    kernel="triton"):
  """(out [B, rows_out, F] as copy_rows of x (src >= 0), delta [B, F // H, rows_out] float32:
  the sum of x * y over each of the F // H groups of H values of a row)."""
  _check_kernel(kernel)
  if kernel == "mosaic_gpu":
    return _copy_rows_delta_mgpu(x_BRF, y_BRF, src_BR, nrows_B, H, interpret=interpret)
  B, rows_in, F = x_BRF.shape
  rows_out = src_BR.shape[1]
  heads = F // H
  R, warps = _launch(rows_out, H)
  kernel = functools.partial(_copy_delta_kernel, R=R, heads=heads, H=H)
  full = pl.BlockSpec((None, rows_in, F), lambda b, i: (b, 0, 0))
  return pl.pallas_call(
      kernel, grid=(B, rows_out // R),
      in_specs=[pl.BlockSpec((None, None), lambda b, i: (b, 0)),
                pl.BlockSpec((None, R), lambda b, i: (b, i)), full, full],
      out_specs=[pl.BlockSpec((None, R, F), lambda b, i: (b, i, 0)),
                 pl.BlockSpec((None, heads, R), lambda b, i: (b, 0, i))],
      out_shape=[jax.ShapeDtypeStruct((B, rows_out, F), x_BRF.dtype),
                 jax.ShapeDtypeStruct((B, heads, rows_out), jnp.float32)],
      interpret=interpret, name="compact_attention_copy_rows_delta",
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
  )(nrows_B.reshape(B, 1).astype(jnp.int32), src_BR.astype(jnp.int32), x_BRF, y_BRF)


# ----------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper)
# ----------------------------------------------------------------------------------------------

def _mgpu_interpret(interpret):
  from pallas_kernels.flash_tiles import mgpu_interpret
  return mgpu_interpret(interpret)


def _copy_rows_mgpu(x_BRF, src_BR, nrows_B, *, interpret=False):
  """copy_rows on Hopper: grid (B, rows_out // R), one warpgroup per program; each of its R rows
  is one async (TMA) copy of F values (a zero row's from a zeros operand) into shared memory, all
  arriving on one barrier; then the R rows go out in one copy. A row is moved as m sub-rows of
  F / m <= 256 values (a TMA box has at most 256 elements per dimension)."""
  B, rows_in, F = x_BRF.shape
  rows_out = src_BR.shape[1]
  dtype = x_BRF.dtype
  if not mgpu_supported(F, dtype.itemsize):
    raise ValueError(f"copy_rows (mosaic_gpu): rows of {F} values of {dtype.itemsize} bytes "
                     "(needs multiples of 128 bytes, at most 65536 values); use kernel='triton' "
                     "or the XLA glue")
  m = F // _pow2_divisor(F, _MGPU_BOX)
  R = _mgpu_copy_rows(F, dtype.itemsize, rows_out)

  def body(nrows_ref, src_ref, x_ref, zero_ref, out_ref, rows_smem, bar):
    b = lax.axis_index("b")
    i = lax.axis_index("i")

    @pl.when(i * R < nrows_ref[b])
    def _():
      @pl.loop(0, R)
      def _row(r):
        s = src_ref[b, i * R + r]
        dst = rows_smem.at[pl.ds(r * m, m)]
        pl.when(s >= 0)(lambda: plmgpu.copy_gmem_to_smem(
            x_ref.at[b, pl.ds(jnp.maximum(s, 0) * m, m)], dst, bar))
        pl.when(s < 0)(lambda: plmgpu.copy_gmem_to_smem(zero_ref, dst, bar))

      plmgpu.barrier_wait(bar)
      plmgpu.copy_smem_to_gmem(rows_smem, out_ref.at[b, pl.ds(i * R * m, R * m)])
      plmgpu.wait_smem_to_gmem(0)

  out = plmgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, rows_out * m, F // m), dtype),
      grid=(B, rows_out // R), grid_names=("b", "i"),
      scratch_types=[plmgpu.SMEM((R * m, F // m), dtype), plmgpu.Barrier(num_arrivals=R)],
      interpret=_mgpu_interpret(interpret), kernel_name="compact_attention_copy_rows_mgpu",
  )(nrows_B.astype(jnp.int32), src_BR.astype(jnp.int32), x_BRF.reshape(B, rows_in * m, F // m),
    jnp.zeros((m, F // m), dtype))
  return out.reshape(B, rows_out, F)


def _copy_rows_delta_mgpu(x_BRF, y_BRF, src_BR, nrows_B, H, *, interpret=False):
  """copy_rows_delta on Hopper: R rows per program (_mgpu_delta_rows), x and y rows in by async
  (TMA) copies (a row of F values = heads sub-rows of H values), x's rows out in one copy, the
  M = R * heads sub-rows' dot products summed in registers (float32, WGMMA layout over a buffer of
  M rounded up to 64 sub-rows; the rows past M are never written out) and written out in one
  copy."""
  B, rows_in, F = x_BRF.shape
  rows_out = src_BR.shape[1]
  dtype = x_BRF.dtype
  if not mgpu_supported(F, dtype.itemsize, H, rows_out):
    raise ValueError(f"copy_rows_delta (mosaic_gpu): {rows_out} rows of {F} values in heads of "
                     f"{H} (needs head_dim 64 or 128, see glue.mgpu_supported); use "
                     "gather_rows_delta (it falls back to XLA's delta) or kernel='triton'")
  heads = F // H
  R = _mgpu_delta_rows(heads, rows_out)
  M = R * heads
  M_pad = -(-M // 64) * 64

  def body(nrows_ref, src_ref, x_ref, y_ref, out_ref, delta_ref, x_smem, y_smem, d_smem, bar):
    b = lax.axis_index("b")
    i = lax.axis_index("i")

    @pl.when(i * R < nrows_ref[b])
    def _():
      @pl.loop(0, R)
      def _row(r):
        s = jnp.maximum(src_ref[b, i * R + r], 0)
        rows = pl.ds(s * heads, heads)
        plmgpu.copy_gmem_to_smem(x_ref.at[b, rows], x_smem.at[pl.ds(r * heads, heads)], bar)
        plmgpu.copy_gmem_to_smem(y_ref.at[b, rows], y_smem.at[pl.ds(r * heads, heads)], bar)

      plmgpu.barrier_wait(bar)
      plmgpu.copy_smem_to_gmem(x_smem.at[pl.ds(0, M)], out_ref.at[b, pl.ds(i * M, M)],
                               commit_group=False)
      xv = plmgpu.load(x_smem, layout=plmgpu.Layout.WGMMA, optimized=False)
      yv = plmgpu.load(y_smem, layout=plmgpu.Layout.WGMMA, optimized=False)
      d_smem[...] = jnp.sum(xv.astype(jnp.float32) * yv.astype(jnp.float32), axis=1)
      plmgpu.commit_smem()
      plmgpu.copy_smem_to_gmem(d_smem.at[pl.ds(0, M)], delta_ref.at[b, pl.ds(i * M, M)],
                               commit_group=False)
      plmgpu.commit_smem_to_gmem_group()
      plmgpu.wait_smem_to_gmem(0)

  sub = lambda a: a.reshape(B, a.shape[1] * heads, H)   # a row = heads sub-rows of H values
  out, delta = plmgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((B, rows_out * heads, H), dtype),
                      jax.ShapeDtypeStruct((B, rows_out * heads), jnp.float32)),
      grid=(B, rows_out // R), grid_names=("b", "i"),
      scratch_types=[plmgpu.SMEM((M_pad, H), dtype), plmgpu.SMEM((M_pad, H), dtype),
                     plmgpu.SMEM((M_pad,), jnp.float32), plmgpu.Barrier(num_arrivals=2 * R)],
      interpret=_mgpu_interpret(interpret),
      kernel_name="compact_attention_copy_rows_delta_mgpu",
  )(nrows_B.astype(jnp.int32), src_BR.astype(jnp.int32), sub(x_BRF), sub(y_BRF))
  return (out.reshape(B, rows_out, F),
          jnp.swapaxes(delta.reshape(B, rows_out, heads), 1, 2))


# ----------------------------------------------------------------------------------------------
# compaction-level wrappers
# ----------------------------------------------------------------------------------------------

def _bound(counts_BI, multiple: int):
  """Rows of the compacted buffer the kernels read: the largest count of the row, rounded up to
  the largest query tile."""
  c = jnp.max(counts_BI, axis=1)
  return (c + multiple - 1) // multiple * multiple


def _gather_src(idx_BIC, T: int, N: int):
  """(src [B, rows_out], rows per slot) of a gather: padding slots (idx == T) read row T - 1."""
  B, I, C = idx_BIC.shape
  idx = jnp.minimum(idx_BIC, T - 1)
  if I == 1:
    return idx[:, 0, :], 1
  n = jnp.arange(N, dtype=jnp.int32)
  return (jnp.swapaxes(idx, 1, 2) * N + n).reshape(B, C * N), N


def _rows(x, I):
  """[B, T, N, ...] -> [B, rows, F]: a row per token (I = 1) or per (token, head) (I > 1)."""
  B, T = x.shape[:2]
  return x.reshape(B, T, -1) if I == 1 else x.reshape(B, T * x.shape[2], -1)


def gather_rows(x_BTN_, idx_BIC, counts_BI, multiple: int, *, interpret=False, kernel="triton"):
  """compaction.gather_rows for the rows the kernels read: x [B, T, N, ...] -> [B, C, N, ...];
  slots past the largest count of the row, rounded up to `multiple`, are left unwritten."""
  B, T, N = x_BTN_.shape[:3]
  C = idx_BIC.shape[-1]
  src, per = _gather_src(idx_BIC, T, N)
  out = copy_rows(_rows(x_BTN_, idx_BIC.shape[1]), src, _bound(counts_BI, multiple) * per,
                  interpret=interpret, kernel=kernel)
  return out.reshape((B, C) + x_BTN_.shape[2:])


def gather_rows_delta(do_BTNH, o_BTNH, idx_BIC, counts_BI, multiple: int, *, interpret=False,
                      kernel="triton"):
  """(do_c [B, C, N, H], delta [B, N, C] float32 = sum_H o_c * do_c) on the rows the kernels read
  (as gather_rows; the other slots are left unwritten)."""
  B, T, N, H = do_BTNH.shape
  I, C = idx_BIC.shape[1], idx_BIC.shape[-1]
  src, per = _gather_src(idx_BIC, T, N)
  nrows = _bound(counts_BI, multiple) * per
  rows_do = _rows(do_BTNH, I)
  if kernel == "mosaic_gpu" and not mgpu_supported(rows_do.shape[-1], do_BTNH.dtype.itemsize, H,
                                                   src.shape[1]):
    # a head count the delta kernel cannot take: dO by the row copy, delta by XLA over all T
    # rows (then gathered: [B, N, C] float32)
    do_c = copy_rows(rows_do, src, nrows, interpret=interpret, kernel=kernel)
    delta_BTN = jnp.sum(do_BTNH.astype(jnp.float32) * o_BTNH.astype(jnp.float32), axis=-1)
    t = jnp.minimum(idx_BIC, T - 1)                                   # [B, I, C]
    delta = jnp.take_along_axis(jnp.swapaxes(delta_BTN, 1, 2), jnp.broadcast_to(
        t, (B, N, C)), axis=2)
    return do_c.reshape(B, C, N, H), delta
  do_c, delta = copy_rows_delta(rows_do, _rows(o_BTNH, I), src, nrows, H, interpret=interpret,
                                kernel=kernel)
  if I > 1:  # [B, 1, C * N] -> [B, N, C]
    delta = jnp.swapaxes(delta.reshape(B, C, N), 1, 2)
  return do_c.reshape(B, C, N, H), delta


def uncompact_rows(x_c_BCN_, slot_BIT, *, interpret=False, kernel="triton"):
  """compaction.uncompact_rows in one pass: out[b, t, n] = x_c[b, slot[b, n or 0, t], n], zeros
  where slot < 0; every output row is written once, nothing is zero-filled first."""
  B, C, N = x_c_BCN_.shape[:3]
  I, T = slot_BIT.shape[1], slot_BIT.shape[2]
  if I == 1:
    src = slot_BIT[:, 0, :]
  else:
    n = jnp.arange(N, dtype=jnp.int32)
    s = jnp.swapaxes(slot_BIT, 1, 2)  # [B, T, N]
    src = jnp.where(s >= 0, s * N + n, -1).reshape(B, T * N)
  out = copy_rows(_rows(x_c_BCN_, I), src, jnp.full((B,), src.shape[1], jnp.int32),
                  interpret=interpret, kernel=kernel)
  return out.reshape((B, T) + x_c_BCN_.shape[2:])
