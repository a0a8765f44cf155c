"""Metric sinks: JSON lines + TensorBoard (host 0 only) and a console progress bar.

A metric is a scalar or a 1-D array (per layer, as schemes return them). In
`<workdir>/metrics.jsonl` an array stays a list and `<name>/mean` is added; in TensorBoard
(`<workdir>/tb`) it becomes `<name>/layer_<i>` scalars plus `<name>/mean`.
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

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self._tb = None
    self._f = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._f = open(os.path.join(workdir, "metrics.jsonl"), "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), flush_secs=30)

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
