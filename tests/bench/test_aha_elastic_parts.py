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
  """Elastic `test` preset at one layer (what this checks does not depend on depth; the train
  steps' compiles grow with it) through parts (dense, then the single arm and the static
  control, which reuse the saved dense model; a rerun skips done units) merged == the
  one-process run (every number, curves included). With a gate the dense model cannot reach:
  stopped at its budget after the first check (exit 3, state saved), resumed to the cap, then its
  own lr sweep's second lr to the cap, the seed NOT JUDGED (no arm trained, no criterion judged
  on it), merged == the one-process run."""
  import dataclasses
  mod = elastic_repro
  mod.PRESETS["test_1layer"] = dataclasses.replace(mod.PRESETS["test"], num_layers=1)
  mod.PRESETS["test_nogate"] = dataclasses.replace(mod.PRESETS["test_1layer"], dense_gate=2.0,
                                                   dense_lrs=(1e-3, 3e-3))
  try:
    for preset in ("test_1layer", "test_nogate"):
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
      if preset == "test_1layer":
        assert gate["passed"] and res["metrics"]["judged_seeds"] == 1
        assert res["seeds"][0]["arms"]["single"]["curves"]["accuracy"]
      else:
        assert [c[0] for c in gate["checks"]] == [2, 3] and not gate["passed"]
        # its own lr sweep: both lrs tried to the cap (the first resumed after the budget stop)
        assert [(t["lr"], t["steps"], t["passed"]) for t in gate["tries"]] == [
            (1e-3, 3, False), (3e-3, 3, False)]
        assert res["seeds"][0]["judged"] is False and res["seeds"][0]["arms"] == {}
        assert res["metrics"]["judged_seeds"] == 0 and res["metrics"]["single.omega_gap"] is None
        # the dense unit ran on a GPU call, the NOT JUDGED units (empty) where the later calls
        # ran: the run is recorded where its work ran (unit-seconds), not where most units did
        dense_json = work / "elastic_repro_test_nogate_s0_dense.json"
        d = json.loads(dense_json.read_text())
        dense_json.write_text(json.dumps(dict(d, device="NVIDIA H200", platform="gpu")))
        res = mod.main([f"--preset={preset}", f"--merge_parts={work}",
                        f"--out_dir={tmp_path / 'o_gpu'}"])
        assert (res["device"], res["platform"]) == ("NVIDIA H200", "gpu")
        assert res["units_ran"]["devices"] == {"NVIDIA H200": 1, "cpu": 2}
  finally:
    del mod.PRESETS["test_nogate"], mod.PRESETS["test_1layer"]


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
    with pytest.raises(ValueError, match=r"_s0_dense\.json: missing; run .*--part=dense"):
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


