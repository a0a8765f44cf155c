"""bench/match_ttft.py's 'test' preset through its CLI, run once with --profile (a module
fixture): the TTFT rows, ratio and verdict (what a run without --profile records: --profile
only adds each row's calls and the run's per_call), and where MATCH's time to first token goes,
call by call."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench import common  # noqa: E402
import match_ttft  # noqa: E402


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
  """(the recorded run of `match_ttft.py --preset=test --profile`, the engine programs each
  profile() call compiled beyond the timed prefill's)."""
  from condattn_jax.inference import Engine
  new_programs = []
  profile = match_ttft.profile

  def counted(*a, **kw):
    before = Engine._step._cache_size()
    out = profile(*a, **kw)
    new_programs.append(Engine._step._cache_size() - before)
    return out
  out_dir = str(tmp_path_factory.mktemp("match_ttft"))
  with pytest.MonkeyPatch.context() as m:
    m.setattr(match_ttft, "profile", counted)
    match_ttft.main(["--preset=test", "--profile", f"--out_dir={out_dir}"])
  (run,) = common.load(common.result_path("match_ttft", out_dir))["runs"]
  return common.recorded_of(run), new_programs


def test_ttft_bench_test_preset(profiled):
  """SWA and MATCH (retrieval for the last prefill_last prompt positions) each prefilled
  through the engine, a median TTFT each, the ratio and verdict recorded from the rows, and
  MATCH's first-token logits differ from SWA's on the same weights (the retrieval ran)."""
  r, _ = profiled
  by = {x["model"]: x for x in r["rows"]}
  assert sorted(by) == ["match", "swa"] and all(x["logits_finite"] for x in by.values())
  assert r["match_over_swa"] == round(by["match"]["ttft_s"] / by["swa"]["ttft_s"], 4)
  assert r["passed"] == (r["match_over_swa"] <= match_ttft.CRITERION["max_ratio"])
  # the verdict a recorded run's claim re-derives from its rows, and that it can fail
  assert match_ttft.verdict(r["rows"]) == {k: r[k] for k in ("match_over_swa", "passed")}
  slow = [dict(x, ttft_s=1.2 * by["swa"]["ttft_s"]) if x["model"] == "match" else x
          for x in r["rows"]]
  assert match_ttft.verdict(slow) == {"match_over_swa": 1.2, "passed": False}
  assert r["match_vs_swa_logit_diff"] > 1e-3


def test_profile_times_each_prefill_call_and_names_the_retrieving_ones(profiled):
  """The 'test' preset with --profile: each row lists the engine's prefill calls (contiguous
  over the prompt, the compiled step the TTFT timed: the same first-token logits); the calls
  the geometry says retrieve (`work`'s aux_calls of them) are exactly MATCH's calls whose
  queries read retrieved chunks (the engine's retrieved_B, measured), SWA's read none; GPU-busy
  time is traced for the first call, the last plain one and each retrieving one; the run's
  per-call ratios re-derive from the rows, and the verdict still reads ttft_s only. The profile
  runs the TTFT's programs: each call gets the engine's static fields (MATCH: whether it
  retrieves; without them the step compiles the path that decides on the device, a cond a
  layer) and compiles no program the timed prefill did not."""
  r, new_programs = profiled
  assert new_programs == [0, 0], new_programs
  s = match_ttft.PRESETS["test"]
  by = {x["model"]: x for x in r["rows"]}
  traced = match_ttft.profiled_calls(match_ttft.call_geometry(s, True))
  for name, row in by.items():
    calls = row["calls"]
    assert len(calls) == row["work"]["prefill_calls"] == -(-s.context // s.prefill_chunk)
    assert calls[0]["start"] == 0 and calls[-1]["stop"] == s.context
    assert all(a["stop"] == b["start"] for a, b in zip(calls, calls[1:]))
    assert all(c["ms"] > 0 for c in calls) and row["profile_logits_equal_prefill"]
    assert [i for i, c in enumerate(calls) if "busy_ms" in c] == traced
    assert row["prefill_busy_ms"] > 0 and row["prefill_span_ms"] >= row["prefill_busy_ms"]
    assert row["calls_ms"] == round(sum(c["ms"] for c in calls), 3)
  ret = [i for i, c in enumerate(by["match"]["calls"]) if c["retrieves"]]
  assert ret and len(ret) == by["match"]["work"]["aux_calls"]
  assert [i for i, c in enumerate(by["match"]["calls"]) if c["retrieved"] > 0] == ret
  assert all(c["retrieved"] is None and not c["retrieves"] for c in by["swa"]["calls"])
  assert all(c["fields"] == {} for c in by["swa"]["calls"])
  aux_blocks = by["match"]["work"]["aux_rows_a_call"] // (s.top_k * s.chunk)
  assert [c["fields"] for c in by["match"]["calls"]] == [
      {"match_call_retrieves": True, "match_aux_blocks": aux_blocks} if c["retrieves"] else
      {"match_call_retrieves": False} for c in by["match"]["calls"]]
  assert set(traced) >= {0, *ret} and len(traced) == len(ret) + 2
  assert r["per_call"] == match_ttft.per_call(r["rows"])
  assert r["per_call"]["retrieving_calls"] == ret
  assert r["match_over_swa"] == round(by["match"]["ttft_s"] / by["swa"]["ttft_s"], 4)
  assert "xla_flags" in r
