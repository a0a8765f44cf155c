"""MATCH benches: the recorded MQAR sweep (bench/results/match_mqar.json) shows its direction (the
fresh small run: tests/cli/test_demo_sections.py); the pre-registered criteria can fail; the
scored-positions-only training / chunked evaluation equal the full logits and the H100 preset's
compiled step fits a shared GPU; the memory bench's 'test' preset shows MATCH's K/V bytes flat
in the context length; the TTFT bench's 'test' preset runs (tests/bench/test_match_ttft.py)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench import common  # noqa: E402
import match_memory  # noqa: E402
import match_mqar  # noqa: E402

RESULT = os.path.join(ROOT, "bench", "results", "match_mqar.json")


def test_mqar_recorded_sweep_shows_the_direction():
  """The recorded sweep (bench/results/match_mqar.json, run sweep_cpu) at length 64: MATCH
  (training mask) beats SWA by > 0.1, and MATCH's decode semantics (recomputed retrieved K/V)
  gives the training mask's accuracy within 0.1 on the same weights. The fresh re-run of the
  bench's 'test' preset (match_mqar.train_length: SWA, MATCH and random retrieval from
  scratch, both semantics) with stronger margins is
  tests/cli/test_demo_sections.py::test_demo_match_recalls_beyond_the_window (scripts/demo.py's
  MATCH section: MATCH >= SWA + 0.3 beyond the window, random <= MATCH - 0.3, decode
  semantics within 0.05); it ran here too before (44 s of CI for weaker checks)."""
  rec = common.recorded_of(common.newest(RESULT, "sweep_cpu"))["summary"]
  assert rec["match"]["64"]["sequence"] > rec["swa"]["64"]["sequence"] + 0.1
  assert abs(rec["match"]["64"]["recompute"] - rec["match"]["64"]["sequence"]) <= 0.1


def test_mqar_criteria_can_fail():
  """check_criteria / verdict on a recorded-shaped summary: MATCH is judged only when the
  baselines are fair, and each criterion fails on its own numbers."""
  row = lambda a, rc=None: dict(sequence=a, plateau=True,
                                **({} if rc is None else {"recompute": rc}))
  good = {"full": {"64": row(1.0), "128": row(0.99)}, "swa": {"64": row(0.95), "128": row(0.5)},
          "match": {"64": row(1.0, 1.0), "128": row(0.99, 0.97)},
          "random": {"64": row(0.97, 0.9), "128": row(0.55, 0.5)}}
  assert match_mqar.verdict(match_mqar.check_criteria(good)) == "pass"
  bad = json.loads(json.dumps(good))
  bad["swa"]["64"]["sequence"] = 0.3
  assert match_mqar.verdict(match_mqar.check_criteria(bad)).startswith("not judged")
  bad = json.loads(json.dumps(good))
  bad["full"]["128"]["sequence"] = 0.94  # full attention below 0.95 at one length only
  assert match_mqar.verdict(match_mqar.check_criteria(bad)) == (
      "not judged: baselines not fair (full_fair failed)")
  bad = json.loads(json.dumps(good))
  bad["full"]["128"]["plateau"] = False
  assert match_mqar.verdict(match_mqar.check_criteria(bad)) == (
      "not judged: baselines not fair (baselines_plateau failed)")
  bad = json.loads(json.dumps(good))
  bad["match"]["128"]["recompute"] = 0.55
  crit = match_mqar.check_criteria(bad)
  assert not crit["match_decode"] and not crit["match_beats_swa"] and crit["match_sequence"]
  bad = json.loads(json.dumps(good))
  bad["random"]["128"]["sequence"] = 0.9
  assert match_mqar.verdict(match_mqar.check_criteria(bad)) == "fail: random_near_swa"


def test_mqar_query_power_places_queries_near_the_pairs():
  """The presets' MQAR rows (query_power 0.01, Zoology's placement): most queries sit in the
  first slots after the pairs (uniform slots: about a quarter in the first quarter), each answer
  is its key's value, and a power <= 0 is refused."""
  import numpy as np
  t = match_mqar.task(match_mqar.PRESETS["h100"], 64)
  uniform = match_mqar.dataclasses.replace(t, query_power=None)
  assert t.query_power == 0.01 and match_mqar.task(match_mqar.PRESETS["cpu"], 64).query_power
  first_quarter = lambda task: np.mean([
      (np.nonzero(task.example(0, i)["loss_mask"])[0] - task.query_start) // 2 < task.num_slots // 4
      for i in range(300)])
  assert first_quarter(t) > 0.5 and 0.15 < first_quarter(uniform) < 0.35
  for i in range(20):
    r = t.example(0, i)
    pairs = dict(zip(r["inputs"][:2 * t.num_pairs:2], r["inputs"][1:2 * t.num_pairs:2]))
    q = np.nonzero(r["loss_mask"])[0]
    assert len(q) == t.num_pairs and all(pairs[r["inputs"][j]] == r["targets"][j] for j in q)
  with pytest.raises(ValueError, match="query_power"):
    match_mqar.dataclasses.replace(t, query_power=0.0)


