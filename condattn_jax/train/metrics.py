"""Metric sinks: JSON lines + TensorBoard event files (host 0 only), a console progress bar and
a PNG plot.

A metric is a scalar or an array (per layer [L], per layer and head [L, N], as schemes return
them). In `<workdir>/metrics.jsonl` an array stays a (nested) list and `<name>/mean` is added; in
the TensorBoard event files (`<workdir>/tb`, written with tensorboardX) it becomes
`<name>/layer_<i>[/head_<j>]` scalars plus `<name>/mean`. Viewing them needs the `tensorboard`
package (`pip install tensorboard; tensorboard --logdir <workdir>/tb`); without it,
`<workdir>/metrics.png` (`plot_metrics`, written at the end of every run and on a stop) shows
the training loss, the lr and the scheme's headline metric.

Resume: `drop_records_after(workdir, step)` removes the records of steps after the checkpoint a
run resumes from (written before a kill -9 / second Ctrl-C, redone by the resumed run), and
`MetricWriter(purge_step=step + 1)` makes TensorBoard drop them from the event files too; so
every step has one record.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import numpy as np


def to_python(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """numpy / jax values -> floats and lists (+ name/mean for arrays)."""
  out = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.ndim == 0:
      out[k] = a.item() if a.dtype.kind in "iub" else float(a)
    else:
      out[k] = a.astype(np.float64).tolist()  # nested lists keep [L] / [L, N] shapes
      out[f"{k}/mean"] = float(a.mean())
  return out


class MetricWriter:
  """Appends to metrics.jsonl and writes TensorBoard scalars; a no-op on non-zero processes."""

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
               purge_step: int | None = None):
    self.enabled = enabled
    self._tb = None
    self._f = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._f = open(os.path.join(workdir, "metrics.jsonl"), "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), flush_secs=30, purge_step=purge_step)

  def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
    if not self.enabled:
      return
    m = to_python(metrics)
    rec = {"step": int(step), **{prefix + k: v for k, v in m.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in m.items():
        if isinstance(v, list):
          for idx, x in np.ndenumerate(np.asarray(v)):  # per layer (and per head: [L, N])
            name = "/".join(f"{n}_{i}" for n, i in zip(("layer", "head"), idx))
            self._tb.add_scalar(f"{prefix}{k}/{name}", float(x), step)
        elif isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(prefix + k, v, step)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def read_records(workdir: str) -> list[dict]:
  """The records of <workdir>/metrics.jsonl in file order (a torn last line is skipped)."""
  out = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        try:
          rec = json.loads(line)
        except ValueError:
          continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
          out.append(rec)
  except FileNotFoundError:
    pass
  return out


def drop_records_after(workdir: str, step: int | None) -> int:
  """Rewrites <workdir>/metrics.jsonl without the records of steps > `step` (None: all records,
  a run restarting from scratch) and torn lines; returns how many lines were dropped. The
  resumed run writes those steps again, so each step keeps one record."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if step is not None and isinstance(rec, dict) and isinstance(rec.get("step"), int) \
        and rec["step"] <= step:
      keep.append(line if line.endswith("\n") else line + "\n")
  if len(keep) == len(lines):
    return 0
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return len(lines) - len(keep)


def plot_metrics(workdir: str, headline: str | None = None, out: str | None = None) -> str | None:
  """Writes <workdir>/metrics.png (or `out`) from metrics.jsonl with matplotlib's Agg backend:
  training loss (and eval loss when recorded), lr, and the scheme's headline metric (its mean
  over layers, e.g. 'l2a/sparsity'; accuracy when the scheme has none). Returns the path, or None
  when there are no training records yet."""
  recs = [r for r in read_records(workdir) if "train/loss" in r]
  if not recs:
    return None
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  def series(name, records):
    pts = [(r["step"], r.get(f"{name}/mean", r.get(name))) for r in records]
    pts = [(s, v) for s, v in pts if isinstance(v, (int, float)) and math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]

  evals = [r for r in read_records(workdir) if any(k.startswith("eval/") for k in r)]
  third = f"train/{headline}" if headline else "train/accuracy"
  panels = [("loss", ["train/loss"]), ("lr", ["train/lr"]),
            (headline or "accuracy", [third])]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  for ax, (title, names) in zip(axes, panels):
    for name in names:
      xs, ys = series(name, recs)
      if xs:
        ax.plot(xs, ys, label=name)
    if title == "loss":
      ekeys = sorted({k for r in evals for k in r if k.startswith("eval/") and k.endswith("/loss")})
      for k in ekeys:
        xs, ys = series(k, evals)
        if xs:
          ax.plot(xs, ys, "o--", label=k)
    ax.set_title(title + (" (mean over layers)" if headline and title == headline else ""))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
  fig.suptitle(os.path.basename(os.path.abspath(workdir)))
  fig.tight_layout()
  out = out or os.path.join(workdir, "metrics.png")
  fig.savefig(out, dpi=90)
  plt.close(fig)
  return out


def _fmt_time(s: float) -> str:
  if not math.isfinite(s):
    return "?"
  s = int(s)
  h, r = divmod(s, 3600)
  m, s = divmod(r, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _fmt_num(x: float) -> str:
  for unit, d in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if x >= d:
      return f"{x / d:.1f}{unit}"
  return f"{x:.0f}"


class ProgressBar:
  """`step 120/1000 [=====>     ] 12% loss 2.310 acc 0.41 | 5.2k tok/s | ETA 3m12s`.

  Redraws in place on a terminal; prints one line per update otherwise (logs, CI)."""

  def __init__(self, total: int, start: int = 0, *, enabled: bool = True, stream=None,
               width: int = 24):
    self.total, self.start = total, start
    self.enabled = enabled
    self.stream = stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.width = width
    self.t0 = time.time()

  def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None,
             extra: Mapping[str, float] | None = None) -> None:
    if not self.enabled:
      return
    frac = step / max(self.total, 1)
    done = int(self.width * frac)
    bar = "=" * done + (">" if done < self.width else "") + " " * max(self.width - done - 1, 0)
    rate = (step - self.start) / max(time.time() - self.t0, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    parts = [f"step {step}/{self.total} [{bar}] {100 * frac:3.0f}%"]
    if loss is not None:
      parts.append(f"loss {loss:.4f}")
    for k, v in (extra or {}).items():
      parts.append(f"{k} {v:.3f}")
    line = " ".join(parts)
    if tokens_per_s is not None:
      line += f" | {_fmt_num(tokens_per_s)} tok/s"
    line += f" | ETA {_fmt_time(eta)}"
    if self.tty:
      self.stream.write("\r" + line + "\033[K")
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled and self.tty:
      self.stream.write("\n")
      self.stream.flush()
