"""End to end on one GPU: dense vs L2A on the FULL Qwen2.5-1.5B-shaped model (issue 7's
bench/e2e.py, issue 8's end-to-end targets, PERF.md "End to end").

    python -m bench.e2e                                   # sanity check, then T = 32K, 64K, 128K
    python -m bench.e2e --T 65536 --schemes dense,l2a_q0.2 --no_sanity --deadline_s 560
    python -m bench.e2e --merge run32k.json --merge run64k.json   # one file per device
    python -m bench.e2e --diag 65536,131072     # one layer's attention on the fused paths
    python -m bench.e2e --tiny --T 64 --reps 1  # CPU check of the plumbing (2 layers)

Model: qwen2 family, hidden 1536, 12 q heads, 2 kv heads, head_dim 128, intermediate 8960,
vocab 151936, q/k/v bias, tied embeddings, all 28 layers (scanned), random init, bf16 compute,
fp32 master weights, remat 'full', B = 1, random tokens. Schemes (SCHEMES below):
  dense      the dense model;
  l2a_q0.2   L2A with context-free routing (routing='bernoulli', bernoulli_q=0.2: sparsity 0.8),
             p_force=0.1, window 4096. NOTE: the L2A layer takes the forced-global step only under
             routing='learned', so this row's train step never runs it; the forced cost is the
             l2a_all row, and `train_ms_pforce` is the expectation 0.9 * this + 0.1 * l2a_all
             (per layer and step the forced path replaces the compacted one with p = 0.1);
  l2a_all    L2A with every token global (routing='all': the forced-global path, dense kernels).
Per row (T, scheme), in a process of its own (so peak memory is the row's own):
  prefill_ms   time to first token: one `Engine._step` (the engine's prefill of the whole T-token
               prompt: every layer writes its caches, logits of the last token), bf16 weights,
               cache_len = T + 128; warm-up, median of --reps, block_until_ready;
  decode_ms    ms per token: `Engine.decode_step` after that prefill, median of --decode_steps;
  train_ms     `condattn_jax.train.loop.jit_train_step` (the jitted step of loop.run: value_and_grad
               of train.step's loss with chunked CE (train.loss_chunk_size 8192), remat full, grad
               clipping, AdamW update, donated state), median of --reps after a warm-up step;
  compile_s    AOT `.lower(...).compile()` of that train step, timed;
  forward_ms   (extra) the cache-free forward to the last token's logits (`Decoder.apply`,
               decode=False): dense attention through the fused kernels (cuDNN), for comparison
               with the engine's cache-layout prefill (which runs the compacted Pallas kernel);
  peak_bytes   jax memory_stats peak_bytes_in_use of the row's process (train state included);
               peak_infer_bytes: the same read after prefill / decode, before the optimizer state;
  kv_cache_bytes  the engine's cache at cache_len;  sparsity  the train step's l2a/sparsity.
Speedups are dense / scheme of the same T in the same run (`speedup_*`).
A sanity check runs first (its own process): on a short sequence, L2A with routing='all' and
window 0 equals the dense model (same weights, `from_dense`); L2A q=0.2 with the fused kernels
equals it with impl='reference'; the engine's prefill / decode logits equal the cache-free
forward's.
Appends a run to $OUT (or --out_dir)/e2e_<device>.json, updated after every row (device, jax version, date, tree,
rows) and prints the table last. Rows that did not run are recorded with their reason.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402

from bench import common  # noqa: E402

# Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B), as ModelConfig fields.
QWEN25_1P5B = dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                   num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True)
# The CPU test's shapes (same family and layout, tiny).
TINY = dict(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True, attention_bias=True)
WINDOW = 4096
SCHEMES = {
    "dense": None,
    "l2a_q0.2": dict(routing="bernoulli", bernoulli_q=0.2, p_force=0.1),
    "l2a_all": dict(routing="all", p_force=0.1),
}
P_FORCE = 0.1
LOSS_CHUNK = 8192
CACHE_EXTRA = 128  # cache slots beyond the prompt (decode steps; keeps S a multiple of 128)
LONG_T = 131072  # rows at or above this use --reps_long
ROW_FIELDS = ("T", "scheme", "layers", "compile_s", "train_ms", "prefill_ms", "decode_ms",
              "peak_bytes", "speedup_train", "speedup_prefill")


# ------------------------------------------------------------------------------------------------
# Building blocks (jax imported lazily: the parent process never touches the GPU)
# ------------------------------------------------------------------------------------------------

def run_config(T: int, scheme: str, *, shapes: dict, window: int = WINDOW,
               loss_chunk: int = LOSS_CHUNK, dtype: str = "bfloat16"):
  """The ml_collections run config of one row: random init, B = 1, seq_len T."""
  from condattn_jax.train.config import default_config
  import ml_collections
  if scheme not in SCHEMES:
    raise ValueError(f"bench.e2e: unknown scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
  c = default_config()
  for k, v in shapes.items():
    c.model[k] = v
  c.model.dtype = dtype
  c.model.param_dtype = "float32"
  c.model.remat_policy = "full"
  c.model.attention_impl = "auto"
  opts = SCHEMES[scheme]
  if opts is not None:
    c.model.scheme = ml_collections.ConfigDict(dict(name="l2a", window=window, **opts))
  c.data.source = "jsonl"  # never read: the benchmark feeds random tokens
  c.data.seq_len = T
  c.data.batch_size = 1
  c.train.loss_chunk_size = min(loss_chunk, T)
  c.train.progress_bar = False
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  return c


def random_batch(T: int, vocab: int, seed: int, sharding=None) -> dict:
  """A [1, T] training batch of random tokens (one document, every position scored)."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(jax.random.key(seed))
  b = dict(inputs=jax.random.randint(k1, (1, T), 0, vocab, jnp.int32),
           targets=jax.random.randint(k2, (1, T), 0, vocab, jnp.int32),
           segment_ids=jnp.ones((1, T), jnp.int32),
           positions=jnp.arange(T, dtype=jnp.int32)[None],
           loss_mask=jnp.ones((1, T), jnp.float32))
  return b if sharding is None else jax.device_put(b, sharding)


