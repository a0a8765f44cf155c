"""L2A measurements: per-layer sparsity on held-out data (the one sparsity measure), KV-cache
bytes, and the one pruning report (docs/schemes/l2a.md#metrics; run by scripts/l2a_prune.py).

  rep = prune_report(model, params, batches, context_len=131072)       # measure, prune, KV bytes
  rep = prune_and_evaluate(config, params, model_cfg, mesh, threshold=0.95, context_len=131072)
                                     # the same on the eval harness's held-out batches, with the
                                     # eval metrics before and after pruning
  rep['report']   JSON-ready: layer_sparsity, pruned_layers, kv bytes (dense base / L2A before /
                  after pruning)[, eval metrics before and after pruning]
  rep['config'], rep['params']   the pruned model
  write(rep['report'], out_dir)   JSON + markdown + per-layer sparsity plot
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.attention.l2a.convert import prune
from condattn_jax.attention import configure, options, write_report_json
from condattn_jax.models.config import ModelConfig

# ----------------------------------------------------------------------------------------------
# Measuring sparsity, KV-cache bytes
# ----------------------------------------------------------------------------------------------
def measure_sparsity(model, params, batches, *, out_dir: str | None = None,
                     name: str = "l2a_sparsity", theta: float | None = None) -> dict[str, Any]:
  """Per-layer sparsity (fraction of non-padding tokens with d = 0) over held-out batches
  (`Scheme.reports` signature).

  model: a Decoder with an L2A config (theta overrides its threshold); batches: iterable of dicts
  with `inputs` (+ optional `positions`, `segment_ids`). Returns {'layer_sparsity': [L],
  'sparsity': mean over layers with a global branch, 'tokens': count} (+ 'json' with out_dir).
  """
  from condattn_jax.models.decoder import Decoder  # avoid an import cycle at module load

  cfg = model.config
  if theta is not None:
    cfg = configure(cfg, "l2a", theta=float(theta))
  m = Decoder(cfg)

  @jax.jit
  def counts(params, inputs, positions, segment_ids):
    _, aux = m.apply({"params": params}, inputs, positions, segment_ids)
    return jnp.sum(aux["global_tokens_B"], axis=1), jnp.sum(aux["tokens_B"], axis=1)

  glob = tokens = None
  for batch in batches:
    inputs = jnp.asarray(batch["inputs"])
    pos = batch.get("positions")
    seg = batch.get("segment_ids")
    g, t = counts(params, inputs, None if pos is None else jnp.asarray(pos),
                  None if seg is None else jnp.asarray(seg))
    g, t = np.asarray(g, np.float64), np.asarray(t, np.float64)
    glob = g if glob is None else glob + g
    tokens = t if tokens is None else tokens + t
  if glob is None:
    raise ValueError("measure_sparsity: no batches.")
  layer_sparsity = 1.0 - glob / np.maximum(tokens, 1.0)
  opts = options(cfg)
  live = [i for i in range(cfg.num_layers) if i not in opts.pruned_layers]
  return write_report_json({"layer_sparsity": [float(x) for x in layer_sparsity],
                            "sparsity": float(np.mean(layer_sparsity[live])) if live else 1.0,
                            "tokens": float(tokens[0])}, out_dir, name)


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Decode KV-cache bytes of an L2A model at `context_len` tokens (K and V only): per layer a
  window ring of min(w, context_len) slots for `self_attn`, plus a full cache of context_len
  slots for `global_attn` unless the layer is pruned. Returns {'total', 'full', 'window'}."""
  from condattn_jax.attention import dense
  o = options(config)
  one = dense.kv_cache_bytes(config.replace(num_layers=1, sliding_window=None), context_len,
                             batch, dtype)["total"] // max(context_len, 1)  # bytes per token
  live = config.num_layers - len(set(o.pruned_layers))
  window = config.num_layers * min(o.window, context_len) * one
  full = live * context_len * one
  return {"total": int(full + window), "full": int(full), "window": int(window)}


