"""bench/scale.py (issue 30's two-GPU scale-out bench) on CPU with its tiny shapes (bench/e2e.py's
TINY, here at one layer: the runs compare layouts, which depth does not change; the compiled
steps grow with it): the L2A step on 1 device and sequence-parallel on 2 fake devices gives the
same first-step loss, the run records rows, scaling efficiency and the loss claims; `summarize`
fails a claim on a loss that moved and judges the 128K goal only on its own row."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import scale  # noqa: E402


@pytest.fixture
def one_layer(monkeypatch):
  """--tiny's shapes (bench/e2e.py's TINY, read when a row is configured) at one layer."""
  monkeypatch.setitem(scale.e2e.TINY, "num_layers", 1)


@pytest.mark.slow
def test_tiny_run_on_two_cpu_devices(tmp_path, one_layer):
  assert scale.main(["--tiny", "--T=32", "--schemes=l2a", "--layouts=one,sequence",
                     "--devices=2", "--reps=1", "--inprocess", f"--out_dir={tmp_path}"]) == 0
  (path,) = tmp_path.glob("scale_*.json")
  run = json.loads(path.read_text())["runs"][-1]
  one, seq = run["rows"]
  assert (one["layout"], one["devices"], seq["layout"], seq["devices"]) == ("one", 1, "sequence", 2)
  assert seq["mesh"] == {"data": 1, "fsdp": 1, "sequence": 2, "tensor": 1}
  assert seq["loss_rel_diff"] < 1e-2 and seq["scaling_efficiency"] > 0
  assert seq["tokens_per_s_per_device"] == pytest.approx(seq["tokens_per_s"] / 2)
  assert [c["passed"] for c in run["claims"]] == [True]
  assert run["recorded"]["goal"]["efficiency"] is None  # the goal is the 128K x2 row only


def test_summarize_fails_a_moved_loss_and_judges_the_goal_row():
  row = lambda layout, dev, loss, tps: dict(T=131072, scheme="l2a", layout=layout, devices=dev,
                                            loss=loss, tokens_per_s_per_device=tps)
  rows, claims, goal = scale.summarize([row("one", 1, 10.0, 100.0), row("sequence", 2, 10.05, 90.0),
                                        row("data", 2, 10.5, 99.0)], loss_rtol=2e-2)
  assert [r.get("scaling_efficiency") for r in rows] == [None, 0.9, 0.99]
  assert list(claims.values()) == [True, False]
  assert goal["efficiency"] == 0.9 and goal["met"]


def test_plan_rows_from_flags_and_refuses_a_bad_item():
  a = scale.common.parse_flags(scale.FLAGS, ["--plan=131072:l2a:one,131072:l2a:sequence:4,"
                                             "32768:dense:data"])
  rows = scale.plan(a, n_all=2)
  assert [(r["T"], r["scheme"], r["layout"], scale.row_devices(r)) for r in rows] == [
      (131072, "l2a", "one", 1), (131072, "l2a", "sequence", 4), (32768, "dense", "data", 2)]
  a = scale.common.parse_flags(scale.FLAGS, ["--T=64", "--schemes=l2a", "--layouts=sequence",
                                             "--devices=2,4"])
  assert [(r["layout"], scale.row_devices(r)) for r in scale.plan(a, n_all=4)] == [
      ("one", 1), ("sequence", 2), ("sequence", 4)]
  a = scale.common.parse_flags(scale.FLAGS, ["--plan=131072:l2a:zigzag"])
  with pytest.raises(SystemExit, match="want T:scheme:layout"):
    scale.plan(a, n_all=2)


@pytest.mark.slow
def test_recipe_rows_compare_every_step(tmp_path, one_layer):
  """--model=7b_recipe (configs/l2a_qwen.py's L2A recipe: learned routing, forced-global steps,
  its trainable subset; tiny shapes here) over 2 training steps of 2 fresh rows each: sequence 4
  and fsdp 2 x sequence 2 give the same loss at every step, the dry run's peak is on the row."""
  assert scale.main(["--model=7b_recipe", "--tiny", "--T=32", "--steps=2", "--rows=2",
                     "--plan=32:l2a:sequence:4,32:l2a:seqfsdp:4", "--inprocess",
                     f"--out_dir={tmp_path}"]) == 0
  (path,) = tmp_path.glob("scale_*.json")
  run = json.loads(path.read_text())["runs"][-1]
  seq, sf = run["rows"]
  assert seq["mesh"] == {"data": 1, "fsdp": 1, "sequence": 4, "tensor": 1}
  assert sf["mesh"] == {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 1}
  assert (seq["rows"], len(seq["losses"]), seq["model"]) == (2, 2, "7b_recipe")
  assert seq["losses"][0] != seq["losses"][1]  # a fresh batch and an update each step
  assert sf["steps_reference"] == "sequence x4" and sf["steps_rel_diff"] < 2e-3
  assert seq["predicted_peak_bytes"] > 0
  assert [c["passed"] for c in run["claims"]] == [True]
  assert "qwen2.5-7b recipe" in run["settings"]["model"]


def test_summarize_fails_a_step_loss_that_moved():
  row = lambda layout, losses: dict(T=131072, scheme="l2a", layout=layout, devices=4,
                                    model="7b_recipe", losses=losses, loss=losses[0])
  rows, claims, _ = scale.summarize([row("sequence", [10.0, 9.0]), row("seqfsdp", [10.0, 9.01])],
                                    loss_rtol=2e-2, steps_rtol=2e-3)
  assert rows[1]["steps_rel_diff"] == pytest.approx(0.01 / 9.0)
  assert list(claims.values()) == [True]
  rows, claims, _ = scale.summarize([row("sequence", [10.0, 9.0]), row("seqfsdp", [10.0, 9.03])],
                                    loss_rtol=2e-2, steps_rtol=2e-3)
  assert list(claims.values()) == [False]
