"""bench/segmented_memory.py (test preset rows, in process: every row runs, the segmented cache
is the analytic one and smaller than dense, its compiled prefill step needs less scratch than
the one-shot dense step) and bench/segmented_fidelity.py (the recorded CPU run: its claims hold
and follow from its numbers; the test preset runs end to end)."""
import json

import numpy as np

from bench import common  # noqa: E402
from bench import segmented_fidelity as fid
from bench import segmented_memory as mem
from condattn_jax.attention import segmented as sgm



def test_memory_bench_rows_at_test_preset():
  p = mem.PRESETS["test"]
  T = p["lengths"][0]
  rows = {r: mem.run_row("test", r, T) for r in ("dense", "segmented")}  # chunked: same code
  assert all(r["logits_finite"] and r["prefill_s"] > 0 for r in rows.values())
  seg, dense = rows["segmented"], rows["dense"]
  assert seg["cache_bytes"] == sgm.kv_cache_bytes(mem._config(p, "segmented"), T)["total"]
  assert seg["cache_bytes"] < dense["cache_bytes"]
  assert seg["step_temp_bytes"] < dense["step_temp_bytes"]
  assert (seg["chunk"], dense["chunk"]) == (p["seg"]["segment_len"], T)


def test_fidelity_test_preset_runs(tmp_path):
  """The test preset through the CLI into --out_dir: finite perplexities at every length, and the
  writer recorded the claim every run carries (its claims / findings follow from its numbers)."""
  assert fid.main(["--preset=test", f"--out_dir={tmp_path}"]) == 0
  (run,) = common.load(common.result_path("segmented_fidelity", str(tmp_path)))["runs"]
  assert run["settings"]["name"] == "test"
  assert {c["name"]: c["passed"] for c in run["claims"]}[
      "claims and findings follow from the perplexities"] is True
  r = common.recorded_of(run)
  lens = list(fid.PRESETS["test"]["eval_lens"])
  for k in ("aligned_segmented", "misaligned_segmented", "misaligned_dense"):
    assert sorted(int(L) for L in r["perplexity"][k]) == lens
    assert all(np.isfinite(v) for v in r["perplexity"][k].values())
  assert set(r["findings"]) == {"misaligned_over_aligned_at_max_len", "explodes_like_paper_2x"}


def test_memory_bench_merges_split_runs(tmp_path):
  """A GPU run split over several commands (--lengths / --rows) merges into one file: rows of
  other (row, T) kept, ratios and targets from the merged rows."""
  out = str(tmp_path / "m.json")
  r = lambda row, T, peak, s: dict(row=row, T=T, peak_minus_weights=peak, cache_bytes=peak,
                                   prefill_s=s)
  json.dump(dict(preset="test", rows=[r("dense", 64, 100, 2.0), r("segmented", 128, 10, 1.0)]),
            open(out, "w"))
  common.write_result(out, "segmented_memory", mem.run("test", lengths=(128,), rows_wanted=(),
                                                        out=out), name="test")
  doc = common.read_result(out)
  assert [(x["row"], x["T"]) for x in doc["rows"]] == [("dense", 64), ("segmented", 128)]
  json.dump(dict(doc, rows=doc["rows"] + [r("dense", 128, 80, 2.0)]), open(out, "w"))
  doc = mem.run("test", lengths=(256,), rows_wanted=(), out=out)
  assert doc["summary"] == {"128": dict(memory_ratio_vs_dense=0.125, cache_ratio_vs_dense=0.125,
                                        latency_ratio_vs_dense=0.5)}
  assert doc["targets"] == dict(at_length=128, memory_quarter_at_max_len=True,
                                latency_no_worse_at_max_len=True)
