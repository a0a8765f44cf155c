"""Hopper kernels (Pallas Mosaic GPU: wgmma, TMA, warp specialisation), compacted-query attention.

Same contract as triton.py: compacted queries q_c [B, C, N, H] (token-major), the full K/V
[B, S, K, H] (GQA: query head h reads kv head h // (N // K), K/V never repeated), per-tile loop
bounds from compaction.tile_bounds, per-query positions / segment ids for the masked tiles.

forward  grid (C / block_q, B, N), heads launched fastest (`launch_grid`); 3 warpgroups
         (FlashAttention-3 layout, after jax.experimental.pallas.ops.gpu.attention_mgpu): two
         compute warpgroups each own block_q / 2 query rows, a memory warpgroup streams the K/V
         tiles of the program's range [lo, hi) through `num_stages` TMA slots; a schedule
         barrier ping-pongs the two compute warpgroups so that one's softmax overlaps the
         other's matrix products. Each compute warpgroup runs its own bounds inside the
         program's range: masked, unmasked or (outside its own range) only the barrier
         handshake. Base-2 online softmax, fp32 accumulators.
dq       grid (C / (W block_q_dq), B, N), W = compute_wgs (2) compute warpgroups of
         block_q_dq rows each + a TMA warpgroup streaming the K/V tiles of the union of their
         bounds (a run-time length); each warpgroup masks the tiles outside its own bounds.
dk/dv    grid (K, S / (W block_k_dkv), B), kv head by kv head (its programs then read the same
         Q / dO tiles; 8 waves or more even at s = 0.95, so no tail): W compute warpgroups of
         block_k_dkv kv rows each accumulate dk, dv over the G query heads of their kv head and
         the query tiles of the union of the heads' and warpgroups' bounds (tokamax's sm90 VJP
         layout).
Programs whose query tiles lie past a row's active count hold only padding, launch after every
live one (`tile_order`) and return at once (the dynamic bound).

Interpret mode (CPU): the kernels run under Pallas' GPU interpreter, which lacks two features the
fast path uses: wgmma with the A operand in registers and `pl.run_state` over an accumulator.
`mgpu_interpret.py` adds the first; for the second the forward adds its P @ V product to the
running accumulator in registers (same value; `_acc_update`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The Mosaic GPU tile helpers (pallas_kernels/flash_tiles.py, shared with block_sparse and
# decode), under this module's names.
from pallas_kernels.flash_tiles import COL as _COL
from pallas_kernels.flash_tiles import FREE_BAR as _FREE_BAR
from pallas_kernels.flash_tiles import LN2, LOG2E, NEG_INF, kv_pipeline
from pallas_kernels.flash_tiles import ROW as _ROW
from pallas_kernels.flash_tiles import SCHED_BAR as _SCHED_BAR
from pallas_kernels.flash_tiles import WG_THREADS as _WG_THREADS
from pallas_kernels.flash_tiles import WGMMA as _WGMMA
from pallas_kernels.flash_tiles import acc_update as _acc_update
from pallas_kernels.flash_tiles import bwd_lse2 as _lse2
from pallas_kernels.flash_tiles import ids_or_zeros as _opt
from pallas_kernels.flash_tiles import kv_cols as _kv_cols
from pallas_kernels.flash_tiles import mgpu_interpret as _interp
from pallas_kernels.flash_tiles import mgpu_params as _params
from pallas_kernels.flash_tiles import named_barrier as _named_barrier
from pallas_kernels.flash_tiles import swizzled as _swizzled
from pallas_kernels.flash_tiles import swizzled_spec as _spec

from .common import BlockSizes

_COMPUTE_WGS = 2


def _mask(s, qp, qs, kp_fn, ks_fn, window, shape):
  """s [bq, bk] with invisible pairs at -inf. qp/qs: per-row vectors (ROW layout); kp_fn/ks_fn:
  per-column values as [bq, bk] arrays."""
  row = lambda x: lax.broadcast_in_dim(x, shape, [0])
  qpb = row(qp)
  kp = kp_fn()
  vis = kp <= qpb
  if window is not None:
    vis = vis & (qpb - kp < window)
  if qs is not None:
    vis = vis & (row(qs) == ks_fn())
  return jnp.where(vis, s, NEG_INF)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def range_union(bounds, axis):
  """The union [lo, hi) of the non-empty tile ranges of `bounds` [..., 4] (lo, full_lo, full_hi,
  hi) over `axis`; (0, 0) where all are empty."""
  lo, hi = bounds[..., 0], bounds[..., 3]
  empty = lo >= hi
  big = jnp.iinfo(jnp.int32).max
  ulo = jnp.min(jnp.where(empty, big, lo), axis=axis)
  uhi = jnp.max(jnp.where(empty, 0, hi), axis=axis)
  ulo = jnp.where(ulo == big, 0, ulo)
  return ulo, jnp.maximum(uhi, ulo)


def launch_grid(B, nprog, N, heads_fastest=True):
  """grid / grid_names of the forward and dq kernels, launched longest-first over the SMs.

  Pallas Mosaic GPU launches the LAST grid axis fastest (the lowering reverses the grid onto
  CUDA's x, y, z). With (q, batch, heads) the N heads of every row of one query tile start
  together and the tiles go heaviest first (`tile_order` maps the "q" index to the live tiles
  in reverse, then the empty programs), which is
  longest-first list scheduling. The old (heads, q, batch) ran head by head: every head's light
  tiles came before the next head's heavy ones, leaving a tail of long programs (a simulation of
  132 SMs: 83% / 72% of ideal at T = 32K, s = 0.9 / 0.95, against 99% / 92%). For B = 1 the
  launch is the same as (batch, q, heads), the grid the H100 results were measured with."""
  if heads_fastest:
    return dict(grid=(nprog, B, N), grid_names=("q", "batch", "heads"))
  return dict(grid=(N, nprog, B), grid_names=("heads", "q", "batch"))


def tile_order(qi, ntiles, nprog, empties_last=True):
  """The query tile (program index) p that launch index qi runs. ntiles: the programs that hold
  active queries (the largest active count of any row / head, in programs; `live_tiles`). Those
  go first, heaviest (latest positions: most keys) first; the programs past every count, which
  return at once, go last and fill the tail of the launch (docs/performance.md: why).
  empties_last=False: the old order, the last program first (nprog - 1 - qi)."""
  if not empties_last:
    return nprog - 1 - qi
  return jnp.where(qi < ntiles, ntiles - 1 - qi, qi)


def live_tiles(counts_BI, rows_per_program):
  """[1] int32: programs of `rows_per_program` query slots holding the largest active count."""
  return ((jnp.max(counts_BI) + rows_per_program - 1) // rows_per_program).reshape(1).astype(
      jnp.int32)


def prog_bounds(bounds_wg, nq_prog, wgs=_COMPUTE_WGS):
  """Per-warpgroup bounds [B, I, wgs * nq_prog, 4] -> (program range [B, I, nq_prog, 2], per-
  warpgroup bounds with empty ranges moved to the program's lo so every loop is ordered)."""
  B, I = bounds_wg.shape[:2]
  b = bounds_wg.reshape(B, I, nq_prog, wgs, 4)
  plo, phi = range_union(b, axis=-1)
  empty = b[..., 0] >= b[..., 3]
  b = jnp.where(empty[..., None], plo[..., None, None], b)
  return jnp.stack([plo, phi], -1), b.reshape(B, I, wgs * nq_prog, 4)


def fwd(q_BCNH, k_BSKH, v_BSKH, qpos_BIC, qseg_BIC, kvpos_BS, kvseg_BS, bounds_BIQ4, counts_BI, *,
        scale, window, bs: BlockSizes, interpret=False, poison=False, heads_fastest=True,
        empties_last=True, fold_scale=True, no_auto_barriers=True, named_barriers=True):
  """Returns (out_c [B, C, N, H], lse [B, N, C] float32); query tiles past counts_BI are not
  written. bounds_BIQ4 are per compute warpgroup (block_q // 2 rows). heads_fastest=False
  launches head by head (the old order; `launch_grid`), empties_last=False launches the
  programs past every count first (the old order; `tile_order`); both for the benchmark only.

  fold_scale: the softmax scale applied inside exp2's argument (s * scale - m: one fused
  multiply-add per score; the row max taken on the raw scores), as tokamax's sm90 kernel, instead
  of scaling every score first. no_auto_barriers: CompilerParams(unsafe_no_auto_barriers=True,
  reduction_scratch_bytes=0), as tokamax's sm90 forward; safe here, no thread reads and writes one
  SMEM region (Q / K / V are read by the tensor cores only, the epilogue only writes); measured
  in docs/performance.md. named_barriers: the
  compute warpgroups' hand-offs on hardware named barriers (bar.arrive / bar.sync, as tokamax's
  sm90 kernel and FlashAttention-3) instead of mbarriers (api.CompactConfig.mgpu_named_barriers;
  the interpreter runs no inline PTX, so interpret mode keeps the mbarriers; tests/gpu checks both
  give the same bits)."""
  named = named_barriers and not interpret
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  dtype = q_BCNH.dtype
  bq, bk = bs.block_q // _COMPUTE_WGS, bs.block_k
  nprog = C // (2 * bq)
  stages = max(2, min(bs.num_stages, S // bk))
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  progb, wgb = prog_bounds(bounds_BIQ4, nprog)
  qk_scale = scale * LOG2E

  def kernel(q_ref, k_ref, v_ref, wgb_ref, progb_ref, count_ref, ntiles_ref, qpos_ref, qseg_ref,
             kvpos_ref, kvseg_ref, out_ref, lse_ref, scoped):
    (qo_smem2, k_smem, v_smem, lse_smem2), (k_bar, v_bar, q_bar), (k_used, v_used), sched = scoped
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    p = tile_order(lax.axis_index("q"), ntiles_ref[0], nprog, empties_last)  # heavy first
    wg = lax.axis_index("wg")
    hsel = h if I > 1 else 0

    def sched_barrier():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    # The compute warpgroups' hand-offs. mbarriers (interpret mode): `sched` is a rendezvous of
    # the two warpgroups, K/V slots are released by arriving on k_used / v_used. Named barriers
    # (hardware bar.arrive / bar.sync, FlashAttention-3's ping-pong): a warpgroup signals the
    # other's turn after issuing Q K^T and waits for its own turn before P V; slots are released
    # by bar.arrive and the memory warpgroup bar.syncs before reusing one.
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

    @pl.when(p * 2 * bq < count_ref[b, hsel])
    def _program():
      plo = progb_ref[b, hsel, p, 0]
      nsteps = progb_ref[b, hsel, p, 1] - plo

      @pl.when(wg < _COMPUTE_WGS)
      def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        row0 = p * 2 * bq + wg * bq
        t = p * 2 + wg
        lo, flo, fhi, hi = (wgb_ref[b, hsel, t, c] for c in range(4))
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], qo_smem, q_bar.at[wg])
        qp = plgpu.load(qpos_ref.at[b, hsel, pl.ds(row0, bq)], layout=_ROW, optimized=False)
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

        def step(j, carry, *, kind):
          slot = lax.rem(j - plo, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          if kind == "skip":
            signal_other()
            release("k", slot)
            if not named:
              plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            if named:
              wait_turn()
            else:
              plgpu.barrier_wait(sched)
            release("v", slot)
            return carry
          acc, m_i, l_i = carry

          def qk(ref):
            plgpu.wgmma(ref, qo_smem, k_smem.at[slot].T)
            signal_other()
            return ref[...]
          s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
          release("k", slot)
          if not fold_scale:
            s = s * qk_scale
          if kind == "masked":
            kp, ks = _kv_cols(kvpos_ref, kvseg_ref, b, j * bk, bk, s.shape)
            s = _mask(s, qp, qs, kp, ks, window, s.shape)
          if fold_scale:  # the max on raw scores, the scale in exp2's argument (one FMA)
            m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
          else:
            m_new = jnp.maximum(m_i, s.max(axis=1))
          m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if kind == "masked" else m_new
          alpha = jnp.exp2(m_i - m_use)
          if fold_scale:
            pr = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
          else:
            pr = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
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

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(plo, lo, functools.partial(step, kind="skip"), carry)
        carry = lax.fori_loop(lo, flo, functools.partial(step, kind="masked"), carry)
        carry = lax.fori_loop(flo, fhi, functools.partial(step, kind="full"), carry)
        carry = lax.fori_loop(fhi, hi, functools.partial(step, kind="masked"), carry)
        acc, m_i, l_i = lax.fori_loop(hi, plo + nsteps, functools.partial(step, kind="skip"),
                                      carry)
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

        rows_of = lambda t: pl.ds((plo + t) * bk, bk)

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

  def entry(*refs):
    kernel_refs = refs
    scratch = (
        (_swizzled((_COMPUTE_WGS, bq, H), dtype), _swizzled((stages, bk, H), dtype),
         _swizzled((stages, bk, H), dtype), plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=_COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    )
    pl.run_scoped(lambda *s: kernel(*kernel_refs, s), *scratch, collective_axes="wg")

  out_shape = [jax.ShapeDtypeStruct((B, C, N, H), dtype),
               jax.ShapeDtypeStruct((B, N, C), jnp.float32)]
  args = [q_BCNH, k_BSKH, v_BSKH, wgb, progb, counts_BI, live_tiles(counts_BI, 2 * bq), qpos_BIC,
          qseg_BIC if has_seg else jnp.zeros((1, 1, 1), jnp.int32),
          kvpos_BS if has_kvpos else jnp.zeros((1, 1), jnp.int32),
          kvseg_BS if has_seg else jnp.zeros((1, 1), jnp.int32)]

  def entry_sel(q_ref, k_ref, v_ref, wgb_ref, progb_ref, count_ref, ntiles_ref, qpos_ref,
                qseg_ref, kvpos_ref, kvseg_ref, out_ref, lse_ref):
    entry(q_ref, k_ref, v_ref, wgb_ref, progb_ref, count_ref, ntiles_ref, qpos_ref,
          qseg_ref if has_seg else None, kvpos_ref if has_kvpos else None,
          kvseg_ref if has_seg else None, out_ref, lse_ref)

  call = plgpu.kernel(
      entry_sel, out_type=out_shape, **launch_grid(B, nprog, N, heads_fastest),
      num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=_params(no_auto_barriers), interpret=_interp(interpret),
      kernel_name="compact_attention_fwd_mgpu" + ("_nb" if named else ""))
  out, lse = call(*args)
  if poison:
    out, lse = _poison_unwritten(out, lse, counts_BI, 2 * bq, I)
  return out, lse


def _poison_unwritten(out, lse, counts_BI, tile, I):
  """Testing: NaN in the rows of tiles the kernel skips (past the count), as an aliased poisoned
  buffer would hold; a kernel bug that skips an active tile leaves garbage that the reference
  comparison catches (Mosaic GPU kernels take no input/output aliases)."""
  B, C, N, H = out.shape
  slot = jnp.arange(C)
  cnt = counts_BI if I > 1 else jnp.broadcast_to(counts_BI, (B, N))
  written = (slot // tile)[None, None, :] * tile < cnt[..., None]     # [B, N, C]
  out = jnp.where(jnp.swapaxes(written, 1, 2)[..., None], out, jnp.nan).astype(out.dtype)
  lse = jnp.where(written, lse, jnp.nan)
  return out, lse


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------

# Compute warpgroups per backward program (compute_wgs; api.CompactConfig.mgpu_bwd_wgs), as in
# tokamax's sm90 flash-attention VJP: dq runs W query tiles of block_q_dq rows against each K/V
# tile the TMA warpgroup streams, dk/dv runs W kv tiles of block_k_dkv rows against each Q/dO tile
# (each K/V or Q/dO load feeds W warpgroups' matrix products). 1 where the buffer is not a
# multiple of W tiles.


def _bwd_wgs(n_tiles, compute_wgs):
  if compute_wgs not in (1, 2):
    raise ValueError(f"compute_wgs must be 1 or 2, got {compute_wgs}")
  return compute_wgs if n_tiles % compute_wgs == 0 else 1


def dq(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
       kvseg_BS, bounds_BIQ4, counts_BI, *, scale, window, bs: BlockSizes, interpret=False,
       poison=False, compute_wgs=2, heads_fastest=True, empties_last=True,
       fold_scale=True):
  """dq_c [B, C, N, H]; programs (W query tiles of block_q_dq rows) past counts_BI are not
  written. bounds_BIQ4: per query tile of block_q_dq rows. fold_scale: as in `fwd` (dk/dv keeps
  the separate scale: folded it was slower, docs/performance.md);
  heads_fastest / empties_last: as in `fwd`."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  dtype = q_BCNH.dtype
  bq, bk = bs.block_q_dq, bs.block_k_dq
  W = _bwd_wgs(C // bq, compute_wgs)
  nprog = C // (W * bq)
  stages = max(1, min(bs.num_stages_dq, S // bk))
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  qk_scale = scale * LOG2E
  progb, wgb = prog_bounds(bounds_BIQ4, nprog, W)

  def kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, wgb_ref, progb_ref, count_ref,
             ntiles_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, dq_ref, q_smem2, do_smem2, bar2):
    qseg_ref = qseg_ref if has_seg else None
    kvseg_ref = kvseg_ref if has_seg else None
    kvpos_ref = kvpos_ref if has_kvpos else None
    h = lax.axis_index("heads")
    b = lax.axis_index("batch")
    p = tile_order(lax.axis_index("q"), ntiles_ref[0], nprog, empties_last)  # heavy first
    wg = lax.axis_index("wg")
    hsel = h if I > 1 else 0
    kh = lax.div(h, G)
    t = p * W + wg  # this warpgroup's query tile (meaningful in the compute warpgroups only)
    rows = pl.ds(t * bq, bq)
    q_smem, do_smem, bar = q_smem2.at[wg], do_smem2.at[wg], bar2.at[wg]

    def compute(pipeline_callback):
      flo, fhi = wgb_ref[b, hsel, t, 1], wgb_ref[b, hsel, t, 2]
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, bar)
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, bar)
      lse2 = plgpu.load(lse2_ref.at[b, h, rows], layout=_ROW, optimized=False)
      delta = plgpu.load(delta_ref.at[b, h, rows], layout=_ROW, optimized=False)
      qp = plgpu.load(qpos_ref.at[b, hsel, rows], layout=_ROW, optimized=False)
      qs = None if qseg_ref is None else plgpu.load(qseg_ref.at[b, hsel, rows], layout=_ROW,
                                                   optimized=False)
      plgpu.barrier_wait(bar)

      def run(acc):
        pipeline_callback((acc, lse2, delta, qp, qs, flo, fhi))
        return acc[...]
      dq_ = pl.run_scoped(run, plgpu.ACC((bq, H), jnp.float32))
      q_smem[...] = (dq_ * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(p * W * bq < count_ref[b, hsel])
    def _program():
      plo = progb_ref[b, hsel, p, 0]
      phi = progb_ref[b, hsel, p, 1]

      def body(idx, k_smem, v_smem, k_used, v_used, carry):
        (step,) = idx
        j = plo + step
        acc, lse2, delta, qp, qs, flo, fhi = carry

        def dp_s(dp_acc, s_acc):
          plgpu.wgmma(dp_acc, do_smem, v_smem.T)
          plgpu.wgmma(s_acc, q_smem, k_smem.T)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(v_used)
          return dp_acc[...], s_acc[...]
        tile = plgpu.ACC((bq, bk), jnp.float32)
        dp, s = pl.run_scoped(dp_s, tile, tile)
        if not fold_scale:
          s = s * qk_scale
        kp, ks = _kv_cols(kvpos_ref, kvseg_ref, b, j * bk, bk, s.shape)
        # Tiles outside this warpgroup's own bounds (the other warpgroup's range) run masked: the
        # bounds come from the same positions / segment ids, so the mask hides every pair there.
        s = lax.cond((j < flo) | (j >= fhi),
                     lambda: _mask(s, qp, qs, kp, ks, window, s.shape), lambda: s)
        row = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
        p_ = jnp.exp2((s * qk_scale if fold_scale else s) - row(lse2))
        ds = p_ * (dp - row(delta))
        plgpu.wgmma(acc, ds.astype(dtype), k_smem)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(k_used)
        return carry

      plgpu.emit_pipeline_warp_specialized(
          body, grid=(phi - plo,), max_concurrent_steps=stages, num_compute_wgs=W,
          memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
          compute_context=compute,
          in_specs=[_spec((bk, H), dtype, lambda i: (plo + i, 0)),
                    _spec((bk, H), dtype, lambda i: (plo + i, 0))],
      )(k_ref.at[b, :, kh, :], v_ref.at[b, :, kh, :])

  args = [q_BCNH, k_BSKH, v_BSKH, do_BCNH, _lse2(lse_BNC), delta_BNC, wgb, progb, counts_BI,
          live_tiles(counts_BI, W * bq), qpos_BIC, _opt(qseg_BIC, (1, 1, 1)),
          _opt(kvpos_BS, (1, 1)), _opt(kvseg_BS, (1, 1))]
  out = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((B, C, N, H), dtype),
      **launch_grid(B, nprog, N, heads_fastest), num_threads=W + 1, thread_name="wg",
      scratch_types=[_swizzled((W, bq, H), dtype), _swizzled((W, bq, H), dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=W)],
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interp(interpret),
      kernel_name="compact_attention_dq_mgpu")(*args)
  if poison:
    out, _ = _poison_unwritten(out, jnp.zeros((B, N, C)), counts_BI, W * bq, I)
  return out


def dkv(q_BCNH, k_BSKH, v_BSKH, do_BCNH, lse_BNC, delta_BNC, qpos_BIC, qseg_BIC, kvpos_BS,
        kvseg_BS, boundsT_BIK4, *, scale, window, bs: BlockSizes, interpret=False, poison=False,
        compute_wgs=2):
  """(dk, dv) [B, S, K, H]: per program W kv tiles of block_k_dkv rows (one per compute
  warpgroup), over the G query heads of its kv head and the query tiles in the union of their
  bounds (boundsT per kv tile over query tiles)."""
  B, C, N, H = q_BCNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  G, I = N // K, qpos_BIC.shape[1]
  dtype = q_BCNH.dtype
  bq, bk = bs.block_q_dkv, bs.block_k_dkv
  nk = S // bk
  W = _bwd_wgs(nk, compute_wgs)
  nprog = nk // W
  stages = max(1, min(bs.num_stages_dkv, C // bq))
  has_seg, has_kvpos = qseg_BIC is not None, kvpos_BS is not None
  qk_scale = scale * LOG2E
  # The union of the program's W kv tiles' ranges and, per head, of the G heads' ranges (each
  # warpgroup and head masks its own).
  bt = boundsT_BIK4.reshape(B, K, G, nprog, W, 4) if I > 1 else boundsT_BIK4.reshape(
      B, 1, 1, nprog, W, 4)
  union = jnp.stack(range_union(bt, axis=(2, 4)), -1)                  # [B, K or 1, nprog, 2]

  def kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, bounds_ref, union_ref, qpos_ref,
             qseg_ref, kvpos_ref, kvseg_ref, dk_ref, dv_ref, k_smem2, v_smem2, bar2):
    qseg_ref = qseg_ref if has_seg else None
    kvseg_ref = kvseg_ref if has_seg else None
    kvpos_ref = kvpos_ref if has_kvpos else None
    kh = lax.axis_index("heads")
    b = lax.axis_index("batch")
    jp = lax.axis_index("kv")
    wg = lax.axis_index("wg")
    j = jp * W + wg  # this warpgroup's kv tile (meaningful in the compute warpgroups only)
    rows = pl.ds(j * bk, bk)
    usel = kh if I > 1 else 0
    ulo = union_ref[b, usel, jp, 0]
    uhi = union_ref[b, usel, jp, 1]
    k_smem, v_smem, bar = k_smem2.at[wg], v_smem2.at[wg], bar2.at[wg]

    def compute(pipeline_callback):
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem, bar)
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem, bar)
      plgpu.barrier_wait(bar)

      def run(dk_acc, dv_acc):
        pipeline_callback((dk_acc, dv_acc))
        return dk_acc[...], dv_acc[...]
      acc = plgpu.ACC((bk, H), jnp.float32)
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
      t, g = idx
      i = ulo + t
      h = kh * G + g
      hsel = h if I > 1 else 0
      lo, flo, fhi, hi = (bounds_ref[b, hsel, j, c] for c in range(4))
      dk_acc, dv_acc = carry

      def s_fn(acc):
        plgpu.wgmma(acc, k_smem, q_smem.T)
        plgpu.wgmma_wait(0)
        lse2 = plgpu.load(lse_smem, layout=_COL)
        delta = plgpu.load(delta_smem, layout=_COL)
        plgpu.barrier_arrive(lse_used)
        plgpu.barrier_arrive(delta_used)
        return acc[...], lse2, delta
      sT, lse2, delta = pl.run_scoped(s_fn, plgpu.ACC((bk, bq), jnp.float32))
      sT = sT * qk_scale
      qrows = pl.ds(i * bq, bq)

      def masked():
        qp = plgpu.load(qpos_ref.at[b, hsel, qrows], layout=_COL, optimized=False)
        qs = None if qseg_ref is None else plgpu.load(qseg_ref.at[b, hsel, qrows], layout=_COL,
                                                      optimized=False)
        col = lambda x: lax.broadcast_in_dim(x, sT.shape, [1])
        kp, ks = _kv_cols(kvpos_ref, kvseg_ref, b, j * bk, bk, sT.shape, transposed=True)
        vis = kp() <= col(qp)
        if window is not None:
          vis = vis & (col(qp) - kp() < window)
        if qs is not None:
          vis = vis & (col(qs) == ks())
        vis = vis & (i >= lo) & (i < hi)   # other heads' / the other warpgroup's tiles
        return jnp.where(vis, sT, NEG_INF)
      sT = lax.cond((i < flo) | (i >= fhi), masked, lambda: sT)
      col = lambda x: lax.broadcast_in_dim(x, sT.shape, [1])
      pT = jnp.exp2(sT - col(lse2))

      def dp_fn(acc):
        plgpu.wgmma(acc, v_smem, do_smem.T)
        plgpu.wgmma(dv_acc, pT.astype(dtype), do_smem)
        return plgpu.wgmma_accumulator_load(acc, wait_n=1)
      dpT = pl.run_scoped(dp_fn, plgpu.ACC((bk, bq), jnp.float32))
      dsT = pT * (dpT - col(delta))
      plgpu.wgmma(dk_acc, dsT.astype(dtype), q_smem)
      plgpu.wgmma_wait(1)
      plgpu.barrier_arrive(do_used)
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(q_used)
      return carry

    hmap = lambda g: kh * G + g
    plgpu.emit_pipeline_warp_specialized(
        body, grid=(uhi - ulo, G), max_concurrent_steps=stages, num_compute_wgs=W,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True, compute_context=compute,
        in_specs=[_spec((bq, None, H), dtype, lambda t, g: (ulo + t, hmap(g), 0)),
                  _spec((bq, None, H), dtype, lambda t, g: (ulo + t, hmap(g), 0)),
                  plgpu.BlockSpec((None, bq), lambda t, g: (hmap(g), ulo + t)),
                  plgpu.BlockSpec((None, bq), lambda t, g: (hmap(g), ulo + t))],
    )(q_ref.at[b], do_ref.at[b], lse2_ref.at[b], delta_ref.at[b])

  args = [q_BCNH, k_BSKH, v_BSKH, do_BCNH, _lse2(lse_BNC), delta_BNC, boundsT_BIK4, union,
          qpos_BIC, _opt(qseg_BIC, (1, 1, 1)), _opt(kvpos_BS, (1, 1)), _opt(kvseg_BS, (1, 1))]
  kv_t = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  return plgpu.kernel(
      kernel, out_type=(kv_t, kv_t), grid=(K, nprog, B), grid_names=("heads", "kv", "batch"),
      num_threads=W + 1, thread_name="wg",
      scratch_types=[_swizzled((W, bk, H), dtype), _swizzled((W, bk, H), dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=W)],
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=_interp(interpret),
      kernel_name="compact_attention_dkv_mgpu")(*args)
