"""train.py / eval.py as a user runs them: every bad input is ONE line (the last line of stderr,
starting with ERROR:) naming the problem, exit code 2 and no traceback; Ctrl-C saves like
SIGTERM and a second Ctrl-C exits at once; one run per workdir; corrupt checkpoints are skipped;
a non-finite step never reaches a checkpoint.

Every case is a program run as `python <script> <args>` runs it (`cli`: a fork of one process
that imported the programs' modules once, tests/_cli_runner.py; `cli_process`: a new interpreter,
for the runs that take signals and for each program's entry point). To stay fast, most fail
before any compilation, and the cases that need a trained run share ONE run (`run1`: started,
refused a second run, Ctrl-C'd) and copy its workdir.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from _cli_runner import Runner
from _train_helpers import HF, PY, ROOT, subprocess_env

TINY = "configs/tiny.py"
L2A = "configs/l2a_qwen.py"
# Fast settings for the runs that train: no eval, a metrics line and a checkpoint every step.
FAST = ["--config.train.log_every=1", "--config.train.checkpoint_every=1",
        "--config.train.keep_checkpoints=3", "--config.train.progress_bar=False",
        "--config.eval.at_end=False"]
LONG = f"{TINY}:steps=100000"


RUNNER = Runner(subprocess_env(1))


def cli(*args, timeout=300):
  """`python *args` in the repo root, 1 CPU device (a fork of RUNNER's process)."""
  return RUNNER.run(*args, timeout=timeout)


def cli_process(*args, timeout=300):
  """The same in a new interpreter: the program's start as a user's shell starts it."""
  return subprocess.run([PY, *args], cwd=ROOT, env=subprocess_env(1), capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def cli_runner_per_module():
  """RUNNER's process ends with each module that uses `cli` (its CPU time counts in the module)."""
  yield
  RUNNER.close()


def last_line(p) -> str:
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  return lines[-1] if lines else ""


def assert_user_error(p, *needles, code=2):
  """Exit code, no traceback, and the last stderr line is the ERROR line naming the problem."""
  tail = p.stderr[-3000:]
  assert p.returncode == code, (p.returncode, tail)
  assert "Traceback" not in p.stderr, tail
  line = last_line(p)
  assert line.startswith("ERROR: "), tail
  for n in needles:
    assert n in line, (n, line)
  return line


# ------------------------------------------------------------------ fail before any training
def test_missing_recipe_file():
  p = cli_process("train.py", "--config=configs/nope.py", "--workdir=/tmp/unused_condattn")
  assert_user_error(p, "configs/nope.py does not exist")


def test_unknown_override_lists_valid_fields():
  p = cli("train.py", f"--config={TINY}", "--config.train.bogus=1", "--workdir=/tmp/unused")
  assert_user_error(p, "unknown config field 'config.train.bogus'", "num_steps")


def test_real_recipe_names_required_fields_in_the_order_the_run_needs_them():
  # dry run: only the model is needed
  p = cli("train.py", f"--config={L2A}:qwen2.5-1.5b", "--dry_run")
  line = assert_user_error(p, "--config.model.init_from=<Qwen2.5-1.5B checkpoint directory>")
  assert "data." not in line
  # data.paths (None in older recipes) is settable from the command line; model.init_from is
  # still named first, then the tokenizer
  p = cli("train.py", f"--config={L2A}:qwen2.5-1.5b", "--workdir=/tmp/unused",
          "--config.data.paths=/data/long/*.jsonl")
  line = assert_user_error(p, "model.init_from", "data.tokenizer")
  assert line.index("model.init_from") < line.index("data.tokenizer") and "data.paths" not in line


def test_eval_lengths_checked_before_training(tmp_path):
  p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w",
          "--config.train.loss_chunk_size=32", "--config.eval.context_lengths=(64,80)")
  assert_user_error(p, "context_lengths has 80", "loss_chunk_size=32")
  assert not os.path.exists(tmp_path / "w" / "config.json")


def test_debug_shows_the_traceback(tmp_path):
  p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w", "--debug",
          "--config.train.loss_chunk_size=32", "--config.eval.context_lengths=(80,)")
  assert p.returncode == 2 and "Traceback" in p.stderr and "validate_config" in p.stderr
  assert last_line(p).startswith("ERROR: ") and "context_lengths has 80" in last_line(p)


