"""The one harness of bench/*.py: CLI convention, timer, result schema and writer.

CLI: absl flags, like train.py, in a FlagValues of the bench's own (`flag_values()` adds the
shared --out_dir / --n / --warmup; `parse_flags(fv, argv)` parses a list, so tests call
`main([...])`). Every bench writes into --out_dir (default $OUT, else bench/results) and nowhere
else: `<out_dir>/<bench>_<device>.json`, or the fixed name a bench documents for a recorded
preset (its FILES table, e.g. bench/results/elastic_tasks.json for the CPU preset): `result_path`.

Timer: `time_call(fn, *args)` -> {"median_ms", "runs_ms"}: `warmup` calls, then `n` calls each
blocked on (wall time per call, host time included); `time_device_bound(fn, *args)` -> {"median_ms",
"runs_ms"}: `n` calls enqueued back to back and one block at the end, per-call time = total / n,
median of `repeats` (the host's dispatch of the next call hides under the device's work, as in a
model's step). Device activity: `trace_activity(fn, n)` -> kernels, busy / span ms per call from a
jax.profiler trace; `activity(events)` is the one parser of such events (also of the CUPTI
traces bench/compact_attention.py --profile takes through torch).

Result schema (one file per bench and device; runs APPENDED, never new top-level keys):

    {"schema": 1, "bench": "compact_attention", "device": "NVIDIA H100 80GB HBM3",
     "runs": [{"bench": ..., "device": ..., "jax_version": "0.11.2",
               "date": "2026-11-25T12:22:00+00:00", "git_commit": "adcd5c8",
               "settings": {...}, "rows": [{...}, ...],
               "claims": [{"name": ..., "passed": true, "detail": {...}}, ...]}, ...]}

A claim is a statement the run checked (a speedup over a target, a check against the reference)
with its pass / fail. The writer (append_run / replace_last_run) records on the run every claim
bench/claims registers for the bench and the run's name, evaluated on the stored numbers;
tests/bench/test_results.py re-evaluates them from every file in bench/results and checks that
every recorded claim passed, so a run that fails a claim cannot land silently. `name` (the run's
tag: a preset, or the old top-level key a migrated run came from) tells runs of one bench apart.
A run stores its rows once: in `rows`, and its bench's own layout in `recorded` without a copy
of them (`recorded_of` puts them back). bench/migrate_results.py brought the older result files
to this schema (`--claims` re-records every run's claims).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import time
from typing import Callable

SCHEMA = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
RUN_KEYS = ("bench", "device", "jax_version", "date", "git_commit", "settings", "rows", "claims")


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def flag_values(*, out_dir: bool = True, n: int | None = None, warmup: int | None = None):
  """A bench's own absl FlagValues (several benches import into one test process without their
  flags clashing), with the shared flags: --out_dir (default $OUT, else bench/results), and --n
  (timed calls, the median is reported) / --warmup where given."""
  from absl import flags
  fv = flags.FlagValues()
  if out_dir:
    flags.DEFINE_string("out_dir", os.environ.get("OUT", RESULTS),
                        "directory of the result file: <bench>_<device>.json, or the fixed name the "
                        "bench documents for a recorded preset (default $OUT, else bench/results)",
                        flag_values=fv)
  if n is not None:
    flags.DEFINE_integer("n", n, "timed calls per measurement (the median is reported)",
                         flag_values=fv)
  if warmup is not None:
    flags.DEFINE_integer("warmup", warmup, "untimed calls before timing", flag_values=fv)
  return fv


def parse_flags(fv, argv=None):
  """Parse `argv` (a list of flags; None: sys.argv[1:]) into `fv`; --help prints the flags."""
  import sys
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--help" in argv or "-h" in argv:
    print(fv.main_module_help() if hasattr(fv, "main_module_help") else str(fv))
    raise SystemExit(0)
  fv.unparse_flags()
  fv(["bench"] + argv)
  return fv


# ------------------------------------------------------------------------------------------------
# Where it ran
# ------------------------------------------------------------------------------------------------

def device_kind() -> str:
  import jax
  return jax.devices()[0].device_kind


def device_slug(kind: str | None = None) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (result file names)."""
  return re.sub(r"[^A-Za-z0-9]+", "_", kind if kind is not None else device_kind()).strip("_")