def test_mqar_merge_joins_lr_jobs(tmp_path):
  """A (method, length) trained as jobs over parts of its lr sweep (--lrs) merges into the
  sweep's result: finals and curves in the sweep's lr order whatever the files' order, and the
  summary's best lr is found across jobs; a sweep covered twice or partly is refused."""
  s = match_mqar.dataclasses.replace(match_mqar.PRESETS["test"], lrs=(1e-3, 3e-3), seeds=(0, 1),
                                     attention_path="auto")
  settings = json.loads(json.dumps(match_mqar.dataclasses.asdict(s)))

  def job(method, lrs, accs):
    curves = {"step": [150, 300], "loss": [[2.0] * len(accs), [1.0] * len(accs)],
              "acc": [[a / 2 for a in accs], accs]}
    final = {"sequence": accs, **({"recompute": accs} if method in match_mqar.RETRIEVES else {})}
    return {"final": final, "curves": curves, "lrs": lrs, "stopped_at": None, "seconds": 1.0}

  def write(name, per):
    path = str(tmp_path / name)
    with open(path, "w") as f:
      json.dump({"device": "cpu", "settings": settings, "per": per}, f)
    return path

  paths = [write("hi.json", {"full": {"64": job("full", [3e-3], [0.9, 0.7])}}),
           write("lo.json", {"full": {"64": job("full", [1e-3], [0.2, 0.4])}}),
           write("rest.json", {m: {"64": job(m, [1e-3, 3e-3], [0.1, 0.1, 0.2, 0.2])}
                               for m in ("swa", "match", "random")})]
  r = match_mqar.merge_progress(s, paths)
  assert r["finals"]["full"]["64"]["sequence"] == [0.2, 0.4, 0.9, 0.7]
  assert r["curves"]["full"]["64"]["acc"] == [[0.1, 0.2, 0.45, 0.35], [0.2, 0.4, 0.9, 0.7]]
  assert r["summary"]["full"]["64"]["best_lr"] == 3e-3 and r["summary"]["full"]["64"][
      "sequence"] == 0.8
  with pytest.raises(ValueError, match="not the sweep's"):
    match_mqar.merge_progress(s, paths + [paths[0]])
  with pytest.raises(ValueError, match="not the sweep's"):
    match_mqar.merge_progress(s, paths[1:])
  # a sweep split by seed too (--seeds): lr 3e-3 as seed 1, then seed 0; a stopped-early job
  # that a finished one covers (run again by a later call) is dropped, an uncovered one is not
  def seeded(seeds, accs, stopped=None):
    r = job("full", [3e-3], accs)
    return dict(r, seeds=seeds, stopped_at=stopped)
  split = [write("s1.json", {"full": {"64": seeded([1], [0.7])}}),
           write("s0.json", {"full": {"64": seeded([0], [0.9])}}),
           write("old.json", {"full": {"64": seeded([0, 1], [0.1, 0.1], stopped=150)}})]
  r = match_mqar.merge_progress(s, [paths[1]] + split + paths[2:])
  assert r["finals"]["full"]["64"]["sequence"] == [0.2, 0.4, 0.9, 0.7]
  assert r["curves"]["full"]["64"]["acc"][0] == [0.1, 0.2, 0.45, 0.35]
  assert "stopped_early" in r and not r["stopped_early"]
  with pytest.raises(ValueError, match="not the sweep's"):
    match_mqar.merge_progress(s, [paths[1], split[0], split[2]] + paths[2:])
  # a file from before Settings.attention_path (no such key) merges with one that ran the
  # block-sparse path (an execution field: same values); any other settings difference is refused
  want = match_mqar.merge_progress(s, paths)["finals"]
  rest = {m: {"64": job(m, [1e-3, 3e-3], [0.1, 0.1, 0.2, 0.2])} for m in ("swa", "match", "random")}
  base = settings
  settings = {k: v for k, v in base.items() if k != "attention_path"}
  old = [write("old_hi.json", {"full": {"64": job("full", [3e-3], [0.9, 0.7])}}),
         write("old_lo.json", {"full": {"64": job("full", [1e-3], [0.2, 0.4])}})]
  settings = dict(base, attention_path="block_sparse")
  assert match_mqar.merge_progress(s, old + [write("bs.json", rest)])["finals"] == want
  settings = dict(base, window=s.window + 1)
  with pytest.raises(ValueError, match="other settings"):
    match_mqar.merge_progress(s, old + [write("other.json", rest)])


