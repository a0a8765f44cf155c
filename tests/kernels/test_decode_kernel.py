"""pallas_kernels.decode: the decode kernels (Mosaic GPU, Mosaic TPU) in Pallas interpret mode ==
the reference (the tree's one mask builder + reference attention), the tile runs cover every
visible slot and skip the rest, the TPU kernel cross-lowers for TPU.

The GPU run (kernel == reference on the H100, timing vs cuDNN) is tests/gpu/test_decode_kernel.py.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import decode as dk
from pallas_kernels.decode import api
from pallas_kernels.decode.testing import decode_problem


_problem = decode_problem  # host draws: no program compiled to make a problem


def _decode(q, k, v, **kw):
  """dk.decode_attention in one jitted program (eagerly, each op of the plan, the merge and the
  reference is dispatched and compiled on its own)."""
  return jax.jit(lambda q, k, v: dk.decode_attention(q, k, v, **kw))(q, k, v)


def _close(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)


def _visible_tiles(kw, active, window, sinks, K, bk):
  """[B, K, nT] bool from the reference mask: the tiles holding a slot some (b, k) row sees."""
  return np.asarray(_visible_tiles_program(kw, active, window=window, sinks=sinks, K=K, bk=bk))


@functools.partial(jax.jit, static_argnames=("window", "sinks", "K", "bk"))
def _visible_tiles_program(kw, active, *, window, sinks, K, bk):
  """_visible_tiles in one compiled program (eagerly: each op of the mask compiled alone)."""
  m = dk.decode_mask(kw["q_positions_BT"], kw["kv_positions_BS"],
                     kv_lengths_B=kw.get("kv_lengths_B"), kv_valid_BS=kw.get("kv_valid_BS"),
                     active=active, window=window, sinks=sinks)
  B, S = kw["kv_positions_BS"].shape
  if m.ndim == 3:
    m = jnp.broadcast_to(m[:, None, None], (B, K, 1) + m.shape[1:])
  else:
    m = m.reshape(B, K, -1, *m.shape[2:])                      # [B, K, G, T, S]
  seen = jnp.any(m, axis=(2, 3))
  nT = -(-S // bk)                                             # a ragged last tile
  seen = jnp.pad(seen, ((0, 0), (0, 0), (0, nT * bk - S)))
  return seen.reshape(B, K, nT, bk).any(-1)


def _run_tiles(runs):
  B, K, _ = runs.shape
  out = []
  for b in range(B):
    for k in range(K):
      se, lo, hi = (int(x) for x in runs[b, k, :3])
      out.append(set(range(se)) | set(range(lo, hi)))
  return out


@pytest.mark.parametrize("case", ["fill", "window", "sinks", "ring-valid", "inactive"])
def test_tile_runs_cover_every_visible_tile_and_skip_the_rest(case):
  """The runs a program reads hold every tile with a visible slot (the kernel would drop keys
  otherwise), and skip: a full cache read through a window reads its window's tiles (+ the sink
  tile), an inactive (row, kv head) reads nothing, a fill reads only its tiles. The cache (1000
  slots) ends in a ragged tile of 40."""
  B, T, N, K, S, bk = 3, 2, 4, 2, 1000, 64
  rng = np.random.default_rng(1)
  lens = jnp.asarray([1000, 300, 5], jnp.int32)
  kvpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  kw = dict(q_positions_BT=lens[:, None] - 2 + jnp.arange(2)[None], kv_positions_BS=kvpos,
            kv_lengths_B=lens)
  active = window = None
  sinks = 0
  if case == "window":
    window = 150
  elif case == "sinks":
    window, sinks = 100, 4
  elif case == "ring-valid":  # a ring: positions wrap, validity from kv_valid, no fill
    ring = (jnp.arange(S)[None] + jnp.asarray([[0], [500], [900]])) % S
    kw = dict(q_positions_BT=jnp.full((B, T), S + 3, jnp.int32), kv_positions_BS=ring,
              kv_valid_BS=jnp.asarray(rng.random((B, S)) < 0.2, jnp.int32))
    window = 300
  elif case == "inactive":
    active = jnp.asarray(rng.random((B, T, N)) < 0.5).at[1].set(False)
  q = jnp.zeros((B, T, N, 64), jnp.bfloat16)
  plan = jax.jit(lambda q, active, kw: api.plan(  # one program (eagerly: op by op)
      q, jnp.zeros((B, S, K, 64)), active=active, window=window, sinks=sinks, block_k=bk, rows=8,
      kv_lengths_B=kw.get("kv_lengths_B"), kv_valid_BS=kw.get("kv_valid_BS"),
      q_positions_BT=kw["q_positions_BT"], kv_positions_BS=kw["kv_positions_BS"]))
  _, qpos, runs, _ = plan(q, active, kw)
  runs = np.asarray(runs)
  assert (runs[..., 0] <= runs[..., 1]).all() and (runs[..., 1] <= runs[..., 2]).all()
  want = _visible_tiles(kw, active, window, sinks, K, bk)
  read = _run_tiles(runs)
  for i, tiles in enumerate(read):
    b, k = divmod(i, K)
    missing = set(np.flatnonzero(want[b, k])) - tiles
    assert not missing, f"{case}: (row {b}, kv head {k}) misses visible tiles {missing}"
  n_read = [len(t) for t in read]
  if case == "fill":
    assert n_read == [16, 16, 5, 5, 1, 1]            # ceil(fill / 64) tiles each
  if case == "window":
    assert max(n_read) <= 4                          # 151 positions: at most 4 tiles of 64
  if case == "sinks":
    assert read[0] == {0, 14, 15} and read[4] == {0}  # keys 899..999 + the sinks
  if case == "inactive":
    assert n_read[2] == n_read[3] == 0               # row 1: no active query, no reads


def test_mosaic_gpu_interpret_equals_reference():
  """The Hopper kernel (Pallas interpret mode): two queries per row (MATCH multi-query), GQA 3,
  per-head active set with a fully inactive row, window + sinks over a full cache with a fill,
  garbage past the fill, 2 kv parts per (row, kv head), a ragged last tile (248 slots: the 4th
  tile loads slots 184..247 and must drop 184..191, which row 0's window also reads through the
  3rd tile): == the reference; inactive -> zeros."""
  q, k, v, kw = _problem(T=2, N=3, K=1, S=248, lengths=(248, 90))
  active = jnp.ones((2, 2, 3), bool).at[0, 1, 2].set(False).at[1].set(False)
  kw.update(active=active, window=60, sinks=3)
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_gpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)
  assert float(jnp.abs(out[1].astype(jnp.float32)).max()) == 0.0
  assert float(jnp.abs(out[0, 1, 2].astype(jnp.float32)).max()) == 0.0


def test_mosaic_tpu_interpret_equals_reference():
  """The TPU kernel (Pallas TPU interpret mode), fill-only (the parts split the fill: row 0 reads
  4 tiles in 2 parts, the last a partial block of 450 - 384 slots whose tail past the cache the
  pipeline leaves unspecified; row 1 one tile and an empty part) plus a per-row active set ==
  the reference."""
  q, k, v, kw = _problem(N=3, K=1, H=128, S=450, lengths=(440, 37), seed=3)
  kw.update(active=jnp.asarray([[True], [True]]))
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_tpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)


@pytest.mark.slow
def test_each_kernel_on_the_other_mask_path():
  """(slow: two more interpret runs; by default the Mosaic GPU kernel runs the positions path and
  the TPU kernel the fill-only path above, and tests/gpu runs both paths on the H100.) Mosaic
  GPU fill-only (no positions read) with a per-row active set over a cache of 224 slots (a
  ragged 4th tile of 32); Mosaic TPU with window + sinks + 2 queries per row: both == the
  reference."""
  q, k, v, kw = _problem(N=3, K=1, S=224, lengths=(200, 37), seed=5)  # 224: a ragged 4th tile
  kw.update(active=jnp.asarray([[True], [False]]))
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_gpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)
  q, k, v, kw = _problem(T=2, N=3, K=1, H=128, S=512, lengths=(400, 37), seed=6)
  kw.update(window=150, sinks=3)
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_tpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)


@pytest.mark.parametrize("chip,S", [("TPU v5 lite", 32768), ("TPU v6 lite", 32768 + 40)])
def test_mosaic_tpu_lowers_for_tpu_at_qwen_shapes(chip, S):
  """The TPU decode kernel lowers to Mosaic for TPU (the lowering jax.export runs) at
  Qwen2.5-1.5B decode shapes (12 query heads, 2 kv heads, head_dim 128, 32K cache, B = 8), window
  + sinks + a per-head active set; on v6 the cache ends in a partial tile (32808 slots)."""
  B, N, K, H = 8, 12, 2, 128
  sds = [jax.ShapeDtypeStruct((B, 1, N, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
         jax.ShapeDtypeStruct((B, 1, N), jnp.bool_)]

  def f(q, k, v, kvpos, lens, act):
    return dk.decode_attention(q, k, v, q_positions_BT=(lens - 1)[:, None], kv_positions_BS=kvpos,
                               kv_lengths_B=lens, active=act, window=4096, sinks=4,
                               impl="mosaic_tpu")
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind=chip, num_cores=1, platform="tpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(f).trace(*sds).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 1


def test_bytes_read_follow_the_routing():
  """kv_bytes_read at Qwen2.5-1.5B decode shapes, 8K cache, B = 8: dense reads every row's fill;
  AHA-style per-head routing with 1 of every 2 kv heads' queries all local (window 1024) reads
  the window for those; L2A-style rows routed local read nothing of the global cache."""
  B, S, N, K, H, bk = 8, 8192, 12, 2, 128, 64
  fill = jnp.full((B,), S, jnp.int32)
  kvpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  qpos = (fill - 1)[:, None]
  q = jnp.zeros((B, 1, N, H), jnp.bfloat16)

  def read(active=None, window=None):
    @jax.jit
    def f(active):
      _, _, runs, _ = api.plan(q, jnp.zeros((B, 8, K, H)), q_positions_BT=qpos,
                               kv_positions_BS=kvpos, kv_lengths_B=fill, kv_valid_BS=None,
                               active=active, window=window, sinks=0, block_k=bk, rows=64)
      return dk.kv_bytes_read(runs, bk, H, 2)
    return int(f(active))  # exact: multiples of 2^k
  dense = read()
  assert dense == B * S * K * H * 2 * 2                      # K and V, bf16
  local_heads = jnp.broadcast_to(jnp.arange(N) >= N // K, (B, 1, N))   # kv head 1's queries
  full = read(active=~local_heads)                           # kv head 0 only: half
  window = read(active=local_heads, window=1024)             # kv head 1, its window
  assert full == dense // 2
  assert window == B * 1024 * H * 2 * 2                       # keys 7168..8191: 16 tiles
  rows = read(active=jnp.asarray([[b < 2] for b in range(B)]))   # 2 of 8 rows routed global
  assert rows == dense // 4


def test_kernel_support_names_the_bad_field():
  why = dk.kernel_support("mosaic_gpu", (1, 20, 12, 128), (1, 1024, 2, 128), jnp.bfloat16)
  assert "120 rows" in why
  why = dk.kernel_support("mosaic_gpu", (1, 1, 12, 96), (1, 40, 2, 96), jnp.float32)
  assert "float32" in why and "head_dim 96" in why and "cache length 40 < the kv tile 64" in why
  # the P@V wgmma's K is the kv tile: 32 does not lower on Hopper (seen on the H100)
  why = dk.kernel_support("mosaic_gpu", (1, 1, 12, 128), (1, 8224, 2, 128), jnp.bfloat16,
                          dk.DecodeConfig(block_k=32))
  assert "DecodeConfig.block_k=32" in why and "multiple of 64" in why
  assert "DecodeConfig.block_k=64" in dk.kernel_support(
      "mosaic_tpu", (1, 1, 12, 128), (1, 8224, 2, 128), jnp.bfloat16, dk.DecodeConfig(block_k=64))
  why = dk.kernel_support("mosaic_gpu", (1, 1, 12, 128), (1, 1004, 2, 128), jnp.bfloat16)
  assert "cache length 1004" in why and "multiple of 8" in why   # the ragged tile's TMA start
  # a cache length that is no multiple of the tile: a ragged last tile, taken
  assert dk.kernel_support("mosaic_gpu", (1, 1, 12, 128), (1, 1000, 2, 128), jnp.bfloat16) is None
  assert dk.kernel_support("mosaic_tpu", (8, 1, 12, 128), (8, 32768, 2, 128), jnp.bfloat16) is None
  # Mosaic TPU blocks a kv head's [tile, head_dim] out of [B, S, K * head_dim]: 128 lanes
  assert "head_dim 64 with 2 kv heads" in dk.kernel_support(
      "mosaic_tpu", (8, 1, 12, 64), (8, 32768, 2, 64), jnp.bfloat16)
  q, k, v, kw = _problem(H=96)
  with pytest.raises(ValueError, match="head_dim 96"):
    dk.decode_attention(q, k, v, impl="mosaic_gpu", interpret=True, **kw)


def test_num_parts_aims_at_two_programs_per_sm():
  cfg = dk.DecodeConfig()
  assert dk.num_parts(1, 2, 8192 // 64, cfg) == 16     # >= 8 tiles a part
  assert dk.num_parts(1, 2, 131072 // 64, cfg) == 128  # B * K * P = 256 <= 264
  assert dk.num_parts(8, 2, 32768 // 64, cfg) == 16
  assert dk.num_parts(8, 2, 32768 // 64, dk.DecodeConfig(parts=3)) == 3



def test_mosaic_gpu_parts_follow_each_kv_heads_reads():
  """Mosaic GPU's grid: max_parts programs per (row, kv head) for about max_programs in all
  (AHA's OLMo-2-1B layer at 32K, 16 kv heads of 514 tiles: 64); a (row, kv head) reading n tiles
  uses part_count = ceil(n / part_tiles) of them (one at least, at most P; part_tiles: a whole
  cache's tiles over P, >= min_tiles_per_part): the read-heavy head of a call spreads over the
  GPU, a light one keeps few parts. The kernel (interpret) with uneven counts (one kv head
  reading 16 tiles in 8 parts, the others none; then two kv heads each reading its window's 4
  tiles in 2) == the reference."""
  cfg = dk.DecodeConfig()
  assert api.max_parts(1, 16, 514, cfg) == 64 and api.max_parts(8, 16, 514, cfg) == 8
  assert api.max_parts(1, 2, 16, cfg) == 2                       # >= 8 tiles a part
  c = api.part_tiles(514, 64, cfg)
  assert c == 9 and api.part_tiles(16, 2, cfg) == 8
  n = jnp.asarray([514, 17, 0, 9, 10])
  np.testing.assert_array_equal(api.part_count(n, 64, c), [58, 2, 1, 1, 2])
  q, k, v, kw = _problem(B=1, T=1, N=4, K=4, S=1024, lengths=(1000,), seed=5)
  lens = kw.pop("kv_lengths_B")
  kw["kv_valid_BS"] = (jnp.arange(1024)[None] < lens[:, None]).astype(jnp.int32)
  small = dk.DecodeConfig(parts=8, min_tiles_per_part=1)
  assert api.part_tiles(16, 8, small) == 2
  for window, active, want in ((None, [True, False, False, False], [8, 1, 1, 1]),
                               (200, [False, True, False, True], [1, 2, 1, 2])):
    act = jnp.asarray(active)[None, None]
    _, _, runs, _ = jax.jit(lambda q, kw: api.plan(
        q, k, active=act, window=window, sinks=0, block_k=64, rows=64, kv_lengths_B=None,
        **kw))(q, kw)
    n = api.num_entries(tuple(runs[..., i] for i in range(4)))
    np.testing.assert_array_equal(api.part_count(n, 8, 2), [want])
    ref = _decode(q, k, v, active=act, window=window, **kw)
    out = _decode(q, k, v, active=act, window=window, impl="mosaic_gpu", interpret=True,
                  config=small, **kw)
    _close(out, ref)
    assert float(jnp.abs(ref.astype(jnp.float32)).max()) > 0


def test_a_windowed_call_sizes_its_parts_by_the_window_not_the_cache():
  """tiles_bound (DecodeConfig(window_parts=True); the default sizes by the cache, asserted
  last): a windowed call (no block lists) sizes its parts by the tiles its queries'
  windows span over consecutive positions (AHA's local heads over a 128K full cache: 3 tiles of
  64 slots, so one part per (row, kv head), not max_parts' 64 empty ones to launch and merge);
  sinks add theirs; no window or block lists: the cache's tiles. The bound sizes P only: with
  positions out of slot order (a permutation: the window's keys scattered over the whole cache)
  one part reads every tile of the (row, kv head)'s runs and the kernel (interpret) == the
  reference; with one part the kernel's output is final (no merge), an inactive row's zeros."""
  assert api.tiles_bound(2048, 1, 64, 128, 0, False) == 3    # ceil(128 / 64) + 1
  assert api.tiles_bound(2048, 64, 64, 128, 0, False) == 4   # a chunk of 64: 191 slots
  assert api.tiles_bound(2048, 1, 64, 128, 4, False) == 4    # + the sink tile
  assert api.tiles_bound(2048, 1, 64, None, 0, False) == 2048
  assert api.tiles_bound(2048, 1, 64, 128, 0, True) == 2048  # block lists: the cache's tiles
  assert api.tiles_bound(2, 1, 64, 128, 0, False) == 2       # never more than the cache
  cfg = dk.DecodeConfig()
  assert api.max_parts(1, 16, api.tiles_bound(2048, 1, 64, 128, 0, False), cfg) == 1
  assert api.max_parts(1, 16, 2048, cfg) == 64
  q, k, v, kw = _problem(B=2, T=1, N=2, K=1, S=1024, lengths=(1024, 1024), seed=7)
  del kw["kv_lengths_B"]
  perm = (jnp.arange(1024, dtype=jnp.int32)[None] * 7) % 1024  # a permutation of the slots
  kw["kv_positions_BS"] = jnp.concatenate([perm, perm])
  kw["kv_valid_BS"] = jnp.ones((2, 1024), jnp.int32)
  kw.update(q_positions_BT=jnp.asarray([[1023], [1023]], jnp.int32), window=100,
            active=jnp.asarray([[True], [False]]))   # row 1: an empty part, no merge: zeros
  _, _, runs, _ = jax.jit(lambda q, kw: api.plan(q, k, sinks=0, block_k=64, rows=64,
                                                 kv_lengths_B=None, **kw))(q, kw)
  assert int(api.num_entries(tuple(runs[..., i] for i in range(4)))[0, 0]) > 8  # runs > bound
  from pallas_kernels.decode import mosaic_gpu
  parts, run = [], mosaic_gpu.decode_parts
  ref = _decode(q, k, v, **kw)
  with pytest.MonkeyPatch.context() as mp:   # the grid decode_attention asks for
    mp.setattr(mosaic_gpu, "decode_parts",
               lambda *a, **kw: parts.append(kw["parts"]) or run(*a, **kw))
    out = _decode(q, k, v, impl="mosaic_gpu", interpret=True,
                  config=dk.DecodeConfig(window_parts=True), **kw)
  assert parts == [1]   # 16 tiles of cache: 2 parts by the cache's count
  with pytest.MonkeyPatch.context() as mp:   # the default sizing (bench trace set 'cacheparts')
    mp.setattr(mosaic_gpu, "decode_parts",
               lambda *a, **kw: parts.append(kw["parts"]) or run(*a, **kw))
    jax.jit(lambda q, k, v: dk.decode_attention(
        q, k, v, impl="mosaic_gpu", interpret=True, **kw)).lower(q, k, v)
  assert parts == [1, 2]
  _close(out, ref)
  assert float(jnp.abs(ref[0].astype(jnp.float32)).max()) > 0
  assert float(jnp.abs(out[1].astype(jnp.float32)).max()) == 0.0


# ------------------------------------------------------------------------------------------------
# condattn_jax.ops: auto runs the decode kernel where cuDNN's decode path cannot
# ------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("S", "lengths"))  # one program (eagerly: op by op)
def _decode_specs(S=1000, lengths=(1000, 300)):  # 1000: a ragged last tile (64 / 128)
  from condattn_jax import ops
  B, N = 2, 12
  lens = jnp.asarray(lengths, jnp.int32)
  kvpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  valid = (kvpos < lens[:, None]).astype(jnp.int32)
  qpos = (lens - 1)[:, None]
  per_head = jnp.asarray(np.random.default_rng(0).random((B, 1, N)) < 0.5)
  # Elastic's decode call: kv head 0's heads full, kv head 1's their SSA blocks (sink block 0 +
  # the query's block and the one before), 128-slot blocks, the cache's validity and fill
  cur = ((lens - 1) // 128)[:, None, None, None]
  lists = jnp.broadcast_to(jnp.concatenate(
      [jnp.zeros_like(cur), jnp.maximum(cur - 1, 0), cur], axis=-1), (B, N, 1, 3))
  mode = jnp.broadcast_to(jnp.repeat(jnp.asarray([ops.HEAD_FULL, ops.HEAD_BLOCKS]), N // 2),
                          (B, N)).astype(jnp.int32)
  return {  # AHA heads routed local over the full cache; Elastic SSA heads (sinks + window)
      "aha-local": ops.MaskSpec(qpos, kvpos, None, valid, window=256, active=per_head),
      "sinks-window": ops.MaskSpec(qpos, kvpos, None, valid, window=256, sinks=4,
                                   kv_lengths_B=lens),
      "elastic-lists": ops.MaskSpec(qpos, kvpos, None, valid, kv_lengths_B=lens,
                                    block_lists=ops.BlockLists(
          lists.astype(jnp.int32), mode, block_q=1, block_k=128)),
  }


def _export_kernels(spec, platform, mesh):
  from condattn_jax import ops
  B, S = spec.kv_positions_BS.shape
  sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, 1, 12, 128), (B, S, 2, 128),
                                                         (B, S, 2, 128))]
  with jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    # the lowering jax.export runs (without its serialization)
    text = jax.jit(lambda q, k, v: ops.attention(q, k, v, spec)).trace(*sds).lower(
        lowering_platforms=(platform,)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  names = ("decode_attention_mgpu", "decode_attention_tpu", "cudnn")
  return {next((n for n in names if n in c), c[:80]) for c in calls}


_H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


def test_dense_decode_stays_on_cudnn_unless_the_backend_says_over_cudnn(monkeypatch):
  """With cuDNN available (faked: this CPU process has none), a dense decode over a full cache
  (a fill, no window) exported for an H100 runs cuDNN's decode path; with the Mosaic GPU
  backend's DecodeConfig(over_cudnn=True) it runs the decode kernel; the AHA-local call runs
  the kernel either way."""
  import dataclasses

  from jax._src.cudnn import fused_attention_stablehlo as fa

  import pallas_kernels.decode as dpkg
  from condattn_jax import ops
  from pallas_kernels.backends import Platform

  class FakeVersions:  # as tests/kernels/test_ops.py's fake_cudnn; cuDNN's partitioning needs
    @staticmethod     # concrete devices (no abstract mesh), so ops is told it can trace cuda
    def cudnn_get_version():
      return 91000
  monkeypatch.setattr(fa, "cuda_versions", FakeVersions)
  monkeypatch.setattr(ops, "_targets", lambda: {"cuda": Platform("cuda", "NVIDIA H100 80GB HBM3")})
  specs = _decode_specs()
  dense = dataclasses.replace(specs["sinks-window"], window=None, sinks=0)
  assert _export_kernels(dense, "cuda", None) == {"cudnn"}
  assert _export_kernels(specs["aha-local"], "cuda", None) == {"decode_attention_mgpu"}
  over = tuple(dataclasses.replace(b, config=dataclasses.replace(b.config, over_cudnn=True))
               for b in dpkg.BACKENDS)
  monkeypatch.setattr(dpkg, "BACKENDS", over)
  assert _export_kernels(dense, "cuda", None) == {"decode_attention_mgpu"}


def test_auto_runs_the_decode_kernel_on_hopper_and_tpu():
  """ops.resolve('decode', ...) picks the Mosaic GPU decode kernel on an (abstract) H100, the
  Mosaic TPU one on a TPU, none on an A100 (one-line reason); ops.attention(impl='auto') lowered
  for an H100 / TPU runs it for routed decode that cuDNN's decode path cannot take (per-head
  active + window: AHA; sinks + window: Elastic SSA, which had only the reference before; Elastic's
  per-head block lists, which went to the block-sparse kernel with one query padded to a tile)."""
  from condattn_jax import ops
  from pallas_kernels.backends import Platform
  shape_q, shape_kv = (8, 1, 12, 128), (8, 32768, 2, 128)
  be, _ = ops.resolve("decode", "auto", shape_q, shape_kv, jnp.bfloat16,
                      Platform("cuda", "NVIDIA H100 80GB HBM3"))
  assert be.name == "mosaic_gpu"
  be, _ = ops.resolve("decode", "auto", shape_q, shape_kv, jnp.bfloat16, Platform("tpu"))
  assert be.name == "mosaic_tpu"
  be, why = ops.resolve("decode", "auto", shape_q, shape_kv, jnp.bfloat16,
                        Platform("cuda", "NVIDIA A100-SXM4-80GB"))
  assert be is None and "Hopper" in why[0]
  h100 = _H100
  tpu = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
  for name, spec in _decode_specs().items():
    assert _export_kernels(spec, "cuda", h100) == {"decode_attention_mgpu"}, name
    assert _export_kernels(spec, "tpu", tpu) == {"decode_attention_tpu"}, name


def test_ops_decode_path_maps_the_mask_and_differentiates_like_the_reference():
  """ops' decode-kernel runner hands every MaskSpec field to the kernel (here its reference
  backend: no kernel compile): outputs == impl='reference', and its VJP (the reference's) == the
  reference's gradient."""
  from condattn_jax import ops
  runner = ops._decode_kernel(None, dk.DecodeBackend("reference"))
  rng = np.random.default_rng(2)
  specs = _decode_specs(S=384, lengths=(380, 100))
  B, S = 2, 384
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((B, 1, 12, 64), (B, S, 2, 64), (B, S, 2, 64)))

  @jax.jit
  def both(q, k, v):
    out = {}
    for name, spec in specs.items():
      for label, f in (("kernel", lambda q, k, v, s=spec: runner(q, k, v, s)),
                       ("reference", lambda q, k, v, s=spec: ops.attention(q, k, v, s,
                                                                            impl="reference"))):
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v) * jnp.cos(q))
        out[name, label] = (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    return out
  out = both(q, k, v)
  for name in specs:
    for got, want in zip(jax.tree.leaves(out[name, "kernel"]),
                         jax.tree.leaves(out[name, "reference"])):
      np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)