def timed(fn: Callable[[], Any], n: int, warmup: int = 1) -> tuple[float, list[float], float]:
  """(median ms, all timed ms, first call s): fn() returns device arrays (blocked on)."""
  import jax
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  for _ in range(warmup - 1):
    jax.block_until_ready(fn())
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append((time.perf_counter() - t0) * 1e3)
  ts_sorted = sorted(ts)
  mid = len(ts) // 2
  med = ts_sorted[mid] if len(ts) % 2 else 0.5 * (ts_sorted[mid - 1] + ts_sorted[mid])
  return med, ts, first


def peak_bytes() -> int | None:
  """The device's peak bytes in use (bench/common.py; None without memory stats or when 0)."""
  return common.peak_bytes() or None


def _bf16_params(params, model_cfg):
  """Inference weights in the compute dtype (what a deployment serves); the router stays fp32
  (it computes in fp32 anyway)."""
  import jax
  import jax.numpy as jnp
  dt = jnp.dtype(model_cfg.dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params), model_cfg.replace(param_dtype=model_cfg.dtype)


class _Captured(logging.Handler):
  """Collects warnings (python warnings and logging >= WARNING) raised while a row runs: a kernel
  that fell back to the reference must show up in the results."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record):
    self.messages.append(f"{record.name}: {record.getMessage()}"[:300])

  def showwarning(self, message, category, filename, lineno, file=None, line=None):
    self.messages.append(f"{category.__name__}: {message}"[:300])


def _ensure_tokamax_importable():
  """tokamax imports xprof only for benchmark helpers; the device image has none: stub it the
  way bench/compact_attention.py does."""
  try:
    import xprof.cli.tools.get_kernel_stats_tool  # noqa: F401
  except ImportError:
    from bench.compact_attention import tokamax_impl
    tokamax_impl()


# ------------------------------------------------------------------------------------------------
# One row
# ------------------------------------------------------------------------------------------------

def run_row(T: int, scheme: str, *, shapes: dict = QWEN25_1P5B, reps: int = 5,
            decode_steps: int = 8, window: int = WINDOW, forward: bool = True,
            devices=None, progress: Callable[[dict], None] | None = None) -> dict:
  """Measures one (T, scheme) row; `progress(row)` after each phase (partial results survive a
  timeout). Speedups are not filled in here (they need the dense row)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax.inference import Engine, cache_bytes
  from condattn_jax.train import loop
  from condattn_jax.train import sharding as shd
  from condattn_jax.train.state import TrainState

  if jax.default_backend() == "gpu":
    _ensure_tokamax_importable()
  devices = list(devices or jax.local_devices()[:1])
  config = run_config(T, scheme, shapes=shapes, window=window)
  row: dict[str, Any] = dict(T=T, scheme=scheme, layers=int(shapes["num_layers"]),
                             device=devices[0].device_kind, jax_version=jax.__version__,
                             reps=reps, status="running", phase="build")
  opts = SCHEMES[scheme]
  if opts is not None:
    row.update(window=window, **opts)
  note = progress or (lambda r: None)
  cap = _Captured()
  logging.getLogger().addHandler(cap)
  old_show = warnings.showwarning
  warnings.showwarning = cap.showwarning
  try:
    t0 = time.perf_counter()
    setup = loop.build(config, devices=devices)
    cfg = setup.model_cfg
    params = loop.init_params(setup)
    jax.block_until_ready(params)
    row["init_s"] = time.perf_counter() - t0
    row["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
    row["phase"] = "prefill"
    note(row)

    # ---- inference: engine prefill (time to first token) and decode, bf16 weights
    ip, icfg = _bf16_params(params, cfg)
    engine = Engine(icfg, ip, cache_len=T + CACHE_EXTRA)
    template = engine.init_cache(1)
    row["kv_cache_bytes"] = cache_bytes(template)
    tokens = jax.random.randint(jax.random.key(7), (1, T), 0, cfg.vocab_size, jnp.int32)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    valid = jnp.ones((1, T), bool)
    zeros_logits = jnp.zeros((1, cfg.vocab_size), jnp.float32)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template)
    del template
    fresh = lambda: jax.block_until_ready(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec))

    def prefill():
      cache = fresh()  # the step donates its cache: a new empty one each call (not timed)
      t = time.perf_counter()
      out = jax.block_until_ready(engine._step(engine.params, cache, tokens, positions, valid,
                                               zeros_logits))
      return out, (time.perf_counter() - t) * 1e3

    (cache, logits, _), first_ms = prefill()
    row["prefill_first_s"] = first_ms / 1e3
    del cache, logits
    ts = []
    for _ in range(reps):
      (cache, logits, _), ms = prefill()
      ts.append(ms)
      if len(ts) < reps:
        del cache, logits
    row["prefill_ms"] = float(np.median(ts))
    row["prefill_ms_all"] = ts
    row["prefill_logits_finite"] = bool(jnp.all(jnp.isfinite(logits)))
    row["phase"] = "decode"
    note(row)

    dts = []
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    on = np.ones((1,), bool)
    for i in range(decode_steps + 2):  # 2 warm-ups (the first compiles)
      t = time.perf_counter()
      cache, logits = engine.decode_step(cache, tok, np.full((1,), T + i, np.int32), on, logits)
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      jax.block_until_ready((cache, tok))
      dts.append((time.perf_counter() - t) * 1e3)
    row["decode_first_s"] = dts[0] / 1e3
    row["decode_ms"] = float(np.median(dts[2:]))
    row["decode_ms_all"] = dts[2:]
    row["decode_logits_finite"] = bool(jnp.all(jnp.isfinite(logits)))
    del cache, logits, tok, engine, ip
    row["peak_infer_bytes"] = peak_bytes()
    row["phase"] = "train"
    note(row)

    # ---- the real train step: AOT compile, then warm-up + median of reps
    with shd.mesh_context(setup.mesh):
      opt_state = jax.jit(setup.tx.init, in_shardings=(setup.param_shardings,),
                          out_shardings=setup.state_shardings.opt_state)(params)
      state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32),
                                             setup.state_shardings.step),
                         params=params, opt_state=opt_state)
      del params, opt_state
      step_fn = loop.jit_train_step(setup)
      t0 = time.perf_counter()
      lowered = step_fn.lower(setup.abstract_state, setup.batch_abstract)
      row["lower_s"] = time.perf_counter() - t0
      compiled = lowered.compile()
      row["compile_s"] = time.perf_counter() - t0
      mem = compiled.memory_analysis()
      if mem is not None:
        row["compiled_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0))
      note(row)
      batch = random_batch(T, cfg.vocab_size, seed=1, sharding=setup.batch_sharding)
      box = {"state": state}
      del state

      def train():
        box["state"], box["metrics"] = compiled(box["state"], batch)
        return box["state"].params, box["metrics"]

      ms, all_ms, first = timed(train, reps)
      m = jax.device_get(box.pop("metrics"))
    row["train_first_s"] = first
    row["train_ms"] = ms
    row["train_ms_all"] = all_ms
    row["loss"] = float(m["loss"])
    row["loss_finite"] = bool(math.isfinite(row["loss"]))
    if "l2a/sparsity" in m:
      row["sparsity"] = float(m["l2a/sparsity"])
    row["peak_bytes"] = peak_bytes()
    row["phase"] = "forward" if forward else "done"
    note(row)

    # ---- extra: the cache-free forward to the last token's logits (fused dense kernels)
    if forward:
      train_params = box.pop("state").params
      ip, icfg = _bf16_params(train_params, cfg)
      del train_params
      from condattn_jax.models.decoder import Decoder
      model = Decoder(icfg)

      def last_logits(p, t):
        h, _ = model.apply({"params": p}, t, return_hidden=True)
        w = model.output_embedding(p).astype(icfg.compute_dtype)
        return jnp.einsum("bd,dv->bv", h[:, -1].astype(icfg.compute_dtype), w,
                          preferred_element_type=jnp.float32)

      t0 = time.perf_counter()
      fwd = jax.jit(last_logits).lower(ip, tokens).compile()
      row["forward_compile_s"] = time.perf_counter() - t0
      ms, all_ms, _ = timed(lambda: fwd(ip, tokens), reps)
      row["forward_ms"] = ms
      row["forward_ms_all"] = all_ms
    row["peak_bytes"] = peak_bytes()
    row["status"] = "ok"
    row["phase"] = "done"
  except Exception as e:  # record the failure (OOM, compile error) with its reason
    row["status"] = f"error in {row.get('phase')}: {type(e).__name__}: {str(e)[:2000]}"
    row["traceback"] = traceback.format_exc()[-4000:]
    row["peak_bytes"] = peak_bytes()
  finally:
    logging.getLogger().removeHandler(cap)
    warnings.showwarning = old_show
    row["warnings"] = sorted(set(cap.messages))[:20]
    note(row)
  return row


# ------------------------------------------------------------------------------------------------
# Sanity check on a short sequence
# ------------------------------------------------------------------------------------------------

_rel = common.rel_err


def sanity(*, shapes: dict = QWEN25_1P5B, T: int = 1024, window: int = 256, tol: float = 5e-2,
           dtype: str = "bfloat16") -> dict:
  """L2A vs dense logits on one random sequence of T tokens (full model, one set of dense
  weights converted with from_dense). Returns {check: rel. error, ..., 'ok': bool}."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax import convert
  from condattn_jax.attention import configure
  from condattn_jax.attention.l2a import from_dense
  from condattn_jax.inference import Engine
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder

  if jax.default_backend() == "gpu":
    _ensure_tokamax_importable()
  base = ModelConfig(**shapes, dtype=dtype, param_dtype=dtype, remat_policy="none")
  tok = jax.random.randint(jax.random.key(3), (1, T), 0, base.vocab_size, jnp.int32)
  params = jax.jit(lambda t: Decoder(base).init(jax.random.key(0), t)["params"])(tok[:, :8])
  params = convert.unbox(params)

  def logits(cfg, p):
    return jax.jit(lambda p, t: Decoder(cfg).apply({"params": p}, t)[0])(p, tok)

  out: dict[str, Any] = dict(T=T, layers=base.num_layers, window=window, tol=tol)
  dense = logits(base, params)
  # routing='all', window 0: s = x, g = norm(x) with the copied norm, global attn = dense attn
  all0 = configure(base, "l2a", routing="all", window=0)
  p_all0 = from_dense(params, all0)
  out["l2a_all_window0_vs_dense"] = _rel(logits(all0, p_all0), dense)
  # q = 0.2 routing: the fused kernels (auto) vs the reference attention
  q = configure(base, "l2a", routing="bernoulli", bernoulli_q=0.2, window=window)
  pq = from_dense(params, q)
  fused = logits(q, pq)
  if jax.default_backend() != "cpu":  # on CPU 'auto' is the reference: nothing to compare
    ref_cfg = configure(q.replace(attention_impl="reference"), "l2a", compact_impl="reference")
    out["l2a_q0.2_fused_vs_reference"] = _rel(fused, logits(ref_cfg, pq))
    out["dense_fused_vs_reference"] = _rel(
        dense, logits(base.replace(attention_impl="reference"), params))
  # engine: prefill T-1 tokens, decode token T-1; logits of positions T-2 and T-1
  for name, cfg, p, full in (("dense", base, params, dense), ("l2a_q0.2", q, pq, fused)):
    eng = Engine(cfg, p, cache_len=T + CACHE_EXTRA)
    cache, pre, _ = eng.prefill([np.asarray(tok[0, :T - 1]).tolist()])
    _, dec = eng.decode_step(cache, tok[:, T - 1], np.full((1,), T - 1, np.int32),
                             np.ones((1,), bool), pre)
    out[f"engine_prefill_vs_forward_{name}"] = _rel(pre[0], full[0, T - 2])
    out[f"engine_decode_vs_forward_{name}"] = _rel(dec[0], full[0, T - 1])
  errs = {k: v for k, v in out.items() if isinstance(v, float) and k != "tol"}
  out["finite"] = bool(all(math.isfinite(v) for v in errs.values()))
  out["ok"] = out["finite"] and all(v <= tol for v in errs.values())
  return out


# ------------------------------------------------------------------------------------------------
# The parent: one process per row, speedups, the JSON and the table
# ------------------------------------------------------------------------------------------------

def peer(rows: list[dict], r: dict, scheme: str) -> dict | None:
  """The row of `scheme` with r's T from the same run (same `run_date` when rows were merged
  from several runs): speedups compare rows timed side by side only."""
  return next((d for d in rows if d["T"] == r["T"] and d["scheme"] == scheme
               and d.get("run_date") == r.get("run_date")), None)


def add_speedups(rows: list[dict]) -> None:
  """speedup_* = dense ms / row ms for rows of the same T (dense rows get 1.0), and the expected
  train step with the forced-global step at p_force (0.9 * q0.2 + 0.1 * all, per layer)."""
  pairs = (("train", "train_ms"), ("prefill", "prefill_ms"), ("decode", "decode_ms"),
           ("forward", "forward_ms"))
  for r in rows:
    dense = peer(rows, r, "dense")
    for name, key in pairs:
      ok = dense is not None and dense.get(key) and r.get(key)
      r[f"speedup_{name}"] = dense[key] / r[key] if ok else None
    if r["scheme"] == "l2a_q0.2":
      full = peer(rows, r, "l2a_all")
      if full is not None and full.get("train_ms") and r.get("train_ms"):
        r["train_ms_pforce"] = (1 - P_FORCE) * r["train_ms"] + P_FORCE * full["train_ms"]
        r["speedup_train_pforce"] = (dense["train_ms"] / r["train_ms_pforce"]
                                     if dense is not None and dense.get("train_ms") else None)


def check_results(doc: dict, rel_tol: float = 1e-6) -> None:
  """Raises ValueError naming the first inconsistency of a results document: the fields, and
  every speedup equal to the ratio of the document's own ms (dense of the same T)."""
  for k in ("device", "jax_version", "date", "rows"):
    if k not in doc:
      raise ValueError(f"e2e results: missing top-level field {k!r}")
  for i, r in enumerate(doc["rows"]):
    where = f"rows[{i}] (T={r.get('T')}, scheme={r.get('scheme')})"
    missing = [k for k in ROW_FIELDS if k not in r]
    if missing:
      raise ValueError(f"e2e results: {where} lacks {missing}")
    if r["scheme"] not in SCHEMES:
      raise ValueError(f"e2e results: {where} has unknown scheme {r['scheme']!r}")
    if r["status"] == "ok" and r["layers"] != doc.get("layers", r["layers"]):
      raise ValueError(f"e2e results: {where} has layers={r['layers']}, the run {doc['layers']}")
    dense = peer(doc["rows"], r, "dense")
    for name in ("train", "prefill", "decode", "forward"):
      key, sp = f"{name}_ms", r.get(f"speedup_{name}")
      if sp is None:
        continue
      if dense is None or not dense.get(key) or not r.get(key):
        raise ValueError(f"e2e results: {where} claims speedup_{name}={sp} without both ms")
      want = dense[key] / r[key]
      if abs(sp - want) > rel_tol * abs(want):
        raise ValueError(f"e2e results: {where} speedup_{name}={sp} but dense {key} / {key} = "
                         f"{want}")
    if r.get("speedup_train_pforce") is not None:
      full = peer(doc["rows"], r, "l2a_all")
      if full is None:
        raise ValueError(f"e2e results: {where} claims speedup_train_pforce without an l2a_all row")
      want_ms = (1 - P_FORCE) * r["train_ms"] + P_FORCE * full["train_ms"]
      if abs(r["train_ms_pforce"] - want_ms) > rel_tol * want_ms:
        raise ValueError(f"e2e results: {where} train_ms_pforce={r['train_ms_pforce']} but "
                         f"0.9 * train_ms + 0.1 * l2a_all = {want_ms}")
      want = dense["train_ms"] / want_ms
      if abs(r["speedup_train_pforce"] - want) > rel_tol * want:
        raise ValueError(f"e2e results: {where} speedup_train_pforce={r['speedup_train_pforce']} "
                         f"but {want}")


