"""MATCH: retrieval-modulated sparse attention (docs/schemes/match.md,
which names the paper).

  options.py    `MatchOptions` (model.scheme.<name>), the SWA / full layer pattern
  retrieval.py  chunk geometry, retrievers (exact match; all-MiniLM-L6-v2 bi-encoder), reranker
  minilm.py     all-MiniLM-L6-v2 in Flax (the bi-encoder retriever's encoder)
  inputs.py     per-forward retrieval + the auxiliary input (decoder input step, raw-token cache)
  layer.py      the decoder layer (window OR retrieved chunks, per-block fused attention; decode
                with a window ring + a fixed-size recomputed retrieved-K/V cache)
  convert.py    dense <-> MATCH (the same parameters, regrouped)
  report.py     analytic cache bytes
"""
from condattn_jax.attention import Scheme, refuse_sliding_window, register
from condattn_jax.attention.match.convert import from_dense, serving_forward, tiny, to_dense
from condattn_jax.attention.match.inputs import MatchInputs, block_inputs, num_blocks
from condattn_jax.attention.match.layer import MatchLayer, RetrievedCache
from condattn_jax.attention.match.options import MatchOptions, layer_kinds
from condattn_jax.attention.match.report import kv_cache_bytes
from condattn_jax.attention.match.retrieval import (ExactMatch, MiniLMRetriever, make_retriever,
                                                    retrieve)

MATCH = register(Scheme(
    name="match", layer_cls=MatchLayer, options=MatchOptions, check=refuse_sliding_window,
    from_dense=from_dense, to_dense=to_dense, layer_variants=layer_kinds, headline_metric=None,
    kv_cache_bytes=kv_cache_bytes, module=MatchInputs, serving_forward=serving_forward,
    sequence_parallel=True,
    tiny=tiny))
