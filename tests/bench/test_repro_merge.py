"""bench/aha_elastic_repro_common.merged_seeds: one-seed runs (one per GPU) judged as one run."""
import pytest

from bench import aha_elastic_repro_common as rc
from bench import common


def _write(path, preset, seeds, settings_extra=None):
  res = dict(settings={"seeds": list(seeds), "seq_len": 64, **(settings_extra or {})},
             seconds=10.0, seeds=[{"seed_marker": s} for s in seeds])
  common.write_result(str(path), "aha_repro", res, name=f"{preset}_seeds{'_'.join(map(str, seeds))}")
  return str(path)


def test_merge_orders_seeds_and_sums_seconds(tmp_path):
  a = _write(tmp_path / "a.json", "h100", [2])
  b = _write(tmp_path / "b.json", "h100", [0, 1])
  seeds, done, seconds = rc.merged_seeds([a, b], "h100")
  assert seeds == [0, 1, 2]
  assert [d["seed_marker"] for d in done] == [0, 1, 2]
  assert seconds == 20.0


def test_merge_refuses_a_repeated_seed_or_other_settings(tmp_path):
  a = _write(tmp_path / "a.json", "h100", [0])
  b = _write(tmp_path / "b.json", "h100", [0])
  with pytest.raises(ValueError, match="seed 0 is already"):
    rc.merged_seeds([a, b], "h100")
  c = _write(tmp_path / "c.json", "h100", [1], {"seq_len": 128})
  with pytest.raises(ValueError, match="settings differ"):
    rc.merged_seeds([a, c], "h100")
  with pytest.raises(ValueError, match="no run of preset 'cpu'"):
    rc.merged_seeds([a], "cpu")
