"""Shared command-line plumbing for train.py / eval.py: flag parsing with clear config errors.

ml_collections' config_flags turns `--config.train.bogus=1` on a locked config into a bare
`AttributeError: 'bogus'` traceback; `parse_flags` replaces that with
`unknown config field 'config.train.bogus' (from --config.train.bogus=1); valid fields of
config.train: [...]` and exit code 2.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from absl import flags


def load_recipe(spec: str):
  """'configs/x.py[:arg]' -> the ConfigDict its get_config(arg) returns."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config={spec}: recipe file {path} does not exist.")
  s = importlib.util.spec_from_file_location("_condattn_recipe", path)
  mod = importlib.util.module_from_spec(s)
  s.loader.exec_module(mod)
  return mod.get_config(arg) if arg else mod.get_config()


def explain_override_error(argv: list[str], flag_name: str = "config") -> str | None:
  """The first `--config.a.b=v` whose path does not exist in the recipe, as a message."""
  spec = None
  for a in argv:
    if a.startswith(f"--{flag_name}="):
      spec = a.split("=", 1)[1]
  if spec is None:
    return None
  try:
    cfg = load_recipe(spec)
  except Exception as e:  # the recipe itself fails: config_flags reports that
    return f"--{flag_name}={spec} failed to load: {e}"
  for a in argv:
    if not a.startswith(f"--{flag_name}."):
      continue
    dotted = a[len(f"--{flag_name}."):].split("=", 1)[0]
    node, where = cfg, flag_name
    for part in dotted.split("."):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if part not in keys:
        return (f"unknown config field '{where}.{part}' (from {a}); valid fields of {where}: "
                f"{sorted(keys)}. The config is locked: only fields the recipe defines can be set.")
      node, where = node[part], f"{where}.{part}"
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """`flags_parser` for absl.app.run."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError, flags.Error) as e:
    msg = explain_override_error(argv) or str(e)
    print(f"FATAL flags error: {msg}", file=sys.stderr)
    sys.exit(2)
