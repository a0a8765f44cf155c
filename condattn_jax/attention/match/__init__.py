"""MATCH: retrieval-modulated sparse attention (SCHEMES.md section 5; paper
../shared/papers/004_3b3ddadb1b62c6a7.txt).

  options.py    MatchOptions (scheme_kwargs), match_config, the SWA / full layer pattern
  retrieval.py  chunk geometry, retrievers (exact match; all-MiniLM-L6-v2 bi-encoder), reranker
  inputs.py     per-forward retrieval + the auxiliary input (decoder input step, raw-token cache)
  layer.py      the decoder layer (window OR retrieved chunks, per-block fused attention; decode
                with a window ring + a fixed-size recomputed retrieved-K/V cache)
  report.py     analytic cache bytes
"""
from condattn_jax.attention import Scheme, register
from condattn_jax.attention.match.inputs import MatchInputs, block_inputs, num_blocks
from condattn_jax.attention.match.layer import MatchLayer, RetrievedCache
from condattn_jax.attention.match.options import (OPTION_NAMES, MatchOptions, layer_kinds,
                                                  match_config, match_options)
from condattn_jax.attention.match.report import from_dense, kv_cache_bytes, to_dense
from condattn_jax.attention.match.retrieval import (ExactMatch, MiniLMRetriever, make_retriever,
                                                    retrieve)

MATCH = register(Scheme(
    name="match", layer_cls=MatchLayer, from_dense=from_dense, to_dense=to_dense,
    layer_variants=layer_kinds, headline_metric=None, kv_cache_bytes=kv_cache_bytes,
    input_module=MatchInputs))
