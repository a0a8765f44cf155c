"""MATCH benches: a fresh small MQAR run (the bench's 'test' preset) shows the direction the
recorded sweep (bench/results/match_mqar.json) claims; the pre-registered criteria can fail; the
memory bench's 'test' preset shows MATCH's K/V bytes flat in the context length."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench import common  # noqa: E402
import match_memory  # noqa: E402
import match_mqar  # noqa: E402
from _test_env import user_env  # noqa: E402
from _train_helpers import PY, subprocess_env  # noqa: E402

RESULT = os.path.join(ROOT, "bench", "results", "match_mqar.json")


@pytest.fixture(scope="module")
def fresh_mqar(tmp_path_factory):
  """The bench's 'test' preset, SWA and MATCH only, from scratch (length 64, one seed), run in a
  subprocess with a user's compile flags (training at the suite's LLVM -O0 is ~2.7x slower a
  step than the compile it saves)."""
  out = tmp_path_factory.mktemp("mqar") / "fresh.json"
  code = ("import json, sys; sys.path.insert(0, 'bench'); import match_mqar; "
          "r = match_mqar.run(match_mqar.PRESETS['test'], methods=('swa', 'match'), "
          "log=lambda *a: None); "
          f"json.dump(r, open({str(out)!r}, 'w'))")
  subprocess.run([PY, "-c", code], cwd=ROOT, env=user_env(subprocess_env(1)), check=True,
                 timeout=900)
  return json.loads(out.read_text())


@pytest.mark.slow
def test_mqar_fresh_run_shows_the_recorded_direction(fresh_mqar):
  """A fresh small run (SWA and MATCH, 300 steps, one seed) reproduces the direction the
  recorded sweep (bench/results/match_mqar.json, run sweep_cpu) shows at length 64: MATCH
  (training mask) beats SWA by > 0.1, and MATCH's decode semantics (recomputed retrieved K/V)
  gives the training mask's accuracy within 0.1 on the same weights."""
  rec = common.recorded_of(common.newest(RESULT, "sweep_cpu"))["summary"]
  assert rec["match"]["64"]["sequence"] > rec["swa"]["64"]["sequence"] + 0.1
  assert abs(rec["match"]["64"]["recompute"] - rec["match"]["64"]["sequence"]) <= 0.1
  got = fresh_mqar["summary"]
  assert got["match"]["64"]["sequence"] > got["swa"]["64"]["sequence"] + 0.1, got
  assert abs(got["match"]["64"]["recompute"] - got["match"]["64"]["sequence"]) <= 0.1, got
  assert set(got["swa"]["64"]) >= {"best_lr", "sequence", "sequence_seeds", "plateau"}
  assert len(fresh_mqar["curves"]["match"]["64"]["acc"]) == 2  # eval_every 150 of 300 steps


def test_mqar_criteria_can_fail():
  """check_criteria / verdict on a recorded-shaped summary: MATCH is judged only when the
  baselines are fair, and each criterion fails on its own numbers."""
  row = lambda a, rc=None: dict(sequence=a, **({} if rc is None else {"recompute": rc}))
  good = {"full": {"64": row(1.0), "128": row(0.99)}, "swa": {"64": row(0.95), "128": row(0.5)},
          "match": {"64": row(1.0, 1.0), "128": row(0.99, 0.97)},
          "random": {"64": row(0.97, 0.9), "128": row(0.55, 0.5)}}
  assert match_mqar.verdict(match_mqar.check_criteria(good)) == "pass"
  bad = json.loads(json.dumps(good))
  bad["swa"]["64"]["sequence"] = 0.3
  assert match_mqar.verdict(match_mqar.check_criteria(bad)).startswith("not judged")
  bad = json.loads(json.dumps(good))
  bad["match"]["128"]["recompute"] = 0.55
  crit = match_mqar.check_criteria(bad)
  assert not crit["match_decode"] and not crit["match_beats_swa"] and crit["match_sequence"]
  bad = json.loads(json.dumps(good))
  bad["random"]["128"]["sequence"] = 0.9
  assert match_mqar.verdict(match_mqar.check_criteria(bad)) == "fail: random_near_swa"


def test_memory_bench_match_flat():
  """MATCH's K/V bytes are the same at two context lengths (only the raw tokens grow); the
  dense rows (which grow) are what the GPU preset adds."""
  s = match_memory.PRESETS["test"]
  s = match_memory.dataclasses.replace(s, contexts=(32, 96), new=1)
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
