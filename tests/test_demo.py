"""`make demo` works: the tiny model learns MQAR recall on the CPU (the run takes ~1 minute)."""
import glob
import json
import os
import subprocess

import pytest

from _train_helpers import PY, ROOT, subprocess_env


@pytest.mark.slow
def test_demo_learns_recall(tmp_path):
  wd = str(tmp_path / "demo")
  p = subprocess.run([PY, "scripts/demo.py", f"--workdir={wd}"], cwd=ROOT, env=subprocess_env(1),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
  assert "What it learned" in p.stdout and "| 16 (trained) |" in p.stdout
  final = max(glob.glob(os.path.join(wd, "eval", "eval_step*.json")),
              key=lambda f: int(f.split("step")[-1].split(".")[0]))
  res = json.load(open(final))["results"]
  assert res["16"]["token_acc"] > 0.9  # recall, not the ~52% "unused value" plateau
  assert res["32"]["token_acc"] > 0.6  # and it carries over to longer sequences
  start = json.load(open(os.path.join(wd, "eval", "eval_step0.json")))["results"]
  assert start["16"]["token_acc"] < 0.1
