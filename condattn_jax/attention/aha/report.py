"""AHA measurements (docs/schemes/aha.md#metrics): KV-cache bytes, full-attention usage mu_f per layer x
head and per task, the per-head gap between full-attention calls, the layer x head heatmap."""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.models.config import ModelConfig


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Decode KV-cache bytes of an AHA model at `context_len` tokens (K and V only): ONE full cache
  of context_len slots per layer, shared by both paths (routed-local heads read only its last w
  slots). Returns {'total', 'full', 'window'} (window = 0: there is no separate ring)."""
  from condattn_jax.attention import dense
  full = dense.kv_cache_bytes(config.replace(scheme="dense", scheme_kwargs=(),
                                             sliding_window=None),
                              context_len, batch, dtype)["total"]
  return {"total": int(full), "full": int(full), "window": 0}


# ----------------------------------------------------------------------------------------------
# Usage (mu_f) per layer x head and per task, per-head gap (paper Table 3), heatmap (Fig. 3)
# ----------------------------------------------------------------------------------------------
def _doc_starts(segment_ids_BT):
  """Index of the first token of each token's (contiguous) document [B, T]."""
  B, T = segment_ids_BT.shape
  idx = np.broadcast_to(np.arange(T), (B, T))
  prev = np.concatenate([np.full((B, 1), -1), segment_ids_BT[:, :-1]], axis=1)
  return np.maximum.accumulate(np.where(segment_ids_BT != prev, idx, 0), axis=1)


def gap_counts(gate_LBTN, segment_ids_BT=None):
  """(gap_sum [L, B, N], gap_count [L, B, N]): for each full-attention trigger of a head with an
  earlier trigger in the same document, the tokens since that earlier trigger (summed) and how
  many such gaps there are. The paper's gap (mean tokens between consecutive full-attention
  calls of a head) = gap_sum / gap_count. gate: bool (padding never triggers)."""
  g = np.asarray(gate_LBTN, bool)
  L, B, T, N = g.shape
  seg = np.ones((B, T), np.int64) if segment_ids_BT is None else np.asarray(segment_ids_BT)
  start = _doc_starts(seg)[None, :, :, None]                            # [1, B, T, 1]
  t = np.arange(T)[None, None, :, None]
  last = np.maximum.accumulate(np.where(g, t, -1), axis=2)              # last trigger <= t
  prev = np.concatenate([np.full((L, B, 1, N), -1), last[:, :, :-1]], axis=2)  # < t
  has = g & (prev >= start)
  return (np.sum(np.where(has, t - prev, 0), axis=2).astype(np.float64),
          np.sum(has, axis=2).astype(np.float64))


def _summary(full_LN, tokens, gap_sum_LN, gap_count_LN):
  usage = full_LN / max(tokens, 1.0)
  gap = np.where(gap_count_LN > 0, gap_sum_LN / np.maximum(gap_count_LN, 1), np.nan)
  return {"tokens": float(tokens), "mu_f": float(usage.mean()),
          "usage": usage.tolist(), "usage_layer": usage.mean(axis=1).tolist(),
          "gap": [[None if np.isnan(x) else float(x) for x in row] for row in gap],
          "heads_by_usage": sorted(usage.ravel().tolist(), reverse=True)}


