"""pallas_kernels.compact_attention on CPU: compaction, bounds, reference, Triton kernels in
interpret mode (forward, dq/dk/dv, lse), fallbacks, and Triton lowering for an abstract H100."""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _train_helpers import count_compiles

from pallas_kernels.compact_attention import (BlockSizes, CompactConfig, bucket_capacities,
                                              compact_attention,
                                              mask_from_indices, reference_compact_attention)
from pallas_kernels.compact_attention import api
from pallas_kernels.compact_attention import compaction as cp
from pallas_kernels.compact_attention import testing
from pallas_kernels.compact_attention.testing import compare, make_problem, rel_err, run

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# Small tiles keep interpret mode quick; block_q_dkv != block_q exercises separate bounds.
SMALL = BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=16,
                   block_k_dkv=32, num_warps=4, num_stages=2)
TRITON = dict(impl="triton", interpret=True, block_sizes=SMALL)


# ------------------------------------------------------------------------------------------------
# compaction and bounds (pure jnp)
# ------------------------------------------------------------------------------------------------

def test_bucket_ladder_always_holds_every_count():
  for T in (1, 100, 128, 1000, 4096):
    caps = bucket_capacities(T, multiple=32)
    assert list(caps) == sorted(set(caps)) and caps[-1] >= T
    assert all(c % 32 == 0 for c in caps)
    for count in (0, 1, T // 3, T):
      assert caps[int(cp.pick_bucket(jnp.int32(count), caps))] >= count
  assert bucket_capacities(1000, capacity=100, multiple=64) == (128, 1024)
  with pytest.raises(ValueError):
    bucket_capacities(100, bucket_fracs=(0.0,))


@functools.partial(jax.jit, static_argnums=(3,))
def _roundtrip(act, x, lse_c, C):
  """Everything test_compaction_roundtrip_matches_numpy checks, in one compiled program (op by
  op, each jnp call compiled alone)."""
  a_BIT, _ = cp.active_to_RT(act)
  idx = cp.compact_indices(a_BIT, C)
  T = act.shape[1]
  x_c = cp.gather_rows(x, idx)
  slot = cp.compact_slots(a_BIT)
  return dict(a_BIT=a_BIT, idx=idx, back=cp.scatter_rows(x_c, idx, T),
              gathered_back=cp.uncompact_rows(x_c, slot),
              lse=cp.uncompact_BNC(lse_c, slot, -jnp.inf),
              lse_want=jnp.swapaxes(cp.scatter_BNT(lse_c, idx, T, -jnp.inf), 1, 2))


def test_compaction_roundtrip_matches_numpy():
  rng = np.random.default_rng(0)
  B, T, N, H, C = 2, 50, 3, 4, 64
  active = rng.random((B, T, N)) < 0.4
  x = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  lse_c = jnp.asarray(rng.normal(size=(B, N, C)), jnp.float32)
  for act, I in ((active[..., 0], 1), (active, N)):
    assert cp.active_to_RT(jnp.asarray(act))[1] == I
    r = jax.device_get(_roundtrip(jnp.asarray(act), x, lse_c, C))
    idx = r["idx"]
    for b in range(B):
      for i in range(I):
        want = np.nonzero(r["a_BIT"][b, i])[0]
        assert np.array_equal(idx[b, i, :len(want)], want)
        assert np.all(idx[b, i, len(want):] == T)
    mask = act[..., None] if act.ndim == 3 else act[:, :, None, None]
    np.testing.assert_array_equal(r["back"], np.where(mask, np.asarray(x), 0))
    # the gather form of the scatter (what the kernels' results go back through) agrees
    np.testing.assert_array_equal(r["gathered_back"], r["back"])
    np.testing.assert_array_equal(r["lse"], r["lse_want"])
  m = mask_from_indices(jnp.array([[3, 0, 9, -1]]), 8)
  np.testing.assert_array_equal(np.asarray(m)[0], [1, 0, 0, 1, 0, 0, 0, 0])


def _dense_visibility(p, qp_c, valid, qs_c, kvpos):
  """[B, I, C, S] bool, by the definition (numpy)."""
  qp_c, valid = np.asarray(qp_c), np.asarray(valid)
  vis = (kvpos[:, None, None, :] <= qp_c[..., None]) & valid[..., None]
  if "window" in p.kw:
    vis &= (qp_c[..., None] - kvpos[:, None, None, :]) < p.kw["window"]
  if qs_c is not None:
    qs, ks = np.asarray(qs_c), np.asarray(p.kw["kv_segment_ids_BS"])
    vis &= (qs[..., None] == ks[:, None, None, :]) & (ks[:, None, None, :] != 0)
  return vis


def _check_bounds(bounds, any_vis, all_vis, *, exact, ends=True):
  """bounds [B, I, n_a, 4] over axis b of any_vis/all_vis [B, I, n_a, n_b].

  Always: every tile with a visible pair is inside [lo, hi); the first and the last tile of
  [lo, hi) hold a visible pair (no masked-only tile at either end); tiles run unmasked
  ([full_lo, full_hi)) have every pair visible. exact (causal masks on sorted positions, where
  the visible tiles are contiguous): [lo, hi) is exactly the set of tiles with a visible pair and
  [full_lo, full_hi) exactly the fully visible ones. ends=False skips the end check (segment
  ids: the per-tile position / segment-id boxes of a query tile holding two documents can overlap
  a kv tile that no pair of it sees, e.g. the keys of document 1 after its last active query)."""
  cp.bounds_numpy_check(bounds)
  n_b = any_vis.shape[-1]
  for idx in np.ndindex(*bounds.shape[:-1]):
    lo, flo, fhi, hi = (int(x) for x in bounds[idx])
    row_any, row_all = any_vis[idx], all_vis[idx]
    inside = np.zeros(n_b, bool)
    inside[lo:hi] = True
    full = np.zeros(n_b, bool)
    full[flo:fhi] = True
    assert not (row_any & ~inside).any(), (idx, "a tile with a visible pair is skipped")
    assert not (full & ~row_all).any(), (idx, "a tile run unmasked has a masked pair")
    if lo < hi:
      assert not ends or (row_any[lo] and row_any[hi - 1]), (
          idx, lo, hi, "bounds end on a masked-only tile")
    else:
      assert not row_any.any()
    if exact:
      np.testing.assert_array_equal(inside, row_any, err_msg=f"{idx}: not tight")
      np.testing.assert_array_equal(full, row_all, err_msg=f"{idx}: unmasked range not exact")


# (block_q, block_k, transpose) of the forward, the dq and the dk/dv loop
_KERNEL_TILES = ((SMALL.block_q, SMALL.block_k, False), (SMALL.block_q_dq, SMALL.block_k_dq, False),
                 (SMALL.block_q_dkv, SMALL.block_k_dkv, True))


@functools.partial(jax.jit, static_argnames=("C",))
def _compacted_tile_bounds(active, qpos_BT, qseg_BT, kvpos_BS, kvseg_BS, window, *, C):
  """(valid, compacted positions, compacted segment ids or None, [bounds per _KERNEL_TILES]):
  the compaction and the three loops' bounds in one compiled program. window (None or an int32
  scalar) is an argument, not static: the three window draws share one compile per active
  shape (tile_bounds computes the same comparisons either way)."""
  a_BIT, _ = cp.active_to_RT(active)
  idx = cp.compact_indices(a_BIT, C)
  valid = idx < active.shape[1]
  qp_c = cp.gather_meta(qpos_BT, idx, cp.PAD_POS)
  qs_c = None if qseg_BT is None else cp.gather_meta(qseg_BT, idx, 0)
  return valid, qp_c, qs_c, [cp.tile_bounds(qp_c, valid, qs_c, kvpos_BS, kvseg_BS, window=window,
                                            block_q=bq, block_k=bk, transpose=tr)
                             for bq, bk, tr in _KERNEL_TILES]


@pytest.mark.parametrize("mask", ["causal", "offset", "window", "segments", "packed"])
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10 ** 6), sparsity=st.floats(0.0, 1.0), per_head=st.booleans())
def test_tile_bounds_are_tight(mask, seed, sparsity, per_head):
  """The bounds of the forward (and dq) loop per query tile over kv tiles, and of the dk/dv loop
  per kv tile over query tiles, at the kernels' own (different) tile sizes: nothing visible is
  skipped, nothing masked-only is visited at either end, exact for causal masks. Every mask kind
  is drawn (3 fixed draws each)."""
  rng = np.random.default_rng(seed)
  B, T = 2, 96
  kw = dict(causal={}, offset=dict(q_offset=32), window=dict(window=int(rng.integers(1, 40))),
            segments=dict(segments=3), packed=dict(segments=3, packed_positions=True))[mask]
  p = make_problem(seed, B=B, T=T, N=2, K=1, sparsity=sparsity, per_head=per_head, **kw)
  S = p.k.shape[1]
  qpos = np.asarray(p.kw.get("q_positions_BT", np.broadcast_to(
      np.arange(T) + p.kw.get("q_offset", 0), (B, T))), np.int32)
  kvpos = np.asarray(p.kw.get("kv_positions_BS", np.broadcast_to(np.arange(S), (B, S))), np.int32)
  qseg = p.kw.get("q_segment_ids_BT")
  kvseg = p.kw.get("kv_segment_ids_BS")
  C = cp.round_up(T, SMALL.q_multiple)
  window = p.kw.get("window")
  valid, qp_c, qs_c, all_bounds = jax.device_get(_compacted_tile_bounds(
      p.active, jnp.asarray(qpos), qseg, jnp.asarray(kvpos), kvseg,
      None if window is None else jnp.int32(window), C=C))
  vis = _dense_visibility(p, qp_c, valid, qs_c, kvpos)
  exact = mask in ("causal", "offset")
  for (bq, bk, transpose), bounds in zip(_KERNEL_TILES, all_bounds):
    tiles = vis.reshape(vis.shape[:2] + (C // bq, bq, S // bk, bk))
    any_vis, all_vis = tiles.any(axis=(3, 5)), tiles.all(axis=(3, 5))
    if transpose:
      any_vis, all_vis = np.swapaxes(any_vis, -1, -2), np.swapaxes(all_vis, -1, -2)
    # Ends are tight only without windows and segment ids: a query tile whose queries lie further
    # apart than the window (sparse per-head sets) has kv tiles between them that its position
    # box admits and no pair sees (seed 150, window 21: queries at 16 and 90, keys 32..63).
    _check_bounds(bounds, any_vis, all_vis, exact=exact,
                  ends=mask not in ("segments", "packed", "window"))


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------

def _naive(p):
  """Loops in float64 numpy: the definition."""
  q, k, v = (np.asarray(x, np.float64) for x in (p.q, p.k, p.v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  kw = p.kw
  qpos = np.asarray(kw.get("q_positions_BT", np.arange(T)[None] + kw.get("q_offset", 0)))
  qpos = np.broadcast_to(qpos, (B, T))
  kvpos = np.broadcast_to(np.asarray(kw.get("kv_positions_BS", np.arange(S)[None])), (B, S))
  qseg, kvseg = kw.get("q_segment_ids_BT"), kw.get("kv_segment_ids_BS")
  act = np.asarray(p.active)
  out = np.zeros_like(q)
  lse = np.full((B, T, N), -np.inf)
  for b in range(B):
    for t in range(T):
      for h in range(N):
        if not (act[b, t, h] if act.ndim == 3 else act[b, t]):
          continue
        ok = kvpos[b] <= qpos[b, t]
        if "window" in kw:
          ok &= qpos[b, t] - kvpos[b] < kw["window"]
        if qseg is not None:
          ok &= (np.asarray(kvseg)[b] == np.asarray(qseg)[b, t]) & (np.asarray(kvseg)[b] != 0)
        if not ok.any():
          continue
        s = k[b, ok, h // (N // K)] @ q[b, t, h] / np.sqrt(H)
        w = np.exp(s - s.max())
        out[b, t, h] = w @ v[b, ok, h // (N // K)] / w.sum()
        lse[b, t, h] = s.max() + np.log(w.sum())
  return out, lse


@pytest.mark.parametrize("kw", [
    dict(sparsity=0.5),
    dict(sparsity=0.3, per_head=True, N=6, K=2),
    dict(sparsity=0.4, segments=3, window=20, packed_positions=True),
    dict(sparsity=0.5, q_offset=24),
    dict(sparsity=0.2, kv_positions=True, S=80),
])
def test_reference_matches_naive_loops(kw):
  p = make_problem(11, B=2, T=48, H=8, **kw)
  qpos = p.kw.get("q_positions_BT")
  if qpos is None:
    qpos = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32) + p.kw.get("q_offset", 0), (2, 48))
  S = p.k.shape[1]
  kvpos = p.kw.get("kv_positions_BS", jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S)))

  @jax.jit  # both calls in one program (op by op: each op compiled alone)
  def reference_and_api(q, k, v, active):
    out, lse = reference_compact_attention(
        q, k, v, active, q_positions_BT=qpos, kv_positions_BS=kvpos,
        q_segment_ids_BT=p.kw.get("q_segment_ids_BT"),
        kv_segment_ids_BS=p.kw.get("kv_segment_ids_BS"), window=p.kw.get("window"))
    # the public API's default impl is the reference
    return out, lse, compact_attention(q, k, v, active, **p.kw)
  out, lse, got = reference_and_api(p.q, p.k, p.v, p.active)
  want_out, want_lse = _naive(p)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(got), want_out, atol=2e-5, rtol=2e-5)


def test_reference_gradients_are_finite_with_empty_rows():
  p = make_problem(3, T=32, sparsity=0.5, segments=2, window=4, packed_positions=True)
  g = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(compact_attention(q, k, v, p.active, **p.kw) ** 2),
      argnums=(0, 1, 2)))(p.q, p.k, p.v)
  assert all(np.isfinite(np.asarray(x)).all() for x in g)


