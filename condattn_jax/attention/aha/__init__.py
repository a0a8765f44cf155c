"""AHA (All-or-Here): per-head binary routing between full and sliding-window attention
(docs/schemes/aha.md, which names the paper).

  options.py  `AHAOptions` (model.scheme.<name>)
  layer.py    the decoder layer, router, regulariser (`aux_loss`)
  convert.py  dense <-> AHA conversion
  report.py   KV-cache bytes, usage (mu_f) per layer x head and per task, per-head gap, heatmap
"""
from condattn_jax.attention import Scheme, refuse_sliding_window, register
from condattn_jax.attention.aha.convert import from_dense, tiny, to_dense
from condattn_jax.attention.aha.layer import AHALayer, Router, aux_loss, task_counts
from condattn_jax.attention.aha.options import MODES, ROUTINGS, AHAOptions
from condattn_jax.attention.aha.report import (gap_counts, kv_cache_bytes, measure_usage,
                                               plot_usage_heatmap, usage_report)

AHA = register(Scheme(
    name="aha", layer_cls=AHALayer, options=AHAOptions, check=refuse_sliding_window,
    aux_loss=aux_loss, from_dense=from_dense, to_dense=to_dense, headline_metric="aha/mu_f",
    kv_cache_bytes=kv_cache_bytes, reports={"usage": usage_report, "measure": measure_usage},
    sequence_parallel=True, tiny=tiny))
