"""decode: attention of a few query tokens per row over a KV cache, kv split into parts.

    out_BTNH = decode_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT=qpos,
                                kv_positions_BS=kvpos, kv_lengths_B=fill, impl="mosaic_gpu")

What a call sees is `reference.decode_mask`: row b's slots < kv_lengths_B[b] (its fill; or every
slot with kv_valid_BS != 0), causal on positions, optionally a window (q_pos - kv_pos < window)
with `sinks` (kv_pos < sinks stays visible), and an active set: bool [B, T] (per row: an L2A row
routed local) or [B, T, N] (per query head: AHA); inactive queries give zeros. With a fill, one
query per row and no window / kv_valid, the caller promises (condattn_jax.ops.MaskSpec's
kv_lengths_B contract) that every slot below the fill holds a position <= the query's: the
kernels then read no positions (a dense or ring decode reads K / V and nothing else).

The plan the kernels share (`plan`):
- GQA folded into the query rows: the G = N / K query heads of kv head k and the T query tokens
  become R = T * G rows (row t * G + g) of one program, so each K/V tile is read once per
  (row, kv head), never once per query head.
- Reads skipped per (row, kv head): the kv tiles (block_k slots) a program reads are two runs,
  sink tiles [0, sink_end) and window tiles [win_lo, win_hi), from per-tile position bounds:
  without a window, the tiles up to the row's fill (one run); with one, only the tiles that hold
  a key inside some query's window (a full cache read by an AHA head routed local, Elastic's
  sinks + window); a (row, kv head) with no active query reads nothing. A window ring read after
  its write (models.layers.KVCache) is a full cache whose fill is min(length, ring size).
  The kernels still mask every score exactly; the runs only bound the reads.
- Block lists (ops.BlockLists' contract: kv_blocks_BNQL per head and query block, head modes
  HEAD_FULL / HEAD_BLOCKS / HEAD_WINDOW_BLOCKS, blocks of list_block_k slots, a multiple of the
  tile): the runs above are those of the rows not in HEAD_BLOCKS mode; after them a (row, kv
  head) reads the tiles of the blocks its other rows list (`listed_tiles`: ascending, each once,
  none inside the runs), and the kernels check each row's list and mode per tile.
- Ragged caches: S need not be a multiple of block_k (`tile_start`).
- Split over the kv length: each (row, kv head) splits its runs into equal parts, one program
  per part, merged by their log-sum-exp (`reference.merge_decode_parts`). Mosaic TPU: P parts
  each (P static: `num_parts`, about config.target_programs programs in all, >=
  config.min_tiles_per_part tiles each). Mosaic GPU: a grid of P parts per (row, kv head) (P
  static: `max_parts`, about config.max_programs programs in all) of which a (row, kv head)
  reading n tiles uses `part_count`(n) = ceil(n / c), c = `part_tiles` (static: the tiles a
  part gets when the (row, kv head) reads the whole cache), computed in the kernel; the others
  write an empty part without loading anything. A call whose reads sit in a few (row, kv
  head)s (an AHA layer's full heads, an L2A row routed global) spreads them over the GPU
  instead of over a fixed number of programs each. A windowed call sizes its parts by the tiles
  a window spans (`tiles_bound`), not by the cache: an AHA head routed local over a 128K cache
  reads a few tiles, in one part.

impl: 'reference' (dense, `reference_decode_attention`), 'mosaic_gpu' (Hopper: TMA K/V pipeline
with a memory warpgroup, wgmma), 'mosaic_tpu' (scalar-prefetched tile runs), each by name;
`interpret=True` runs a kernel in Pallas interpret mode (CPU tests). Choosing one per platform is
condattn_jax.ops' job (`BACKENDS`, the pallas_kernels.backends interface). Forward only.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels.backends import Platform, platform_reason

from .reference import merge_decode_parts, reference_decode_attention

HEAD_FULL, HEAD_BLOCKS, HEAD_WINDOW_BLOCKS = 0, 1, 2   # ops.BlockLists' head modes

IMPLS = ("reference", "mosaic_gpu", "mosaic_tpu")
NO_QUERY = -(2 ** 31) + 1   # the position of a padding / inactive query row: sees no key
MGPU_ROWS = 64              # one wgmma M tile: the query rows of a Mosaic GPU program
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tuning knobs (static). block_k: kv slots per tile (None: Mosaic GPU 64, Mosaic TPU 128;
  Mosaic GPU takes multiples of 64 only: its P@V wgmma contracts over the tile, and the K of a
  bf16 / f16 wgmma must be a multiple of 64 under the 128-byte swizzle); a cache length that is
  no multiple of the tile ends in a ragged tile (read as the last block_k slots, the slots an
  earlier tile holds masked); num_stages: K/V tiles in flight
  per program (Mosaic GPU; shared memory per program grows with num_stages x block_k x
  head_dim); parts: kv parts per (row, kv head) (None: `num_parts` / `max_parts`; Mosaic GPU
  uses up to that many, `part_count`); target_programs: the total programs `num_parts` aims
  for; max_programs: the grid `max_parts` aims for (Mosaic GPU); balance: Mosaic GPU splits by
  `part_count` (False: `num_parts` parts each, the previous split);
  window_parts: a windowed call sizes its parts by the tiles its window spans (`tiles_bound`;
  one part skips the merge); False (default): by the cache's tiles. Not adopted: it failed
  ADOPTION_RULE's wall test at 8K (run aha11_windowparts_8k, bench/claims/decode_program.py);
  min_tiles_per_part: the fewest tiles a part gets (a part's partial output is written and
  merged: bytes a tiny part would spend on that instead of K/V); over_cudnn: condattn_jax.ops'
  auto runs this backend for the decode calls cuDNN's decode path also takes (a full cache
  with a fill, no window, an active set per row at most), not only for the others; set it
  where tests/gpu/test_decode_kernel.py's timings show the kernel faster than cuDNN there."""
  block_k: int | None = None
  num_stages: int = 2
  parts: int | None = None
  target_programs: int = 264
  max_programs: int = 1024
  balance: bool = True
  window_parts: bool = False
  min_tiles_per_part: int = 8
  over_cudnn: bool = False

  def tile(self, impl: str, S: int | None = None) -> int:
    """The kv tile (S, the cache length, no longer matters: a ragged last tile is masked)."""
    if self.block_k is not None:
      return self.block_k
    return 128 if impl == "mosaic_tpu" else 64