# ------------------------------------------------------------------------------------------------
# Block lists (ops.BlockLists: Elastic's per-head blocks, MATCH's window OR listed chunks)
# ------------------------------------------------------------------------------------------------

def _lists_problem(seed=7, fill=False):
  """Two rows, two queries each (block_q 1: per-token lists), 4 query heads over 2 kv heads,
  a 504-slot cache (ragged last tile) with validity, window 100 + 3 sinks, blocks of 128 slots;
  per-head lists that differ inside a kv head's group (with -1 padding, duplicates, a block
  past the cache) and every head mode: row 0 FULL / BLOCKS / BLOCKS / WINDOW_BLOCKS, row 1
  BLOCKS / BLOCKS / FULL / FULL (kv head 0 lists only). fill: the cache's fill instead of its
  validity and no window / sinks (Elastic's one-token call: the runs from the fill alone)."""
  q, k, v, kw = _problem(B=2, T=2, N=4, K=2, S=504, lengths=(480, 300), seed=seed)
  if not fill:
    lens = kw.pop("kv_lengths_B")
    kw["kv_valid_BS"] = (jnp.arange(504)[None] < lens[:, None]).astype(jnp.int32)
  lists = jnp.asarray([[[[0, 3, -1], [1, 1, 3]], [[2, -1, -1], [0, 9, 2]],
                        [[1, -1, -1], [3, 3, 3]], [[0, -1, -1], [1, -1, -1]]],
                       [[[2, 0, -1], [1, -1, -1]], [[0, 1, 2], [-1, -1, -1]],
                        [[0, -1, -1], [0, -1, -1]], [[1, -1, -1], [1, -1, -1]]]], jnp.int32)
  mode = jnp.asarray([[0, 1, 1, 2], [1, 1, 0, 0]], jnp.int32)
  kw.update(window=None if fill else 100, sinks=0 if fill else 3, kv_blocks_BNQL=lists,
            head_mode_BN=mode, block_q=1, list_block_k=128)
  return q, k, v, kw