def git_commit() -> str | None:
  """$CONDATTN_GIT_COMMIT if set, else `git rev-parse --short HEAD`. Set it on a device run: the
  device tool copies the working tree, but the copy's git metadata may name an older commit."""
  if os.environ.get("CONDATTN_GIT_COMMIT"):
    return os.environ["CONDATTN_GIT_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip() or None
  except (OSError, subprocess.CalledProcessError):
    return None


def host_platform():
  """This process's device as a pallas_kernels.backends.Platform (what ops.resolve takes)."""
  import jax
  from pallas_kernels.backends import Platform
  backend = jax.default_backend()
  if backend == "gpu":
    from jax.extend import backend as jex_backend
    rocm = "rocm" in jex_backend.get_backend().platform_version.lower()
    return Platform("rocm" if rocm else "cuda", device_kind())
  return Platform(backend if backend == "tpu" else "cpu", device_kind())


# ------------------------------------------------------------------------------------------------
# Timer
# ------------------------------------------------------------------------------------------------

def _block(x):
  import jax
  return jax.block_until_ready(x)


def time_call(fn: Callable, *args, n: int = 10, warmup: int = 2) -> dict:
  """Each call alone: {"median_ms", "runs_ms"} over n calls after `warmup` (wall time, blocked on
  every call)."""
  for _ in range(warmup):
    _block(fn(*args))
  runs = []
  for _ in range(n):
    t0 = time.perf_counter()
    _block(fn(*args))
    runs.append((time.perf_counter() - t0) * 1e3)
  return dict(median_ms=statistics.median(runs), runs_ms=runs)


def time_interleaved(fns: dict, n: int = 10) -> dict:
  """Several calls timed in turns: n rounds, each calls every fn once, alone and blocked, in an
  order that reverses every round (A B, B A, ...), so drift over the rounds reaches each fn
  alike; {name: {"median_ms", "runs_ms"}}."""
  names = list(fns)
  runs = {k: [] for k in names}
  for i in range(n):
    for k in (names if i % 2 == 0 else names[::-1]):
      t0 = time.perf_counter()
      _block(fns[k]())
      runs[k].append((time.perf_counter() - t0) * 1e3)
  return {k: dict(median_ms=statistics.median(v), runs_ms=v) for k, v in runs.items()}


def time_device_bound(fn: Callable, *args, n: int = 10, warmup: int = 2, repeats: int = 3) -> dict:
  """Calls back to back: n calls enqueued, one block at the end, per-call time = total / n;
  {"median_ms", "runs_ms"} over `repeats` such batches."""
  for _ in range(warmup):
    _block(fn(*args))
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = [fn(*args) for _ in range(n)]
    _block(out)
    runs.append((time.perf_counter() - t0) * 1e3 / n)
  return dict(median_ms=statistics.median(runs), runs_ms=runs)


# ------------------------------------------------------------------------------------------------
# Shared measurements
# ------------------------------------------------------------------------------------------------

def peak_bytes(device=None) -> int | None:
  """The device's peak bytes in use so far (None where the backend keeps no memory stats, e.g.
  CPU)."""
  import jax
  dev = device if device is not None else jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if not stats or stats.get("peak_bytes_in_use") is None:
    return None
  return int(stats["peak_bytes_in_use"])


def activity(events) -> dict:
  """Summary of device activity events [(name, start_us, dur_us), ...] (one trace, any source:
  a CUPTI chrome trace through torch, a jax.profiler xplane): {count, busy_us (the union of the
  intervals: time the device did something), span_us (first start to last end; span - busy is
  idle time inside, e.g. launch gaps), per_name_us {name: summed duration}, per_name_count
  {name: events}}."""
  events = list(events)
  per: dict[str, float] = {}
  count: dict[str, int] = {}
  for name, _, dur in events:
    per[name] = per.get(name, 0.0) + float(dur)
    count[name] = count.get(name, 0) + 1
  if not events:
    return dict(count=0, busy_us=0.0, span_us=0.0, per_name_us=per, per_name_count=count)
  iv = sorted((float(s), float(s) + float(d)) for _, s, d in events)
  busy, lo, hi = 0.0, iv[0][0], iv[0][1]
  for a, b in iv[1:]:
    if a > hi:
      busy, lo, hi = busy + hi - lo, a, b
    else:
      hi = max(hi, b)
  busy += hi - lo
  return dict(count=len(events), busy_us=busy, span_us=max(b for _, b in iv) - iv[0][0],
              per_name_us=per, per_name_count=count)


def cuda_traces(fn: Callable, n: int) -> list[list[dict]]:
  """The device activity of n traced calls of `fn()` through torch's profiler, which reads CUPTI
  for the whole process, so it records JAX's kernels too (Nsight Compute crashes under JAX on
  the device). Each traced call follows an untraced one (it starts on an idle GPU, caches warm);
  one more call is traced first and dropped. Returns one list per kept call (a call without
  activity is left out) of its chrome-trace events of category kernel / gpu_memcpy /
  gpu_memset (name, ts and dur in us, args: CUPTI's launch facts)."""
  import jax
  import torch
  from torch.profiler import ProfilerActivity, profile
  torch.cuda.init()
  calls = []
  for i in range(n + 1):
    jax.block_until_ready(fn())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      jax.block_until_ready(fn())
    path = f"/tmp/_cuda_trace_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as fh:
      evs = json.load(fh)["traceEvents"]
    os.remove(path)
    acts = [e for e in evs if e.get("ph") == "X" and e.get("cat") in (
        "kernel", "gpu_memcpy", "gpu_memset")]
    if i and acts:
      calls.append(acts)
  return calls


def trace_key(e: dict, width: int) -> str:
  """An activity event's name in a per-kernel table: memcpy / memset marked, cut to width."""
  return ({"gpu_memcpy": "memcpy: ", "gpu_memset": "memset: "}.get(e["cat"], "")
          + e["name"][:width])


def trace_summary(acts: list[dict]) -> dict:
  """One traced call's activity (cuda_traces): busy_ms (the union of its intervals), span_ms
  (first start to last end) and its timeline [[name, start us from the first, duration us]]."""
  a = activity((e["name"], e["ts"], e["dur"]) for e in acts)
  t0 = min(e["ts"] for e in acts)
  return dict(busy_ms=a["busy_us"] / 1e3, span_ms=a["span_us"] / 1e3,
              timeline=[[e["name"][:60], round(e["ts"] - t0, 1), round(e["dur"], 1)]
                        for e in sorted(acts, key=lambda e: e["ts"])])


# Lines of an xplane that summarise (derived from) the stream lines: never counted twice.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Framework Ops",
                 "Framework Name Scope", "Source code", "Launch Stats", "_counters_",
                 "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope")


