"""ops: MaskSpec semantics against a brute-force loop, the one reference against per-query numpy,
every implementation against the reference, impl selection per LOWERING platform (exported from
this CPU host for cpu / cuda / tpu), per-shard kernels under the 8-device mesh, loud kernel-import
failures, and one-line errors."""
import contextlib
import dataclasses
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from condattn_jax import ops
from condattn_jax.attention.elastic import composite
from pallas_kernels.backends import Platform

# ------------------------------------------------------------------------------------------------
# Obviously-right references: one (query, key) pair at a time
# ------------------------------------------------------------------------------------------------


def _loop_visible(b, n, t, s, *, qpos, kpos, qseg, kseg, window, sinks, active, blocks, modes,
                  block_q, block_k):
  """The MaskSpec rules, written out for one (row, head, query, key)."""
  if kpos[b, s] > qpos[b, t]:
    return False
  if kseg is not None:
    if kseg[b, s] == 0:
      return False
    if qseg is not None and qseg[b, t] != kseg[b, s]:
      return False
  if window is not None and qpos[b, t] - kpos[b, s] >= window and not kpos[b, s] < sinks:
    return False
  if active is not None and not (active[b, t] if active.ndim == 2 else active[b, t, n]):
    return False
  if blocks is not None and (modes is None or modes[b, n] == ops.HEAD_BLOCKS):
    if s // block_k not in list(blocks[b, n, t // block_q]):
      return False
  return True


def _loop_mask(spec, N):
  """bool [B, N, T, S] from the loop above."""
  a = {f: None if getattr(spec, f) is None else np.asarray(getattr(spec, f))
       for f in ("q_positions_BT", "kv_positions_BS", "q_segment_ids_BT", "kv_segment_ids_BS",
                 "active")}
  bl = spec.block_lists
  kw = dict(qpos=a["q_positions_BT"], kpos=a["kv_positions_BS"], qseg=a["q_segment_ids_BT"],
            kseg=a["kv_segment_ids_BS"], window=spec.window, sinks=spec.sinks, active=a["active"],
            blocks=None if bl is None else np.asarray(bl.kv_blocks_BNQL),
            modes=None if bl is None or bl.head_mode_BN is None else np.asarray(bl.head_mode_BN),
            block_q=None if bl is None else bl.block_q, block_k=None if bl is None else bl.block_k)
  B, T = kw["qpos"].shape
  S = kw["kpos"].shape[1]
  return np.array([[[[_loop_visible(b, n, t, s, **kw) for s in range(S)] for t in range(T)]
                    for n in range(N)] for b in range(B)])


