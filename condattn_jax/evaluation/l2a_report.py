"""L2A's section of the evaluation: per-layer sparsity on held-out data, post-training pruning and
the KV-cache bytes report (SCHEMES.md 1; run by scripts/l2a_prune.py).

  rep = prune_and_evaluate(config, params, model_cfg, mesh, threshold=0.95, context_len=131072)
  rep['report']   JSON-ready: layer_sparsity, pruned_layers, kv bytes (dense base / L2A before /
                  after pruning), eval metrics before and after pruning
  rep['config'], rep['params']   the pruned model
"""
from __future__ import annotations

import json
import os
from typing import Any

from condattn_jax.attention import l2a, options
from condattn_jax.data import make_eval_batches
from condattn_jax.evaluation.perplexity import eval_data_config
from condattn_jax.models.decoder import Decoder


def layer_sparsity(eval_row: dict, num_layers: int) -> list[float]:
  """Per-layer sparsity as the eval harness reported it (aux/l2a/sparsity_layer_i: the L2A
  layer's own count, 1 - global tokens / valid tokens, averaged over the eval batches)."""
  keys = [f"aux/l2a/sparsity_layer_{i}" for i in range(num_layers)]
  missing = [k for k in keys if k not in eval_row]
  if missing:
    raise ValueError(f"eval results lack {missing[:3]}: is model.scheme.name 'l2a'?")
  return [float(eval_row[k]) for k in keys]


def _summary(row: dict) -> dict:
  keep = ("ce", "ppl", "token_acc", "exact_match", "tokens", "aux/l2a/sparsity")
  return {k: row[k] for k in keep if k in row}


def prune_and_evaluate(config, params, model_cfg, mesh, *, threshold: float = 0.95,
                       context_len: int | None = None, eval_len: int | None = None
                       ) -> dict[str, Any]:
  """Measure per-layer sparsity (`l2a.measure_sparsity`) on the eval harness's held-out batches
  (config.eval.num_batches batches of length eval_len), prune layers >= threshold, re-evaluate,
  report KV-cache bytes."""
  from condattn_jax import evaluation
  if model_cfg.scheme != "l2a":
    raise ValueError(f"L2A pruning needs model.scheme.name='l2a', got {model_cfg.scheme!r}.")
  L = int(eval_len or config.data.seq_len)
  ctx = int(context_len or config.data.seq_len)
  before = evaluation.evaluate(config, params, model_cfg, mesh, lengths=[L])["results"][L]
  # the one sparsity measure (token-weighted over the same held-out batches as the eval)
  batches = make_eval_batches(eval_data_config(config, L), int(config.eval.num_batches),
                              int(config.eval.seed))
  sp = l2a.measure_sparsity(Decoder(model_cfg), params, batches)["layer_sparsity"]
  pcfg, pparams, new = l2a.prune(params, model_cfg, sp, threshold)
  after = evaluation.evaluate(config, pparams, pcfg, mesh, lengths=[L])["results"][L]
  opts = options(pcfg)
  report = {
      "eval_len": L,
      "context_len": ctx,
      "threshold": float(threshold),
      "theta": float(opts.theta),
      "window": int(opts.window),
      "layer_sparsity": sp,
      "pruned_layers": list(opts.pruned_layers),
      "newly_pruned": list(new),
      **l2a.kv_bytes_report(model_cfg, pcfg, ctx),
      "eval_before": _summary(before),
      "eval_after": _summary(after),
  }
  return {"report": report, "config": pcfg, "params": pparams}


def _bytes(b: float) -> str:
  for unit, d in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if b >= d:
      return f"{b / d:,.1f} {unit}"
  return f"{int(b)} B"


def _vs_dense(reduction: float) -> str:
  """'12.5% less than' / '12.5% more than' the dense base (a reduction < 0 is more)."""
  return f"{100 * abs(reduction):.1f}% {'less' if reduction >= 0 else 'more'} than the dense base"


def markdown(report: dict) -> str:
  mib = _bytes
  lines = [f"### L2A pruning (threshold {report['threshold']}, theta {report['theta']})", "",
           "| layer | sparsity | pruned |", "|---|---|---|"]
  for i, s in enumerate(report["layer_sparsity"]):
    lines.append(f"| {i} | {s:.4f} | {'yes' if i in report['pruned_layers'] else ''} |")
  lines += ["", f"KV cache at {report['context_len']} tokens (batch 1): dense base "
            f"{mib(report['kv_bytes_dense_base'])}, L2A before {mib(report['kv_bytes_before'])}, "
            f"after {mib(report['kv_bytes_after'])} "
            f"({_vs_dense(report['kv_reduction_vs_dense'])})", "",
            "| | token acc | exact match | ppl | sparsity |", "|---|---|---|---|---|"]
  for name in ("eval_before", "eval_after"):
    r = report[name]
    lines.append(f"| {name[5:]} | {r.get('token_acc', float('nan')):.4f} | "
                 f"{r.get('exact_match', float('nan')):.4f} | {r.get('ppl', float('nan')):.3f} | "
                 f"{r.get('aux/l2a/sparsity', float('nan')):.4f} |")
  return "\n".join(lines) + "\n"


def plot_layer_sparsity(report: dict, path: str) -> str:
  """Per-layer sparsity bars (paper Fig. 3) with the pruning threshold; pruned layers hatched."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sp = report["layer_sparsity"]
  fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(sp) + 1.5), 3.0))
  bars = ax.bar(range(len(sp)), sp, color="tab:blue")
  for i, b in enumerate(bars):
    if i in report["pruned_layers"]:
      b.set_hatch("//")
      b.set_color("tab:gray")
  ax.axhline(report["threshold"], color="tab:red", ls="--", lw=1, label=f"prune >= {report['threshold']}")
  ax.set_xlabel("layer")
  ax.set_ylabel("sparsity (tokens skipping global)")
  ax.set_ylim(0, 1.02)
  ax.set_title(f"L2A per-layer sparsity (theta {report['theta']})")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write(report: dict, out_dir: str, name: str = "l2a_prune") -> tuple[str, str]:
  os.makedirs(out_dir, exist_ok=True)
  jp, mp = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".md")
  with open(jp, "w") as f:
    json.dump(report, f, indent=2)
  with open(mp, "w") as f:
    f.write(markdown(report))
  plot_layer_sparsity(report, os.path.join(out_dir, name + "_layers.png"))
  return jp, mp
