"""Claims of bench/block_sparse.py's recorded GPU runs (block_sparse_<device>.json) and the
pallas_kernels/block_sparse/README.md quotes of them (see bench/claims/__init__.py)."""
from bench.claims import approx, claim, expect, quote

H100 = "block_sparse_NVIDIA_H100_80GB_HBM3.json"
README = "pallas_kernels/block_sparse/README.md"


def _recorded(run):
  from bench import common
  return common.recorded_of(run)


def _bench():
  from bench import block_sparse
  return block_sparse


@claim("block_sparse", run="triton", file=H100)
def gpu_result(rec, run):
  """bench/results/block_sparse_<H100>.json: the kernels passed the small check against the
  reference, every variant ran at 32K and 64K without NaN, the speedups follow from the timed
  milliseconds, and the claims in the README hold: at Omega = 0.7 (70% SSA heads) the fused
  launch is >= 1.85x cuDNN dense forward and forward+backward at 32K, and >= 2.1x at 64K; our
  kernel with every head full runs at >= 0.72x cuDNN forward (the unmasked range's affine kv
  addresses; 0.60-0.64x before)."""
  r = _recorded(run)
  expect(r["jax_version"] == "0.11.2" and r["date"][:4] >= "2026")
  expect(r["check_small"] and all(c["ok"] for c in r["check_small"]))
  rows = {(x["T"], x["omega"]): x for x in r["rows"]}
  expect(set(rows) == {(T, o) for T in (32768, 65536) for o in (0.3, 0.7)})
  for row in rows.values():
    expect({"fused", "per_group", "cudnn_group"} <= set(row["variants"]))
    for v in row["variants"].values():
      expect("err" not in v and not v["nan"])
      expect(v["speedup_fwd"] == approx(row["dense_fwd_ms"] / v["fwd_ms"]))
      expect(v["speedup_fwdbwd"] == approx(row["dense_fwdbwd_ms"] / v["fwdbwd_ms"]))
  for T, floor in ((32768, 1.85), (65536, 2.1)):
    f = rows[T, 0.7]["variants"]["fused"]
    expect(min(f["speedup_fwd"], f["speedup_fwdbwd"]) >= floor)
    expect(rows[T, 0.7]["variants"]["ours_dense"]["speedup_fwd"] >= 0.72)
  expect(r["triton_fwd_sub_tile"] == 128)


@claim("block_sparse", run="mosaic_gpu", file=H100)
def mosaic_gpu_run_meets_issue_31_targets(rec, run):
  """The Mosaic GPU run on one H100: the small check passed; every (T, SSA share) row ran without
  NaN, speedups follow from the ms; issue 31's targets at 64K, 70% SSA heads (>= 2.9x cuDNN
  forward, >= 2.7x forward+backward in one launch; all heads full >= 0.95x forward) are claims
  that passed; the all-full forward+backward miss is recorded with its kernels-alone profile;
  the README's results table quotes these numbers (2 decimals: the quote mosaic_gpu_table)."""
  r = _recorded(run)
  expect(r["device"] == "NVIDIA H100 80GB HBM3" and r["jax_version"] == "0.11.2")
  expect(r["settings"]["impl"] == "mosaic_gpu" and all(c["ok"] for c in r["check_small"]))
  names = {c["name"] for c in run["claims"]}
  expect({f"T=65536 omega=0.7 {v} {k} >= {f}" for _, _, v, k, f in _bench().TARGETS} <= names)
  rows = {(x["T"], x["omega"]): x for x in r["rows"]}
  expect(set(rows) == {(T, o) for T in (32768, 65536) for o in (0.3, 0.7)})
  for row in rows.values():
    for v in row["variants"].values():
      expect(not v["nan"])
      expect(v["speedup_fwd"] == approx(row["dense_fwd_ms"] / v["fwd_ms"]))
      expect(v["speedup_fwdbwd"] == approx(row["dense_fwdbwd_ms"] / v["fwdbwd_ms"]))
  (miss,) = r["targets_missed"]
  expect(miss["variant"] == "ours_dense" and miss["key"] == "speedup_fwdbwd" and miss["value"] < 0.95)
  ka = {x["T"]: x for x in r["kernels_alone"]}[65536]
  # the backward's 7 products per pair run at the matrix ceiling: >= 600 TFLOP/s issued each
  expect(min(ka["dq"]["tflops_issued"], ka["dkv"]["tflops_issued"]) >= 600)
  expect(ka["bwd_ms"] > ka["cudnn"]["bwd_ms"] and ka["fwd"]["ms"] < ka["cudnn"]["fwd_ms"])


