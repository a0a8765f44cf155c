"""Tile configuration shared by the kernel backends."""
from __future__ import annotations

import dataclasses
import math

from pallas_kernels.flash_tiles import TRITON_SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the three kernels (queries x keys) and Triton launch parameters.

  The compacted query buffer is padded to a multiple of every block_q*, and the kv length must be
  a multiple of every block_k* (smaller power-of-two tiles are tried before giving up).
  num_warps / num_stages apply to the Triton backend only.
  """
  block_q: int = 128
  block_k: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  num_warps: int = 8
  num_stages: int = 3
  num_warps_dq: int = 8
  num_stages_dq: int = 3
  num_warps_dkv: int = 4
  num_stages_dkv: int = 2
  # Tiles for small compacted buffers (capacity <= small_below * T): fewer, longer programs
  # balance worse, so smaller tiles win there (bench/compact_attention.py --sweep).
  small: "BlockSizes | None" = None
  small_below: float = 0.25

  @property
  def q_multiple(self) -> int:
    m = math.lcm(self.block_q, self.block_q_dq, self.block_q_dkv)
    return m if self.small is None else math.lcm(m, self.small.q_multiple)

  def for_capacity(self, C: int, T: int) -> "BlockSizes":
    if self.small is not None and C <= self.small_below * T:
      return self.small
    return self

  def with_(self, **kw) -> "BlockSizes":
    return dataclasses.replace(self, **kw)

  def fit_kv(self, S: int, min_block: int) -> "BlockSizes | None":
    """Shrink the kv tiles (powers of two, down to min_block) until they divide S."""
    out = {}
    if self.small is not None:
      out["small"] = self.small.fit_kv(S, min_block)
      if out["small"] is None:
        return None
    for name in ("block_k", "block_k_dq", "block_k_dkv"):
      b = min(getattr(self, name), _pow2_floor(S))
      while b >= min_block and S % b:
        b //= 2
      if b < min_block:
        return None
      out[name] = b
    return dataclasses.replace(self, **out)


def _pow2_floor(x: int) -> int:
  return 1 << (max(x, 1).bit_length() - 1)


# Chosen on an H200 by bench/compact_attention.py --sweep (docs/performance.md).
GPU_BLOCK_SIZES = BlockSizes()
# float32 tiles take twice the shared memory.
GPU_BLOCK_SIZES_F32 = BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2,
                                 block_q_dq=64, block_k_dq=64, num_warps_dq=4, num_stages_dq=2,
                                 block_q_dkv=64, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=2)


def triton_smem_estimate(bs: BlockSizes, H: int, itemsize: int) -> int:
  """Largest shared-memory need of the three kernels: the pipelined K/V (or Q/dO) tiles times
  num_stages, plus the tiles held for the whole loop."""
  fwd = (bs.num_stages * 2 * bs.block_k + bs.block_q) * H * itemsize
  dq = (bs.num_stages_dq * 2 * bs.block_k_dq + 2 * bs.block_q_dq) * H * itemsize
  dkv = (bs.num_stages_dkv * 2 * bs.block_q_dkv + 2 * bs.block_k_dkv) * H * itemsize
  worst = max(fwd, dq, dkv)
  return worst if bs.small is None else max(worst, triton_smem_estimate(bs.small, H, itemsize))


def fit_triton_smem(bs: BlockSizes, H: int, itemsize: int) -> BlockSizes | None:
  """Fewer pipeline stages, then smaller tiles, until the estimate fits (None if nothing does)."""
  for _ in range(12):
    if triton_smem_estimate(bs, H, itemsize) <= TRITON_SMEM_BYTES:
      return bs
    if max(bs.num_stages, bs.num_stages_dq, bs.num_stages_dkv) > 2:
      bs = bs.with_(num_stages=min(bs.num_stages, 2), num_stages_dq=min(bs.num_stages_dq, 2),
                    num_stages_dkv=min(bs.num_stages_dkv, 2))
      continue
    halve = lambda b: max(16, b // 2)
    if min(bs.block_q, bs.block_k, bs.block_q_dq, bs.block_k_dq, bs.block_q_dkv,
           bs.block_k_dkv) <= 16:
      return None
    bs = bs.with_(block_q=halve(bs.block_q), block_k=halve(bs.block_k),
                  block_q_dq=halve(bs.block_q_dq), block_k_dq=halve(bs.block_k_dq),
                  block_q_dkv=halve(bs.block_q_dkv), block_k_dkv=halve(bs.block_k_dkv),
                  num_warps=4, num_warps_dq=4, num_warps_dkv=4)
  return None


# Mosaic GPU (Hopper): block_q = the rows of one program = 2 compute warpgroups x 64; block_q_dq /
# block_k_dkv = the rows of one backward compute warpgroup (two per program); num_stages* = TMA
# pipeline depth. Chosen on an H100 by bench/compact_attention.py --sweep_only --sweep_kernels mgpu
# (the measurements: docs/performance.md).
MGPU_BLOCK_SIZES = BlockSizes(block_q=128, block_k=128, block_q_dq=64, block_k_dq=128,
                              block_q_dkv=64, block_k_dkv=64, num_stages=2, num_stages_dq=2,
                              num_stages_dkv=2)

TPU_BLOCK_SIZES = BlockSizes(block_q=256, block_k=512, block_q_dq=256, block_k_dq=512,
                             block_q_dkv=256, block_k_dkv=512)
