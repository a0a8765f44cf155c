"""The claims of recorded runs, as functions of the stored numbers, and the doc quotes of them.

A claim is a statement about one run of a result file (a speedup over a target, a check against
the reference, a ratio that follows from the rows), written as a function of the run:

    @claim("compact_attention", run="launch_order", file="*H100*")
    def heads_fastest_launch_is_faster(rec, run):
      expect(rec["launch_order"][0]["speedup"] > 1.0, "heads-fastest is not faster")

`rec` is the bench's own layout as of that run (`common.recorded_from` over the file's runs up
to and including it; later runs do not change it), `run` the run record itself. The function
calls `expect` (with `approx` for tolerances) for each condition; a failed condition fails the claim with its
message as the detail.

The claims are evaluated twice: by the writer (`common.append_run` / `replace_last_run` records
every claim registered for the bench and the run's name on the run it writes, so a run that
misses one lands with `passed: false`), and by tests/bench/test_results.py, which re-evaluates
each one from the stored numbers of every file in bench/results and requires it to pass and to
agree with the recorded verdict. A claim registered for a run name that no result file holds
fails that check too (a renamed run cannot drop its claims silently).

Quotes (`@quote(doc, file, run=...)`): a function of the newest run of that name in that result
file returning the strings a doc (README.md, docs/performance.md, a package README) must
contain; the same check fails when the doc quotes a number the newest run no longer has.

One module per bench in this package registers its claims and quotes.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import math
import os
import pkgutil
from typing import Callable

CLAIMS: list["Claim"] = []
QUOTES: list["Quote"] = []


class ClaimFailed(Exception):
  """A condition of a claim does not hold on the run's numbers."""


@dataclasses.dataclass(frozen=True)
class Claim:
  bench: str
  run: tuple          # the run's settings["name"]: any of these (fnmatch patterns)
  file: str           # the result file's base name (fnmatch pattern)
  name: str
  fn: Callable

  def applies(self, bench: str, run_name: str, file: str) -> bool:
    return (bench == self.bench and any(fnmatch.fnmatchcase(run_name, r) for r in self.run)
            and fnmatch.fnmatchcase(file, self.file))


@dataclasses.dataclass(frozen=True)
class Quote:
  doc: str            # path from the repository root
  file: str           # result file's base name in bench/results
  run: tuple          # the newest run named any of these is quoted
  name: str
  fn: Callable


def claim(bench: str, *, run: str | tuple = "main", file: str = "*", name: str | None = None):
  """Register `fn(rec, run)` as a claim of every run of `bench` named `run` (a name or a tuple of
  names: a migrated run is named "main", the bench names a new one by its preset) in the files
  whose base name matches `file`; the claim's name is `name` or the function's, with spaces."""
  def deco(fn):
    runs = (run,) if isinstance(run, str) else tuple(run)
    CLAIMS.append(Claim(bench, runs, file, name or fn.__name__.replace("_", " "), fn))
    return fn
  return deco


def quote(doc: str, file: str, *, run: str | tuple = "main", name: str | None = None):
  """Register `fn(rec, run) -> [str]`: strings `doc` must contain, made from the newest run of
  bench/results/`file` named `run` (a name or a tuple of names, as for `claim`)."""
  def deco(fn):
    runs = (run,) if isinstance(run, str) else tuple(run)
    QUOTES.append(Quote(doc, file, runs, name or fn.__name__, fn))
    return fn
  return deco


def expect(cond, msg: str = "") -> None:
  """Fail the claim being evaluated, with `msg`, unless `cond` holds."""
  if not cond:
    raise ClaimFailed(str(msg) or "condition failed")


class approx:  # noqa: N801 (reads like pytest.approx, whose tolerances it takes)
  """`x == approx(want, rel=, abs=)`: within abs, or within rel of want (pytest.approx's rule:
  rel 1e-6 and abs 1e-12 by default; only abs where only abs is given)."""

  def __init__(self, want, rel=None, abs=None):  # noqa: A002
    self.want, self.rel, self.abs = want, rel, abs

  def __eq__(self, got):
    rel = 1e-6 if self.rel is None and self.abs is None else (self.rel or 0.0)
    tol = max(rel * math.fabs(self.want), 1e-12 if self.abs is None else self.abs)
    return math.fabs(got - self.want) <= tol

  def __repr__(self):
    return f"approx({self.want!r}, rel={self.rel}, abs={self.abs})"


def load_all() -> None:
  """Import every claims module of this package (each registers its claims on import)."""
  for m in pkgutil.iter_modules([os.path.dirname(__file__)]):
    importlib.import_module(f"{__name__}.{m.name}")


def view(runs: list[dict], i: int) -> dict:
  """The bench's layout as of runs[i]: recorded_from over runs[: i + 1]."""
  from bench import common
  return common.recorded_from(dict(runs=runs[: i + 1]))


def evaluate(file: str, runs: list[dict], i: int) -> list[dict]:
  """The registered claims of runs[i] of the result file named `file`, evaluated on the stored
  numbers: [{name, passed, detail}] (detail: the failed condition's message). A claim that
  raises (a missing key, a bench helper's ValueError) fails with the error as its detail, so a
  writer never loses the run it is saving."""
  load_all()
  run = runs[i]
  rname = run["settings"].get("name", "main")
  out = []
  rec = None
  for c in CLAIMS:
    if not c.applies(run["bench"], rname, os.path.basename(file)):
      continue
    rec = view(runs, i) if rec is None else rec
    try:
      c.fn(rec, run)
      out.append(dict(name=c.name, passed=True, detail={}))
    except Exception as e:  # noqa: BLE001 (any error fails the claim; the writer keeps the run)
      out.append(dict(name=c.name, passed=False, detail=dict(error=f"{type(e).__name__}: {e}")))
  return out


def record(file: str, runs: list[dict], i: int) -> None:
  """Evaluate runs[i]'s registered claims and record them on it (replacing same-named ones)."""
  got = evaluate(file, runs, i)
  names = {c["name"] for c in got}
  runs[i]["claims"] = [c for c in runs[i]["claims"] if c["name"] not in names] + got


def missing(q: Quote, text: str) -> list[str]:
  """The strings of `quoted(q)` that `text` (the doc) lacks, line breaks read as spaces."""
  flat = " ".join(text.split())
  return [t for t in quoted(q) if " ".join(t.split()) not in flat]


def quoted(q: Quote) -> list[str]:
  """The strings `q.doc` must contain, from the newest run named one of `q.run` of `q.file`."""
  from bench import common
  path = os.path.join(common.RESULTS, q.file)
  runs = common.load(path)["runs"]
  named = [k for k, r in enumerate(runs) if r["settings"].get("name") in q.run]
  if not named:
    raise ValueError(f"{path}: no run named {q.run}")
  i = max(named, key=lambda k: (common._timestamp(runs[k]["date"]), k))
  return list(q.fn(view(runs, i), runs[i]))