def test_solo_lanes_pack_elastic_h100_into_2_calls_of_the_same_units():
  """bench/aha_elastic_gpu.py --solo_capacity: Elastic h100 on 4 GPUs runs each seed's dense
  model and single arm in one lane alone on its GPU (call 1), the rest in call 2: the same
  units as the 3-call plan, each once, after what it reads; a solo lane is alone on its GPU in
  its call (also beside other runs' lanes) and runs under the solo timeout; shared lanes keep
  the capacity. Without solo_capacity the plan is the 3-call one."""
  import importlib
  from bench import aha_elastic_gpu as gp

  def check(calls, runs, solo_cap, gpus=4, per_gpu=3):
    placed = {}
    for c, lanes in enumerate(calls):
      by_gpu = {}
      for lane in lanes:
        by_gpu.setdefault(lane[0].gpu, []).append(lane)
        assert len({ch.gpu for ch in lane}) == 1 and 0 <= lane[0].gpu < gpus
        cost = sum(ch.cost for ch in lane)
        assert cost <= (solo_cap if any(ch.solo for ch in lane) else 330.0), (c, cost)
        for ch in lane:
          s = importlib.import_module(f"bench.{ch.bench}").PRESETS[ch.preset]
          for j, u in enumerate(ch.units):
            key = (ch.bench, ch.preset, ch.seed, u)
            assert key not in placed, key
            for d in gp.deps(ch.bench, s, u):
              dk = key[:3] + (d,)
              assert (dk in placed and placed[dk] < c) or d in ch.units[:j], (key, d)
            placed[key] = c
      for g, ls in by_gpu.items():
        assert len(ls) <= per_gpu
        if any(ch.solo for lane in ls for ch in lane):
          assert len(ls) == 1, (c, g, [[ch.units for ch in lane] for lane in ls])
    return placed

  runs = (("elastic_repro", "h100"),)
  three = gp.plan(runs)
  two = gp.plan(runs, solo_capacity=420.0)
  assert len(three) == 3 and len(two) == 2
  assert not any(ch.solo for lanes in three for lane in lanes for ch in lane)
  assert set(check(two, runs, 420.0)) == set(check(three, runs, 330.0))
  solo = [lane for lane in two[0] if lane[0].solo]
  assert sorted((lane[0].seed, tuple(lane[0].units)) for lane in solo) == \
      [(s, ("dense", "single")) for s in (0, 1, 2)]
  text = gp.script(two, runs, solo_capacity=420.0)
  assert "--solo_capacity=420" in text.splitlines()[1]
  goes = [l.split() for l in text.splitlines() if l.strip().startswith(("go ", "TIMEOUT="))]
  call1 = [g for g in goes if "go" in g and g[g.index("go") + 1] == "1"]
  assert len(call1) == 3 and all(g[0] == "TIMEOUT=$SOLO_TIMEOUT" for g in call1)
  assert sorted(g[g.index("go") + 3] for g in call1) == ["0", "1", "2"]
  assert f"SOLO_TIMEOUT=${{SOLO_TIMEOUT:-$(( TIMEOUT > {gp.SOLO_TIMEOUT_S}" in text
  # beside another run's lanes, a solo lane still has its GPU to itself
  mixed = (("elastic_repro", "h100"), ("aha_repro", "h100"))
  check(gp.plan(mixed, solo_capacity=420.0), mixed, 420.0)


def test_pairs_pre_plan_runs_its_gated_dense_models_first():
  """`--runs=aha_repro:h100_pairs_pre`: every unit of its 3 seeds once (tiny twin too), the
  gated (pretrained) dense trainings in call 1 with the budget stop."""
  import importlib
  from bench import aha_elastic_gpu as gp
  for tiny in (False, True):
    calls = gp.plan(gp.PRE_RUNS, tiny=tiny)
    preset = gp.TINY["h100_pairs_pre"] if tiny else "h100_pairs_pre"
    s = importlib.import_module("bench.aha_repro").PRESETS[preset]
    got = sorted((ch.seed, u) for lanes in calls for lane in lanes for ch in lane
                 for u in ch.units)
    assert got == sorted((seed, u) for seed in s.seeds for u in aha_repro.units(s, seed))
    first = [ch for lane in calls[0] for ch in lane]
    assert sorted(ch.seed for ch in first if "dense" in ch.units) == list(s.seeds)
    if not tiny:   # the tiny twin's gate is 0 (a dry run): no budget stop
      assert all(f"--dense_budget_s={gp.DENSE_BUDGET_S}" in gp.command(ch) for ch in first)


def test_batched_plan_keeps_every_program_inside_a_call():
  """bench/aha_elastic_gpu.py batched_cost (the until-plateau arms in batched programs): every
  arm of the three AHA presets placed once (33 a preset), every program (arms to the cap) within
  a call, no arm state carried between calls, the dense models' call first; a faster device
  step packs more arms a program and needs fewer calls; more GPUs, fewer calls."""
  from bench import aha_elastic_gpu as gp
  runs = ("h100", "h100_pairs", "h100_pairs_pre")
  slow, fast = (gp.batched_cost(runs, gpus=4, device_ms=ms) for ms in (14.0, 14.0 / 3))
  for c in (slow, fast):
    assert [p["arms"] for p in c["presets"]] == [33, 33, 33]
    assert c["longest_program_s"] <= c["call_s"] and c["state_mib_if_fresh"] == 0.0
    assert c["calls"] == 1 + -(-c["programs"] // 4)
  assert fast["presets"][0]["arms_per_program"] > slow["presets"][0]["arms_per_program"]
  assert fast["calls"] < slow["calls"]
  assert gp.batched_cost(runs, gpus=2, device_ms=14.0)["calls"] > slow["calls"]