def merge_results(docs: list[dict]) -> dict:
  """One document from several runs of the same device and jax version (e.g. one command per T
  within a lease's limits): rows keep their run's date (`run_date`), speedups stay within a
  run; `runs` lists each run's date, command and tree."""
  if not docs:
    raise ValueError("merge_results: no documents")
  for d in docs:
    check_results(d)
    if (d["device"], d["jax_version"]) != (docs[0]["device"], docs[0]["jax_version"]):
      raise ValueError(f"merge_results: {d['device']} / jax {d['jax_version']} differs from "
                       f"{docs[0]['device']} / jax {docs[0]['jax_version']}: keep them apart")
  out = {k: v for k, v in docs[0].items() if k not in ("rows", "not_run", "command", "tree")}
  out["date"] = max(d["date"] for d in docs)
  out["runs"] = [dict(date=d["date"], command=d.get("command"), tree=d.get("tree"),
                      rows=[(r["T"], r["scheme"]) for r in d["rows"]]) for d in docs]
  out["sanity"] = next((d["sanity"] for d in docs if d.get("sanity")), None)
  out["rows"], out["not_run"] = [], []
  for d in docs:
    out["rows"] += [dict(r, run_date=d["date"]) for r in d["rows"]]
    out["not_run"] += d.get("not_run", [])
  out["rows"].sort(key=lambda r: (r["T"], r["run_date"], list(SCHEMES).index(r["scheme"])))
  add_speedups(out["rows"])
  check_results(out)
  return out