def _loop_attention(q, k, v, mask_BNTS):
  """Per query, numpy float64; a query that sees nothing gives zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  G = N // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      for n in range(N):
        keys = np.flatnonzero(mask_BNTS[b, n, t])
        if keys.size:
          logits = k[b, keys, n // G] @ q[b, t, n] / np.sqrt(H)
          p = np.exp(logits - logits.max())
          out[b, t, n] = (p / p.sum()) @ v[b, keys, n // G]
  return out


def _jit_reference(q, k, v, spec):
  """ops.attention(impl='reference') in one jitted program (eagerly: op by op, each op compiled
  alone)."""
  return jax.jit(lambda q, k, v: ops.attention(q, k, v, spec, impl="reference"))(q, k, v)


def _packed(B, T, rng, tail=3):
  """Contiguous documents restarting positions at 0; the last `tail`-ish tokens are padding."""
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    t, s = 0, 1
    while t < T - tail:
      n = int(rng.integers(1, T - t))
      seg[b, t:t + n] = s
      pos[b, t:t + n] = np.arange(n)
      t, s = t + n, s + 1
  return seg, pos


def _qkv(rng, B, T, S, N, K, H, dtype=jnp.float32):
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))


def _cache_layout(rng, B, T, S):
  """Chunked prefill / decode into a cache: T queries at the end of S slots, some slots empty."""
  kv_pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
  valid = (rng.random((B, S)) < 0.85) * rng.integers(1, 4, (B, S))  # any nonzero id = valid
  return kv_pos[:, S - T:].copy(), kv_pos, valid.astype(np.int32)


# ------------------------------------------------------------------------------------------------
# MaskSpec semantics
# ------------------------------------------------------------------------------------------------

def _spec_cases(rng):
  B, T, S, N = 2, 12, 12, 4
  seg, pos = _packed(B, T, rng)
  qp, kp, valid = _cache_layout(rng, B, 5, S)
  blocks = rng.integers(-1, 3, size=(B, N, 3, 2)).astype(np.int32)  # block_q 4 -> 3 query blocks
  modes = np.array([[0, 1, 1, 0], [1, 1, 0, 1]], np.int32)
  yield "causal", ops.MaskSpec(pos, pos)
  yield "window", ops.MaskSpec(pos, pos, window=3)
  yield "segments", ops.MaskSpec(pos, pos, seg, seg)
  yield "segments+window", ops.MaskSpec(pos, pos, seg, seg, window=2)
  yield "sinks", ops.MaskSpec(pos, pos, seg, seg, window=2, sinks=2)
  yield "cache validity", ops.MaskSpec(qp, kp, None, valid, window=4)
  yield "cache+sinks", ops.MaskSpec(qp, kp, None, valid, window=3, sinks=1)
  yield "active per token", ops.MaskSpec(pos, pos, seg, seg, active=rng.random((B, T)) < 0.5)
  yield "active per head", ops.MaskSpec(pos, pos, seg, seg, window=5,
                                        active=rng.random((B, T, N)) < 0.5)
  yield "block lists", ops.MaskSpec(pos, pos, seg, seg, block_lists=ops.BlockLists(
      blocks, None, block_q=4, block_k=5))
  yield "block lists+modes", ops.MaskSpec(pos, pos, seg, seg, window=6, block_lists=ops.BlockLists(
      blocks, modes, block_q=4, block_k=5), active=rng.random((B, T)) < 0.7)


@pytest.mark.parametrize("case", [c for c, _ in _spec_cases(np.random.default_rng(0))])
def test_dense_mask_matches_brute_force_loop(case):
  spec = dict(_spec_cases(np.random.default_rng(0)))[case]
  N = 4
  want = _loop_mask(spec, N)
  got = np.asarray(spec.dense_mask())
  if got.ndim == 3:  # shared by heads
    got = np.broadcast_to(got[:, None], want.shape)
  np.testing.assert_array_equal(got, want)
  assert want.any() and not want.all()  # the case is not trivial


def test_reference_matches_loop_attention_gqa():
  rng = np.random.default_rng(1)
  B, T, N, K, H = 2, 12, 4, 2, 8
  cases = list(_spec_cases(np.random.default_rng(0)))
  qkvs = []
  for case, spec in cases:
    S = np.asarray(spec.kv_positions_BS).shape[1]
    Tq = np.asarray(spec.q_positions_BT).shape[1]
    qkvs.append(_qkv(rng, B, Tq, S, N, K, H))
  # every case's reference in one jitted program (one compile, not one per case)
  outs = jax.jit(lambda qkvs: [ops.attention(q, k, v, spec, impl="reference")
                               for (q, k, v), (_, spec) in zip(qkvs, cases)])(qkvs)
  for (case, spec), (q, k, v), out in zip(cases, qkvs, outs):
    np.testing.assert_allclose(out, _loop_attention(q, k, v, _loop_mask(spec, N)), atol=2e-5,
                               err_msg=case)


def test_masked_rows_are_zero_not_nan_and_grads_finite():
  q = jnp.ones((1, 2, 2, 4)); k = v = jnp.ones((1, 2, 1, 4))
  pos = jnp.array([[0, 1]])
  spec = ops.MaskSpec(pos, pos, jnp.array([[0, 0]]), jnp.array([[0, 0]]))
  assert np.all(np.asarray(ops.attention(q, k, v, spec)) == 0)  # eager
  g = jax.jit(jax.grad(lambda q, k, v: ops.attention(q, k, v, spec).sum(), argnums=(0, 1, 2)))(
      q, k, v)  # one program (op by op compiles each primitive alone)
  assert all(np.isfinite(np.asarray(x)).all() for x in g)


def test_maskspec_is_a_pytree_with_static_fields():
  pos = jnp.zeros((1, 4), jnp.int32)
  spec = ops.MaskSpec(pos, pos, window=3, sinks=1, contiguous=True)
  leaves, tree = jax.tree.flatten(spec)
  assert len(leaves) == 2  # the two position arrays; None fields and statics are not leaves
  back = jax.tree.unflatten(tree, leaves)
  assert (back.window, back.sinks, back.contiguous) == (3, 1, True)
  assert tree != jax.tree.structure(ops.MaskSpec(pos, pos, window=4))  # statics are in the treedef
  f = jax.jit(lambda s: s.dense_mask())  # statics stay Python values under jit
  assert f(spec).shape == (1, 4, 4)


# ------------------------------------------------------------------------------------------------
# Every implementation against the reference (on CPU)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 3])
def test_tokamax_packed_matches_reference(window):
  """The k_start mask (document start, window) of the tokamax path, via tokamax's XLA kernel."""
  rng = np.random.default_rng(0)
  B, T, N, K, H = 2, 12, 4, 2, 8
  q, k, v = _qkv(rng, B, T, T, N, K, H)
  seg, pos = _packed(B, T, rng)
  spec = ops.MaskSpec(pos, pos, seg, seg, window=window, contiguous=True)
  want = _jit_reference(q, k, v, spec)
  out = jax.jit(lambda q, k, v: ops.attention(q, k, v, spec, impl="tokamax"))(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5)  # padding rows included: zeros on both


@pytest.mark.parametrize("backend,layout", [
    ("triton", "packed+active"), ("triton", "cache+per-head active"), ("triton", "contiguous"),
    ("mosaic_tpu", "cache+per-head active")])  # the kernel's own tests cover Mosaic further
