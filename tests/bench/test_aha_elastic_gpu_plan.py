"""bench/aha_elastic_gpu.py: the H100 plan of the AHA / Elastic reproductions runs every unit of
every seed once, each after the units it reads, in lanes of at most the capacity (<= per_gpu a
GPU), in 3 calls on 4 GPUs (6 on 2, within the carry budget); the committed scripts are the
plans'. The CPU dry run of the whole script (tiny
presets, every call and the merge) is the manual test below (default cover: this file's plan
checks and tests/bench/test_aha_elastic_parts.py, which runs parts and merges them)."""
import importlib
import os
import subprocess

import pytest

from bench import aha_elastic_gpu as gp
from bench import common
from _train_helpers import PY, ROOT


def _check(calls, tiny, capacity, gpus=4, per_gpu=3, runs=gp.RUNS, carry_mib=None):
  placed = {}
  units = {}
  for bench, preset in runs:
    p = gp.TINY.get(preset, preset) if tiny else preset
    s = importlib.import_module(f"bench.{bench}").PRESETS[p]
    for seed in s.seeds:
      units[(bench, p, seed)] = importlib.import_module(f"bench.{bench}").units(s, seed)
  for c, lanes in enumerate(calls):
    assert len(lanes) <= gpus * per_gpu
    for lane in lanes:
      assert sum(ch.cost for ch in lane) <= capacity
      for ch in lane:
        s = importlib.import_module(f"bench.{ch.bench}").PRESETS[ch.preset]
        for j, u in enumerate(ch.units):
          key = (ch.bench, ch.preset, ch.seed, u)
          assert key not in placed, key                         # once
          for d in gp.deps(ch.bench, s, u):                     # after what it reads
            dk = (ch.bench, ch.preset, ch.seed, d)
            assert (dk in placed and placed[dk] < c) or d in ch.units[:j], (key, d)
          placed[key] = c
    if carry_mib is not None:   # dense models held for later calls fit the carry
      held = sum(gp._tree_mib(b, tiny) for (b, p, seed), us in units.items()
                 if (b, p, seed, "dense") in placed
                 and any((b, p, seed, u) not in placed for u in us))
      assert held <= carry_mib, (c, held)
  want = set()
  for bench, preset in runs:
    p = gp.TINY.get(preset, preset) if tiny else preset
    s = importlib.import_module(f"bench.{bench}").PRESETS[p]
    want |= {(bench, p, seed, u) for seed in s.seeds
             for u in importlib.import_module(f"bench.{bench}").units(s, seed)}
  assert set(placed) == want                                     # every unit


def test_h100_plan_runs_every_unit_once_after_its_inputs_in_3_calls():
  calls = gp.plan()
  _check(calls, False, 330.0)
  assert len(calls) == 3
  with open(os.path.join(ROOT, "bench", "aha_elastic_h100.sh")) as f:
    assert f.read() == gp.script(calls), "rewrite: python -m bench.aha_elastic_gpu " \
                                         "--write=bench/aha_elastic_h100.sh"
  _check(gp.plan(tiny=True), True, 330.0)
  _check(gp.plan(capacity=300.0, per_gpu=2), False, 300.0, per_gpu=2)
  with pytest.raises(RuntimeError, match="raise capacity"):
    gp.plan(capacity=250.0)          # the Elastic dense model alone is 300


def test_x2_plan_finishes_elastic_first_and_fits_the_carry():
  """Two GPUs, a fresh machine a call: Elastic's run is whole after call 3, the dense models
  held between calls fit the carry budget, and the committed x2 script is the plan's (it
  unpacks $IN, packs the unit results and the held trees to $OUT)."""
  calls = gp.plan(gp.RUNS_FEW, gpus=2, carry_mib=gp.CARRY_MIB)
  _check(calls, False, 330.0, gpus=2, runs=gp.RUNS_FEW, carry_mib=gp.CARRY_MIB)
  assert len(calls) == 6
  elastic = {c for c, lanes in enumerate(calls) for lane in lanes for ch in lane
             if ch.bench == "elastic_repro"}
  assert max(elastic) == 2
  with open(os.path.join(ROOT, gp.SCRIPTS[2])) as f:
    text = f.read()
  assert text == gp.script(calls, gp.RUNS_FEW, gpus=2), \
      "rewrite: python -m bench.aha_elastic_gpu --gpus=2 --write=bench/aha_elastic_x2.sh"
  assert "unpack" in text and "--carry=" in text and "split -b 15m" in text
  # without the budget, the first calls would hold more than it
  free = gp.plan(gp.RUNS_FEW, gpus=2)
  with pytest.raises(AssertionError):
    _check(free, False, 330.0, gpus=2, runs=gp.RUNS_FEW, carry_mib=gp.CARRY_MIB)


