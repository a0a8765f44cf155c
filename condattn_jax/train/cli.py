"""Shared command-line plumbing for train.py / eval.py: flag parsing, overrides, one-line errors.

  if __name__ == "__main__":
    cli.run(main)                       # absl app.run with everything below

Contract of a command run through `run`:
  * a user error (bad config value, missing or unreadable file, corrupt checkpoint, bad data
    record, mesh / shape mismatch, busy workdir) ends with ONE line `ERROR: <what> ...` on stderr
    and exit code 2, no traceback; `--debug` prints the traceback (and the library logs) too.
    User errors are `ValueError` and `OSError` (FileNotFoundError, PermissionError, ...) raised
    by the code, which names the field / file and the fix in its message. Anything else is a bug:
    traceback and exit code 1.
  * Ctrl-C outside the training loop (which saves first, see train.loop) exits with code 130.
  * Orbax / absl / asyncio chatter below WARNING is hidden unless `--debug` or `--verbosity`.
  * `--config.a.b=v` on a field that is None in the recipe (ml_collections cannot type it) is
    applied here: `v` is a Python literal when it parses as one, else the string.
  * `--config.a.b=v` without `--config=` (eval.py --checkpoint=...) is kept aside in
    `PENDING_OVERRIDES` and applied with `apply_overrides` to the config saved with the checkpoint.
  * An unknown `--config.a.b` names the field and lists the valid ones (the config is locked).
"""
from __future__ import annotations

import ast
import importlib.util
import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable

from absl import app, flags

_DEBUG = flags.DEFINE_bool("debug", False, "Show tracebacks of user errors and the library logs "
                           "(orbax, absl) below WARNING.")

# Exceptions that mean "the input is wrong" (the message says what and how to fix it).
USER_ERRORS = (ValueError, OSError)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

# `--config.a.b=v` given without `--config=...`: (dotted path, raw value), in command-line order.
PENDING_OVERRIDES: list[tuple[str, str]] = []


def one_line(e: BaseException) -> str:
  """An exception as one line (type name kept for OSErrors without a message of ours)."""
  msg = " ".join(str(e).split())
  if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
    msg = f"{msg}: {e.filename}"
  if not msg:
    msg = type(e).__name__
  return msg


def debug_requested(argv: list[str] | None = None) -> bool:
  if flags.FLAGS.is_parsed():
    return bool(_DEBUG.value)
  argv = sys.argv if argv is None else argv
  return any(a in ("--debug", "--debug=true", "--debug=True", "--debug=1") for a in argv)