# ------------------------------------------------------------------------------------------------
# Triton kernels, interpret mode
# ------------------------------------------------------------------------------------------------

# The Triton kernels against the reference on problems that share their shapes and static
# keywords, so each backward variant runs all of them in ONE compiled program (and the reference
# in one: testing.run): 2 rows, T = 48 queries (no multiple of the query tile of 32: the compacted
# buffer is padded; a multiple of 16, the kernel's kv granularity) after a prefix of 32 of the 80
# keys, GQA 2:1 over 2 kv heads, float32, per-head active sets, positions and segment ids given,
# window 24, the ladder (0.25,) (buckets of 32 and 64 slots). bfloat16 runs in
# test_triton_default_tiles_and_ladder, one active set per row (no head axis) there and in the
# kv-length tests, the GPU path's one bucket in both.
_EDGE_B, _EDGE_T, _EDGE_S, _EDGE_N, _EDGE_K, _EDGE_H, _EDGE_WINDOW = 2, 48, 80, 4, 2, 32, 24
_EDGE_CASES = (
    # no active query -> the ladder's smallest bucket (every program empty)
    "all_empty",
    # row 1 fully active -> the full bucket; row 0 attends nothing
    "empty_and_full_rows",
    # packed documents with restarting positions in both rows, 5 to 11 active queries a (row,
    # head) -> the smaller bucket
    "sparse_documents",
    # row 0 AHA: per-head sets over packed documents with the window; row 1 a cache layout: keys
    # at arbitrary sorted positions (gaps, repeats), queries at (or one past) the last 48 of
    # them, one document. 32 to 42 active queries a (row, head): all but one hold more than one
    # tile of 32 (test_poisoned_outputs_catch_an_unwritten_tile needs that) -> the full bucket.
    "masking",
)
_EDGE = {}  # name -> (problem, its reference's run)


