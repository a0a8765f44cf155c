"""bench/common.py's one result schema: every result file in bench/results is in it and every
claim it recorded passed; the writer appends runs (never new top-level keys); the migration keeps
every number; docs/performance.md quotes the newest recorded run."""
import glob
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from bench import migrate_results  # noqa: E402

FILES = sorted(p for p in glob.glob(os.path.join(common.RESULTS, "*.json"))
               if not os.path.basename(p).startswith(migrate_results.SKIP))


def test_there_are_results_to_check():
  assert len(FILES) >= 16, FILES


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(p) for p in FILES])
def test_every_results_file_is_in_the_schema_and_its_claims_hold(path):
  data = common.load(path)  # raises naming the file and the field
  assert data["runs"] and data["bench"] in os.path.basename(path)
  for run in data["runs"]:
    assert run["bench"] == data["bench"] and run["settings"]["name"]
    failed = [c["name"] for c in run["claims"] if not c["passed"]]
    assert not failed, (path, run["settings"]["name"], failed)


def test_the_writer_appends_runs_and_readers_see_the_newest(tmp_path):
  path = str(tmp_path / "toy_cpu.json")
  first = common.write_result(path, "toy", dict(rows=[dict(T=1, ms=2.0)], note="first"),
                              settings=dict(n=3), claims={"fast enough": True})
  second = common.write_result(path, "toy", dict(rows=[dict(T=1, ms=1.5)]),
                               claims={"fast enough": False})
  data = common.load(path)
  assert set(data) == {"schema", "bench", "device", "runs"} and len(data["runs"]) == 2
  assert data["runs"][0]["settings"] == dict(n=3, name="main") and first["rows"][0]["ms"] == 2.0
  assert [c["passed"] for r in data["runs"] for c in r["claims"]] == [True, False]
  # the newest run's keys replace the older run's; keys only the older run wrote stay
  assert common.read_result(path) == dict(rows=[dict(T=1, ms=1.5)], note="first")
  assert common.newest(path) == second or common.newest(path)["date"] == second["date"]
  with pytest.raises(ValueError, match="holds bench 'toy', not 'other'"):
    common.write_result(path, "other", {})
  bad = dict(second, date="25/11/2026")
  with pytest.raises(ValueError, match="date '25/11/2026' is not ISO 8601"):
    common.append_run(path, bad)
  with pytest.raises(ValueError, match="missing field 'claims'"):
    common.append_run(path, {k: v for k, v in second.items() if k != "claims"})
  with open(path, "w") as f:
    json.dump({"device": "x", "rows": []}, f)
  with pytest.raises(ValueError, match="not a schema-1 result file .*migrate_results"):
    common.load(path)


def test_the_migration_keeps_every_number_and_splits_history_into_runs(tmp_path):
  """An old file with history as top-level keys: each result block becomes a run (dated by its
  own date), the rest the 'main' run; read back, the content is the old file's exactly."""
  old = dict(device="NVIDIA H100 80GB HBM3", jax_version="0.11.2", date="2026-11-25T20:04:57+00:00",
             what="toy", rows=[dict(T=32768, ms=1.25)],
             **{f"block_{i}": [dict(T=i, ms=i / 3)] for i in range(20)},
             gpu_smoke=dict(date="2026-11-24T10:00:00+00:00", tree="abc1234", result="8 passed"),
             failed_claims=[])
  path = str(tmp_path / "toy_NVIDIA_H100_80GB_HBM3.json")
  with open(path, "w") as f:
    json.dump(old, f)
  assert migrate_results.needs_migration(path)
  assert migrate_results.main([path]) == 0 and not migrate_results.needs_migration(path)
  data = common.load(path)
  assert data["bench"] == "toy" and data["device"] == old["device"]
  names = [r["settings"]["name"] for r in data["runs"]]
  assert names[0] == "main" and "gpu_smoke" in names and len(names) == 22
  smoke = common.newest(path, "gpu_smoke")
  assert smoke["date"] == "2026-11-24T10:00:00+00:00" and smoke["git_commit"] == "abc1234"
  assert common.newest(path, "main")["rows"] == old["rows"]
  assert [c["passed"] for c in common.newest(path, "main")["claims"]] == [True]
  assert common.read_result(path) == old


def test_performance_page_quotes_the_newest_compact_attention_run():
  """docs/performance.md's table of the compacted kernels' speed is the newest recorded H100 run:
  every (T, s) row with its active count and auto's forward / forward+backward ms."""
  res = common.read_result(os.path.join(common.RESULTS,
                                        "compact_attention_NVIDIA_H100_80GB_HBM3.json"))
  perf = open(os.path.join(ROOT, "docs", "performance.md")).read()
  assert len(res["rows"]) == 10
  for r in res["rows"]:
    a = r["auto"]
    line = (f"| {r['T'] // 1024}K | {r['sparsity']:<4g} | {r['active']:5d} | "
            f"{a['fwd_ms']:5.2f} / {a['fwdbwd_ms']:6.2f} |")
    assert line in perf, line
