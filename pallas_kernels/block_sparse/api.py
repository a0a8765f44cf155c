"""block_sparse_attention: flash attention over per-(batch, head, query-block) kv block lists, with
a per-head mode, so a layer's mixed heads (full / streaming sink+local / block-sparse) run in ONE
launch.

    out_BTNH = block_sparse_attention(q_BTNH, k_BSKH, v_BSKH, kv_blocks_BNQL, head_mode_BN,
                                      block_q=128, block_k=128, window=..., sinks=...)
    out_BTNH, lse_BTN = block_sparse_attention(..., return_lse=True)

The mask is pallas_kernels.compact_attention.reference.dense_mask's (the one mask builder; the
reference path is its reference_attention): query t of row b, head n sees key slot s iff
kv_pos <= q_pos, same document, inside the window or a sink key, t active, and (head n in mode
HEAD_BLOCKS) s's block is listed for t's block. A HEAD_FULL head ignores its list and visits every
kv tile it can see (the causal / document / window range of its query tile).

The kernels' tiles are the lists' blocks (block_q x block_k; any T, S: inputs are padded to whole
blocks, padding invisible); they visit only the listed tiles
(duplicates, padding -1 and tiles no pair can see are dropped by tables.py, so the list length L
bounds the work) and apply the element mask inside a tile. Backward: custom_vjp saving the lse;
dq over the same tables, dk/dv per kv tile over the transposed tables (every query head of the kv
head: native GQA).

impl: 'auto' (Hopper GPUs: Mosaic GPU; other GPUs: Triton; TPU: Mosaic; elsewhere the jnp
reference), 'reference', 'triton', 'mosaic_gpu', 'mosaic_tpu'. A kernel that cannot take a call
raises ValueError when asked for by name; under 'auto' it warns once (BlockSparseFallbackWarning)
and uses the reference (on Hopper 'auto' never falls back to the Triton kernel).

Head modes: HEAD_FULL (0), HEAD_BLOCKS (1), and HEAD_WINDOW_BLOCKS (2, tables.py): the head sees
the window (and sinks) OR its listed blocks whole (MATCH's "window OR retrieved chunks", segmented
prefixes), under causality, documents and the active set. Mode 2 runs on 'reference' and
'mosaic_gpu'; the Triton / Mosaic TPU kernels reject it (ValueError for concrete modes, NaN
outputs for the heads of a traced mode 2).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compact_attention.reference import (HEAD_BLOCKS, HEAD_FULL, check_qkv,
                                                        dense_mask, reference_attention)

from pallas_kernels.flash_tiles import TRITON_SMEM_BYTES

from . import tables
from .tables import HEAD_WINDOW_BLOCKS

IMPLS = ("auto", "reference", "triton", "mosaic_gpu", "mosaic_tpu")
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

__all__ = ["BACKENDS", "BlockSparseBackend", "BlockSparseConfig", "HEAD_BLOCKS", "HEAD_FULL",
           "HEAD_WINDOW_BLOCKS", "IMPLS", "BlockSparseFallbackWarning", "block_sparse_attention", "kernel_support"]


class BlockSparseFallbackWarning(UserWarning):
  pass


@functools.cache
def _warn_once(msg: str) -> None:
  warnings.warn(msg, BlockSparseFallbackWarning, stacklevel=3)


def _platform() -> str:
  """The host platform 'auto' resolves for (condattn_jax.ops resolves per lowering platform and
  names the kernel explicitly; tests swap this to resolve for another platform)."""
  return jax.default_backend()


def _is_hopper() -> bool:
  """Whether the default device is a Hopper GPU (tests swap it to resolve for an abstract H100)."""
  try:
    from pallas_kernels.backends import HOPPER_DEVICE_KINDS
  except ImportError:   # the backends interface not there yet
    HOPPER_DEVICE_KINDS = ("NVIDIA H100", "NVIDIA H200", "NVIDIA H800", "NVIDIA GH200")
  try:
    return (jax.default_backend() == "gpu"
            and jax.devices()[0].device_kind.startswith(HOPPER_DEVICE_KINDS))
  except RuntimeError:
    return False


def _backend_module(name: str):
  if name == "triton":
    from . import triton as mod
  elif name == "mosaic_gpu":
    from . import mosaic_gpu as mod
  else:
    from . import mosaic_tpu as mod
  return mod


# Backward sub-tiles (Triton): dq walks kv blocks in sub-tiles of this many keys, a dk/dv
# program owns this many keys and walks query blocks in sub-tiles of this many rows (the
# compacted kernel's H200-tuned backward tiles: dq 128 x 64, dk/dv 64 x 64; a 128 x 128 dk/dv
# tile keeps two 128 x H float32 accumulators live and spills).
TRITON_SUB_TILE = 64
# Forward (Triton): kv tiles are walked in sub-tiles of this many keys (bench/block_sparse.py
# --fwd_sub_tile times the choices against cuDNN in one process).
TRITON_FWD_SUB_TILE = 128


def triton_launch(block_q: int, block_k: int, H: int, itemsize: int, sub: int,
                  fwd_sub: int = TRITON_FWD_SUB_TILE) -> dict:
  """num_warps / num_stages / sub-tiles per kernel; three pipeline stages where the shared
  memory allows (else two, else one)."""
  def stages(per_stage, fixed):
    for n in (3, 2):
      if (n * per_stage + fixed) * H * itemsize <= TRITON_SMEM_BYTES:
        return n
    return 1
  sq, sk, sf = min(block_q, sub), min(block_k, sub), min(block_k, fwd_sub)
  warps = lambda a, b: 8 if a * b >= 128 * 64 else 4
  return dict(fwd=dict(num_warps=warps(block_q, sf), num_stages=stages(2 * sf, block_q),
                       sub_k=sf),
              dq=dict(num_warps=warps(block_q, sk), num_stages=stages(2 * sk, 2 * block_q),
                      sub_k=sk),
              dkv=dict(num_warps=warps(sq, sk), num_stages=min(2, stages(2 * sq, 2 * sk)),
                       sub_q=sq, sub_k=sk))


def kernel_support(impl: str, q_shape, kv_shape, dtype, block_q: int, block_k: int) -> str | None:
  """None if kernel `impl` takes the shape, else the reason it cannot."""
  T, H, S = q_shape[1], q_shape[-1], kv_shape[1]
  if jnp.dtype(dtype) not in _FLOAT_DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (supported: bfloat16, float16, float32)"
  del T, S  # any lengths: the wrapper pads to whole blocks (padding is invisible)
  if impl == "triton":
    if H & (H - 1) or not 16 <= H <= 256:
      return f"head_dim {H} (Triton kernel needs a power of two in [16, 256])"
    if any(b < 16 or b & (b - 1) for b in (block_q, block_k)):
      return f"block_q {block_q} / block_k {block_k} (Triton kernel needs powers of two >= 16)"
    if (2 * block_k + block_q) * H * jnp.dtype(dtype).itemsize > TRITON_SMEM_BYTES:
      return f"block_q {block_q} / block_k {block_k} at head_dim {H} exceed shared memory"
    return None
  if impl == "mosaic_gpu":
    from . import mosaic_gpu
    return mosaic_gpu.support(block_q, block_k, H, dtype)
  if impl == "mosaic_tpu":
    if H % 128 and H != 64:
      return f"head_dim {H} (Mosaic kernel needs 64 or a multiple of 128)"
    if block_q % 128 or block_k % 128:
      return f"block_q {block_q} / block_k {block_k} (Mosaic kernel needs multiples of 128)"
    return None
  raise ValueError(impl)


@dataclasses.dataclass(frozen=True)
class BlockSparseConfig:
  """Kernel variants of block_sparse_attention (static: another config is another program;
  condattn_jax.ops runs the defaults). No variant today: a field comes with a candidate of the
  kernels' pre-registered A/B (bench/block_sparse.py --ab, AB_VARIANTS) and stays only if it is
  adopted; the removed ones are listed in this package's README."""