@claim("block_sparse", run="elastic_prefill_mosaic_gpu", file=H100)
def elastic_prefill_one_launch_meets_1_55x(rec, run):
  """Elastic FA-SSA prefill at 64K, Omega 0.7, one block-sparse (Mosaic GPU) launch per layer:
  >= 1.55x the dense model on the same H100, as the README quotes."""
  rows = {x["row"]: x for x in run["rows"]}
  dense = rows["dense"]["ms"]
  for name, x in rows.items():
    if name != "dense":
      expect(x["finite"] and x["speedup_vs_dense"] == approx(dense / x["ms"]))
  expect(run["settings"]["T"] == 65536 and _recorded(run)["block_sparse_kernel"].startswith(
      "mosaic_gpu"))
  one = rows["elastic_0.7"]["speedup_vs_dense"]
  expect(one >= 1.55 and not rows["elastic_0.7"]["dense_full_heads"])


@claim("block_sparse", run="window_or_blocks_mosaic_gpu", file=H100)
def window_or_blocks_run_costs_its_pairs(rec, run):
  """HEAD_WINDOW_BLOCKS at 64K on the H100: window 2048 OR 4 chunks costs about its visible keys
  (2560 / 2048) over the window alone, forward and forward+backward, as the README quotes."""
  r = {x["variant"]: x for x in run["rows"]}
  for key in ("fwd_ms", "fwdbwd_ms"):
    ratio = r["window_or_top"][key] / r["window_only"][key]
    expect(1.0 < ratio <= 1.35, (key, ratio))
    expect(r["cudnn_dense"][key] > 5 * r["window_or_top"][key])


@quote(README, H100, run="mosaic_gpu")
def mosaic_gpu_table(rec, run):
  """The README's results table (speedups over cuDNN, 2 decimals) and the kernels-alone times."""
  r = _recorded(run)
  out = []
  for row in r["rows"]:
    v = row["variants"]
    cells = [f"{v['fused']['speedup_fwd']:.2f} / {v['fused']['speedup_fwdbwd']:.2f}",
             f"{v['cudnn_group']['speedup_fwd']:.2f} / {v['cudnn_group']['speedup_fwdbwd']:.2f}",
             (f"{v['ours_dense']['speedup_fwd']:.2f} / {v['ours_dense']['speedup_fwdbwd']:.2f}"
              if "ours_dense" in v else ""), f"{row['ideal_speedup']:.2f}"]
    line = f"| {row['T'] // 1024}K | {round(row['omega'] * 100)}% | " + " | ".join(cells) + " |"
    out.append(line.replace("|  |", "| |"))
  ka = {x["T"]: x for x in r["kernels_alone"]}[65536]
  out += [f"{ka[key]['ms']:.1f} ms" for key in ("fwd", "dq", "dkv")]
  out.append(f"{ka['bwd_ms']:.1f} ms against cuDNN's {ka['cudnn']['bwd_ms']:.1f}")
  return out


@quote(README, H100, run="elastic_prefill_mosaic_gpu")
def elastic_prefill_speedup(rec, run):
  rows = {x["row"]: x for x in run["rows"]}
  return [f"{rows['elastic_0.7']['speedup_vs_dense']:.2f}x", f"dense {rows['dense']['ms']:.1f} ms"]


@quote(README, H100, run="window_or_blocks_mosaic_gpu")
def window_or_blocks_times(rec, run):
  r = {x["variant"]: x for x in run["rows"]}
  w, o, d = r["window_or_top"], r["window_only"], r["cudnn_dense"]
  return [f"{w['fwd_ms']:.2f} ms forward / {w['fwdbwd_ms']:.2f} ms forward+backward against "
          f"{o['fwd_ms']:.2f} / {o['fwdbwd_ms']:.2f}",
          f"cuDNN dense {d['fwd_ms']:.2f} / {d['fwdbwd_ms']:.2f}"]


@quote("README.md", H100, run="elastic_prefill_mosaic_gpu")
def readme_elastic_prefill(rec, run):
  """README's memory / speed section: Elastic FA-SSA prefill at 64K, Omega 0.7, one launch and
  the split."""
  rows = {x["row"]: x for x in run["rows"]}
  return [f"{rows['elastic_0.7']['speedup_vs_dense']:.2f}x dense at 64K with Omega 0.7",
          f"FA heads on cuDNN beside it: {rows['elastic_0.7_split']['speedup_vs_dense']:.2f}x"]