def test_pallas_interpret_matches_reference(backend, layout):
  rng = np.random.default_rng(2)
  # the smallest shapes each kernel takes: Triton head_dim >= 16; Mosaic 64 and kv % 128
  B, N, K, H, T = (2, 4, 2, 16, 32) if backend == "triton" else (2, 4, 2, 64, 128)
  if layout == "cache+per-head active":
    S = 2 * T
    qp, kp, valid = _cache_layout(rng, B, T, S)
    spec = ops.MaskSpec(qp, kp, None, valid, window=T - 5, active=rng.random((B, T, N)) < 0.4)
  elif layout == "packed+active":
    S = T
    seg, pos = _packed(B, T, rng)
    spec = ops.MaskSpec(pos, pos, seg, seg, active=rng.random((B, T)) < 0.5)
  else:
    S = T
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    spec = ops.MaskSpec(pos, pos, window=T // 3, contiguous=True)
  q, k, v = _qkv(rng, B, T, S, N, K, H)
  f = lambda q, k, v: ops.attention(q, k, v, spec, impl=backend)  # the kernel, interpret mode
  out = jax.jit(f)(q, k, v)
  np.testing.assert_allclose(out, _jit_reference(q, k, v, spec), atol=1e-5)


def test_pallas_interpret_gradients_match_reference():
  rng = np.random.default_rng(9)
  B, T, N, K, H = 1, 32, 2, 1, 16
  q, k, v = _qkv(rng, B, T, T, N, K, H)
  seg, pos = _packed(B, T, rng)
  spec = ops.MaskSpec(pos, pos, seg, seg, window=9, active=rng.random((B, T, N)) < 0.5)
  loss = lambda impl: lambda q, k, v: jnp.sum(jnp.sin(ops.attention(q, k, v, spec, impl=impl)))
  got = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss("reference"), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_auto_on_cpu_is_the_reference_eager_and_jitted():
  rng = np.random.default_rng(3)
  B, T, N, K, H = 2, 16, 4, 1, 8
  q, k, v = _qkv(rng, B, T, T, N, K, H)
  seg, pos = _packed(B, T, rng)
  spec = ops.MaskSpec(pos, pos, seg, seg, active=rng.random((B, T, N)) < 0.5)
  want = ops.attention(q, k, v, spec, impl="reference")
  np.testing.assert_array_equal(ops.attention(q, k, v, spec), want)  # eager
  np.testing.assert_array_equal(jax.jit(lambda *a: ops.attention(*a, spec))(q, k, v), want)


# ------------------------------------------------------------------------------------------------
# Impl selection per LOWERING platform, exported from this CPU host
# ------------------------------------------------------------------------------------------------

B_, T_, N_, K_, H_ = 2, 256, 4, 2, 64
_H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
_A100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu"))
_TPU = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
_DISABLED = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
             jax.export.DisabledSafetyCheck.custom_call("__cudnn$fmhaSoftmax"),
             jax.export.DisabledSafetyCheck.custom_call("__cudnn$fmhaSoftmaxBackward")]


def _specs():
  rng = np.random.default_rng(4)
  pos = jnp.broadcast_to(jnp.arange(T_, dtype=jnp.int32), (B_, T_))
  seg = jnp.asarray(np.repeat([[1] * 100 + [2] * 150 + [0] * 6], B_, 0), jnp.int32)
  dpos = jnp.asarray(np.repeat([list(range(100)) + list(range(150)) + [0] * 6], B_, 0), jnp.int32)
  qp, kp, valid = _cache_layout(rng, B_, 16, T_)
  return {
      "unpacked": ops.MaskSpec(pos, pos, window=64, contiguous=True),
      "packed": ops.MaskSpec(dpos, dpos, seg, seg, contiguous=True),
      "packed-window": ops.MaskSpec(dpos, dpos, seg, seg, window=64, contiguous=True),
      "active": ops.MaskSpec(pos, pos, active=jnp.asarray(rng.random((B_, T_)) < 0.3)),
      "per-head": ops.MaskSpec(pos, pos, active=jnp.asarray(rng.random((B_, T_, N_)) < 0.3)),
      "cache": ops.MaskSpec(jnp.asarray(qp), jnp.asarray(kp), None, jnp.asarray(valid)),
      "sinks": ops.MaskSpec(pos, pos, window=32, sinks=4, contiguous=True),
  }


