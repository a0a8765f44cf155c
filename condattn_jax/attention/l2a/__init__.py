"""L2A (Learning To Attend): token-level conditional global attention (docs/schemes/l2a.md).

  options.py  `L2AOptions` (model.scheme.<name>), the pre-norm check
  layer.py    the decoder layer, router, regulariser (`aux_loss`)
  convert.py  dense <-> L2A conversion, pruning of params
  report.py   per-layer sparsity on held-out data, KV-cache bytes, the one pruning report
              (also on the eval harness's data, with eval metrics; JSON / markdown / plot)
"""
from condattn_jax.attention import Scheme, register
from condattn_jax.attention.l2a.convert import (GLOBAL_BRANCH, from_dense, prune, prune_params,
                                                tiny, to_dense)
from condattn_jax.attention.l2a.layer import (L2ALayer, Router, aux_loss, lambda_at,
                                              layer_variants)
from condattn_jax.attention.l2a.options import LAMBDA_SCHEDULES, ROUTINGS, L2AOptions, check
from condattn_jax.attention.l2a.report import (kv_bytes_report, kv_cache_bytes, measure_sparsity,
                                               prune_and_evaluate, prune_report)

L2A = register(Scheme(
    name="l2a", layer_cls=L2ALayer, options=L2AOptions, check=check, aux_loss=aux_loss,
    from_dense=from_dense, to_dense=to_dense, layer_variants=layer_variants,
    headline_metric="l2a/sparsity", kv_cache_bytes=kv_cache_bytes,
    reports={"prune": prune_report, "sparsity": measure_sparsity}, sequence_parallel=True,
    tiny=tiny))
