"""pallas_kernels.compact_attention Mosaic GPU (Hopper) kernels on CPU: Pallas' GPU interpret mode
(warpgroups, barriers, TMA copies and wgmma simulated; outputs start as NaN) against the
reference, forward, lse and dq/dk/dv (the backward with two compute warpgroups per program, and
with one). Each case takes 10-60 s on CPU."""
import jax.numpy as jnp
import pytest

from pallas_kernels.compact_attention import BlockSizes, CompactConfig, compact_attention
from pallas_kernels.compact_attention.testing import compare, make_problem

# Small tiles: a program holds 2 compute warpgroups x 64 query rows; kv tiles of 64.
MGPU = dict(impl="mosaic_gpu", interpret=True, block_sizes=BlockSizes(
    block_q=128, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=64, block_k_dkv=64))

CASES = [
    # L2A: one active set per row, GQA 2:1 over 2 kv heads; 105 of 256 queries active, so the
    # ladder's smaller bucket (128) runs: one forward program per head whose second warpgroup
    # holds the tail (rows 64..104), dq's pair of 64-row tiles the second partly padding (at
    # sparsity 0.5, 136 active, the full bucket ran: two forward programs per head, which
    # odd_kv_tiles_window and the default-tiles tests run)
    ("l2a_gqa", dict(T=256, N=4, K=2, H=64, sparsity=0.6)),
    # AHA: per-head sets, packed documents with restarting positions (kv positions given), window
    # (GQA 2:1 as in l2a_gqa; two heads and one query tile of 128 keep the interpreter's grid
    # small: the backward still runs 2 tiles of 64 each way)
    ("aha_packed_window", dict(T=128, N=2, K=1, H=64, sparsity=0.6, per_head=True, segments=3,
                               window=40, packed_positions=True)),
    # a prefix of keys before the queries (128 queries after 128 keys), float16 (a row with no
    # active query, which this case had as a second row, is the halo test's third row)
    ("prefix_f16", dict(T=128, N=2, K=1, H=64, sparsity=0.9, q_offset=128, dtype=jnp.float16)),
    # 5 kv tiles: dk/dv falls back to one compute warpgroup per program, dq keeps two; a window
    # that cuts through the programs' pairs of query tiles (each warpgroup masks its own range).
    # The XLA glue (CompactConfig(glue_kernels=False)): the case is about the attention kernels'
    # tiles; the Mosaic GPU glue runs in every other case (and test_compact_attention_glue.py),
    # and costs a third of this case's interpreter time
    ("odd_kv_tiles_window", dict(T=320, N=2, K=1, H=64, sparsity=0.3, window=70,
                                 config=CompactConfig(glue_kernels=False))),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_mosaic_gpu_matches_reference_interpret(name, kw):
  kw = dict(kw)
  config = kw.pop("config", None)
  p = make_problem(7, **{**dict(dtype=jnp.bfloat16), **kw})
  errs, bad = compare(p, dict(MGPU, bucket_fracs=(0.5,), config=config))
  assert not bad, (name, errs)


@pytest.mark.slow
def test_mosaic_gpu_one_compute_warpgroup_backward_matches_reference_interpret():
  """CompactConfig(mgpu_bwd_wgs=1): dq and dk/dv with one compute warpgroup per program (T = 128:
  2 query and 2 kv tiles of 64 in the backward, so each program's loop runs 1-2 steps). The XLA
  glue (glue_kernels=False): the Mosaic GPU glue is the same with either backward and runs in
  the CASES above."""
  p = make_problem(3, T=128, N=2, K=1, H=64, sparsity=0.5, per_head=True, segments=2,
                   dtype=jnp.bfloat16)
  errs, bad = compare(p, dict(MGPU, bucket_fracs=(0.5,), config=CompactConfig(
      mgpu_bwd_wgs=1, glue_kernels=False)))
  assert not bad, errs


def test_launch_grid_runs_heaviest_query_tiles_first_across_heads():
  """The forward / dq launch order. Pallas Mosaic GPU puts the LAST grid axis on CUDA's x, which
  the hardware launches fastest (jax 0.11.2 `pallas/mosaic_gpu/lowering.py` reverses the grid).
  With `launch_grid` and `tile_order` every row's and head's tile p starts before any tile p - 1
  among the tiles that hold active queries (later tiles see more keys), so the launch is longest
  first, and the programs past every count (which return at once) come after all of them; the
  old (heads, q, batch) order ran every tile of head 0 before head 1's heaviest, and the old tile
  order (nprog - 1 - q) launched the empty programs first."""
  import jax.numpy as jnp
  from pallas_kernels.compact_attention.mosaic_gpu import launch_grid, live_tiles, tile_order
  B, nprog, N = 2, 5, 3
  counts_BI = jnp.array([[130], [300]], jnp.int32)           # rows: 2 and 3 programs of 128
  ntiles = int(live_tiles(counts_BI, 128)[0])
  assert ntiles == 3

  def tiles_in_launch_order(heads_fastest, empties_last=True):
    lg = launch_grid(B, nprog, N, heads_fastest)
    names, grid = lg["grid_names"], lg["grid"]
    assert sorted(names) == ["batch", "heads", "q"] and len(grid) == 3
    order = []
    for z in range(grid[0]):          # CUDA z = first Pallas axis (slowest)
      for y in range(grid[1]):
        for x in range(grid[2]):      # CUDA x = last Pallas axis (fastest)
          ids = dict(zip(names, (z, y, x)))
          p = int(tile_order(jnp.int32(ids["q"]), ntiles, nprog, empties_last))
          order.append((ids["batch"], p, ids["heads"]))
    assert len(set(order)) == B * nprog * N              # every program exactly once
    return order

  launch = tiles_in_launch_order(True)
  tiles = [p for _, p, _ in launch]
  live = [p for p in tiles if p < ntiles]
  assert live == sorted(live, reverse=True)              # heaviest first, all rows and heads
  assert tiles[:len(live)] == live                       # ... and before every empty program
  assert launch[:N] == [(0, ntiles - 1, h) for h in range(N)]   # heads fastest
  old_tiles = [p for _, p, _ in tiles_in_launch_order(True, empties_last=False)]
  assert old_tiles[:B * N] == [nprog - 1] * (B * N)      # the old order: empty programs first
  old = [p for b, p, _ in tiles_in_launch_order(False) if b == 0]
  assert old[:nprog] != sorted(old, reverse=True)[:nprog]


def test_mosaic_gpu_rejects_what_it_cannot_take():
  p = make_problem(1, T=128, N=2, K=1, H=64, dtype=jnp.float32)
  with pytest.raises(ValueError, match="dtype float32"):
    compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_gpu", interpret=True)
  p = make_problem(1, T=128, N=2, K=1, H=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim 32"):
    compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_gpu", interpret=True)
  p = make_problem(1, T=128, N=2, K=1, H=64, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="CompactConfig.bwd_impl='reference'"):
    compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_gpu", interpret=True,
                      config=CompactConfig(bwd_impl="reference"))


def test_backward_kernel_follows_the_config():
  """CompactConfig.bwd_impl: None runs the forward's kernel both ways; 'triton' under a Mosaic GPU
  forward runs the Triton backward; a shape the backward kernel cannot take is the error. (Which
  kernel a platform gets: ops.resolve, tests/kernels/test_ops.py.)"""
  from pallas_kernels.compact_attention import api
  shp = ((1, 256, 4, 64), (1, 256, 2, 64))
  got = api._resolve_impl("mosaic_gpu", *shp, jnp.bfloat16, None, CompactConfig())
  assert (got[0], got[2]) == ("mosaic_gpu", "mosaic_gpu")
  got = api._resolve_impl("mosaic_gpu", *shp, jnp.bfloat16, None, CompactConfig(bwd_impl="triton"))
  assert (got[0], got[2]) == ("mosaic_gpu", "triton")
  got = api._resolve_impl("triton", *shp, jnp.float32, None, CompactConfig())
  assert (got[0], got[2]) == ("triton", "triton")
  with pytest.raises(ValueError, match="mosaic_gpu kernel cannot take this call: dtype float32"):
    api._resolve_impl("triton", *shp, jnp.float32, None, CompactConfig(bwd_impl="mosaic_gpu"))


@pytest.mark.slow
def test_mosaic_gpu_forward_triton_backward_match_reference_interpret():
  """CompactConfig(bwd_impl='triton'): the Mosaic GPU forward's out / lse feed the Triton backward
  (interpret mode, default tiles). The window of test_mosaic_gpu_default_tiles_match_reference_
  interpret's problem (its shapes too): one compiled reference for both."""
  p = make_problem(5, T=256, N=2, K=1, H=64, sparsity=0.7, dtype=jnp.bfloat16, window=150)
  errs, bad = compare(p, dict(impl="mosaic_gpu", interpret=True,
                              config=CompactConfig(bwd_impl="triton")))
  assert not bad, errs


@pytest.mark.slow
def test_mosaic_gpu_default_tiles_match_reference_interpret():
  """The default Mosaic GPU tiles (MGPU_BLOCK_SIZES: dq kv tiles of 128) and the default ladder,
  two compute warpgroups in every backward kernel (T = 256, 144 queries active: the full
  bucket, 2 forward programs of 128 queries, 4 dq / dk-dv tiles of 64 in pairs, 2 kv tiles of
  128 in dq's loop)."""
  p = make_problem(11, T=256, N=2, K=1, H=64, sparsity=0.4, dtype=jnp.bfloat16, window=150)
  errs, bad = compare(p, dict(impl="mosaic_gpu", interpret=True))
  assert not bad, errs


@pytest.mark.slow
def test_mosaic_gpu_halo_of_a_sequence_shard_matches_reference_interpret():
  """The local-window call of shard 0 of 4 under context parallelism (context._halo, T = 1024,
  window 128): its two zigzag chunks as rows, chunk 0 behind a halo of one whole chunk of
  padding (positions 0, segment 0: no shard before it), chunk 7 behind chunk 6's tail. The
  L2A sequence x4 step hung on 4 H100s; this is its per-shard local edge in miniature. Rows 0-1:
  both chunks active; row 2: chunk 0 again, inactive (one compile for both; three rows, as the
  interpreter's time grows with the grid's batch axis). One query head on one kv head: the
  halo's positions and segment ids are what this checks (GQA runs in the CASES), and the
  interpreter's time grows with the head axis too."""
  import numpy as np
  from pallas_kernels.compact_attention.testing import Problem
  C, B, N, K, H = 128, 3, 1, 1, 64
  rng = np.random.default_rng(5)  # host draws: no random program compiled
  pos0, pos7 = np.r_[np.zeros(C), np.arange(C)], np.arange(768, 1024)  # chunk 0's, chunk 7's row
  kv_pos = np.stack([pos0, pos7, pos0]).astype(np.int32)
  kv_seg = np.stack([np.r_[np.zeros(C), np.ones(C)], np.ones(2 * C)] * 2)[:B].astype(np.int32)
  q_pos = np.stack([np.arange(C), np.arange(896, 1024)] * 2)[:B]
  kw = dict(q_positions_BT=jnp.asarray(q_pos, jnp.int32),
            kv_positions_BS=jnp.asarray(kv_pos), q_segment_ids_BT=jnp.ones((B, C), jnp.int32),
            kv_segment_ids_BS=jnp.asarray(kv_seg), window=128)
  rnd = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.bfloat16))
  active_rows = np.asarray([True, True, False])
  p = Problem(q=rnd(B, C, N, H), k=rnd(B, 2 * C, K, H), v=rnd(B, 2 * C, K, H),
              active=jnp.asarray(np.repeat(active_rows[:, None], C, axis=1)),
              ct=rnd(B, C, N, H), ct_lse=jnp.asarray(rng.standard_normal((B, C, N), np.float32)),
              kw=kw)
  errs, bad = compare(p, dict(MGPU))
  assert not bad, errs