def xplane_events(path: str, plane_prefix: str = "/device:GPU", line_prefix: str = "Stream"):
  """(events [(name, start_us, dur_us)], line names read) of a jax.profiler trace file
  (`*.xplane.pb`): the events of the planes named `plane_prefix*` on the lines named
  `line_prefix*` (on a GPU, CUPTI's 'Stream #<id>(...)' lines: one event per kernel / memcpy /
  memset), or where no line has that prefix, on every line but the derived summaries
  (DERIVED_LINES)."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(path)
  events, names = [], []
  for plane in data.planes:
    if not plane.name.startswith(plane_prefix):
      continue
    lines = list(plane.lines)
    chosen = [l for l in lines if l.name.startswith(line_prefix)] or [
        l for l in lines if l.name not in DERIVED_LINES]
    for line in chosen:
      names.append(f"{plane.name}/{line.name}")
      events += [(e.name, e.start_ns / 1e3, e.duration_ns / 1e3) for e in line.events]
  return events, names


def trace_activity(fn: Callable, n: int = 1, *, plane_prefix: str | None = None,
                   line_prefix: str | None = None, top_n: int = 10) -> dict:
  """`fn()` called n times back to back (blocked at the end) under jax.profiler, the device's
  activity summarised per call: {calls, kernels (events per call), busy_ms / span_ms per call,
  top [[name, ms per call], ...] (the top_n longest), launches {name: events per call} (of those
  names), lines (what was read)}. Default planes: the GPU's
  stream lines; on a CPU backend (a plumbing check only: no device plane exists) the XLA CPU
  client's threads of the host plane. Wall time under a trace is not reported (the tracer
  slows the host): time the same calls untraced."""
  import glob
  import shutil
  import tempfile
  import jax
  cpu = jax.default_backend() == "cpu"
  plane_prefix = plane_prefix or ("/host:CPU" if cpu else "/device:GPU")
  line_prefix = line_prefix or ("tf_XLA" if cpu else "Stream")
  d = tempfile.mkdtemp(prefix="trace_")
  try:
    jax.profiler.start_trace(d)
    try:
      out = None
      for _ in range(n):  # (a call may donate what the one before returned: the last waited)
        out = fn()
      jax.block_until_ready(out)
    finally:
      jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      raise RuntimeError(f"trace_activity: jax.profiler wrote no .xplane.pb under {d}.")
    events, lines = xplane_events(paths[0], plane_prefix, line_prefix)
    if not lines:  # nothing matched (e.g. no CUPTI on the GPU host): say what the trace held
      from jax.profiler import ProfileData
      lines = [f"no {plane_prefix}* plane; planes: " + ", ".join(
          pl.name for pl in ProfileData.from_file(paths[0]).planes)]
  finally:
    shutil.rmtree(d, ignore_errors=True)
  a = activity(events)
  top = sorted(a["per_name_us"].items(), key=lambda kv: -kv[1])[:top_n]
  return dict(calls=n, kernels=a["count"] / n, busy_ms=a["busy_us"] / n / 1e3,
              span_ms=a["span_us"] / n / 1e3, top=[[k, v / n / 1e3] for k, v in top],
              launches={k: a["per_name_count"][k] / n for k, _ in top}, lines=lines)


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| in float64 (0 when both are zero)."""
  import numpy as np
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  den = float(np.linalg.norm(b))
  num = float(np.linalg.norm(a - b))
  return num / den if den else num