def _ab_rejected_by_its_rule(r, device="NVIDIA H100 80GB HBM3"):
  """An all-full A/B run (bench/block_sparse.py --ab) on one GPU (`device`), 64K then 32K: every
  variant passed its small check and matched the default's out / dq / dk / dv without NaN; each median
  is its rounds', gains and x cuDNN follow from the medians; the registered rule
  (bench/block_sparse.ab_decide) re-applied to the stored numbers gives the recorded decision,
  none adopted."""
  import statistics
  bench = _bench()
  expect(r["device"] == device and r["jax_version"] == "0.11.2")
  expect([x["T"] for x in r["rows"]] == [65536, 32768])
  expect(all(r["checks"][n]["ok"] for n in r["names"]))
  for row in r["rows"]:
    expect(not any(row["nan"].values()) and not row["err"])
    expect(set(row["ms"]) == {"default", "cudnn", *r["names"]})
    for n, ms in row["ms"].items():
      expect(ms == approx(statistics.median(row["runs_ms"][n])))
      expect(row["gain_vs_default"][n] == approx(row["ms"]["default"] / ms))
      expect(row["speedup_vs_cudnn"][n] == approx(row["ms"]["cudnn"] / ms))
    for n in r["names"]:
      expect(max(row["errors_vs_default"][n].values()) <= bench.AB_TOL)
  dec = bench.ab_decide(r["checks"], r["rows"], r["names"])
  expect(dec["adopted"] is None and r["decision"]["adopted"] is None)
  expect({n: v["why"] for n, v in dec["verdict"].items()}
         == {n: v["why"] for n, v in r["decision"]["verdict"].items()})


@claim("block_sparse", run="mosaic_gpu_ab", file=H100)
def mosaic_gpu_ab_applies_its_registered_rule(rec, run):
  """The all-full A/B of the Mosaic GPU backward's schedule variants (dq ping-pong / overlap, dk/dv
  ping-pong / 4 stages and combinations) on one H100, 64K then 32K, interleaved rounds in one
  process: every variant passed its small check against the reference and matched the default's
  out / dq / dk / dv without NaN; each median is its rounds', gains and x cuDNN follow from the
  medians; the recorded decision is the registered rule (bench/block_sparse.ab_decide) re-applied
  to the stored numbers: none adopted (none >= AB_MIN_GAIN faster at both lengths), so the
  variants and their BlockSparseConfig fields were removed."""
  r = _recorded(run)
  expect(len(r["names"]) == 7)
  _ab_rejected_by_its_rule(r)


@claim("block_sparse", run="mosaic_gpu_onebwd2_ab", file=H100)
def mosaic_gpu_onebwd2_ab_applies_its_registered_rule(rec, run):
  """The all-full A/B of the one-kernel backward candidates (onebwd1: dq issued before dK and
  reduce-added from one float32 shared-memory tile per warpgroup; onebwd2: two tiles; onebwd2_tm:
  two tiles, steps in (query tile, query head) order) on one H100, 64K then 32K, interleaved
  rounds in one process: every candidate passed its small check and matched the default's out /
  dq / dk / dv without NaN; each median is its rounds', gains and x cuDNN follow from the medians;
  the recorded decision is the registered rule (bench/block_sparse.ab_decide) re-applied to the
  stored numbers: none adopted (each slower than the default at both lengths), so the candidates
  and their BlockSparseConfig fields were removed."""
  r = _recorded(run)
  expect(r["names"] == ["onebwd1", "onebwd2", "onebwd2_tm"])
  _ab_rejected_by_its_rule(r)
  expect(all(row["gain_vs_default"][n] < 1.0 for row in r["rows"] for n in r["names"]))


@claim("block_sparse", run="mosaic_gpu_dkv_q128_ab", file="block_sparse_NVIDIA_H200.json")
def mosaic_gpu_dkv_q128_ab_applies_its_registered_rule(rec, run):
  """The all-full A/B of the dk/dv candidates (dkv_q128: whole 128-row query tiles at dq's
  wgmma shapes, lse / delta as the accumulators' initial values; dkv_fold, its control: those
  initial values on the default's 64-row sub-tiles) on one H200 (asked as an H100; GPUs 1-3 of
  its host ran MQAR jobs meanwhile), 64K then 32K, interleaved rounds in one process: both
  passed their small checks and matched the default without NaN; the registered rule re-applied
  gives the recorded decision: none adopted, each slower than the default at both lengths
  (dkv_q128 ~0.76-0.79x, dkv_fold ~0.95x), so both and their BlockSparseConfig fields were
  removed."""
  r = _recorded(run)
  expect(r["names"] == ["dkv_q128", "dkv_fold"])
  _ab_rejected_by_its_rule(r, device="NVIDIA H200")
  expect(all(row["gain_vs_default"][n] < 1.0 for row in r["rows"] for n in r["names"]))


