"""Hopper kernels (Pallas Mosaic GPU) of a decode step's MLP: weights streamed once.

    h_MF   = gate_up(xn_MD, w_gate_DF, w_up_DF)      silu(xn @ Wg) * (xn @ Wu), rounded like the model
    part   = down(h_MF, w_down_FD)                     f32 partial sums of h @ Wd, one per K part
    (api.decode_mlp: out = x + round(sum(part)), one XLA fusion)

A decode step multiplies M <= 64 activation rows by weight matrices of tens of MB: the time is the
weight read, so both kernels are built around one stream of weight tiles per program:

- Operands. wgmma's B operand is a weight tile [block_k, block_n] straight from the row-major
  [K, N] weight (N contiguous, the layout of jax's hopper_matmul_mgpu example); its A operand
  is the activation rows padded to wgmma's 64-row M tile. The padding costs tensor-core time
  only (64 rows where M are real: at the Qwen2.5-1.5B shapes a gate/up program's products are
  ~a third of its tile's transfer time, overlapped), never bytes: the activation tile's TMA box
  holds round_up(M, 8) rows (rows past M read as zeros by TMA's out-of-bounds fill), and the
  stages' activation buffers overlap (`act_rows`: stage s owns rows [s * Mp, (s + 1) * Mp) of
  one buffer and wgmma reads the 64 rows from s * Mp; the rows past Mp belong to the next stages
  or to the buffer's tail and only reach accumulator rows >= M, which are never stored), so the
  activations take Mp x block_k x 2 bytes of shared memory a stage, not 64 x block_k x 2.
  Not the transposed form (weights as wgmma's M side, the activation rows an N = Mp wide B
  operand), which saves the padded products: there the down kernel's B operand would be h
  transposed, [F, Mp] with rows of Mp x 2 bytes, while Mosaic GPU's wgmma wants both operands
  under one swizzle (the weights' 128 bytes: h would travel padded to 64 columns), and both
  kernels' accumulators would come out transposed ([N, Mp]: the h tile and the residual
  epilogue would need a transpose); the gate/up products hide under the transfers anyway.
- One warpgroup per program (128 threads): it waits for a stage's TMA barrier, issues the
  stage's wgmmas, waits for the previous stage's wgmmas (wgmma_wait(1)) and refills that
  stage's slot with the tile `stages` steps ahead. No memory warpgroup: the refill is one
  elected thread's TMA issue, and a one-warpgroup program keeps the register file and shared
  memory small enough for 2-3 programs per SM, which the grid sizes below need.
- Grids sized to be resident at once. Weight bytes are shared by the requests in flight, not
  by SMs: when every program is resident with the same tiles in flight, every program streams
  at the same rate and all finish together; a grid that is not resident at once runs a second
  wave (140 programs of one per SM on 132 SMs: ~2 waves). api.plan picks tiles and stages so
  that the grid fits in ceil(programs / SMs) programs per SM (shared memory is the limit).
- gate/up: grid (F / block_n,); a program reads the [D, block_n] column slab of both Wg and Wu
  (full K: the silu * mul epilogue needs the complete sums), accumulates both in fp32,
  rounds g and u to the activation dtype (the model's two nn.Dense outputs), computes
  silu(g) * u in fp32 and writes h rounded to the activation dtype, rows < M only (TMA drops
  the rest).
- down (K = F large, N = D small): split-K. grid (D / block_n, splits), the K part fastest;
  program (n, s) reads the rows [lo_s, hi_s) of Wd's column slab n (K parts of
  floor / ceil(steps / splits) tiles) and writes its fp32 partial [Mp, block_n] to part[s]. The
  column tiles alone (24 at the 1.5B shapes) would leave most SMs idle; split-K makes
  (D / block_n) x splits programs (e.g. 24 x 11 = 264, two per SM). The partials' sum, the
  rounding of the model's down_proj output and the residual add are one small XLA fusion
  (api.decode_mlp), which a decoder's next RMSNorm fusion can absorb; no cross-program
  reduction in the kernel (it would need grid-wide semaphores, which the GPU interpreter the
  tests run on does not simulate).

Ragged edges: N (F or D) and K (D or F) need not be multiples of the tiles (multiples of 8:
TMA's 16-byte strides): the last tiles read past the array, which TMA fills with zeros (a zero
row of K adds nothing), and the stores drop what lies past it. Interpret mode (CPU): Pallas' GPU
interpreter (flash_tiles.mgpu_interpret), which fills and drops out-of-bounds copies the same way.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_tiles import mgpu_interpret, swizzled

ROWS = 64   # wgmma's M tile: the padded activation rows
# no cross-warp reductions in these kernels: no reduction scratch (2 KiB of shared memory a
# program, which api.plan's residency needs)
_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def padded_rows(M: int) -> int:
  """The activation rows a TMA box holds: M rounded up to 8 (the shared-memory tile's rows)."""
  return -(-M // 8) * 8


def act_rows(stages: int, mp: int) -> int:
  """Rows of the stages' overlapped activation buffer: stage s owns [s * mp, (s + 1) * mp), and
  wgmma reads the 64 rows from s * mp (the last stage's window runs 64 - mp rows past its own)."""
  return stages * mp + ROWS - mp


def smem_bytes(kind: str, M: int, block_n: int, block_k: int, stages: int, itemsize: int = 2):
  """Shared memory of one program (bytes; the barriers aside): the weight tiles of `stages`
  steps (two matrices for 'gate_up'), the overlapped activation rows, the output tile."""
  mp = padded_rows(M)
  mats = 2 if kind == "gate_up" else 1
  weights = stages * mats * block_k * block_n * itemsize
  acts = act_rows(stages, mp) * block_k * itemsize
  out = ROWS * block_n * (itemsize if kind == "gate_up" else 4)
  return weights + acts + (0 if kind == "gate_up" else out)


def _ring(nsteps, stages, bar, load, compute):
  """One warpgroup's TMA ring over `nsteps` (>= 1, static or traced) K steps: `load(t, slot)`
  issues step t's copies into `slot` (arriving on bar[slot]); `compute(t, slot)` issues step t's
  wgmmas. Step t waits for its slot and issues its products; with two or more stages it then
  waits for step t - 1's products (one wgmma group stays in flight) and refills their slot with
  step t - 1 + stages; with one stage it waits for its own and refills with step t + 1."""
  lag = 1 if stages > 1 else 0
  for i in range(stages):
    if isinstance(nsteps, int):
      if i < nsteps:
        load(i, i)
    else:
      pl.when(i < nsteps)(functools.partial(load, i, i))

  def step(t, carry):
    slot = lax.rem(t, stages)
    plgpu.barrier_wait(bar.at[slot])
    compute(t, slot)
    plgpu.wgmma_wait(lag)
    done = t - lag
    nxt = done + stages

    @pl.when((done >= 0) & (nxt < nsteps))
    def _():
      load(nxt, lax.rem(done, stages))
    return carry

  lax.fori_loop(0, nsteps, step, None)
  plgpu.wgmma_wait(0)


def gate_up(xn_MD, wg_DF, wu_DF, *, block_n: int, block_k: int, stages: int,
            interpret=False):
  """h [M, F] in xn's dtype: round(silu(g) * u) with g = round(xn @ Wg), u = round(xn @ Wu)
  (fp32 sums, rounded to xn's dtype as the model's nn.Dense outputs are; silu * mul in fp32).
  M <= 64; D, F multiples of 8 (api.kernel_support)."""
  M, D = xn_MD.shape
  F = wg_DF.shape[1]
  dtype = xn_MD.dtype
  bn, bk = block_n, block_k
  mp = padded_rows(M)
  nk = -(-D // bk)
  S = max(1, min(stages, nk))

  def kernel(x_ref, wg_ref, wu_ref, h_ref, x_smem, g_smem, u_smem, bar):
    n0 = lax.axis_index("n") * bn

    def load(t, slot):
      k0 = t * bk
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, mp), pl.ds(k0, bk)],
                              x_smem.at[pl.ds(slot * mp, mp)], bar.at[slot])
      plgpu.copy_gmem_to_smem(wg_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], g_smem.at[slot],
                              bar.at[slot])
      plgpu.copy_gmem_to_smem(wu_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], u_smem.at[slot],
                              bar.at[slot])

    def run(acc_g, acc_u):
      def compute(t, slot):
        a = x_smem.at[pl.ds(slot * mp, ROWS)]
        plgpu.wgmma(acc_g, a, g_smem.at[slot])
        plgpu.wgmma(acc_u, a, u_smem.at[slot])
      _ring(nk, S, bar, load, compute)
      return acc_g[...], acc_u[...]

    acc = plgpu.ACC((ROWS, bn), jnp.float32)
    g, u = pl.run_scoped(run, acc, acc)
    g = g.astype(dtype).astype(jnp.float32)     # the model's gate_proj output
    u = u.astype(dtype).astype(jnp.float32)     # the model's up_proj output
    h = (jax.nn.silu(g) * u).astype(dtype)
    out = g_smem.at[0, pl.ds(0, ROWS)]          # stage 0's [block_k >= 64, block_n]: free now
    out[...] = h
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out.at[pl.ds(0, mp)], h_ref.at[pl.ds(0, mp), pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((M, F), dtype),
      grid=(-(-F // bn),), grid_names=("n",),
      scratch_types=[swizzled((act_rows(S, mp), bk), dtype), swizzled((S, bk, bn), dtype),
                     swizzled((S, bk, bn), dtype),
                     plgpu.Barrier(num_arrivals=3, num_barriers=S)],
      compiler_params=_PARAMS,
      interpret=mgpu_interpret(interpret), kernel_name="decode_mlp_gate_up_mgpu")
  return call(xn_MD, wg_DF, wu_DF)


def split_range(s, nk: int, splits: int):
  """K steps [lo, hi) of part s: floor(s * nk / splits) .. floor((s + 1) * nk / splits) (part
  sizes differ by at most one step; none is empty while splits <= nk)."""
  return lax.div(s * nk, splits), lax.div((s + 1) * nk, splits)


def down(h_MF, wd_FD, *, block_n: int, block_k: int, stages: int, splits: int,
         interpret=False):
  """part [splits, M, D] float32: part[s] = h[:, K part s] @ Wd[K part s, :] (fp32 sums); the
  sum over s is h @ Wd. splits <= ceil(F / block_k)."""
  M, F = h_MF.shape
  D = wd_FD.shape[1]
  dtype = h_MF.dtype
  bn, bk = block_n, block_k
  mp = padded_rows(M)
  nk = -(-F // bk)
  if not 1 <= splits <= nk:
    raise ValueError(f"down: splits={splits} must be in [1, {nk}] (the K steps of block_k={bk})")
  S = max(1, min(stages, -(-nk // splits)))

  def kernel(h_ref, wd_ref, part_ref, h_smem, w_smem, bar):
    n0 = lax.axis_index("n") * bn
    s = lax.axis_index("split")
    lo, hi = split_range(s, nk, splits)

    def load(t, slot):
      k0 = (lo + t) * bk
      plgpu.copy_gmem_to_smem(h_ref.at[pl.ds(0, mp), pl.ds(k0, bk)],
                              h_smem.at[pl.ds(slot * mp, mp)], bar.at[slot])
      plgpu.copy_gmem_to_smem(wd_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], w_smem.at[slot],
                              bar.at[slot])

    def run(acc):
      def compute(t, slot):
        plgpu.wgmma(acc, h_smem.at[pl.ds(slot * mp, ROWS)], w_smem.at[slot])
      _ring(hi - lo, S, bar, load, compute)
      return acc[...]

    y = pl.run_scoped(run, plgpu.ACC((ROWS, bn), jnp.float32))

    def store(out):
      out[...] = y
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out.at[pl.ds(0, mp)],
                              part_ref.at[s, pl.ds(0, mp), pl.ds(n0, bn)])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(store, swizzled((ROWS, bn), jnp.float32))

  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((splits, M, D), jnp.float32),
      grid=(-(-D // bn), splits), grid_names=("n", "split"),
      scratch_types=[swizzled((act_rows(S, mp), bk), dtype), swizzled((S, bk, bn), dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=S)],
      compiler_params=_PARAMS,
      interpret=mgpu_interpret(interpret), kernel_name="decode_mlp_down_mgpu")
  return call(h_MF, wd_FD)
