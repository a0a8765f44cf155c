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
  res = bench.run(bench.PRESETS["test"], log=lambda *_: None, out_dir=str(tmp_path))
  files = list(tmp_path.iterdir())
  assert len(files) == 1 and files[0].name.startswith("block_sparse_")
  data = json.loads(files[0].read_text())
  assert data["schema"] == 1 and data["bench"] == "block_sparse" and len(data["runs"]) == 1
  run = data["runs"][0]
  assert run["settings"]["name"] == "triton" and run["claims"][0]["passed"]
  on_disk = run["recorded"]
  assert on_disk["rows"] == run["rows"] == json.loads(json.dumps(res["rows"]))
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


def test_recorded_gpu_result():
  """bench/results/block_sparse_<H100>.json: the kernels passed the small check against the
  reference, every variant ran at 32K and 64K without NaN, the speedups follow from the timed
  milliseconds, and the claims in the README hold: at Omega = 0.7 (70% SSA heads) the fused
  launch is >= 1.85x cuDNN dense forward and forward+backward at 32K, and >= 2.1x at 64K; our
  kernel with every head full runs at >= 0.72x cuDNN forward (the unmasked range's affine kv
  addresses; 0.60-0.64x before)."""
  r = _run(H100, "triton")["recorded"]
  assert r["jax_version"] == "0.11.2" and r["date"][:4] >= "2026"
  assert r["check_small"] and all(c["ok"] for c in r["check_small"])
  rows = {(x["T"], x["omega"]): x for x in r["rows"]}
  assert set(rows) == {(T, o) for T in (32768, 65536) for o in (0.3, 0.7)}
  for row in rows.values():
    assert {"fused", "per_group", "cudnn_group"} <= set(row["variants"])
    for v in row["variants"].values():
      assert "err" not in v and not v["nan"]
      assert v["speedup_fwd"] == pytest.approx(row["dense_fwd_ms"] / v["fwd_ms"])
      assert v["speedup_fwdbwd"] == pytest.approx(row["dense_fwdbwd_ms"] / v["fwdbwd_ms"])
  for T, floor in ((32768, 1.85), (65536, 2.1)):
    f = rows[T, 0.7]["variants"]["fused"]
    assert min(f["speedup_fwd"], f["speedup_fwdbwd"]) >= floor
    assert rows[T, 0.7]["variants"]["ours_dense"]["speedup_fwd"] >= 0.72
  assert r["triton_fwd_sub_tile"] == 128


H100 = os.path.join(ROOT, "bench", "results", "block_sparse_NVIDIA_H100_80GB_HBM3.json")
README = os.path.join(ROOT, "pallas_kernels", "block_sparse", "README.md")


def _run(path, name):
  data = json.load(open(path))
  assert data["schema"] == 1 and data["bench"] == "block_sparse"
  (run,) = [r for r in data["runs"] if r["settings"]["name"] == name]
  assert all(c["passed"] for c in run["claims"]), run["claims"]
  return run