def _documents(rng, S):
  """(segment ids, positions restarting per document) [S] of 3 documents, 3 padding slots after."""
  cuts = np.sort(rng.choice(np.arange(8, S - 8), size=2, replace=False))
  return testing.packed_documents(S, [*cuts, S - 3])


def _edge_problem(name):
  B, T, S, N, K, H = _EDGE_B, _EDGE_T, _EDGE_S, _EDGE_N, _EDGE_K, _EDGE_H
  rng = np.random.default_rng(5)  # host draws: no random program compiled
  q, k, v, ct, ct_lse = testing.random_operands(5, B, T, S, N, K, H, jnp.float32)
  kvpos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
  seg = np.ones((B, S), np.int32)
  active = np.zeros((B, T, N), bool)
  if name == "empty_and_full_rows":
    active[1] = True
  elif name == "sparse_documents":
    for b in range(B):
      seg[b], kvpos[b] = _documents(rng, S)
    active = rng.random((B, T, N)) >= 0.85
  elif name == "masking":
    seg[0] = _documents(rng, S)[0]
    kvpos[1] = np.sort(rng.choice(4 * S, size=S, replace=True))
    active = rng.random((B, T, N)) >= 0.2
  qpos = kvpos[:, S - T:].copy()
  if name == "masking":
    qpos[1] += rng.integers(0, 2, T).astype(np.int32)
  kw = dict(q_positions_BT=jnp.asarray(qpos), kv_positions_BS=jnp.asarray(kvpos),
            q_segment_ids_BT=jnp.asarray(seg[:, S - T:]), kv_segment_ids_BS=jnp.asarray(seg),
            window=_EDGE_WINDOW)
  return testing.Problem(q, k, v, jnp.asarray(active), ct, ct_lse, kw)


