"""A user's first day (issue 27), the programs run as a user runs them (test_cli_errors.cli: a
fork of the CLI runner; the run whose folder turns unwritable mid-run and the TPU-line check in
new interpreters): a checkpoints/ folder that cannot be written (before the first step and in
the middle of a run: one ERROR line, no Orbax wait, what can be kept is kept), the resume after
it (one metrics record per step, a changed config said and kept, the metrics plot), init_from
config.json errors, and the small CLI roughness (--help, a misspelt recipe variant, the TPU
backend line, the eval-on-training-files warning).

The unwritable directory: `chattr +i` when the tests run as root (root ignores mode bits) and
the file system supports it, else chmod 0o555; skipped when neither can stop a write.
"""
import json
import os
import subprocess
import time

import pytest

from _train_helpers import HF, PY, ROOT, subprocess_env
from test_cli_errors import (FAST, LONG, TINY, _steps, _wait_for, assert_user_error, cli,
                             cli_runner_per_module, last_line)  # noqa: F401 (autouse)



def _unwritable(d):
  """Makes directory `d` unwritable to this process; returns the function that undoes it."""
  if os.geteuid() == 0:
    r = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    if r.returncode != 0:
      pytest.skip(f"root without a working chattr +i ({r.stderr.decode().strip()}): cannot make "
                  "a directory unwritable")
    return lambda: subprocess.run(["chattr", "-i", str(d)], check=True)
  os.chmod(d, 0o555)
  return lambda: os.chmod(d, 0o755)


def _probe_unwritable(d) -> bool:
  try:
    os.mkdir(os.path.join(d, "probe"))
  except OSError:
    return True
  os.rmdir(os.path.join(d, "probe"))
  return False


def test_unwritable_checkpoints_refused_before_the_first_step(tmp_path):
  ck = tmp_path / "w" / "checkpoints"
  ck.mkdir(parents=True)
  undo = _unwritable(ck)
  try:
    assert _probe_unwritable(ck)
    t0 = time.time()
    p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w", *FAST)
    elapsed = time.time() - t0
  finally:
    undo()
  assert_user_error(p, f"checkpoint directory {ck} cannot be written", "chattr -i")
  assert elapsed < 60  # no training, no Orbax wait
  assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")  # refused before the first step
  assert not os.path.exists(tmp_path / "w" / "run.lock")


def _records(wd):
  out = []
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    for line in f:
      out.append(json.loads(line))
  return out


