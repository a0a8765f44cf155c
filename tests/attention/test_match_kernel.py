"""MATCH's training attention through the block-sparse kernel (options.attention_path,
docs/schemes/match.md): the whole-row block-sparse call (block lists in head mode
HEAD_WINDOW_BLOCKS) equals the per-block gathered path, values and gradients in float32; 'auto'
takes it exactly where the resolver has a kernel for it (Hopper), and the Hopper program of a
MATCH training step runs the Mosaic GPU block-sparse kernels with no gathered K/V copy."""
import contextlib
import functools
import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from _train_helpers import host_init
from condattn_jax import attention, ops
from condattn_jax.attention.match import layer as match_layer
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder
from pallas_kernels.backends import Platform


def _with(cfg, **kw):
  return cfg.replace(scheme_kwargs=dict(cfg.scheme_options, **kw))


def test_block_sparse_path_equals_gathered_path_fp32(monkeypatch):
  """Two SWA + retrieval layers (OLMo-2: post-norm, GQA 4:2), two packed documents with
  restarting positions and padding in row 1: logits and every parameter gradient of the
  block-sparse path (one ops.attention call over the row: the reference on CPU) == the gathered
  path's. The block-sparse run never calls the gathered path. Recomputed retrieval
  (retrieved_kv='recompute': the retrieved K/V appended after the row's keys): the forward on
  both paths agrees too."""
  base = ModelConfig(family="olmo2", num_layers=2, vocab_size=32).replace(qk_norm="full",
                                                                         post_norm=True)
  cfg = attention.configure(base, "match", window=8, chunk=4, top_k=2)
  T = 43
  tok = jax.random.randint(jax.random.PRNGKey(1), (2, T), 1, 8)
  params = host_init(cfg, 0)
  seg = np.ones((2, T), np.int32)
  seg[1, 25:] = 2
  seg[1, 41:] = 0
  pos = np.stack([np.arange(T), np.where(seg[1] == 0, 0, np.r_[np.arange(25), np.arange(18)])])
  pos, seg = jnp.asarray(pos, jnp.int32), jnp.asarray(seg)
  ct = jnp.cos(jnp.arange(2 * T * 32).reshape(2, T, 32)) * (seg != 0)[..., None]

  def run(path):
    c = _with(cfg, attention_path=path)

    def loss(p):
      out, aux = Decoder(c).apply({"params": p}, tok, pos, seg)
      return jnp.sum(out * ct), (out, aux["retrieved"])
    (_, (out, frac)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(out), np.asarray(frac), g

  want, frac, g_want = run("gathered")
  assert float(frac.min()) > 0.2  # every layer retrieves

  def no_gather(*a, **k):
    raise AssertionError("the block-sparse path ran the gathered attention")
  monkeypatch.setattr(match_layer.MatchLayer, "_block_attend", no_gather)
  got, _, g_got = run("block_sparse")
  live = np.asarray(seg) != 0
  np.testing.assert_allclose(got[live], want[live], atol=2e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5 * float(np.abs(b).max()) + 1e-7,
                               err_msg=jax.tree_util.keystr(path))
  # recomputed retrieved K/V (appended after the row's keys, listed by their block): forward
  monkeypatch.undo()
  fwd = lambda path: np.asarray(jax.jit(Decoder(_with(cfg, retrieved_kv="recompute",
                                                      attention_path=path)).apply)(
      {"params": params}, tok, pos, seg)[0])
  np.testing.assert_allclose(fwd("block_sparse")[live], fwd("gathered")[live], atol=2e-5)


_H100 = Platform("cuda", "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("platform,chunk,H,dtype,impl,want", [
    (_H100, 128, 128, jnp.bfloat16, "auto", True),
    (Platform("cuda", "NVIDIA H200"), 128, 64, jnp.float16, "pallas", True),
    (_H100, 64, 128, jnp.bfloat16, "auto", False),        # the kernel's block_q is 128
    (_H100, 128, 128, jnp.float32, "auto", False),        # wgmma: bf16 / f16
    (_H100, 128, 128, jnp.bfloat16, "reference", False),  # impl asks for no kernel
    (Platform("cuda", "NVIDIA A100-SXM4-80GB"), 128, 128, jnp.bfloat16, "auto", False),
    (Platform("tpu", "TPU v5 lite"), 128, 128, jnp.bfloat16, "auto", False),
    (Platform("cpu"), 128, 128, jnp.bfloat16, "auto", False),
])
def test_auto_takes_the_block_sparse_path_where_a_kernel_runs_it(platform, chunk, H, dtype, impl,
                                                                 want):
  from condattn_jax.attention.match import MatchOptions
  o = MatchOptions(window=1024, chunk=chunk, impl=impl)
  assert match_layer.block_sparse_runs(o, (1, 4096, 32, H), (1, 4096, 8, H), dtype,
                                       platform) is want


