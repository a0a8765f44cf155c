"""The training forward of scheme 'segmented': a lax.scan over segments of the decoder in cached
mode (the inference code path, verbatim), carrying every layer's state (tail, pool, ...).

    out, aux = forward(model, params, tokens_BT, positions_BT, segment_ids_BT, train=True)

TBPTT with depth K (docs/schemes/segmented.md#semantics; paper Definition 3.2): the loss of segment i
back-propagates through the carried tail for exactly K segment transitions. Each scan step runs
K + 1 streams of the same segment (rows stacked as [B, K + 1] on the batch axis, so every row's
streams live on the row's shard): stream 0 starts from stop_gradient(state), stream s >= 1 from
the state stream s - 1 produced one segment earlier, and stream K gives the outputs (logits /
hidden). All streams compute the same values; they differ only in how far back their incoming
state carries gradients, so stream K's loss reaches segments i-1 .. i-K and no further. The
pool and the retrieved prefix are stop_gradient inside the operator. Cost: (K + 1) x a plain
forward (the authors' code recomputes the K previous segments per segment: the same).

The boundary (`tbptt_boundary`): 'true_state' (default, the paper's Def. 3.2): stream 0 starts
from stop_gradient of the TRUE state, so values equal inference's. 'empty_restart' (the
authors' trainer.py): stream 0 runs its segment as a first segment (no carried tail, no
retrieved prefix: ctx.fields[layer.RESTART_FIELD] on its rows), so stream K's segment i sees
segments i-K.. recomputed from an empty start; its values differ from inference's. (The pool
entries of the restarted segments are the restarted stream's K/V; the authors' pool keeps the
K/V of each segment's first computation. The pool is forward-only either way.)

The CE is normalised by the train step: by the number of target tokens (`loss_normalisation=
'tokens'`, sum(mask * CE) / sum(mask)), or, 'segment_mean' (the authors' trainer), as the mean
over segments of each segment's mean CE: `loss_weights` (Scheme.loss_weights) gives the step the
per-token weights (not the same when segments carry different numbers of targets).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax.attention import options
from condattn_jax.attention.segmented.layer import RESTART_FIELD


def _init_cache(model, params, batch: int, cache_len: int):
  tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  shapes = jax.eval_shape(
      lambda p, t: model.apply({"params": p}, t, decode=True, cache_len=cache_len,
                               mutable=["cache"])[1]["cache"], params, tok)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def forward(model, params, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
            train: bool = False, rngs=None, return_hidden: bool = False, task_ids_B=None,
            fields=None):
  """Segment-major forward over whole rows (positions 0..T-1, right padding = segment id 0).
  Returns (logits_BTV float32 | hidden_BTD, aux = {}); `positions_BT` is not read (a row is one
  document at 0..T-1)."""
  del positions_BT
  cfg = model.config
  o = options(cfg)
  B, T = tokens_BT.shape
  S, K = o.segment_len, o.tbptt
  NS = K + 1
  n = -(-T // S)
  pad = n * S - T
  valid_BT = (jnp.ones((B, T), jnp.int32) if segment_ids_BT is None
              else (segment_ids_BT != 0).astype(jnp.int32))
  tok = jnp.pad(tokens_BT, ((0, 0), (0, pad)))
  val = jnp.pad(valid_BT, ((0, 0), (0, pad)))
  pos = jnp.broadcast_to(jnp.arange(n * S, dtype=jnp.int32), (B, n * S))
  to_seg = lambda x: x.reshape(B, n, S).swapaxes(0, 1)
  rep = lambda x: jnp.repeat(x, NS, axis=0)  # [B, ...] -> [B * NS, ...], row-major streams
  per_row = lambda v: jnp.ndim(v) >= 1 and jnp.shape(v)[0] == B
  fields = {k: rep(v) if per_row(v) else v for k, v in (fields or {}).items()}
  if o.tbptt_boundary == "empty_restart":  # stream 0 of every row restarts empty
    fields[RESTART_FIELD] = jnp.tile(jnp.arange(NS) == 0, B)
  task = None if task_ids_B is None else rep(task_ids_B)
  cache0 = _init_cache(model, params, B * NS, n * S)
  for leaf in jax.tree.leaves(cache0):
    if leaf.shape[1] != B * NS:
      raise ValueError(f"segmented.forward: a cache leaf {leaf.shape} does not have the batch on "
                       "axis 1 (after the layer axis); every layer state must be batch-first.")

  def restream(x):
    """Incoming states: stream 0 <- stop_gradient(stream K), stream s <- stream s - 1."""
    y = x.reshape(x.shape[0], B, NS, *x.shape[2:])
    y = jnp.concatenate([lax.stop_gradient(y[:, :, K:]), y[:, :, :K]], axis=2)
    return y.reshape(x.shape)

  def step(cache, xs):
    t, p, v = xs
    (out, _), variables = model.apply(
        {"params": params, "cache": jax.tree.map(restream, cache)}, rep(t), rep(p), rep(v),
        task_ids_B=task, fields=fields, train=train, decode=True, cache_len=n * S,
        return_hidden=return_hidden, mutable=["cache"], rngs=rngs or {})
    out = out.reshape(B, NS, *out.shape[1:])[:, K]
    return variables["cache"], out

  if o.remat_segments:
    step = jax.checkpoint(step)
  _, out = lax.scan(step, cache0, (to_seg(tok), to_seg(pos), to_seg(val)))
  out = out.swapaxes(0, 1).reshape(B, n * S, *out.shape[3:])[:, :T]
  return out, {}


def loss_weights(batch: dict, config):
  """Scheme.loss_weights: None for loss_normalisation='tokens'; for 'segment_mean' the weights
  w_BT with sum(mask * w * CE) / sum(mask) == the mean over segments j (holding >= 1 target in
  the batch) of sum_{t in j}(mask * CE) / sum_{t in j}(mask), sums over the batch's rows; a
  target belongs to its input position's segment (position t // segment_len)."""
  o = options(config)
  if o.loss_normalisation == "tokens":
    return None
  mask_BT = batch["loss_mask"].astype(jnp.float32)
  B, T = mask_BT.shape
  S = o.segment_len
  n = -(-T // S)
  per_seg_n = jnp.pad(mask_BT, ((0, 0), (0, n * S - T))).reshape(B, n, S).sum(axis=(0, 2))
  has = per_seg_n > 0
  n_segs = jnp.maximum(jnp.sum(has), 1)
  w_n = jnp.where(has, jnp.sum(mask_BT) / (n_segs * jnp.maximum(per_seg_n, 1.0)), 0.0)
  return jnp.broadcast_to(jnp.repeat(w_n, S)[:T][None], (B, T))
