"""pallas_kernels.block_sparse on CPU: the Triton-style kernels in Pallas interpret mode vs the one
reference (forward, lse, dq/dk/dv) over shapes, lists (empty, -1 padding, duplicates, future
blocks), mixed per-head modes, GQA, documents, window + sinks, active sets, cache layouts;
poisoned outputs and NaN-poisoned unlisted K/V; the visit tables; errors; ops dispatch (CPU and
exported for cuda / tpu)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from condattn_jax import ops
from pallas_kernels.block_sparse import (HEAD_BLOCKS, HEAD_FULL, api, block_sparse_attention,
                                         kernel_support, tables)
from pallas_kernels.block_sparse.testing import compare, make_problem, run, ssa_lists
from pallas_kernels.compact_attention.reference import dense_mask, reference_attention

TRITON = dict(impl="triton", interpret=True)


# Named cases (they were the hypothesis test's 3 derandomized draws, same seeds and
# parameters; T = 64, H = 16, 16-blocks). The draw dropped (B = 1, 4 query / 2 kv heads, float32,
# one-entry random lists on HEAD_BLOCKS heads only, 8-row sub-tiles) ran what
# test_ssa_mixed_heads_and_rows_that_see_nothing (HEAD_BLOCKS heads of the same GQA in 8-row
# sub-tiles, float32; empty lists) and test_unlisted_kv_is_never_read (HEAD_BLOCKS-only random
# lists) run.
@pytest.mark.parametrize("name,seed,kw,sub_tile", [
    # per-head active sets on packed documents, bf16, GQA 2:1 over 2 kv heads, whole blocks
    ("documents_active_heads_bf16", 65535, dict(B=1, N=4, K=2, dtype=jnp.bfloat16, L=2,
                                                full_frac=0.0, active="head", segments=2), 64),
    # two rows, HEAD_FULL heads only (no sharing), window + sinks, 8-row / 8-key sub-tiles
    ("full_heads_window_sinks", 1223, dict(B=2, N=2, K=2, dtype=jnp.float32, L=2,
                                           full_frac=1.0, window=20, sinks=3), 8),
])
def test_triton_matches_reference(monkeypatch, name, seed, kw, sub_tile):
  """sub_tile 8: the forward and backward walk the 16-blocks in 8-row / 8-key sub-tiles (as
  128-blocks in 64-sub-tiles on a GPU); 64: whole blocks."""
  monkeypatch.setattr(api, "TRITON_SUB_TILE", sub_tile)
  monkeypatch.setattr(api, "TRITON_FWD_SUB_TILE", sub_tile)
  p = make_problem(seed, **kw)
  errs, bad = compare(p, TRITON)
  assert not bad, (name, errs)


def test_ssa_mixed_heads_and_rows_that_see_nothing(monkeypatch):
  """Streaming (sink + local) heads next to full heads in one call; an all-padding list (and
  an empty L = 0 list) make rows that see nothing: zeros, lse -inf, zero gradients. Backward in
  sub-tiles (8 of a 16-block), forward too."""
  monkeypatch.setattr(api, "TRITON_SUB_TILE", 8)
  monkeypatch.setattr(api, "TRITON_FWD_SUB_TILE", 8)
  B, T, N, K, H, bq = 1, 128, 4, 2, 16, 16
  p = make_problem(7, B=B, T=T, N=N, K=K, H=H, block_q=bq, block_k=bq, window=40, sinks=4)
  lists = ssa_lists(B, N, T, T, block_q=bq, block_k=bq, sink_blocks=1, local_blocks=3).copy()
  lists[0, 3] = -1                                       # head 3: every entry is padding
  p.kw.update(kv_blocks_BNQL=jnp.asarray(lists),
              head_mode_BN=jnp.asarray([[HEAD_FULL, HEAD_BLOCKS, HEAD_BLOCKS, HEAD_BLOCKS]]))
  errs, bad, (o, lse, (dq, _, _)) = compare(p, TRITON, outputs=True)
  assert not bad, errs
  assert np.all(np.asarray(o)[0, :, 3] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :, 3]))
  assert np.all(np.asarray(dq)[0, :, 3] == 0)
  p.kw.update(kv_blocks_BNQL=jnp.zeros((B, N, T // bq, 0), jnp.int32), head_mode_BN=None)
  o, lse, (dq, dk, dv) = run(p, **TRITON)
  assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
  assert not np.any(np.asarray(dk)) and not np.any(np.asarray(dv))


def test_duplicates_and_padding_do_not_change_the_result():
  p = make_problem(3, T=64, L=2, full_frac=0.0, dup_pad=False)
  lists = np.asarray(p.kw["kv_blocks_BNQL"])
  noisy = np.concatenate([lists, lists, np.full_like(lists, -1), lists + 100], axis=-1)
  o1, l1, g1 = run(p, **TRITON)
  p.kw["kv_blocks_BNQL"] = jnp.asarray(noisy)
  o2, l2, g2 = run(p, **TRITON)
  np.testing.assert_array_equal(o1, o2)
  for a, b in zip(g1, g2):
    np.testing.assert_array_equal(a, b)


def test_lengths_that_are_not_whole_blocks_are_padded():
  """T, S not multiples of the blocks (a chunk after a prefix of keys): padded to whole blocks
  inside; padding queries / keys change nothing (values, lse and gradients)."""
  p = make_problem(9, T=40, S=90, N=2, K=1, L=3, window=30, sinks=2, block_q=16, block_k=16)
  errs, bad = compare(p, TRITON)
  assert not bad, errs


def test_unlisted_kv_is_never_read():
  """NaN in every K/V block no HEAD_BLOCKS list names (and no full head exists) must not leak
  into the outputs or the gradients; dk/dv there are exact zeros."""
  B, T, N, K, bq = 1, 64, 4, 2, 16
  p = make_problem(11, B=B, T=T, N=N, K=K, L=2, full_frac=0.0, block_q=bq, block_k=bq)
  lists = np.asarray(p.kw["kv_blocks_BNQL"]) % 2 * 2      # blocks 0 and 2 only (and -1 -> 0)
  p.kw["kv_blocks_BNQL"] = jnp.asarray(lists)
  listed = np.asarray([True, False, True, False])
  bad = np.repeat(~listed, bq)[None, :, None, None]
  k_nan = jnp.where(bad, jnp.nan, p.k)
  v_nan = jnp.where(bad, jnp.nan, p.v)
  o_r, l_r, g_r = run(p, impl="reference")
  p.k, p.v = k_nan, v_nan
  o, l, (dq, dk, dv) = run(p, poison=True, **TRITON)
  np.testing.assert_allclose(o, o_r, atol=2e-5)
  np.testing.assert_allclose(dq, g_r[0], atol=2e-5)
  assert np.all(np.asarray(dk)[:, np.repeat(~listed, bq)] == 0)
  np.testing.assert_allclose(dk, g_r[1], atol=2e-5)
  np.testing.assert_allclose(dv, g_r[2], atol=2e-5)


def test_tables_visit_only_listed_visible_tiles():
  """HEAD_BLOCKS programs visit <= L tiles: the deduplicated, in-range, visible list entries (a
  future tile is dropped); HEAD_FULL programs visit the causal range; the transposed tables
  name exactly the (query tile, kv tile) pairs of the forward tables."""
  B, N, T, bq = 1, 2, 64, 16
  nq = T // bq
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  lists = np.full((B, N, nq, 4), -1, np.int32)
  lists[0, 0, 2] = [1, 1, 3, 9]                # dup, future tile 3, out of range 9
  lists[0, 0, 3] = [0, 3, -1, 2]
  full_BN = jnp.asarray([[0, 1]], jnp.int32)

  @jax.jit  # the tables in one program (op by op: each op compiled alone)
  def all_tables(lists, full_BN):
    vis, full = tables.tile_visibility(pos, pos, None, None, jnp.ones((B, 1, T), bool),
                                       window=None, sinks=0, block_q=bq, block_k=bq)
    bounds, lst = tables.forward_tables(lists, full_BN, vis, full)
    return bounds, lst, tables.transposed_tables(full_BN, bounds, lst, vis, full)
  bounds, lst, (bT, lT) = all_tables(jnp.asarray(lists), full_BN)
  b = np.asarray(bounds)
  assert b[0, 0, 2].tolist() == [0, 0, 0, 1] and np.asarray(lst)[0, 0, 2, 0] == 1
  assert b[0, 0, 3].tolist() == [0, 0, 0, 3] and np.asarray(lst)[0, 0, 3, :3].tolist() == [0, 2, 3]
  assert b[0, 0, 0].tolist() == [0, 0, 0, 0]
  assert [r[3] - r[0] for r in b[0, 1]] == [1, 2, 3, 4]    # full head: causal tiles
  assert [r[2] - r[1] for r in b[0, 1]] == [0, 1, 2, 3]    # all but the diagonal unmasked
  pairs = {(i, int(lst[0, 0, i, x])) for i in range(nq) for x in range(b[0, 0, i, 3])}
  pairsT = {(int(lT[0, 0, j, x]), j) for j in range(nq) for x in range(int(bT[0, 0, j, 3]))}
  assert pairs == pairsT == {(2, 1), (3, 0), (3, 2), (3, 3)}
  assert np.asarray(bT)[0, 1, :, 3].tolist() == [4, 4, 4, 4]


def test_errors_are_one_line_and_name_the_argument():
  p = make_problem(1, T=64, H=16)
  kw = dict(p.kw)
  with pytest.raises(ValueError, match="kv_blocks_BNQL must be int"):
    block_sparse_attention(p.q, p.k, p.v, **{**kw, "kv_blocks_BNQL": kw["kv_blocks_BNQL"][:, :1]})
  with pytest.raises(ValueError, match="head_mode_BN must be"):
    block_sparse_attention(p.q, p.k, p.v, **{**kw, "head_mode_BN": jnp.zeros((1, 3), jnp.int32)})
  with pytest.raises(ValueError, match="head_dim 24"):
    x = jnp.zeros((1, 64, 4, 24))
    block_sparse_attention(x, x[:, :, :2], x[:, :, :2], **kw, **TRITON)
  with pytest.raises(ValueError, match="unknown impl"):
    block_sparse_attention(p.q, p.k, p.v, **kw, impl="cuda")
  assert kernel_support("triton", (1, 64, 4, 16), (1, 64, 2, 16), jnp.float32, 16, 16) is None
  assert "powers of two" in kernel_support("triton", (1, 96, 4, 16), (1, 96, 2, 16),
                                           jnp.float32, 48, 16)


def _mask_spec(p, window=None, sinks=0):
  kw = p.kw
  T, S = p.q.shape[1], p.k.shape[1]
  pos = kw.get("q_positions_BT", jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T)))
  kvpos = kw.get("kv_positions_BS", jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (1, S)))
  return ops.MaskSpec(pos, kvpos, kw.get("q_segment_ids_BT"), kw.get("kv_segment_ids_BS"),
                      active=kw.get("active"), window=window, sinks=sinks,
                      block_lists=ops.BlockLists(kw["kv_blocks_BNQL"], kw["head_mode_BN"],
                                                 block_q=kw["block_q"], block_k=kw["block_k"]))


def test_ops_dispatch_pallas_equals_reference_with_gradients():
  p = make_problem(5, B=2, T=64, N=4, K=2, segments=2, window=20, sinks=2, active="head")
  mask = _mask_spec(p, window=20, sinks=2)

  def f(impl):
    def loss(q, k, v):
      o = ops.attention(q, k, v, mask, impl=impl)
      return jnp.sum(o * p.ct), o
    (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(p.q, p.k, p.v)
    return o, g

  o_p, g_p = jax.jit(lambda: f("pallas"))()
  o_r, g_r = jax.jit(lambda: f("reference"))()
  np.testing.assert_allclose(o_p, o_r, atol=2e-5)
  for a, b in zip(g_p, g_r):
    np.testing.assert_allclose(a, b, atol=5e-5)
  # the same spec through the block-sparse package directly (no second mask description); one
  # jitted program (eagerly: op by op, each op compiled alone)
  want = jax.jit(lambda: reference_attention(p.q, p.k, p.v, mask.dense_mask())[0])()
  np.testing.assert_allclose(o_r, want, atol=1e-6)
  x = jnp.zeros((2, 64, 4, 24))
  with pytest.raises(ValueError, match="impl='pallas' cannot take this call: .*head_dim 24"):
    ops.attention(x, x[:, :, :2], x[:, :, :2], mask, impl="pallas")


_H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
_A100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu"))
_TPU = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="TPU v5 lite", num_cores=1, platform="tpu"))


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_ops_exports_the_block_sparse_kernel_for_cuda_and_tpu(impl):
  """auto and pallas with block lists lower the block-sparse kernels (forward and backward), not
  the O(T*S) reference, for cuda (Hopper: Mosaic GPU, no Triton call; an A100: Triton) and tpu
  (Mosaic)."""
  B, T, N, K, H = 1, 256, 4, 2, 64
  lists = jnp.asarray(ssa_lists(B, N, T, T, block_q=128, block_k=128, sink_blocks=1,
                                local_blocks=1))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = ops.MaskSpec(pos, pos, window=128, sinks=4, contiguous=True, block_lists=ops.BlockLists(
      lists, jnp.asarray([[0, 1, 1, 0]], jnp.int32), block_q=128, block_k=128))
  sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]

  def f(q, k, v):
    return jax.grad(lambda *a: ops.attention(*a, mask, impl=impl).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  for mesh, platform in ((_H100, "cuda"), (_A100, "cuda"), (_TPU, "tpu")):
    with jax.sharding.use_abstract_mesh(mesh):
      # the lowering jax.export runs (without its serialization)
      text = jax.jit(f).trace(*sds).lower(lowering_platforms=(platform,)).as_text()
    if mesh is _H100:
      for name in ("block_sparse_fwd_mgpu", "block_sparse_dq_mgpu", "block_sparse_dkv_mgpu"):
        assert f"{name}_" in text and f"{name}_mosaic_gpu" in text.replace("_nb_", "_"), name
      assert "triton" not in " ".join(re.findall(r"custom_call @([\w.$]+)", text))
    elif platform == "cuda":
      for name in ("block_sparse_fwd", "block_sparse_dq", "block_sparse_dkv"):
        assert f'name = "{name}' in text, name
      assert "mgpu" not in text
    else:
      assert text.count("tpu_custom_call") == 3
    # no dense logits (under auto, the CPU reference branch's residual slots stay in the text)
    assert impl == "auto" or f"{T}x{T}xf32" not in text


def test_auto_on_cpu_is_the_reference():
  p = make_problem(2, T=64)
  mask = _mask_spec(p)
  a = ops.attention(p.q, p.k, p.v, mask)
  r = reference_attention(p.q, p.k, p.v, mask.dense_mask())[0]
  np.testing.assert_array_equal(a, r)
  out = block_sparse_attention(p.q, p.k, p.v, **p.kw)   # the package's auto on CPU, too
  np.testing.assert_array_equal(out, r)
  m = dense_mask(mask.q_positions_BT, mask.kv_positions_BS,
                 kv_blocks_BNQL=p.kw["kv_blocks_BNQL"], head_mode_BN=p.kw["head_mode_BN"],
                 block_q=16, block_k=16)
  assert m.shape == (1, 4, 64, 64)