def test_memory_bench_match_flat():
  """MATCH's K/V bytes are the same at two context lengths (only the raw tokens grow); the
  dense rows (which grow) are what the GPU preset adds. No decode steps (new=0): the cache's
  arrays are allocated by the engine at its cache length and keep their shapes through decode,
  so the bytes are those after prefill; MATCH's decode step itself is tests/schemes' (generation
  == the declared forward)."""
  s = match_memory.PRESETS["test"]
  s = match_memory.dataclasses.replace(s, contexts=(32, 96), new=0)
  r = match_memory.run(s, models=("match",), log=lambda *a: None)
  assert match_memory.check_flat(r) == []
  m32, m96 = r["rows"]
  assert m32["kv_bytes"] == m96["kv_bytes"] == m32["analytic"]["window"] + m32["analytic"]["retrieved"]
  assert m96["cache_bytes"] - m32["cache_bytes"] == 4 * 64  # only the raw tokens grow
  grown = dict(r, rows=r["rows"] + [dict(m32, model="dense"), dict(m32, model="dense")])
  assert match_memory.check_flat(grown) == ["dense kv_bytes do not grow with context"]


def test_memory_merge_refuses_runs_of_other_settings():
  import pytest
  r = common.read_result(os.path.join(ROOT, "bench", "results", "match_memory.json"))
  other = dict(r, settings=dict(r["settings"], window=64))
  with pytest.raises(ValueError, match="differ"):
    match_memory.merge([r, other])


def test_answer_logits_and_chunked_accuracy_equal_the_full_logits():
  """The bench scores only the answer positions (hidden states gathered before the LM head) and
  evaluates held-out rows eval_chunk at a time: the logits equal the full forward's at those
  positions, and the chunked accuracy (uneven last chunk, 2 models) equals argmax-correct over
  the full logits, with targets set so that a known fraction is correct."""
  import dataclasses
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  s = dataclasses.replace(match_mqar.PRESETS["test"], eval_chunk=16)
  cfg = match_mqar.model_config(s, "swa", 64)
  model = match_mqar.Decoder(cfg)
  held = match_mqar.rows(match_mqar.task(s, 64), 0, 40, stream=1)
  init = jax.jit(lambda k: nn.unbox(model.init(k, jnp.zeros((1, 64), jnp.int32))["params"]))
  params = jax.tree.map(lambda *a: jnp.stack(a), init(jax.random.PRNGKey(0)),
                        init(jax.random.PRNGKey(1)))  # one init program for both keys
  full = np.asarray(jax.jit(jax.vmap(lambda p, x: model.apply({"params": p}, x)[0],
                                    in_axes=(0, None)))(params, held["inputs"]))  # [M,N,T,V]
  ans = held["answers"]
  got = np.asarray(match_mqar.answer_logits(model, jax.tree.map(lambda a: a[1], params),
                                            jnp.asarray(held["inputs"]), jnp.asarray(ans)))
  np.testing.assert_allclose(got, np.take_along_axis(full[1], ans[..., None], 1), atol=1e-5)
  # model 0's argmax becomes the target of rows 0..24 (25 of 40 rows correct for model 0)
  pred = np.take_along_axis(full[0].argmax(-1), ans, 1)
  targets = held["targets"].copy()
  np.put_along_axis(targets[:25], ans[:25], pred[:25], 1)
  held = dict(held, targets=targets)
  acc = match_mqar._accuracy_fn(s, cfg, 64)(params, {k: jnp.asarray(v) for k, v in held.items()})
  want = [np.mean(np.take_along_axis(full[m].argmax(-1), ans, 1) ==
                  np.take_along_axis(targets, ans, 1)) for m in range(2)]
  np.testing.assert_allclose(acc, want)
  assert acc[0] >= 25 / 40


