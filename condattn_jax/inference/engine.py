"""The inference engine: batched ragged prefill, chunked prefill, decode and greedy generation
over any scheme's cache.

    engine = Engine(model_cfg, params, cache_len=4096, prefill_chunk=1024)
    out = engine.generate([[1, 5, 9], [4, 4]], max_new_tokens=32, stop_tokens=(2,))
    out.tokens        # per row: the generated ids (up to and including a stop token)
    out.logits        # per row: [n, V] logits that chose them (with return_logits=True)

How it drives a scheme: every step is one `Decoder.apply(..., decode=True, cache_len,
mutable=['cache'])` on a chunk [B, C] with per-row positions and a validity mask (ragged rows are
right-padded; padding tokens are never written to a cache and never attended). Each layer owns
its cache (`models.layers.KVCache`: per-row lengths, full or window ring; L2A: a window ring for
the local branch and a full cache for the global branch, written for every token, read only by
tokens routed global). The engine never names a scheme: it only threads the 'cache' collection,
whose structure it reads off the model (`init_cache`: zeros of the abstract cache).
Attention inside the chunk goes through `ops.attention` with the cache's kv positions, i.e. the
fused kernels on GPU/TPU (the reference on CPU).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder


@dataclasses.dataclass
class Generation:
  """tokens: per row the generated ids (a stop token included); logits: per row [n, V] float32
  (return_logits) or None; prefill_s / decode_s: wall seconds (device work included);
  steps: decode steps run."""
  tokens: list[list[int]]
  logits: list[np.ndarray] | None
  prefill_s: float
  decode_s: float
  steps: int


def cache_bytes(cache) -> int:
  """Bytes held by a cache pytree (what the device really allocates for it)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


