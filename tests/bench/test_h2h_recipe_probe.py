"""bench/h2h_recipe_probe.py: a variant trains and is scored per task on held-out rows; a round's
verdict follows from its rows, and the registered claim catches a row whose verdict was edited."""
import copy
import json
import os

import pytest

from bench import claims
from bench import common
from bench import eval_head_to_head as h2h
from bench import h2h_recipe_probe as probe


def test_one_variant_trains_and_is_scored_per_task(tmp_path, monkeypatch):
  monkeypatch.setitem(h2h.PRESETS, "h100", dict(h2h.PRESETS["h100"], width=32, layers=1, ffn=64,
                                                heads=2, kv_heads=1, dtype="float32"))
  monkeypatch.setitem(probe.VARIANTS, "toy", dict(seq_len=128, pack=2, lr=1e-3,
                                                  tasks=["niah_single_1"], batch=4))
  monkeypatch.setattr(probe, "RUNS_DIR", str(tmp_path / "runs"))
  probe.one("toy", 120, str(tmp_path), steps=4)
  r = json.load(open(tmp_path / "probe_toy.json"))
  assert r["curve"] and r["curve"][-1][0] == 4
  assert set(r["per_task"]) == {"niah_single_1@64", "niah_single_1@128"}
  assert all(0.0 <= v <= 1.0 for v in r["per_task"].values())
  # the held-out score is the mean over the 4 NIAH tasks: one task alone gives none
  assert probe.niah_score(r) is None


def _write_round(d, scores):
  for n, v in probe.ROUND2.items():
    per = {f"{t}@{v['seq_len'] // v.get('pack', 1)}": scores.get(n, 0.1) for t in probe.NIAH}
    json.dump(dict(variant=n, settings=v, wall_s=1.0, per_task=per,
                   curve=[[100, 0.1, 5.0], [200, 0.2, 4.0]]), open(d / f"probe_{n}.json", "w"))


def test_round_verdict_and_its_claim(tmp_path):
  _write_round(tmp_path, {"niah_p8_lr3e-4": 0.95})
  run = probe.main([f"--record={tmp_path}", "--round=2", "--device=NVIDIA H200",
                    "--commit=abc1234", "--date=2026-11-28T00:00:00+00:00",
                    f"--out_dir={tmp_path}"])
  assert run["recorded"]["qualified"] == ["niah_p8_lr3e-4"]
  assert [c["passed"] for c in run["claims"]] == [True]
  path = common.result_path("h2h_recipe_probe", str(tmp_path), "NVIDIA H200")
  assert common.load(path)["runs"][-1]["recorded"]["verdict"] == "qualified: niah_p8_lr3e-4"
  # a row whose verdict disagrees with its score fails the registered claim
  bad = copy.deepcopy(run)
  bad["rows"][0]["qualifies"] = True
  (c,) = [c for c in claims.CLAIMS if c.bench == "h2h_recipe_probe" and "round2" in c.run]
  with pytest.raises(claims.ClaimFailed):
    c.fn(bad["recorded"], bad)
  c.fn(run["recorded"], run)


def test_dense_log_is_recorded_with_its_best_accuracy(tmp_path):
  """--record_dense: a head-to-head dense pretraining's metrics.jsonl as run h100_preset_dense,
  the best train accuracy re-derived by its claim (which fails once the model learned)."""
  log = tmp_path / "metrics.jsonl"
  log.write_text("".join(json.dumps({"step": s, "train/accuracy": a, "train/ce": 5.0,
                                     "train/grad_norm": 1.0, "train/steps_per_s": 10.0}) + "\n"
                         for s, a in ((50, 0.01), (100, 0.03), (150, 0.02))))
  with pytest.raises(SystemExit, match="--commit is required"):
    probe.main([f"--record_dense={log}", "--device=NVIDIA H200"])
  run = probe.main([f"--record_dense={log}", "--device=NVIDIA H200", "--commit=abc1234",
                    "--date=2026-11-28T00:00:00+00:00", f"--out_dir={tmp_path}"])
  assert run["recorded"]["best_train_accuracy"] == 0.03 and [r["step"] for r in run["rows"]] == [
      50, 100, 150]
  assert [c["passed"] for c in run["claims"]] == [True]
  assert run["recorded"]["verdict"].startswith("did not learn: train answer accuracy <= 0.030")
  (c,) = [c for c in claims.CLAIMS
          if c.bench == "h2h_recipe_probe" and "h100_preset_dense" in c.run]
  learned = copy.deepcopy(run)
  learned["rows"][1]["train_accuracy"] = learned["recorded"]["best_train_accuracy"] = 0.9
  with pytest.raises(claims.ClaimFailed):
    c.fn(learned["recorded"], learned)