def test_workdir_that_is_a_file(tmp_path):
  f = tmp_path / "afile"
  f.write_text("x")
  p = cli("train.py", f"--config={TINY}", f"--workdir={f}")
  assert_user_error(p, str(f), "is a file")
  p = cli("train.py", f"--config={TINY}", f"--workdir={f}/sub")
  assert_user_error(p, "is a file")


def test_read_only_workdir_is_named(tmp_path, monkeypatch):
  """A workdir this user cannot write (root ignores mode bits, so the denial is simulated at
  os.access / os.makedirs, the calls prepare() makes) is a PermissionError naming the path, which
  the CLI prints as one line (exit 2: PermissionError is an OSError user error)."""
  from condattn_jax.train import workdir as workdir_lib
  ro = tmp_path / "ro"
  ro.mkdir()
  monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != str(ro))
  with pytest.raises(PermissionError, match=f"{ro} is not writable"):
    workdir_lib.prepare(str(ro))

  def denied(path, *a, **k):
    raise PermissionError(13, "Permission denied", str(path))
  monkeypatch.setattr(os, "makedirs", denied)
  with pytest.raises(PermissionError, match=f"cannot create {ro}/sub: permission denied"):
    workdir_lib.prepare(str(ro / "sub"))


def test_synthetic_vocab_larger_than_model():
  p = cli("train.py", f"--config={TINY}", "--dry_run", "--config.data.task.vocab_size=128")
  assert_user_error(p, "data.task.vocab_size=128 exceeds the model's vocab_size=64")


def test_mesh_larger_than_the_machine():
  p = cli("train.py", f"--config={TINY}", "--dry_run", "--config.mesh.fsdp=1",
          "--config.mesh.tensor=2")
  assert_user_error(p, "needs 2 devices, but 1 are available")


def test_tokenizer_larger_than_model(tmp_path):
  docs = tmp_path / "d.jsonl"
  docs.write_text(json.dumps({"text": "hello world"}) + "\n")
  p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w", "--config.data.source=jsonl",
          f"--config.data.paths={docs}", "--config.data.tokenizer=tests/fixtures/tokenizer/qwen")
  assert_user_error(p, "the tokenizer", "tokens but the model's vocab_size is 64")


def test_malformed_jsonl_line_is_named(tmp_path):
  docs = tmp_path / "docs.jsonl"
  good = json.dumps({"tokens": list(range(1, 60))})
  docs.write_text("\n".join([good, good, '{"tokens": [1, 2,', good]) + "\n")
  # data.separator_id is None in the defaults: settable from the command line all the same
  p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w", "--config.data.source=jsonl",
          f"--config.data.paths={docs}", "--config.data.separator_id=1",
          "--config.data.batch_size=4", "--config.eval.at_end=False")
  assert_user_error(p, f"{docs}:3: not valid JSON", "data.on_bad_record=skip")


def test_truncated_hf_checkpoint_is_named(tmp_path):
  hf = tmp_path / "hf"
  shutil.copytree(os.path.join(HF, "qwen2"), hf)
  st = hf / "model.safetensors"
  os.truncate(st, os.path.getsize(st) // 2)
  p = cli("train.py", f"--config={TINY}", f"--workdir={tmp_path}/w", f"--config.model.init_from={hf}")
  assert_user_error(p, f"{st} is truncated")


def test_eval_checkpoint_errors(tmp_path):
  p = cli_process("eval.py", f"--checkpoint={tmp_path}/nope")
  assert_user_error(p, f"{tmp_path}/nope does not exist")
  f = tmp_path / "afile"
  f.write_text("x")
  p = cli("eval.py", f"--checkpoint={f}")
  assert_user_error(p, f"{f} is a file")
  # --config and --workdir (the run directory) instead of --checkpoint
  p = cli("eval.py", f"--config={TINY}", f"--workdir={tmp_path}/none")
  assert_user_error(p, f"{tmp_path}/none", "does not exist")


# ------------------------------------------------------------------- one shared trained run
def _wait_for(pred, timeout, what, proc=None):
  t0 = time.time()
  while time.time() - t0 < timeout:
    if pred():
      return
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}: "
                           f"{proc.stderr.read()[-3000:]}")
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}")


