"""The repo's command-line programs (train.py, eval.py, scripts/*.py, `python -c`) run for the
tests as a user runs them, without paying the interpreter's and jax's imports once per command
(not a test module).

`Runner` starts ONE helper process (this file as a script, in the environment the commands get)
that imports PRELOAD and waits; each `Runner.run(script, *args)` forks it, and the fork runs the
command as `python script args...` does: the script as __main__ (its `if __name__ ==
"__main__":` block included), sys.argv and sys.path[0] set from it, stdin empty, stdout and
stderr captured, non-daemon threads joined and atexit handlers run at the end, and its exit code (SystemExit's code; 1 and the
traceback on stderr for an uncaught exception) handed back in a subprocess.CompletedProcess. The
helper imports modules and runs nothing in jax (no backend, no compile), so each command starts
its backend and compiles as its own process would. What only a new interpreter checks (python's
start-up, the first import of every module) is left to the tests that run a program as a
subprocess."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("absl.app", "absl.flags", "ml_collections.config_flags", "numpy", "jax", "flax.linen",
           "optax", "condattn_jax.train.cli", "condattn_jax.train.loop",
           "condattn_jax.checkpoint")


class Runner:
  """One helper process for many commands, started at the first `run`; `close()` ends it (the
  next `run` starts another)."""

  def __init__(self, env: dict):
    self.env, self.proc, self.out_dir, self.count = env, None, None, 0

  def _start(self):
    self.out_dir = tempfile.mkdtemp(prefix="cli_runner_")
    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT,
                                 env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, start_new_session=True)

  def run(self, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python script *args` in ROOT, its output captured; subprocess.TimeoutExpired (and the
    helper and the command killed) after `timeout` seconds."""
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    self.count += 1
    out, err = (os.path.join(self.out_dir, f"{self.count}.{k}") for k in ("stdout", "stderr"))
    self.proc.stdin.write(json.dumps(dict(argv=[script, *args], stdout=out, stderr=err)) + "\n")
    self.proc.stdin.flush()
    if not select.select([self.proc.stdout], [], [], timeout)[0]:
      self._kill()
      raise subprocess.TimeoutExpired([script, *args], timeout)
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the CLI runner exited ({self.proc.wait()}) while running {script}")
    code = json.loads(line)["returncode"]
    with open(out) as f, open(err) as g:
      return subprocess.CompletedProcess([sys.executable, script, *args], code, f.read(), g.read())

  def _kill(self):
    os.killpg(self.proc.pid, signal.SIGKILL)  # the helper and the command it forked
    self.proc.wait()

  def close(self):
    """Ends the helper process (waited for: its CPU time counts as this process's children's)."""
    if self.proc is not None:
      if self.proc.poll() is None:
        self.proc.stdin.close()
        try:
          self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
          self._kill()
      shutil.rmtree(self.out_dir, ignore_errors=True)
    self.proc = None


def _exit_code(e: SystemExit) -> int:
  """What the interpreter exits with for `SystemExit(e.code)` (a message: printed, code 1)."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def _child(req: dict) -> None:
  """In the fork: run the command line as `python argv...` would, then exit with its code."""
  import atexit
  import runpy
  import threading
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
  sys.stdin = open(0, closefd=False)
  script, *args = req["argv"]
  code = 0
  try:
    if script == "-c":
      sys.argv = ["-c", *args[1:]]
      sys.path[0] = ""
      exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
    else:
      sys.argv = [script, *args]
      sys.path[0] = os.path.dirname(os.path.abspath(script))
      runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    code = _exit_code(e)
  except BaseException:  # the interpreter's own handling of an uncaught exception
    sys.excepthook(*sys.exc_info())
    code = 1
  try:  # the interpreter's exit: join the non-daemon threads, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:
  import importlib
  for name in PRELOAD:
    importlib.import_module(name)
  requests, replies = sys.stdin, sys.stdout
  for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
      _child(req)
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps(dict(returncode=os.waitstatus_to_exitcode(status))) + "\n")
    replies.flush()


if __name__ == "__main__":
  _serve()
