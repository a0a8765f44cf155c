"""Loss, train step and eval step (pure functions; `loop.py` jits them with shardings).

loss = sum(loss_mask * w * token CE) / sum(loss_mask)  +  scheme.aux_loss(aux, batch, step, cfg)

w = scheme.loss_weights(batch, model_cfg) (per-token weights on the whole batch; 1 when the
scheme declares none). The reported `loss` / `ce` are the unweighted token mean.

`train.loss_chunk_size > 0` computes the CE from the final hidden states in chunks of that many
positions (`Decoder(..., return_hidden=True)` + `Decoder.output_embedding`), rematerialising
each chunk's logits in the backward pass, so the [B, T, V] float32 logits never exist at once.
`train.microbatches = k > 1` splits the batch into k microbatches and sums their gradients
(same result as one big batch: the CE is normalised by the global number of scored tokens).

Metrics of a step (all scalars unless the scheme returns per-layer arrays, shape [L]):
  loss, ce, aux_loss, accuracy (argmax == target over scored tokens), tokens (scored),
  grad_norm (trainable params, before clipping), lr, and every metric of the scheme's aux_loss.
"""
from __future__ import annotations

import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from condattn_jax.attention import get_scheme
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder
from condattn_jax.parallel import context
from condattn_jax.train import optimizer as opt_lib
from condattn_jax.train.state import TrainState, step_rng

RESERVED_METRICS = ("loss", "ce", "aux_loss", "accuracy", "tokens", "grad_norm", "lr")


def token_cross_entropy(logits_BTV, targets_BT):
  """Per-token CE [B,T] and argmax-correct [B,T] (float32)."""
  logits = logits_BTV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == targets_BT).astype(jnp.float32)
  return logz - tgt, correct


