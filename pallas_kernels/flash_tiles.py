"""Flash-attention tile math shared by the kernel packages (compact_attention, block_sparse).

Constants of the online softmax (base-2 exponentials), the shared-memory budget of a Triton
program, and the small in-kernel helpers both packages' Triton and Mosaic TPU kernels use:
  dot(a, b, trans_a, trans_b)   a Triton-lowered matrix product
  bwd_lse2(lse)                 natural-log lse -> base 2, empty rows (-inf) -> +inf (so p = 0)
  lanes / rows / bcast_lanes    the TPU layout: per-query values over the 128 lanes, per-key
                                values over the 8 sublanes
  lse_safe(lse)                 TPU backward: empty rows (-inf) -> +inf (so p = 0)
  poison_buffers(shapes, on)    NaN-filled output buffers (a testing aid: an element a kernel fails
                                to write shows up as NaN)
and the Mosaic GPU (Hopper) building blocks of the compacted, block-sparse and decode kernels:
  WGMMA / ROW / COL             register layouts of a wgmma tile and its row / column vectors
  swizzled / swizzled_spec      SMEM tiles / BlockSpecs in the layout wgmma and TMA want
  acc_update(acc, a, b_ref)     acc + a @ b (a in registers), also under the GPU interpreter
  kv_cols(...)                  a kv tile's positions / segment ids broadcast over a score tile
  named_barrier / WG_THREADS / SCHED_BAR / FREE_BAR   hardware named barriers of the warp-
                                specialised kernels (ping-pong turns, free TMA slots)
  mgpu_params / mgpu_interpret  compiler params; interpret-mode params (CPU)
  ids_or_zeros(x, shape)        an optional int32 operand as a placeholder array
Importable without condattn_jax; nothing here depends on the platform a program is lowered for.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = float("-inf")
TRITON_SMEM_BYTES = 227 * 1024  # Hopper's per-block limit (232448)

# TPU layout
LANES = 128
SUBLANES = 8
NT_DIMS = (((1,), (1,)), ((), ()))  # lax.dot_general dimension numbers of a @ b.T


def dot(a, b, trans_a=False, trans_b=False):
  """A matrix product inside a Triton-lowered kernel."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b)


def bwd_lse2(lse):
  """Natural-log lse -> base-2, with empty rows (-inf) mapped to +inf so that p = 0."""
  lse2 = lse * LOG2E
  return jnp.where(lse2 == NEG_INF, jnp.inf, lse2)


def lse_safe(lse):
  """Natural-log lse with empty rows (-inf) mapped to +inf so that p = exp(s - lse) = 0."""
  return jnp.where(lse == NEG_INF, jnp.inf, lse)


def lanes(x_BIC):
  """[..., C] -> [..., C, 128]: a per-query value replicated over the lanes."""
  return jnp.broadcast_to(x_BIC[..., None], x_BIC.shape + (LANES,))


def rows(x_BS):
  """[B, S] -> [B, 8, S]: a per-key value replicated over the sublanes."""
  return jnp.broadcast_to(x_BS[:, None, :], (x_BS.shape[0], SUBLANES, x_BS.shape[1]))


