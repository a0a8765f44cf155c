"""bench.aha_repro --plot: the PNG of a recorded run's headline-arm curves (docs/figures/); a
one-line error naming an unknown run or a run without curves."""
import json
import os

import pytest

from _train_helpers import ROOT

RESULTS = os.path.join(ROOT, "bench", "results", "aha_repro_NVIDIA_H200.json")


def test_plot_draws_every_headline_arm_and_names_a_bad_run(tmp_path):
  from bench import aha_repro, common
  out = aha_repro.main(["--plot=h100_pairs_pre_plateau", f"--plot_from={RESULTS}",
                        f"--out_dir={tmp_path}"])
  assert out == str(tmp_path / "aha_repro_h100_pairs_pre_plateau_curves.png")
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # 5 windows x 3 seeds, each arm's mu_f and accuracy curves
  assert aha_repro.plot_curves(RESULTS, "h100_pairs_pre_plateau", str(tmp_path / "a.png")) == 15
  with pytest.raises(ValueError, match="no run named 'nope'"):
    aha_repro.plot_curves(RESULTS, "nope", str(tmp_path / "x.png"))
  d = common.load(RESULTS)
  run = dict(d["runs"][-1], recorded=dict(d["runs"][-1]["recorded"], seeds=[]))
  empty = tmp_path / "empty.json"
  empty.write_text(json.dumps(dict(d, runs=[run])))
  with pytest.raises(ValueError, match="holds no headline-arm curves"):
    aha_repro.plot_curves(str(empty), run["settings"]["name"], str(tmp_path / "y.png"))