def test_window_blocks_resolve_only_to_kernels_that_run_mode_2():
  shapes = ((1, 1024, 8, 128), (1, 1024, 2, 128), jnp.bfloat16)
  st = dict(block_q=128, block_k=128, window_blocks=True)
  be, _ = ops.resolve("block_sparse", "auto", *shapes, _H100, **st)
  assert be.name == "mosaic_gpu"
  for plat in (Platform("cuda", "NVIDIA A100-SXM4-80GB"), Platform("tpu", "TPU v5 lite")):
    be, why = ops.resolve("block_sparse", "auto", *shapes, plat, **st)
    assert be is None and any("HEAD_WINDOW_BLOCKS" in w for w in why), why
    assert ops.resolve("block_sparse", "auto", *shapes, plat, block_q=128,
                       block_k=128)[0] is not None


_DISABLED = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def test_hopper_training_step_runs_the_block_sparse_kernel_without_gathered_keys():
  """jax.export of a MATCH layer's forward + backward for an (abstract) H100, chunk 128, window
  128, top-2, bf16: 'auto' lowers three Mosaic GPU calls (fwd, dq, dk/dv) and no Triton call; the
  gathered path (control) gathers per-block K/V ([B*G, w+c-1+k*c, K, H], padded to whole kv
  tiles) and runs the compacted kernel's calls. (The exported text also holds the gathered path
  as the branch for other platforms, so it is the kernels that tell the programs apart.)"""
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=1, vocab_size=64, hidden_size=128,
                     num_heads=2, num_kv_heads=1, head_dim=64, dtype="bfloat16")
  cfg = attention.configure(base, "match", window=128, chunk=128, top_k=2)
  B, T = 1, 512
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
  tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
  params = jax.eval_shape(lambda t: nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(0), t)),
                          jnp.zeros((B, T), jnp.int32))["params"]
  gathered_kv = f"tensor<{B * T // 128}x512x1x64xbf16>"  # w+c-1+k*c = 511 keys, padded

  def program(path):
    c = _with(cfg, attention_path=path)
    loss = lambda p, t: jnp.sum(Decoder(c).apply({"params": p}, t)[0].astype(jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"],
                               disabled_checks=_DISABLED)(params, tok).mlir_module()

  mosaic = lambda targets: [t for t in targets if t.startswith("mosaic_gpu")]
  targets = re.findall(r"custom_call @([\w.$]+)", program("auto"))
  assert len(mosaic(targets)) == 3, targets
  assert not [t for t in targets if "triton" in t.lower()], targets
  # the gathered path (control): its per-block keys, padded to whole kv tiles, run the
  # compacted Mosaic GPU kernel (forward and backward) instead
  text = program("gathered")
  assert gathered_kv in text and len(mosaic(re.findall(r"custom_call @([\w.$]+)", text))) > 3


def _serving_cfg(**kw):
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=3, vocab_size=16)
  return attention.configure(base, "match", **{**dict(window=6, chunk=3, top_k=2, swa_ratio=0.7,
                                                      prefill_last=4), **kw})


