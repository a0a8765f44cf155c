"""GPU glue of compacted-query attention (Pallas Triton): row gathers bounded by the active count,
and putting results back in one pass.

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

The compaction-level wrappers (gather_rows, uncompact_rows, gather_rows_delta) build src from the
compaction's idx / slot arrays for one active set per row (I = 1: a row is the N * H values of a
token) or per (row, head) (I = N: a row is one head's H values).
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

_MAX_ROWS = 16      # rows per program
_MAX_CHUNK = 1024   # values per row moved by one load / store


def _pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two dividing n, at most cap."""
  return min(n & -n, cap)


def supported(H: int) -> bool:
  """Heads of H values can be moved as Triton tensors (a power of two, 16 .. 1024)."""
  return H & (H - 1) == 0 and 16 <= H <= _MAX_CHUNK


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


def copy_rows(x_BRF, src_BR, nrows_B, *, interpret=False):
  """out [B, rows_out, F]: out[b, r] = x[b, src[b, r]] (0 where src < 0) for r < nrows[b]
  (rounded up to whole programs); the other rows are left unwritten."""
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


def copy_rows_delta(x_BRF, y_BRF, src_BR, nrows_B, H: int, *, interpret=False):
  """(out [B, rows_out, F] as copy_rows of x (src >= 0), delta [B, F // H, rows_out] float32:
  the sum of x * y over each of the F // H groups of H values of a row)."""
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


def gather_rows(x_BTN_, idx_BIC, counts_BI, multiple: int, *, interpret=False):
  """compaction.gather_rows for the rows the kernels read: x [B, T, N, ...] -> [B, C, N, ...];
  slots past the largest count of the row, rounded up to `multiple`, are left unwritten."""
  B, T, N = x_BTN_.shape[:3]
  C = idx_BIC.shape[-1]
  src, per = _gather_src(idx_BIC, T, N)
  out = copy_rows(_rows(x_BTN_, idx_BIC.shape[1]), src, _bound(counts_BI, multiple) * per,
                  interpret=interpret)
  return out.reshape((B, C) + x_BTN_.shape[2:])


def gather_rows_delta(do_BTNH, o_BTNH, idx_BIC, counts_BI, multiple: int, *, interpret=False):
  """(do_c [B, C, N, H], delta [B, N, C] float32 = sum_H o_c * do_c) on the rows the kernels read
  (as gather_rows; the other slots are left unwritten)."""
  B, T, N, H = do_BTNH.shape
  I, C = idx_BIC.shape[1], idx_BIC.shape[-1]
  src, per = _gather_src(idx_BIC, T, N)
  do_c, delta = copy_rows_delta(_rows(do_BTNH, I), _rows(o_BTNH, I), src,
                                _bound(counts_BI, multiple) * per, H, interpret=interpret)
  if I > 1:  # [B, 1, C * N] -> [B, N, C]
    delta = jnp.swapaxes(delta.reshape(B, C, N), 1, 2)
  return do_c.reshape(B, C, N, H), delta


def uncompact_rows(x_c_BCN_, slot_BIT, *, interpret=False):
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
                  interpret=interpret)
  return out.reshape((B, T) + x_c_BCN_.shape[2:])