def _program(spec, *, grad=False, impl="auto", Tq=None, attend=ops.attention):
  """(the jitted attention (its gradient with grad) of spec, its bf16 argument shapes)."""
  Tq = Tq or spec.q_positions_BT.shape[1]
  sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16)
         for s in ((B_, Tq, N_, H_), (B_, T_, K_, H_), (B_, T_, K_, H_))]
  f = lambda q, k, v: attend(q, k, v, spec, impl=impl)
  if grad:
    f0 = f
    f = lambda q, k, v: jax.grad(lambda *a: f0(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(
        q, k, v)
  return jax.jit(f), sds


def _export(spec, platform, *, grad=False, impl="auto", mesh=None, Tq=None, attend=ops.attention):
  """The module text of spec's attention lowered for `platform` (under `mesh`): the lowering
  jax.export runs (Traced.lower(lowering_platforms=...)), without its serialization."""
  f, sds = _program(spec, grad=grad, impl=impl, Tq=Tq, attend=attend)
  with jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    return f.trace(*sds).lower(lowering_platforms=(platform,)).as_text()


def _lowered(spec, platforms, mesh, *, grad=False):
  """{platform: module text} of ONE trace under `mesh` (every branch its targets hold) lowered
  for each platform (what jax.export does per platform, without its serialization)."""
  f, sds = _program(spec, grad=grad)
  with jax.sharding.use_abstract_mesh(mesh):
    traced = f.trace(*sds)
    return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in platforms}


def _kernels(text):
  """What runs: custom-call targets, with Triton kernels named (tokamax vs ours)."""
  found = set()
  for line in text.splitlines():
    if "stablehlo.custom_call" not in line:
      continue
    target = re.search(r"custom_call @([\w$.:-]+)", line).group(1)
    if target == "__gpu$xla.gpu.triton":
      name = re.search(r'name = "([^"]+)"', line).group(1)
      found.add("tokamax-triton" if name.startswith("pallas_flash_attention") else
                "glue-triton" if name.startswith("compact_attention_copy_rows") else
                "compact-triton" if name.startswith("compact_attention") else "triton:" + name)
    elif target.startswith("__cudnn$fmha"):
      found.add("cudnn")
    elif target == "tpu_custom_call":
      found.add("mosaic-tpu")
    elif target in ("mosaic_gpu", "mosaic_gpu_v2"):
      found.add("mosaic-gpu")
    else:
      found.add(target)
  return found


def _reference_sized(text, B, T, S):
  """An f32 [B, K, G, T, S] logits tensor: the O(T*S) reference was lowered."""
  return f"tensor<{B}x{K_}x{N_ // K_}x{T}x{S}xf32>" in text


@pytest.mark.parametrize("grad", [False, True])
def test_auto_picks_per_lowering_platform(grad):
  specs = _specs()
  # no cuDNN in this process (the next test fakes one); tokamax only for causal documents: with a
  # window it visits every causal tile, the compacted kernel's bounds stop at the window. On an
  # H100 the compacted kernel is Mosaic GPU, its gathers / putting back too: no Triton call
  mgpu = {"mosaic-gpu"}
  want_cuda = {"unpacked": mgpu, "packed-window": mgpu, "packed": {"tokamax-triton"},
               "active": mgpu, "per-head": mgpu, "cache": mgpu}
  if grad:
    # The compacted kernel's backward is its forward's kernel (CompactConfig.bwd_impl None), so
    # under grad the specs whose backward differs in kind or shape: tokamax's own backward
    # (packed), per-head active sets, 16 queries over a 256-slot cache. unpacked, packed-window
    # and active run the same Mosaic GPU backward as per-head (their forward pick is asserted
    # without grad).
    want_cuda = {n: want_cuda[n] for n in ("packed", "per-head", "cache")}
  for name, want in want_cuda.items():
    # the cuda and the cpu program: one trace under the H100 mesh, lowered for each
    texts = _lowered(specs[name], ("cuda", "cpu"), _H100, grad=grad)
    text = texts["cuda"]
    assert _kernels(text) == want, (name, _kernels(text))
    T = specs[name].q_positions_BT.shape[1]
    # forward: the reference branch is not lowered at all (under grad its zero-filled residual
    # slots are still in the StableHLO; test_other_branches_residuals_are_dead checks XLA drops
    # them)
    assert grad or not _reference_sized(text, B_, T, T_), name
    text = _export(specs[name], "tpu", grad=grad, mesh=_TPU)
    assert _kernels(text) == {"mosaic-tpu"}, (name, _kernels(text))
    assert grad or not _reference_sized(text, B_, T, T_), name
    text = texts["cpu"]  # GPU branch traced, not lowered
    assert _kernels(text) == set(), (name, _kernels(text))
    assert _reference_sized(text, B_, T, T_), name


@pytest.fixture
def fake_cudnn(monkeypatch):
  """cuDNN present (faked: this CPU host has none) and the cuda branch traced. cuDNN's
  partitioning needs concrete devices (no abstract mesh), so ops is told it can trace cuda."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  class FakeVersions:
    @staticmethod
    def cudnn_get_version():
      return 91000
  monkeypatch.setattr(fa, "cuda_versions", FakeVersions)
  monkeypatch.setattr(ops, "_targets", lambda: {"cuda": Platform("cuda", "NVIDIA H100 80GB HBM3")})


def test_auto_picks_cudnn_for_unpacked_when_cudnn_is_present(fake_cudnn):
  """With cuDNN (faked: this CPU host has none) contiguous unpacked bf16 goes to cuDNN."""
  specs = _specs()
  assert _kernels(_export(specs["unpacked"], "cuda")) == {"cudnn"}
  assert _kernels(_export(specs["unpacked"], "cuda", grad=True)) == {"cudnn"}
  assert _kernels(_export(specs["unpacked"], "cuda", impl="cudnn")) == {"cudnn"}
  f32 = ops.MaskSpec(specs["unpacked"].q_positions_BT, specs["unpacked"].kv_positions_BS,
                     contiguous=True)
  with pytest.raises(ValueError, match="dtype float32"):  # cuDNN takes 16-bit floats only
    ops.attention(*(jnp.zeros((B_, T_, 2, H_)),) * 3, f32, impl="cudnn")


def test_other_branches_residuals_are_dead_after_compilation(monkeypatch):
  """Under grad, a platform_dependent cond carries every branch's residuals, zero-filled in the
  branches that do not make them. Emulate the GPU case on CPU in a scanned layer stack: the kept
  branch saves only its inputs (as a flash kernel does; here the reference under jax.checkpoint),
  another platform's branch is the plain reference with [B, K, G, T, S] float32 residuals. The
  compiled gradient must need no more temporary memory than the kept branch alone."""
  B, T, N, K, H, L = 2, 128, 4, 2, 16, 4
  rng = np.random.default_rng(8)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  spec = ops.MaskSpec(pos, pos, active=jnp.asarray(rng.random((B, T)) < 0.5))
  w = [jnp.asarray(rng.standard_normal((L, N * H, n * H)) * 0.05, jnp.float32) for n in (N, K, K)]
  x = jnp.asarray(rng.standard_normal((B, T, N * H)), jnp.float32)

  def loss(w, x):
    def layer(x, w):
      q, k, v = ((x @ wi).reshape(B, T, -1, H) for wi in w)
      return x + ops.attention(q, k, v, spec).reshape(B, T, N * H), None
    return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

  def compiled(branches):
    monkeypatch.setattr(ops, "_branches", lambda impl, q, mask, scale: branches(scale))
    step = jax.jit(jax.grad(loss))
    return step.lower(w, x).compile().memory_analysis().temp_size_in_bytes, step(w, x)

  flash_like = lambda s: jax.checkpoint(ops._reference(s))
  temp_k, g_k = compiled(lambda s: dict(default=flash_like(s)))
  temp_d, g_d = compiled(lambda s: dict(default=ops._reference(s), cpu=flash_like(s),
                                        tpu=ops._reference(s)))
  temp_r, _ = compiled(lambda s: dict(default=flash_like(s), cpu=ops._reference(s)))
  probs = L * B * N * T * T * 4  # the reference's saved probabilities over the stack
  assert temp_r >= temp_k + probs  # the measure sees live reference residuals
  assert temp_d <= temp_k * 1.01 + 4096, (temp_d, temp_k)
  for a, b in zip(g_d, g_k):
    np.testing.assert_array_equal(a, b)


def test_masks_no_kernel_takes_use_the_reference_with_a_warning(caplog):
  ops._warn_once.cache_clear()
  text = _export(_specs()["sinks"], "cuda", mesh=_H100)
  assert _kernels(text) == set() and _reference_sized(text, B_, T_, T_)
  assert "no kernel takes this call (sink tokens" in caplog.text


def test_shapes_no_kernel_takes_use_the_reference_with_a_warning(caplog):
  """auto on an H100 with head_dim 24 (neither Mosaic GPU nor Triton takes it): the reference,
  warned once with each kernel's reason."""
  ops._warn_once.cache_clear()
  T = 64
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T))
  spec = ops.MaskSpec(pos, pos, active=jnp.ones((1, T), bool))
  sds = [jax.ShapeDtypeStruct((1, T, 2, 24), jnp.bfloat16)] * 3
  with jax.sharding.use_abstract_mesh(_H100):
    text = jax.export.export(jax.jit(lambda q, k, v: ops.attention(q, k, v, spec)),
                             platforms=["cuda"], disabled_checks=_DISABLED)(*sds).mlir_module()
  assert _kernels(text) == set() and "tensor<1x2x1x64x64xf32>" in text
  assert "no kernel takes this call (mosaic_gpu: head_dim 24" in caplog.text
  assert "triton: head_dim 24" in caplog.text


