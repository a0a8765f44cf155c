"""Elastic measurements (docs/schemes/elastic.md#metrics): KV-cache bytes, Omega_MSR / Omega_ESR per task,
per-head FA frequency (layer x query head) and its heatmap (paper Fig. 6)."""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.models.config import ModelConfig


def kv_cache_bytes(config: ModelConfig, context_len: int, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Decode KV-cache bytes at `context_len` tokens: ONE full cache per layer (FA heads need the
  whole prefix; SSA heads read their sink and local blocks of it) plus the cached decision
  (float32 [B, K, 2]: the modes and their router probability, + int32 [B] per layer).
  {'total', 'full', 'decision'}."""
  from condattn_jax.attention import dense
  full = dense.kv_cache_bytes(config.replace(scheme="dense", scheme_kwargs=(),
                                             sliding_window=None), context_len, batch,
                              dtype)["total"]
  decision = config.num_layers * batch * (8 * config.num_kv_heads + 4)
  return {"total": int(full + decision), "full": int(full), "decision": int(decision)}


def measure(model, params, batches, *, out_dir: str | None = None,
            name: str = "elastic_sparsity") -> dict[str, Any]:
  """Eval-mode (argmax, no noise) decisions of `model` (a Decoder with an Elastic config) on
  `batches` (dicts with inputs [+ positions, segment_ids, task_ids [B], the prompt field]): per
  task id and overall, samples, Omega_MSR (mean per-sample fraction of query heads in class 0),
  Omega_ESR (mean fraction of causal pairs skipped), fa_freq [L][N] (class-1 frequency per layer
  x query head). `Scheme.reports` signature (with out_dir also <out_dir>/<name>.json)."""
  from condattn_jax.attention import options, write_report_json
  from condattn_jax.models.decoder import Decoder
  o = options(model.config)
  m = Decoder(model.config)

  @jax.jit
  def decide(params, inputs, positions, segment_ids, fields):
    _, aux = m.apply({"params": params}, inputs, positions, segment_ids, fields=fields)
    return aux["fa_BK"], aux["rho_BN"]                                    # [L, B, K], [L, B, N]

  acc: dict[str, list] = {}
  seen = False
  for batch in batches:
    seen = True
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    fields = {o.prompt_field: jnp.asarray(batch[o.prompt_field])} if o.prompt_field in batch \
        else {}
    fa, rho = decide(params, jnp.asarray(batch["inputs"]),
                     None if pos is None else jnp.asarray(pos),
                     None if seg is None else jnp.asarray(seg), fields)
    fa, rho = np.asarray(fa, np.float64), np.asarray(rho, np.float64)
    G = rho.shape[2] // fa.shape[2]
    fa_N = np.repeat(fa, G, axis=2)                                       # [L, B, N]
    tasks = batch.get("task_ids")
    tasks = np.zeros(fa.shape[1], np.int64) if tasks is None else np.asarray(tasks)
    for b, t in enumerate(tasks):
      for key in ("all", o.task_names[int(t)]):
        a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += 1.0 - fa_N[:, b].mean()
        a[2] += rho[:, b].mean()
        a[3] = a[3] + fa_N[:, b]
  if not seen:
    raise ValueError("elastic measure: no batches.")
  summary = lambda a: {"samples": int(a[0]), "omega_msr": a[1] / a[0], "omega_esr": a[2] / a[0],
                       "fa_freq": (a[3] / a[0]).tolist()}
  out = {"modes": o.modes, **summary(acc.pop("all"))}
  out["tasks"] = {k: summary(v) for k, v in acc.items()}
  return write_report_json(out, out_dir, name)


def plot_fa_heatmap(fa_freq, path: str, *, tasks: dict[str, Any] | None = None,
                    title: str | None = None) -> str:
  """PNG heatmap of the FA frequency, layer (rows) x query head (columns), 0 (always SA) .. 1
  (always FA), like the paper's Fig. 6; with `tasks` ({name: fa_freq}) a panel per task."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  panels = [("all", np.asarray(fa_freq, np.float64))]
  panels += [(k, np.asarray(v, np.float64)) for k, v in (tasks or {}).items()]
  L, N = panels[0][1].shape
  fig, axes = plt.subplots(1, len(panels), figsize=(1.0 + len(panels) * max(2.5, 0.3 * N),
                                                   1.2 + max(2.0, 0.25 * L)), squeeze=False)
  for ax, (name, u) in zip(axes[0], panels):
    im = ax.imshow(u, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_title(f"{name}: Omega_MSR {1 - u.mean():.2f}", fontsize=9)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="FA frequency")
  if title:
    fig.suptitle(title)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def sparsity_report(model, params, batches, *, out_dir: str | None = None,
                    name: str = "elastic_sparsity") -> dict[str, Any]:
  """`measure` + the FA-frequency heatmap (`Scheme.reports` signature): with out_dir, writes
  <out_dir>/<name>.json and <name>.png (a panel per task). Returns the measured dict with the
  two paths under 'json' / 'png'."""
  from condattn_jax.attention import write_report_json
  rep = measure(model, params, batches)
  if out_dir is None:
    return rep
  os.makedirs(out_dir, exist_ok=True)
  png = plot_fa_heatmap(rep["fa_freq"], os.path.join(out_dir, f"{name}.png"),
                        tasks={k: v["fa_freq"] for k, v in rep["tasks"].items()},
                        title=f"Elastic ({rep['modes']}) FA frequency per head")
  return write_report_json({**rep, "png": png}, out_dir, name)
