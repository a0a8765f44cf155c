"""Inference over any scheme's cache: ragged batched prefill, chunked prefill, decode, greedy
generation (`engine.py`)."""
from condattn_jax.inference.engine import Engine, Generation, cache_bytes

__all__ = ["Engine", "Generation", "cache_bytes"]