def chunked_token_cross_entropy(hidden_BTD, w_DV, targets_BT, chunk: int, dtype):
  """Same as token_cross_entropy(hidden @ w) without materialising all logits.

  Under a mesh that splits rows over `sequence` (n shards) each shard runs its own T / n tokens
  in chunks of gcd(chunk, T / n), in jax.shard_map (rows over the batch and sequence axes; the
  weight whole on every shard, in `dtype`, its vocab not split over `tensor` here): the weight's
  gradient is summed over the shards once, after the chunk loop.
  (Chunks of the whole row put each step's chunk on one shard: GSPMD gathered it to every device
  and all-reduced its [chunk, V] float32 logits over the sharded hidden dim: 32 all-reduces of
  4.6 GiB in the 1.5B 128K step at sequence 4; per-shard chunks under sharding constraints still
  all-reduced the [V, D] weight gradient in every loop step.)"""
  B, T, D = hidden_BTD.shape
  if T % chunk:
    raise ValueError(f"train.loss_chunk_size={chunk} must divide the sequence length "
                     f"data.seq_len={T}.")
  shards = context.sequence_shards()
  if shards is None:
    return _chunked_ce(hidden_BTD, w_DV.astype(dtype), targets_BT, chunk, dtype)
  mesh, ax, n = shards
  batch, _ = context._shard_axes(mesh, B, 1, 1)
  P = jax.sharding.PartitionSpec
  rows = P(batch, ax)

  def per_shard(h, w, t):
    # w varies over the shards from here: its gradient is summed once, here (its transpose),
    # instead of in every chunk of the loop (where jax would cast it at each use)
    w = jax.lax.pcast(w, (ax, *(batch or ())), to="varying")
    return _chunked_ce(h, w, t, math.gcd(chunk, T // n), dtype)

  fn = jax.shard_map(per_shard, mesh=mesh, in_specs=(rows, P(), rows), out_specs=(rows, rows))
  return fn(hidden_BTD, w_DV.astype(dtype), targets_BT)


def _chunked_ce(hidden_BTD, w_DV, targets_BT, chunk: int, dtype):
  B, T, D = hidden_BTD.shape
  n = T // chunk
  h = hidden_BTD.reshape(B, n, chunk, D).swapaxes(0, 1)
  t = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(h_BCD, t_BC):
    logits = jnp.einsum("bcd,dv->bcv", h_BCD.astype(dtype), w_DV)
    return token_cross_entropy(logits.astype(jnp.float32), t_BC)

  ce, correct = jax.lax.map(lambda xs: one(*xs), (h, t))
  return ce.swapaxes(0, 1).reshape(B, T), correct.swapaxes(0, 1).reshape(B, T)


# Batch entries the decoder reads itself; every other entry reaches the layers in ctx.fields.
_MODEL_INPUTS = ("inputs", "positions", "segment_ids", "task_ids", "targets", "loss_mask")


def context_fields(batch: dict) -> dict:
  """The per-batch fields the data pipeline added beyond the standard ones (LayerContext.fields)."""
  return {k: v for k, v in batch.items() if k not in _MODEL_INPUTS}


def forward_ce(model: Decoder, params, batch, *, train: bool, rng, loss_chunk_size: int = 0,
               step=None):
  """(ce_BT, correct_BT, aux) for one batch. `step` (the train step, int32 scalar) reaches the
  layers as ctx.fields['step'] (schedules inside a layer, e.g. Elastic's Gumbel temperature).
  Under a mesh that splits rows over `sequence` (n > 1 shards) the rows run in the zigzag layout
  (condattn_jax/parallel/context.py: applied here to inputs / positions / segment ids / targets,
  undone on ce_BT and correct_BT, which come back in the batch's order)."""
  n_seq = context.sequence_size()
  if n_seq > 1:
    batch = context.batch_to_layout(batch, n_seq)
  ce, correct, aux = _forward_ce(model, params, batch, train=train, rng=rng,
                                 loss_chunk_size=loss_chunk_size, step=step, zigzag=n_seq > 1)
  if n_seq > 1:
    ce, correct = context.from_layout(ce, n_seq), context.from_layout(correct, n_seq)
  return ce, correct, aux


def _forward_ce(model, params, batch, *, train, rng, loss_chunk_size, step, zigzag):
  rngs = {"router": rng} if rng is not None else {}
  chunked = loss_chunk_size and loss_chunk_size > 0
  fields = context_fields(batch)
  if step is not None:
    fields["step"] = jnp.asarray(step, jnp.int32)
  forward = get_scheme(model.config.scheme).forward  # None: one decoder pass
  forward = forward or (lambda m, p, *a, **kw: m.apply({"params": p}, *a, **kw))
  with context.zigzag_layout(zigzag):
    out, aux = forward(model, params, batch["inputs"], batch["positions"], batch["segment_ids"],
                       task_ids_B=batch.get("task_ids"), fields=fields, train=train,
                       return_hidden=bool(chunked), rngs=rngs)
  if chunked:
    ce, correct = chunked_token_cross_entropy(out, model.output_embedding(params), batch["targets"],
                                              int(loss_chunk_size), model.config.compute_dtype)
  else:
    ce, correct = token_cross_entropy(out, batch["targets"])
  return ce, correct, aux


def _check_metric_names(m: dict):
  clash = sorted(set(m) & set(RESERVED_METRICS))
  if clash:
    raise ValueError(f"the scheme's aux_loss returns metric(s) {clash} whose names the train step "
                     f"uses itself; rename them.")


def ascent_flip(grads, scheme):
  """`grads` with the sign of the scheme's gradient-ascent params (`Scheme.ascent_params`,
  e.g. Elastic's Lagrange multipliers) flipped: the optimizer's descent on them is an ascent."""
  if not scheme.ascent_params:
    return grads
  rx = [re.compile(r) for r in scheme.ascent_params]
  return jax.tree_util.tree_map_with_path(
      lambda p, g: -g if any(r.fullmatch(opt_lib.path_str(p)) for r in rx) else g, grads)


def check_ascent_groups(scheme, tc, labels) -> None:
  """Refuses a `train.param_groups` group with maximize=True over the scheme's ascent params
  (the step already flips them: a second flip would train them the wrong way)."""
  if not scheme.ascent_params:
    return
  rx = [re.compile(r) for r in scheme.ascent_params]
  groups = tc.get("param_groups") or {}
  for path, label in jax.tree_util.tree_flatten_with_path(labels)[0]:
    name = opt_lib.path_str(path)
    g = groups.get(label) if label not in (opt_lib.FROZEN, opt_lib.DEFAULT) else None
    if g is not None and g.get("maximize") and any(r.fullmatch(name) for r in rx):
      raise ValueError(f"train.param_groups.{label}.maximize=True: scheme {scheme.name!r} already "
                       f"trains {name} by gradient ascent (Scheme.ascent_params); drop maximize.")


def make_loss_and_grads(model_cfg: ModelConfig, tc):
  """loss_and_grads(params, batch, step) -> (grads, metrics without grad_norm / lr).

  The gradient of  sum(mask * CE) / sum(mask) + aux_loss  (microbatched when
  train.microbatches > 1); the router RNG is fold_in(key(train.seed), step)."""
  model = Decoder(model_cfg)
  scheme = get_scheme(model_cfg.scheme)
  k = int(tc.get("microbatches", 1) or 1)
  chunk = int(tc.get("loss_chunk_size", 0) or 0)
  seed = int(tc.seed)

  def micro_objective(params, mb, w, rng, step, n_total):
    ce, correct, aux = forward_ce(model, params, mb, train=True, rng=rng, loss_chunk_size=chunk,
                                  step=step)
    mask = mb["loss_mask"].astype(jnp.float32)
    ce_sum = jnp.sum(ce * mask)
    aux_loss, aux_metrics = scheme.aux_loss(aux, mb, step, model_cfg)
    _check_metric_names(aux_metrics)
    ce_obj = ce_sum if w is None else jnp.sum(ce * mask * w)
    obj = ce_obj / n_total + aux_loss / k
    return obj, (ce_sum, jnp.sum(correct * mask), aux_loss, aux_metrics)

  grad_fn = jax.value_and_grad(micro_objective, has_aux=True)

  def loss_and_grads(params, batch, step):
    step = jnp.asarray(step, jnp.int32)
    rng = step_rng(seed, step)
    n_tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    n_total = jnp.maximum(n_tokens, 1.0)
    w = scheme.loss_weights(batch, model_cfg) if scheme.loss_weights is not None else None
    if k == 1:
      (_, (ce_sum, correct, aux_loss, aux_m)), grads = grad_fn(params, batch, w, rng, step,
                                                               n_total)
    else:
      B = batch["inputs"].shape[0]
      if B % k:
        raise ValueError(f"train.microbatches={k} must divide the global batch "
                         f"data.batch_size={B}.")
      # Row r goes to microbatch r % k: each device keeps its own rows (no resharding).
      split = lambda x: x.reshape(B // k, k, *x.shape[1:]).swapaxes(0, 1)
      mbs = jax.tree.map(split, batch)

      def body(g_acc, xs):
        mb, w_mb = xs
        (_, outs), g = grad_fn(params, mb, w_mb, rng, step, n_total)
        return jax.tree.map(jnp.add, g_acc, g), outs

      grads, (ce_sum, correct, aux_loss, aux_m) = jax.lax.scan(
          body, jax.tree.map(jnp.zeros_like, params), (mbs, None if w is None else split(w)))
      ce_sum, correct, aux_loss = ce_sum.sum(), correct.sum(), aux_loss.mean()
      aux_m = jax.tree.map(lambda v: v.mean(axis=0), aux_m)
    metrics = dict(loss=ce_sum / n_total + aux_loss, ce=ce_sum / n_total, aux_loss=aux_loss,
                   accuracy=correct / n_total, tokens=n_tokens)
    metrics.update(aux_m)
    return grads, metrics

  return loss_and_grads


def make_train_step(model_cfg: ModelConfig, tc, tx: optax.GradientTransformation, labels,
                    schedule: optax.Schedule) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """train_step(state, batch) -> (new_state, metrics). The scheme's gradient-ascent params
  (`Scheme.ascent_params`) get their gradient flipped before the optimizer."""
  loss_and_grads = make_loss_and_grads(model_cfg, tc)
  scheme = get_scheme(model_cfg.scheme)
  check_ascent_groups(scheme, tc, labels)

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, metrics = loss_and_grads(state.params, batch, state.step)
    grads = ascent_flip(grads, scheme)
    trainable = [g for g, l in zip(jax.tree.leaves(grads), jax.tree.leaves(labels))
                 if l != opt_lib.FROZEN]
    metrics["grad_norm"] = optax.tree.norm(trainable)
    metrics["lr"] = schedule(state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return train_step


def exact_match_counts(correct_BT, mask_BT):
  """(rows whose scored tokens are all correct, rows with >= 1 scored token)."""
  scored = mask_BT > 0
  row_has = jnp.any(scored, axis=-1)
  row_ok = jnp.all(jnp.where(scored, correct_BT > 0, True), axis=-1) & row_has
  return jnp.sum(row_ok.astype(jnp.float32)), jnp.sum(row_has.astype(jnp.float32))


def make_eval_step(model_cfg: ModelConfig, *, loss_chunk_size: int = 0, seed: int = 0):
  """eval_step(params, batch, step) -> sums over the batch:
  ce_sum, correct (tokens), tokens, seq_correct, seqs (rows with >= 1 scored token), and the
  scheme's aux metrics (means over this batch). train=False; the router RNG is key(seed)."""
  model = Decoder(model_cfg)
  scheme = get_scheme(model_cfg.scheme)

  def eval_step(params, batch, step):
    rng = jax.random.key(seed)
    ce, correct, aux = forward_ce(model, params, batch, train=False, rng=rng,
                                  loss_chunk_size=loss_chunk_size, step=step)
    mask = batch["loss_mask"].astype(jnp.float32)
    seq_correct, seqs = exact_match_counts(correct, mask)
    _, aux_m = scheme.aux_loss(aux, batch, step, model_cfg)
    out = dict(ce_sum=jnp.sum(ce * mask), correct=jnp.sum(correct * mask), tokens=jnp.sum(mask),
               seq_correct=seq_correct, seqs=seqs)
    out.update({f"aux/{k}": v for k, v in aux_m.items()})
    return out

  return eval_step
