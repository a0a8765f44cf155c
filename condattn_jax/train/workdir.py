"""One run per workdir: a lock file `<workdir>/run.lock` holding the owner's pid and host.

  lock = WorkdirLock.acquire(workdir)     # WorkdirBusyError if another live run holds it
  ...
  lock.release()

The lock is created atomically (written to a temporary file, then hard-linked to run.lock, which
fails if it exists), so it is never seen half-written. A lock left by a run that died (SIGKILL,
power loss) is stale when its host is this host and its pid is gone, or the pid now belongs to
another process (its start time differs): it is taken over with a warning. A lock of another host
cannot be checked from here: the error says which host and how to remove it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

LOCK_NAME = "run.lock"


class WorkdirBusyError(OSError):
  """Another run (alive, or on another host) holds the workdir's lock."""


def prepare(workdir: str) -> str:
  """Creates `workdir` (and parents) and checks it is a writable directory; returns its abspath.
  Errors name the path and what is wrong with it."""
  if not workdir:
    raise ValueError("--workdir is empty: give the run's directory.")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise NotADirectoryError(f"--workdir={workdir}: {path} is a file, not a directory; give a "
                             "directory (it is created if missing).")
  try:
    os.makedirs(path, exist_ok=True)
  except NotADirectoryError as e:
    raise NotADirectoryError(f"--workdir={workdir}: a parent of {path} is a file ({e.filename}).") from e
  except PermissionError as e:
    raise PermissionError(f"--workdir={workdir}: cannot create {path}: permission denied "
                          f"({e.filename}).") from e
  if not os.access(path, os.W_OK | os.X_OK):
    raise PermissionError(f"--workdir={workdir}: {path} is not writable; choose a directory you "
                          "can write to.")
  return path


def _proc_start(pid: int) -> str | None:
  """Start time of `pid` in clock ticks since boot (Linux), to tell a reused pid apart."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _owner() -> dict:
  return dict(pid=os.getpid(), host=socket.gethostname(), proc_start=_proc_start(os.getpid()),
              started=time.strftime("%Y-%m-%d %H:%M:%S"))


def read_lock(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return {}


def is_stale(info: dict) -> bool:
  """True when the lock's owner is known to be gone (same host only)."""
  if not info or info.get("host") != socket.gethostname():
    return False
  pid = info.get("pid")
  if not isinstance(pid, int) or not _alive(pid):
    return True
  start = info.get("proc_start")
  now = _proc_start(pid)
  return start is not None and now is not None and start != now


class WorkdirLock:
  """A held lock; `release()` removes the file if it is still ours."""

  def __init__(self, path: str, owner: dict):
    self.path = path
    self.owner = owner

  @classmethod
  def acquire(cls, workdir: str) -> "WorkdirLock":
    path = os.path.join(workdir, LOCK_NAME)
    me = _owner()
    tmp = f"{path}.{me['pid']}.tmp"
    with open(tmp, "w") as f:
      json.dump(me, f)
    try:
      for _ in range(3):
        try:
          os.link(tmp, path)
          return cls(path, me)
        except FileExistsError:
          pass
        info = read_lock(path)
        if info is None:
          continue  # released meanwhile
        if info.get("pid") == me["pid"] and info.get("host") == me["host"]:
          raise WorkdirBusyError(f"{path}: this process already runs in workdir {workdir}.")
        if not is_stale(info):
          who = (f"pid {info.get('pid')} on host {info.get('host')}, started "
                 f"{info.get('started', '?')}" if info else "an unreadable lock file")
          raise WorkdirBusyError(
              f"workdir {workdir} is in use by another run ({who}; lock {path}). Wait for it to "
              "finish or stop it, or use another --workdir; if no such run is alive, delete the "
              "lock file.")
        logging.warning("taking over the stale lock %s of pid %s on %s (that run is gone).",
                        path, info.get("pid"), info.get("host"))
        stale = f"{path}.stale.{me['pid']}"
        try:
          os.rename(path, stale)  # atomic: only one taker wins this file
          os.remove(stale)
        except FileNotFoundError:
          pass
      raise WorkdirBusyError(f"could not take the lock {path} (another run keeps taking it).")
    finally:
      try:
        os.remove(tmp)
      except FileNotFoundError:
        pass

  def release(self) -> None:
    info = read_lock(self.path)
    if info and info.get("pid") == self.owner["pid"] and info.get("host") == self.owner["host"]:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