def test_a_kv_length_no_tile_divides_runs_the_kernel_padded(caplog):
  """auto on an H100, 64 queries over 200 cached keys (a prefill chunk into a cache whose length
  no kernel tile divides): the Mosaic GPU kernel on keys padded to 256, no reference, no warning."""
  ops._warn_once.cache_clear()
  T, S = 64, 200
  qpos = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (1, T))
  kvpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (1, S))
  spec = ops.MaskSpec(qpos, kvpos, active=jnp.ones((1, T), bool))
  q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(_H100):
    text = jax.export.export(jax.jit(lambda q, k, v: ops.attention(q, k, v, spec)),
                             platforms=["cuda"], disabled_checks=_DISABLED)(q, kv, kv).mlir_module()
  assert _kernels(text) and "no kernel takes this call" not in caplog.text, _kernels(text)


def test_explicit_impls_export_their_kernel_for_each_platform():
  """Every kernel name reaches its kernel: 'pallas' is the resolver's Pallas kernel (Mosaic GPU
  on an H100, Triton on an A100), 'triton' / 'mosaic_gpu' / 'mosaic_tpu' that kernel; a kernel
  name lowered for a platform it does not compile for is a lowering error naming it."""
  spec = _specs()["cache"]
  assert _kernels(_export(spec, "cuda", impl="pallas", mesh=_H100)) == {"mosaic-gpu"}
  assert _kernels(_export(spec, "cuda", impl="pallas", mesh=_A100)) == {"compact-triton",
                                                                       "glue-triton"}
  assert _kernels(_export(spec, "cuda", impl="mosaic_gpu", mesh=_H100)) == {"mosaic-gpu"}
  assert _kernels(_export(spec, "cuda", impl="triton", mesh=_H100)) == {"compact-triton",
                                                                       "glue-triton"}
  assert _kernels(_export(spec, "tpu", impl="pallas", mesh=_TPU)) == {"mosaic-tpu"}
  assert _kernels(_export(spec, "tpu", impl="mosaic_tpu", mesh=_TPU)) == {"mosaic-tpu"}
  with pytest.raises(ValueError, match="impl='mosaic_gpu' cannot take this call: .*Hopper"):
    _export(spec, "cuda", impl="mosaic_gpu", mesh=_A100)
  with pytest.raises(ValueError, match="impl='mosaic_tpu': no compact kernel of that name lowers "
                                       "for cuda"):
    _export(spec, "cuda", impl="mosaic_tpu", mesh=_H100)
  # on CPU, impl='pallas' is the kernel in interpret mode: no custom call, no [T, S] logits
  text = _export(spec, "cpu", impl="pallas")
  assert _kernels(text) == set() and not _reference_sized(text, B_, 16, T_)