def _metric_lines(wd) -> int:
  try:
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def _steps(wd) -> list[int]:
  d = os.path.join(wd, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit())


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
  """A long tiny run: a second run on its workdir is refused while it trains, then Ctrl-C saves
  a checkpoint and stops it. Returns what happened (the workdir is reused by the tests below)."""
  wd = str(tmp_path_factory.mktemp("run1") / "w")
  p1 = subprocess.Popen([PY, "train.py", f"--config={LONG}", f"--workdir={wd}", *FAST],
                        cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(lambda: _metric_lines(wd) >= 3, 300, "3 training steps", p1)
    lock = json.load(open(os.path.join(wd, "run.lock")))
    second = cli("train.py", f"--config={LONG}", f"--workdir={wd}", "--config.train.lr=0.1", *FAST)
    config_during = json.load(open(os.path.join(wd, "config.json")))
    assert p1.poll() is None, "the first run must still be training"
    p1.send_signal(signal.SIGINT)
    out, err = p1.communicate(timeout=120)
  finally:
    if p1.poll() is None:
      p1.kill()
  return dict(wd=wd, lock=lock, pid=p1.pid, rc=p1.returncode, stderr=err, second=second,
              config_during=config_during)


def test_second_run_on_a_busy_workdir_is_refused(run1):
  assert run1["lock"]["pid"] == run1["pid"] and run1["lock"]["host"]
  assert_user_error(run1["second"], f"workdir {run1['wd']} is in use by another run",
                    f"pid {run1['pid']}")
  assert run1["config_during"]["train"]["lr"] == 3e-3  # not the refused run's lr


def test_ctrl_c_saves_and_stops(run1):
  assert run1["rc"] == 0, run1["stderr"][-3000:]
  assert "Traceback" not in run1["stderr"]
  assert "Ctrl-C: saving a checkpoint after this step" in run1["stderr"]
  # orbax's INFO chatter (one block per save, every step here) is hidden by default
  assert "checkpoint_manager.py" not in run1["stderr"] and "async_checkpointer" not in run1["stderr"]
  line = last_line(dict_proc(run1))
  assert "stopped at step" in line and "re-run the same command to resume" in line
  stopped = int(line.split("stopped at step ")[1].split()[0])
  assert _steps(run1["wd"])[-1] == stopped
  assert not os.path.exists(os.path.join(run1["wd"], "run.lock"))


def dict_proc(r):
  class P:  # last_line() on a recorded stderr
    stderr = r["stderr"]
  return P


def _copy(run1, tmp_path) -> str:
  wd = str(tmp_path / "w")
  shutil.copytree(run1["wd"], wd)
  return wd


def _truncate_params(wd, step):
  d = os.path.join(wd, "checkpoints", str(step), "params")
  files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if "/d/" in os.path.join(r, f)]
  big = max(files, key=os.path.getsize)
  os.truncate(big, os.path.getsize(big) // 2)


def test_resume_with_another_model_fails_and_keeps_config_json(run1, tmp_path):
  wd = _copy(run1, tmp_path)
  before = open(os.path.join(wd, "config.json")).read()
  p = cli("train.py", f"--config={LONG}", f"--workdir={wd}", "--config.model.num_layers=3", *FAST)
  assert_user_error(p, "does not match the model of this config")
  assert open(os.path.join(wd, "config.json")).read() == before
  assert not os.path.exists(os.path.join(wd, "run.lock"))


def test_eval_skips_a_corrupt_newest_checkpoint_and_records_knobs(run1, tmp_path):
  wd = _copy(run1, tmp_path)
  steps = _steps(wd)
  _truncate_params(wd, steps[-1])
  # --config.* overrides with --checkpoint (no --config): applied to the saved config
  p = cli("eval.py", f"--checkpoint={wd}", "--config.eval.num_batches=1",
          "--config.eval.context_lengths=(64,)")
  assert p.returncode == 0, p.stderr[-3000:]
  assert "Traceback" not in p.stderr
  assert f"{wd}/checkpoints/{steps[-1]}" in p.stderr and "skipping checkpoint" in p.stderr
  name = f"eval_step{steps[-2]}_context_lengths=64_num_batches=1.json"
  res = json.load(open(os.path.join(wd, "eval", name)))
  assert res["step"] == steps[-2] and res["knobs"]["eval"]["num_batches"] == 1
  # an unknown knob for this scheme: one line listing the valid fields
  p = cli("eval.py", f"--checkpoint={wd}", "--config.model.scheme.theta=0.7")
  assert_user_error(p, "unknown config field 'config.model.scheme.theta'", "['name']")
  # nothing readable at all
  for s in steps[:-1]:
    _truncate_params(wd, s)
  p = cli("eval.py", f"--checkpoint={wd}")
  assert_user_error(p, "no readable checkpoint in", f"{wd}/checkpoints/{steps[0]}")


def test_resume_skips_corrupt_and_nonfinite_never_reaches_a_checkpoint(run1, tmp_path):
  """Resume over a truncated newest checkpoint (skipped, moved to <step>.corrupt), then an lr that
  blows up: the update whose loss / grad norm is non-finite is skipped, the run stops (exit 3),
  and the checkpoint whose params produced it is set aside; what remains is finite."""
  wd = _copy(run1, tmp_path)
  steps = _steps(wd)
  _truncate_params(wd, steps[-1])
  p = cli("train.py", f"--config={LONG}", f"--workdir={wd}", *FAST, "--config.train.lr=1e30",
          "--config.train.warmup_frac=0.0", "--config.train.grad_clip=0.0", "--stop_after=8")
  line = assert_user_error(p, "non-finite", "the update was skipped", code=3)
  assert f"skipping checkpoint step {steps[-1]}" in p.stderr
  assert os.path.isdir(os.path.join(wd, "checkpoints", f"{steps[-1]}.corrupt"))
  bad = int(line.split(" at step ")[1].split(":")[0])
  good = int(line.split("the last good checkpoint is step ")[1].split()[0])
  # the checkpoint of step bad-1 (its params produced the non-finite values) was set aside; the
  # one before it is the newest kept
  assert _steps(wd)[-1] == good == bad - 2
  assert os.path.isdir(os.path.join(wd, "checkpoints", f"{bad - 1}.nonfinite"))
  # every kept checkpoint holds finite params
  check = ("import sys, jax, numpy as np; sys.path.insert(0, 'tests');"
           "from _train_helpers import tiny; from condattn_jax.train import loop;"
           f"_, p, s = loop.load_params(tiny('steps=100000'), {wd!r});"
           "assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p)); print(s)")
  r = cli("-c", check)
  assert r.returncode == 0 and r.stdout.split()[-1] == str(good), r.stderr[-2000:]


def test_second_ctrl_c_exits_at_once(run1, tmp_path):
  wd = _copy(run1, tmp_path)
  p = subprocess.Popen([PY, "train.py", f"--config={LONG}", f"--workdir={wd}", *FAST],
                       cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  err = []
  try:
    # the "mesh ..." line is logged once the handlers are in place; the first step still has to
    # compile, so both Ctrl-Cs land before any step finishes
    for line in p.stderr:
      err.append(line)
      if "mesh {" in line:
        break
    p.send_signal(signal.SIGINT)
    for line in p.stderr:
      err.append(line)
      if "Ctrl-C: saving a checkpoint" in line:
        break
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=60)[1]
    elapsed = time.time() - t0
  finally:
    if p.poll() is None:
      p.kill()
  stderr = "".join(err) + rest
  assert p.returncode == 130, stderr[-3000:]
  assert "second Ctrl-C: exiting now without saving" in stderr and "Traceback" not in stderr
  assert elapsed < 10
  assert _steps(wd) == _steps(run1["wd"])  # nothing saved
  assert not os.path.exists(os.path.join(wd, "run.lock"))
