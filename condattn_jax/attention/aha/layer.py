"""AHA's decoder layer, options, router and regulariser (SCHEMES.md section 2).

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
(token, head) attends through `ops.attention` over that cache with a per-head active set: the
routed-global pairs over the whole prefix, the routed-local ones with the window (only the last w
keys of the cache). With decode_skip the full-attention call is skipped when no (token, head) of
the chunk routes global. tau is a test-time knob.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax import ops
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, attend, make_norm, mlp_residual

MODES = ("exact", "sparse")
ROUTINGS = ("learned", "all", "none", "soft")


@dataclasses.dataclass(frozen=True)
class AHAOptions:
  """The `scheme_kwargs` of scheme 'aha' (defaults: SCHEMES.md section 2 / the paper).

  window           local window w (keys t-w+1..t), >= 1; paper: 16..256, released checkpoint 128.
  tau              threshold: g = (s > tau); a test-time knob (higher = fewer full heads).
  lam              weight of the L1 regulariser lam * mean_{layers, tokens, heads} s (paper 3e-4).
  mode             'exact' | 'sparse' (see the module docstring).
  p_force          sparse mode: per layer per step probability of the forced-global (dense) step.
  routing          'learned' (router + STE); 'all' (every head full: the base model); 'none'
                   (every head local: a sliding-window model); 'soft' (analysis only: head =
                   s * Full + (1 - s) * Local, dense).
  router_bias_init b_r at conversion / init (W_r = 0): sigmoid(2) = 0.88 > 0.5 = every head full.
  decode_skip      decode: skip the full-attention call when no (token, head) routes global.
  compact_impl     ops.attention impl of the per-head active-set calls (sparse mode, decode).
  num_tasks        > 0: aux_loss reports usage per task id 0..num_tasks-1 (batch['task_ids']).
  """
  window: int = 128
  tau: float = 0.5
  lam: float = 3e-4
  mode: str = "exact"
  p_force: float = 0.05
  routing: str = "learned"
  router_bias_init: float = 2.0
  decode_skip: bool = True
  compact_impl: str = "auto"
  num_tasks: int = 0

  def __post_init__(self):
    if int(self.window) != self.window or self.window < 1:
      raise ValueError(f"model.scheme_kwargs.window={self.window!r} must be an int >= 1.")
    if not 0.0 < self.tau < 1.0:
      raise ValueError(f"model.scheme_kwargs.tau={self.tau} must be in (0, 1) (a sigmoid "
                       "score threshold).")
    if self.lam < 0:
      raise ValueError(f"model.scheme_kwargs.lam={self.lam} must be >= 0.")
    if self.mode not in MODES:
      raise ValueError(f"model.scheme_kwargs.mode={self.mode!r}: choose one of {MODES}.")
    if not 0.0 <= self.p_force <= 1.0:
      raise ValueError(f"model.scheme_kwargs.p_force={self.p_force} must be in [0, 1].")
    if self.routing not in ROUTINGS:
      raise ValueError(f"model.scheme_kwargs.routing={self.routing!r}: choose one of {ROUTINGS}.")
    if self.compact_impl not in ops.IMPLS:
      raise ValueError(f"model.scheme_kwargs.compact_impl={self.compact_impl!r}: choose one of "
                       f"{ops.IMPLS}.")
    if int(self.num_tasks) != self.num_tasks or self.num_tasks < 0:
      raise ValueError(f"model.scheme_kwargs.num_tasks={self.num_tasks!r} must be an int >= 0.")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(AHAOptions))


def aha_options(config) -> AHAOptions:
  """AHAOptions from a ModelConfig (its scheme_kwargs), a run config, a dict, or AHAOptions."""
  if isinstance(config, AHAOptions):
    return config
  if isinstance(config, ModelConfig):
    kw = config.scheme_options
  elif isinstance(config, dict):
    kw = dict(config)
  elif hasattr(config, "model"):  # a run config holding a model section
    return aha_options(config.model)
  else:
    kw = dict(getattr(config, "scheme_kwargs", ()))
  unknown = sorted(set(kw) - set(OPTION_NAMES))
  if unknown:
    raise ValueError(f"model.scheme_kwargs has unknown AHA option(s) {unknown}; valid: "
                     f"{sorted(OPTION_NAMES)}.")
  return AHAOptions(**kw)


def aha_config(base: ModelConfig, **options) -> ModelConfig:
  """`base` (any scheme) turned into scheme 'aha' with these options (validated)."""
  if base.sliding_window is not None:
    raise ValueError(f"model.sliding_window={base.sliding_window}: AHA converts a full-attention "
                     "model (its window is scheme_kwargs.window); set sliding_window=None.")
  kw = dict(base.scheme_kwargs) if base.scheme == "aha" else {}
  kw.update(options)
  aha_options(kw)  # validate
  return base.replace(scheme="aha", scheme_kwargs=tuple(sorted(kw.items())))


class Router(nn.Module):
  """r = x_in @ kernel + bias: one logit per token and query head, in float32.
  kernel [D, N] zero init, bias [N] = router_bias_init."""
  config: ModelConfig
  bias_init: float = 2.0

  @nn.compact
  def __call__(self, x_BTD):
    cfg = self.config
    w = self.param("kernel", nn.with_logical_partitioning(nn.initializers.zeros,
                                                          ("embed", "q_heads")),
                   (cfg.hidden_size, cfg.num_heads), cfg.weight_dtype)
    b = self.param("bias", nn.with_logical_partitioning(
        nn.initializers.constant(self.bias_init), ("q_heads",)), (cfg.num_heads,),
                   cfg.weight_dtype)
    return jnp.einsum("btd,dn->btn", x_BTD.astype(jnp.float32), w.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) + b.astype(jnp.float32)


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
    o = aha_options(cfg)
    B, T, _ = x_BTD.shape
    N = cfg.num_heads
    valid_BT = ctx.valid_BT
    n_valid_B = jnp.sum(valid_BT, axis=1).astype(jnp.float32)

    attn = Attention(cfg, window=None, name="self_attn")
    x_in = x_BTD if cfg.post_norm else make_norm(cfg, "input_layernorm")(x_BTD)

    # ---- router: one score per (token, query head)
    s_BTN = jax.nn.sigmoid(Router(cfg, bias_init=o.router_bias_init, name="router")(x_in))
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
        raise ValueError("model.scheme_kwargs.routing='soft' is an analysis mode of the full "
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

    def run(active, window):
      return attend(q, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                    kv_segment_ids_BS=kv_valid, window=window, active=active,
                    impl=o.compact_impl)

    local_active = valid_BTN & ~hard_BTN
    window = o.window if o.window < ctx.cache_len else None
    if o.decode_skip:
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
  o = aha_options(config)
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