@dataclasses.dataclass(frozen=True)
class BlockSparseBackend:
  """One block-sparse kernel as a backend (the pallas_kernels.backends interface): `name` (the
  impl), `lowers_for` (lowering platforms), `needs_hopper`, `config` (a BlockSparseConfig or
  None: the defaults). supports(...) is None where the kernel takes the call lowered for
  `platform`, else why not; calling it runs block_sparse_attention with impl=name and config."""
  name: str
  lowers_for: tuple[str, ...] = ()
  needs_hopper: bool = False
  config: Any = None
  not_on_hopper: bool = False   # Pallas-Triton: deprecated; Hopper resolves to Mosaic GPU only

  def supports(self, q_shape, kv_shape, dtype, platform, *, block_q, block_k,
               window_blocks: bool = False) -> str | None:
    """window_blocks: the head modes may hold HEAD_WINDOW_BLOCKS (only 'mosaic_gpu' and the
    reference run it)."""
    if self.name == "reference":
      return None
    from pallas_kernels.backends import platform_reason
    why = platform_reason(self.name, self.lowers_for, platform, self.needs_hopper)
    if why is None and self.not_on_hopper and platform.is_hopper:
      why = (f"the {self.name} kernel is not resolved on Hopper ({platform.device_kind}): the "
             "Mosaic GPU kernel is that platform's (impl='triton' on the package still runs it)")
    if why is None and window_blocks and self.name != "mosaic_gpu":
      why = (f"head mode HEAD_WINDOW_BLOCKS (2): the {self.name} kernel does not run it (only "
             "mosaic_gpu and the reference do)")
    return why or kernel_support(self.name, q_shape, kv_shape, dtype, block_q, block_k)

  def __call__(self, q_BTNH, k_BSKH, v_BSKH, kv_blocks_BNQL, head_mode_BN=None, **kw):
    kw.setdefault("config", self.config)
    return block_sparse_attention(q_BTNH, k_BSKH, v_BSKH, kv_blocks_BNQL, head_mode_BN,
                                  impl=self.name, **kw)


