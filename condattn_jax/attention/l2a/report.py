"""L2A measurements: per-layer sparsity on held-out data (the one sparsity measure), KV-cache
bytes, and the pruning report (SCHEMES.md section 1)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.attention.l2a.convert import prune
from condattn_jax.attention import configure, options
from condattn_jax.models.config import ModelConfig

# ----------------------------------------------------------------------------------------------
# Measuring sparsity, KV-cache bytes
# ----------------------------------------------------------------------------------------------
def measure_sparsity(model, params, batches, *, theta: float | None = None) -> dict[str, Any]:
  """Per-layer sparsity (fraction of non-padding tokens with d = 0) over held-out batches.

  model: a Decoder with an L2A config (theta overrides its threshold); batches: iterable of dicts
  with `inputs` (+ optional `positions`, `segment_ids`). Returns {'layer_sparsity': [L],
  'sparsity': mean over layers with a global branch, 'tokens': count}.
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
  return {"layer_sparsity": [float(x) for x in layer_sparsity],
          "sparsity": float(np.mean(layer_sparsity[live])) if live else 1.0,
          "tokens": float(tokens[0])}


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


def prune_report(model, params, batches, *, context_len: int, threshold: float = 0.95,
                 theta: float | None = None, dtype: str | None = None) -> dict[str, Any]:
  """Measure per-layer sparsity, prune layers >= threshold, report KV-cache bytes.

  Returns a dict with the pruned config and params under 'config' / 'params' and a JSON-ready
  'report': layer_sparsity, pruned_layers, kv bytes for the dense base model, the L2A model before
  pruning and after, and the reduction relative to both.
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
  return {"config": pcfg, "params": pparams, "report": report}