def test_recorded_mosaic_gpu_run_meets_issue_31_targets_and_the_readme_quotes_it():
  """The Mosaic GPU run on one H100: the small check passed; every (T, SSA share) row ran without
  NaN, speedups follow from the ms; issue 31's targets at 64K, 70% SSA heads (>= 2.9x cuDNN
  forward, >= 2.7x forward+backward in one launch; all heads full >= 0.95x forward) are claims
  that passed; the all-full forward+backward miss is recorded with its kernels-alone profile;
  and the README's results table quotes these numbers (2 decimals)."""
  run = _run(H100, "mosaic_gpu")
  r = run["recorded"]
  assert r["device"] == "NVIDIA H100 80GB HBM3" and r["jax_version"] == "0.11.2"
  assert r["settings"]["impl"] == "mosaic_gpu" and all(c["ok"] for c in r["check_small"])
  names = {c["name"] for c in run["claims"]}
  assert {f"T=65536 omega=0.7 {v} {k} >= {f}" for _, _, v, k, f in bench.TARGETS} <= names
  rows = {(x["T"], x["omega"]): x for x in r["rows"]}
  assert set(rows) == {(T, o) for T in (32768, 65536) for o in (0.3, 0.7)}
  for row in rows.values():
    for v in row["variants"].values():
      assert not v["nan"]
      assert v["speedup_fwd"] == pytest.approx(row["dense_fwd_ms"] / v["fwd_ms"])
      assert v["speedup_fwdbwd"] == pytest.approx(row["dense_fwdbwd_ms"] / v["fwdbwd_ms"])
  (miss,) = r["targets_missed"]
  assert miss["variant"] == "ours_dense" and miss["key"] == "speedup_fwdbwd" and miss["value"] < 0.95
  ka = {x["T"]: x for x in r["kernels_alone"]}[65536]
  # the backward's 7 products per pair run at the matrix ceiling: >= 600 TFLOP/s issued each
  assert min(ka["dq"]["tflops_issued"], ka["dkv"]["tflops_issued"]) >= 600
  assert ka["bwd_ms"] > ka["cudnn"]["bwd_ms"] and ka["fwd"]["ms"] < ka["cudnn"]["fwd_ms"]

  text = open(README).read()
  f2 = lambda x: f"{x:.2f}"
  for (T, om), row in rows.items():
    v = row["variants"]
    cells = [f"{v['fused']['speedup_fwd']:.2f} / {v['fused']['speedup_fwdbwd']:.2f}",
             f"{v['cudnn_group']['speedup_fwd']:.2f} / {v['cudnn_group']['speedup_fwdbwd']:.2f}",
             (f"{v['ours_dense']['speedup_fwd']:.2f} / {v['ours_dense']['speedup_fwdbwd']:.2f}"
              if "ours_dense" in v else ""), f2(row["ideal_speedup"])]
    line = f"| {T // 1024}K | {round(om * 100)}% | " + " | ".join(cells) + " |"
    assert line.replace("|  |", "| |") in text, line
  for key in ("fwd", "dq", "dkv"):
    assert f"{ka[key]['ms']:.1f} ms" in text, key
  assert f"{ka['bwd_ms']:.1f} ms against cuDNN's {ka['cudnn']['bwd_ms']:.1f}" in text


def test_recorded_elastic_prefill_one_launch_meets_1_55x():
  """Elastic FA-SSA prefill at 64K, Omega 0.7, one block-sparse (Mosaic GPU) launch per layer:
  >= 1.55x the dense model on the same H100, as the README quotes."""
  run = _run(H100, "elastic_prefill_mosaic_gpu")
  rows = {x["row"]: x for x in run["rows"]}
  dense = rows["dense"]["ms"]
  for name, x in rows.items():
    if name != "dense":
      assert x["finite"] and x["speedup_vs_dense"] == pytest.approx(dense / x["ms"])
  assert run["settings"]["T"] == 65536 and run["recorded"]["block_sparse_kernel"].startswith(
      "mosaic_gpu")
  one = rows["elastic_0.7"]["speedup_vs_dense"]
  assert one >= 1.55 and not rows["elastic_0.7"]["dense_full_heads"]
  text = open(README).read()
  assert f"{one:.2f}x" in text and f"dense {dense:.1f} ms" in text


def test_recorded_window_or_blocks_run_costs_its_pairs():
  """HEAD_WINDOW_BLOCKS at 64K on the H100: window 2048 OR 4 chunks costs about its visible keys
  (2560 / 2048) over the window alone, forward and forward+backward, as the README quotes."""
  run = _run(H100, "window_or_blocks_mosaic_gpu")
  r = {x["variant"]: x for x in run["rows"]}
  for key in ("fwd_ms", "fwdbwd_ms"):
    ratio = r["window_or_top"][key] / r["window_only"][key]
    assert 1.0 < ratio <= 1.35, (key, ratio)
    assert r["cudnn_dense"][key] > 5 * r["window_or_top"][key]
  text = open(README).read()
  w, o, d = r["window_or_top"], r["window_only"], r["cudnn_dense"]
  assert (f"{w['fwd_ms']:.2f} ms forward / {w['fwdbwd_ms']:.2f} ms forward+backward against "
          f"{o['fwd_ms']:.2f} / {o['fwdbwd_ms']:.2f}") in " ".join(text.split())
  assert f"cuDNN dense {d['fwd_ms']:.2f} / {d['fwdbwd_ms']:.2f}" in text