def test_h100_preset_fits_a_shared_gpu(monkeypatch):
  """The H100 preset's largest job (full attention at length 512, one lr of its sweep: --lrs,
  3 seeds = 3 models) compiles on CPU to <= 12 GiB of step temporaries and <= 4 GiB an
  evaluation call, so 4 jobs share one 80 GiB GPU. (Before: logits of every position and the
  1024 held-out rows in one call asked 24 GiB at length 128 and 96 GiB at 512.)"""
  s = match_mqar.PRESETS["h100"]
  assert dict(s.model_groups) == {512: 4} and len(match_mqar.method_lrs(s, "full")) == 4
  monkeypatch.setattr(match_mqar, "LRS", (1e-3,))
  m = match_mqar.compiled_memory(s, "full", 512)
  assert m["step_temp"] <= 12 * 2**30 and m["eval_temp"] <= 4 * 2**30, m
  # the GPU plan caps a length-512 job at MEM_FRACTION[512] of an 80 GB card (<= 4 jobs a
  # card): the step's and the evaluation's temporaries and the arguments together fit under it
  cap = match_mqar.MEM_FRACTION[512]
  total = m["step_temp"] + m["eval_temp"] + m["step_args"] + m["eval_args"]
  assert total <= cap * 80e9, (total / 2**30, cap)
  assert max(j["models"] for j in match_mqar.plan_jobs(s) if j["length"] == 512) <= 3


def test_h100_gpu_plan_runs_the_sweep_once_within_the_calls():
  """The h100 preset trains 12,800 steps (8 epochs of its 100K rows: at 3200 the baselines did
  not learn); its GPU plan on 4 GPUs holds every (method, length, lr, seed) model exactly once,
  each GPU's estimated work within a call's budget, <= 4 jobs and <= 0.9 of its memory, and
  each job's estimated end before --deadline_s; a re-plan leaves out what finished (--done),
  and the script runs each job under timeout 480 with --deadline_s=440."""
  import re
  s = match_mqar.PRESETS["h100"]
  assert s.steps == 12800 and s.steps * s.batch // s.train_rows == 8  # epochs of 100K rows
  calls = match_mqar.gpu_plan(s, 4)
  want = sorted((m, n, lr, x) for n in s.lengths for m in match_mqar.METHODS
                for lr in match_mqar.method_lrs(s, m) for x in s.seeds)
  got = sorted((j["method"], j["length"], lr, x) for c in calls for j in c
               for lr in j["lrs"] for x in j["seeds"])
  assert got == want and len(want) == 168
  room = match_mqar.GPU_BUDGET_S - match_mqar.JOB_OVERHEAD_S
  for c in calls:
    for g in range(4):
      on = [j for j in c if j["gpu"] == g]
      assert sum(j["work_s"] for j in on) <= room and len(on) <= match_mqar.JOBS_PER_GPU
      assert sum(j["cap"] for j in on) <= 0.9
      assert all(j["est_s"] <= match_mqar.GPU_BUDGET_S for j in on)
  assert len(calls) <= 12  # 12 with STEP_MS re-tuned from call 1 (MATCH / random at 512: 24 ms)
  first = {(j["method"], j["length"], lr, x) for j in calls[0] for lr in j["lrs"]
           for x in j["seeds"]}
  rest = match_mqar.gpu_plan(s, 4, done=first)
  assert sorted((j["method"], j["length"], lr, x) for c in rest for j in c for lr in j["lrs"]
                for x in j["seeds"]) == sorted(set(want) - first)
  with open(os.path.join(ROOT, "bench", "match_segmented_gpu.sh")) as f:
    sh = f.read()
  job = re.search(r"while read -r g m L.*?done <", sh, re.S).group(0)
  assert "LIMIT=${MQAR_TIMEOUT:-480}" in sh and "timeout $LIMIT" in job
  assert "--deadline_s=$(( LIMIT - 40 ))" in job and "--seeds=$seeds" in job


def test_ttft_times_the_two_models_in_turns():
  """bench.common.time_interleaved (the TTFT bench's timer): n rounds, each model once a round,
  the order reversed every round (A B, B A, ...), each model's own runs and their median."""
  calls = []
  fns = {"swa": lambda: calls.append("swa"), "match": lambda: calls.append("match")}
  out = common.time_interleaved(fns, n=4)
  assert calls == ["swa", "match", "match", "swa", "swa", "match", "match", "swa"]
  for k in fns:
    assert len(out[k]["runs_ms"]) == 4
    mid = sorted(out[k]["runs_ms"])[1:3]
    assert out[k]["median_ms"] == pytest.approx((mid[0] + mid[1]) / 2)