_PLATFORMS = dict(h100=Platform("cuda", "NVIDIA H100 80GB HBM3"),
                  a100=Platform("cuda", "NVIDIA A100-SXM4-80GB"),
                  mi300=Platform("rocm", "AMD Instinct MI300X"), tpu=Platform("tpu", "TPU v5 lite"),
                  cpu=Platform("cpu"))


def test_the_resolver_picks_per_lowering_platform_and_device_kind():
  """ops.resolve, the one resolver: compacted attention on an H100 -> Mosaic GPU, on other CUDA /
  ROCm GPUs -> Triton, on TPU -> Mosaic TPU, on CPU -> no kernel (the reference); a shape the
  first choice cannot take moves to the next; an explicit kernel name is that kernel or None with
  its reason. The block-sparse package resolves the same way."""
  q, kv, bf16 = (1, 256, 4, 64), (1, 256, 2, 64), jnp.bfloat16
  pick = lambda impl, plat, dtype=bf16, q=q, kv=kv, kind="compact", **kw: ops.resolve(
      kind, impl, q, kv, dtype, _PLATFORMS[plat], **kw)
  name = lambda r: None if r[0] is None else r[0].name
  want = dict(h100="mosaic_gpu", a100="triton", mi300="triton", tpu="mosaic_tpu", cpu=None)
  for plat, kernel in want.items():
    assert name(pick("auto", plat)) == name(pick("pallas", plat)) == kernel, plat
  assert name(pick("auto", "h100", jnp.float32)) == "triton"  # Mosaic GPU: 16-bit floats only
  assert name(pick("triton", "h100")) == "triton"
  backend, why = pick("mosaic_gpu", "a100")
  assert backend is None and "needs a Hopper GPU" in why[0]
  backend, why = pick("auto", "h100", q=(1, 256, 4, 24), kv=(1, 256, 2, 24))
  assert backend is None and [w.split(":")[0] for w in why] == ["mosaic_gpu", "triton"]  # cuda's
  assert all("head_dim 24" in w for w in why)
  # the block-sparse kernels (their tiles are the lists' blocks)
  blocks = dict(block_q=128, block_k=128, kind="block_sparse")
  assert name(pick("auto", "a100", **blocks)) == "triton"
  assert name(pick("auto", "tpu", **blocks)) == "mosaic_tpu"
  assert name(pick("auto", "cpu", **blocks)) is None
  assert name(pick("auto", "h100", **blocks)) in ("mosaic_gpu", "triton")  # Mosaic GPU: issue 31


def test_the_compact_backends_carry_their_config():
  """A backend variant is dataclasses.replace(backend, config=...): its supports() checks the
  backward kernel of the config too, and calling it runs compact_attention with that config."""
  from pallas_kernels.compact_attention import BACKENDS, CompactConfig
  mgpu = next(b for b in BACKENDS if b.name == "mosaic_gpu")
  q, kv = (1, 256, 4, 64), (1, 256, 2, 64)
  assert mgpu.supports(q, kv, jnp.bfloat16, _PLATFORMS["h100"]) is None
  # a kv length no tile divides (2242: a serve cache of prompt + budget slots) is padded by
  # compact_attention, so the kernels take it and ops.resolve does not fall to the reference
  odd = (1, 2242, 2, 64)
  assert mgpu.supports(q, odd, jnp.bfloat16, _PLATFORMS["h100"]) is None
  assert ops.resolve("compact", "auto", q, odd, jnp.bfloat16, _PLATFORMS["a100"])[0].name == "triton"
  assert ops.resolve("compact", "auto", q, odd, jnp.bfloat16, _PLATFORMS["tpu"])[0].name == "mosaic_tpu"
  tbwd = dataclasses.replace(mgpu, config=CompactConfig(bwd_impl="triton"))
  assert tbwd.supports(q, kv, jnp.bfloat16, _PLATFORMS["h100"]) is None
  q24, kv24 = (1, 256, 4, 48), (1, 256, 2, 48)  # Triton backward: power-of-two head_dim only
  assert "head_dim 48" in dataclasses.replace(
      next(b for b in BACKENDS if b.name == "triton")).supports(q24, kv24, jnp.bfloat16,
                                                              _PLATFORMS["a100"])
  with pytest.raises(ValueError, match="CompactConfig.bwd_impl='cuda'"):
    CompactConfig(bwd_impl="cuda")