# Preference order (condattn_jax.ops.resolve takes the first that supports a call): Hopper: Mosaic
# GPU; other CUDA / ROCm GPUs: Triton; TPU: Mosaic TPU; anything else: the reference.
BACKENDS = (BlockSparseBackend("mosaic_gpu", ("cuda",), needs_hopper=True,
                               config=BlockSparseConfig()),
            BlockSparseBackend("triton", ("cuda", "rocm"), not_on_hopper=True),
            BlockSparseBackend("mosaic_tpu", ("tpu",)),
            BlockSparseBackend("reference"))


def _resolve_impl(impl, interpret, q_shape, kv_shape, dtype, block_q, block_k):
  if impl not in IMPLS:
    raise ValueError(f"block_sparse_attention: unknown impl {impl!r}; choose one of {IMPLS}")
  explicit = impl != "auto"
  if impl == "auto":  # BACKENDS' order for the host device (Hopper: never Pallas-Triton)
    from pallas_kernels.backends import Platform, platform_reason
    host = {"gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}.get(_platform(), "cpu")
    plat = Platform(host, "NVIDIA H100" if host == "cuda" and _is_hopper() else "")
    impl = next(be.name for be in BACKENDS if be.name == "reference" or (platform_reason(
        be.name, be.lowers_for, plat, be.needs_hopper) is None and not (
            be.not_on_hopper and plat.is_hopper)))
  if impl == "reference":
    return impl
  reason = kernel_support(impl, q_shape, kv_shape, dtype, block_q, block_k)
  if reason is not None:
    msg = (f"block_sparse_attention: the {impl} kernel cannot take this call: {reason}. "
           "Use impl='reference' (or other block sizes).")
    if explicit:
      raise ValueError(msg)
    _warn_once(msg + " Falling back to the jnp reference.")
    return "reference"
  return impl


@dataclasses.dataclass(frozen=True)
class _Config:
  backend: str
  scale: float
  window: int | None
  sinks: int
  block_q: int
  block_k: int
  interpret: Any
  poison: bool
  sub_tile: int = TRITON_SUB_TILE
  fwd_sub_tile: int = TRITON_FWD_SUB_TILE


@dataclasses.dataclass(frozen=True)
class _Meta:
  """Kernel-ready mask metadata (a pytree of arrays; None where absent)."""
  kv_blocks_BNQL: Any
  mode_BN: Any      # int32 head modes (HEAD_FULL / HEAD_BLOCKS / HEAD_WINDOW_BLOCKS)
  full_BN: Any
  qpos_BT: Any
  kvpos_BS: Any
  bseg_q_BT: Any    # ids for the tile bounds (None: no documents)
  bseg_kv_BS: Any
  kseg_q_BIT: Any   # ids for the element mask: -1 never matches (inactive / padding queries)
  kseg_kv_BS: Any
  valid_BIT: Any


jax.tree_util.register_dataclass(
    _Meta, data_fields=[f.name for f in dataclasses.fields(_Meta)], meta_fields=[])


def _normalise(B, T, S, N, kv_blocks, head_mode, qpos, kvpos, qseg, kvseg, active) -> _Meta:
  mode_BN = (jnp.full((B, N), HEAD_BLOCKS, jnp.int32) if head_mode is None
             else jnp.asarray(head_mode, jnp.int32))
  full_BN = (mode_BN == HEAD_FULL).astype(jnp.int32)
  if kvseg is None:
    bq_, bkv = None, None
  elif qseg is None:  # a cache's validity: the query chunk is one document
    bkv = (kvseg != 0).astype(jnp.int32)
    bq_ = jnp.ones((B, T), jnp.int32)
  else:
    bq_, bkv = qseg, kvseg
  if active is None:
    valid = jnp.ones((B, 1, T), bool)
  else:
    valid = active[:, None, :] if active.ndim == 2 else jnp.swapaxes(active, 1, 2)
  if bq_ is None and active is None:
    kq, kkv = None, None
  else:
    base = jnp.zeros((B, T), jnp.int32) if bq_ is None else jnp.where(bq_ == 0, -1, bq_)
    kkv = jnp.zeros((B, S), jnp.int32) if bkv is None else bkv
    kq = base[:, None, :] if active is None else jnp.where(valid, base[:, None, :], -1)
  return _Meta(jnp.asarray(kv_blocks, jnp.int32), mode_BN, full_BN, qpos, kvpos, bq_, bkv, kq, kkv, valid)


def _visibility(cfg: _Config, m: _Meta):
  return tables.tile_visibility(m.qpos_BT, m.kvpos_BS, m.bseg_q_BT, m.bseg_kv_BS, m.valid_BIT,
                                window=cfg.window, sinks=cfg.sinks, block_q=cfg.block_q,
                                block_k=cfg.block_k)


def _launch(cfg: _Config, H: int, itemsize: int, kernel: str) -> dict:
  kw = dict(scale=cfg.scale, window=cfg.window, sinks=cfg.sinks, block_q=cfg.block_q,
            block_k=cfg.block_k, interpret=cfg.interpret, poison=cfg.poison)
  if cfg.backend == "triton":
    kw.update(triton_launch(cfg.block_q, cfg.block_k, H, itemsize, cfg.sub_tile,
                            cfg.fwd_sub_tile)[kernel])
  return kw


def _mgpu_tables(cfg: _Config, m: _Meta):
  """(steps_BNQX, count_BNQ) of the Mosaic GPU kernels (tables.step_tables)."""
  vis_w, full_w = _visibility(cfg, m)
  if cfg.window is None:
    vis_c, full_c = vis_w, full_w
  else:
    vis_c, full_c = _visibility(dataclasses.replace(cfg, window=None, sinks=0), m)
  return tables.step_tables(m.kv_blocks_BNQL, m.mode_BN, vis_w, full_w, vis_c, full_c)


def _mgpu_kw(cfg: _Config) -> dict:
  return dict(scale=cfg.scale, window=cfg.window, sinks=cfg.sinks, block_q=cfg.block_q,
              block_k=cfg.block_k, interpret=cfg.interpret)


def _forward_impl(cfg: _Config, q, k, v, m: _Meta):
  mod = _backend_module(cfg.backend)
  if cfg.backend == "mosaic_gpu":
    steps, count = _mgpu_tables(cfg, m)
    return mod.fwd(q, k, v, steps, count, m.qpos_BT, m.kseg_q_BIT, m.kvpos_BS, m.kseg_kv_BS,
                   **_mgpu_kw(cfg))
  vis, full = _visibility(cfg, m)
  bounds, lst = tables.forward_tables(m.kv_blocks_BNQL, m.full_BN, vis, full)
  return mod.fwd(q, k, v, m.full_BN, bounds, lst, m.qpos_BT, m.kseg_q_BIT, m.kvpos_BS,
                 m.kseg_kv_BS, **_launch(cfg, q.shape[-1], q.dtype.itemsize, "fwd"))


def _backward_impl(cfg: _Config, res, dout, dlse_BNT):
  q, k, v, m, out, lse_BNT = res
  mod = _backend_module(cfg.backend)
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)     # [B, T, N]
  delta = jnp.swapaxes(delta, 1, 2) - jnp.where(jnp.isfinite(lse_BNT), dlse_BNT, 0.0)
  if cfg.backend == "mosaic_gpu":
    steps, count = _mgpu_tables(cfg, m)
    tsteps, tcount = tables.transposed_step_tables(steps, count, k.shape[2])
    meta = (m.qpos_BT, m.kseg_q_BIT, m.kvpos_BS, m.kseg_kv_BS)
    dq = mod.dq(q, k, v, dout, lse_BNT, delta, steps, count, *meta, **_mgpu_kw(cfg))
    dk, dv = mod.dkv(q, k, v, dout, lse_BNT, delta, tsteps, tcount, *meta, **_mgpu_kw(cfg))
    return dq, dk, dv
  vis, full = _visibility(cfg, m)
  full_BN = m.full_BN
  bounds, lst = tables.forward_tables(m.kv_blocks_BNQL, full_BN, vis, full)
  boundsT, lstT = tables.transposed_tables(full_BN, bounds, lst, vis, full)
  H, isz = q.shape[-1], q.dtype.itemsize
  meta = (m.qpos_BT, m.kseg_q_BIT, m.kvpos_BS, m.kseg_kv_BS)
  dq = mod.dq(q, k, v, dout, lse_BNT, delta, full_BN, bounds, lst, *meta,
              **_launch(cfg, H, isz, "dq"))
  dk, dv = mod.dkv(q, k, v, dout, lse_BNT, delta, full_BN, boundsT, lstT, *meta,
                   **_launch(cfg, H, isz, "dkv"))
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(cfg, q, k, v, m):
  return _forward_impl(cfg, q, k, v, m)