# fused_bwd: the Triton backward in one launch (dq by atomic adds inside the dk/dv kernel) or the
# two-kernel backward (dq; dk/dv, the default): each runs every edge problem.
@pytest.mark.parametrize("fused_bwd", [True, False], ids=["fused_bwd", "split_bwd"])
def test_triton_matches_reference(fused_bwd):
  """Both backward variants (CompactConfig.fused_triton_bwd) on every _EDGE_CASES problem: one
  compiled program per variant runs them all (testing.run), and one reference."""
  for name in _EDGE_CASES:
    p, ref, impl_kw = _edge_case(name, fused_bwd)
    errs, bad = compare(p, impl_kw, reference=ref)
    assert not bad, (name, errs)


def _edge_case(name, fused_bwd):
  """(problem, its reference's run, the kernel's keywords) of an _EDGE_CASES case."""
  if name not in _EDGE:  # the problem and its reference, once for both backward variants
    p = _edge_problem(name)
    _EDGE[name] = p, testing.run(p, impl="reference")
  return (*_EDGE[name], dict(TRITON, bucket_fracs=(0.25,),
                             config=CompactConfig(fused_triton_bwd=fused_bwd)))


def test_triton_default_tiles_and_ladder():
  """GPU default tiles (128) and the default bucket ladder, bf16."""
  p = make_problem(9, T=256, N=2, K=1, H=64, sparsity=0.7, dtype=jnp.bfloat16)
  errs, bad = compare(p, dict(impl="triton", interpret=True))
  assert not bad, errs