def kv_bytes_report(config: ModelConfig, pruned: ModelConfig, context_len: int,
                    dtype: str | None = None) -> dict[str, Any]:
  """KV-cache bytes of the dense base model, the L2A model before pruning and after, and the
  reductions relative to both (one context of `context_len` tokens)."""
  from condattn_jax.attention import dense as dense_scheme
  base = config.replace(scheme="dense", scheme_kwargs=(), sliding_window=None)
  dense = dense_scheme.kv_cache_bytes(base, context_len, dtype=dtype)["total"]
  before = kv_cache_bytes(config, context_len, dtype=dtype)["total"]
  after = kv_cache_bytes(pruned, context_len, dtype=dtype)["total"]
  return {
      "kv_bytes_dense_base": dense,
      "kv_bytes_before": before,
      "kv_bytes_after": after,
      "kv_reduction_vs_before": 1.0 - after / max(before, 1),
      "kv_reduction_vs_dense": 1.0 - after / max(dense, 1),
  }


def prune_report(model, params, batches, *, out_dir: str | None = None,
                 name: str = "l2a_prune", context_len: int, threshold: float = 0.95,
                 theta: float | None = None, dtype: str | None = None) -> dict[str, Any]:
  """Measure per-layer sparsity, prune layers >= threshold, report KV-cache bytes
  (`Scheme.reports` signature).

  Returns a dict with the pruned config and params under 'config' / 'params' and a JSON-ready
  'report': layer_sparsity, pruned_layers, kv bytes for the dense base model, the L2A model before
  pruning and after, and the reduction relative to both. With out_dir, `write` puts the report
  there (<name>.json, <name>.md, <name>_layers.png; paths under 'json', 'md', 'png').
  """
  cfg = model.config
  if theta is not None:
    cfg = configure(cfg, "l2a", theta=float(theta))
  from condattn_jax.models.decoder import Decoder
  meas = measure_sparsity(Decoder(cfg), params, batches)
  pcfg, pparams, new = prune(params, cfg, meas["layer_sparsity"], threshold)
  report = {
      "context_len": int(context_len),
      "threshold": float(threshold),
      "theta": float(options(cfg).theta),
      "layer_sparsity": meas["layer_sparsity"],
      "sparsity": meas["sparsity"],
      "pruned_layers": list(options(pcfg).pruned_layers),
      "newly_pruned": list(new),
      **kv_bytes_report(cfg, pcfg, context_len, dtype),
  }
  rep = {"config": pcfg, "params": pparams, "report": report}
  if out_dir is not None:
    rep["json"], rep["md"] = write(report, out_dir, name)
    rep["png"] = os.path.join(out_dir, name + "_layers.png")
  return rep


# ----------------------------------------------------------------------------------------------
# The pruning report on the eval harness's held-out data, written as JSON / markdown / plot
# ----------------------------------------------------------------------------------------------
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
  """`prune_report` on the eval harness's held-out batches (config.eval.num_batches batches of
  length eval_len, default data.seq_len), with the eval metrics before and after pruning
  (report keys eval_len, window, eval_before, eval_after added). `config` is the run config."""
  from condattn_jax import evaluation
  from condattn_jax.data import make_eval_batches
  from condattn_jax.evaluation.perplexity import eval_data_config
  from condattn_jax.models.decoder import Decoder
  if model_cfg.scheme != "l2a":
    raise ValueError(f"L2A pruning needs model.scheme.name='l2a', got {model_cfg.scheme!r}.")
  L = int(eval_len or config.data.seq_len)
  ctx = int(context_len or config.data.seq_len)
  before = evaluation.evaluate(config, params, model_cfg, mesh, lengths=[L])["results"][L]
  # the one sparsity measure (token-weighted over the same held-out batches as the eval)
  batches = make_eval_batches(eval_data_config(config, L), int(config.eval.num_batches),
                              int(config.eval.seed))
  rep = prune_report(Decoder(model_cfg), params, batches, context_len=ctx, threshold=threshold)
  after = evaluation.evaluate(config, rep["params"], rep["config"], mesh,
                              lengths=[L])["results"][L]
  rep["report"].update(eval_len=L, window=int(options(model_cfg).window),
                       eval_before=_summary(before), eval_after=_summary(after))
  return rep


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
            f"({_vs_dense(report['kv_reduction_vs_dense'])})"]
  if "eval_before" not in report:  # prune_report alone: no evaluation
    return "\n".join(lines) + "\n"
  lines += ["", "| | token acc | exact match | ppl | sparsity |", "|---|---|---|---|---|"]
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