@pytest.mark.slow
def test_recomputed_retrieval_block_sparse_equals_gathered():
  """Recomputed retrieved K/V on the block-sparse path (the retrieved chunks' K/V appended after
  the keys, listed by their block): the engine's chunked prefill (5-token calls over 3-token
  blocks: calls that start inside a block, several blocks a call, the window ring; decode steps
  gather) == the gathered path's serving forward (retrieved_kv='recompute', last-m retrieval),
  and that forward on the block-sparse path == gathered (fp32)."""
  from condattn_jax.attention import match
  from condattn_jax.inference import Engine
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(1, 6, n)) for n in (29, 22, 9)]
  cfg = _serving_cfg(attention_path="block_sparse")
  params = host_init(cfg, 0)
  gen = Engine(cfg, params, cache_len=48, prefill_chunk=5).generate(prompts, 7, return_logits=True)
  seqs = [p + g[:-1] for p, g in zip(prompts, gen.tokens)]
  L = max(map(len, seqs))
  tok, seg = np.zeros((3, L), np.int32), np.zeros((3, L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  P = np.asarray([len(p) for p in prompts], np.int32)

  def serving(c):
    return np.asarray(jax.jit(lambda p: match.serving_forward(Decoder(c), p, tok, pos, seg, None,
                                                              prompt_lengths_B=P)[0])(params))
  want = serving(_serving_cfg(attention_path="gathered"))
  got = serving(cfg)
  live = seg != 0
  np.testing.assert_allclose(got[live], want[live], atol=2e-5)
  for b, p in enumerate(prompts):
    np.testing.assert_allclose(gen.logits[b], want[b, len(p) - 1:len(seqs[b])], atol=1e-4,
                               rtol=0)


@pytest.mark.slow
def test_recomputed_retrieval_layout_on_the_mosaic_gpu_kernel_interpret():
  """The keys layout of recomputed retrieval (layer._retrieved_attend: the row's keys, then each
  block's retrieved chunks at position layer._BEFORE_ALL, listed by their block, HEAD_WINDOW_
  BLOCKS) on the Mosaic GPU kernel in interpret mode == the reference, forward and gradients
  (bf16); without the lists the output is far off. (At -2^30 the kernel hid the listed keys: it
  tests a listed pair's distance against 2^30.) One query head (the layout is what this checks;
  GQA runs in tests/kernels/test_block_sparse_mgpu.py), two blocks of 128 queries, each with one
  retrieved chunk of 128 keys, the last one's tail padding (segment id 0)."""
  from pallas_kernels.block_sparse import block_sparse_attention
  B, T, N, K, H, c, R, w = 1, 256, 1, 1, 64, 128, 128, 100
  G, S = T // c, T + T // c * R
  rng = np.random.default_rng(0)  # host draws: no random program compiled
  rnd = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.bfloat16))
  q, k, v, ct = rnd(B, T, N, H), rnd(B, S, K, H), rnd(B, S, K, H), rnd(B, T, N, H)
  kw = dict(block_q=c, block_k=c, window=w,
            q_positions_BT=jnp.arange(T, dtype=jnp.int32)[None] + 1000,
            kv_positions_BS=jnp.concatenate([jnp.arange(T, dtype=jnp.int32) + 1000, jnp.full(
                (G * R,), match_layer._BEFORE_ALL, jnp.int32)])[None],
            q_segment_ids_BT=jnp.ones((B, T), jnp.int32).at[0, :5].set(0),
            kv_segment_ids_BS=jnp.ones((B, S), jnp.int32).at[0, T + 200:].set(0))
  first = T // c + jnp.arange(G)[:, None] * (R // c)
  lists = jnp.broadcast_to(first + jnp.arange(R // c), (B, N, G, R // c)).astype(jnp.int32)
  mode = jnp.full((B, N), ops.HEAD_WINDOW_BLOCKS, jnp.int32)

  @functools.partial(jax.jit, static_argnames=("impl", "interpret"))  # one program a kernel
  def run(impl, lists=lists, **x):
    def loss(q, k, v):
      o = block_sparse_attention(q, k, v, lists, mode, impl=impl, **kw, **x)
      return jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32)), o
    (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (o, *g)
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                           / jnp.linalg.norm(b.astype(jnp.float32)))
  want = run("reference")
  for name, a, b in zip(("out", "dq", "dk", "dv"), run("mosaic_gpu", interpret=True), want):
    assert rel(a, b) < 1e-2, (name, rel(a, b))
  assert rel(run("reference", lists=jnp.full_like(lists, -1))[0], want[0]) > 0.5


