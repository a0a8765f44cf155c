"""bench/segmented_memory.py (test preset rows, in process: every row runs, the segmented cache
is the analytic one and smaller than dense, its compiled prefill step needs less scratch than
the one-shot dense step) and bench/segmented_fidelity.py (the recorded CPU run: its claims hold
and follow from its numbers; the test preset runs end to end)."""
import json
import math
import os

import numpy as np
import pytest

from bench import common  # noqa: E402
from bench import segmented_fidelity as fid
from bench import segmented_memory as mem
from condattn_jax.attention import segmented as sgm

RESULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                      "results", "segmented_fidelity.json")


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


def test_recorded_fidelity_claims_follow_from_the_numbers():
  r = common.read_result(RESULT)
  assert r["preset"] == "cpu" and r["date"][:4] >= "2026" and r["platform"] == "cpu"
  assert r["settings"]["segmented"] == {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in fid.SEG.items()}
  assert r["settings"]["eval_lens"] == list(fid.PRESETS["cpu"]["eval_lens"])
  ppl = {k: {int(L): v for L, v in d.items()} for k, d in r["perplexity"].items()}
  a, m = ppl["aligned_segmented"], ppl["misaligned_segmented"]
  assert all(math.isfinite(x) and x > 1 for d in ppl.values() for x in d.values())
  claims, findings = fid.claims_of(ppl, fid.PRESETS["cpu"])
  assert claims == r["claims"] and findings == r["findings"]
  assert all(claims.values()), claims
  # the recorded numbers themselves: aligned flat, misaligned above it beyond one segment
  assert max(a.values()) / min(a.values()) < 1.5
  assert all(m[L] > a[L] for L in a if L > fid.SEG["segment_len"])


def test_fidelity_test_preset_runs():
  r = fid.run("test")
  lens = list(fid.PRESETS["test"]["eval_lens"])
  for k in ("aligned_segmented", "misaligned_segmented", "misaligned_dense"):
    assert sorted(r["perplexity"][k]) == lens
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


def test_recorded_gpu_memory_and_latency_meet_the_targets():
  """bench/results/segmented_memory.json (one GPU, LLaMA-2-7B shape, S/M/R = 4096/512/512): at
  64K the segmented prefill's peak (minus weights) is <= 1/4 of dense's, even of an ideal dense
  engine holding nothing but its KV cache, and it is no slower; the ratios follow from the rows."""
  r = common.read_result(os.path.join(os.path.dirname(RESULT), "segmented_memory.json"))
  assert r["preset"] == "gpu" and r["device"].startswith("NVIDIA") and r["jax_version"]
  rows = {(x["row"], x["T"]): x for x in r["rows"]}
  assert all("error" not in x and x["logits_finite"] for x in rows.values())
  assert {T for _, T in rows} == {16384, 32768, 65536}
  assert mem.summarise(mem.PRESETS["gpu"], r["rows"]) == (r["summary"], r["targets"])
  assert r["targets"] == dict(at_length=65536, memory_quarter_at_max_len=True,
                              latency_no_worse_at_max_len=True)
  seg, dense = rows["segmented", 65536], rows["dense", 65536]
  assert seg["peak_minus_weights"] <= 0.25 * dense["cache_bytes"]
  assert seg["prefill_s"] <= rows["dense_chunked", 65536]["prefill_s"]
  # segmented memory grows only with the pool (long heads of long layers), dense with T
  assert (rows["segmented", 65536]["peak_minus_weights"]
          < 1.5 * rows["segmented", 16384]["peak_minus_weights"])
