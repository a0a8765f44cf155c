"""GPU (Hopper): the Mosaic GPU decode kernel (pallas_kernels.decode) == the float32 reference,
and its time per call against cuDNN's decode path (ops.attention impl='cudnn': GQA folded, kv
split, per-row lengths) at Qwen2.5-1.5B decode shapes (12 query heads, 2 kv heads, head_dim 128),
(B, cache) = (1, 8K), (1, 128K), (8, 32K), plus the reads the kernel skips (AHA heads routed local:
a window of a full cache; L2A rows routed local: inactive rows; Elastic SSA: sinks + window) that
cuDNN cannot; AHA / Elastic / MATCH engines decode through it.

    pytest -q -s -m "not slow" tests/gpu/test_decode_kernel.py   (skipped without a Hopper GPU)

(`slow`: the DecodeConfig sweep, run when re-picking the defaults.)

Each timing is one jitted program that runs the call `_REPS` times in a fori_loop (each call's
query depends on the previous output), divided by _REPS: no dispatch overhead in the number.
The table goes to stdout and, with CONDATTN_DECODE_TIMINGS=<path>, to that JSON file.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu" or not jax.devices()[0].device_kind.startswith(
    ("NVIDIA H100", "NVIDIA H200", "NVIDIA H800", "NVIDIA GH200")):
  pytest.skip("needs a Hopper GPU", allow_module_level=True)

from condattn_jax import ops  # noqa: E402
from pallas_kernels import decode as dk  # noqa: E402
from pallas_kernels.decode.testing import decode_problem  # noqa: E402

N, K, H = 12, 2, 128
_REPS = 32
_ROWS = []


def _problem(B, S, lengths, T=1, seed=0):
  return decode_problem(B=B, T=T, N=N, K=K, H=H, S=S, lengths=lengths, seed=seed)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fill", "per-row-active", "per-head-window", "sinks-window",
                                  "multi-query", "ragged-window", "block-lists"])
def test_mosaic_gpu_decode_kernel_equals_reference(case):
  """Kernel == the float32 reference; 'fill' (no positions read) and 'ragged-window' (per-head
  active, window + sinks) run a cache of 8224 slots: 128 tiles of 64 and a ragged 129th that
  loads slots 8160..8223 and masks those below 8192; 'block-lists': per-head block lists of 128
  slots in every head mode (Elastic: FA heads full, SSA heads their listed blocks; MATCH-style
  window OR listed), validity instead of a fill."""
  B, S = 4, 8224 if case in ("fill", "ragged-window") else 8192
  T = 2 if case == "multi-query" else 1
  q, k, v, kw = _problem(B, S, [S, S // 3, 1, S - 77], T=T, seed=len(case))
  rng = np.random.default_rng(0)
  if case == "per-row-active":
    kw["active"] = jnp.asarray([[True], [False], [True], [True]])
  elif case == "per-head-window":
    kw.update(active=jnp.asarray(rng.random((B, 1, N)) < 0.5), window=1000)
  elif case == "sinks-window":
    kw.update(window=2048, sinks=4)
  elif case == "ragged-window":
    kw.update(active=jnp.asarray(rng.random((B, 1, N)) < 0.5), window=1000, sinks=4)
  elif case == "block-lists":
    lens = kw.pop("kv_lengths_B")
    kw["kv_valid_BS"] = (jnp.arange(S)[None] < lens[:, None]).astype(jnp.int32)
    lists = jnp.asarray(rng.integers(-1, S // 128, (B, N, 1, 6)), jnp.int32)
    kw.update(window=1024, kv_blocks_BNQL=lists, block_q=1, list_block_k=128,
              head_mode_BN=jnp.asarray(rng.integers(0, 3, (B, N)), jnp.int32))
  elif case == "multi-query":
    kw["active"] = jnp.asarray(rng.random((B, T, N)) < 0.8)
  out = jax.jit(lambda q, k, v: dk.decode_attention(q, k, v, impl="mosaic_gpu", **kw))(q, k, v)
  ref = dk.decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                            v.astype(jnp.float32), **kw)
  bad = ~np.isfinite(np.asarray(out, np.float32)).all(axis=(1, 2, 3))
  assert not bad.any(), f"{case}: rows {np.flatnonzero(bad)} not finite"
  assert _rel(out, ref) < 1e-2, case
  if "active" in kw:  # inactive queries: exact zeros
    act = np.broadcast_to(np.asarray(kw["active"])[..., None] if kw["active"].ndim == 2
                          else np.asarray(kw["active"]), (B, T, N))
    assert float(np.abs(np.asarray(out, np.float32)[~act]).max(initial=0.0)) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["aha", "elastic", "match"])
def test_engine_decode_runs_the_kernel_and_equals_the_reference(scheme):
  """A scheme's engine decodes through ops.attention(impl='auto') and its decode calls run the
  decode kernel (traced calls counted), the decode step's logits equal the same engine on the
  reference attention: AHA (OLMo-2 layout, 4 heads of 128, window 64, a random router: heads
  routed local and full), Elastic (4 query / 2 kv heads of 128, blocks of 128, kv head 0 FA and
  kv head 1 SSA by routing 'fixed': per-head block lists), MATCH (window 128, chunks of 128,
  top 2: the window + retrieved keys)."""
  from condattn_jax import attention
  from condattn_jax.inference import Engine
  from condattn_jax.models.config import ModelConfig
  from pallas_kernels.decode import api
  if scheme == "aha":
    base = ModelConfig(family="olmo2", qk_norm="full", post_norm=True, vocab_size=512,
                       hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                       num_kv_heads=4, head_dim=128, dtype="bfloat16", param_dtype="bfloat16")
    knobs = dict(window=64)
  else:
    base = ModelConfig(family="qwen3", qk_norm="head", vocab_size=512, hidden_size=256,
                       intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=128, dtype="bfloat16", param_dtype="bfloat16")
    knobs = (dict(block=128, sinks=128, local=256, routing="fixed", fixed_fa_kv_heads=(0,))
             if scheme == "elastic" else dict(window=128, chunk=128, top_k=2))
  cfg, params = attention.convert(attention.init_dense(base, 3), base, scheme, **knobs)
  if scheme == "aha":  # a random router: both routes taken
    r = params["layers"]["router"]
    r["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(0), r["kernel"].shape,
                                          r["kernel"].dtype)
    r["bias"] = jnp.zeros_like(r["bias"])
  calls = []
  orig = api.decode_attention

  def counting(*a, **kw):
    calls.append(kw.get("impl"))
    return orig(*a, **kw)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 512, n).astype(np.int32) for n in (300, 77, 512)]
  outs = []
  for impl in ("auto", "reference"):
    c = (attention.configure(cfg, "aha", compact_impl=impl) if scheme == "aha"
         else attention.configure(cfg, "match", impl=impl) if scheme == "match" else cfg)
    eng = Engine(c.replace(attention_impl=impl), params, cache_len=640)
    cache, logits, lengths = eng.prefill(prompts)
    tok = np.asarray(logits).argmax(-1)
    api.decode_attention = counting
    try:
      outs.append(np.asarray(eng.decode_step(cache, tok, lengths, np.ones(3, bool), logits)[1]))
    finally:
      api.decode_attention = orig
    if impl == "auto":
      assert calls and set(calls) == {"mosaic_gpu"}, calls
  assert _rel(outs[0], outs[1]) < 2e-2


def _time(fn, q, k, v):
  """ms per call of fn(q, k, v) -> out [B, T, N, H], _REPS chained calls in one program."""
  @jax.jit
  def run(q, k, v):
    def body(_, q):
      return (q + 1e-3 * fn(q, k, v)).astype(q.dtype)
    return jax.lax.fori_loop(0, _REPS, body, q)
  jax.block_until_ready(run(q, k, v))
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(run(q, k, v))
    best = min(best, (time.perf_counter() - t0) / _REPS * 1e3)
  return best


def _kv_bytes(slots_read, B):
  return slots_read * B * K * H * 2 * 2  # K and V, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(1, 8192), (1, 131072), (8, 32768)])
def test_decode_kernel_timing_vs_cudnn(B, S):
  """Prints ms per call (and effective GB/s of the K/V bytes each call must read) for:
  dense full cache (kernel vs cuDNN decode), half the rows routed local (L2A: kernel vs cuDNN,
  whose inactive rows read 1 slot), every head routed local with a 4096 window (AHA: reads a
  window; cuDNN cannot), sinks + window (Elastic SSA). Asserts only that every number is finite
  and the kernel's window call reads less time than its dense call at S >= 32K."""
  q, k, v, kw = _problem(B, S, [S] * B)
  mask = ops.MaskSpec(q_positions_BT=kw["q_positions_BT"], kv_positions_BS=kw["kv_positions_BS"],
                      kv_segment_ids_BS=jnp.ones((B, S), jnp.int32),
                      kv_lengths_B=kw["kv_lengths_B"])
  half = jnp.asarray([[b % 2 == 0] for b in range(B)]) if B > 1 else jnp.asarray([[False]])
  kern = lambda **x: (lambda q, k, v: dk.decode_attention(q, k, v, impl="mosaic_gpu",
                                                          **{**kw, **x}))
  import dataclasses
  cudnn = lambda m: (lambda q, k, v: ops.attention(q, k, v, m, impl="cudnn"))
  rows = {
      "dense/kernel": (kern(), S),
      "dense/cudnn": (cudnn(mask), S),
      "half-rows-local/kernel": (kern(active=half), S * float(np.mean(np.asarray(half)))),
      "half-rows-local/cudnn": (cudnn(dataclasses.replace(mask, active=half)),
                                S * float(np.mean(np.asarray(half)))),
      "heads-local-window4096/kernel": (kern(window=4096), min(S, 4096)),
      "sinks4-window4096/kernel": (kern(window=4096, sinks=4), min(S, 4096 + 64)),
  }
  got = {}
  for name, (fn, slots) in rows.items():
    ms = _time(fn, q, k, v)
    got[name] = ms
    gbs = _kv_bytes(slots, B) / (ms * 1e-3) / 1e9 if slots else 0.0
    row = dict(B=B, S=S, case=name, ms=round(ms, 4), kv_GBps=round(gbs, 1),
               device=jax.devices()[0].device_kind)
    _ROWS.append(row)
    print(f"B={B} S={S:>6} {name:<32} {ms * 1e3:9.1f} us  {gbs:7.1f} GB/s of K/V")
  assert all(np.isfinite(list(got.values())))
  if S >= 32768:
    assert got["heads-local-window4096/kernel"] < got["dense/kernel"]
  path = os.environ.get("CONDATTN_DECODE_TIMINGS")
  if path:
    with open(path, "w") as f:
      json.dump(_ROWS, f, indent=1)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("B,S", [(8, 32768), (1, 131072)])