def attention_diag(T: int, reps: int = 5) -> dict:
  """What one layer's attention costs on the train step's fused paths (Qwen2.5-1.5B attention
  shapes, B = 1, bf16): causal vs window 4096, each with segment ids (the train batch) and
  without (cuDNN); with segment ids and a window also tokamax and the Pallas compacted kernel
  (all queries active) explicitly; fwd and fwd+bwd ms, median of `reps` after a warm-up."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax import ops
  _ensure_tokamax_importable()
  N, K, H = QWEN25_1P5B["num_heads"], QWEN25_1P5B["num_kv_heads"], QWEN25_1P5B["head_dim"]
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (1, T, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, T, K, H), jnp.bfloat16)
  ct = jax.random.normal(ks[3], (1, T, N, H), jnp.bfloat16)
  pos = jnp.arange(T, dtype=jnp.int32)[None]
  seg = jnp.ones((1, T), jnp.int32)
  out: dict[str, Any] = dict(T=T)
  for name, window, segs, impl in (("causal_seg(auto)", None, True, "auto"),
                                   ("window4096_seg(auto)", WINDOW, True, "auto"),
                                   ("window4096_seg(tokamax)", WINDOW, True, "tokamax"),
                                   ("window4096_seg(pallas)", WINDOW, True, "pallas"),
                                   ("causal(cudnn)", None, False, "auto"),
                                   ("window4096(cudnn)", WINDOW, False, "auto")):
    m = ops.MaskSpec(q_positions_BT=pos, kv_positions_BS=pos,
                     q_segment_ids_BT=seg if segs else None,
                     kv_segment_ids_BS=seg if segs else None, window=window, contiguous=True)
    f = lambda q, k, v, m=m, impl=impl: ops.attention(q, k, v, m, impl=impl)
    fb = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * ct),
                  argnums=(0, 1, 2))
    out[name] = {key: timed(lambda g=jax.jit(g): g(q, k, v), reps)[0]
                 for key, g in (("fwd_ms", f), ("fwdbwd_ms", fb))}
  return out


def _fmt(v, spec=".1f"):
  return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
  head = (f"{'T':>7} {'scheme':9} {'L':>2} {'compile_s':>9} {'train_ms':>9} {'prefill_ms':>10} "
          f"{'decode_ms':>9} {'fwd_ms':>8} {'peak_GiB':>8} {'sp_train':>8} {'sp_pre':>6} "
          f"{'sp_fwd':>6} {'sp_dec':>6} {'sparsity':>8}  status")
  lines = [head]
  for r in rows:
    pk = r.get("peak_bytes")
    lines.append(
        f"{r['T']:>7} {r['scheme']:9} {r.get('layers', 0):>2} {_fmt(r.get('compile_s')):>9} "
        f"{_fmt(r.get('train_ms')):>9} {_fmt(r.get('prefill_ms')):>10} "
        f"{_fmt(r.get('decode_ms'), '.2f'):>9} {_fmt(r.get('forward_ms')):>8} "
        f"{_fmt(None if pk is None else pk / 2**30):>8} {_fmt(r.get('speedup_train'), '.2f'):>8} "
        f"{_fmt(r.get('speedup_prefill'), '.2f'):>6} {_fmt(r.get('speedup_forward'), '.2f'):>6} "
        f"{_fmt(r.get('speedup_decode'), '.2f'):>6} {_fmt(r.get('sparsity'), '.3f'):>8}  "
        f"{r.get('status', '')[:60]}" + (f"  run {r['run_date'][:16]}" if r.get("run_date") else ""))
    if r.get("speedup_train_pforce") is not None:
      lines.append(f"{'':>7} {'':9}    train with p_force {P_FORCE} (expected): "
                   f"{r['train_ms_pforce']:.1f} ms, speedup {r['speedup_train_pforce']:.2f}")
  return "\n".join(lines)


def _child(args) -> int:
  """One row (or the sanity check) in this process; results in args.result."""
  def write(obj):
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
      json.dump(obj, f, indent=1)
    os.replace(tmp, args.result)

  if args.child == "sanity":
    import jax
    try:
      res = (sanity(shapes=TINY, T=64, window=16, dtype="float32", tol=1e-4) if args.tiny
             else sanity())
    except Exception as e:
      res = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}",
                 traceback=traceback.format_exc()[-4000:])
    res.update(device=jax.local_devices()[0].device_kind, jax_version=jax.__version__)
    write(res)
    return 0
  T, scheme = int(args.child.split(":")[0]), args.child.split(":", 1)[1]
  reps = args.reps_long if T >= LONG_T else args.reps
  run_row(T, scheme, reps=reps, decode_steps=args.decode_steps, forward=not args.no_forward,
          progress=write, **(dict(shapes=TINY, window=16) if args.tiny else {}))
  return 0


def _spawn(child: str, result: str, args, timeout: float) -> tuple[dict | None, str]:
  cmd = [sys.executable, "-m", "bench.e2e", "--child", child, "--result", result,
         "--reps", str(args.reps), "--reps_long", str(args.reps_long),
         "--decode_steps", str(args.decode_steps)] + (["--no_forward"] if args.no_forward else [])
  cmd += ["--tiny"] if args.tiny else []
  t0 = time.time()
  try:
    p = subprocess.run(cmd, timeout=max(timeout, 1), cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    how = "" if p.returncode == 0 else f"process exit code {p.returncode}"
  except subprocess.TimeoutExpired:
    how = f"timeout: stopped after {time.time() - t0:.0f} s (deadline)"
  res = None
  if os.path.exists(result):
    with open(result) as f:
      res = json.load(f)
  return res, how


FLAGS = common.flag_values()
flags.DEFINE_list("T", ["32768", "65536", "131072"], "context lengths", flag_values=FLAGS)
flags.DEFINE_list("schemes", list(SCHEMES), f"schemes, of {list(SCHEMES)}", flag_values=FLAGS)
flags.DEFINE_integer("reps", 5, "timed repeats (median)", flag_values=FLAGS)
flags.DEFINE_integer("reps_long", 3, "timed repeats at T >= 128K", flag_values=FLAGS)
flags.DEFINE_integer("decode_steps", 8, "timed decode steps (median)", flag_values=FLAGS)
flags.DEFINE_bool("no_forward", False, "skip the cache-free forward", flag_values=FLAGS)
flags.DEFINE_bool("no_sanity", False, "skip the sanity check", flag_values=FLAGS)
flags.DEFINE_float("deadline_s", None, "stop starting rows after this many seconds; a running "
                   "row is cut there", flag_values=FLAGS)
flags.DEFINE_string("tree", os.environ.get("E2E_TREE"), "what tree ran (commit and dirty files), "
                    "recorded in the JSON", flag_values=FLAGS)
flags.DEFINE_bool("tiny", False, "tiny shapes (2 layers, window 16): a CPU check of the plumbing",
                  flag_values=FLAGS)
flags.DEFINE_multi_string("merge", None, "merge these result files (one device) into "
                          "--out_dir/e2e_<device>.json", flag_values=FLAGS)
flags.DEFINE_list("diag", None, "only time one layer's attention on the fused paths at these T "
                  "(attention_diag)", flag_values=FLAGS)
flags.DEFINE_string("child", None, "internal: run one row ('T:scheme' or 'sanity')",
                    flag_values=FLAGS)
flags.DEFINE_string("result", None, "internal: the child's result file", flag_values=FLAGS)


def main(argv=None) -> int:
  fv = common.parse_flags(FLAGS, argv)
  args = types.SimpleNamespace(**{name: fv[name].value for name in fv})
  args.T = [int(x) for x in args.T]
  args.diag = None if args.diag is None else [int(x) for x in args.diag]
  if bad := [x for x in args.schemes if x not in SCHEMES]:
    raise SystemExit(f"--schemes {bad}: choose from {list(SCHEMES)}")
  if args.child:
    return _child(args)
  if args.merge:
    doc = merge_results([common.read_result(p) for p in args.merge])
    dest = common.result_path("e2e", args.out_dir, doc["device"])
    common.write_result(dest, "e2e", doc, name="merged")
    print(f"wrote {dest}")
    print(table(doc["rows"]))
    return 0
  if args.diag:
    for T in args.diag:
      print("DIAG", json.dumps(attention_diag(T)), flush=True)
    return 0

  t_start = time.time()
  work = tempfile.mkdtemp(prefix="e2e_rows_")  # the children's partial results
  left = lambda: (math.inf if args.deadline_s is None else args.deadline_s - (time.time() - t_start))
  os.makedirs(args.out_dir, exist_ok=True)
  doc: dict[str, Any] = dict(
      device=None, jax_version=None,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      tree=args.tree, command="python -m bench.e2e " + " ".join(argv or sys.argv[1:]),
      model=dict(TINY if args.tiny else QWEN25_1P5B, dtype="bfloat16", param_dtype="float32", remat_policy="full",
                 batch=1, loss_chunk_size=LOSS_CHUNK, cache_len="T + 128"),
      layers=(TINY if args.tiny else QWEN25_1P5B)["num_layers"], schemes={k: v for k, v in SCHEMES.items()},
      l2a_window=WINDOW,
      timing=(f"median of {args.reps} (T < {LONG_T}) / {args.reps_long} (T >= {LONG_T}) after a "
              f"warm-up; decode: median of {args.decode_steps} steps after 2; block_until_ready"),
      notes=["l2a_q0.2 uses routing='bernoulli' with p_force=0.1, but the L2A layer takes the "
             "forced-global step only under routing='learned': its train step never runs it. "
             "train_ms_pforce = 0.9 * l2a_q0.2 + 0.1 * l2a_all is the expected step with the "
             "forced path at p_force=0.1 (derived, not timed).",
             "prefill_ms is the engine's one-chunk prefill into its caches (the compacted Pallas "
             "kernel for every cached attention, dense included); forward_ms is the cache-free "
             "forward (cuDNN / tokamax for dense self-attention)."],
      sanity=None, rows=[], not_run=[])
  path = lambda: common.result_path("e2e", args.out_dir, doc["device"] or "unknown")

  saved = []  # the file this run was appended to (the first save appends, later ones update)

  def save():
    add_speedups(doc["rows"])
    run = common.make_run("e2e", doc, name="tiny" if args.tiny else "main")
    if saved and saved[-1] == path():
      common.replace_last_run(path(), run)
    else:
      common.append_run(path(), run)
      saved.append(path())

  def adopt(res):
    if res and res.get("device") and doc["device"] is None:
      doc["device"], doc["jax_version"] = res["device"], res["jax_version"]

  if not args.no_sanity:
    res, how = _spawn("sanity", os.path.join(work, "sanity.json"), args, left())
    adopt(res)
    doc["sanity"] = res if res else dict(ok=False, error=how or "no result")
    print("sanity:", json.dumps(doc["sanity"]), flush=True)
    save()
  for T in sorted(args.T):
    for scheme in args.schemes:
      if left() < 60:
        doc["not_run"].append(dict(T=T, scheme=scheme, reason="deadline (--deadline_s) reached"))
        save()
        continue
      res, how = _spawn(f"{T}:{scheme}", os.path.join(work, f"row_{T}_{scheme}.json"),
                        args, left() - 10)
      adopt(res)
      if res is None:
        res = dict(T=T, scheme=scheme, layers=doc["layers"], status=how or "no result")
      elif how:
        res["status"] = f"{how} in phase {res.get('phase')}"
      for k in ROW_FIELDS:
        res.setdefault(k, None)
      doc["rows"].append(res)
      save()
      print(json.dumps({k: res.get(k) for k in ROW_FIELDS + ("status", "forward_ms", "sparsity")}),
            flush=True)
  save()
  print(f"wrote {path()}")
  print(table(doc["rows"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
