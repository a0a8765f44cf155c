"""`make demo` shows conditional attention at work: scripts/demo.py's default (L2A) section, run
here as `make demo` runs it (the other sections: tests/cli/test_demo_sections.py).

Every number checked below is measured by the demo run inside this test (the dense model from
tests/fixtures/l2a/; conversion, the scheme's training, the baselines and the evals run here);
the margins are ones the run can miss. The runs use `--preset=ci` (scripts/demo.py
CI_PRESET: the same claims, fewer steps for phases whose full-run values sit far from the
limits); `make demo` runs the full preset.
"""
import json
import os
import re
import subprocess

import pytest

from _train_helpers import PY, ROOT, assert_l2a_pruning_kv_bytes, subprocess_env
from _test_env import training_env


def _demo(args, timeout=1500):
  """scripts/demo.py as `make demo` runs it, near XLA's default optimisation level
  (tests/conftest.py sets test-only flags, at which the demo's trainings would run slower):
  tests/_test_env.py training_env (cheaper compilations, the same numbers up to float rounding),
  malloc on huge pages (inherited: tests/conftest.py sets GLIBC_TUNABLES for every process the
  suite starts)."""
  return subprocess.run([PY, "scripts/demo.py"] + args, cwd=ROOT,
                        env=training_env(subprocess_env(1)),
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """(workdir, the finished process, its metrics): `make demo`'s command, run once."""
  wd = str(tmp_path_factory.mktemp("demo") / "run")
  p = _demo([f"--workdir={wd}", "--preset=ci"])
  path = os.path.join(wd, "demo_metrics.json")  # written before a failed claim exits 1
  assert os.path.exists(path), (p.stdout[-4000:], p.stderr[-4000:])
  with open(path) as f:
    return wd, p, json.load(f)


@pytest.mark.slow
def test_demo_l2a_claims(demo_run):
  wd, p, m = demo_run
  summary = {k: m[k] for k in ("dense_accuracy", "converted_accuracy", "l2a_accuracy",
                                "l2a_sparsity", "l2a_layer_sparsity", "context_free_accuracy",
                                "context_free_sparsity", "local_only_accuracy")}
  assert m["dense_accuracy"] > 0.95, summary
  # the conversion breaks recall (both branches copied): the accuracy below is learned in the run
  assert m["converted_accuracy"] < 0.2, summary
  assert m["l2a_sparsity"] >= 0.6, summary
  assert min(m["l2a_layer_sparsity"]) >= 0.5, summary
  assert m["l2a_accuracy"] >= m["dense_accuracy"] - 0.03, summary
  # context-free routing at the same sparsity is clearly worse; local attention alone fails
  assert abs(m["context_free_sparsity"] - m["l2a_sparsity"]) < 0.05, summary
  assert m["context_free_accuracy"] <= m["l2a_accuracy"] - 0.2, summary
  assert m["local_only_accuracy"] <= 0.2, summary
  # theta is a knob: higher theta, sparser
  lo, hi = (m["theta_sweep"][str(t)] for t in m["settings"]["thetas"])
  assert hi["sparsity"] > lo["sparsity"], m["theta_sweep"]
  assert_l2a_pruning_kv_bytes(m["settings"], m["l2a_layer_sparsity"], m["pruning"])
  # the demo checks the same claims itself (exit code 1 when one fails)
  assert all(c["ok"] for c in m["claims"]), m["claims"]
  assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])


@pytest.mark.slow
def test_demo_l2a_prints_this_runs_numbers(demo_run):
  wd, p, m = demo_run
  out = p.stdout
  pct = lambda x: f"{100 * x:.1f}%"
  # the side-by-side table, from this run's metrics
  assert f"| dense (full attention) | {pct(m['dense_accuracy'])} | 0.0% |" in out
  assert f"| {pct(m['l2a_accuracy'])} | {pct(m['l2a_sparsity'])} |" in out
  assert (f"| context-free routing, same sparsity | {pct(m['context_free_accuracy'])} | "
          f"{pct(m['context_free_sparsity'])} |") in out
  assert f"| {pct(m['local_only_accuracy'])} | 100.0% |" in out
  for t in m["settings"]["thetas"]:
    assert f"L2A, theta {t}" in out
  # one text bar per layer, its length the layer's sparsity
  for i, x in enumerate(m["l2a_layer_sparsity"]):
    bar = re.search(rf"layer {i} \|([#.]+)\| {re.escape(pct(x))}", out)
    assert bar, (i, out)
    assert bar.group(1).count("#") == round(30 * x)
  assert "KV cache" in out and "131072 tokens: dense" in out
  assert f"Verdict: {m['verdict']}" in out
  assert m["verdict"].startswith(f"L2A skips global attention for {pct(m['l2a_sparsity'])} of "
                                 "tokens and ")
  # files written and named, commands for a real checkpoint
  png = os.path.join(wd, "l2a_layer_sparsity.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.join(wd, "demo_metrics.json") in out and png in out
  assert "python train.py --config=configs/l2a_qwen.py" in out
  assert "python eval.py --checkpoint=DIR --config.model.scheme.theta=" in out
  run = m["run"]
  assert run["wall_seconds"] > 0 and run["cpu_seconds"] > 0 and "loadavg_start" in run


def test_demo_unknown_scheme_is_one_line(tmp_path):
  p = _demo([f"--workdir={tmp_path / 'x'}", "--scheme=nope"], timeout=300)
  assert p.returncode == 2, p.stderr
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("ERROR: --scheme=nope") and "'l2a'" in last, p.stderr
  assert "Traceback" not in p.stderr