def test_poisoned_outputs_catch_an_unwritten_tile(monkeypatch):
  """The kernel's outputs start as NaN (poison=True): a kernel that skips one active tile (here:
  counts one tile short) must fail the comparison, so a passing run means every element was
  written by the kernel. The problem: test_triton_matches_reference's masking problem (its (row,
  head)s hold up to 42 active queries: the broken count leaves those past the first tile of 32
  unwritten), whose correct run (the same program: no compile here) passes."""
  p, ref, impl_kw = _edge_case("masking", False)
  assert int(np.asarray(p.active).sum(axis=1).max()) > SMALL.block_q
  errs, bad = compare(p, impl_kw, reference=ref)
  assert not bad, errs
  real = cp.active_counts
  monkeypatch.setattr(cp, "active_counts", lambda a: jnp.maximum(real(a) - SMALL.block_q, 0))
  jax.clear_caches()  # retrace with the broken count
  errs, bad = compare(p, impl_kw, grads=False, reference=ref)  # forward only: one compile
  assert "out" in bad and np.isnan(errs["out"]), errs


def test_kernels_skip_tiles_outside_their_bounds():
  """Each kernel loops over its bounds only: with every range emptied (lo = hi = 0) the forward
  gives zeros / lse -inf, dq and dk/dv zeros, although the masks alone would let every pair
  through. (The bounds tests above check the ranges; this checks that the kernels use them.)"""
  from pallas_kernels.compact_attention import triton as kt
  B, C, S, N, K, H = 1, 64, 64, 2, 1, 32
  rng = np.random.default_rng(0)  # host draws: no random program compiled
  q, do = (jnp.asarray(rng.standard_normal((B, C, N, H)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(2))
  qpos = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32) + S, (B, 1, C))  # sees every key
  counts = jnp.full((B, 1), C, jnp.int32)
  kw = dict(scale=H ** -0.5, window=None, bs=SMALL, interpret=True)
  dkv_dq = lambda *a, **k: kt.dkv(*a, dq_acc_BCNH=jnp.zeros(q.shape, jnp.float32), **k)
  for fn, bq, bk, tr in ((kt.fwd, SMALL.block_q, SMALL.block_k, False),
                         (kt.dq, SMALL.block_q_dq, SMALL.block_k_dq, False),
                         (kt.dkv, SMALL.block_q_dkv, SMALL.block_k_dkv, True),
                         (dkv_dq, SMALL.block_q_dkv, SMALL.block_k_dkv, True)):
    n_a, n_b = (S // bk, C // bq) if tr else (C // bq, S // bk)
    full = jnp.broadcast_to(jnp.array([0, 0, n_b, n_b], jnp.int32), (B, 1, n_a, 4))
    empty = jnp.zeros((B, 1, n_a, 4), jnp.int32)
    lse = delta = jnp.zeros((B, N, C))

    @jax.jit  # the bounds are an argument: full and empty run one compiled kernel
    def call(b, fn=fn):
      if fn is kt.fwd:
        return fn(q, k, v, qpos, None, None, None, b, counts, **kw)
      args = (q, k, v, do, lse, delta, qpos, None, None, None, b)
      return fn(*args, counts, **kw) if fn is kt.dq else fn(*args, **kw)
    outs = {name: jax.device_get(call(b)) for name, b in (("full", full), ("empty", empty))}
    assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(outs["full"]))
    for x in jax.tree.leaves(outs["empty"]):
      x = np.asarray(x)
      assert np.all((x == 0) | (x == -np.inf)), (fn, "computed a tile outside its bounds")


