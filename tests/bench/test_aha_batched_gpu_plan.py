"""bench/aha_batched_gpu.sh (issue 34's until-plateau run of an aha_repro preset, arms batched on
4 GPUs): its lanes run with a stand-in for `python -m bench.aha_repro` that records each call and
stores the units the call names, refusing (exit 7) an arm before its seed's dense model and a
static control before its seed's w<smallest>. Checked: every unit of every seed of the real
preset runs exactly once, on its lane's GPU, in an order the units' reads allow, every step exits
0, and `pack` brings back every unit's result; the lanes run as `start`'s daemon, watched by
`watch` to the end, and `watch` where no run was started exits 3 in one line."""
import json
import os
import subprocess
import sys
import tarfile

from _train_helpers import PY, ROOT

STAND_IN = r'''#!{python}
import json, os, sys
if sys.argv[1:3] != ["-m", "bench.aha_repro"]:
  os.execv({real!r}, [{real!r}] + sys.argv[1:])
a = dict(x[2:].split("=", 1) for x in sys.argv[3:])
with open(os.environ["CALLS"], "a") as f:
  f.write(json.dumps(dict(gpu=os.environ["CUDA_VISIBLE_DEVICES"], **a)) + "\n")
unit = lambda s, u: os.path.join(a["work_dir"], f"aha_repro_{{a['preset']}}_s{{s}}_{{u}}.json")
for s in a["seeds"].split(","):
  for u in (a.get("part") or a["arms"]).split(","):
    need = None if u == "dense" else ("w16" if u == "static" else "dense")
    if need and not os.path.exists(unit(s, need)):
      sys.exit(7)
    open(unit(s, u), "w").write("{{}}")
'''


def test_lanes_run_every_unit_once_in_order_and_pack_them(tmp_path):
  from bench import aha_repro
  stand_in = tmp_path / "py"
  stand_in.write_text(STAND_IN.format(python=sys.executable, real=PY))
  stand_in.chmod(0o755)
  env = dict(os.environ, PY=str(stand_in), PRESET="h100_pairs_pre", W=str(tmp_path / "w"),
             OUT=str(tmp_path / "out"), CALLS=str(tmp_path / "calls.jsonl"), POLL_S="0.2",
             PYTHONPATH=ROOT)
  script = os.path.join(ROOT, "bench", "aha_batched_gpu.sh")
  p = subprocess.run(["bash", script, "watch"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=60)   # nothing started here: one line, at once
  assert p.returncode == 3 and p.stdout.count("\n") == 1 and "'start' it again" in p.stdout
  # `start`: `run` as a daemon, then `watch` until every lane is done, then `pack`
  p = subprocess.run(["bash", script, "start"], cwd=ROOT, env=dict(env, WATCH_POLL_S="0.5"),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "all 4 lanes done" in p.stdout, p.stdout + p.stderr
  assert f"packed {3 * 10} unit results" in p.stdout, p.stdout
  logs = "".join(open(tmp_path / "w" / "logs" / f"lane{i}.log").read() for i in range(4))
  ends = [line for line in logs.splitlines() if " end " in line]
  assert len(ends) == 3 + 3 + 2 + 2 and all(line.endswith("rc=0") for line in ends), logs
  calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
  s = aha_repro.PRESETS["h100_pairs_pre"]
  ran = [(int(seed), u, c["gpu"]) for c in calls for seed in c["seeds"].split(",")
         for u in (c.get("part") or c["arms"]).split(",")]
  want = {(seed, u) for seed in s.seeds for u in aha_repro.units(s, seed)}
  assert sorted((seed, u) for seed, u, _ in ran) == sorted(want)  # every unit once
  lane_of = {(seed, u): g for seed, u, g in ran}
  for seed in s.seeds:   # dense, windows, the first lambda unit on the seed's GPU
    assert {lane_of[seed, u] for u in ("dense", "w16", "w256", "w16_lam0.003")} == {str(seed)}
    assert lane_of[seed, "w16_lam0.1"] == "3"   # the other lambda units on GPU 3
  assert [lane_of[seed, "static"] for seed in s.seeds] == ["0", "1", "3"]
  assert all(c["workers"] == "15" for c in calls if "arms" in c)
  p = subprocess.run(["bash", script, "pack"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  with tarfile.open(tmp_path / "out" / "aha_units_h100_pairs_pre.tgz") as tar:
    names = tar.getnames()
  assert sum(n.endswith(".json") for n in names) == len(want) and "logs/lane3.log" in names