def test_lowering_for_a_platform_this_host_cannot_trace_is_a_clear_error():
  with pytest.raises(ValueError, match="use_abstract_mesh"):
    _export(_specs()["active"], "tpu")  # no TPU abstract device: the branch is a placeholder
  with pytest.raises(ValueError, match="use_abstract_mesh"):
    _export(_specs()["active"], "cuda", grad=True)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def test_explicit_impls_that_cannot_take_the_call_raise():
  specs = _specs()
  q = jnp.zeros((B_, T_, N_, H_), jnp.bfloat16)
  k = jnp.zeros((B_, T_, K_, H_), jnp.bfloat16)
  cases = [("cudnn", "unpacked", "cuDNN is not available"),
           ("cudnn", "packed", "packed segment ids"),
           ("cudnn", "active", "not contiguous"),
           ("tokamax", "cache", "not contiguous"),
           ("tokamax", "per-head", "active set"),
           ("tokamax", "sinks", "sink tokens"),
           ("pallas", "sinks", "sink tokens")]
  for impl, name, why in cases:
    q = jnp.zeros((B_, specs[name].q_positions_BT.shape[1], N_, H_), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"impl='{impl}' cannot take this call: .*{why}"):
      ops.attention(q, k, k, specs[name], impl=impl)
  x = jnp.zeros((1, 32, 2, 24))  # the Triton kernel needs a power-of-two head_dim
  pos = jnp.broadcast_to(jnp.arange(32), (1, 32))
  with pytest.raises(ValueError, match="impl='pallas' cannot take this call: .*head_dim 24"):
    ops.attention(x, x, x, ops.MaskSpec(pos, pos), impl="pallas")
  with pytest.raises(ValueError, match="unknown impl 'nope'"):
    ops.attention(q, k, k, specs["unpacked"], impl="nope")
  with pytest.raises(ValueError, match="impl='mosaic_gpu' cannot take this call: .*float32"):
    ops.attention(x, x, x, ops.MaskSpec(pos, pos), impl="mosaic_gpu")


def test_malformed_masks_are_one_line_errors():
  pos = jnp.zeros((1, 4), jnp.int32)
  x = jnp.zeros((1, 4, 2, 8))
  bad = [(ops.MaskSpec(pos, jnp.zeros((1, 5), jnp.int32)), "kv_positions_BS must be an int array of shape"),
         (ops.MaskSpec(pos, pos, pos, None), "q_segment_ids_BT without kv_segment_ids_BS"),
         (ops.MaskSpec(pos, pos, active=jnp.ones((1, 4))), "active must be bool"),
         (ops.MaskSpec(pos, pos, window=0), "window must be an int >= 1"),
         (ops.MaskSpec(pos, pos, sinks=-1), "sinks must be an int >= 0"),
         (ops.MaskSpec(pos, pos, None, pos, contiguous=True), "both .*or neither"),
         (ops.MaskSpec(pos, pos, block_lists=ops.BlockLists(jnp.zeros((1, 2, 3, 1), jnp.int32),
                                                            block_q=2)), "kv_blocks_BNQL must be")]
  for spec, msg in bad:
    with pytest.raises(ValueError, match=msg):
      ops.attention(x, x, x, spec)
  with pytest.raises(ValueError, match="T=4 != S=2"):
    ops.attention(x, x[:, :2], x[:, :2], ops.MaskSpec(pos, pos[:, :2], contiguous=True))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    ops.attention(x, x[:, :, :1].repeat(3, 2), x[:, :, :1].repeat(3, 2), ops.MaskSpec(pos, pos))


# ------------------------------------------------------------------------------------------------
# The kernel package: loud import failures
# ------------------------------------------------------------------------------------------------

def test_kernel_import_failure_raises_with_the_original_error(monkeypatch):
  rng = np.random.default_rng(5)
  q, k, v = _qkv(rng, 1, 16, 16, 2, 1, 16)
  pos = jnp.broadcast_to(jnp.arange(16), (1, 16))
  spec = ops.MaskSpec(pos, pos, active=jnp.ones((1, 16), bool))

  class Broken:  # a finder that fails every pallas_kernels import, as a broken install would
    @staticmethod
    def find_spec(name, path=None, target=None):
      if name.split(".")[0] == "pallas_kernels":
        raise ImportError("triton wheel is broken (simulated)")
      return None
  for mod in [m for m in sys.modules if m.split(".")[0] == "pallas_kernels"]:
    monkeypatch.delitem(sys.modules, mod)
  monkeypatch.setattr(sys, "meta_path", [Broken, *sys.meta_path])
  for impl in ("pallas", "reference", "auto"):
    with pytest.raises(ImportError, match="pallas_kernels.compact_attention.*simulated") as e:
      jax.jit(lambda *a: ops.attention(*a, spec, impl=impl))(q, k, v)
    assert "simulated" in str(e.value.__cause__)


