"""pallas_kernels.block_sparse Mosaic GPU (Hopper) kernels on CPU: Pallas' GPU interpret mode
(warpgroups, barriers, TMA copies and wgmma simulated) against the one reference, forward, lse
and dq/dk/dv, over the head modes (HEAD_FULL / HEAD_BLOCKS / HEAD_WINDOW_BLOCKS), GQA, window +
sinks, documents, per-head active sets, a cache layout; the step tables against a brute-force
count; the mode-2 reference; the resolver on an abstract H100. Each kernel case takes 10-30 s."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_sparse import (HEAD_BLOCKS, HEAD_FULL, api, block_sparse_attention,
                                         tables)
from pallas_kernels.block_sparse.tables import HEAD_WINDOW_BLOCKS
from pallas_kernels.block_sparse.testing import compare, make_problem, ssa_lists
from pallas_kernels.compact_attention.reference import dense_mask

MGPU = dict(impl="mosaic_gpu", interpret=True)
W, F, B_ = HEAD_WINDOW_BLOCKS, HEAD_FULL, HEAD_BLOCKS

# (name, problem, head modes)
CASES = [
    # GQA 2:1, mixed FULL / BLOCKS heads, random lists with padding and duplicates, 64-key tiles
    # (dk/dv: one compute warpgroup)
    ("gqa_mixed", dict(T=256, N=4, K=2, L=2), None),
    # every mode in one launch, window + sinks, 128-key tiles (dk/dv: two compute warpgroups),
    # 3 query heads on one kv head (one head per mode; a second WINDOW_BLOCKS head ran the same
    # program path and grew the interpreter's grid by a third)
    ("modes_window_sinks", dict(T=256, N=3, K=1, L=2, window=70, sinks=5, block_k=128),
     [F, B_, W]),
    # packed documents with restarting positions, per-head active sets, mode 2 with a window
    ("documents_active_heads", dict(T=256, N=2, K=1, L=2, segments=2, active="head", window=50),
     [W, B_]),
    # a cache: keys before the queries at sorted positions with a validity mask, float16, two kv
    # heads, 128-key tiles at head_dim 128
    ("cache_f16", dict(T=128, S=256, N=2, K=2, L=3, H=128, kv_positions=True,
                       dtype=jnp.float16, block_k=128), [B_, F]),
]


# (These run in `make test`: `slow` orders them, it does not leave them out. They cover what the
# former default-run backward check ran, every mode on one kv head with window + sinks and packed
# documents at 64-key tiles: modes_window_sinks runs every mode in one launch with window +
# sinks, documents_active_heads WINDOW_BLOCKS / BLOCKS heads on packed documents at 64-key tiles,
# gqa_mixed a FULL head beside BLOCKS heads at 64-key tiles.)
@pytest.mark.slow
@pytest.mark.parametrize("name,kw,modes", CASES, ids=[c[0] for c in CASES])
def test_mosaic_gpu_matches_reference_interpret(name, kw, modes):
  kw = {**dict(H=64, dtype=jnp.bfloat16, block_q=128, block_k=64), **kw}
  p = make_problem(11, **kw)
  if modes is not None:
    p.kw["head_mode_BN"] = jnp.asarray([modes], jnp.int32)
  errs, bad = compare(p, MGPU)
  assert not bad, (name, errs)


def test_mosaic_gpu_ssa_rows_that_see_nothing_interpret():
  """Streaming heads next to a full head, one head whose list is all padding: zeros, lse -inf,
  zero dq; forward only (the backward is in the CASES above)."""
  B, T, N, K, bq = 1, 256, 2, 1, 128
  p = make_problem(3, B=B, T=T, N=N, K=K, H=64, dtype=jnp.bfloat16, block_q=bq, block_k=64,
                   window=100, sinks=4)
  lists = ssa_lists(B, N, T, T, block_q=bq, block_k=64, sink_blocks=1, local_blocks=2).copy()
  lists[0, 1] = -1
  p.kw.update(kv_blocks_BNQL=jnp.asarray(lists), head_mode_BN=jnp.asarray([[F, B_]]))
  errs, bad, (o, lse, _) = compare(p, MGPU, grads=False, outputs=True)
  assert not bad, errs
  assert np.all(np.asarray(o)[0, :, 1] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :, 1]))


def test_window_blocks_reference_is_window_or_listed_blocks():
  """HEAD_WINDOW_BLOCKS in the reference: exactly the union of the window's pairs (a HEAD_FULL
  head's) and the listed blocks' causal pairs (a HEAD_BLOCKS head's without the window)."""
  T, bq = 64, 16
  pos = jnp.asarray(np.arange(T)[None])
  lists = np.asarray([[[[0, -1]], [[0, -1]], [[1, 0]], [[2, -1]]]], np.int32)   # [1, 1, 4, 2]
  lists = jnp.asarray(np.swapaxes(lists, 1, 2))
  kw = dict(kv_blocks_BNQL=lists, block_q=bq, block_k=bq)

  @jax.jit  # the three masks in one program (op by op: each op compiled alone)
  def masks():
    return (api.reference_mask(pos, pos, window=8, sinks=2, head_mode_BN=jnp.asarray([[W]]), **kw),
            dense_mask(pos, pos, window=8, sinks=2),
            dense_mask(pos, pos, head_mode_BN=jnp.asarray([[B_]]), **kw))
  m2, win, blk = masks()
  np.testing.assert_array_equal(np.asarray(m2[0, 0]), np.asarray(win[0] | blk[0, 0]))
  # the listed blocks add pairs outside the window
  assert int(np.asarray(m2).sum()) > int(np.asarray(win).sum())


@pytest.mark.parametrize("segments", [0, 2])
def test_step_tables_match_brute_force(segments):
  """Forward tables: per program the visited tiles are the tiles holding a visible pair of the
  reference mask (exactly with plain positions; a superset with packed documents, whose tile
  bounds come from position ranges), kind 0 only where all pairs are visible; the transposed
  tables list each (head, query tile) pair that visits a kv tile, once."""
  B, T, N, K, bq, bk = 1, 256, 4, 2, 64, 32
  p = make_problem(5, B=B, T=T, N=N, K=K, H=16, block_q=bq, block_k=bk, L=3, window=60, sinks=3,
                   segments=segments)
  p.kw["head_mode_BN"] = jnp.asarray([[F, B_, W, W]], jnp.int32)
  kw = dict(p.kw)
  pos = jnp.arange(T)[None]
  qp, kp = kw.get("q_positions_BT", pos), kw.get("kv_positions_BS", pos)
  qs, ks = kw.get("q_segment_ids_BT"), kw.get("kv_segment_ids_BS")
  cfg = api._Config(backend="mosaic_gpu", scale=1.0, window=60, sinks=3, block_q=bq, block_k=bk,
                    interpret=True, poison=False)

  @jax.jit  # the reference mask and the tables in one program (op by op: each op compiled alone)
  def mask_and_tables(qp, kp, qs, ks, lists, modes):
    mask = api.reference_mask(qp, kp, qs, ks, window=60, sinks=3, kv_blocks_BNQL=lists,
                              head_mode_BN=modes, block_q=bq, block_k=bk)      # [B, N, T, S]
    meta = api._normalise(B, T, T, N, lists, modes, qp, kp, qs, ks, None)
    return mask, api._mgpu_tables(cfg, meta)
  mask, (steps, count) = jax.device_get(
      mask_and_tables(qp, kp, qs, ks, kw["kv_blocks_BNQL"], kw["head_mode_BN"]))
  tiles = mask.reshape(B, N, T // bq, bq, T // bk, bk)
  any_, all_ = tiles.any(axis=(3, 5)), tiles.all(axis=(3, 5))
  for n in range(N):
    for i in range(T // bq):
      e = steps[0, n, i, :count[0, n, i]]
      want = np.flatnonzero(any_[0, n, i])
      if segments:
        assert set(want) <= set(e // 4)
      else:
        np.testing.assert_array_equal(e // 4, want)
      assert np.all((e % 4 == 0) <= all_[0, n, i, e // 4])
  tsteps, tcount = (np.asarray(x) for x in tables.transposed_step_tables(
      jnp.asarray(steps), jnp.asarray(count), K))
  G, nq = N // K, T // bq
  for kh in range(K):
    for j in range(T // bk):
      e = tsteps[0, kh, j, :tcount[0, kh, j]] // 4
      want = [g * nq + i for g in range(G) for i in range(nq)
              if j in steps[0, kh * G + g, i, :count[0, kh * G + g, i]] // 4]
      np.testing.assert_array_equal(e, want)


def test_mode2_rejected_by_triton_and_tpu_kernels():
  p = make_problem(1, T=64, N=2, K=1, H=16)
  p.kw["head_mode_BN"] = jnp.asarray([[W, F]], jnp.int32)
  with pytest.raises(ValueError, match="HEAD_WINDOW_BLOCKS"):
    block_sparse_attention(p.q, p.k, p.v, impl="triton", interpret=True, **p.kw)


def test_auto_on_hopper_resolves_to_mosaic_gpu(monkeypatch):
  """'auto' on an (abstract) H100 picks the Mosaic GPU kernel, never Pallas-Triton; on another
  CUDA GPU it picks Triton; a shape the Mosaic GPU kernel cannot take on Hopper falls back to the
  reference with a warning, not to Triton."""
  monkeypatch.setattr(api, "_platform", lambda: "cuda")
  monkeypatch.setattr(api, "_is_hopper", lambda: True)
  bf16 = jnp.bfloat16
  assert api._resolve_impl("auto", False, (1, 256, 4, 128), (1, 256, 2, 128), bf16, 128,
                           128) == "mosaic_gpu"
  with pytest.warns(api.BlockSparseFallbackWarning, match="mosaic_gpu kernel cannot"):
    assert api._resolve_impl("auto", False, (1, 256, 4, 128), (1, 256, 2, 128), jnp.float32,
                             128, 128) == "reference"
  monkeypatch.setattr(api, "_is_hopper", lambda: False)
  assert api._resolve_impl("auto", False, (1, 256, 4, 128), (1, 256, 2, 128), bf16, 128,
                           128) == "triton"


def test_mosaic_gpu_lowers_for_cuda_without_triton_calls():
  """The Hopper program (jax.export for cuda, forward + backward): Mosaic GPU custom calls for
  all three kernels, no Triton call."""
  from jax import export
  B, T, N, K, H = 1, 512, 4, 2, 128
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
  lists = jnp.asarray(ssa_lists(B, N, T, T, block_q=128, block_k=128, sink_blocks=1,
                                local_blocks=2))
  mode = jnp.asarray([[F, B_, W, B_]], jnp.int32)

  def loss(q, k, v):
    o = block_sparse_attention(q, k, v, lists, mode, window=256, sinks=4, impl="mosaic_gpu")
    return jnp.sum(o.astype(jnp.float32))

  orig = api._platform
  try:
    api._platform = lambda: "cuda"
    text = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                         platforms=["cuda"])(q, kv, kv).mlir_module()
  finally:
    api._platform = orig
  targets = re.findall(r"custom_call @([\w.]+)", text)
  assert targets.count("mosaic_gpu_v2") + targets.count("mosaic_gpu") == 3, targets
  assert not [t for t in targets if "triton" in t.lower()], targets


def test_ops_resolver_picks_mosaic_gpu_for_block_sparse_on_h100():
  """condattn_jax.ops' one resolver over the package's BACKENDS: an (abstract) H100 / H200 gets the
  Mosaic GPU kernel for block-sparse calls, an A100 and a ROCm GPU the Triton kernel, a TPU Mosaic
  TPU, the CPU none (the reference); a float32 call on an H100, which the Mosaic GPU kernel cannot
  take, gets no kernel (the reference) rather than Pallas-Triton, with both reasons."""
  from condattn_jax import ops
  from pallas_kernels.backends import Platform
  from pallas_kernels.block_sparse import BACKENDS
  assert ops.backends("block_sparse") is BACKENDS
  shapes = ((1, 1024, 8, 128), (1, 1024, 2, 128))
  st = dict(block_q=128, block_k=128)
  pick = lambda plat, dtype=jnp.bfloat16: ops.resolve("block_sparse", "auto", *shapes, dtype,
                                                      plat, **st)
  for kind, want in (("NVIDIA H100 80GB HBM3", "mosaic_gpu"), ("NVIDIA H200", "mosaic_gpu"),
                     ("NVIDIA A100-SXM4-80GB", "triton")):
    assert pick(Platform("cuda", kind))[0].name == want, kind
  assert pick(Platform("rocm", "AMD Instinct MI300X"))[0].name == "triton"
  assert pick(Platform("tpu", "TPU v5 lite"))[0].name == "mosaic_tpu"
  assert pick(Platform("cpu"))[0] is None
  be, reasons = pick(Platform("cuda", "NVIDIA H100 80GB HBM3"), jnp.float32)
  assert be is None and "float32" in reasons[0] and "not resolved on Hopper" in reasons[1]