@pytest.mark.slow
def test_unwritable_checkpoints_mid_run_stop_at_once_and_the_resume_keeps_one_record_per_step(
    tmp_path):
  """The folder turns unwritable while the run trains (a checkpoint every step): the run stops
  at its next save with ONE line naming the last good checkpoint (no ~300 s Orbax wait, no
  traceback), metrics.jsonl and the plot are kept. Made writable again, the same command with
  another lr resumes from that checkpoint: the change is said and the old config.json kept, the
  records written after the checkpoint are replaced (one per step)."""
  wd = str(tmp_path / "w")
  p = subprocess.Popen([PY, "train.py", f"--config={LONG}", f"--workdir={wd}", *FAST],
                       cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  undo = None
  try:
    ck = os.path.join(wd, "checkpoints")
    _wait_for(lambda: os.path.isdir(ck) and len(_steps(wd)) >= 2, 300, "2 checkpoints", p)
    undo = _unwritable(ck)
    t0 = time.time()
    _, err = p.communicate(timeout=120)
    elapsed = time.time() - t0
  finally:
    if p.poll() is None:
      p.kill()
    if undo is not None:
      undo()

  class P:
    returncode, stderr = p.returncode, err
  line = assert_user_error(P, "cannot save the checkpoint of step", "the run stopped",
                           "Kept: the last good checkpoint is step")
  assert elapsed < 60, elapsed
  assert "orbax" not in err.lower() or "Traceback" not in err
  good = int(line.split("the last good checkpoint is step ")[1].split()[0])
  failed = int(line.split("cannot save the checkpoint of step ")[1].split(",")[0])
  assert good in _steps(wd) and good < failed
  recs = [r["step"] for r in _records(wd) if "train/loss" in r]
  assert recs[-1] == failed  # metrics up to the failed save are kept
  assert os.path.isfile(os.path.join(wd, "metrics.png"))
  assert not os.path.exists(os.path.join(wd, "run.lock"))
  old_config = open(os.path.join(wd, "config.json")).read()

  r = cli("train.py", f"--config={LONG}", f"--workdir={wd}", *FAST, "--config.train.lr=0.001",
          "--stop_after=2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"resuming from step {good} with a changed config (train.lr: 0.003 -> 0.001)" in r.stderr
  assert open(os.path.join(wd, f"config.step{good}.json")).read() == old_config
  assert json.load(open(os.path.join(wd, "config.json")))["train"]["lr"] == 0.001
  steps = [r["step"] for r in _records(wd) if "train/loss" in r]
  assert steps == list(range(1, good + 3)), steps  # one record per step, none after the end
  assert not [n for n in os.listdir(os.path.join(wd, "checkpoints")) if "tmp" in n]


def _hf_copy(tmp_path, edit):
  import shutil
  hf = tmp_path / "hf"
  shutil.copytree(os.path.join(HF, "qwen2"), hf)
  cfg = hf / "config.json"
  cfg.write_text(edit(cfg.read_text()))
  return hf, cfg


def test_init_from_config_json_lacking_keys_or_broken_is_one_line(tmp_path):
  hf, cfg = _hf_copy(tmp_path, lambda t: json.dumps({"model_type": "qwen2"}))
  p = cli("train.py", f"--config={TINY}", "--dry_run", f"--config.model.init_from={hf}")
  assert_user_error(p, str(cfg), "lacks the key(s) vocab_size, hidden_size")
  hf2, cfg2 = _hf_copy(tmp_path / "b", lambda t: t[:len(t) // 2])  # cut inside the object
  p = cli("train.py", f"--config={TINY}", "--dry_run", f"--config.model.init_from={hf2}")
  assert_user_error(p, f"{cfg2} is not valid JSON", "at line", "column")


def test_help_exits_0_and_a_misspelt_variant_lists_the_variants():
  for script in ("train.py", "eval.py"):
    p = cli(script, "--help")
    assert p.returncode == 0, (script, p.stderr[-2000:])
    assert "--workdir" in p.stdout
  p = cli("train.py", "--config=configs/l2a_qwen.py:tinny", "--dry_run")
  assert_user_error(p, "'tinny' is not a variant", "did you mean 'tiny'?", "'qwen2.5-7b'")


def test_no_tpu_backend_line_before_an_error():
  env = subprocess_env(1)
  env.pop("JAX_PLATFORMS")  # jax then probes TPU first, and logs it
  p = subprocess.run([PY, "train.py", f"--config={TINY}", "--dry_run",
                      "--config.data.task.vocab_size=128"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert_user_error(p, "exceeds the model's vocab_size=64")
  assert "libtpu" not in p.stderr and "Unable to initialize backend" not in p.stderr, p.stderr


def test_evaluation_on_the_training_files_is_warned(tmp_path):
  docs = tmp_path / "d.jsonl"
  docs.write_text(json.dumps({"tokens": list(range(1, 60))}) + "\n")
  f = tmp_path / "afile"
  f.write_text("x")
  args = [f"--config={TINY}", f"--workdir={f}", "--config.data.source=jsonl",
          f"--config.data.paths={docs}"]
  p = cli("train.py", *args)
  assert_user_error(p, "is a file")  # stops right after the warning, before any compilation
  assert "data.eval_paths is not set: the evaluation reads the training files" in p.stderr
  p = cli("train.py", *args, f"--config.data.eval_paths={docs}")
  assert "data.eval_paths is not set" not in p.stderr