def num_tiles(S: int, block_k: int) -> int:
  """Tiles of a cache of S slots: ceil(S / block_k); the last one ragged when block_k does not
  divide S (`tile_start`)."""
  return -(-S // block_k)


def tile_start(tile, S: int, block_k: int):
  """The first slot the kernels load for kv tile `tile`: tile * block_k, or S - block_k for a
  ragged last tile (block_k slots in bounds; its slots below tile * block_k belong to the tile
  before and are masked). Needs S >= block_k (kernel_support)."""
  return jnp.minimum(tile * block_k, S - block_k)


def num_parts(B: int, K: int, ntiles: int, cfg: DecodeConfig, programs: int | None = None) -> int:
  """The largest power of two P with B * K * P <= programs (default cfg.target_programs) and
  ntiles / P >= min_tiles_per_part (1 at least), or cfg.parts."""
  if cfg.parts is not None:
    return cfg.parts
  programs = cfg.target_programs if programs is None else programs
  P = 1
  while B * K * P * 2 <= programs and ntiles // (P * 2) >= cfg.min_tiles_per_part:
    P *= 2
  return P


def max_parts(B: int, K: int, ntiles: int, cfg: DecodeConfig) -> int:
  """Mosaic GPU's static parts per (row, kv head): num_parts with max_programs."""
  return num_parts(B, K, ntiles, cfg, programs=cfg.max_programs)


def tiles_bound(ntiles: int, T: int, block_k: int, window, sinks: int, has_lists: bool) -> int:
  """The parts' sizing tiles: ntiles, or for a windowed call without block lists the tiles a
  (row, kv head) reads when its slots hold consecutive positions (a decode's cache): its T
  queries' windows span window + T - 1 slots, i.e. at most ceil((window + T - 1) / block_k) + 1
  tiles, plus ceil(sinks / block_k) sink tiles. It sizes P only: a (row, kv head) whose runs hold
  more tiles (positions out of slot order) still reads them all, over fewer parts."""
  if window is None or has_lists:
    return ntiles
  return min(ntiles, -(-(window + T - 1) // block_k) + 1 + -(-sinks // block_k))


def part_tiles(ntiles: int, P: int, cfg: DecodeConfig) -> int:
  """Mosaic GPU's tiles a part (static): max(min_tiles_per_part, ceil(ntiles / P)), so a (row,
  kv head) reading the whole cache of ntiles tiles fills its P parts."""
  return max(cfg.min_tiles_per_part, -(-ntiles // P))


def part_count(n, P: int, c: int):
  """The parts a (row, kv head) reading n run entries uses (in the kernel, per program):
  ceil(n / c) in [1, P] (c = `part_tiles`)."""
  return jnp.clip(lax.div(n + (c - 1), c), 1, P)


def kernel_support(impl: str, q_shape, kv_shape, dtype, cfg: DecodeConfig = DecodeConfig(),
                   list_block_k: int | None = None) -> str | None:
  """None if kernel `impl` takes [B, T, N, H] queries over [B, S, K, H] keys of `dtype` (with
  block lists of list_block_k slots a block, when given), else why not (one line)."""
  if impl == "reference":
    return None
  if impl not in IMPLS:
    return f"unknown decode impl {impl!r}; choose one of {IMPLS}"
  B, T, N, H = q_shape
  S, K = kv_shape[1], kv_shape[2]
  bk = cfg.tile(impl, S)
  why = []
  if jnp.dtype(dtype) not in _DTYPES:
    why.append(f"dtype {jnp.dtype(dtype).name} (the decode kernels take bfloat16 / float16)")
  if H % 64 or H > 256:
    why.append(f"head_dim {H} (the decode kernels take a multiple of 64, <= 256)")
  rows = T * (N // K)
  max_rows = MGPU_ROWS if impl == "mosaic_gpu" else 128
  if rows > max_rows:
    why.append(f"{T} queries x {N // K} query heads per kv head = {rows} rows (a decode program "
               f"takes <= {max_rows}: decode is a few tokens per row)")
  if impl == "mosaic_gpu" and bk % 64:
    why.append(f"DecodeConfig.block_k={bk}: Mosaic GPU's P@V wgmma contracts over the kv tile, "
               "a multiple of 64 for bf16 / f16; use block_k=None (64) or a multiple of 64")
  if impl == "mosaic_tpu" and H % 128 and K > 1:
    why.append(f"head_dim {H} with {K} kv heads (Mosaic TPU reads a kv head's [block_k, "
               "head_dim] block of the [B, S, K * head_dim] cache: head_dim a multiple of 128)")
  if impl == "mosaic_tpu" and bk % 128:
    why.append(f"DecodeConfig.block_k={bk}: Mosaic TPU needs a multiple of 128; use "
               "block_k=None (128)")
  if impl == "mosaic_gpu" and S % 8:
    why.append(f"cache length {S}: Mosaic GPU loads a ragged last tile from slot S - block_k, "
               "which its TMA copy needs at a multiple of 8; pad the cache to a multiple of 8")
  if S < bk:
    why.append(f"cache length {S} < the kv tile {bk} (DecodeConfig.block_k): use a smaller "
               "block_k or the reference")
  if list_block_k is not None and list_block_k % bk:
    why.append(f"block lists of {list_block_k}-slot blocks (BlockLists.block_k): the decode "
               f"kernels read whole listed blocks in tiles of {bk}; use blocks of a multiple of "
               f"{bk} slots")
  return "; ".join(why) or None


# ------------------------------------------------------------------------------------------------
# The plan: folded query rows, per-(row, kv head) tile runs
# ------------------------------------------------------------------------------------------------

def fold_queries(q_BTNH, q_positions_BT, active, K: int, rows: int):
  """(q_BKRH [B, K, rows, H], qpos_BKR int32): query head k * G + g of token t is row t * G + g
  of kv head k; rows past T * G and inactive queries get position NO_QUERY (they see nothing)."""
  B, T, N, H = q_BTNH.shape
  G = N // K
  R = T * G
  q_BKRH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H)
  qpos_BTN = jnp.broadcast_to(q_positions_BT.astype(jnp.int32)[:, :, None], (B, T, N))
  if active is not None:
    act_BTN = active if active.ndim == 3 else jnp.broadcast_to(active[:, :, None], (B, T, N))
    qpos_BTN = jnp.where(act_BTN, qpos_BTN, NO_QUERY)
  qpos_BKR = qpos_BTN.reshape(B, T, K, G).transpose(0, 2, 1, 3).reshape(B, K, R)
  pad = rows - R
  q_BKRH = jnp.pad(q_BKRH, ((0, 0), (0, 0), (0, pad), (0, 0)))
  qpos_BKR = jnp.pad(qpos_BKR, ((0, 0), (0, 0), (0, pad)), constant_values=NO_QUERY)
  return q_BKRH, qpos_BKR


def unfold_rows(o_BKRH, T: int, N: int):
  """Inverse of fold_queries' row layout: [B, K, >= T * G, H] -> [B, T, N, H]."""
  B, K, _, H = o_BKRH.shape
  G = N // K
  o = o_BKRH[:, :, :T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)
  return o.reshape(B, T, N, H)


def fold_lists(kv_blocks_BNQL, head_mode_BN, T: int, K: int, rows: int, block_q: int):
  """(lists_BKRL int32 [B, K, rows, L], mode_BKR int32 [B, K, rows]): the block list and head
  mode of each folded query row (row t * G + g of kv head k: head k * G + g, query block
  t // block_q); head_mode_BN None = HEAD_BLOCKS; padding rows list nothing."""
  B, N, _, L = kv_blocks_BNQL.shape
  G = N // K
  lists = kv_blocks_BNQL.astype(jnp.int32)[:, :, jnp.arange(T) // block_q]     # [B, N, T, L]
  lists = lists.reshape(B, K, G, T, L).transpose(0, 1, 3, 2, 4).reshape(B, K, T * G, L)
  mode = (jnp.full((B, N), HEAD_BLOCKS, jnp.int32) if head_mode_BN is None
          else head_mode_BN.astype(jnp.int32))
  mode = jnp.broadcast_to(mode.reshape(B, K, 1, G), (B, K, T, G)).reshape(B, K, T * G)
  pad = rows - T * G
  lists = jnp.pad(lists, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-1)
  mode = jnp.pad(mode, ((0, 0), (0, 0), (0, pad)), constant_values=HEAD_BLOCKS)
  return lists, mode


def listed_tiles(lists_BKRL, mode_BKR, qpos_BKR, runs_BK3, *, num_kv_tiles: int,
                 per_block: int):
  """(listed_BKE int32 [B, K, E], count_BK int32): the tiles of the blocks (per_block tiles a
  block) listed by a (row, kv head)'s active rows in a mode other than HEAD_FULL, outside its
  runs (a tile is read once), ascending and distinct, `count` of them first (the rest 0)."""
  B, K, R, L = lists_BKRL.shape
  nT, m = num_kv_tiles, per_block
  use = (mode_BKR != HEAD_FULL) & (qpos_BKR != NO_QUERY)
  e = lists_BKRL
  tiles = e[..., None] * m + jnp.arange(m, dtype=jnp.int32)                   # [B, K, R, L, m]
  ok = (use[..., None] & (e >= 0))[..., None] & (tiles >= 0) & (tiles < nT)
  r = runs_BK3[:, :, None, None, None, :]
  ok &= ~((tiles < r[..., 0]) | ((tiles >= r[..., 1]) & (tiles < r[..., 2])))
  flat = jnp.sort(jnp.where(ok, tiles, nT).reshape(B, K, -1), axis=-1)
  dup = jnp.concatenate([jnp.zeros((B, K, 1), bool), flat[..., 1:] == flat[..., :-1]], axis=-1)
  flat = jnp.sort(jnp.where(dup, nT, flat), axis=-1)
  count = jnp.sum(flat < nT, axis=-1).astype(jnp.int32)
  return jnp.where(flat < nT, flat, 0), count


def tile_runs(qpos_BKR, kv_positions_BS, kv_lengths_B, kv_valid_BS, *, window, sinks, block_k):
  """int32 [B, K, 3] (sink_end, win_lo, win_hi): the kv tiles (block_k slots each) program
  (b, k) reads, tiles [0, sink_end) then [win_lo, win_hi) (disjoint, win_lo >= sink_end). Every
  tile holding a slot visible to one of the (b, k) rows is in them (the kernels mask the rest).
  With neither a window nor kv_valid_BS this is arithmetic on the fills; otherwise one pass over
  the [B, S] positions (4 bytes a slot, against K * H * 4 bytes of K/V)."""
  B, S = kv_positions_BS.shape
  nT = num_tiles(S, block_k)
  on_BKR = qpos_BKR != NO_QUERY
  on_BK = jnp.any(on_BKR, axis=-1)
  big = jnp.iinfo(jnp.int32).max
  qmax_BK = jnp.max(jnp.where(on_BKR, qpos_BKR, -big), axis=-1)
  qmin_BK = jnp.min(jnp.where(on_BKR, qpos_BKR, big), axis=-1)
  zero = jnp.zeros_like(qmax_BK)
  if window is None and kv_valid_BS is None:
    fill_B = jnp.full((B,), S, jnp.int32) if kv_lengths_B is None else kv_lengths_B
    end_B = (jnp.clip(fill_B.astype(jnp.int32), 0, S) + block_k - 1) // block_k
    end_BK = jnp.where(on_BK, end_B[:, None], 0)
    return jnp.stack([zero, zero, end_BK], axis=-1)
  slot_BS = jnp.arange(S, dtype=jnp.int32)[None, :]
  ok_BS = jnp.ones((B, S), bool)
  if kv_lengths_B is not None:
    ok_BS = slot_BS < kv_lengths_B[:, None]
  if kv_valid_BS is not None:
    ok_BS = ok_BS & (kv_valid_BS != 0)
  pad = nT * block_k - S  # a ragged last tile: its missing slots hold no key
  pos_BnT = jnp.pad(kv_positions_BS.astype(jnp.int32), ((0, 0), (0, pad))).reshape(B, nT, block_k)
  ok_BnT = jnp.pad(ok_BS, ((0, 0), (0, pad))).reshape(B, nT, block_k)
  pmin_BT = jnp.min(jnp.where(ok_BnT, pos_BnT, big), axis=-1)
  pmax_BT = jnp.max(jnp.where(ok_BnT, pos_BnT, -big), axis=-1)
  any_BT = jnp.any(ok_BnT, axis=-1)
  past_BKT = any_BT[:, None] & (pmin_BT[:, None] <= qmax_BK[..., None])   # a non-future key
  need_BKT = past_BKT
  if window is not None:
    need_BKT = past_BKT & (pmax_BT[:, None] > qmin_BK[..., None] - window)
  t_T = jnp.arange(nT, dtype=jnp.int32)

  def run_end(need):  # 1 + the last needed tile (0 if none)
    return jnp.max(jnp.where(need, t_T + 1, 0), axis=-1)

  win_hi = run_end(need_BKT)
  win_lo = jnp.min(jnp.where(need_BKT, t_T, nT), axis=-1)
  sink_end = zero
  if window is not None and sinks:
    sink_end = run_end(past_BKT & (pmin_BT[:, None] < sinks))
  win_lo = jnp.maximum(jnp.minimum(win_lo, win_hi), sink_end)
  win_hi = jnp.maximum(win_hi, win_lo)
  runs = jnp.stack([sink_end, win_lo, win_hi], axis=-1)
  return jnp.where(on_BK[..., None], runs, 0)


def plan(q_BTNH, k_BSKH, *, q_positions_BT, kv_positions_BS, kv_lengths_B, kv_valid_BS, active,
         window, sinks, block_k, rows, kv_blocks_BNQL=None, head_mode_BN=None, block_q=1,
         list_block_k=None, lists_shared=False):
  """(q_BKRH, qpos_BKR, runs_BK4, lists): the kernels' inputs (see the module docstring).
  runs_BK4: (sink_end, win_lo, win_hi, listed count) per (row, kv head); lists: None, or
  (lists_BKRL, mode_BKR, listed_BKE) with block lists (`fold_lists`, `listed_tiles`): the runs
  are then those of the rows not in HEAD_BLOCKS mode (HEAD_FULL: the usual mask;
  HEAD_WINDOW_BLOCKS: its window too), the listed tiles those of the rows not in HEAD_FULL.
  lists_shared (ops.BlockLists.shared_by_kv_head: a kv head's rows share one list and one mode,
  HEAD_FULL or HEAD_BLOCKS): the same result, its runs and listed tiles computed with no mode
  (every row full, every row listed) and each kv head's mode applied after: that work then
  depends on the positions, fills and lists only, the same in every layer."""
  B, T, N, _ = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BKRH, qpos_BKR = fold_queries(q_BTNH, q_positions_BT, active, K, rows)
  lists = None
  qpos_runs = qpos_BKR
  if kv_blocks_BNQL is not None:
    lists_BKRL, mode_BKR = fold_lists(kv_blocks_BNQL, head_mode_BN, T, K, rows, block_q)
    if lists_shared:
      return _plan_shared(q_BKRH, qpos_BKR, lists_BKRL, mode_BKR, T * (N // K), S,
                          kv_positions_BS, kv_lengths_B, kv_valid_BS, window=window,
                          sinks=sinks, block_k=block_k, list_block_k=list_block_k)
    qpos_runs = jnp.where(mode_BKR == HEAD_BLOCKS, NO_QUERY, qpos_BKR)
  runs = tile_runs(qpos_runs, kv_positions_BS, kv_lengths_B, kv_valid_BS, window=window,
                   sinks=sinks, block_k=block_k)
  count = jnp.zeros(runs.shape[:2], jnp.int32)
  if kv_blocks_BNQL is not None:
    R = T * (N // K)  # the real rows: the padding rows list nothing (sorted per step)
    listed, count = listed_tiles(lists_BKRL[:, :, :R], mode_BKR[:, :, :R], qpos_BKR[:, :, :R],
                                 runs, num_kv_tiles=num_tiles(S, block_k),
                                 per_block=list_block_k // block_k)
    lists = (lists_BKRL, mode_BKR, listed)
  return q_BKRH, qpos_BKR, jnp.concatenate([runs, count[..., None]], axis=-1), lists


def _plan_shared(q_BKRH, qpos_BKR, lists_BKRL, mode_BKR, R, S, kv_positions_BS, kv_lengths_B,
                 kv_valid_BS, *, window, sinks, block_k, list_block_k):
  """`plan` with lists_shared: the runs of every row as HEAD_FULL and the listed tiles of every
  row as HEAD_BLOCKS (no mode read), then per kv head (its row 0's mode) the one or the other."""
  runs_full = tile_runs(qpos_BKR, kv_positions_BS, kv_lengths_B, kv_valid_BS, window=window,
                        sinks=sinks, block_k=block_k)
  listed_all, count_all = listed_tiles(
      lists_BKRL[:, :, :R], jnp.full(mode_BKR[:, :, :R].shape, HEAD_BLOCKS, jnp.int32),
      qpos_BKR[:, :, :R], jnp.zeros_like(runs_full), num_kv_tiles=num_tiles(S, block_k),
      per_block=list_block_k // block_k)
  blocks_BK = mode_BKR[:, :, 0] == HEAD_BLOCKS
  runs = jnp.where(blocks_BK[..., None], 0, runs_full)
  count = jnp.where(blocks_BK, count_all, 0)
  listed = jnp.where(blocks_BK[..., None], listed_all, 0)
  return (q_BKRH, qpos_BKR, jnp.concatenate([runs, count[..., None]], axis=-1),
          (lists_BKRL, mode_BKR, listed))


def num_entries(runs):
  """The tiles a (row, kv head) reads: sink tiles + window tiles (+ listed tiles: runs of 4)."""
  n = runs[0] + runs[2] - runs[1]
  return n + runs[3] if len(runs) > 3 else n


def kv_bytes_read(runs_BK4, block_k: int, head_dim: int, itemsize: int):
  """float32 scalar: the K / V bytes the kernels read for these tile runs (`plan`'s runs), i.e.
  sum over (row, kv head) of its tiles x block_k slots x head_dim x 2 (K and V) x itemsize
  (float: a step's bytes pass int32): what a scheme's routing saves shows up here (an inactive
  (row, kv head) reads 0)."""
  tiles = num_entries(tuple(runs_BK4[..., c] for c in range(runs_BK4.shape[-1])))
  return jnp.sum(tiles).astype(jnp.float32) * float(block_k * head_dim * 2 * itemsize)


def part_range(runs, p, P):
  """(lo, hi): the run entries part p of P reads (`entry_tile`); the n entries split as evenly
  as integers allow."""
  n = num_entries(runs)
  return lax.div(n * p, P), lax.div(n * (p + 1), P)  # n, p >= 0: truncation == floor


def entry_tile(runs, e, listed_at=None):
  """The tile of run entry e: e below sink_end, then win_lo + e - sink_end through the window
  run, then listed_at(i) (the i-th listed tile, `listed_tiles`) past it."""
  t = jnp.where(e < runs[0], e, runs[1] + e - runs[0])
  if listed_at is None:
    return t
  w = runs[0] + runs[2] - runs[1]
  return jnp.where(e < w, t, listed_at(jnp.maximum(e - w, 0)))


# ------------------------------------------------------------------------------------------------
# Entry point and backends
# ------------------------------------------------------------------------------------------------

def decode_attention(q_BTNH, k_BSKH, v_BSKH, *, q_positions_BT, kv_positions_BS,
                     kv_lengths_B=None, kv_valid_BS=None, active=None, window=None, sinks=0,
                     scale=None, impl: str = "reference", config: DecodeConfig = DecodeConfig(),
                     interpret=False, kv_blocks_BNQL=None, head_mode_BN=None, block_q=1,
                     list_block_k=None, lists_shared=False):
  """out [B, T, N, H] in q's dtype under reference.decode_mask; see the module docstring. Block
  lists (ops.BlockLists' contract): kv_blocks_BNQL [B, N, ceil(T / block_q), L] of key blocks of
  list_block_k slots, head_mode_BN (None: every head HEAD_BLOCKS). A kernel that cannot take the
  shape raises ValueError naming why."""
  if impl not in IMPLS:
    raise ValueError(f"decode_attention: unknown impl {impl!r}; choose one of {IMPLS}")
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  scale = H ** -0.5 if scale is None else float(scale)
  has_lists = kv_blocks_BNQL is not None
  if has_lists and list_block_k is None:
    raise ValueError("decode_attention: kv_blocks_BNQL needs list_block_k (the slots a block)")
  lists_kw = (dict(kv_blocks_BNQL=kv_blocks_BNQL, head_mode_BN=head_mode_BN, block_q=block_q,
                   list_block_k=list_block_k) if has_lists else {})
  if impl == "reference":
    return reference_decode_attention(
        q_BTNH, k_BSKH, v_BSKH, q_positions_BT=q_positions_BT, kv_positions_BS=kv_positions_BS,
        kv_lengths_B=kv_lengths_B, kv_valid_BS=kv_valid_BS, active=active, window=window,
        sinks=sinks, scale=scale, **lists_kw)[0]
  if why := kernel_support(impl, q_BTNH.shape, k_BSKH.shape, q_BTNH.dtype, config,
                           list_block_k if has_lists else None):
    raise ValueError(f"decode_attention impl={impl!r} cannot take this call: {why}")
  bk = config.tile(impl, S)
  rows = MGPU_ROWS if impl == "mosaic_gpu" else -(-T * (N // K) // 8) * 8
  q_BKRH, qpos_BKR, runs, lists = plan(
      q_BTNH, k_BSKH, q_positions_BT=q_positions_BT, kv_positions_BS=kv_positions_BS,
      kv_lengths_B=kv_lengths_B, kv_valid_BS=kv_valid_BS, active=active, window=window,
      sinks=sinks, block_k=bk, rows=rows, lists_shared=lists_shared, **lists_kw)
  ntiles = num_tiles(S, bk)
  if config.window_parts:
    ntiles = tiles_bound(ntiles, T, bk, window, sinks, has_lists)
  if impl == "mosaic_gpu" and config.balance:
    P = max_parts(B, K, ntiles, config)
    counts = dict(part_tiles=part_tiles(ntiles, P, config))
  else:
    P, counts = num_parts(B, K, ntiles, config), {}
  lengths_B = (jnp.full((B,), S, jnp.int32) if kv_lengths_B is None
               else jnp.minimum(kv_lengths_B.astype(jnp.int32), S))  # masks a ragged tile's tail
  # fill-only: one query per row, a fill, no window / validity: every slot below the fill is
  # visible (MaskSpec.kv_lengths_B's contract: cache positions <= the query's), so the kernels
  # read no positions
  fill_only = (T == 1 and kv_lengths_B is not None and window is None and kv_valid_BS is None
               and not has_lists)
  kvpos = None if fill_only else kv_positions_BS.astype(jnp.int32)
  valid = None if kv_valid_BS is None else kv_valid_BS.astype(jnp.int32)
  out_rows = -(-T * (N // K) // 8) * 8
  if impl == "mosaic_gpu":
    from . import mosaic_gpu as mod
  else:
    from . import mosaic_tpu as mod
  o_BKPRH, lse_BKPR = mod.decode_parts(
      q_BKRH, k_BSKH, v_BSKH, qpos_BKR, kvpos, valid, lengths_B, runs, scale=scale,
      window=window, sinks=sinks, parts=P, out_rows=out_rows, block_k=bk,
      num_stages=config.num_stages, interpret=interpret, lists=lists,
      per_block=list_block_k // bk if has_lists else 1, **counts)
  if P == 1:   # one part: the kernel's output is final (an empty part wrote zeros)
    o_BKRH = o_BKPRH[:, :, 0]
  else:
    o_BKRH = merge_decode_parts(o_BKPRH.astype(jnp.float32), lse_BKPR, axis=2)
  return unfold_rows(o_BKRH, T, N).astype(q_BTNH.dtype)


@dataclasses.dataclass(frozen=True)
class DecodeBackend:
  """One decode kernel as a backend (the pallas_kernels.backends interface)."""
  name: str
  lowers_for: tuple[str, ...] = ()
  needs_hopper: bool = False
  config: DecodeConfig = DecodeConfig()

  def supports(self, q_shape, kv_shape, dtype, platform: Platform,
               list_block_k: int | None = None) -> str | None:
    """list_block_k (static): the call's block lists' block size (None: no block lists)."""
    if self.name == "reference":
      return None
    why = platform_reason(self.name, self.lowers_for, platform, self.needs_hopper)
    return why if why is not None else kernel_support(self.name, q_shape, kv_shape, dtype,
                                                      self.config, list_block_k)

  def __call__(self, q_BTNH, k_BSKH, v_BSKH, **kw):
    return decode_attention(q_BTNH, k_BSKH, v_BSKH, impl=self.name, config=self.config, **kw)


BACKENDS = (DecodeBackend("mosaic_gpu", ("cuda",), needs_hopper=True),
            DecodeBackend("mosaic_tpu", ("tpu",)),
            DecodeBackend("reference"))
