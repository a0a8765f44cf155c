"""The one check of the recorded results: every result file in bench/results is in
bench/common.py's schema, every claim its runs recorded passed, every claim registered in
bench/claims holds when re-evaluated from the stored numbers (and agrees with the recorded
verdict), and every doc quote (README.md, docs/performance.md) is the newest run's. Also: the
writer appends runs and records their claims, the migration keeps every number."""
import glob
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import claims  # noqa: E402
from bench import common  # noqa: E402
from bench import migrate_results  # noqa: E402

FILES = sorted(p for p in glob.glob(os.path.join(common.RESULTS, "*.json"))
               if not os.path.basename(p).startswith(migrate_results.SKIP))
claims.load_all()


def test_there_are_results_to_check():
  assert len(FILES) >= 16, FILES


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(p) for p in FILES])
def test_every_results_file_is_in_the_schema_and_its_claims_hold(path):
  """Recorded claims passed; the registered claims, re-evaluated from the stored numbers, pass
  and were recorded with the same verdict (python -m bench.migrate_results --claims records
  them)."""
  data = common.load(path)  # raises naming the file and the field
  assert data["runs"] and data["bench"] in os.path.basename(path)
  for i, run in enumerate(data["runs"]):
    name = run["settings"]["name"]
    assert run["bench"] == data["bench"] and name
    failed = [c["name"] for c in run["claims"] if not c["passed"]]
    assert not failed, (path, name, failed)
    stored = {c["name"]: c["passed"] for c in run["claims"]}
    for c in claims.evaluate(path, data["runs"], i):
      assert c["passed"], f"{os.path.basename(path)} run {name!r}: claim {c['name']!r} fails: " \
                          f"{c['detail']['error']}"
      assert stored.get(c["name"]) is True, (
          f"{os.path.basename(path)} run {name!r}: claim {c['name']!r} not recorded (run "
          f"python -m bench.migrate_results --claims)")


def test_every_registered_claim_is_evaluated_on_a_recorded_run():
  """A claim whose bench / run name / file matches no recorded run would never be checked."""
  seen = set()
  for path in FILES:
    data = common.load(path)
    for run in data["runs"]:
      seen |= {id(c) for c in claims.CLAIMS if c.applies(
          run["bench"], run["settings"]["name"], os.path.basename(path))}
  unused = [c.name for c in claims.CLAIMS if id(c) not in seen]
  assert not unused, f"claims that match no run in bench/results: {unused}"
  assert len(claims.CLAIMS) >= 32


def test_a_claim_fails_when_a_stored_number_changes(tmp_path):
  """Re-evaluation reads the stored numbers: the MQAR run with SWA recalling at 512 fails its
  claim, the writer records the failure on the run it appends, and the error names the claim."""
  src = os.path.join(common.RESULTS, "match_mqar.json")
  data = common.load(src)
  rec = common.recorded_from(data)
  assert [c["passed"] for c in claims.evaluate(src, data["runs"], 0)] == [True]
  bad = json.loads(json.dumps(data))
  bad["runs"][0]["recorded"]["methods"]["swa"]["512"] = 0.95
  (got,) = claims.evaluate(src, bad["runs"], 0)
  assert got["name"] == "mqar result holds the claims" and not got["passed"]
  assert "ClaimFailed" in got["detail"]["error"]
  path = str(tmp_path / "match_mqar.json")
  run = common.write_result(path, "match_mqar", json.loads(json.dumps(
      dict(rec, methods=dict(rec["methods"], swa=dict(rec["methods"]["swa"], **{"512": 0.95}))))),
      name="cpu")
  on_disk = common.load(path)["runs"][-1]
  assert on_disk["claims"] == run["claims"]
  assert {c["name"]: c["passed"] for c in on_disk["claims"]}["mqar result holds the claims"] is False


@pytest.mark.parametrize("q", claims.QUOTES, ids=[q.name for q in claims.QUOTES])
def test_docs_quote_the_newest_run(q):
  """Every number a doc quotes from a result file is the newest run's (one helper for every doc:
  bench/claims' @quote)."""
  missing = claims.missing(q, open(os.path.join(ROOT, q.doc)).read())
  assert not missing, f"{q.doc} does not quote the newest {q.run} run of {q.file}: {missing}"


def test_a_doc_quoting_another_number_fails_the_quote_check():
  (q,) = [q for q in claims.QUOTES if q.name == "readme_match_memory"]
  text = open(os.path.join(ROOT, q.doc)).read()
  assert claims.missing(q, text) == []
  assert claims.missing(q, text.replace("21.0 MB", "20.0 MB")) == [claims.quoted(q)[0]]


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


def test_refreshing_claims_keeps_every_number(tmp_path):
  """migrate_results --claims on a copy of a result file: rows stored once, claims recorded, the
  content read back unchanged; a run whose stored rows differ from its recorded rows is kept
  as it is (not deduplicated)."""
  src = os.path.join(common.RESULTS, "compact_attention_NVIDIA_H200.json")
  path = str(tmp_path / os.path.basename(src))
  data = common.load(src)
  for run in data["runs"]:  # as migrated: the rows in both places, no registered claims
    run["recorded"] = common.recorded_of(run)
    run["claims"] = [c for c in run["claims"] if c["name"] not in {
        x.name for x in claims.CLAIMS}]
  common._write(path, data)
  before = common.recorded(path)
  assert migrate_results.main(["--claims", path]) == 0
  after = common.load(path)
  assert common.recorded_from(after) == before
  main = after["runs"][0]
  assert main["rows"] and "rows" not in main["recorded"]
  assert [c["passed"] for c in main["claims"] if c["name"].startswith("h200")] == [True, True]
