"""bench/aha_repro.py and bench/elastic_repro.py split into parts (one job = a seed's dense
model, or units that reuse its saved checkpoint from --work_dir), merged per seed with
--merge_parts: the merged record equals the one-process run of the same preset, a gated dense
training stopped at its budget goes on to the same model, and a merge with a part missing names
the file and the command that writes it."""
import json
import os

import pytest

from bench import aha_elastic_repro_common as rc
from bench import aha_repro, common, elastic_repro


def _json(x):
  return json.loads(json.dumps(x))


def _merged(mod, preset, work, out):
  res = mod.main([f"--preset={preset}", f"--merge_parts={work}", f"--out_dir={out}"])
  assert res["preset"] == preset and set(res["unit_seconds"]) == {str(s) for s in
                                                                   mod.PRESETS[preset].seeds}
  (run,) = common.load(common.result_path(mod.__name__.split(".")[-1], str(out)))["runs"]
  assert run["claims"] and all(c["passed"] for c in run["claims"]), run["claims"]
  return res


def test_elastic_parts_resume_and_merge_equal_the_whole_run(tmp_path):
  """Elastic `test` preset through parts (dense, then the single arm and the static control,
  which reuse the saved dense model; a rerun skips done units) merged == the one-process run
  (every number, curves included). With a gate the dense model cannot reach: stopped at its
  budget after the first check (exit 3, state saved), resumed to the cap, then its own lr sweep's
second lr to the cap, the seed NOT JUDGED
  (no arm trained, no criterion judged on it), merged == the one-process run."""
  import dataclasses
  mod = elastic_repro
  mod.PRESETS["test_nogate"] = dataclasses.replace(mod.PRESETS["test"], dense_gate=2.0,
                                                   dense_lrs=(1e-3, 3e-3))
  try:
    for preset in ("test", "test_nogate"):
      whole = mod.run(mod.PRESETS[preset], log=lambda *a: None)
      work = tmp_path / preset
      argv = [f"--preset={preset}", f"--work_dir={work}"]
      if preset == "test_nogate":
        with pytest.raises(SystemExit) as e:
          mod.main(argv + ["--part=dense", "--dense_budget_s=0"])
        assert e.value.code == 3
        with pytest.raises(ValueError, match=r"_s0_dense.json: missing; run .*--part=dense"):
          mod.main([f"--preset={preset}", f"--merge_parts={work}", f"--out_dir={tmp_path}"])
      mod.main(argv + ["--part=dense"])
      mod.main(argv + ["--part=single,static"])
      mod.main(argv + ["--part=single"])     # done already: skipped
      res = _merged(mod, preset, work, tmp_path / f"o_{preset}")
      assert _json(res["seeds"]) == _json(whole["seeds"]) and res["metrics"] == whole["metrics"]
      gate = res["seeds"][0]["dense_gate"]
      if preset == "test":
        assert gate["passed"] and res["metrics"]["judged_seeds"] == 1
        assert res["seeds"][0]["arms"]["single"]["curves"]["accuracy"]
      else:
        assert [c[0] for c in gate["checks"]] == [2, 3] and not gate["passed"]
        # its own lr sweep: both lrs tried to the cap (the first resumed after the budget stop)
        assert [(t["lr"], t["steps"], t["passed"]) for t in gate["tries"]] == [
            (1e-3, 3, False), (3e-3, 3, False)]
        assert res["seeds"][0]["judged"] is False and res["seeds"][0]["arms"] == {}
        assert res["metrics"]["judged_seeds"] == 0 and res["metrics"]["single.omega_gap"] is None
  finally:
    del mod.PRESETS["test_nogate"]


@pytest.mark.manual
def test_aha_parts_merge_equal_the_whole_run(tmp_path):
  """AHA `test` preset with a two-value lambda sweep: dense, then the headline window, the other
  lambda and the static control as separate parts, merged == the one-process run (~35 CPU-s).
  Default cover: the Elastic test above (the shared part runner, stores and merge) and
  tests/bench/test_aha_repro.py's CI run (AHA's w16 and static units through --part and
  --merge_parts from the committed dense model)."""
  import dataclasses
  mod = aha_repro
  s = dataclasses.replace(mod.PRESETS["test"], lams=(1e-2, 3e-2))
  mod.PRESETS["test_sweep"] = s
  try:
    whole = _json(mod.run(s, log=lambda *a: None)["seeds"])
    assert mod.units(s, 0) == ["dense", "w16", "w16_lam0.01", "static"]
    work = tmp_path / "w"
    argv = ["--preset=test_sweep", f"--work_dir={work}"]
    with pytest.raises(ValueError, match="_dense.msgpack: missing; run .*--part=dense"):
      mod.main(argv + ["--part=w16"])
    for part in ("dense", "w16_lam0.01,w16", "static"):
      mod.main(argv + [f"--part={part}"])
    res = _merged(mod, "test_sweep", work, tmp_path / "o")
    assert _json(res["seeds"]) == whole
  finally:
    del mod.PRESETS["test_sweep"]


def test_a_part_of_other_settings_is_refused(tmp_path):
  s = elastic_repro.PRESETS["test"]
  st = rc.Store("elastic_repro", "test", s, 0, str(tmp_path))
  st.put("dense", {"x": 1}, 1.0)
  other = rc.Store("elastic_repro", "test", elastic_repro.PRESETS["ci"], 0, str(tmp_path))
  with pytest.raises(ValueError, match="other settings"):
    other.get("dense")