def _kernel_attention_fwd(cfg, q, k, v, m):
  out, lse = _forward_impl(cfg, q, k, v, m)
  return (out, lse), (q, k, v, m, out, lse)


def _kernel_attention_bwd(cfg, res, cts):
  dout, dlse = cts
  dq, dk, dv = _backward_impl(cfg, res, dout, dlse)
  m = res[3]
  return dq, dk, dv, jax.tree.map(lambda _: None, m)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)
_kernel_attention_jit = jax.jit(_kernel_attention, static_argnums=(0,))


_PAD_KV_POS = 2 ** 30  # after every query position: a padding key is never visible


def _pad_to_blocks(T, S, Tp, Sp, q, k, v, qpos, kvpos, qseg, kvseg, act):
  """Pads queries to Tp rows (inactive) and keys to Sp slots (at a position no query reaches,
  document 0)."""
  B = q.shape[0]
  rows = lambda x, n, fill: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2),
                                    constant_values=fill)
  q = rows(q, Tp - T, 0)
  k, v = rows(k, Sp - S, 0), rows(v, Sp - S, 0)
  qpos, kvpos = rows(qpos, Tp - T, 0), rows(kvpos, Sp - S, _PAD_KV_POS)
  qseg = None if qseg is None else rows(qseg, Tp - T, 0)
  kvseg = None if kvseg is None else rows(kvseg, Sp - S, 0)
  act = jnp.ones((B, T), bool) if act is None else act
  return q, k, v, qpos, kvpos, qseg, kvseg, rows(act, Tp - T, False)