def measure_usage(model, params, batches, *, out_dir: str | None = None,
                  name: str = "aha_usage", tau: float | None = None) -> dict[str, Any]:
  """Full-attention usage on held-out batches: mu_f per layer x head (paper eq. 8 and Fig. 3),
  per task id (rows' batch['task_ids']), and the per-head gap (paper Table 3)
  (`Scheme.reports` signature; with out_dir also <out_dir>/<name>.json, path under 'json').

  model: a Decoder with an AHA config (tau overrides its threshold); batches: iterable of dicts
  with `inputs` (+ optional `positions`, `segment_ids`, `task_ids` [B]). Returns a JSON-ready
  dict: tau, window, tokens, mu_f, usage [L][N], usage_layer [L], gap [L][N] (None: the head
  never fired twice in one document), heads_by_usage (paper Fig. 4), and under 'tasks' the same
  per task id.
  """
  from condattn_jax.attention import configure, options
  from condattn_jax.models.decoder import Decoder  # avoid an import cycle at module load

  cfg = model.config
  if tau is not None:
    cfg = configure(cfg, "aha", tau=float(tau))
  m = Decoder(cfg)

  @jax.jit
  def gates(params, inputs, positions, segment_ids):
    _, st = m.apply({"params": params}, inputs, positions, segment_ids,
                    mutable=["intermediates"])
    return st["intermediates"]["layers"]["gate"][0]                      # [L, B, T, N]

  acc: dict[Any, list] = {}

  def add(key, full_LN, tokens, gs_LN, gc_LN):
    a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0])
    for i, x in enumerate((full_LN, tokens, gs_LN, gc_LN)):
      a[i] = a[i] + x

  seen = False
  for batch in batches:
    seen = True
    inputs = jnp.asarray(batch["inputs"])
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    g = np.asarray(gates(params, inputs, None if pos is None else jnp.asarray(pos),
                         None if seg is None else jnp.asarray(seg)))
    seg_np = None if seg is None else np.asarray(seg)
    valid_B = (np.full(g.shape[1], g.shape[2], np.float64) if seg_np is None
               else np.sum(seg_np != 0, axis=1).astype(np.float64))
    full_LBN = np.sum(g, axis=2).astype(np.float64)
    gs, gc = gap_counts(g, seg_np)
    tasks = batch.get("task_ids")
    tasks = [None] * g.shape[1] if tasks is None else [int(t) for t in np.asarray(tasks)]
    for b, task in enumerate(tasks):
      for key in ("all", task) if task is not None else ("all",):
        add(key, full_LBN[:, b], valid_B[b], gs[:, b], gc[:, b])
  if not seen:
    raise ValueError("measure_usage: no batches.")
  o = options(cfg)
  out = {"tau": float(o.tau), "window": int(o.window), **_summary(*acc.pop("all"))}
  out["tasks"] = {str(k): _summary(*v) for k, v in sorted(acc.items())}
  from condattn_jax.attention import write_report_json
  return write_report_json(out, out_dir, name)


def plot_usage_heatmap(usage, path: str, *, title: str | None = None,
                       tasks: dict[str, Any] | None = None) -> str:
  """PNG heatmap of mu_f, layer (rows) x head (columns), colour 0 (local) .. 1 (full), like the
  paper's Fig. 3; with `tasks` ({name: usage [L][N]}) one more panel per task. Returns path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  panels = [("all" if tasks else (title or "mu_f"), np.asarray(usage, np.float64))]
  panels += [(f"task {k}", np.asarray(v, np.float64)) for k, v in (tasks or {}).items()]
  L, N = panels[0][1].shape
  fig, axes = plt.subplots(1, len(panels), figsize=(1.0 + len(panels) * max(2.5, 0.35 * N),
                                                   1.2 + max(2.0, 0.3 * L)), squeeze=False)
  for ax, (name, u) in zip(axes[0], panels):
    im = ax.imshow(u, vmin=0.0, vmax=1.0, cmap="Blues_r", aspect="auto")
    ax.set_title(f"{name}: mu_f {u.mean():.3f}", fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="full-attention usage")
  if title and tasks:
    fig.suptitle(title)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def usage_report(model, params, batches, *, out_dir: str | None = None,
                 name: str = "aha_usage", tau: float | None = None) -> dict[str, Any]:
  """measure_usage + the heatmap (`Scheme.reports` signature): with out_dir, writes
  <out_dir>/<name>.json and <name>.png (a panel per task when the batches carry task ids).
  Returns the measured dict (with the two paths under 'json' / 'png')."""
  rep = measure_usage(model, params, batches, tau=tau)
  if out_dir is None:
    return rep
  from condattn_jax.attention import write_report_json
  os.makedirs(out_dir, exist_ok=True)
  png = plot_usage_heatmap(rep["usage"], os.path.join(out_dir, f"{name}.png"),
                           title=f"AHA full-attention usage (w={rep['window']}, tau={rep['tau']})",
                           tasks={k: v["usage"] for k, v in rep["tasks"].items()} or None)
  return write_report_json({**rep, "png": png}, out_dir, name)
