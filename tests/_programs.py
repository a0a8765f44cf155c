"""Jitted model programs shared by the tests of one process (not a test module).

jax's jit cache hits only when the SAME function object is called again with the same avals:
a test that applies a fresh `Decoder(cfg).apply` (eagerly, op by op, or through a new lambda)
traces, lowers and compiles it again. These factories are memoized on the (hashable, frozen)
ModelConfig, so every test of a process that runs the same config's forward with inputs of the
same shapes shares one traced and compiled program; params and inputs are arguments."""
import functools

import jax
import jax.numpy as jnp


@functools.lru_cache(maxsize=None)
def apply(cfg):
  """(params, tokens_BT[, positions_BT, segment_ids_BT]) -> Decoder(cfg)'s (logits_BTV, aux),
  jitted once per config (positional arrays or None)."""
  from condattn_jax.models.decoder import Decoder
  return jax.jit(lambda p, *args: Decoder(cfg).apply({"params": p}, *args))


@functools.lru_cache(maxsize=None)
def serving_forward(cfg):
  """(params, tokens_BT, positions_BT, segment_ids_BT, prefill_lengths_B) -> (logits_BTV, aux)
  of the forward cfg's scheme declares generation equals (`Scheme.serving_forward`; else its
  training `forward`; else the decoder's apply), jitted once per config (prefill_lengths_B is
  traced: int32 [B])."""
  from condattn_jax import attention
  from condattn_jax.models.decoder import Decoder
  s = attention.get_scheme(cfg.scheme)
  if s.serving_forward is not None:
    return jax.jit(lambda p, t, pos, seg, n: s.serving_forward(
        Decoder(cfg), p, t, pos, seg, jnp.asarray(n, jnp.int32)))
  if s.forward is not None:
    return jax.jit(lambda p, t, pos, seg, n: s.forward(Decoder(cfg), p, t, pos, seg))
  f = apply(cfg)
  return lambda p, t, pos, seg, n: f(p, t, pos, seg)
