"""What keeps a run's checkpoints good: the non-finite guard, the finite check, stop signals.

  step_fn = skip_nonfinite(train_step)      # inside jit: a NaN / inf loss or grad norm leaves
                                            # the state exactly as it was (update skipped)
  check_finite(step, host_metrics, ...)     # on the host, before any save: raises
                                            # NonFiniteLossError and sets aside the checkpoint
                                            # whose params produced the non-finite values
  stop = StopSignals(install=True)          # SIGTERM / first Ctrl-C: save after this step and
                                            # stop; second Ctrl-C: exit at once (code 130)
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

FINITE_KEYS = ("loss", "grad_norm")
EXIT_INTERRUPTED = 130


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN / inf; the run stopped without saving that state."""


def skip_nonfinite(train_step: Callable) -> Callable:
  """train_step(state, batch) -> (state, metrics) whose update is dropped (the whole state,
  step counter included, is the input state) when metrics['loss'] or metrics['grad_norm'] is not
  finite. The selection is elementwise inside the same jit, so donation still applies."""

  def guarded(state, batch):
    new_state, m = train_step(state, batch)
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m[k])) for k in FINITE_KEYS if k in m]))
    new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
    return new_state, m

  return guarded


def nonfinite(m: dict) -> dict[str, float]:
  """{name: value} of the FINITE_KEYS metrics that are NaN / inf."""
  return {k: float(np.asarray(m[k]).reshape(-1)[0]) for k in FINITE_KEYS
          if k in m and not np.all(np.isfinite(m[k]))}


def check_finite(step: int, m: dict, ckpt=None, *, saved_this_run=(), primary: bool = True):
  """Raises NonFiniteLossError when step `step`'s loss / grad norm is not finite.

  The params of step - 1 produced those values; a checkpoint of step - 1 written by this run is
  therefore not "good": it is moved to <step - 1>.nonfinite (when an older checkpoint remains),
  so a resume starts from the last checkpoint whose params gave finite values."""
  bad = nonfinite(m)
  if not bad:
    return
  where = "no checkpoint was written"
  if ckpt is not None:
    ckpt.wait()
    steps = sorted(ckpt.all_steps())
    moved = ""
    if steps and steps[-1] == step - 1 and step - 1 in saved_this_run and len(steps) > 1:
      if primary:
        dst = ckpt.quarantine(step - 1, "nonfinite")
        moved = (f"checkpoint step {step - 1} (its params gave these values) moved to {dst}; ")
      else:
        ckpt.mgr.reload()
      steps = steps[:-1]
    last = steps[-1] if steps else None
    where = moved + (f"the last good checkpoint is step {last} in {ckpt.directory} (untouched)"
                     if last is not None else "no checkpoint was written")
  raise NonFiniteLossError(
      f"non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}: the update "
      f"was skipped and the run stopped; {where}. Lower train.lr, raise train.warmup_frac, check "
      "the data, or use a float32 model.dtype to find the cause.")


class StopSignals:
  """SIGTERM (preemption) and SIGINT (Ctrl-C) -> a flag checked at step boundaries: the loop
  saves a checkpoint and stops. A second Ctrl-C exits at once (code 130, no save) after
  `on_hard_exit` (e.g. releasing the workdir lock).

  "At once" holds even while the main thread is inside a long C++ call (compilation, waiting
  for a step): Python runs signal handlers only between bytecodes of the main thread, so the
  signals are also read from `signal.set_wakeup_fd` by a watcher thread, which sees each one
  when it arrives. Single process, main thread only; with jax.distributed the coordination
  service's preemption sync point is used instead."""

  def __init__(self, install: bool, on_hard_exit: Callable[[], None] | None = None):
    self.flag = False
    self.reason: str | None = None
    self.on_hard_exit = on_hard_exit
    self._old: dict = {}
    self._old_wakeup = None
    self._socks = None
    self._seen = 0
    self._lock = threading.Lock()
    if install and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
      try:
        r, w = socket.socketpair()
        w.setblocking(False)
        self._old_wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        self._socks = (r, w)
        threading.Thread(target=self._watch, args=(r,), daemon=True,
                         name="condattn-stop-signals").start()
      except (OSError, ValueError):  # no wakeup fd: handlers still set the flag
        self._socks = None

  def _handle(self, signum, frame):
    """Main-thread handler: sets the flag at the next bytecode (deterministic for os.kill in
    tests); counting and the hard exit are the watcher's (or this handler's without one)."""
    del frame
    self._set(signum)
    if self._socks is None:
      self._count(signum)

  def _set(self, signum):
    if not self.flag:
      self.reason = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
      self.flag = True

  def _watch(self, r):
    while True:
      try:
        data = r.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum in (signal.SIGTERM, signal.SIGINT):
          self._count(signum)

  def _count(self, signum):
    with self._lock:
      self._seen += 1
      first = self._seen == 1
    if signum == signal.SIGINT and not first:
      sys.stderr.write("\nsecond Ctrl-C: exiting now without saving.\n")
      sys.stderr.flush()
      if self.on_hard_exit is not None:
        try:
          self.on_hard_exit()
        except Exception:  # pylint: disable=broad-except
          pass
      os._exit(EXIT_INTERRUPTED)
    self._set(signum)
    if first:
      logging.warning("%s: saving a checkpoint after this step, then stopping%s.",
                      "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C",
                      " (Ctrl-C again to exit at once, without saving)"
                      if signum == signal.SIGINT else "")

  def restore(self):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}
    if self._socks is not None:
      signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
      for sock in reversed(self._socks):  # the write end first: the watcher's recv returns b""
        sock.close()
      self._socks = None