def test_hopper_engine_prefill_runs_the_block_sparse_kernel(caplog):
  """An engine prefill call (decode mode, cache written, 256 tokens with the prompt lengths:
  recomputed retrieval for the last m) exported for an (abstract) H100, one SWA layer (what is
  checked is each SWA layer's; a second one doubled the trace and lowering): the SWA layer runs the
  Mosaic GPU block-sparse forward and hold no gathered [B*G, w+c-1+k*c] K/V tensor; the gathered
  path's per-block keys (w+c-1+k*c = 511, which no GPU kernel takes) are padded to 512 and run
  the compacted Mosaic GPU kernel (the aux rows' own attention and, in a call none of whose
  blocks retrieves, the window's, are the compacted kernel's in both programs). Neither lowering warns that a call
  fell back to the O(T*S) reference (the block-sparse program traces the gathered path too, in
  the branch for other platforms)."""
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=1, vocab_size=64, hidden_size=128,
                     num_heads=2, num_kv_heads=1, head_dim=64, dtype="bfloat16")
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
  B, C, L = 1, 256, 1024
  i32 = lambda s: jax.ShapeDtypeStruct(s, jnp.int32)
  G = -(-(C + 127) // 128)  # blocks a call of C tokens from any start touches
  kv = lambda n: f"tensor<{B * G}x{n}x1x64xbf16>"

  model = lambda path: Decoder(attention.configure(base, "match", window=128, chunk=128,
                                                   top_k=2, prefill_last=200,
                                                   attention_path=path))
  # the parameters' and the cache's shapes, traced once (the attention path changes neither)
  m = model("auto")
  params = jax.eval_shape(lambda t: nn.unbox(m.init(jax.random.PRNGKey(0), t)),
                          jnp.zeros((1, 8), jnp.int32))["params"]
  cache = jax.eval_shape(lambda p, t: m.apply({"params": p}, t, decode=True, cache_len=L,
                                              unroll_layers=True, mutable=["cache"])[1]["cache"],
                         params, i32((B, 1)))

  def program(path):
    m = model(path)

    def step(p, c, t, pos, valid, P):
      return m.apply({"params": p, "cache": c}, t, pos, valid, decode=True, cache_len=L,
                     fields={"prompt_len_B": P}, unroll_layers=True, mutable=["cache"])[0]
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=_DISABLED)(
          params, cache, i32((B, C)), i32((B, C)), i32((B, C)), i32((B,))).mlir_module()

  def kernels(text):  # the Mosaic GPU kernels' names (their custom calls' locations)
    names = []
    for line in re.findall(r"^.*custom_call @mosaic_gpu.*$", text, re.M):
      loc = re.search(r"loc\((#loc\d+)\)\s*$", line).group(1)
      names += re.findall(r'"(\w+)_mgpu\w*/', re.search(rf"^{loc} = (.*)$", text, re.M).group(1))
    return names
  ops._warn_once.cache_clear()  # (a warning is logged once a process)
  with caplog.at_level(logging.WARNING):
    auto, gathered = kernels(program("auto")), program("gathered")
  assert not [r for r in caplog.records if "no kernel takes this call" in r.getMessage()]
  # compacted forwards: the aux rows' attention and (a call no block of which retrieves) the
  # window's, in both; gathered: the per-block call's too (unpadded: the reference)
  fwd = lambda names: names.count("compact_attention_fwd")
  assert "block_sparse_fwd" in auto and "block_sparse_fwd" not in kernels(gathered), auto
  assert fwd(kernels(gathered)) > fwd(auto) >= 2, (auto, kernels(gathered))
  assert kv(512) in gathered and kv(511) not in gathered