@pytest.mark.manual
def test_tiny_script_dry_run(tmp_path):
  """The whole script on the tiny presets on this CPU (lanes one after another, every call,
  then the merges): every lane exits 0 and every preset's merged run is written with passing
  claims (its pre-registered verdicts may fail: tiny models)."""
  sh = tmp_path / "tiny.sh"
  subprocess.run([PY, "-m", "bench.aha_elastic_gpu", "--tiny", f"--write={sh}"], cwd=ROOT,
                 check=True)
  env = dict(os.environ, W=str(tmp_path / "w"), OUT=str(tmp_path / "out"), PY=PY, SERIAL="1",
             TIMEOUT="1800")
  p = subprocess.run(["bash", str(sh), "all"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=3600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  lanes = [l for l in p.stdout.splitlines() if l.startswith("call ")]
  assert lanes and all("rc=0" in l for l in lanes), lanes
  for bench, name in (("aha_repro", "tiny"), ("aha_repro", "tiny_pairs"),
                      ("elastic_repro", "tiny")):
    runs = common.load(common.result_path(bench, str(tmp_path / "out")))["runs"]
    (run,) = [r for r in runs if r["settings"]["name"] == name]
    assert run["claims"] and all(c["passed"] for c in run["claims"])
  assert (tmp_path / "out" / "aha_elastic_units.tgz").exists()


def test_carry_keeps_finished_dense_models_first_within_the_budget(tmp_path):
  """The pack's --carry list on a work dir like the one-GPU call 1 left (Elastic seed 0 cut with
  two sweep states, seeds 1-2 dense done, AHA dense done): within the budget the finished dense
  models come first and a cut training's states go all together or not at all (named on the
  log), so the pack never outgrows what the device tool returns; without a budget, all."""
  def f(name, mib):
    (tmp_path / name).write_bytes(b"\0" * int(mib * 2**20))
  f("elastic_repro_h100_s0_dense_state_lr0.pkl", 6)
  f("elastic_repro_h100_s0_dense_state_lr1.pkl", 6)
  for s in (1, 2):
    f(f"elastic_repro_h100_s{s}_dense.msgpack", 3)
  for s in (0, 1, 2):
    f(f"aha_repro_h100_s{s}_dense.msgpack", 1)
  runs = (("elastic_repro", "h100"), ("aha_repro", "h100"))
  everything = gp.carry(str(tmp_path), runs)
  assert len(everything) == 7
  logged = []
  kept = gp.carry(str(tmp_path), runs, budget_mib=10, log=logged.append)
  assert kept == ["elastic_repro_h100_s1_dense.msgpack", "elastic_repro_h100_s2_dense.msgpack",
                  "aha_repro_h100_s0_dense.msgpack", "aha_repro_h100_s1_dense.msgpack",
                  "aha_repro_h100_s2_dense.msgpack"]
  assert len(logged) == 1 and "dense_state_lr0.pkl" in logged[0] and "lr1" in logged[0]
  roomy = gp.carry(str(tmp_path), runs, budget_mib=30, log=logged.append)
  assert sorted(roomy) == sorted(everything) and len(logged) == 1


def test_pairs_gated_plan_runs_only_its_units_and_its_script_is_the_plans():
  """`--runs=aha_repro:h100_pairs_gated` (outside the default plan): every unit of its 3 seeds
  once, after what it reads; each gated dense training in a lane of its own in call 1, with the
  budget stop (--dense_budget_s: exit 3, rerun goes on); the committed 4-GPU script is the
  plan's; the default plans are unchanged (the tests above)."""
  runs = gp.EXTRA_RUNS
  calls = gp.plan(runs)
  _check(calls, False, 330.0, runs=runs)
  _check(gp.plan(runs, tiny=True), True, 330.0, runs=runs)
  dense = [lane for lane in calls[0] if any("dense" in ch.units for ch in lane)]
  assert len(dense) == 3 and all(len(lane) == 1 and lane[0].units == ["dense"]
                                 for lane in dense)
  assert all(f"--dense_budget_s={gp.DENSE_BUDGET_S}" in gp.command(lane[0]) for lane in dense)
  assert {ch.preset for lanes in calls for lane in lanes for ch in lane} == {"h100_pairs_gated"}
  with open(os.path.join(ROOT, gp.PAIRS_GATED_SCRIPT)) as f:
    assert f.read() == gp.script(calls, runs), \
        "rewrite: python -m bench.aha_elastic_gpu --runs=aha_repro:h100_pairs_gated " \
        f"--write={gp.PAIRS_GATED_SCRIPT}"
  with pytest.raises(SystemExit, match="not in"):
    gp.main(["--runs=aha_repro:nope"])


def test_need_plan_places_the_need_unit_after_the_dense_model():
  """Elastic's need design on 2 GPUs (`--runs=elastic_repro:h100_need`): every unit once, each
  after what it reads, within the carry; the need unit (recall of frozen static splits) reads
  only the dense model and has its own cost; its tiny twin is the dry run's."""
  runs = gp.NEED_RUNS
  calls = gp.plan(runs, gpus=2, carry_mib=gp.CARRY_MIB)
  _check(calls, False, 330.0, gpus=2, runs=runs, carry_mib=gp.CARRY_MIB)
  assert len(calls) == 3
  need = [ch for lanes in calls for lane in lanes for ch in lane if "need" in ch.units]
  assert len(need) == 3 and all(ch.cost == gp.COST["elastic_repro"]["need"] for ch in need)
  _check(gp.plan(runs, tiny=True, gpus=2), True, 330.0, gpus=2, runs=runs)
  s = importlib.import_module("bench.elastic_repro").PRESETS["h100"]
  assert "need" not in importlib.import_module("bench.elastic_repro").units(s, 0)
  assert gp.main(["--gpus=2", "--runs=elastic_repro:h100_need", "--print"])


def test_plateau_cost_counts_every_arm_and_scales_with_the_cap():
  """The until-plateau re-run estimate: one arm per learned unit (windows + lambda sweep, as
  aha_repro.units lists them) and per static lr; its cost grows with the steps (the cap by
  default), and at the cap an h100 arm no longer fits one lane (it spans calls)."""
  from bench import aha_elastic_gpu as g
  from bench import aha_repro
  s = aha_repro.PRESETS["h100"]
  learned = sum(len([u for u in aha_repro.units(s, seed) if u not in ("dense", "static")])
                for seed in s.seeds)
  cap = g.plateau_cost("h100")
  rec = g.plateau_cost("h100", steps=s.aha_steps)
  assert cap["learned"] == learned and cap["static"] == len(s.seeds) * len(s.static_lrs)
  assert cap["steps"] == s.aha_cap and rec["steps"] == s.aha_steps
  assert cap["alone_s"] > 4 * rec["alone_s"] and cap["calls"] >= 4 * rec["calls"] - 3
  assert cap["arm_s"] > 330.0 > rec["arm_s"]


def test_plan_warns_that_its_estimates_are_the_fixed_recipes_under_the_rule(capsys):
  """A plan of AHA presets under the until-plateau rule warns (its COST is the fixed recipe's);
  the tiny dry run's does not; --plateau_cost prints the estimate at the recipe and the cap."""
  from bench import aha_elastic_gpu as g
  g.main(["--gpus=2", "--print", "--runs=aha_repro:h100"])
  assert "WARNING aha_repro:h100 trains every arm until plateau" in capsys.readouterr().err
  g.main(["--gpus=2", "--print", "--tiny", "--runs=aha_repro:h100"])
  assert "WARNING" not in capsys.readouterr().err
  out = g.main(["--gpus=2", "--plateau_cost", "--runs=aha_repro:h100"])
  assert [c["steps"] for c in out] == [1500, 12000]
