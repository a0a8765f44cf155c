r"""Peak prefill memory and latency: scheme 'segmented' vs dense, through inference.Engine.

    python -m bench.segmented_memory                    # preset 'gpu' (one GPU, ~10 min)
    python -m bench.segmented_memory --preset test      # tiny CPU shapes (tests)

Rows (each in its own process, so peak_bytes_in_use is the row's own), at every context length:
  dense          Engine(prefill_chunk=None): one-shot prefill, full KV cache (the usual baseline)
  dense_chunked  Engine(prefill_chunk=S): chunked prefill over a full KV cache
  segmented      Engine(prefill_chunk=S): segment-by-segment prefill (tail, pool, retrieval)
A row: random weights of the model shape (LLaMA-2-7B by default; initialised on the host and
copied over, so the device's peak is the prefill's), one prompt of T random
tokens, a first prefill (compile + run), then `repeats` timed prefills (median, seconds,
device work included). Memory: the device's peak_bytes_in_use after the row (GPU/TPU; None on
CPU), the weights' bytes, peak minus weights, the cache bytes the engine holds, and the
compiled step's temp bytes (XLA memory analysis, any platform).
Targets (issue 14): segmented peak (minus weights) <= 1/4 of dense at 64K, latency <= dense.

Writes bench/results/segmented_memory.json (preset gpu) with the settings, the date and device.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from absl import flags  # noqa: E402
from bench import common

PRESETS = {
    # LLaMA-2-7B shape (32 layers, 32 heads, d=4096), bf16, the paper's S/M/R and lists
    "gpu": dict(lengths=(16384, 32768, 65536), layers=32, hidden=4096, inter=11008, heads=32,
                kv_heads=32, head_dim=128, vocab=32000, dtype="bfloat16", repeats=3,
                seg=dict(segment_len=4096, tail_len=512, retrieve_len=512)),
    "test": dict(lengths=(64,), layers=2, hidden=32, inter=64, heads=4, kv_heads=2,
                 head_dim=8, vocab=64, dtype="float32", repeats=1,
                 seg=dict(segment_len=16, tail_len=4, retrieve_len=8, long_heads=(0,),
                          long_layers=(1,), query_len=8, summary_window=4, summary_stride=2,
                          summary_tail=2, topk=4, anchors=2, expand=(-1, 2))),
}
ROWS = ("dense", "dense_chunked", "segmented")
# result file of the recorded preset (others: <out_dir>/segmented_memory_<device>.json)
FILES = {"gpu": "segmented_memory.json"}


def _config(p, row):
  from condattn_jax.attention import configure
  from condattn_jax.models.config import ModelConfig
  cfg = ModelConfig(family="llama", vocab_size=p["vocab"], hidden_size=p["hidden"],
                    intermediate_size=p["inter"], num_layers=p["layers"], num_heads=p["heads"],
                    num_kv_heads=p["kv_heads"], head_dim=p["head_dim"], rope_theta=10000.0,
                    dtype=p["dtype"], param_dtype=p["dtype"])
  return configure(cfg, "segmented", **p["seg"]) if row == "segmented" else cfg


def host_params(cfg, seed: int = 0):
  """Random weights of cfg's shapes made on the host (numpy: a 4M-value random pattern, shifted
  per leaf and tiled; norm scales 1) and copied leaf by leaf, so the device's peak is the
  prefill's, not an initialiser's (a jitted init of a 7B model makes [L, 11008, 4096] random
  bits at once: GBs of temporaries). Memory and latency do not depend on the values."""
  import flax.linen as nn
  import ml_dtypes  # noqa: F401  (numpy bfloat16)
  from condattn_jax.models.decoder import Decoder
  shapes = nn.unbox(jax.eval_shape(
      lambda k: Decoder(cfg).init(k, jnp.zeros((1, 8), jnp.int32))["params"],
      jax.random.PRNGKey(seed)))
  base = (np.random.default_rng(seed).standard_normal(1 << 22, dtype=np.float32) * 0.02)
  dev = jax.devices()[0]
  out, i = [], 0
  leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
  for path, x in leaves:
    dt = np.dtype(x.dtype)
    if "scale" in jax.tree_util.keystr(path):
      h = np.ones(x.shape, dt)
    else:
      h = np.resize(np.roll(base, 7919 * i).astype(dt), x.shape)
    out.append(jax.device_put(h, dev))
    i += 1
  return jax.tree_util.tree_unflatten(tree, out)


def run_row(preset: str, row: str, T: int) -> dict:
  """One row in this process."""
  from condattn_jax.inference import Engine, cache_bytes
  p = PRESETS[preset]
  cfg = _config(p, row)
  S = p["seg"]["segment_len"]
  params = host_params(cfg)
  weights = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
  eng = Engine(cfg, params, cache_len=T, prefill_chunk=None if row == "dense" else S)
  prompt = [list(np.random.default_rng(0).integers(1, p["vocab"], T))]
  t0 = time.perf_counter()
  cache, logits, _ = eng.prefill(prompt)
  logits.block_until_ready()
  first = time.perf_counter() - t0
  held = cache_bytes(cache)
  del cache
  times = []
  for _ in range(p["repeats"]):
    t0 = time.perf_counter()
    cache, logits, _ = eng.prefill(prompt)
    logits.block_until_ready()
    times.append(time.perf_counter() - t0)
    del cache
  C = T if row == "dense" else S
  lowered = eng._step.lower(eng, params, eng.init_cache(1), jnp.zeros((1, C), jnp.int32),
                            jnp.zeros((1, C), jnp.int32), jnp.ones((1, C), bool),
                            jnp.zeros((1, cfg.vocab_size), jnp.float32))
  ma = lowered.compile().memory_analysis()
  peak = common.peak_bytes()
  return dict(row=row, T=T, chunk=C, prefill_s=statistics.median(times), first_call_s=first,
              peak_bytes=peak, weights_bytes=weights,
              peak_minus_weights=None if peak is None else peak - weights,
              cache_bytes=held, step_temp_bytes=int(getattr(ma, "temp_size_in_bytes", 0) or 0),
              logits_finite=bool(np.isfinite(np.asarray(logits, np.float32)).all()))


def summarise(p: dict, rows: list[dict]) -> tuple[dict, dict]:
  """Per length: segmented / dense ratios (memory minus weights, cache, latency); targets at the
  longest length with both rows."""
  summary = {}
  for T in sorted({x["T"] for x in rows}):
    r = {x["row"]: x for x in rows if x["T"] == T and "error" not in x}
    if "dense" in r and "segmented" in r:
      d, s = r["dense"], r["segmented"]
      mem = (None if d["peak_minus_weights"] is None
             else s["peak_minus_weights"] / d["peak_minus_weights"])
      summary[str(T)] = dict(memory_ratio_vs_dense=mem,
                             cache_ratio_vs_dense=s["cache_bytes"] / d["cache_bytes"],
                             latency_ratio_vs_dense=s["prefill_s"] / d["prefill_s"])
  last = summary[max(summary, key=int)] if summary else {}
  targets = dict(at_length=max(map(int, summary)) if summary else None,
                 memory_quarter_at_max_len=(last.get("memory_ratio_vs_dense") is not None
                                            and last["memory_ratio_vs_dense"] <= 0.25),
                 latency_no_worse_at_max_len=last.get("latency_ratio_vs_dense", 9) <= 1.0)
  return summary, targets


def run(preset: str, lengths=None, rows_wanted=ROWS, out: str | None = None) -> dict:
  """Each (row, T) in a process of its own; with `out`, rows already there for other
  (row, T) are kept (runs split over several commands merge) and the file is rewritten after
  every row (an interrupted run keeps what it measured)."""
  p = PRESETS[preset]
  lengths = tuple(lengths or p["lengths"])
  rows = []
  if out and os.path.exists(out):
    prev = common.read_result(out)
    if prev.get("preset") == preset:
      rows = [r for r in prev["rows"] if not (r["T"] in lengths and r["row"] in rows_wanted)]

  written = False

  def doc():
    summary, targets = summarise(p, rows)
    return dict(bench="segmented_memory", preset=preset,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, platform=jax.default_backend(),
                jax_version=jax.__version__, settings={k: v for k, v in p.items()},
                rows=sorted(rows, key=lambda r: (r["T"], ROWS.index(r["row"]))),
                summary=summary, targets=targets)

  for T in lengths:
    for row in rows_wanted:
      t0 = time.perf_counter()
      cmd = [sys.executable, "-m", "bench.segmented_memory", "--preset", preset, "--row",
             f"{row},{T}"]
      res = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(
          os.path.dirname(os.path.abspath(__file__))))
      if res.returncode:
        rows.append(dict(row=row, T=T, error=res.stderr.strip().splitlines()[-1:]))
      else:
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
      rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
      print(json.dumps(rows[-1]), flush=True)
      if out:  # the first row appends this run, later rows update it
        new = common.make_run("segmented_memory", doc(), name=preset)
        if written:
          common.replace_last_run(out, new)
        else:
          common.append_run(out, new)
          written = True
  return doc()


FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "gpu", sorted(PRESETS), "sizes", flag_values=FLAGS)
flags.DEFINE_string("row", None, "internal: 'name,T' runs one row, prints JSON", flag_values=FLAGS)
flags.DEFINE_string("lengths", "", "comma-separated context lengths (default: the preset's); rows "
                    "of other lengths already in the result file are kept", flag_values=FLAGS)
flags.DEFINE_string("rows", ",".join(ROWS), f"subset of {','.join(ROWS)}", flag_values=FLAGS)


def main(argv=None):
  args = common.parse_flags(FLAGS, argv)
  if args.row:
    name, T = args.row.split(",")
    print(json.dumps(run_row(args.preset, name, int(T))))
    return 0
  if args.preset == "gpu" and jax.default_backend() not in ("gpu", "cuda", "rocm"):
    print("preset 'gpu' needs a GPU (use --preset test on CPU)")
    return 2
  rows = tuple(x for x in args.rows.split(",") if x)
  bad = sorted(set(rows) - set(ROWS))
  if bad:
    raise SystemExit(f"--rows {bad}: choose from {ROWS}")
  lengths = tuple(int(x) for x in args.lengths.split(",") if x) or None
  out = common.result_path("segmented_memory", args.out_dir, fixed=FILES.get(args.preset))
  r = run(args.preset, lengths, rows, out)
  print(json.dumps(dict(summary=r["summary"], targets=r["targets"]), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