# ------------------------------------------------------------------------------------------------
# Per-shard kernels under the 8-device CPU mesh
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["pallas", "tokamax"])
def test_kernels_run_per_shard_under_a_mesh(impl):
  from condattn_jax.train import sharding as shd
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2),
                           ("data", "fsdp", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rng = np.random.default_rng(6)
  B, T, N, K, H = 4, 32, 4, 2, 16
  q, k, v = _qkv(rng, B, T, T, N, K, H)
  seg, pos = _packed(B, T, rng)
  active = None if impl == "tokamax" else jnp.asarray(rng.random((B, T, N)) < 0.5)
  spec = ops.MaskSpec(pos, pos, seg, seg, active=active, window=9, contiguous=True)
  f = jax.jit(lambda *a: ops.attention(*a, spec, impl=impl))
  want = _jit_reference(q, k, v, spec)
  with shd.mesh_context(mesh):
    assert ops._mesh_shards(B, N, K) is not None
    got = f(q, k, v)
    text = f.lower(q, k, v).as_text()
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert "shard_map" in text or "manual" in text.lower()



def test_mask_must_be_a_maskspec():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(TypeError, match="mask must be an ops.MaskSpec, got dict"):
    ops.attention(q, q, q, {"q_positions_BT": jnp.zeros((1, 4), jnp.int32)})


def test_without_tokamax_auto_uses_the_compacted_kernel(monkeypatch):
  """A GPU host without tokamax (not in every image): auto falls to the compacted kernel for packed
  documents instead of crashing; explicit impl='tokamax' is a one-line error naming the package."""
  for name in ["tokamax"] + [m for m in sys.modules if m.startswith("tokamax.")]:
    monkeypatch.setitem(sys.modules, name, None)  # `import tokamax...` raises ImportError
  specs = _specs()
  assert _kernels(_export(specs["packed"], "cuda", mesh=_H100)) == {"mosaic-gpu"}
  with pytest.raises(ValueError, match=r"impl='tokamax'.*tokamax cannot be imported.*pip install"):
    _export(specs["packed"], "cuda", impl="tokamax", mesh=_H100)


# ------------------------------------------------------------------------------------------------
# Full heads on cuDNN, the rest in the block-sparse launch (Elastic's composite)
# ------------------------------------------------------------------------------------------------

def _split_case(rng, B=2, T=64, N=8, K=4, H=16, bq=16):
  q, k, v = _qkv(rng, B, T, T, N, K, H)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  nq = T // bq
  lists = np.full((B, N, nq, 2), -1, np.int32)
  for i in range(nq):  # SSA-like: the first block and the diagonal block
    lists[:, :, i, 0], lists[:, :, i, 1] = 0, i
  # row 0: KV heads 1 and 3 full; row 1: KV head 2 full, and KV head 0 has one full query head
  # only (G = 2: it stays in the block-sparse launch)
  mode = np.ones((B, N), np.int32)
  mode[0, 2:4] = mode[0, 6:8] = ops.HEAD_FULL
  mode[1, 4:6] = ops.HEAD_FULL
  mode[1, 0] = ops.HEAD_FULL
  bl = ops.BlockLists(jnp.asarray(lists), jnp.asarray(mode), block_q=bq, block_k=bq)
  return (q, k, v), ops.MaskSpec(pos, pos, block_lists=bl, contiguous=True)


def test_split_full_heads_matches_the_reference_with_gradients():
  """Two kernels (full KV heads gathered into a dense causal call, the rest block-sparse) give
  the one-mask reference's output and gradients; rows with different full-head counts (2 and
  1, so the run-time head count is 2 and row 1 computes a spare head that is discarded)."""
  (q, k, v), mask = _split_case(np.random.default_rng(3))
  calls = []

  def dense_fn(q, k, v, m):
    assert m.block_lists is None
    calls.append(q.shape[2])
    return ops.attention(q, k, v, m, impl="reference")

  sparse_fn = ops._block_sparse(None, "triton", interpret=True)  # the kernel, interpret mode
  split = lambda q, k, v: composite.split_full_heads(q, k, v, mask, dense_fn, sparse_fn)
  ref = lambda q, k, v: ops.attention(q, k, v, mask, impl="reference")
  ct = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)
  # output and gradients in one jitted program per side
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * ct),
                                                        argnums=(0, 1, 2))(*a)))
  out_split, g_split = both(split)(q, k, v)
  out_ref, g_ref = both(ref)(q, k, v)
  np.testing.assert_allclose(out_split, out_ref, atol=2e-5)
  assert 4 in calls  # lax.switch traced every head count; C = 2 KV heads = 4 query heads ran
  for a, b in zip(g_split, g_ref):
    np.testing.assert_allclose(a, b, atol=5e-5)


def test_auto_on_cuda_runs_full_heads_on_cudnn_when_asked(fake_cudnn, monkeypatch):
  """composite.attention(dense_full_heads=True): the cuda branch lowers cuDNN next to the
  block-sparse kernel the resolver picks (forward and backward); without it, or with a window,
  no cuDNN. (cuDNN's lowering needs no abstract mesh,
  Triton's needs one: the block-sparse kernel is lowered in interpret mode here.)"""
  sparse_calls = []
  interpreted = ops._block_sparse

  def block_sparse(scale, kernel_impl, interpret=False):
    sparse_calls.append(kernel_impl)
    return interpreted(scale, "triton", True)
  monkeypatch.setattr(ops, "_block_sparse", block_sparse)
  B, T, N, K = B_, T_, N_, K_
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  nq = -(-T // 128)
  lists = jnp.zeros((B, N, nq, 1), jnp.int32)
  mode = jnp.asarray(np.tile([ops.HEAD_FULL] * (N // K) + [ops.HEAD_BLOCKS] * (N - N // K),
                             (B, 1)), jnp.int32)
  spec = lambda window=None: ops.MaskSpec(pos, pos, window=window, contiguous=True,
                                          block_lists=ops.BlockLists(lists, mode, block_q=128,
                                                                     block_k=128))
  split = lambda split: functools.partial(composite.attention, dense_full_heads=split)
  for grad in (False, True):
    assert "cudnn" in _kernels(_export(spec(), "cuda", grad=grad, attend=split(True)))
  picked, _ = ops.resolve("block_sparse", "auto", (B, T, N, H_), (B, T, K, H_), jnp.bfloat16,
                          Platform("cuda", "NVIDIA H100 80GB HBM3"), block_q=128, block_k=128)
  assert sparse_calls and set(sparse_calls) == {picked.name}
  assert "cudnn" not in _kernels(_export(spec(), "cuda", attend=split(False)))
  assert "cudnn" not in _kernels(_export(spec(window=100), "cuda", attend=split(True)))
