"""Claims of bench/decode.py's recorded GPU runs (decode_<device>.json; see
bench/claims/__init__.py). Issue 33's targets are recorded on each run as `targets` (met or not:
the baseline before the decode kernels); the claims here are that those verdicts and every derived
number follow from the stored rows."""
from bench.claims import approx, claim, expect, quote

H100 = "decode_NVIDIA_H100_80GB_HBM3.json"
RUNS = ("main", "rest", "match", "aha_rate", "match128", "inplace_cudnn", "split_kv",
        "split_kv_no_cond", "main_decode_kernel", "serve", "fits", "aha10", "match128k", "aha10b",
        "match_flat", "match_flat2", "match_split", "match_nocond", "match_flat_il",
        "elastic_rows", "elastic_decided", "elastic_fill", "aux_ab", "greedy_step",
        "greedy_step_b", "serve_greedy", "serve_dev", "b32", "serve_planned",
        "serve_planned64") + tuple(
            f"all_{k}" for k in range(14))


@claim("decode", run=RUNS, file="decode_*NVIDIA*")
def rows_and_targets_follow_from_the_stored_numbers(rec, run):
  """Every row ran or says why; limit_ms = bytes / the card's bandwidth, x_limit = ms / limit_ms,
  bytes = weights + K/V, scheme ratios against the dense row of the same point; the recorded
  target verdicts == targets_of(rows) re-evaluated."""
  from bench import decode
  bw = run["settings"]["bandwidth_tbps"]
  expect(bw == decode.bandwidth_tbps(run["device"], None), ("bandwidth", bw, run["device"]))
  ok = [r for r in run["rows"] if r["status"] == "ok"]
  expect(ok, "no row finished")
  for r in run["rows"]:
    expect(r["status"] in ("ok", "error", "skipped"), r)
    expect(r["status"] == "ok" or r.get("error") or r.get("reason"), r)
  eng = {(r["scheme"], r["shapes"], r["B"], r["T"]): r for r in ok
         if "bytes" in r and "kind" not in r}
  for r in eng.values():
    expect(r["bytes"] == r["weight_bytes"] + r["kv_bytes"] and r["ms"] > 0 and r["logits_finite"])
    expect(r["limit_ms"] == approx(r["bytes"] / (bw * 1e9)) and
           r["x_limit"] == approx(r["ms"] / r["limit_ms"]), r["scheme"])
    d = eng.get(("dense", r["shapes"], r["B"], r["T"]))
    if r["scheme"] != "dense" and d is not None:
      expect(r["achieved"] == approx(d["ms"] / r["ms"] / (d["bytes"] / r["bytes"])), r["scheme"])
  for r in ok:
    if r.get("kind") == "fits":  # peak from the memory analysis; fits against the card
      expect(r["peak_est_bytes"] == r["arg_bytes"] + r["out_bytes"] - r["alias_bytes"]
             + r["temp_bytes"] and r["fits"] == (r["peak_est_bytes"] <= r["card_bytes"]), r)
    if r.get("kind") == "serve":
      expect(r["tokens_per_s"] == approx(r["tokens"] / r["wall_s"]), r["mode"])
  want = decode.targets_of(run["rows"], run["settings"]["dense_shapes"])
  expect([(t["name"], t["met"]) for t in run["targets"]] ==
         [(t["name"], t["met"]) for t in want], "recorded target verdicts differ from the rows'")


def _row(rows, scheme, shapes, B, T):
  """The engine row that ran (status ok) for scheme / shapes / B / T."""
  return next(x for x in rows if (x["scheme"], x["shapes"], x["B"], x["T"]) == (scheme, shapes, B, T)
              and x["status"] == "ok")


def _engine_line(rows, scheme, shapes, B, T):
  r = _row(rows, scheme, shapes, B, T)
  return (f"| {scheme} ({shapes}) | {B} | {T // 1024}K | {r['ms']:.1f} | {r['limit_ms']:.2f} | "
          f"{r['x_limit']:.1f} |")


@quote("docs/performance.md", H100, run="main")
def performance_decode_main(rec, run):
  """docs/performance.md's Decode table (main run): dense and scheme rows, the baselines, the
  prefill pair."""
  rows = run["rows"]
  q = "qwen2.5-1.5b"
  out = [_engine_line(rows, "dense", q, B, T) for B, T in
         ((1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 8192))]
  out += [_engine_line(rows, s, sh, B, T) for s, sh, B, T in
          (("l2a", q, 1, 32768), ("l2a", q, 1, 131072), ("elastic", q, 1, 32768),
           ("aha", "olmo2-1b", 1, 32768), ("dense", "olmo2-1b", 1, 32768))]
  for B, T in ((1, 8192), (1, 32768), (1, 131072), (8, 32768)):
    st, pl = (next(x for x in rows if (x["scheme"], x["B"], x["T"]) == (n, B, T))
              for n in ("xla_stacked", "xla_per_layer"))
    out.append(f"| {B} | {T // 1024}K | {st['ms']:.2f} | {pl['ms']:.2f} | "
               f"{st['temp_over_cache']:.2f} | {pl['temp_over_cache']:.2f} |")
  pre = {r["mode"]: r for r in rows if r.get("kind") == "prefill"}
  out.append(f"{pre['one_shot']['ms']:.0f} ms one-shot, {pre['chunked']['ms']:.0f} ms in "
             f"{pre['chunked']['chunk']}-token chunks")
  return out