def block_sparse_attention(q_BTNH, k_BSKH, v_BSKH, kv_blocks_BNQL, head_mode_BN=None, *,
                           block_q: int = 128, block_k: int = 128, q_positions_BT=None,
                           kv_positions_BS=None, q_segment_ids_BT=None, kv_segment_ids_BS=None,
                           window: int | None = None, sinks: int = 0, active=None,
                           scale: float | None = None, impl: str = "auto", interpret: Any = False,
                           return_lse: bool = False, poison: bool = False,
                           config: BlockSparseConfig | None = None):
  """Block-sparse attention; the mask contract is reference.dense_mask's (module docstring).

  Args:
    q_BTNH: [B, T, N, H]; k_BSKH, v_BSKH: [B, S, K, H], N % K == 0 (GQA, K/V not repeated).
    kv_blocks_BNQL: int [B, N, T // block_q, L]: kv blocks (key slots [j * block_k, ...)) query
      block i of head n may see; entries outside [0, S // block_k) are padding (use -1);
      duplicates are harmless.
    head_mode_BN: None (every head uses its list) or int [B, N]: HEAD_FULL (0) ignores its list,
      HEAD_BLOCKS (1) sees only its listed blocks, HEAD_WINDOW_BLOCKS (2) sees the window (and
      sinks) or its listed blocks whole ('reference' and 'mosaic_gpu' only).
    block_q, block_k: the lists' block sizes (= the kernels' tiles; T and S need not be
      multiples: the kernels run on inputs padded to whole blocks, padding invisible).
    q_positions_BT: default arange(T) + S - T (the queries are the last T keys);
      kv_positions_BS: default arange(S).
    q_segment_ids_BT, kv_segment_ids_BS: documents (0 = padding, never attended); kv ids alone
      mark a cache's valid slots (the query chunk is one document).
    window, sinks: keys q_pos - window < kv_pos <= q_pos, plus keys with kv_pos < sinks.
    active: None, bool [B, T] or [B, T, N]: inactive queries give zeros.
    scale: logits scale (default H ** -0.5).
    impl: 'auto' | 'reference' | 'triton' | 'mosaic_gpu' | 'mosaic_tpu'; interpret: Pallas
      interpret mode (True for Triton and Mosaic GPU, pltpu.InterpretParams() for Mosaic TPU) to
      run a kernel on CPU.
    return_lse: also return the log-sum-exp [B, T, N] float32 (-inf where nothing is visible);
      differentiable too.
    poison: testing aid: kernel outputs start as NaN, so an element never written shows up (the
      Mosaic GPU kernels write every row and take no aliased buffer: ignored there).
    config: BlockSparseConfig (kernel variants; default BlockSparseConfig()).

  Returns:
    out [B, T, N, H] in q's dtype (queries that see nothing: zeros), and lse if return_lse.
  """
  q, k, v = (jnp.asarray(x) for x in (q_BTNH, k_BSKH, v_BSKH))
  check_qkv(q, k, v)
  B, T, N, H = q.shape
  S = k.shape[1]
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  for name, b in (("block_q", block_q), ("block_k", block_k)):
    if int(b) != b or b < 1:
      raise ValueError(f"{name} must be an int >= 1, got {b!r}")
  nq = -(-T // block_q)
  kv_blocks = jnp.asarray(kv_blocks_BNQL)
  if (kv_blocks.ndim != 4 or kv_blocks.shape[:3] != (B, N, nq)
      or not jnp.issubdtype(kv_blocks.dtype, jnp.integer)):
    raise ValueError(f"kv_blocks_BNQL must be int [B, N, ceil(T / block_q), L] = [{B}, {N}, {nq}, "
                     f"L]; got {kv_blocks.dtype} {kv_blocks.shape}")
  if kv_blocks.shape[3] == 0:
    kv_blocks = jnp.full((B, N, nq, 1), -1, jnp.int32)
  mode = None if head_mode_BN is None else jnp.asarray(head_mode_BN, jnp.int32)
  if mode is not None and mode.shape != (B, N):
    raise ValueError(f"head_mode_BN must be [B, N] = {(B, N)}; got {mode.shape}")
  if window is not None and (int(window) != window or window < 1):
    raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
  if int(sinks) != sinks or sinks < 0:
    raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
  if q_segment_ids_BT is not None and kv_segment_ids_BS is None:
    raise ValueError("q_segment_ids_BT without kv_segment_ids_BS: give kv ids too (kv ids alone "
                     "mark a cache's valid slots)")
  qpos = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (S - T), (B, T))
          if q_positions_BT is None else jnp.asarray(q_positions_BT, jnp.int32))
  kvpos = (jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
           if kv_positions_BS is None else jnp.asarray(kv_positions_BS, jnp.int32))
  qseg = None if q_segment_ids_BT is None else jnp.asarray(q_segment_ids_BT, jnp.int32)
  kvseg = None if kv_segment_ids_BS is None else jnp.asarray(kv_segment_ids_BS, jnp.int32)
  act = None if active is None else jnp.asarray(active)
  for name, x, shp in (("q_positions_BT", qpos, (B, T)), ("kv_positions_BS", kvpos, (B, S)),
                       ("q_segment_ids_BT", qseg, (B, T)), ("kv_segment_ids_BS", kvseg, (B, S))):
    if x is not None and x.shape != shp:
      raise ValueError(f"{name} must have shape {shp}, got {x.shape}")
  if act is not None and (act.dtype != jnp.bool_ or act.shape not in ((B, T), (B, T, N))):
    raise ValueError(f"active must be bool [B, T]={(B, T)} or [B, T, N]={(B, T, N)}; got "
                     f"{act.dtype} {act.shape}")
  scale = float(H ** -0.5 if scale is None else scale)
  config = BlockSparseConfig() if config is None else config
  if not isinstance(config, BlockSparseConfig):
    raise ValueError(f"block_sparse_attention: config must be a BlockSparseConfig, got "
                     f"{type(config).__name__}")

  impl = _resolve_impl(impl, interpret, q.shape, k.shape, q.dtype, block_q, block_k)
  mode2 = None
  if mode is not None and impl in ("triton", "mosaic_tpu"):
    if not isinstance(mode, jax.core.Tracer) and np.any(np.asarray(mode) == HEAD_WINDOW_BLOCKS):
      raise ValueError(f"block_sparse_attention: head_mode_BN holds HEAD_WINDOW_BLOCKS (2), which "
                       f"the {impl} kernel does not run; use impl='mosaic_gpu' (Hopper) or "
                       "impl='reference'")
    mode2 = mode == HEAD_WINDOW_BLOCKS    # traced: those heads' outputs become NaN (below)
  if impl == "reference":
    mask = reference_mask(qpos, kvpos, qseg, kvseg, window=window, sinks=sinks, active=act,
                          kv_blocks_BNQL=kv_blocks, head_mode_BN=mode, block_q=block_q,
                          block_k=block_k)
    out, lse = reference_attention(q, k, v, mask, scale=scale)
  else:
    cfg = _Config(backend=impl, scale=scale, window=None if window is None else int(window),
                  sinks=int(sinks), block_q=int(block_q), block_k=int(block_k),
                  interpret=interpret, poison=poison, sub_tile=TRITON_SUB_TILE,
                  fwd_sub_tile=TRITON_FWD_SUB_TILE)
    Tp, Sp = nq * block_q, -(-S // block_k) * block_k
    if (Tp, Sp) != (T, S):  # whole blocks: padding queries inactive, padding keys invisible
      q, k, v, qpos, kvpos, qseg, kvseg, act = _pad_to_blocks(
          T, S, Tp, Sp, q, k, v, qpos, kvpos, qseg, kvseg, act)
    meta = _normalise(B, Tp, Sp, N, kv_blocks, mode, qpos, kvpos, qseg, kvseg, act)
    out, lse_BNT = _kernel_attention_jit(cfg, q, k, v, meta)
    out, lse = out[:, :T], jnp.swapaxes(lse_BNT, 1, 2)[:, :T]
    if mode2 is not None:
      out = jnp.where(mode2[:, None, :, None], jnp.nan, out).astype(out.dtype)
      lse = jnp.where(mode2[:, None, :], jnp.nan, lse)
  return (out, lse) if return_lse else out


def reference_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT=None, kv_segment_ids_BS=None,
                   *, window=None, sinks=0, active=None, kv_blocks_BNQL=None, head_mode_BN=None,
                   block_q=None, block_k=None):
  """reference.dense_mask with the head mode HEAD_WINDOW_BLOCKS too: such a head sees the pairs
  dense_mask gives a HEAD_FULL head (window and sinks included) OR those it gives a HEAD_BLOCKS
  head without the window. Other modes: dense_mask itself. bool [B, N, T, S] with lists."""
  kw = dict(active=active, kv_blocks_BNQL=kv_blocks_BNQL, block_q=block_q, block_k=block_k)
  if head_mode_BN is None or kv_blocks_BNQL is None:
    return dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                      window=window, sinks=sinks, head_mode_BN=head_mode_BN, **kw)
  mode = jnp.asarray(head_mode_BN)
  wb = mode == HEAD_WINDOW_BLOCKS
  base = dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                    window=window, sinks=sinks, head_mode_BN=jnp.where(wb, HEAD_FULL, mode), **kw)
  listed = dense_mask(q_positions_BT, kv_positions_BS, q_segment_ids_BT, kv_segment_ids_BS,
                      head_mode_BN=jnp.full_like(mode, HEAD_BLOCKS), **kw)
  return base | (wb[:, :, None, None] & listed)
