"""Hopper kernels (Pallas Mosaic GPU: wgmma, TMA, warp specialisation) for block-sparse attention.

Same inputs as triton.py (token-major [B, T, N, H] queries, [B, S, K, H] keys / values, GQA:
query head h reads kv head h // (N // K), K/V never repeated; tiles are the block lists' blocks),
but driven by explicit step tables (tables.step_tables): program (b, n, query tile i) walks
count_BNQ[b, n, i] entries tile * 4 + kind (kind 0: no mask; KIND_WINDOW: the element mask;
KIND_LISTED: the element mask without the window, a listed block of a HEAD_WINDOW_BLOCKS head).
All head modes of a layer run in one launch per kernel.

forward  grid (query tile, B, N), heads launched fastest, latest (heaviest) query tiles first;
         3 warpgroups as the compacted kernel's forward (FlashAttention-3 layout): two compute
         warpgroups each own block_q / 2 rows of the tile, a memory warpgroup streams the
         program's listed K/V tiles through `num_stages` TMA slots, the compute warpgroups
         ping-pong on hardware named barriers (mbarriers in interpret mode). Base-2 online
         softmax, fp32 accumulators.
dq       grid (query tile, B, N): two compute warpgroups of block_q / 2 rows + a TMA warpgroup
         streaming the listed K/V tiles (emit_pipeline_warp_specialized, the index map reads the
         table).
dk/dv    grid (K, kv tile, B): block_k / 64 compute warpgroups of 64 kv rows accumulate dk, dv
         over the steps of the transposed table (tables.transposed_step_tables: every (query
         head of the kv head, query tile) pair that visits the tile: native GQA), each in
         block_q / 64 query sub-tiles of 64 rows streamed with their lse / delta through
         `num_stages` TMA slots. A step's products: S^T = K Q^T (waited for), then
         dP^T = V dO^T and dV += P^T dO issued together, dK += dS^T Q (P^T, dS^T from
         registers).
Every output row is written (programs with no step write zeros / lse -inf), so `poison` needs no
aliased buffer.

Supports block_q 128, block_k 64 or 128, head_dim 64 or 128, bfloat16 / float16 (wgmma operands).
Interpret mode (CPU) runs under Pallas' GPU interpreter with the compacted kernel's register-
operand rule (compact_attention/mgpu_interpret.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The Mosaic GPU tile helpers the compacted-query and decode kernels use too (same TMA layouts,
# same hand-offs), under this module's names.
from pallas_kernels.flash_tiles import COL as _COL
from pallas_kernels.flash_tiles import FREE_BAR as _FREE_BAR
from pallas_kernels.flash_tiles import LN2, LOG2E, NEG_INF
from pallas_kernels.flash_tiles import ROW as _ROW
from pallas_kernels.flash_tiles import SCHED_BAR as _SCHED_BAR
from pallas_kernels.flash_tiles import WG_THREADS as _WG_THREADS
from pallas_kernels.flash_tiles import WGMMA as _WGMMA
from pallas_kernels.flash_tiles import acc_update as _acc_update
from pallas_kernels.flash_tiles import bwd_lse2 as _lse2
from pallas_kernels.flash_tiles import ids_or_zeros as _opt
from pallas_kernels.flash_tiles import kv_cols as _kv_cols
from pallas_kernels.flash_tiles import kv_pipeline
from pallas_kernels.flash_tiles import mgpu_interpret as _interp
from pallas_kernels.flash_tiles import mgpu_params as _params
from pallas_kernels.flash_tiles import named_barrier as _named_barrier
from pallas_kernels.flash_tiles import swizzled as _swizzled
from pallas_kernels.flash_tiles import swizzled_spec as _spec

from .tables import KIND_FULL, KIND_LISTED

_COMPUTE_WGS = 2
DKV_ROWS = 64        # kv rows per dk/dv compute warpgroup (wgmma M)
DKV_SUB_Q = 64       # query rows per dk/dv step (128: two more 64 x 128 fp32 tiles live: spills)
NUM_STAGES = 2       # TMA slots (three 128-row K/V stages do not fit beside Q at head_dim 128)
_BIG = 2 ** 30


def support(block_q: int, block_k: int, H: int, dtype) -> str | None:
  """None if the kernels take these tiles / head_dim / dtype, else the reason."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} (Mosaic GPU kernel: bfloat16 or float16)"
  if H not in (64, 128):
    return f"head_dim {H} (Mosaic GPU kernel: 64 or 128)"
  if block_q != 128 or block_k not in (64, 128):
    return (f"block_q {block_q} / block_k {block_k} (Mosaic GPU kernel: block_q 128, block_k 64 "
            "or 128)")
  return None


