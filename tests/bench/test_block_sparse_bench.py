"""bench/block_sparse.py at its tiny CPU preset (Triton-style kernel in interpret mode, the jnp
reference as the dense baseline): every variant passes the small check, every row is timed, the
speedups come from the same run, and the JSON holds device, jax version and date."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import block_sparse as bench  # noqa: E402


def test_test_preset_writes_checked_rows(tmp_path):
  bench.main(["--preset=test", f"--out_dir={tmp_path}"])   # the command line a user runs
  files = list(tmp_path.iterdir())
  assert len(files) == 1 and files[0].name.startswith("block_sparse_")
  data = json.loads(files[0].read_text())
  assert data["schema"] == 1 and data["bench"] == "block_sparse" and len(data["runs"]) == 1
  run = data["runs"][0]
  assert run["settings"]["name"] == "triton" and run["claims"][0]["passed"]
  on_disk = run["recorded"]
  assert on_disk["rows"] == run["rows"]
  res = {k: v for k, v in on_disk.items() if k != "targets_missed"}
  bench.append_run(str(files[0]), bench.to_run(res, "again"))
  runs = json.loads(files[0].read_text())["runs"]
  assert [r["settings"]["name"] for r in runs] == ["triton", "again"]   # appended, not overwritten
  assert on_disk["device"] and on_disk["jax_version"] and on_disk["date"]
  checks = on_disk["check_small"]
  assert {c["variant"] for c in checks} == {"fused", "per_group"} and all(c["ok"] for c in checks)
  (row,) = on_disk["rows"]
  assert row["T"] == 64 and row["omega"] == 0.5 and row["sparse_heads"] == 2
  assert 0 < row["visible_fraction"] < 1
  assert set(row["variants"]) == {"fused", "per_group"}
  for r in row["variants"].values():
    assert not r["nan"] and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
    assert r["speedup_fwd"] == pytest.approx(row["dense_fwd_ms"] / r["fwd_ms"])
    assert r["speedup_fwdbwd"] == pytest.approx(row["dense_fwdbwd_ms"] / r["fwdbwd_ms"])
  assert "fused" in bench.table(on_disk)


def test_visible_fraction_of_ssa_heads():
  s = bench.PRESETS["test"]
  lists = bench.lists_for(s, 64)
  mode, _ = bench.head_modes(s, 1.0)
  # T = 64, block 16: sink block 0 + the 2 blocks ending at the diagonal: query block i sees
  # blocks {0, i-1, i}; pairs counted by brute force
  want = 0
  for t in range(64):
    i = t // 16
    want += sum(1 for u in range(t + 1) if u // 16 in {0, i - 1, i})
  assert bench.visible_fraction(s, 64, lists, mode) == pytest.approx(want / (64 * 65 / 2))
  mode_full, _ = bench.head_modes(s, 0.0)
  assert bench.visible_fraction(s, 64, lists, mode_full) == 1.0
  assert np.all(np.asarray(mode_full) == bench.HEAD_FULL)


def test_kernels_alone_lines_read_a_recorded_dkv_ab_run():
  """The dk/dv variants are removed (issue 31), their recorded A/B runs stay readable: each
  dkv_<name> / dkv_<name>_err of a kernels-alone row is printed."""
  x = dict(T=65536, heads="all full", fwd=dict(ms=57.39), dq=dict(ms=74.72), dkv=dict(ms=109.36),
           bwd_ms=184.08, bwd_tflops_useful=478.0, cudnn=dict(fwd_ms=57.62, bwd_ms=165.14),
           dkv_stages4=dict(ms=107.15, rel_err_vs_default=0.0), dkv_overlap_err="ValueError: x")
  (line,) = bench.kernels_alone_lines(dict(kernels_alone=[x]))
  assert "dk/dv 109.36" in line and "dk/dv stages4 107.15 ms" in line
  assert "dk/dv overlap ERROR ValueError: x" in line and line.endswith("bwd 165.14 ms")

def test_absl_flags_of_block_sparse_and_elastic_prefill(capsys):
  """Both benches parse absl flags (bench/common.py's convention) into their settings; a GPU
  preset on a CPU stops before any compilation."""
  from bench import common
  from bench import elastic_prefill as ep
  args = common.parse_flags(bench.FLAGS, ["--preset=test", "--T=32,64", "--omega=0.3",
                                          "--impl=mosaic_gpu", "--kernels_alone", "--n=3",
                                          "--variants=fused", "--out_dir=/tmp/x"])
  s = bench.settings_from_flags(args)
  assert (s.preset, s.Ts, s.omegas, s.impl, s.kernels_alone, s.n, s.variants) == (
      "test", (32, 64), (0.3,), "mosaic_gpu", True, 3, ("fused",))
  assert args.out_dir == "/tmp/x"
  assert bench.settings_from_flags(common.parse_flags(bench.FLAGS, ["--preset=test"])) == \
      bench.PRESETS["test"]
  assert ep.main(["--preset=gpu", "--T=64", "--layers=1"]) == 2  # on CPU: refused, no run
  assert "needs a GPU" in capsys.readouterr().out


def test_match_run_claims_memory_within_1_2x_swa(tmp_path):
  """bench.block_sparse --match's record (no compilation here): the run keeps every row and the
  issue's memory claim passes at <= 1.2x SWA's training-forward temp bytes and fails above; the
  claim-carrying run appends to a schema-1 result file."""
  rows = {name: dict(fwd_temp_bytes=b, fwdbwd_temp_bytes=2 * b, fwd_ms=1.0, fwdbwd_ms=3.0,
                     finite=True) for name, b in (("dense", 100), ("swa", 100), ("match", 110),
                                                  ("match_gathered", 400))}
  res = dict(T=32768, window=2048, chunk=128, top_k=4, layers=2, rows=rows,
             fwd_temp_vs_swa=1.1, fwdbwd_temp_vs_swa=1.1)
  run = bench.match_run(res)
  assert [r["row"] for r in run["rows"]] == list(rows) and run["settings"]["T"] == 32768
  assert [c["passed"] for c in run["claims"]] == [True]
  assert [c["passed"] for c in bench.match_run(dict(res, fwd_temp_vs_swa=1.3))["claims"]] == [False]
  assert [c["passed"] for c in bench.match_run({k: v for k, v in res.items()
                                                if k != "fwd_temp_vs_swa"})["claims"]] == [False]
  data = bench.append_run(str(tmp_path / "block_sparse_x.json"), run)
  assert data["runs"][-1]["settings"]["name"] == "match_mosaic_gpu"


def test_ab_rule_adopts_only_a_variant_faster_by_the_margin_at_every_length():
  """bench/block_sparse.ab_decide, the A/B's pre-registered rule, on made-up rows (no compile):
  a variant qualifies only if its small check passed, it matches the default at every T and it
  is >= AB_MIN_GAIN faster at every T of AB_TS; of the qualifiers the largest 64K gain is
  adopted."""
  names = ["a", "b", "c", "d"]
  a, b, c, d = names
  gains = {65536: {a: 1.03, b: 1.05, c: 1.02, d: 1.04}, 32768: {a: 1.02, b: 1.01, c: 1.016,
                                                                  d: 1.03}}
  rows = []
  for T, g in gains.items():
    ms = {"default": 100.0, **{n: 100.0 / x for n, x in g.items()}}
    rows.append(dict(T=T, ms=ms, gain_vs_default={n: 100.0 / v for n, v in ms.items()},
                     nan={n: False for n in ms},
                     errors_vs_default={n: dict(out=1e-3, dq=1e-3, dk=1e-3, dv=1e-3) for n in g},
                     err={}))
  checks = {n: dict(ok=True) for n in (a, b, c)} | {d: dict(ok=False)}
  dec = bench.ab_decide(checks, rows, names)
  # b: 1.01 at 32K (under the margin); d: its check failed; a and c qualify, a gains more at 64K
  assert [n for n, v in dec["verdict"].items() if v["qualifies"]] == [a, c]
  assert dec["adopted"] == a and bench.AB_MIN_GAIN == 1.015
  rows[1]["errors_vs_default"][a]["dq"] = 0.1       # a gradient off the default's: disqualified
  assert bench.ab_decide(checks, rows, names)["adopted"] == c
  rows[0]["nan"][c] = True
  assert bench.ab_decide(checks, rows, names)["adopted"] is None


def test_ab_candidates_are_configs_and_the_next_run_name_is_new():
  """The registered A/B candidates are BlockSparseConfigs that differ from the default, and
  AB_RUN names no run already in a recorded result file (each A/B's claim reads its own run:
  once an A/B is recorded, AB_RUN names the next one)."""
  from pallas_kernels.block_sparse import BlockSparseConfig
  for name, cfg in bench.AB_VARIANTS.items():
    assert isinstance(cfg, BlockSparseConfig) and cfg != BlockSparseConfig(), name
  results = os.path.join(ROOT, "bench", "results")
  for fname in os.listdir(results):
    if fname.startswith("block_sparse_") and fname.endswith(".json"):
      with open(os.path.join(results, fname)) as fh:
        names = {r["settings"].get("name") for r in json.load(fh)["runs"]}
      assert bench.AB_RUN not in names, fname


def test_profile_helpers_read_made_up_traces_and_an_ncu_csv(tmp_path):
  """--profile's pieces without a GPU: kernel roles from names, the table, the ncu -k regex of
  ours and cuDNN's kernels (glue of our program left out), and ncu_summary over a raw CSV in
  ncu's layout (header row, units row, one row per kernel)."""
  assert [bench.kernel_role(n) for n in (
      "block_sparse_fwd_mgpu_nb", "block_sparse_dq_mgpu", "block_sparse_dkv_mgpu",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7",
      "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3",
      "loop_add_fusion", "memset: x")] == ["fwd", "dq", "dkv", "cudnn_fwd", "cudnn_bwd", "glue",
                                           "glue"]
  k = lambda ms, role, **kw: dict(ms=ms, calls=1, role=role, **kw)
  row = dict(T=65536, programs=dict(
      ours_fwdbwd=dict(busy_ms=240.0, span_ms=241.0, clocks=dict(
          wall_ms=249.0, sm_mhz=dict(median=1755.0, min=1600.0, max=1980.0),
          power_w=dict(median=690.0, max=700.0), reasons={"sw_power_cap": 0.9}), kernels={
              "block_sparse_dkv_mgpu": k(110.0, "dkv", regs=168, smem=140000),
              "block_sparse_dq_mgpu": k(75.0, "dq"), "block_sparse_fwd_mgpu_nb": k(56.0, "fwd"),
              "loop_transpose_fusion": k(1.5, "glue"), "tiny_fusion": k(0.01, "glue")}),
      cudnn_fwdbwd=dict(busy_ms=220.0, span_ms=221.0, clocks={}, kernels={
          "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3": k(160.0, "cudnn_bwd"),
          "void cudnn::fusion::compute_dot_do_o<128>(float*)": k(1.2, "glue"),
          "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": k(57.0, "cudnn_fwd")})))
  text = bench.profile_table([row])
  assert "T=65536 ours_fwdbwd: wall 249.00" in text and "SM MHz median 1755" in text
  assert "dkv" in text and "regs 168" in text and "tiny_fusion" not in text
  assert bench.ncu_regex([row]).split("|") == sorted([
      "block_sparse_dkv_mgpu", "block_sparse_dq_mgpu", "block_sparse_fwd_mgpu_nb",
      "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7"])
  head = ["ID", "Process ID", "Kernel Name", "gpu__time_duration.sum",
          "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_not_issued_per_issue_active.ratio",
          "smsp__pcsamp_warps_issue_stalled_barrier"]
  units = ["", "", "", "ms", "register/thread", "%", "%", "%", "ratio", "ratio", "ratio", ""]
  rows = [["0", "1", "block_sparse_dkv_mgpu", "109.5", "168", "18.6", "71.2", "12.0", "2.5",
           "0.4", "9.9", "1,234"],
          ["1", "1", "block_sparse_dkv_mgpu", "108.0", "168", "18.0", "70.0", "11.0", "2.0",
           "0.5", "9.9", "7"]]
  import csv
  path = tmp_path / "raw.csv"
  with open(path, "w", newline="") as fh:
    csv.writer(fh, quoting=csv.QUOTE_ALL).writerows([["==PROF== noise"], head, units] + rows)
  s = bench.ncu_summary(str(path))
  assert list(s) == ["block_sparse_dkv_mgpu", "block_sparse_dkv_mgpu #2"]
  d = s["block_sparse_dkv_mgpu"]
  assert d["duration"] == [109.5, "ms"] and d["regs"] == [168.0, "register/thread"]
  assert d["occ_achieved_pct"] == [18.6, "%"]
  assert d["tensor"] == {head[6]: 71.2}
  assert list(d["pipes_top"]) == ["tensor_op_gmma_cycles_active", "alu_cycles_active"]
  # cycles per issued instruction, the not-issued variant left out; pcsamp only as a fallback
  assert d["stalls_per_issue_active.ratio"] == {"barrier": 2.5, "long_scoreboard": 0.4}
  lines = bench.ncu_summary_lines(s)
  assert lines[0].startswith("dkv block_sparse_dkv_mgpu") and "duration=109.5 ms" in lines[1]
  assert bench.stall_of("smsp__pcsamp_warps_issue_stalled_wait") == ("wait", "pcsamp")
  assert bench.stall_of("smsp__pcsamp_warps_issue_stalled_wait_not_issued") is None


def test_trace_tables_from_made_up_cuda_traces(monkeypatch):
  """The per-kernel tables of --profile (block_sparse.trace_kernels) and of compact_attention's
  profile (_trace_kernels) from two made-up traced calls (common.cuda_traces stubbed: CUPTI needs
  a GPU): medians per kernel, launches per call, CUPTI's launch facts, memcpy marked, busy (the
  union of the intervals) and span, the last call's timeline."""
  from bench import common
  from bench import compact_attention as ca
  ev = lambda name, ts, dur, cat="kernel", **args: dict(ph="X", cat=cat, name=name, ts=ts,
                                                      dur=dur, args=args)
  calls = [[ev("block_sparse_dkv_mgpu", 0.0, 1000.0, **{"registers per thread": 168}),
            ev("block_sparse_dkv_mgpu", 500.0, 1000.0), ev("copy", 3000.0, 100.0, "gpu_memcpy")],
           [ev("block_sparse_dkv_mgpu", 10.0, 3000.0), ev("copy", 4010.0, 300.0, "gpu_memcpy")]]
  monkeypatch.setattr(common, "cuda_traces", lambda fn, n: calls[:n])
  got = bench.trace_kernels(None, 2)
  dkv = got["kernels"]["block_sparse_dkv_mgpu"]
  assert dkv["ms"] == pytest.approx(2.5) and dkv["calls"] == 1 and dkv["regs"] == 168
  assert dkv["role"] == "dkv" and got["kernels"]["memcpy: copy"]["ms"] == pytest.approx(0.2)
  assert got["busy_ms"] == pytest.approx((1.6 + 3.3) / 2)   # 0-1500 + 3000-3100; 10-3010 + 4010-4310
  assert got["span_ms"] == pytest.approx((3.1 + 4.3) / 2)
  assert got["timeline"] == [["block_sparse_dkv_mgpu", 0.0, 3000.0], ["copy", 4000.0, 300.0]]
  med, busy, span, timeline = ca._trace_kernels(None, 2)
  assert med == {"block_sparse_dkv_mgpu": pytest.approx(2.5), "memcpy: copy": pytest.approx(0.2)}
  assert (busy, span, timeline) == (got["busy_ms"], got["span_ms"], got["timeline"])