# -------------------------------------------------------------------------------- recipes
def load_recipe(spec: str):
  """'configs/x.py[:arg]' -> the ConfigDict its get_config(arg) returns."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config={spec}: recipe file {path} does not exist.")
  s = importlib.util.spec_from_file_location("_condattn_recipe", path)
  mod = importlib.util.module_from_spec(s)
  s.loader.exec_module(mod)
  return mod.get_config(arg) if arg else mod.get_config()


def _config_spec(argv: list[str], flag_name: str = "config") -> str | None:
  spec = None
  for i, a in enumerate(argv):
    if a.startswith(f"--{flag_name}="):
      spec = a.split("=", 1)[1]
    elif a == f"--{flag_name}" and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def _override_args(argv: list[str], flag_name: str = "config"):
  """[(index, dotted path, raw value or None)] of the `--config.a.b=v` arguments."""
  out = []
  for i, a in enumerate(argv):
    if a.startswith(f"--{flag_name}."):
      body = a[len(f"--{flag_name}."):]
      dotted, eq, value = body.partition("=")
      out.append((i, dotted, value if eq else None))
  return out


def field_error(cfg, dotted: str, given: str, flag_name: str = "config") -> str | None:
  """Message for a dotted path that does not exist in `cfg`, else None."""
  node, where = cfg, flag_name
  for part in dotted.split("."):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part not in keys:
      return (f"unknown config field '{where}.{part}' (from {given}); valid fields of {where}: "
              f"{sorted(keys)}. The config is locked: only fields the recipe defines can be set.")
    node, where = node[part], f"{where}.{part}"
  return None


def explain_override_error(argv: list[str], flag_name: str = "config") -> str | None:
  """The first `--config.a.b=v` whose path does not exist in the recipe, as a message."""
  spec = _config_spec(argv, flag_name)
  if spec is None:
    return None
  try:
    cfg = load_recipe(spec)
  except Exception as e:  # pylint: disable=broad-except
    return f"--{flag_name}={spec} failed to load: {one_line(e)}"
  for _, dotted, value in _override_args(argv, flag_name):
    msg = field_error(cfg, dotted, f"--{flag_name}.{dotted}" + ("" if value is None else f"={value}"),
                      flag_name)
    if msg:
      return msg
  return None


# ------------------------------------------------------------------------------ overrides
def parse_literal(raw: str) -> Any:
  """A command-line value for an untyped (None) field: a Python literal if it is one."""
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    return raw


def _convert(current: Any, raw: str, dotted: str) -> Any:
  """`raw` typed like the field's current value (None: a literal or the string)."""
  if current is None:
    return parse_literal(raw)
  if isinstance(current, bool):
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
      return True
    if low in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"--config.{dotted}={raw}: expected a bool (true / false).")
  if isinstance(current, (int, float, tuple, list)):
    try:
      v = ast.literal_eval(raw)
    except (ValueError, SyntaxError) as e:
      raise ValueError(f"--config.{dotted}={raw}: expected a {type(current).__name__} "
                       f"like the recipe's {current!r}.") from e
    if isinstance(current, (tuple, list)):
      v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    elif isinstance(current, int) and not (isinstance(v, int) and not isinstance(v, bool)):
      raise ValueError(f"--config.{dotted}={raw}: expected an int.")
    elif isinstance(current, float):
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"--config.{dotted}={raw}: expected a number.")
      v = float(v)
    return v
  return raw


def apply_overrides(cfg, overrides: list[tuple[str, str]], flag_name: str = "config") -> None:
  """Sets each (dotted path, raw value) on `cfg`; unknown paths are a ValueError."""
  for dotted, raw in overrides:
    msg = field_error(cfg, dotted, f"--{flag_name}.{dotted}={raw}", flag_name)
    if msg:
      raise ValueError(msg)
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    value = _convert(node[leaf], raw, dotted)
    try:
      node[leaf] = value
    except TypeError as e:
      raise ValueError(f"--{flag_name}.{dotted}={raw}: {one_line(e)}") from e


def _untyped_overrides(argv: list[str], flag_name: str = "config"):
  """Indices and (path, value) of overrides ml_collections cannot parse: no --config= at all, or
  a field whose recipe value is None (not a typed placeholder)."""
  spec = _config_spec(argv, flag_name)
  args = _override_args(argv, flag_name)
  if not args:
    return [], []
  if spec is None:
    return [i for i, _, _ in args], [(d, v) for _, d, v in args]
  try:
    cfg = load_recipe(spec)
  except Exception:  # pylint: disable=broad-except  (config_flags reports it)
    return [], []
  idx, out = [], []
  for i, dotted, value in args:
    if value is None or field_error(cfg, dotted, "", flag_name):
      continue
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    if hasattr(node, "get_type") and node[leaf] is None and node.get_type(leaf) is type(None):
      idx.append(i)
      out.append((dotted, value))
  return idx, out