def test_decode_kernel_config_sweep(B, S):
  """Prints ms per dense call of the kernel for a few DecodeConfigs (tile, stages, parts), to
  pick the defaults (DecodeConfig) and over_cudnn; asserts only finite numbers."""
  q, k, v, kw = _problem(B, S, [S] * B)
  cfgs = [dk.DecodeConfig(num_stages=3), dk.DecodeConfig(num_stages=4),
          dk.DecodeConfig(block_k=128, num_stages=2), dk.DecodeConfig(min_tiles_per_part=4),
          dk.DecodeConfig(target_programs=132)]  # the default's number: the timing test's
  for cfg in cfgs:
    fn = lambda q, k, v, cfg=cfg: dk.decode_attention(q, k, v, impl="mosaic_gpu", config=cfg, **kw)
    ms = _time(fn, q, k, v)
    gbs = _kv_bytes(S, B) / (ms * 1e-3) / 1e9
    _ROWS.append(dict(B=B, S=S, case=f"sweep/{cfg}", ms=round(ms, 4), kv_GBps=round(gbs, 1),
                      device=jax.devices()[0].device_kind))
    print(f"B={B} S={S:>6} {cfg} {ms * 1e3:9.1f} us  {gbs:7.1f} GB/s of K/V")
    assert np.isfinite(ms)
  path = os.environ.get("CONDATTN_DECODE_TIMINGS")
  if path:
    with open(path, "w") as f:
      json.dump(_ROWS, f, indent=1)
