"""Training-inference consistent segmented execution (docs/schemes/segmented.md,
which names the paper).

  options.py  `SegmentedOptions` (model.scheme.<name>: S, M, R, K, head / layer lists, retrieval
              knobs), the whole-config check, the static partition
  core.py     the ONE segment operator (state transition, retrieval, attention over
              [prefix ; segment]) and the per-layer full-sequence scan
  layer.py    the decoder layer (cached mode = inference and training; full-sequence mode)
  forward.py  the training forward: scan over segments, TBPTT depth K (Scheme.forward)
  convert.py  dense <-> segmented (identity on weights)
  report.py   cache bytes, attention-visible KV length
"""
from condattn_jax.attention import Scheme, register
from condattn_jax.attention.segmented.convert import from_dense, tiny, to_dense
from condattn_jax.attention.segmented.core import (full_sequence, init_state, query_summaries,
                                                   retrieve, segment_step, state_shapes)
from condattn_jax.attention.segmented.forward import forward, loss_weights
from condattn_jax.attention.segmented.layer import SegmentedLayer
from condattn_jax.attention.segmented.options import (LLAMA2_LONG_HEADS, LLAMA2_LONG_LAYERS,
                                                      SegmentedOptions, check, head_groups,
                                                      layer_variants)
from condattn_jax.attention.segmented.report import kv_cache_bytes, visible_kv_length

SEGMENTED = register(Scheme(
    name="segmented", layer_cls=SegmentedLayer, options=SegmentedOptions, check=check,
    from_dense=from_dense, to_dense=to_dense, layer_variants=layer_variants,
    kv_cache_bytes=kv_cache_bytes, forward=forward, loss_weights=loss_weights,
    packed_documents=False,
    sequence_parallel="its forward is a sequential scan over the row's segments",
    tiny=tiny))
