"""PNG figures of a head-to-head report (matplotlib, Agg backend).

  accuracy_vs_length(report, path)   mean accuracy over the suite's tasks per length, a line
                                     per model
  accuracy_vs_ttft(report, path)     one panel per length: mean accuracy vs TTFT, a point per
                                     model; models of one threshold sweep (same checkpoint,
                                     one knob varied) joined by a line, in knob order (L2A paper
                                     Fig. 13: accuracy vs TTFT over theta)
  routing_heatmaps(model_result, path)  the scheme's routing statistics: per-layer statistics as
                                     a task x layer heatmap, per layer x head statistics as one
                                     layer x head heatmap per task (mean over the lengths)
"""
from __future__ import annotations

import numpy as np


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _lengths(report) -> list[str]:
  return [str(x) for x in report["knobs"]["lengths"]]


def accuracy_vs_length(report: dict, path: str) -> str:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6, 4))
  Ls = _lengths(report)
  for m in report["models"]:
    ax.plot([int(L) for L in Ls], [m["mean_accuracy"].get(L, np.nan) for L in Ls], marker="o",
            label=m["name"])
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("mean accuracy over tasks")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(f"suite {report['knobs']['suite']}")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def sweep_groups(report: dict) -> dict[str, list[int]]:
  """{sweep label: [model indices in knob order]} for models that differ from each other only
  by one swept knob (knobs['sweep'] = {knob: value}); labels name checkpoint and knob."""
  groups: dict[str, list[tuple[float, int]]] = {}
  for i, m in enumerate(report["models"]):
    sw = m["knobs"].get("sweep")
    if not sw:
      continue
    (knob, value), = sw.items()
    label = f"{m['knobs'].get('checkpoint', m['name'])}: {knob}"
    groups.setdefault(label, []).append((float(value), i))
  return {k: [i for _, i in sorted(v)] for k, v in groups.items()}


def accuracy_vs_ttft(report: dict, path: str) -> str:
  plt = _plt()
  Ls = _lengths(report)
  fig, axes = plt.subplots(1, len(Ls), figsize=(4.5 * len(Ls), 4), squeeze=False)
  groups = sweep_groups(report)
  for ax, L in zip(axes[0], Ls):
    for m in report["models"]:
      e = m["efficiency"].get(L)
      if e:
        ax.scatter([1e3 * e["ttft_s"]], [m["mean_accuracy"][L]], s=18)
        ax.annotate(m["name"], (1e3 * e["ttft_s"], m["mean_accuracy"][L]), fontsize=6)
    for label, idx in groups.items():
      ms = [report["models"][i] for i in idx]
      ax.plot([1e3 * m["efficiency"][L]["ttft_s"] for m in ms],
              [m["mean_accuracy"][L] for m in ms], marker="o", label=label.split("/")[-1])
    ax.set_xlabel("TTFT (ms, batch of %d)" % report["knobs"]["batch_size"])
    ax.set_ylabel("mean accuracy")
    ax.set_title(f"length {L}")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if groups:
      ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def routing_arrays(model_result: dict) -> dict[str, dict[str, np.ndarray]]:
  """{statistic: {task: array [L] or [L, N]}}: the mean over the lengths of each task."""
  out: dict[str, dict[str, list]] = {}
  for task, by_len in model_result.get("routing", {}).items():
    for stats in by_len.values():
      for k, v in stats.items():
        out.setdefault(k, {}).setdefault(task, []).append(np.asarray(v, np.float64))
  return {k: {t: np.mean(np.stack(v), axis=0) for t, v in d.items()} for k, d in out.items()}


def routing_heatmaps(model_result: dict, path: str) -> str | None:
  """One figure: a task x layer heatmap per per-layer statistic, and per layer x head
  statistic one layer x head heatmap per task. None when the model reports no routing."""
  arrs = routing_arrays(model_result)
  if not arrs:
    return None
  plt = _plt()
  panels = []
  for k, by_task in arrs.items():
    tasks = sorted(by_task)
    if all(by_task[t].ndim == 1 for t in tasks):
      panels.append((f"{k}: task x layer", np.stack([by_task[t] for t in tasks]), tasks,
                     "layer"))
    else:
      for t in tasks:
        panels.append((f"{k}: {t} (layer x head)", by_task[t], None, "head"))
  cols = min(4, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.axis("off")
  for ax, (title, a, ylabels, xlabel) in zip(axes.flat, panels):
    im = ax.imshow(a, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_title(title, fontsize=7)
    ax.set_xlabel(xlabel, fontsize=7)
    if ylabels is not None:
      ax.set_yticks(range(len(ylabels)))
      ax.set_yticklabels(ylabels, fontsize=6)
    else:
      ax.set_ylabel("layer", fontsize=7)
      ax.set_yticks(range(a.shape[0]))
    if a.ndim == 2 and a.shape[1] <= 32:
      ax.set_xticks(range(a.shape[1]))
    fig.colorbar(im, ax=ax, fraction=0.046)
  fig.suptitle(model_result["name"], fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
