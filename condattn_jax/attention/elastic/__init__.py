"""Elastic Attention: input-adaptive head-level sparsity with per-task targets
(docs/schemes/elastic.md, which names the paper).

  options.py  `ElasticOptions` (model.scheme.<name>)
  layer.py    router, pooling, Gumbel STE, the decoder layer (SA modes through ONE ops.attention
              call with per-head modes), Lagrangian `aux_loss`, task-name -> id mapping
  masks.py    SSA / XA block lists (`ops.BlockLists`), skipped-pair fractions (Omega_ESR)
  convert.py  dense <-> Elastic conversion
  report.py   KV-cache bytes, Omega_MSR / Omega_ESR per task, per-head FA heatmap (paper Fig. 6)
"""
from condattn_jax.attention import Scheme, refuse_sliding_window, register
from condattn_jax.attention.elastic import masks
from condattn_jax.attention.elastic.convert import from_dense, tiny, to_dense
from condattn_jax.attention.elastic.layer import (ElasticLayer, Router, aux_loss,
                                                  Multipliers, fixed_fa_head_sets, gumbel_ste,
                                                  pool_keys, serving_forward, task_ids,
                                                  tau_at)
from condattn_jax.attention.elastic.options import MODES, POOLINGS, ROUTINGS, ElasticOptions
from condattn_jax.attention.elastic.report import (kv_cache_bytes, measure, plot_fa_heatmap,
                                                   sparsity_report)

ELASTIC = register(Scheme(
    name="elastic", layer_cls=ElasticLayer, options=ElasticOptions, check=refuse_sliding_window,
    aux_loss=aux_loss, from_dense=from_dense, to_dense=to_dense,
    headline_metric="elastic/omega_msr", kv_cache_bytes=kv_cache_bytes,
    reports={"sparsity": sparsity_report, "measure": measure}, module=Multipliers,
    ascent_params=("scheme/lagrange",),
    serving_forward=serving_forward, packed_documents=False,
    sequence_parallel=True,
    tiny=tiny))