def test_no_recompilation_across_active_sets():
  """Active sets of every size (empty, full, in between) run with no new
  XLA compilation after the first call, eagerly (where a host-side bucket choice would compile
  new kernels) and under jit with gradients."""
  p = make_problem(1, T=64, N=2, K=1, H=32, sparsity=0.5)
  rng = np.random.default_rng(0)
  sets = [jnp.asarray(rng.random((1, 64)) >= s) for s in (0.5, 0.0, 0.97, 1.0, 0.8)]
  f = lambda q, k, v, a: compact_attention(q, k, v, a, **TRITON)
  g = jax.jit(jax.grad(lambda q, k, v, a: jnp.sum(f(q, k, v, a) ** 2), argnums=(0, 1, 2)))
  # warm-up; twice, as the first call imports jax modules (Pallas interpret mode) that add
  # entries to the state jit caches are keyed on
  for _ in range(2):
    jax.block_until_ready(f(p.q, p.k, p.v, sets[0]))
    jax.block_until_ready(g(p.q, p.k, p.v, sets[0]))
  events, stop = count_compiles()
  try:
    for a in sets[1:]:
      jax.block_until_ready(f(p.q, p.k, p.v, a))
      jax.block_until_ready(g(p.q, p.k, p.v, a))
  finally:
    stop()
  assert not events, f"{len(events)} compilations after the first call"


