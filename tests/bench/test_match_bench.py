"""MATCH benches: the recorded MQAR fidelity result (bench/results/match_mqar.json) holds the
paper's claim and is complete; the bench's training loop learns at a tiny size; the memory
bench's 'test' preset shows MATCH's K/V bytes flat in the context length."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench import common  # noqa: E402
import match_memory  # noqa: E402
import match_mqar  # noqa: E402

RESULT = os.path.join(ROOT, "bench", "results", "match_mqar.json")


def test_mqar_bench_trains_and_evaluates():
  s = match_mqar.PRESETS["test"]
  cfg, params, _ = match_mqar.train(s, "match", log=lambda *a: None)
  acc = match_mqar.accuracy(s, cfg, params, 64)
  assert 0.0 <= acc <= 1.0
  assert match_mqar.model_config(s, "sink").scheme_options["sinks"] == 4
  assert match_mqar.model_config(s, "swa").scheme_options["top_k"] == 0
  assert match_mqar.model_config(s, "full").scheme_options["window"] == max(s.lengths)


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


def test_mqar_check_claims_refuses_swa_recall():
  """match_mqar.check_claims (what the bench records as its claims) can fail: the recorded result
  with SWA also recalling at 512 is refused."""
  r = common.read_result(RESULT)
  assert match_mqar.check_claims(r) == []
  bad = json.loads(json.dumps(r))
  bad["methods"]["swa"]["512"] = 0.95
  assert match_mqar.check_claims(bad)


def test_memory_merge_refuses_runs_of_other_settings():
  import pytest
  r = common.read_result(os.path.join(ROOT, "bench", "results", "match_memory.json"))
  other = dict(r, settings=dict(r["settings"], window=64))
  with pytest.raises(ValueError, match="differ"):
    match_memory.merge([r, other])