def bcast_lanes(x, n):
  """(rows, 128) lane-replicated -> (rows, n)."""
  if n == LANES:
    return x
  if n < LANES:
    return x[:, :n]
  return jnp.tile(x, (1, n // LANES))


def poison_buffers(shapes, poison):
  """([NaN arrays], [their ANY-memory BlockSpecs]) for output buffers aliased by a Mosaic TPU
  kernel when `poison`, else ([], [])."""
  if not poison:
    return [], []
  return ([jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes],
          [pl.BlockSpec(memory_space=pl.ANY) for _ in shapes])


# ------------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper)
# ------------------------------------------------------------------------------------------------

WGMMA = plmgpu.Layout.WGMMA
ROW = plmgpu.Layout.WGMMA.reduce(1)
COL = plmgpu.Layout.WGMMA.reduce(0)
WG_THREADS = 128
SCHED_BAR = 4   # named barriers 4, 5: the compute warpgroups' turns (Mosaic GPU uses 0..3)
FREE_BAR = 6    # 6 .. 6 + 2 * stages: K slots free, then V slots free


def swizzled(shape, dtype):
  """SMEM tiles in the layout wgmma / TMA want (8 x 64 bf16 tiles, 128-byte swizzle)."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plmgpu.find_swizzle(shape[-1] * bits)
  return plmgpu.SMEM(shape, dtype, transforms=(
      plmgpu.TilingTransform((8, swizzle * 8 // bits)), plmgpu.SwizzleTransform(swizzle)))


def swizzled_spec(shape, dtype, index_map):
  """A BlockSpec whose SMEM tile has `swizzled`'s layout."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plmgpu.find_swizzle(shape[-1] * bits)
  return plmgpu.BlockSpec(shape, index_map, transforms=(
      plmgpu.TilingTransform((8, swizzle * 8 // bits)), plmgpu.SwizzleTransform(swizzle)))


def acc_update(acc, a, b_ref, interpret):
  """acc + a @ b_ref (fp32 [M, N] in WGMMA layout; a in registers, b in SMEM). The GPU
  interpreter has no pl.run_state over an accumulator: there the product is added in registers
  (same value)."""
  if interpret:
    def f(ref):
      plmgpu.wgmma(ref, a, b_ref)
      return ref[...]
    return acc + pl.run_scoped(f, plmgpu.ACC(acc.shape, jnp.float32))

  def g(ref):
    plmgpu.wgmma(ref, a, b_ref)
  return pl.run_state(g)(plmgpu.ACC.init(acc))


def kv_cols(kvpos_ref, kvseg_ref, b, start, bk, shape, transposed=False):
  """Closures producing the kv positions / segment ids of kv tile [start, start + bk) broadcast
  over a [bq, bk] (or, transposed, [bk, bq]) tile; kvpos_ref None: positions = slots."""
  dim = 0 if transposed else 1
  layout = ROW if transposed else COL

  def kp():
    if kvpos_ref is None:
      return start + plmgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)
    x = plmgpu.load(kvpos_ref.at[b, pl.ds(start, bk)], layout=layout, optimized=False)
    return lax.broadcast_in_dim(x, shape, [dim])

  def ks():
    x = plmgpu.load(kvseg_ref.at[b, pl.ds(start, bk)], layout=layout, optimized=False)
    return lax.broadcast_in_dim(x, shape, [dim])
  return kp, ks


def named_barrier(op, barrier_id, num_threads):
  """`bar.{op} barrier_id, num_threads` (op 'arrive' or 'sync') by every thread of the calling
  warpgroup; barrier_id an int or an int32 scalar."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  if isinstance(barrier_id, int):
    @plmgpu.inline_mgpu()
    def emit(_):
      mgpu_utils.inline_ptx(f"bar.{op} {barrier_id}, {num_threads};", convergent=True)
    emit()
    return

  @plmgpu.inline_mgpu(arg_types=(plmgpu.Layout.WG_SPLAT,))
  def emit_dyn(_, bid):
    mgpu_utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid.registers[()], convergent=True)
  emit_dyn(jnp.asarray(barrier_id, jnp.int32))


def mgpu_params(no_auto_barriers):
  """Compiler params (approximate math; without automatic barriers where the kernel places its
  own named barriers)."""
  if no_auto_barriers:
    return plmgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                 reduction_scratch_bytes=0)
  return plmgpu.CompilerParams(approx_math=True)


def mgpu_interpret(interpret):
  """Interpret-mode params of a Mosaic GPU kernel (None when compiled): Pallas' GPU interpreter
  with wgmma's register-operand rule (pallas_kernels/compact_attention/mgpu_interpret.py)."""
  if not interpret:
    return None
  from pallas_kernels.compact_attention import mgpu_interpret as mi
  return mi.params(interpret)


def ids_or_zeros(x, shape):
  """An optional int32 kernel operand: x, or a placeholder of `shape` the kernel never reads."""
  return x if x is not None else jnp.zeros(shape, jnp.int32)


def kv_pipeline(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_used, v_used, *, b, kh, rows_of,
                nsteps, stages):
  """The Hopper kernels' memory-warpgroup K/V producer: TMA-loads rows `rows_of(t)` of
  k_ref / v_ref[b, :, kh] into slot t % stages for t < nsteps (arriving on k_bar / v_bar), waits
  for the compute warpgroups' release (k_used / v_used) before reusing a slot, and then observes
  the last steps' releases too, so each waiter sees every barrier phase."""
  def load(t, slot):
    rows = rows_of(t)
    plmgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_bar.at[slot])
    plmgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_bar.at[slot])

  for i in range(stages):
    pl.when(i < nsteps)(functools.partial(load, i, i))

  @pl.loop(0, nsteps - stages)
  def _loop(t):
    slot = lax.rem(t, stages)
    rows = rows_of(t + stages)
    plmgpu.barrier_wait(k_used.at[slot])
    plmgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_bar.at[slot])
    plmgpu.barrier_wait(v_used.at[slot])
    plmgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_bar.at[slot])

  @pl.loop(jnp.maximum(nsteps - stages, 0), nsteps)
  def _drain(t):
    slot = lax.rem(t, stages)
    plmgpu.barrier_wait(k_used.at[slot])
    plmgpu.barrier_wait(v_used.at[slot])
