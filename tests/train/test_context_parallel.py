"""Context parallelism (condattn_jax/parallel/context.py) on 8 fake CPU devices, fp32: a row's
tokens split over the `sequence` mesh axis (zigzag layout) give the unsharded model's loss,
metrics and gradients (<= 1e-5), for dense, L2A, AHA, Elastic and MATCH, with sequence x fsdp x
tensor meshes, the all-gather and ring strategies and local windows crossing shard boundaries
(halo exchange); the schemes that do not run sequence-parallel are refused at config validation
in one line."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import ROOT, assert_trees_close, host, random_params
from condattn_jax import ops
from condattn_jax.attention import get_scheme
from condattn_jax.data import make_global_batch
from condattn_jax.parallel import context
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop
from condattn_jax.train import sharding as shd
from condattn_jax.train.cli import load_recipe
from condattn_jax.train.step import make_loss_and_grads


def _mesh(data, fsdp, sequence, tensor):
  devices = np.asarray(jax.devices()[:8]).reshape(data, fsdp, sequence, tensor)
  return jax.sharding.Mesh(devices, shd.MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(shd.MESH_AXES))


def _packed(B, T):
  """Segment ids (documents of different lengths, a padded tail, a row of one document) and
  positions restarting in each document."""
  seg = np.ones((B, T), np.int32)
  seg[0, 11:], seg[0, T - 5:] = 2, 0
  seg[1, 5:], seg[1, 20:] = 2, 3
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
  return seg, pos


# ------------------------------------------------------------------------------------------------
# The layout
# ------------------------------------------------------------------------------------------------

def test_zigzag_layout_balances_causal_work_and_round_trips():
  order = context.zigzag_order(16, 2)  # 4 chunks of 4: shard 0 holds chunks 0, 3; shard 1: 1, 2
  np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  T, n = 64, 4
  order = context.zigzag_order(T, n)
  work = [int(sum(t + 1 for t in part)) for part in order.reshape(n, T // n)]  # causal keys
  assert len(set(work)) == 1, work
  x = jnp.arange(2 * T).reshape(2, T)
  np.testing.assert_array_equal(context.from_layout(context.to_layout(x, n), n), x)
  with pytest.raises(ValueError, match="must be a multiple of 8"):
    context.zigzag_order(60, 4)
  # what a layer reads to take its row back to token order: n only inside the step's layout
  assert context.to_layout(x, 1) is x and context.from_layout(x, 1) is x
  with shd.mesh_context(_mesh(1, 1, 4, 2)):
    with context.zigzag_layout():
      assert context.layout_size() == 4
    assert context.layout_size() == 1
  with context.zigzag_layout():
    assert context.layout_size() == 1  # no sequence axis


# ------------------------------------------------------------------------------------------------
# Attention per shard against the unsharded reference
# ------------------------------------------------------------------------------------------------

# (mesh (data, fsdp, sequence, tensor), strategy, window, per-head active, T): window 5 with 4
# shards of 2 chunks of 128 tokens is the halo path (every window crosses a chunk edge; the halo
# is rounded up to a whole chunk: kv a multiple of 128); window 12 does not fit a 4-token chunk's
# halo and runs the strategy; the all-gather over 8 shards puts the gathered zigzag row back in
# natural order (context.natural_order) before the kernel. The halo moves by ppermute or (the
# last case, halo_exchange='all_gather': the step then holds no collective-permute) by an
# all-gather of every shard's chunk tails.
ATTN_CASES = [((1, 2, 2, 2), "ring", None, False, 32), ((1, 2, 4, 1), "all_gather", 5, True, 1024),
              ((2, 1, 4, 1), "ring", 12, False, 32), ((1, 1, 8, 1), "all_gather", None, True, 64),
              ((1, 1, 4, 2), "all_gather", 5, False, 1024, "all_gather")]


@pytest.mark.parametrize("mesh,strategy,window,per_head,T,halo_by",
                         [c + ("ppermute",) * (6 - len(c)) for c in ATTN_CASES])
def test_attention_per_shard_equals_the_unsharded_reference(mesh, strategy, window, per_head, T,
                                                            halo_by):
  rng = np.random.default_rng(0)
  B, N, K, H, n = 2, 4, 2, 8, mesh[2]
  q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
  seg, pos = map(jnp.asarray, _packed(B, T))
  active = jnp.asarray(rng.random((B, T, N) if per_head else (B, T)) < 0.5)
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)

  def loss(q, k, v, sharded):
    arrays = (q, k, v, seg, pos, active)
    if sharded:
      arrays = tuple(context.to_layout(x, n) for x in arrays)
    q, k, v, s, p, a = arrays
    mask = ops.MaskSpec(p, p, s, s, active=a, window=window, contiguous=True)
    with context.zigzag_layout(sharded):
      out = ops.attention(q, k, v, mask, impl="reference")
    out = context.from_layout(out, n) if sharded else out
    return jnp.sum(out * weights), out

  grad = lambda sharded: jax.value_and_grad(lambda *a: loss(*a, sharded), argnums=(0, 1, 2),
                                            has_aux=True)
  (want_loss, want), want_g = jax.jit(grad(False))(q, k, v)  # one program, not op by op
  f = jax.jit(grad(True))
  with shd.mesh_context(_mesh(*mesh), sequence_attention=strategy), \
      context.halo_exchange(halo_by):
    (got_loss, got), got_g = f(q, k, v)
    jaxpr = str(f.trace(q, k, v).jaxpr)
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all() and all(np.isfinite(np.asarray(g)).all() for g in got_g)
  np.testing.assert_array_equal(np.asarray(got)[0, T - 5:], 0.0)  # padding queries: zeros
  assert "shard_map" in jaxpr
  # every mesh axis is named in the specs (size-1 axes too): no psum of dQ / dK / dV over the
  # axes the inputs would be replicated over (one all-reduce per attention call in the backward)
  assert "psum" not in jaxpr
  halo = window is not None and window - 1 <= T // (2 * n)
  if halo and halo_by == "all_gather":  # the tails only: [n, 2, B, halo, K, H] per tensor
    assert "ppermute" not in jaxpr and "all_gather" in jaxpr
    gathered = re.findall(r"\w+\[([\d,]*)\] = all_gather", jaxpr)
    assert gathered and all(g.startswith(f"{n},2,{B},128") for g in gathered), gathered
  elif halo or strategy == "ring":  # K/V move by ppermute only: no full-row gather
    assert "ppermute" in jaxpr and "all_gather" not in jaxpr
  else:
    assert "all_gather" in jaxpr


def test_kernels_per_shard_leave_no_gradient_psum_over_size_one_axes():
  """ops.per_shard (a kernel under a data x fsdp x tensor mesh, sequence 1) names the rules
  table's size-1 axes in its shard_map specs, as context.attention does: the backward holds no
  psum of dQ / dK / dV over an axis the inputs would be replicated over (it had one per
  attention call, over the size-1 sequence axis)."""
  B, T, N, K, H = 4, 128, 4, 2, 16
  q, k = jnp.ones((B, T, N, H)), jnp.ones((B, T, K, H))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = ops.MaskSpec(pos, pos, active=jnp.ones((B, T), bool), contiguous=True)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ops.attention(q, k, v, mask, impl="pallas")),
                       argnums=(0, 1, 2)))
  with shd.mesh_context(_mesh(2, 2, 1, 2)):
    jaxpr = str(f.trace(q, k, k).jaxpr)
  assert "shard_map" in jaxpr and "psum" not in jaxpr


@pytest.mark.parametrize("mesh,strategy,window", [((1, 1, 4, 2), "all_gather", None),
                                                   ((2, 1, 4, 1), "ring", 12)])
def test_block_lists_split_with_the_query_blocks(mesh, strategy, window):
  """Block lists (per head and query block: the kv blocks it may see; Elastic's / MATCH's masks)
  under sequence parallelism: their query-block axis laid out like the tokens (zigzag, whole
  blocks per chunk), their kv entries blocks of the natural row (the gathered K/V are put back
  in natural order): out and dQ / dK / dV == the unsharded reference (fp32, 1e-5), heads mixing
  HEAD_FULL, HEAD_BLOCKS and (with a window) HEAD_WINDOW_BLOCKS, padded lists, documents; lists take the gather path whatever the
  strategy (ring steps and halos hold other key blocks). A block_q that does not divide a
  chunk is refused in one line."""
  rng = np.random.default_rng(0)
  B, T, N, K, H, bq, bk, L, n = 2, 128, 4, 2, 8, 8, 16, 3, mesh[2]
  Q = T // bq
  q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
  seg, pos = map(jnp.asarray, _packed(B, T))
  last = (np.arange(Q) * bq + bq - 1) // bk  # a query block's last causal kv block
  lists = (rng.random((B, N, Q, L)) * (last[None, None, :, None] + 1)).astype(np.int32)
  lists[..., -1] = np.where(rng.random((B, N, Q)) < 0.3, -1, lists[..., -1])
  mode = jnp.asarray([[ops.HEAD_FULL, ops.HEAD_BLOCKS, ops.HEAD_BLOCKS, ops.HEAD_FULL],
                      [ops.HEAD_BLOCKS] * N], jnp.int32)
  if window:  # MATCH's "window OR its listed blocks" heads too
    mode = mode.at[:, 2].set(ops.HEAD_WINDOW_BLOCKS)
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)

  def loss(q, k, v, sharded, block_q=bq):
    arrays, kb = (q, k, v, seg, pos), jnp.asarray(lists)
    if sharded:
      arrays, kb = tuple(context.to_layout(x, n) for x in arrays), context.to_layout(kb, n, axis=2)
    q, k, v, s, p = arrays
    bl = ops.BlockLists(kb if block_q == bq else kb[:, :, ::block_q // bq], mode, block_q=block_q,
                        block_k=bk, window_blocks=bool(window))
    mask = ops.MaskSpec(p, p, s, s, window=window, block_lists=bl, contiguous=True)
    with context.zigzag_layout(sharded):
      out = ops.attention(q, k, v, mask, impl="reference")
    out = context.from_layout(out, n) if sharded else out
    return jnp.sum(out * weights), out

  grad = lambda sharded: jax.value_and_grad(lambda *a: loss(*a, sharded), argnums=(0, 1, 2),
                                            has_aux=True)
  (_, want), want_g = jax.jit(grad(False))(q, k, v)  # one program, not op by op
  assert 0 < np.mean(np.asarray(want) == 0) < 0.5  # the lists hide keys, not every query
  f = jax.jit(grad(True))
  with shd.mesh_context(_mesh(*mesh), sequence_attention=strategy):
    (_, got), got_g = f(q, k, v)
    jaxpr = str(f.trace(q, k, v).jaxpr)
    with pytest.raises(ValueError, match=r"BlockLists.block_q=32 must divide a zigzag chunk "
                                         r"\(T / 2n = 16 tokens\)"):
      jax.eval_shape(lambda: loss(q, k, v, True, block_q=32))  # traced: no eager op compiled
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, atol=1e-5)
  assert "all_gather" in jaxpr and "ppermute" not in jaxpr


@pytest.mark.parametrize("n", [2, 4, 8])
def test_gathered_keys_reach_the_kernel_sorted_so_no_shard_walks_future_tiles(monkeypatch, n):
  """The compacted kernels walk, per query tile, the kv tiles between the first and the last one
  holding a visible pair (pallas_kernels/compact_attention/compaction.tile_bounds). The K/V that
  context.attention hands a shard's kernel must be in position order: in the gathered zigzag
  order the last shard walked 4n - 1 chunks of keys where 2n + 1 hold its causal pairs (its step
  then sets everyone's pace: 1.4x the attention work at n = 2, 1.67x at 4, 1.82x at 8)."""
  from pallas_kernels.compact_attention import compaction
  B, N, K, H, bq, bk = 1, 2, 1, 8, 8, 8
  T = 2 * n * 4 * bq  # chunks of 4 query tiles
  C = T // (2 * n)

  def visits(q, k, v, mask):  # a kernel branch that returns the tile visits of its bounds
    qp, kp = mask.q_positions_BT, mask.kv_positions_BS
    bounds = compaction.tile_bounds(qp[:, None], jnp.ones(qp[:, None].shape, bool), None, kp, None,
                                    window=None, block_q=bq, block_k=bk)[:, 0]
    walked = jnp.sum(bounds[..., 3] - bounds[..., 0], axis=-1).astype(q.dtype)  # [B]
    return jnp.broadcast_to(walked[:, None, None, None], q.shape)

  monkeypatch.setattr(ops, "_branches", lambda impl, q, mask, scale: {"default": visits})
  pos = context.to_layout(jnp.arange(T, dtype=jnp.int32)[None], n)
  x = jnp.zeros((B, T, N, H), jnp.float32)
  mask = ops.MaskSpec(pos, pos, contiguous=True)
  f = jax.jit(lambda q, k, v: ops.attention(q, k, v, mask, impl="reference"))
  mesh = _mesh(1, 8 // n, n, 1)
  with shd.mesh_context(mesh), context.zigzag_layout():
    got = np.asarray(f(x, x[:, :, :K], x[:, :, :K]))[0, ::T // n, 0, 0]  # one value per shard
  tiles = lambda first_pos: sum(p // bk + 1 for p in range(first_pos + bq - 1, first_pos + C, bq))
  want = [tiles(i * C) + tiles((2 * n - 1 - i) * C) for i in range(n)]  # causal tiles only
  np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------------
# The train step's loss and gradients against one device
# ------------------------------------------------------------------------------------------------

def _config(scheme, mesh, strategy="all_gather"):
  if scheme == "l2a":
    c = load_recipe(f"{ROOT}/configs/l2a_qwen.py:tiny,steps=4,batch=4,seq=32,pairs=4,gap=8,window=4")
    c.model.scheme.compact_impl = "reference"
    c.model.scheme.p_force = 0.5  # some layers take the forced-global (dense) step
    c.model.scheme.lambda_schedule = "constant"  # the regulariser is in the loss at step 0
  elif scheme == "aha":  # olmo2 (post-norm), window 8, per-head actives (sparse mode)
    c = load_recipe(f"{ROOT}/configs/aha_olmo.py:tiny,steps=4,batch=4,seq=32,pairs=4,gap=8")
    c.model.scheme.compact_impl = "reference"
    c.model.scheme.mode = "sparse"
    c.model.scheme.p_force = 0.5
  elif scheme == "elastic":  # XA and SSA block lists mixed per head (STE), boundary pooling
    c = load_recipe(f"{ROOT}/configs/elastic_qwen.py:tiny,steps=4,batch=4,seq=32,pairs=4,gap=8,"
                    "modes=xa_ssa")
  elif scheme == "match":  # window 8, chunks of 2, exact-match retrieval of 2 chunks per block
    c = load_recipe(f"{ROOT}/configs/match_qwen.py:tiny,steps=4,batch=4,seq=32,pairs=4,window=8,"
                    "top_k=2")
  else:
    c = load_recipe(f"{ROOT}/configs/tiny.py:steps=4,batch=4,seq=32,pairs=4")
  c.mesh.data, c.mesh.fsdp, c.mesh.sequence, c.mesh.tensor = mesh
  c.mesh.sequence_attention = strategy
  c.train.progress_bar = False
  c.train.loss_chunk_size = 8  # the chunked CE: per shard under sequence > 1 (whole rows on one)
  # one row per data*fsdp=2 shard per microbatch, as derive_layout sets under sequence > 1, on
  # one device too: L2A's regulariser is per microbatch
  c.train.microbatches = 2
  return c


def _batch(B=4, T=32):
  rng = np.random.default_rng(1)
  seg, pos = _packed(B, T)
  tok = lambda: rng.integers(0, 64, (B, T)).astype(np.int32)
  return dict(inputs=tok(), targets=tok(), segment_ids=seg, positions=pos,
              loss_mask=(seg != 0).astype(np.float32))


def _loss_and_grads(setup, params, batch):
  lg = jax.jit(make_loss_and_grads(setup.model_cfg, setup.config.train),
               in_shardings=(setup.param_shardings, setup.batch_sharding, None),
               out_shardings=(setup.param_shardings, None))
  with setup.mesh_context():
    grads, metrics = lg(jax.device_put(params, setup.param_shardings),
                        make_global_batch(batch, setup.batch_sharding, 4), 0)
  return host(grads), host(metrics)


# L2A's window 4 and AHA's window 8 take the halo path (4 or 2 shards of 2 chunks of 4 / 8 tokens).
# One mesh per scheme (each case is two compiled steps' worth of the file's time): between them
# the cases hold both strategies (L2A's global branch by ring, the others' by all-gather), 2 and
# 4 sequence shards and a tensor axis beside the sequence axis (AHA, Elastic, MATCH).
MODEL_CASES = {"dense": [((1, 2, 4, 1), "all_gather")],
               "l2a": [((1, 2, 4, 1), "ring")],
               "aha": [((1, 2, 2, 2), "all_gather")],
               "elastic": [((1, 2, 2, 2), "all_gather")],
               "match": [((1, 2, 2, 2), "all_gather")]}


@pytest.fixture(scope="module")
def model_runs():
  out = {}
  batch = _batch()
  for scheme, cases in MODEL_CASES.items():
    one = loop.build(_config(scheme, (1, 1, 1, 1)), devices=[jax.devices()[0]])
    params = random_params(one.abstract_params, seed=3, router_std=0.3)
    out[scheme, "one"] = _loss_and_grads(one, params, batch)
    for mesh, strategy in cases:
      out[scheme, mesh, strategy] = _loss_and_grads(loop.build(_config(scheme, mesh, strategy)),
                                                    params, batch)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("scheme,mesh,strategy",
                         [(s, m, st) for s, cases in MODEL_CASES.items() for m, st in cases])
def test_sequence_parallel_step_equals_one_device(model_runs, scheme, mesh, strategy):
  want_g, want = model_runs[scheme, "one"]
  got_g, got = model_runs[scheme, mesh, strategy]
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert_trees_close(got_g, want_g, atol=1e-5)
  if scheme == "l2a":  # the routing really mixed, the regulariser in the loss
    assert 0.2 < float(want["l2a/sparsity"]) < 0.8
    assert 0.0 < float(want["aux_loss"])
  if scheme == "match":  # the batch really retrieves: some blocks list chunks, not all slots
    from condattn_jax.attention import options
    from condattn_jax.attention.match import block_inputs
    o, b = options(_config("match", mesh)), _batch()
    ids = jax.jit(lambda *a: block_inputs(o, *a)[1]["match_chunks_BGk"])(  # jit: 10x eager's time
        b["inputs"], b["positions"], b["segment_ids"])
    assert 0.0 < float(np.mean(np.asarray(ids) >= 0)) < 1.0
  if scheme in ("l2a", "aha", "elastic"):  # the router is trained (STE and the regulariser)
    router = [x for p, x in jax.tree_util.tree_flatten_with_path(want_g)[0]
              if "router" in jax.tree_util.keystr(p)]
    assert router and all(np.abs(x).max() > 0 for x in router)


# ------------------------------------------------------------------------------------------------
# Config validation
# ------------------------------------------------------------------------------------------------

TINY_RECIPES = {"segmented": "segmented_llama.py:tiny"}


def test_every_scheme_runs_sequence_parallel_or_is_refused_in_one_line():
  from condattn_jax.attention import SCHEMES
  get_scheme("dense")  # loads the built-in schemes
  builtin = sorted(n for n, s in SCHEMES.items()
                   if s.layer_cls.__module__.startswith("condattn_jax.attention"))
  assert set(builtin) == set(MODEL_CASES) | set(TINY_RECIPES), builtin
  for name in builtin:
    scheme = get_scheme(name)
    if scheme.sequence_parallel is True:
      assert name in MODEL_CASES, f"{name} declares sequence_parallel without an equality test"
      continue
    c = load_recipe(os.path.join(ROOT, "configs", TINY_RECIPES[name]))
    c.mesh.sequence = 2
    with pytest.raises(ValueError) as e:
      config_lib.validate_config(c, needs_data=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"config.mesh.sequence=2: scheme {name!r} does not run sequence-parallel")
    assert msg.endswith("set config.mesh.sequence=1.")


def test_match_auxiliary_rows_are_refused_under_sequence_parallelism():
  """MATCH with retrieved_kv='recompute' (auxiliary rows appended to the row) under a sequence
  mesh in the zigzag layout: one line naming the field and the fix (traced only)."""
  from condattn_jax.attention.match import MatchInputs
  from condattn_jax.models.context import LayerContext
  c = _config("match", (1, 1, 2, 1))
  c.model.scheme.retrieved_kv = "recompute"
  setup = loop.build(c, devices=jax.devices()[:2])
  b = _batch()
  ctx = LayerContext(tokens_BT=b["inputs"], positions_BT=b["positions"],
                     segment_ids_BT=b["segment_ids"])
  run = lambda: MatchInputs(setup.model_cfg).apply({}, b["inputs"], ctx)
  with setup.mesh_context(), context.zigzag_layout():
    with pytest.raises(ValueError) as e:
      jax.eval_shape(run)
  assert "\n" not in str(e.value)
  assert str(e.value).startswith("model.scheme.retrieved_kv='recompute' appends auxiliary rows")


def test_row_length_and_strategy_are_checked():
  c = _config("l2a", (1, 1, 8, 1))
  c.data.seq_len = 40  # 16 chunks of 2.5 tokens
  with pytest.raises(ValueError, match=r"config.data.seq_len has 40 tokens: with "
                                       r"config.mesh.sequence=8 .* a multiple of 16"):
    config_lib.validate_config(c, needs_data=False)
  c = _config("dense", (1, 1, 2, 1), strategy="allgather")
  with pytest.raises(ValueError, match=r"config.mesh.sequence_attention='allgather': choose one"):
    config_lib.validate_config(c, needs_data=False)


@pytest.mark.parametrize("recipe,block_field", [("elastic_qwen.py", "block"),
                                                ("match_qwen.py", "chunk")])
@pytest.mark.parametrize("devices", [8, 64, 256])
def test_elastic_and_match_recipes_lay_out_with_sequence_8(recipe, block_field, devices):
  """The real Elastic / MATCH recipes with config.mesh.sequence=8 (no other override) on 8, 64
  and 256 devices: the derived mesh keeps sequence=8, rows and the eval batch divide data*fsdp,
  each microbatch holds one row per data*fsdp shard, the row length check passes and a zigzag
  chunk holds whole query blocks (block lists split with the tokens)."""
  c = load_recipe(os.path.join(ROOT, "configs", recipe))
  c.mesh.sequence = 8
  out, _ = shd.derive_layout(c, devices, num_heads=32, num_kv_heads=8)
  data, fsdp, seq, tensor = shd.mesh_shape(out.mesh, devices)
  assert seq == 8 and data * fsdp * seq * tensor == devices
  shd.check_batch_layout(out, data, fsdp)
  context.check_config(out, seq)
  rows = int(out.data.batch_size) // int(out.train.microbatches)
  assert rows == data * fsdp and int(out.eval.batch_size) % (data * fsdp) == 0
  assert (int(out.data.seq_len) // (2 * seq)) % int(out.model.scheme[block_field]) == 0


@pytest.mark.parametrize("devices,mesh,microbatches", [(8, (1, 1, 8, 1), 48), (64, (1, 8, 8, 1), 6),
                                                       (256, (1, 16, 8, 2), 3)])
def test_the_7b_128k_recipe_with_sequence_8_lays_out(devices, mesh, microbatches):
  """configs/l2a_qwen.py:sequence=8 (the paper's 128K rows over 8 devices, 48 rows) on 8, 64 and
  256 devices: the mesh the build derives, one row per data*fsdp shard per microbatch (no
  hand-set train.microbatches), and every check build() applies passes. A microbatch count set
  by hand stays."""
  c = load_recipe(os.path.join(ROOT, "configs", "l2a_qwen.py:sequence=8"))
  c.model.init_from = os.path.join(ROOT, "tests", "fixtures", "config_only", "qwen2.5-7b")
  out, notes = shd.derive_layout(c, devices, num_heads=28, num_kv_heads=4)
  assert shd.mesh_shape(out.mesh, devices) == mesh
  data, fsdp, seq, _ = mesh
  shd.check_batch_layout(out, data, fsdp)
  context.check_config(out, seq)
  assert int(out.data.seq_len) == 131072 and int(out.data.batch_size) == 48
  assert int(out.train.microbatches) == microbatches == 48 // (data * fsdp)
  assert int(c.train.microbatches) == 1  # the input config is not changed
  assert any(n.startswith(f"train.microbatches 1 -> {microbatches}: mesh sequence=8") for n in notes)
  c.train.microbatches = 3  # set by hand: kept (16 rows per microbatch divide every mesh here)
  assert int(shd.derive_layout(c, devices, num_heads=28, num_kv_heads=4)[0].train.microbatches) == 3
  c.train.microbatches, c.mesh.sequence = 1, 1  # no sequence axis: rows per microbatch as set
  assert int(shd.derive_layout(c, devices, num_heads=28, num_kv_heads=4)[0].train.microbatches) == 1


@pytest.mark.slow
def test_sequence_parallel_step_exports_the_tpu_kernels():
  """The L2A step with sequence 2 x fsdp 2 x tensor 2 exported for TPU from this CPU host
  (loop.export_train_step): every attention runs the Mosaic TPU kernel per shard: the local
  window on [halo ; chunk] and the global branch / its forced-dense step on the gathered K/V
  (no reference attention, whose residuals a lowering-time switch kept in the step)."""
  import collections
  import re
  c = load_recipe(f"{ROOT}/configs/l2a_qwen.py:tiny,steps=4,batch=4,seq=512,width=256,window=64")
  c.mesh.data, c.mesh.fsdp, c.mesh.sequence, c.mesh.tensor = 1, 2, 2, 2
  setup = loop.build(c)
  text = loop.export_train_step(setup, "tpu", device_kind="TPU v5 lite").mlir_module()
  kernels = collections.Counter(re.findall(r'kernel_name = "([^"]+)"', text))
  for k in ("compact_attention_fwd_tpu", "compact_attention_dq_tpu", "compact_attention_dkv_tpu"):
    assert kernels[k] >= 1, kernels
  # no reference scores [B, K, G, T_q, S]: a shard's global (256 queries x 512 gathered keys) or
  # halo (128-query chunks x 256 keys) attention (with model.attention_impl='reference' the halo
  # and forced-dense calls show them: checked by hand)
  assert not re.search(r"tensor<\d+x\d+x\d+x(256x512|128x256)x", text)
  assert "all_gather" in text and "collective_permute" in text  # K/V gather, halo exchange
  assert "platform_index" not in text


@pytest.mark.parametrize("mesh", [(1, 2, 4, 1), (1, 1, 4, 2)])
def test_chunked_cross_entropy_runs_each_shards_own_tokens(mesh):
  """train.step.chunked_token_cross_entropy under a sequence mesh: each shard scores its own
  tokens (chunks of its T / n), so no hidden-state chunk is gathered across devices (chunks of the
  whole row were: GSPMD gathered each chunk to every device, and at the 1.5B 128K shapes
  all-reduced its [8192, V] float32 logits), and the weight's gradient is summed over the shards
  once (not in every chunk); CE, argmax-correct and gradients == the unsharded CE."""
  from condattn_jax.train.step import chunked_token_cross_entropy, token_cross_entropy
  B, T, D, V = 2, 64, 24, 256
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
  t = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  weights = jnp.arange(T, dtype=jnp.float32)

  def run(ce_fn):
    def loss(h, w):
      ce, correct = ce_fn(h, w)
      return jnp.sum(ce * weights), (ce, correct)
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

  (_, want), want_g = jax.jit(run(lambda h, w: token_cross_entropy(h @ w, t)))(h, w)  # 1 program
  f = jax.jit(run(lambda h, w: chunked_token_cross_entropy(h, w, t, 8, jnp.float32)))  # 2 / shard
  m = _mesh(*mesh)
  hs = jax.device_put(h, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(shd.BATCH_AXES,
                                                                                 "sequence")))
  with shd.mesh_context(m):
    (_, got), got_g = f(hs, w)
    hlo = f.lower(hs, w).compile().as_text()
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[1], want[1])
  for g, wg in zip(got_g, want_g):
    np.testing.assert_allclose(g, wg, rtol=1e-4, atol=1e-5)
  moved = [l for l in hlo.splitlines() if re.search(r" (all-gather|all-to-all)\(", l)
           and re.search(rf"\[[\d,]*,{D}\]", l.split("=", 1)[1].split("(")[0])]
  assert not moved, moved
  # the weight's gradient is summed over the shards once, not once per chunk of the loop
  summed = [l for l in hlo.splitlines() if re.search(r" all-reduce\(", l)
            and re.search(rf"\[({D},{V}|{V},{D})\]", l.split("=", 1)[1].split(" all-reduce(")[0])]
  assert len(summed) <= 1, summed


# ------------------------------------------------------------------------------------------------
# What a compiled step moves (condattn_jax/parallel/hlo.py; the dry run's collectives line)
# ------------------------------------------------------------------------------------------------

_HLO = """HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %s = f32[] add(%a, %b)
}

%branch.t (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=3, replica_groups=mesh['data'=1,'sequence'=2] {'sequence'}, to_apply=%add
}

%body.1 (t: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %t = (s32[], bf16[2,8]{1,0}) parameter(0)
  %ag = bf16[4,8]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['data'=1,'sequence'=2] {'sequence'}, dimensions={0}
  %cp = (bf16[2,8]{1,0}, bf16[2,8]{1,0}) collective-permute(%x, %y), channel_id=2, source_target_pairs={{0,1}}
  %c = f32[4]{0} conditional(%pred, %v, %v), true_computation=%branch.t, false_computation=%branch.f
}

ENTRY %main (p0: bf16[2,8]) -> bf16[2,8] {
  %w = (s32[], bf16[2,8]{1,0}) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"28"}}
  %rs = f32[2,8]{1,0} reduce-scatter(%g), channel_id=4, replica_groups=mesh['data'=1,'sequence'=2] {'sequence'}, dimensions={0}, to_apply=%add
}
"""


def test_compiled_collectives_count_loop_trips_and_conditionals():
  from condattn_jax.parallel import hlo
  got = {c["op"]: c for c in hlo.collectives(_HLO)}
  assert set(got) == {"all-reduce", "all-gather", "collective-permute", "reduce-scatter"}
  assert (got["all-gather"]["bytes"], got["all-gather"]["trips"]) == (64, 28)
  assert got["all-gather"]["axes"] == "sequence" and got["collective-permute"]["axes"] == ""
  assert got["collective-permute"]["bytes"] == 64  # a tuple's elements summed
  assert got["all-reduce"]["in_conditional"] and got["all-reduce"]["trips"] == 28
  assert not got["all-gather"]["in_conditional"] and got["reduce-scatter"]["trips"] == 1
  s = hlo.summary(hlo.collectives(_HLO))
  assert s["total_bytes"] == 64 * 28 + 64 * 28 + 16 * 28 + 64 and s["in_conditional"] == 1
  assert list(s["ops"]) == ["all-gather", "collective-permute", "all-reduce", "reduce-scatter"]
  report = dict(params=dict(total=1), model={}, mesh={}, devices=2, global_batch=1, seq_len=8,
                model_line="  model", memory_source="src", collectives=s, compile_seconds=1.0)
  assert ("  collectives per step [src]: 4.00 KiB of results x loop trips; all-gather 1 (1.75 KiB)"
          in loop.format_dry_run(report))
  assert "1 under a conditional" in loop.format_dry_run(report)