def test_block_list_runs_read_each_listed_tile_once():
  """plan with block lists: a (row, kv head) whose rows are all HEAD_BLOCKS reads only the tiles
  of its listed blocks (2 tiles of 64 a 128-slot block), each once, none past the cache; one
  with a HEAD_FULL / HEAD_WINDOW_BLOCKS row reads its runs too, listed tiles inside them not
  again; kv_bytes_read counts them."""
  q, _, _, kw = _lists_problem()
  kw.pop("list_block_k")
  static = dict(window=kw.pop("window"), sinks=kw.pop("sinks"), block_q=kw.pop("block_q"))
  plan = jax.jit(lambda q, kw: api.plan(q, jnp.zeros((2, 504, 2, 64)), active=None, block_k=64,
                                        rows=8, kv_lengths_B=None, list_block_k=128, **static,
                                        **kw))
  _, _, runs, (_, _, listed) = plan(q, kw)
  runs, listed = np.asarray(runs), np.asarray(listed)
  tiles = [set(range(r[0])) | set(range(r[1], r[2])) | set(listed[b, k, :r[3]].tolist())
           for b, row in enumerate(runs) for k, r in enumerate(row)]
  counts = [r[0] + r[2] - r[1] + r[3] for row in runs for r in row]
  assert counts == [len(t) for t in tiles]                         # no tile twice
  assert tiles[1] == {0, 1, 2, 3, 5, 6, 7}    # (0, 1): blocks 0, 1, 3 + window 379..479 + sinks
  assert tiles[2] == {0, 1, 2, 3, 4, 5} and runs[1, 0, 2] == 0    # (1, 0): blocks 0, 1, 2 only
  assert max(max(t) for t in tiles) <= 7                          # block 9: past the cache
  assert float(dk.kv_bytes_read(jnp.asarray(runs), 64, 64, 2)) == sum(counts) * 64 * 64 * 2 * 2