# ------------------------------------------------------------------------------------------------
# Result schema and writer
# ------------------------------------------------------------------------------------------------

def new_run(bench: str, settings: dict | None = None, *, device: str | None = None,
            date: str | None = None, commit: str | None = None) -> dict:
  """A run record: where and when it ran, its settings; rows and claims start empty."""
  import jax
  return dict(bench=bench, device=device if device is not None else device_kind(),
              jax_version=jax.__version__,
              date=date or datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              git_commit=commit if commit is not None else git_commit(),
              settings=dict(settings or {}), rows=[], claims=[])


def claim(run: dict, name: str, passed: bool, **detail) -> bool:
  """Record a claim (a checked statement) and its pass / fail on the run; returns `passed`."""
  run["claims"].append(dict(name=name, passed=bool(passed), detail=detail))
  return bool(passed)


def check_run(run: dict, where: str = "run") -> None:
  """One-line ValueError naming the first field a run lacks or gets wrong."""
  for key in RUN_KEYS:
    if key not in run:
      raise ValueError(f"{where}: missing field {key!r} (a run has {RUN_KEYS}; see bench/common.py)")
  if not isinstance(run["rows"], list) or not isinstance(run["claims"], list):
    raise ValueError(f"{where}: 'rows' and 'claims' must be lists")
  if not isinstance(run["settings"], dict):
    raise ValueError(f"{where}: 'settings' must be a dict")
  try:
    datetime.datetime.fromisoformat(run["date"])
  except (TypeError, ValueError):
    raise ValueError(f"{where}: date {run['date']!r} is not ISO 8601 (YYYY-MM-DD[THH:MM:SS])")
  for i, c in enumerate(run["claims"]):
    if set(c) != {"name", "passed", "detail"} or not isinstance(c["passed"], bool):
      raise ValueError(f"{where}: claims[{i}] must be {{name, passed: bool, detail}}, got {c!r}")


def result_path(bench: str, out_dir: str | None = None, device: str | None = None, *,
                fixed: str | None = None) -> str:
  """The one result-file rule: `<out_dir>/<fixed>` where the bench documents a fixed name (a
  recorded preset), else `<out_dir>/<bench>_<device>.json` (device: this process's)."""
  return os.path.join(out_dir or RESULTS, fixed or f"{bench}_{device_slug(device)}.json")


def load(path: str) -> dict:
  """A result file; ValueError naming the file if it is not in the one schema."""
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict) or data.get("schema") != SCHEMA or "runs" not in data:
    raise ValueError(f"{path}: not a schema-{SCHEMA} result file (run bench/migrate_results.py)")
  for i, run in enumerate(data["runs"]):
    check_run(run, f"{path}: runs[{i}]")
  return data


def append_run(path: str, run: dict) -> dict:
  """Append `run` to the result file at `path` (created if absent); returns the file's data."""
  check_run(run, path)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if isinstance(old, dict) and "schema" not in old:  # an old-layout file: migrate it first
      from bench import migrate_results
      _write(path, migrate_results.migrate(old, path, bench=run["bench"]))
    data = load(path)
    if data["bench"] != run["bench"]:
      raise ValueError(f"{path}: holds bench {data['bench']!r}, not {run['bench']!r}")
  else:
    data = dict(schema=SCHEMA, bench=run["bench"], device=run["device"], runs=[])
  data["runs"].append(run)
  _record_claims(path, data)
  _write(path, data)
  return data


