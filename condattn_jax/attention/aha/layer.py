"""AHA's decoder layer, options, router and regulariser (docs/schemes/aha.md#semantics).

Per decoder layer, with x_in the attention block's input (what q_proj sees: RMSNorm_in(x) in
the pre-norm families llama / qwen2 / qwen3, the residual stream x itself in post-norm olmo2):

    r  = x_in @ W_r + b_r                      # `router/kernel` [D, N], `router/bias` [N]
    s  = sigmoid(r)                            # [B, T, N]: one score per QUERY head
    g  = STE(s > tau)                          # 1 = full (global) attention, 0 = local window w
    head_n = g * Full_n + (1 - g) * Local_n    # the SAME q/k/v/o weights for both paths (GQA:
                                               # query heads of a group share their K/V)
    pre-norm : x' = x + o_proj(heads)          post-norm: x' = x + RMSNorm_post_attn(o_proj(heads))
    out = the family's MLP half of x'

STE: the forward value is exactly the hard choice (`where(g, Full, Local)`), and d head / d s =
Full - Local (the paper's d L / d s = d L / d g). Init (`from_dense`, and a random init): W_r = 0,
b_r = router_bias_init = +2 -> s = 0.88 > tau: every head global, the model IS the base model.

Training modes (`mode`):
  exact   Full and Local computed densely for every (token, head): the paper-faithful STE
          gradient everywhere.
  sparse  Local densely (a window: cheap), Full only for the routed (token, head) pairs through
          `ops.attention` with a per-head active set [B, T, N] (the compacted-query kernel). The
          STE term needs Full, so only routed pairs give the router a CE gradient, except on
          forced-global steps (probability p_force per layer and step, from the `router` RNG
          stream: the same draw on every replica) where Full runs densely for all pairs and the
          gradient is exactly the exact mode's. The forward value is the same in both modes.

Decode (ctx.decode): ONE full KV cache per layer (the new tokens' K/V always written); every
(token, head) attends through `ops.attention` over that cache with a per-head active set, in two
calls: the routed-global pairs over the whole prefix, the routed-local ones with the window (only
the last w keys of the cache). A one-token step runs both calls unconditionally (on a GPU / TPU
the decode kernels read nothing for an inactive (row, kv head): a call without an active query
costs a launch, where a lax.cond costs a host round trip), with the cache's fill
(MaskSpec.kv_lengths_B: the full heads' call then reads no positions); a chunk of several tokens, with decode_skip,
skips a call when no (token, head) of the chunk takes it. tau is a test-time knob.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax.attention import options
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, attend, make_norm, mlp_residual

class Router(nn.Module):
  """r = x_in @ kernel + bias: one logit per token and query head, in float32.
  kernel [D, N] zero init, bias [N] = router_bias_init (no bias param with use_bias=False)."""
  config: ModelConfig
  bias_init: float = 2.0
  use_bias: bool = True

  @nn.compact
  def __call__(self, x_BTD):
    cfg = self.config
    w = self.param("kernel", nn.with_logical_partitioning(nn.initializers.zeros,
                                                          ("embed", "q_heads")),
                   (cfg.hidden_size, cfg.num_heads), cfg.weight_dtype)
    r = jnp.einsum("btd,dn->btn", x_BTD.astype(jnp.float32), w.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    if not self.use_bias:
      return r
    b = self.param("bias", nn.with_logical_partitioning(
        nn.initializers.constant(self.bias_init), ("q_heads",)), (cfg.num_heads,),
                   cfg.weight_dtype)
    return r + b.astype(jnp.float32)


class AHALayer(nn.Module):
  """One AHA decoder layer. Returns (x, aux) with per-layer aux values (the decoder stacks them):

  score_N   mean router score s per query head over non-padding tokens (the regulariser's
            term; zeros when no router is in the loop: routing 'all' / 'none')
  usage_N   fraction of non-padding tokens whose head n took full attention (mu_f per head)
  full_BN   per row, per head: count of full-attention (token, head) decisions
  tokens_B  per row: non-padding tokens
  forced    1.0 when this step ran the forced-global (dense) path (sparse mode)
  Sown intermediates: 'score' s [B, T, N], 'gate' g [B, T, N] (bool).
  """
  config: ModelConfig
  variant: object = None

  @nn.compact
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    o = options(cfg)
    B, T, _ = x_BTD.shape
    N = cfg.num_heads
    valid_BT = ctx.valid_BT
    n_valid_B = jnp.sum(valid_BT, axis=1).astype(jnp.float32)

    attn = Attention(cfg, window=None, name="self_attn")
    x_in = x_BTD if cfg.post_norm else make_norm(cfg, "input_layernorm")(x_BTD)

    # ---- router: one score per (token, query head)
    s_BTN = jax.nn.sigmoid(Router(cfg, bias_init=o.router_bias_init, use_bias=o.router_bias,
                                     name="router")(x_in))
    valid_BTN = jnp.broadcast_to(valid_BT[:, :, None], (B, T, N))
    if o.routing in ("learned", "soft"):
      hard_BTN = s_BTN > o.tau
    elif o.routing == "all":
      hard_BTN = jnp.ones((B, T, N), bool)
    else:  # none
      hard_BTN = jnp.zeros((B, T, N), bool)
    if o.routing == "soft":
      hard_BTN = jnp.ones((B, T, N), bool)  # Full is needed everywhere; mixing is soft below
    hard_BTN = hard_BTN & valid_BTN

    # ---- forced-global step (sparse training, learned routing)
    forced = jnp.zeros((), bool)
    sparse_train = ctx.train and o.mode == "sparse" and o.routing == "learned"
    if sparse_train and o.p_force > 0:
      if not self.has_rng("router"):
        raise ValueError("AHA sparse training with p_force > 0 needs the step RNG: call the model "
                         "with rngs={'router': key} (the same key on every replica).")
      forced = jax.random.bernoulli(self.make_rng("router"), o.p_force)

    # ---- both paths with the same q/k/v (K/V shared by the query heads of a group)
    q, k, v = attn.qkv(x_in, ctx.positions_BT)
    if ctx.decode:
      if o.routing == "soft":
        raise ValueError("model.scheme.routing='soft' is an analysis mode of the full "
                         "forward; decode with routing 'learned', 'all' or 'none'.")
      local, full = self._decode_paths(attn, q, k, v, ctx, hard_BTN, valid_BTN, o)
      avail_BTN = hard_BTN
    else:
      local = attend(q, k, v, q_positions_BT=ctx.positions_BT, kv_positions_BS=ctx.positions_BT,
                     q_segment_ids_BT=ctx.segment_ids_BT, kv_segment_ids_BS=ctx.segment_ids_BT,
                     window=o.window, impl=cfg.attention_impl, contiguous=True)
      dense = lambda q, k, v: attn.attend(q, k, v, ctx)
      compact = lambda q, k, v: attn.attend(q, k, v, ctx, active=hard_BTN, impl=o.compact_impl)
      if o.routing == "none":
        full = jnp.zeros_like(q)
        avail_BTN = hard_BTN
      elif o.mode == "exact" or o.routing in ("all", "soft"):
        full = dense(q, k, v)
        avail_BTN = jnp.ones((B, T, N), bool)
      elif sparse_train and o.p_force > 0:
        full = lax.cond(forced, dense, compact, q, k, v)
        avail_BTN = hard_BTN | forced
      else:
        full = compact(q, k, v)
        avail_BTN = hard_BTN

    # ---- mixing: the hard choice forward, d head / d s = Full - Local backward (STE)
    g4 = hard_BTN[..., None]
    if o.routing == "soft":
      s4 = s_BTN[..., None].astype(q.dtype)
      heads = s4 * full + (1 - s4) * local
    else:
      heads = jnp.where(g4, full, local)
      if o.routing == "learned":
        ste = (s_BTN - lax.stop_gradient(s_BTN))[..., None] * avail_BTN[..., None]
        heads = heads + ste.astype(q.dtype) * (full - local)
    out_BTD = attn.project_out(heads)
    if cfg.post_norm:
      x_BTD = x_BTD + make_norm(cfg, "post_attention_layernorm")(out_BTD)
    else:
      x_BTD = x_BTD + out_BTD
    self.sow("intermediates", "score", s_BTN)
    self.sow("intermediates", "gate", hard_BTN)

    vf = valid_BTN.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(n_valid_B), 1.0)
    full_BN = jnp.sum(hard_BTN.astype(jnp.float32), axis=1)
    learned = o.routing in ("learned", "soft")
    aux = dict(
        score_N=(jnp.sum(s_BTN * vf, axis=(0, 1)) / denom if learned
                 else jnp.zeros((N,), jnp.float32)),
        usage_N=jnp.sum(full_BN, axis=0) / denom,
        full_BN=full_BN, tokens_B=n_valid_B, forced=forced.astype(jnp.float32))
    return mlp_residual(cfg, x_BTD), aux

  def _decode_paths(self, attn, q, k, v, ctx, hard_BTN, valid_BTN, o):
    """(local, full) outputs over the ONE full cache: local for the routed-local (token, head)
    pairs with the window, full for the routed-global ones (zeros elsewhere)."""
    k_all, v_all, kv_pos, kv_valid = attn.write_cache(k, v, ctx)
    # one query per row: the cache's fill after the write (MaskSpec.kv_lengths_B)
    fill_B = attn.fill_after_write(ctx, k_all.shape[1]) if q.shape[1] == 1 else None

    def run(active, window):
      return attend(q, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                    kv_segment_ids_BS=kv_valid, window=window, active=active,
                    impl=o.compact_impl, full_cache=fill_B is not None, kv_lengths_B=fill_B)

    local_active = valid_BTN & ~hard_BTN
    window = o.window if o.window < ctx.cache_len else None
    if o.decode_skip and (q.shape[1] > 1 or o.decode_skip_steps):
      local = lax.cond(jnp.any(local_active), lambda: run(local_active, window),
                       lambda: jnp.zeros_like(q))
      full = lax.cond(jnp.any(hard_BTN), lambda: run(hard_BTN, None), lambda: jnp.zeros_like(q))
    else:
      local, full = run(local_active, window), run(hard_BTN, None)
    return local, full


# ----------------------------------------------------------------------------------------------
# Regulariser and metrics
# ----------------------------------------------------------------------------------------------
def task_counts(full_LBN, tokens_LB, task_ids_B, num_tasks: int):
  """(full_K, slots_K) per task id k < num_tasks: the task's rows' full-attention decisions and
  their (layer, token, head) slots. usage of task k = full_K[k] / slots_K[k]; both are sums, so
  their means over steps or batches keep the ratio (a task absent from a batch adds 0 / 0)."""
  full_B = jnp.sum(full_LBN, axis=(0, 2))
  slots_B = jnp.sum(tokens_LB, axis=0) * full_LBN.shape[2]
  onehot_BK = jax.nn.one_hot(task_ids_B, num_tasks, dtype=jnp.float32)
  return full_B @ onehot_BK, slots_B @ onehot_BK


def aux_loss(aux, batch, step, config):
  """`lam * mean_{layers, tokens, heads} s` (the paper's eq. 7) and the AHA metrics.

  aux: the decoder's stacked per-layer dict (leading axis L); batch: the training batch (its
  'task_ids' give per-task usage when num_tasks > 0); config: the ModelConfig (or a run config,
  or the options). Metrics: aha/lambda, aha/reg, aha/mu_f (mean full-attention usage: the
  headline), aha/usage [L, N] (mu_f per layer x head), aha/usage_layer [L], aha/forced_frac,
  and with num_tasks > 0 and task ids in the batch aha/full_task and aha/slots_task [num_tasks]
  (see `task_counts`: usage of task k = full_task[k] / slots_task[k]).
  """
  del step
  o = options(config)
  score_LN = aux["score_N"]
  usage_LN = aux["usage_N"]
  reg = jnp.mean(score_LN)
  metrics = {
      "aha/lambda": jnp.asarray(o.lam, jnp.float32),
      "aha/reg": reg,
      "aha/mu_f": jnp.mean(usage_LN),
      "aha/usage": usage_LN,
      "aha/usage_layer": jnp.mean(usage_LN, axis=1),
      "aha/forced_frac": jnp.mean(aux["forced"]),
  }
  task_ids = None if batch is None else batch.get("task_ids")
  if o.num_tasks and task_ids is not None:
    metrics["aha/full_task"], metrics["aha/slots_task"] = task_counts(
        aux["full_BN"], aux["tokens_B"], task_ids, o.num_tasks)
  return o.lam * reg, metrics