def parse_flags(argv: list[str]) -> list[str]:
  """`flags_parser` for absl.app.run: clear errors (exit 2) and untyped / pending overrides."""
  drop, untyped = _untyped_overrides(argv)
  if drop:
    argv = [a for i, a in enumerate(argv) if i not in set(drop)]
    sys.argv[:] = argv  # config_flags reads its overrides from sys.argv
  try:
    rest = flags.FLAGS(argv)
  except SystemExit as e:  # absl's --help / --helpfull print the usage and exit 1
    if e.code not in (0, None) and any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  except (AttributeError, KeyError, TypeError, flags.Error) as e:
    msg = explain_override_error(argv) or one_line(e)
    print(f"ERROR: flags: {msg}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)
  except USER_ERRORS as e:  # config_flags: the recipe failed to load or to build
    if debug_requested(argv):
      traceback.print_exc()
    print(f"ERROR: {_recipe_error(argv, e)}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)
  cfg = None
  if "config" in flags.FLAGS and _config_spec(argv) is not None:
    try:
      cfg = flags.FLAGS["config"].value
      if cfg is not None:
        cfg.keys()  # config_flags defers a failed load to the first use of the config
    except Exception as e:  # pylint: disable=broad-except
      if debug_requested(argv):
        traceback.print_exc()
      print(f"ERROR: {_recipe_error(argv, e)}", file=sys.stderr)
      sys.exit(EXIT_USER_ERROR)
  PENDING_OVERRIDES.clear()
  if untyped:
    if cfg is None:
      PENDING_OVERRIDES.extend(untyped)
    else:
      try:
        apply_overrides(cfg, untyped)
      except ValueError as e:
        print(f"ERROR: flags: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
  return rest


_HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "--helpfull", "--helpxml")


def _recipe_error(argv, e) -> str:
  spec = _config_spec(argv)
  if spec is not None:
    path = spec.partition(":")[0]
    if not os.path.isfile(path):
      return f"--config={spec}: recipe file {os.path.abspath(path)} does not exist."
    try:
      load_recipe(spec)
    except USER_ERRORS as inner:
      return f"--config={spec}: {one_line(inner)}"
    except Exception as inner:  # pylint: disable=broad-except
      return f"--config={spec} failed to load: {type(inner).__name__}: {one_line(inner)}"
  return one_line(e)


# -------------------------------------------------------------------------------- logging
class _DropNoise(logging.Filter):
  """Orbax warnings that say nothing to a user of this library."""
  NOISE = ("Given directory is read only", "was found in the checkpoint, but could not be restored",
           "setting save_interval_steps=0", "setting create=False",
           "setting max_to_keep=None")

  def filter(self, record):
    msg = record.getMessage()
    if any(n in msg for n in self.NOISE):
      return False
    # a failed background save: orbax logs its traceback; condattn_jax.checkpoint re-raises it
    # as one CheckpointWriteError line
    return not ("orbax" in record.pathname and record.levelno >= logging.ERROR
                and ("save" in msg.lower() or "commit" in msg.lower()))


def _quiet_unraisable(unraisable):
  # Orbax / tensorstore coroutines that fail after a restore error was already raised print
  # "Exception ignored in <coroutine ...>" tracebacks at exit; the real error was reported.
  logging.getLogger("absl").debug("ignored: %s", unraisable.exc_value)


def _quiet_thread_excepthook(args, _orig=threading.excepthook):
  if isinstance(args.exc_value, RuntimeError) and "Event loop is closed" in str(args.exc_value):
    return
  _orig(args)


def setup_logging() -> None:
  """Hide library chatter below WARNING (orbax / grain log through absl's logger, tensorstore
  failures through asyncio) unless --debug or an explicit --verbosity."""
  if debug_requested() or flags.FLAGS["verbosity"].present:
    return
  # jax logs "Unable to initialize backend 'tpu' ... libtpu.so" (INFO) on every CPU / GPU host
  logging.getLogger("jax").setLevel(logging.WARNING)
  logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font cache INFO on a first plot
  absl_logger = logging.getLogger("absl")
  absl_logger.setLevel(logging.WARNING)
  absl_logger.addFilter(_DropNoise())
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  sys.unraisablehook = _quiet_unraisable
  threading.excepthook = _quiet_thread_excepthook


# ------------------------------------------------------------------------------------ run
def _guarded(main: Callable[[list[str]], Any]):
  def wrapped(argv):
    setup_logging()
    try:
      return main(argv)
    except KeyboardInterrupt:
      if debug_requested():
        raise
      print("ERROR: interrupted (Ctrl-C).", file=sys.stderr)
      sys.exit(EXIT_INTERRUPTED)
    except USER_ERRORS + (app.UsageError,) as e:
      if debug_requested():
        traceback.print_exc()
      sys.stdout.flush()
      print(f"ERROR: {one_line(e)}", file=sys.stderr)
      sys.exit(EXIT_USER_ERROR)
  return wrapped


def run(main: Callable[[list[str]], Any]) -> None:
  """absl.app.run(main) with this module's flag parsing, logging and error contract."""
  app.run(_guarded(main), flags_parser=parse_flags)
