"""Inference over any scheme's cache (`engine.py`): `Engine.from_checkpoint(workdir, **knobs)` or
`Engine(model_cfg, params, cache_len=...)`; ragged batched prefill, chunked prefill, decode,
generation (greedy or sampled: `sampling.py`; stop tokens and stop strings: `text.py`) returning
a `Generation` with per-row routing statistics. `generate.py` is the command line."""
from condattn_jax.inference.engine import Engine, Generation, Request, cache_bytes, check_prompts

__all__ = ["Engine", "Generation", "Request", "cache_bytes", "check_prompts"]