def test_shared_lists_plan_the_same_and_layers_share_it():
  """ops.BlockLists.shared_by_kv_head (Elastic's one-token call: a kv head's query heads share
  one list and one mode, FULL or BLOCKS): plan(lists_shared=True) gives the general plan's
  outputs exactly, kv heads of either mode, a row whose lists hold -1 padding, duplicates and a
  block past the cache; and two layers' plans with the same positions, fill and lists but other
  modes compile (XLA CPU) to one listed-tile computation: 2 sorts, against 4 without."""
  q, _, _, kw = _problem(B=2, T=1, N=4, K=2, S=504, lengths=(480, 300), seed=3)
  lists_BQL = jnp.asarray([[[0, 3, 3, -1]], [[9, 1, -1, 2]]], jnp.int32)      # [B, Q, L]
  lists = jnp.broadcast_to(lists_BQL[:, None], (2, 4, 1, 4))                  # every head
  mode_a = jnp.repeat(jnp.asarray([[0, 1], [1, 1]], jnp.int32), 2, axis=1)    # per kv head
  mode_b = jnp.repeat(jnp.asarray([[1, 0], [0, 1]], jnp.int32), 2, axis=1)
  k = jnp.zeros((2, 504, 2, 64))

  def one(q, kw, mode, shared):
    return api.plan(q, k, active=None, window=None, sinks=0, block_k=64, rows=8,
                    kv_valid_BS=None, kv_blocks_BNQL=lists, head_mode_BN=mode, block_q=1,
                    list_block_k=128, lists_shared=shared, **kw)
  for mode in (mode_a, mode_b):
    got, want = (jax.jit(lambda q, kw, s=s: one(q, kw, mode, s))(q, kw) for s in (True, False))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(g, w)
  sorts = {s: jax.jit(lambda q, kw, s=s: (one(q, kw, mode_a, s)[2:], one(q, kw, mode_b, s)[2:])
                      ).lower(q, kw).compile().as_text().count(" sort(") for s in (True, False)}
  assert sorts == {True: 2, False: 4}, sorts


