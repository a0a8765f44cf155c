"""bench.aha_repro --plot: the PNG of a recorded run's headline-arm curves (docs/figures/), and a
one-line error naming an unknown run."""
import os

import pytest

from _train_helpers import ROOT

RESULTS = os.path.join(ROOT, "bench", "results", "aha_repro_NVIDIA_H200.json")


def test_plot_draws_a_recorded_run_and_names_an_unknown_one(tmp_path):
  from bench import aha_repro
  out = aha_repro.main(["--plot=h100_pairs_pre_plateau", f"--plot_from={RESULTS}",
                        f"--out_dir={tmp_path}"])
  assert out == str(tmp_path / "aha_repro_h100_pairs_pre_plateau_curves.png")
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(out) > 20_000   # 15 curves a panel, two panels
  with pytest.raises(ValueError, match="no run named 'nope'"):
    aha_repro.plot_curves(RESULTS, "nope", str(tmp_path / "x.png"))