# ------------------------------------------------------------------------------------------------
# shapes the kernels cannot take
# ------------------------------------------------------------------------------------------------

def test_unsupported_shape_raises():
  """A kernel asked for by name that cannot take the shape is a ValueError naming why (choosing
  another kernel, or the reference with a warning, is condattn_jax.ops' resolver's job:
  tests/kernels/test_ops.py); so is an unknown impl or a config field out of range."""
  p = make_problem(2, T=32, N=2, K=1, H=24, sparsity=0.5)
  with pytest.raises(ValueError, match="head_dim 24"):
    compact_attention(p.q, p.k, p.v, p.active, impl="triton", interpret=True)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    compact_attention(p.q, p.k[:, :, :1].repeat(3, 2)[:, :, :3], p.v[:, :, :1].repeat(3, 2)[:, :, :3],
                      p.active)
  ok = make_problem(2, T=32, N=2, K=1, H=32, sparsity=0.5)
  with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):  # at lowering
    compact_attention(ok.q, ok.k, ok.v, ok.active, impl="triton")
  with pytest.raises(ValueError, match="unknown impl 'auto'"):
    compact_attention(p.q, p.k, p.v, p.active, impl="auto")
  with pytest.raises(ValueError, match="mgpu_bwd_wgs=3"):
    CompactConfig(mgpu_bwd_wgs=3)
  with pytest.raises(ValueError, match="config must be a CompactConfig"):
    compact_attention(p.q, p.k, p.v, p.active, impl="triton", interpret=True, config={})


@pytest.mark.parametrize("layout", ["default", "positions+segments"])
def test_kv_length_the_tiles_cannot_divide_is_padded_not_a_fallback(layout):
  """kv length 40 (not % 16: e.g. a window ring of window + 1 slots) runs the Triton kernel on
  K/V padded with slots no query sees: same values and gradients as the reference. The padded
  layouts: none (positions 0..39 implied), and kv positions (a cache-like layout: kv slots out of
  position order) with segment ids in one call (each pads its own kv array: positions and
  segment ids were separate cases, one compile pair each). The default layout runs segment ids
  without kv positions: the wrapper marks its padding slots with segment id 0."""
  p = make_problem(2, B=2, T=40, S=40, N=2, K=1, H=32, sparsity=0.5)
  kw = {}
  if layout == "positions+segments":
    perm = np.random.default_rng(0).permutation(40)
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 2, 0), jnp.int32)
    kw = dict(q_positions_BT=jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40)),
              kv_positions_BS=jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (2, 40)),
              q_segment_ids_BT=seg, kv_segment_ids_BS=seg)

  def loss(impl, q, k, v):
    out = compact_attention(q, k, v, p.active, impl=impl, interpret=impl == "triton", **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2), out
  vg = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2),
                                               has_aux=True))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback warning (traced inside the block)
    (_, got), g_got = vg("triton")(p.q, p.k, p.v)
  (_, want), g_want = vg("reference")(p.q, p.k, p.v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  for a, b in zip(g_got, g_want):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.parametrize("fused_bwd", [True, False], ids=["fused_bwd", "split_bwd"])
def test_triton_lowers_for_h100_at_realistic_shapes(fused_bwd):
  """Lowers the kernels to Triton IR (what the GPU compiles) for an abstract H100: ONE bucket (the
  GPU glue kernels bound the work by the active count, so there is no ladder and no lax.switch):
  the forward and the fused dk/dv/dq kernel (its atomic adds lower), or forward, dq and dk/dv,
  plus the glue: four row copies (q gathered for each pass, out and dq put back) and the dO
  gather with delta."""
  from jax.sharding import AbstractDevice, AbstractMesh
  B, T, N, K, H = 1, 4096, 28, 4, 128
  sds = [jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T), jnp.bool_)]

  def fwd_bwd(q, k, v, a):
    f = lambda q, k, v: compact_attention(q, k, v, a, impl="triton", window=4096,
                                          config=CompactConfig(fused_triton_bwd=fused_bwd))
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(out)

  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    # the lowering jax.export runs (without its serialization)
    text = jax.jit(fwd_bwd).trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
  names = sorted(re.findall(r'name = "(compact_attention_[a-z_]+)"', text))
  glue = ["compact_attention_copy_rows"] * 4 + ["compact_attention_copy_rows_delta"]
  attn = (["compact_attention_dkv_dq", "compact_attention_fwd"] if fused_bwd else
          ["compact_attention_dkv", "compact_attention_dq", "compact_attention_fwd"])
  assert "stablehlo.case" not in text  # no bucket switch
  assert text.count("__gpu$xla.gpu.triton") == len(attn) + len(glue)
  assert names == sorted(attn + glue), names