def _profile_64k(run):
  r = {x["T"]: x for x in run["rows"]}[65536]["programs"]
  return r["ours_fwdbwd"], r["cudnn_fwdbwd"], r


@claim("block_sparse", run="mosaic_gpu_profile_all_full", file=H100)
def profile_puts_the_all_full_gap_in_the_backward(rec, run):
  """The all-full profile at 64K on one H100 (bench/block_sparse.py --profile: CUPTI per-kernel
  medians, NVML clocks): each program's kernels, summed by role, fill its busy time (one stream);
  our forward and glue are faster than cuDNN's, so the backward holds more than the whole gap
  (dq + dk/dv over cuDNN's bprop and its glue); dk/dv issues its 4 products a pair at < 0.92x
  dq's rate for its 3; both programs ran under the software power cap in every NVML sample,
  below 1700 MHz median; cuDNN's fprop / bprop are persistent (one CTA per SM, 132), ours launch
  a CTA per tile (16384 forward / dq, 4096 dk/dv)."""
  o, c, r = _profile_64k(run)
  for p in r.values():
    total = sum(x["ms"] for x in p["kernels"].values())
    expect(total == approx(sum(p["roles_ms"].values()), rel=1e-6))
    expect(0.99 * p["busy_ms"] <= total <= 1.001 * p["span_ms"], (total, p["busy_ms"]))
  ro, rc = o["roles_ms"], c["roles_ms"]
  expect(ro["fwd"] < rc["cudnn_fwd"] and ro["glue"] < rc["glue"])
  gap = o["busy_ms"] - c["busy_ms"]
  expect(ro["dq"] + ro["dkv"] - rc["cudnn_bwd"] - rc["glue"] > gap > 0)
  expect((4 / ro["dkv"]) / (3 / ro["dq"]) < 0.92)
  for p in (o, c):
    expect(p["clocks"]["reasons"].get("sw_power_cap") == 1.0
           and p["clocks"]["sm_mhz"]["median"] < 1700)
  grid = lambda p, role: [x["grid"][0] * x["grid"][1] * x["grid"][2]
                          for x in p["kernels"].values() if x["role"] == role]
  expect(grid(c, "cudnn_fwd") == [132] and grid(c, "cudnn_bwd") == [132])
  expect(grid(o, "fwd") == [16384] and grid(o, "dq") == [16384] and grid(o, "dkv") == [4096])


@quote("docs/performance.md", H100, run="mosaic_gpu_profile_all_full")
def performance_all_full_profile(rec, run):
  """docs/performance.md's all-full profile table (64K, ms, 2 decimals) and its derived figures."""
  o, c, r = _profile_64k(run)
  ro, rc = o["roles_ms"], c["roles_ms"]
  return [f"| ours | {ro['fwd']:.2f} | {ro['dq']:.2f} | {ro['dkv']:.2f} | {ro['glue']:.2f} | "
          f"{o['busy_ms']:.2f} | {o['clocks']['sm_mhz']['median']:.0f} |",
          f"| cuDNN | {rc['cudnn_fwd']:.2f} | {rc['cudnn_bwd']:.2f} (one kernel) | | "
          f"{rc['glue']:.2f} | {c['busy_ms']:.2f} | {c['clocks']['sm_mhz']['median']:.0f} |",
          f"{ro['dq'] + ro['dkv']:.2f} ms against cuDNN's {rc['cudnn_bwd'] + rc['glue']:.2f}",
          f"{c['busy_ms'] / o['busy_ms']:.3f}x",
          f"{(4 / ro['dkv']) / (3 / ro['dq']):.2f}x dq's rate",
          f"fwd {r['ours_fwd_alone']['busy_ms']:.2f}, dq {r['ours_dq_alone']['busy_ms']:.2f}, "
          f"dk/dv {r['ours_dkv_alone']['busy_ms']:.2f}"]
