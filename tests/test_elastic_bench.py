"""bench/elastic_tasks.py: the task mix is what the bench claims (facts beyond SSA's reach, local
periods inside it, task ids from names), the `test` preset runs end to end, and the recorded CPU
result holds the issue's claims (robust task clearly sparser, retrieval within 2 points)."""
import json
import os

import numpy as np
import pytest

from bench import elastic_tasks as bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_task_mix_rows():
  s = bench.PRESETS["cpu"]
  mix = bench.TaskMix(s)
  b = mix.batch(0, 8)
  np.testing.assert_array_equal(b["task_ids"], [0, 1] * 4)
  T = s.seq_len
  for r in range(8):
    inp, tgt, m = b["inputs"][r], b["targets"][r], b["loss_mask"][r]
    if b["task_ids"][r] == 0:  # retrieval: answers of queries whose facts are > T/4 back
      q = np.flatnonzero(m)
      assert len(q) == s.num_queries and (q >= 3 * T // 4).all()
      facts = np.flatnonzero((inp >= mix.fact0) & (inp < mix.query0))
      assert len(facts) == s.num_facts and facts.min() >= s.sink_pad and facts.max() < T // 2
      assert (q[:, None] - facts[None] >= s.local + s.block).all()
      for t in q:
        k = inp[t] - mix.query0
        f = [p for p in facts if (inp[p] - mix.fact0) // s.num_values == k]
        assert len(f) == 1 and tgt[t] - mix.answer0 == (inp[f[0]] - mix.fact0) % s.num_values
    else:  # local: a scored target repeats a token at most p_max (inside SSA's window) back
      t = np.flatnonzero(m)
      assert 0 < len(t) <= s.local_scored and t.min() >= T - s.local_scored
      assert (inp >= mix.local0).all() and s.p_max <= s.local - s.block
      seq = np.concatenate([inp, tgt[-1:]])
      for i in t:
        assert any(seq[i + 1] == seq[i + 1 - p] for p in range(s.p_min, s.p_max + 1))
      # older segments mislead: some token recurs with another successor earlier in the row
      succ = {}
      clash = False
      for i in range(T):
        clash |= succ.setdefault(seq[i], seq[i + 1]) != seq[i + 1]
      assert clash
  with pytest.raises(ValueError, match="task 'qa' is not one of"):
    bench.elastic.task_ids(["qa"], bench.TASKS)


def test_test_preset_runs(tmp_path):
  out = tmp_path / "e.json"
  r = bench.main(["--preset=test", f"--out={out}"])
  saved = json.loads(out.read_text())
  assert saved["settings"]["router_steps"] == 3 and len(saved["elastic_history"]) == 3
  for k in ("dense_accuracy", "elastic_accuracy", "all_ssa_accuracy", "omega_msr", "omega_esr"):
    assert set(saved[k]) == set(bench.TASKS), k
  assert np.shape(r["fa_freq"]["local"]) == (2, 4)


def test_recorded_cpu_result_holds_the_claims():
  r = json.load(open(os.path.join(ROOT, "bench", "results", "elastic_tasks.json")))
  want = json.loads(json.dumps(bench.dataclasses.asdict(bench.PRESETS["cpu"])))
  assert r["platform"] == "cpu" and r["settings"] == want
  assert r["omega_msr"]["local"] > r["omega_msr"]["retrieval"] + 0.15, r["omega_msr"]
  assert r["retrieval_gap_points"] <= 2.0, r["retrieval_gap_points"]
  assert r["dense_accuracy"]["retrieval"] > 0.9  # the dense model solved the task
  assert r["all_ssa_accuracy"]["retrieval"] < 0.5  # and SSA alone cannot


def test_prefill_bench_test_preset_runs():
  from bench import elastic_prefill as ep
  r = ep.run(ep.PRESETS["test"], log=lambda *a: None)
  dense, el = r["rows"]
  assert dense["row"] == "dense" and el["omega"] == 0.5 and el["fa_kv_heads"] == [0]
  assert all(x["finite"] and x["ms"] > 0 for x in r["rows"])
  assert el["speedup_vs_dense"] == pytest.approx(dense["ms"] / el["ms"])


def test_recorded_prefill_result():
  """bench/results/elastic_prefill_<H100>.json: whole Qwen3-8B-shaped layers, FA-SSA with a
  static head split vs dense cuDNN. Recorded as measured: at 64K, 75% SSA KV heads gives 1.39x
  and 62.5% 1.19x, under the 1.5x target at Omega 0.7; sparser is faster, 64K gains more than
  32K, and the speedups follow from the milliseconds."""
  import json
  import os
  from bench import elastic_prefill as ep
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                      "results", "elastic_prefill_NVIDIA_H100_80GB_HBM3.json")
  doc = json.load(open(path))
  assert doc["jax_version"] == "0.11.2" and doc["date"][:4] >= "2026"
  got = {}
  for run in doc["runs"]:
    s = run["settings"]
    assert (s["hidden"], s["heads"], s["kv_heads"], s["mlp"]) == (4096, 32, 8, 12288)
    dense = run["rows"][0]
    assert dense["row"] == "dense"
    for r in run["rows"][1:]:
      assert r["finite"] and r["speedup_vs_dense"] == pytest.approx(dense["ms"] / r["ms"])
      got[s["T"], r["omega"]] = r["speedup_vs_dense"]
  assert got[65536, 0.75] > got[65536, 0.625] > 1.0
  assert got[65536, 0.75] > got[32768, 0.75]
  assert 1.3 < got[65536, 0.75] < 1.5   # the target (1.5x at 0.7) is not reached: see the note
  assert set(ep.configs(ep.PRESETS["gpu"])) == {"dense", "elastic_0.625", "elastic_0.75"}
