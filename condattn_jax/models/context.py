"""LayerContext: everything a decoder layer may read besides its input activations.

The decoder builds one context per forward pass and hands it, unchanged, to every layer (the
scanned layer body receives it broadcast); the scan adds the per-layer entries (`layer_idx` and
the scheme's `layer_flags`). A scheme layer's contract is

    layer(x_BTD, ctx) -> (x_BTD, aux)

Arrays are pytree leaves; `train`, `decode` and `cache_len` are static (part of the tree
structure), so a change of mode retraces and a change of values does not.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerContext:
  """Per-batch inputs every layer can see.

  tokens_BT       int32 token ids (MATCH retrieves over raw tokens).
  positions_BT    int32 positions (restart at 0 in each packed document).
  segment_ids_BT  int32 document ids, 0 = padding; None = one document per row, no padding.
  task_ids_B      int32 per-sample task ids (Elastic's per-task targets) or None.
  fields          any other per-batch arrays the data pipeline adds (name -> array); the train
                  and eval steps add 'step' (int32 scalar, the train step).
  layer_idx       int32 scalar: this layer's index (set by the decoder's scan; 0 outside it).
  layer_flags     the scheme's per-layer values for this layer (name -> scalar), see
                  `Scheme.layer_flags`.
  train           training forward (RNG-driven routing, forced steps, ...).
  decode          cached inference: layers read and write their caches ('cache' collection).
  cache_len       slots of a full KV cache (decode only).
  """
  tokens_BT: Any
  positions_BT: Any
  segment_ids_BT: Any = None
  task_ids_B: Any = None
  fields: dict = dataclasses.field(default_factory=dict)
  layer_idx: Any = 0
  layer_flags: dict = dataclasses.field(default_factory=dict)
  train: bool = dataclasses.field(default=False, metadata=dict(static=True))
  decode: bool = dataclasses.field(default=False, metadata=dict(static=True))
  cache_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  def replace(self, **kw) -> "LayerContext":
    return dataclasses.replace(self, **kw)

  @property
  def valid_BT(self):
    """bool [B, T]: real tokens (segment id != 0); in decode, the chunk's valid tokens."""
    if self.segment_ids_BT is None:
      return jnp.ones(self.positions_BT.shape, bool)
    return self.segment_ids_BT != 0

  @property
  def batch_size(self) -> int:
    return self.positions_BT.shape[0]
