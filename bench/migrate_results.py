"""Bring the result files in bench/results to the one schema of bench/common.py (keeps every
number: `common.recorded(path)` gives back each old file's content exactly, which this script
checks before it writes).

    python -m bench.migrate_results                 # every old-format file in bench/results
    python -m bench.migrate_results --check         # only report which files need migrating
    python -m bench.migrate_results path.json ...   # these files
    python -m bench.migrate_results --claims        # re-record every run's claims (bench/claims)
                                                    # from its stored numbers, rows stored once

An old file was one dict: metadata (device, jax_version, date, settings, ...) and results, with
history kept as extra top-level keys. It becomes {"schema": 1, "bench", "device", "runs": [...]}:
a "main" run holding the metadata and every key that is not its own result block, and one run per
key that is (a list of rows, or a dict with its own date / commit), named by that key
(settings["name"]), dated by its own date where it has one. A run's `recorded` field keeps the
old content verbatim; its rows are the old `rows` list where there was one (stored once).
"""
from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

SKIP = ()
# Keys of the old H100 compacted-attention file that describe the whole file, not one result.
_META = {"device", "platform", "jax_version", "date", "what", "runs", "tree", "commit", "command",
         "commands", "dates", "note", "shapes", "active_set", "bucket_fracs", "timing", "settings",
         "preset", "bench", "seconds", "train_seconds", "model", "task", "protocol", "backend"}


def _bench_name(path: str, device: str | None) -> str:
  stem = os.path.basename(path)[:-len(".json")]
  if device:
    suffix = "_" + common.device_slug(device)
    if stem.endswith(suffix):
      return stem[:-len(suffix)]
  return stem


def _is_block(key: str, value) -> bool:
  """A result block of its own (a run): a list of row dicts, or a dict with its own date / tree."""
  if key in _META or key == "rows":
    return False
  if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
    return True
  return isinstance(value, dict) and ("date" in value or "tree" in value)


def _run(bench, device, old_meta, name, recorded, *, date=None, commit=None):
  settings = recorded.get("settings") if isinstance(recorded.get("settings"), dict) else {}
  run = dict(bench=bench, device=device, jax_version=old_meta.get("jax_version"),
             date=str(date or old_meta.get("date") or "1970-01-01"),
             git_commit=commit if commit is not None else old_meta.get("commit"),
             settings={**settings, "name": name},
             rows=[r for r in recorded.get("rows", []) if isinstance(r, dict)]
             if isinstance(recorded.get("rows"), list) else [],
             claims=[], recorded=recorded)
  for cname, passed in common.own_claims(recorded).items():
    common.claim(run, cname, passed)
  return common.dedup_rows(run)


def migrate(old: dict, path: str, bench: str | None = None) -> dict:
  """The schema-1 file for the old dict `old` read from `path` (bench: its name, default from the
  old file or the file name)."""
  device = old.get("device") if isinstance(old.get("device"), str) else None
  inner = old.get("runs") if isinstance(old.get("runs"), list) else []
  inner = [r for r in inner if isinstance(r, dict)]
  meta = dict(old)
  if device is None and inner:  # a file that was only a list of runs: their device, newest date
    newest = max(inner, key=lambda r: str(r.get("date", "")))
    device = newest.get("device")
    meta.update({k: newest[k] for k in ("date", "jax_version", "commit") if k in newest})
  device = device or "cpu"
  if bench is None:
    bench = old.get("bench") if isinstance(old.get("bench"), str) else _bench_name(path, device)
  blocks = [k for k, v in old.items() if _is_block(k, v)] if len(old) > 20 else []
  main = {k: v for k, v in old.items() if k not in blocks}
  runs = [_run(bench, device, meta, "main", main)]
  for k in blocks:
    v = old[k]
    date = v.get("date") if isinstance(v, dict) else None
    commit = v.get("tree") if isinstance(v, dict) and isinstance(v.get("tree"), str) else None
    runs.append(_run(bench, device, meta, k, {k: v}, date=date, commit=commit))
  new = dict(schema=common.SCHEMA, bench=bench, device=device, runs=runs)
  for i, r in enumerate(runs):
    common.check_run(r, f"{path}: runs[{i}]")
  if common.recorded_from(new) != old:
    raise ValueError(f"{path}: the migrated file does not give back the old content")
  return new


def refresh(path: str) -> dict:
  """A schema-1 file with its rows stored once per run (common.dedup_rows) and every run's
  registered claims (bench/claims) evaluated on its stored numbers and recorded; ValueError if
  the content read back (common.recorded_from) or any run's rows would change."""
  from bench import claims
  data = common.load(path)
  before = common.recorded_from(data)
  rows = [r["rows"] for r in data["runs"]]
  for i, run in enumerate(data["runs"]):
    common.dedup_rows(run)
    claims.record(os.path.basename(path), data["runs"], i)
  if common.recorded_from(data) != before or [r["rows"] for r in data["runs"]] != rows:
    raise ValueError(f"{path}: refreshing the claims would change the recorded numbers")
  return data


def needs_migration(path: str) -> bool:
  with open(path) as f:
    data = json.load(f)
  return not (isinstance(data, dict) and data.get("schema") == common.SCHEMA)


def main(argv):
  check = "--check" in argv
  if "--claims" in argv:  # re-record every file's claims from its stored numbers
    for p in [a for a in argv if not a.startswith("--")] or sorted(
        p for p in glob.glob(os.path.join(common.RESULTS, "*.json"))
        if not os.path.basename(p).startswith(SKIP)):
      common._write(p, refresh(p))
      print(f"claims recorded: {p}")
    return 0
  paths = [a for a in argv if not a.startswith("--")] or sorted(
      p for p in glob.glob(os.path.join(common.RESULTS, "*.json"))
      if not os.path.basename(p).startswith(SKIP))
  todo = [p for p in paths if needs_migration(p)]
  for p in todo:
    if check:
      print(f"needs migrating: {p}")
      continue
    with open(p) as f:
      old = json.load(f)
    new = migrate(old, p)
    with open(p, "w") as f:
      json.dump(new, f, indent=1)
      f.write("\n")
    print(f"migrated {p}: {len(new['runs'])} run(s)")
  return 1 if check and todo else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