@quote("docs/performance.md", H100, run="rest")
def performance_decode_rest(rec, run):
  """The rows of the second run: segmented and dense on LLaMA-2-7B shapes, L2A at B = 8."""
  rows = run["rows"]
  return [_engine_line(rows, "segmented", "llama2-7b", 1, 32768),
          _engine_line(rows, "dense", "llama2-7b", 1, 32768),
          _engine_line(rows, "l2a", "qwen2.5-1.5b", 8, 32768)]


@quote("docs/performance.md", H100, run="match")
def performance_decode_match(rec, run):
  rows = run["rows"]
  return [_engine_line(rows, "match", "qwen2.5-1.5b", 1, 8192),
          _engine_line(rows, "match", "qwen2.5-1.5b", 1, 32768)]


@quote("docs/performance.md", H100, run="aha_rate")
def performance_decode_aha_local(rec, run):
  return [_engine_line(run["rows"], "aha", "olmo2-1b", 1, 32768)]


@quote("docs/performance.md", H100, run="match128")
def performance_decode_match_128k(rec, run):
  return [_engine_line(run["rows"], "match", "qwen2.5-1.5b", 1, 131072)]


def _baseline_line(rows, B, T):
  st, pl = (next(x for x in rows if (x["scheme"], x["B"], x["T"]) == (n, B, T))
            for n in ("xla_stacked", "xla_per_layer"))
  return f"| {B} | {T // 1024}K | {st['ms']:.2f} | {pl['ms']:.2f} |"


def _achieved(rows, scheme, shapes, B, T):
  r = _row(rows, scheme, shapes, B, T)
  return f"{r['ms']:.2f} ms, {r['achieved']:.2f} of the bound"


@quote("docs/performance.md", H100, run="inplace_cudnn")
def performance_decode_inplace(rec, run):
  """In-place caches with the unsplit cuDNN decode (the first run after the cache change)."""
  rows, q = run["rows"], "qwen2.5-1.5b"
  return [_engine_line(rows, "dense", q, 1, T) + f" {_peak(rows, 'dense', q, 1, T)} |"
          for T in (8192, 32768, 131072)]


def _over_mib(run):
  """The most MiB any dense row's compiled peak holds beyond its weights + cache."""
  return max((r["peak_est_bytes"] - r["weight_bytes"] - r["cache_bytes"]) / 2**20
             for r in run["rows"] if r["scheme"] == "dense" and "peak_est_bytes" in r)


def _peak(rows, scheme, shapes, B, T):
  r = _row(rows, scheme, shapes, B, T)
  return f"{r['peak_est_bytes'] / 2**30:.2f} / {r['cache_bytes'] / 2**30:.2f}"


@quote("docs/performance.md", H100, run="split_kv")
def performance_decode_split(rec, run):
  """Split-KV cuDNN decode: dense B = 1 rows, their baselines, L2A with decode_skip."""
  rows, q = run["rows"], "qwen2.5-1.5b"
  out = [_engine_line(rows, "dense", q, 1, T) + f" {_peak(rows, 'dense', q, 1, T)} |"
         for T in (8192, 32768, 131072)]
  out += [_baseline_line(rows, 1, T) for T in (8192, 32768, 131072)]
  out += [_achieved(rows, "l2a", q, 1, T) for T in (32768, 131072)]
  out.append(f"weights + the cache + at most {_over_mib(run):.1f} MiB at B = 1")
  return out


@quote("docs/performance.md", H100, run="split_kv_no_cond")
def performance_decode_split_no_cond(rec, run):
  """The same code, L2A without decode_skip's per-layer lax.cond; dense at B = 8."""
  rows, q = run["rows"], "qwen2.5-1.5b"
  return [_engine_line(rows, "dense", q, 8, 32768) + f" {_peak(rows, 'dense', q, 8, 32768)} |",
          _baseline_line(rows, 8, 32768),
          _achieved(rows, "l2a", q, 1, 32768), _achieved(rows, "l2a", q, 1, 131072),
          f"{_over_mib(run):.1f} MiB at B = 8, 32K"]


@quote("docs/performance.md", H100, run="main_decode_kernel")
def performance_decode_kernel(rec, run):
  """The Mosaic GPU decode kernel in the engine: dense rows with their XLA baselines, L2A at 128K."""
  rows, q = run["rows"], "qwen2.5-1.5b"
  out = []
  for B, T in ((1, 8192), (1, 32768), (1, 131072), (8, 32768)):
    r = _row(rows, "dense", q, B, T)
    st, pl = (next(x for x in rows if (x["scheme"], x["B"], x["T"]) == (n, B, T))
              for n in ("xla_stacked", "xla_per_layer"))
    out.append(f"| dense ({q}) | {B} | {T // 1024}K | {r['ms']:.2f} | {r['limit_ms']:.2f} | "
               f"{r['x_limit']:.2f} | {st['ms']:.2f} / {pl['ms']:.2f} |")
  r = _row(rows, "l2a", q, 1, 131072)
  out.append(f"| L2A ({q}) | 1 | 128K | {r['ms']:.2f} | {r['limit_ms']:.2f} | {r['x_limit']:.2f} | - |")
  out.append(f"{r['ms']:.2f} ms, {r['achieved']:.2f} of its bytes-bound speedup")
  return out


@quote("docs/performance.md", H100, run="aha10")
def performance_decode_short_call(rec, run):
  """The short call's one finished row: dense OLMo-2-1B, B = 1, 32K (the AHA 10% row's dense)."""
  r = _row(run["rows"], "dense", "olmo2-1b", 1, 32768)
  return [f"| dense (olmo2-1b) | 1 | 32K | {r['ms']:.2f} | {r['limit_ms']:.2f} | "
          f"{r['x_limit']:.2f} | {r['compile_s']:.1f} | "
          f"{_peak(run['rows'], 'dense', 'olmo2-1b', 1, 32768)} |"]