def _mask(s, qp, qs, kvpos_ref, kvseg_ref, b, start, bk, kind, *, window, sinks,
          transposed=False):
  """s [bq, bk] (transposed: [bk, bq]) with invisible pairs at -inf: kv_pos <= q_pos, same
  segment id, and (unless kind == KIND_LISTED) inside the window or a sink key."""
  shape = s.shape
  qdim = 1 if transposed else 0
  qb = lambda x: lax.broadcast_in_dim(x, shape, [qdim])
  kp_fn, ks_fn = _kv_cols(kvpos_ref, kvseg_ref, b, start, bk, shape, transposed=transposed)
  qpb = qb(qp)
  kp = kp_fn()
  vis = kp <= qpb
  if window is not None:
    listed = kind == KIND_LISTED
    win = jnp.where(listed, _BIG, window)
    inside = (qpb - kp) < win
    if sinks:
      inside = inside | (kp < jnp.where(listed, 0, sinks))
    vis = vis & inside
  if qs is not None:
    vis = vis & (qb(qs) == ks_fn())
  return jnp.where(vis, s, NEG_INF)


def _decode(e):
  return lax.shift_right_logical(e, 2), lax.bitwise_and(e, 3)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def fwd(q_BTNH, k_BSKH, v_BSKH, steps_BNQX, count_BNQ, qpos_BT, qseg_BIT, kvpos_BS, kvseg_BS, *,
        scale, window, sinks, block_q, block_k, num_stages=NUM_STAGES, interpret=False,
        named_barriers=True, name="block_sparse_fwd_mgpu"):
  """(out [B, T, N, H], lse [B, N, T] float32 natural log, -inf where nothing is visible).
  qseg_BIT: None or int [B, I, T] (I = 1 or N; -1 never matches), kvseg_BS with it."""
  named = named_barriers and not interpret
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  dtype = q_BTNH.dtype
  bq, bk = block_q // _COMPUTE_WGS, block_k
  nq = T // block_q
  stages = max(2, min(num_stages, S // bk))
  has_seg = qseg_BIT is not None
  I = qseg_BIT.shape[1] if has_seg else 1
  qk_scale = scale * LOG2E

  def kernel(q_ref, k_ref, v_ref, steps_ref, count_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref,
             out_ref, lse_ref, scoped):
    (qo_smem2, k_smem, v_smem, lse_smem2), (k_bar, v_bar, q_bar), (k_used, v_used), sched = scoped
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    p = nq - 1 - lax.axis_index("q")   # latest (heaviest) query tiles first
    wg = lax.axis_index("wg")
    hsel = h if I > 1 else 0
    nsteps = count_ref[b, h, p]

    def sched_barrier():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    if named:
      def signal_other():
        _named_barrier("arrive", _SCHED_BAR + 1 - wg, 2 * _WG_THREADS)

      def wait_turn():
        _named_barrier("sync", _SCHED_BAR + wg, 2 * _WG_THREADS)

      def release(kind, slot):
        _named_barrier("arrive", _FREE_BAR + (0 if kind == "k" else stages) + slot,
                       3 * _WG_THREADS)
    else:
      signal_other = sched_barrier

      def release(kind, slot):
        plgpu.barrier_arrive((k_used if kind == "k" else v_used).at[slot])

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      qo_smem = qo_smem2.at[wg]
      row0 = p * block_q + wg * bq
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], qo_smem, q_bar.at[wg])
      qp = plgpu.load(qpos_ref.at[b, pl.ds(row0, bq)], layout=_ROW, optimized=False)
      qs = None if not has_seg else plgpu.load(
          qseg_ref.at[b, hsel, pl.ds(row0, bq)], layout=_ROW, optimized=False)
      if named:  # every slot starts free
        for si in range(stages):
          release("k", si)
          release("v", si)
      plgpu.barrier_wait(q_bar.at[wg])
      m_i = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), _ROW)
      l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), _ROW)
      acc = plgpu.layout_cast(jnp.zeros((bq, H), jnp.float32), _WGMMA)
      pl.when(wg == 1)(wait_turn if named else sched_barrier)

      def step(t, carry):
        acc, m_i, l_i = carry
        j, kind = _decode(steps_ref[b, h, p, t])
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(ref):
          plgpu.wgmma(ref, qo_smem, k_smem.at[slot].T)
          signal_other()
          return ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
        release("k", slot)
        s = lax.cond(kind == KIND_FULL, lambda: s, lambda: _mask(
            s, qp, qs, kvpos_ref, kvseg_ref, b, j * bk, bk, kind, window=window, sinks=sinks))
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        pr = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + pr.sum(axis=1)
        p16 = pr.astype(dtype)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        if not named:
          plgpu.barrier_arrive(sched)  # softmax done
        plgpu.barrier_wait(v_bar.at[slot])
        if named:
          wait_turn()  # tensor cores free
        else:
          plgpu.barrier_wait(sched)
        acc = _acc_update(acc, p16, v_smem.at[slot], interpret)
        release("v", slot)
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, nsteps, step, (acc, m_i, l_i))
      pl.when(wg == 0)(signal_other if named else sched_barrier)

      empty = l_i == 0.0
      l_safe = jnp.where(empty, 1.0, l_i)
      acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      qo_smem[...] = acc.astype(dtype)
      lse_smem = lse_smem2.at[wg]
      lse_smem[...] = jnp.where(empty, NEG_INF, (m_i + jnp.log2(l_safe)) * LN2)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(row0, bq), h])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(row0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      kh = lax.div(h, G)

      def rows_of(t):
        j, _ = _decode(steps_ref[b, h, p, t])
        return pl.ds(j * bk, bk)

      if named:
        @pl.loop(0, nsteps)
        def _named_loop(t):
          slot = lax.rem(t, stages)
          rows = rows_of(t)
          _named_barrier("sync", _FREE_BAR + slot, 3 * _WG_THREADS)
          plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_bar.at[slot])
          _named_barrier("sync", _FREE_BAR + stages + slot, 3 * _WG_THREADS)
          plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_bar.at[slot])
        return  # the compute warpgroups' last releases are left unmatched (CTA exit)

      kv_pipeline(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_used, v_used, b=b, kh=kh,
                  rows_of=rows_of, nsteps=nsteps, stages=stages)

  def entry(q_ref, k_ref, v_ref, steps_ref, count_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref,
            out_ref, lse_ref):
    refs = (q_ref, k_ref, v_ref, steps_ref, count_ref, qpos_ref, qseg_ref if has_seg else None,
            kvpos_ref, kvseg_ref if has_seg else None, out_ref, lse_ref)
    scratch = (
        (_swizzled((_COMPUTE_WGS, bq, H), dtype), _swizzled((stages, bk, H), dtype),
         _swizzled((stages, bk, H), dtype), plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=_COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    )
    pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, collective_axes="wg")

  out_shape = [jax.ShapeDtypeStruct((B, T, N, H), dtype),
               jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  args = [q_BTNH, k_BSKH, v_BSKH, steps_BNQX, count_BNQ, qpos_BT, _opt(qseg_BIT, (1, 1, 1)),
          kvpos_BS, _opt(kvseg_BS, (1, 1))]
  out, lse = plgpu.kernel(
      entry, out_type=out_shape, grid=(nq, B, N), grid_names=("q", "batch", "heads"),
      num_threads=_COMPUTE_WGS + 1, thread_name="wg", compiler_params=_params(True),
      interpret=_interp(interpret), kernel_name=name + ("_nb" if named else ""))(*args)
  return out, lse


# ----------------------------------------------------------------------------------------------
# backward: dq
# ----------------------------------------------------------------------------------------------

def dq(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, steps_BNQX, count_BNQ, qpos_BT,
       qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
       num_stages=NUM_STAGES, interpret=False):
  """dq [B, T, N, H] over the forward's step tables."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  dtype = q_BTNH.dtype
  W = _COMPUTE_WGS
  bq, bk = block_q // W, block_k
  nq = T // block_q
  stages = max(1, min(num_stages, S // bk))
  has_seg = qseg_BIT is not None
  I = qseg_BIT.shape[1] if has_seg else 1
  qk_scale = scale * LOG2E

  def kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, steps_ref, count_ref, qpos_ref,
             qseg_ref, kvpos_ref, kvseg_ref, dq_ref, q_smem2, do_smem2, bar2):
    qseg_ref = qseg_ref if has_seg else None
    kvseg_ref = kvseg_ref if has_seg else None
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    p = nq - 1 - lax.axis_index("q")
    wg = lax.axis_index("wg")
    hsel = h if I > 1 else 0
    kh = lax.div(h, G)
    rows = pl.ds(p * block_q + wg * bq, bq)
    q_smem, do_smem, bar = q_smem2.at[wg], do_smem2.at[wg], bar2.at[wg]
    nsteps = count_ref[b, h, p]

    def compute(pipeline_callback):
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, bar)
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, bar)
      lse2 = plgpu.load(lse2_ref.at[b, h, rows], layout=_ROW, optimized=False)
      delta = plgpu.load(delta_ref.at[b, h, rows], layout=_ROW, optimized=False)
      qp = plgpu.load(qpos_ref.at[b, rows], layout=_ROW, optimized=False)
      qs = None if qseg_ref is None else plgpu.load(qseg_ref.at[b, hsel, rows], layout=_ROW,
                                                   optimized=False)
      plgpu.barrier_wait(bar)

      def run(acc):
        pipeline_callback((acc, lse2, delta, qp, qs))
        return acc[...]
      dq_ = pl.run_scoped(run, plgpu.ACC((bq, H), jnp.float32))
      q_smem[...] = (dq_ * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0)

    def body(idx, k_smem, v_smem, k_used, v_used, carry):
      (t,) = idx
      j, kind = _decode(steps_ref[b, h, p, t])
      acc, lse2, delta, qp, qs = carry

      def dp_s(dp_acc, s_acc):
        plgpu.wgmma(dp_acc, do_smem, v_smem.T)
        plgpu.wgmma(s_acc, q_smem, k_smem.T)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(v_used)
        return dp_acc[...], s_acc[...]
      tile = plgpu.ACC((bq, bk), jnp.float32)
      dp, s = pl.run_scoped(dp_s, tile, tile)
      s = lax.cond(kind == KIND_FULL, lambda: s, lambda: _mask(
          s, qp, qs, kvpos_ref, kvseg_ref, b, j * bk, bk, kind, window=window, sinks=sinks))
      row = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
      p_ = jnp.exp2(s * qk_scale - row(lse2))
      ds = p_ * (dp - row(delta))
      plgpu.wgmma(acc, ds.astype(dtype), k_smem)
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(k_used)
      return carry

    tile_of = lambda t: _decode(steps_ref[b, h, p, t])[0]
    plgpu.emit_pipeline_warp_specialized(
        body, grid=(nsteps,), max_concurrent_steps=stages, num_compute_wgs=W,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute,
        in_specs=[_spec((bk, H), dtype, lambda t: (tile_of(t), 0)),
                  _spec((bk, H), dtype, lambda t: (tile_of(t), 0))],
    )(k_ref.at[b, :, kh, :], v_ref.at[b, :, kh, :])

  args = [q_BTNH, k_BSKH, v_BSKH, do_BTNH, _lse2(lse_BNT), delta_BNT, steps_BNQX, count_BNQ,
          qpos_BT, _opt(qseg_BIT, (1, 1, 1)), kvpos_BS, _opt(kvseg_BS, (1, 1))]
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((B, T, N, H), dtype), grid=(nq, B, N),
      grid_names=("q", "batch", "heads"), num_threads=W + 1, thread_name="wg",
      scratch_types=[_swizzled((W, bq, H), dtype), _swizzled((W, bq, H), dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=W)],
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interp(interpret),
      kernel_name="block_sparse_dq_mgpu")(*args)


# ----------------------------------------------------------------------------------------------
# backward: dk, dv over the transposed step tables
# ----------------------------------------------------------------------------------------------

def dkv(q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, tsteps_BKJY, tcount_BKJ, qpos_BT,
        qseg_BIT, kvpos_BS, kvseg_BS, *, scale, window, sinks, block_q, block_k,
        num_stages=NUM_STAGES, interpret=False):
  """(dk, dv) [B, S, K, H] over the transposed step tables (tables.transposed_step_tables).

  A pipeline step is a 64-row query sub-tile (DKV_SUB_Q) of a 128-row query tile. Per 128 x 128
  (query tile, kv tile) pair and SM this issues its products at ~0.89x dq's rate (issue 31's
  profile), both kernels with two compute warpgroups of 64 rows:
    products       dq: S, dP, dQ, each 16 wgmma m64n128k16 (48). dk/dv: S^T, dP^T 32 m64n64k16
                   each (N = the 64-row sub-tile: half dq's N, twice the instructions per
                   flop), dV, dK 16 m64n128k16 with a 64-deep reduction: 96 instructions for 4/3
                   of dq's flops.
    waits          dq: 4 a pair. dk/dv: 16 a pair (4 per warpgroup a sub-step).
    barriers, TMA  dq: 2 copies, 2 releases per warpgroup. dk/dv: 8 copies (Q, dO, lse, delta
                   per sub-step), 4 full-barrier waits, 16 releases.
    registers      dk/dv holds two accumulators (dK, dV: 128) + S^T, dP^T, P^T and the per-column
                   lse / delta values, which is why its sub-tile is 64 rows.
  Whole 128-row steps at dq's shapes (lse / delta as the accumulators' initial values, P^T in the
  input dtype, 24 / 240 registers) and that step's control on 64-row sub-tiles both lost the
  registered A/B (run mosaic_gpu_dkv_q128_ab: 0.79x / 0.96x the default at 64K; this package's
  README)."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G = N // K
  dtype = q_BTNH.dtype
  bkw, bq = DKV_ROWS, DKV_SUB_Q
  W = block_k // bkw
  R = block_q // bq
  nq, nk = T // block_q, S // block_k
  stages = max(1, num_stages)
  has_seg = qseg_BIT is not None
  I = qseg_BIT.shape[1] if has_seg else 1
  qk_scale = scale * LOG2E

  def kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, tsteps_ref, tcount_ref, qpos_ref,
             qseg_ref, kvpos_ref, kvseg_ref, dk_ref, dv_ref, k_smem2, v_smem2, bar2):
    qseg_ref = qseg_ref if has_seg else None
    kvseg_ref = kvseg_ref if has_seg else None
    kh = lax.axis_index("heads")
    b = lax.axis_index("batch")
    jt = lax.axis_index("kv")
    wg = lax.axis_index("wg")
    start = jt * block_k + wg * bkw
    rows = pl.ds(start, bkw)
    nsteps = tcount_ref[b, kh, jt]
    k_smem, v_smem, bar = k_smem2.at[wg], v_smem2.at[wg], bar2.at[wg]

    def dec(t):
      gi, kind = _decode(tsteps_ref[b, kh, jt, t])
      return lax.div(gi, nq), lax.rem(gi, nq), kind   # (g, query tile, kind)

    def compute(pipeline_callback):
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem, bar)
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem, bar)
      plgpu.barrier_wait(bar)

      def run(dk_acc, dv_acc):
        pipeline_callback((dk_acc, dv_acc))
        return dk_acc[...], dv_acc[...]
      acc = plgpu.ACC((bkw, H), jnp.float32)
      dk_, dv_ = pl.run_scoped(run, acc, acc)
      k_smem[...] = (dk_ * scale).astype(dtype)
      v_smem[...] = dv_.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, rows, kh], commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, rows, kh], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    def body(idx, q_smem, do_smem, lse_smem, delta_smem, q_used, do_used, lse_used, delta_used,
             carry):
      t, r = idx
      g, i, kind = dec(t)
      h = kh * G + g
      hsel = h if I > 1 else 0
      dk_acc, dv_acc = carry

      def s_fn(acc):
        plgpu.wgmma(acc, k_smem, q_smem.T)
        plgpu.wgmma_wait(0)
        lse2 = plgpu.load(lse_smem, layout=_COL)
        delta = plgpu.load(delta_smem, layout=_COL)
        plgpu.barrier_arrive(lse_used)
        plgpu.barrier_arrive(delta_used)
        return acc[...], lse2, delta
      sT, lse2, delta = pl.run_scoped(s_fn, plgpu.ACC((bkw, bq), jnp.float32))
      qrows = pl.ds((i * R + r) * bq, bq)

      def masked():
        qp = plgpu.load(qpos_ref.at[b, qrows], layout=_COL, optimized=False)
        qs = None if qseg_ref is None else plgpu.load(qseg_ref.at[b, hsel, qrows], layout=_COL,
                                                      optimized=False)
        return _mask(sT, qp, qs, kvpos_ref, kvseg_ref, b, start, bkw, kind, window=window,
                     sinks=sinks, transposed=True)
      sT = lax.cond(kind == KIND_FULL, lambda: sT, masked)
      col = lambda x: lax.broadcast_in_dim(x, sT.shape, [1])
      pT = jnp.exp2(sT * qk_scale - col(lse2))

      def dp_fn(acc):
        plgpu.wgmma(acc, v_smem, do_smem.T)
        plgpu.wgmma(dv_acc, pT.astype(dtype), do_smem)
        return plgpu.wgmma_accumulator_load(acc, wait_n=1)
      dpT = pl.run_scoped(dp_fn, plgpu.ACC((bkw, bq), jnp.float32))
      dsT = (pT * (dpT - col(delta))).astype(dtype)
      plgpu.wgmma(dk_acc, dsT, q_smem)
      plgpu.wgmma_wait(1)
      plgpu.barrier_arrive(do_used)
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(q_used)
      return carry

    def qmap(t, r):
      g, i, _ = dec(t)
      return i * R + r, kh * G + g, 0

    def rmap(t, r):
      g, i, _ = dec(t)
      return kh * G + g, i * R + r

    plgpu.emit_pipeline_warp_specialized(
        body, grid=(nsteps, R), max_concurrent_steps=stages, num_compute_wgs=W,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True, compute_context=compute,
        in_specs=[_spec((bq, None, H), dtype, qmap), _spec((bq, None, H), dtype, qmap),
                  plgpu.BlockSpec((None, bq), rmap), plgpu.BlockSpec((None, bq), rmap)],
    )(q_ref.at[b], do_ref.at[b], lse2_ref.at[b], delta_ref.at[b])

  args = [q_BTNH, k_BSKH, v_BSKH, do_BTNH, _lse2(lse_BNT), delta_BNT, tsteps_BKJY, tcount_BKJ,
          qpos_BT, _opt(qseg_BIT, (1, 1, 1)), kvpos_BS, _opt(kvseg_BS, (1, 1))]
  kv_t = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  return plgpu.kernel(
      kernel, out_type=(kv_t, kv_t), grid=(K, nk, B), grid_names=("heads", "kv", "batch"),
      num_threads=W + 1, thread_name="wg",
      scratch_types=[_swizzled((W, bkw, H), dtype), _swizzled((W, bkw, H), dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=W)],
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interp(interpret),
      kernel_name="block_sparse_dkv_mgpu")(*args)