def test_mosaic_gpu_lowers_for_h100_at_realistic_shapes():
  """The Hopper path at Qwen2.5-7B shapes (28 query / 4 kv heads of 128, 4K), forward + backward
  lowered for cuda: ONE bucket (no switch), Mosaic GPU calls only: forward, dq, dk/dv and the
  glue's five row copies (q gathered for each pass, out and dq put back, dO with delta: 4 rows
  of 28 heads per program), no Triton call."""
  B, T, N, K, H = 1, 4096, 28, 4, 128
  sds = [jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16),
         jax.ShapeDtypeStruct((B, T), jnp.bool_)]

  def fwd_bwd(q, k, v, a):
    f = lambda q, k, v: compact_attention(q, k, v, a, impl="mosaic_gpu", window=4096)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(out)
  text = jax.jit(fwd_bwd).trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
  targets = re.findall(r"custom_call @([\w$.]+)", text)
  assert "stablehlo.case" not in text
  assert targets == ["mosaic_gpu_v2"] * 8, targets


def test_mosaic_gpu_named_barriers_config_reaches_the_forward_kernel(monkeypatch):
  """CompactConfig.mgpu_named_barriers is handed to the forward kernel through the static config,
  on every call."""
  from pallas_kernels.compact_attention import mosaic_gpu

  class Seen(Exception):
    pass
  seen = []

  def spy(*args, named_barriers, **kw):
    seen.append(named_barriers)
    raise Seen
  monkeypatch.setattr(mosaic_gpu, "fwd", spy)
  p = make_problem(4, T=128, N=2, K=1, H=64, sparsity=0.5, dtype=jnp.bfloat16)
  for val in (True, False, True):
    with pytest.raises(Seen):
      compact_attention(p.q, p.k, p.v, p.active, impl="mosaic_gpu", interpret=True,
                        config=CompactConfig(mgpu_named_barriers=val))
  assert seen == [True, False, True]


@pytest.mark.parametrize("field,values", [("uncompact_by_gather", (False, True)),
                                          ("fused_triton_bwd", (False, True)),
                                          ("glue_kernels", (False, True)),
                                          ("glue_impl", (None, "mosaic_gpu"))])
def test_config_fields_change_the_program(field, values):
  """Each CompactConfig field changes the traced program (it is part of the static config of the
  inner jit, so calls with other knobs never share a cached trace)."""
  p = make_problem(4, T=64, N=2, K=1, H=32, sparsity=0.5)
  base = {"glue_kernels": False} if field == "uncompact_by_gather" else {}  # XLA glue's way back

  def loss(config, q, k, v):
    return compact_attention(q, k, v, p.active, **TRITON, config=config).astype(
        jnp.float32).sum()
  texts = []
  for val in values:
    config = CompactConfig(**{**base, field: val})
    texts.append(str(jax.make_jaxpr(jax.grad(functools.partial(loss, config),
                                             argnums=(0, 1, 2)))(p.q, p.k, p.v)))
  assert texts[0] != texts[1]