class Engine:
  """Prefill / decode / generate for one model (any scheme) and one cache size.

  cache_len: slots of every full cache (>= prompt length + new tokens of every row).
  prefill_chunk: prompt tokens per prefill call (None: the whole padded prompt at once); chunked
    prefill bounds activation memory at long context.
  """

  def __init__(self, model_cfg: ModelConfig, params, *, cache_len: int,
               prefill_chunk: int | None = None):
    if cache_len <= 0:
      raise ValueError(f"Engine(cache_len={cache_len}) must be > 0.")
    if prefill_chunk is not None and prefill_chunk <= 0:
      raise ValueError(f"Engine(prefill_chunk={prefill_chunk}) must be > 0 or None.")
    self.config = model_cfg
    self.model = Decoder(model_cfg)
    self.params = params
    self.cache_len = int(cache_len)
    self.prefill_chunk = prefill_chunk
    self._cache_shapes: dict[int, object] = {}

  # ------------------------------------------------------------------------------ the step
  @functools.partial(jax.jit, static_argnums=0, donate_argnums=(2,))
  def _step(self, params, cache, tokens_BT, positions_BT, valid_BT, prev_logits_BV):
    """One chunk: writes its valid tokens into the caches; returns (cache, logits of each row's
    last valid token [B, V] (prev_logits where a row has none in this chunk))."""
    (hidden_BTD, _), variables = self.model.apply(
        {"params": params, "cache": cache}, tokens_BT, positions_BT,
        valid_BT.astype(jnp.int32), decode=True, cache_len=self.cache_len, return_hidden=True,
        mutable=["cache"])
    n_B = jnp.sum(valid_BT, axis=1)
    last_BD = jnp.take_along_axis(hidden_BTD, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)[:, 0]
    logits_BV = jnp.einsum("bd,dv->bv", last_BD.astype(self.config.compute_dtype),
                           self.model.output_embedding(params).astype(self.config.compute_dtype),
                           preferred_element_type=jnp.float32)
    logits_BV = jnp.where((n_B > 0)[:, None], logits_BV, prev_logits_BV)
    return variables["cache"], logits_BV

  def cache_shapes(self, batch_size: int):
    """The abstract cache (ShapeDtypeStructs) for `batch_size` rows, read off the model once per
    batch size (tracing a 32-layer model costs ~1 s: not paid again on every prefill)."""
    if batch_size not in self._cache_shapes:
      tok = jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)
      self._cache_shapes[batch_size] = jax.eval_shape(
          lambda p, t: self.model.apply({"params": p}, t, decode=True, cache_len=self.cache_len,
                                        mutable=["cache"])[1]["cache"], self.params, tok)
    return self._cache_shapes[batch_size]

  def _commit(self, tree):
    """`tree` placed on the params' device (when they all live on one). The step's outputs are
    committed arrays: inputs made by jnp.zeros are not, and jit compiles the step once for each
    kind, so a chunked prefill would compile its step twice (minutes for a 7B model on a GPU)."""
    devs = {d for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)
            for d in x.devices()}
    dev = devs.pop() if len(devs) == 1 else (jax.devices()[0] if not devs else None)
    return tree if dev is None else jax.device_put(tree, dev)

  def init_cache(self, batch_size: int):
    """Zeros in the structure of every layer's cache (read off the model, not hard-coded),
    on the params' device."""
    return self._commit(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                     self.cache_shapes(batch_size)))

  # ------------------------------------------------------------------------------ prefill
  def prefill(self, prompts: Sequence[Sequence[int]]):
    """Ragged batched prefill. Returns (cache, logits_BV of each prompt's last token, lengths_B)."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if not len(prompts) or lengths.min() < 1:
      raise ValueError("prefill needs at least one prompt and no empty prompt.")
    if lengths.max() > self.cache_len:
      raise ValueError(f"a prompt of {lengths.max()} tokens does not fit cache_len="
                       f"{self.cache_len}; raise cache_len.")
    B = len(prompts)
    C = int(self.prefill_chunk or lengths.max())
    P = -(-int(lengths.max()) // C) * C
    tokens = np.zeros((B, P), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = np.asarray(p, np.int32)
    positions = np.broadcast_to(np.arange(P, dtype=np.int32), (B, P))
    valid = positions < lengths[:, None]
    cache = self.init_cache(B)
    logits = self._commit(jnp.zeros((B, self.config.vocab_size), jnp.float32))
    for c in range(0, P, C):
      sl = slice(c, c + C)
      cache, logits = self._step(self.params, cache, jnp.asarray(tokens[:, sl]),
                                 jnp.asarray(positions[:, sl]), jnp.asarray(valid[:, sl]), logits)
    return cache, logits, lengths

  # ------------------------------------------------------------------------------- decode
  def decode_step(self, cache, tokens_B, positions_B, active_B, prev_logits_BV):
    """One token per active row at its position. Returns (cache, logits_BV)."""
    return self._step(self.params, cache, jnp.asarray(tokens_B, jnp.int32)[:, None],
                      jnp.asarray(positions_B, jnp.int32)[:, None],
                      jnp.asarray(active_B, bool)[:, None], prev_logits_BV)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               stop_tokens: Sequence[int] = (), return_logits: bool = False) -> Generation:
    """Greedy generation: each row stops at a stop token or after max_new_tokens."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if lengths.max() + max_new_tokens > self.cache_len:
      raise ValueError(f"prompt ({lengths.max()}) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"cache_len={self.cache_len}; raise cache_len.")
    t0 = time.perf_counter()
    cache, logits, lengths = self.prefill(prompts)
    logits.block_until_ready()
    t1 = time.perf_counter()
    B = len(prompts)
    out: list[list[int]] = [[] for _ in range(B)]
    kept: list[list[np.ndarray]] = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    stop = set(int(t) for t in stop_tokens)
    pos = lengths.copy()
    steps = 0
    while True:
      host_logits = np.asarray(logits)
      for b in range(B):
        if done[b]:
          continue
        tok = int(host_logits[b].argmax())
        out[b].append(tok)
        if return_logits:
          kept[b].append(host_logits[b].copy())
        if tok in stop or len(out[b]) >= max_new_tokens:
          done[b] = True
      if done.all():
        break
      last = np.asarray([o[-1] if o else 0 for o in out], np.int32)
      cache, logits = self.decode_step(cache, last, pos, ~done, logits)
      pos = pos + (~done)
      steps += 1
    t2 = time.perf_counter()
    return Generation(tokens=out, logits=[np.stack(k) for k in kept] if return_logits else None,
                      prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps)