def _record_claims(path: str, data: dict) -> None:
  """Evaluate and record the last run's registered claims (bench/claims) on it."""
  from bench import claims
  claims.record(os.path.basename(path), data["runs"], len(data["runs"]) - 1)


def _write(path: str, data: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)


def replace_last_run(path: str, run: dict) -> dict:
  """Replace the file's last run by `run` (a bench saving its progress on the run it appended)."""
  check_run(run, path)
  data = load(path)
  data["runs"][-1] = run
  _record_claims(path, data)
  _write(path, data)
  return data


def runs(path: str, name: str | None = None) -> list[dict]:
  """The runs of a result file, oldest first (only those tagged `name` in settings["name"])."""
  out = load(path)["runs"]
  return [r for r in out if name is None or r["settings"].get("name") == name]


def _timestamp(date: str) -> float:
  d = datetime.datetime.fromisoformat(date)
  return (d if d.tzinfo else d.replace(tzinfo=datetime.timezone.utc)).timestamp()


def newest(path: str, name: str | None = None) -> dict:
  """The latest run (by ISO date; among runs tagged `name`)."""
  rs = runs(path, name)
  if not rs:
    raise ValueError(f"{path}: no run" + ("" if name is None else f" named {name!r}"))
  return max(rs, key=lambda r: _timestamp(r["date"]))


def recorded_from(data: dict) -> dict:
  """The runs' `recorded` contents merged in file order (a later run's key replaces an earlier
  one's): for a migrated file exactly the old file's dict; the keys a bench writes per run
  (its old top-level layout) read as the newest run's."""
  out = {}
  for run in data["runs"]:
    out.update(recorded_of(run))
  return out


def recorded_of(run: dict) -> dict:
  """One run's `recorded` layout; its "rows" are the run's `rows` where the run stores them once
  (the writer drops the copy: `dedup_rows`)."""
  if "recorded" not in run:
    return {}
  rec = dict(run["recorded"])
  if "rows" not in rec and run["rows"]:
    rec["rows"] = run["rows"]
  return rec


def dedup_rows(run: dict) -> dict:
  """Store the rows once: drop `recorded["rows"]` where it equals the run's `rows` (recorded_of
  gives it back)."""
  rec = run.get("recorded")
  if isinstance(rec, dict) and run.get("rows") and rec.get("rows") == run["rows"]:
    run["recorded"] = {k: v for k, v in rec.items() if k != "rows"}
  return run


def recorded(path: str) -> dict:
  """recorded_from(load(path))."""
  return recorded_from(load(path))


def make_run(bench: str, result: dict, *, settings: dict | None = None, name: str = "main",
             claims: dict | None = None) -> dict:
  """A run from a bench's result dict (its layout kept verbatim in `recorded`): metadata from
  new_run, rows from result["rows"] where it is a list, claims {name: passed} recorded."""
  own = result.get("settings") if isinstance(result.get("settings"), dict) else {}
  # a result that names its device (e.g. a merge, run on a CPU, of units measured on GPUs) keeps it
  device = result["device"] if isinstance(result.get("device"), str) else None
  run = new_run(bench, {**own, **(settings or {}), "name": name}, device=device)
  run["rows"] = [r for r in result.get("rows", []) if isinstance(r, dict)] if isinstance(
      result.get("rows"), list) else []
  for cname, passed in {**own_claims(result), **(claims or {})}.items():
    claim(run, cname, passed)
  run["recorded"] = result
  return dedup_rows(run)


def own_claims(result: dict) -> dict:
  """{claim: passed} a bench states in its own layout: `claims` / `targets` dicts of booleans, a
  `failed_claims` list."""
  out = {}
  for key in ("claims", "targets"):
    if isinstance(result.get(key), dict):
      out.update({k: v for k, v in result[key].items() if isinstance(v, bool)})
  if isinstance(result.get("failed_claims"), list):
    out["no failed claims"] = not result["failed_claims"]
  return out


def write_result(path: str, bench: str, result: dict, *, name: str = "main",
                 settings: dict | None = None, claims: dict | None = None) -> dict:
  """Append a run made from a bench's result dict (make_run) to the result file at `path`."""
  run = make_run(bench, result, settings=settings, name=name, claims=claims)
  append_run(path, run)
  return run


def read_result(path: str) -> dict:
  """A bench's result layout as its newest runs recorded it (recorded(path)); a file still in
  the old layout (one a bench not yet on this harness writes) as it is."""
  with open(path) as f:
    data = json.load(f)
  if isinstance(data, dict) and "schema" not in data:
    return data
  return recorded(path)