@pytest.mark.parametrize("fill", [False, True], ids=["validity", "fill"])
def test_mosaic_gpu_block_lists_interpret_equals_reference(fill):
  """The Hopper kernel (interpret mode) with block lists == the reference (the block-sparse
  kernels' mask, ops.BlockLists' contract), in every head mode, 2 kv parts; with a validity
  array and a window, and with the cache's fill alone (Elastic's one-token call)."""
  q, k, v, kw = _lists_problem(fill=fill)
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_gpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)
  assert float(jnp.abs(ref.astype(jnp.float32)).max()) > 0


@pytest.mark.slow
def test_mosaic_tpu_block_lists_interpret_equals_reference():
  """(slow: by default the TPU kernel's block lists are checked by the export below and the
  Mosaic GPU kernel's in interpret mode.) The TPU kernel (interpret) with block lists == the
  reference."""
  q, k, v, kw = _lists_problem()
  q, k, v = (jnp.concatenate([x, x], axis=-1) for x in (q, k, v))   # head_dim 128
  ref = _decode(q, k, v, **kw)
  out = _decode(q, k, v, impl="mosaic_tpu", interpret=True,
                            config=dk.DecodeConfig(parts=2), **kw)
  _close(out, ref)


def test_decode_merge_equals_merge_parts():
  """merge_decode_parts (the decode paths' merge: the weight total an extra channel of the one
  weighted sum) == merge_parts' output over parts of very different lse, parts that see no key
  (lse -inf), a row whose parts are all empty (zeros, no NaN) and a single part (an empty one:
  zeros); with its lse in another layout (lse_perm: cuDNN's [.., K, G] beside o's [.., G, K, H])
  the same numbers."""
  rng = np.random.default_rng(0)
  o = jnp.asarray(rng.standard_normal((3, 5, 4, 8)), jnp.float32)    # [B, P, rows, H]
  lse = rng.standard_normal((3, 5, 4)) * 30
  lse[0, 1:] = -np.inf                                                # one visible part
  lse[1, :, 2] = -np.inf                                              # a row that sees nothing
  lse[2, 3] = -np.inf
  lse = jnp.asarray(lse, jnp.float32)
  # each merge in one jitted program (eagerly: op by op, each op compiled alone)
  got = jax.jit(lambda o, l: dk.merge_decode_parts(o, l, axis=1))(o, lse)
  want = jax.jit(lambda o, l: dk.merge_parts(o, l, axis=1)[0])(o, lse)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1, 2], 0.0)
  np.testing.assert_allclose(got[0], o[0, 0], rtol=1e-6)
  one, one_want = jax.jit(lambda o, l: (dk.merge_decode_parts(o, l, axis=1),   # one part
                                        dk.merge_parts(o, l, axis=1)[0]))(o[:, 1:2], lse[:, 1:2])
  np.testing.assert_allclose(one, one_want, rtol=1e-6)
  np.testing.assert_array_equal(one[0], 0.0)
  o5 = o.reshape(3, 5, 2, 2, 8)                                       # [B, P, G, K, H]
  lse_kg = lse.reshape(3, 5, 2, 2).transpose(0, 1, 3, 2)              # [B, P, K, G]
  perm = jax.jit(lambda o, l: dk.merge_decode_parts(o, l, axis=1, lse_perm=(0, 1, 3, 2)))
  np.testing.assert_allclose(perm(o5, lse_kg), want.reshape(3, 2, 2, 8), rtol=1e-5, atol=1e-6)
