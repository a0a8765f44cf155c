"""L2A's decoder layer, options and regulariser (docs/schemes/l2a.md#semantics).

Per decoder layer (pre-norm families: llama, qwen2, qwen3):

    s  = x + LocalAttn(RMSNorm_in(x))          # `self_attn`, sliding window w
    g  = RMSNorm_global(s)                     # `global_layernorm` (init: copy of input_layernorm)
    p  = sigmoid(g @ w_r / tau)                # `router/kernel` [D], zero init, no bias
    d  = STE(p >= theta)                       # hard forward, sigmoid gradient backward
    a  = GlobalAttn(g)                         # `global_attn`, only for tokens with d = 1
    x' = s + d * a
    out = x' + MLP(RMSNorm_post(x'))

Options: `L2AOptions` (options.py), set as `model.scheme.<name>`.
Every choice where the paper and the authors' code differ is a field there.

Training: with probability `p_force` per layer and step (drawn from the `router` RNG stream, the
same key on every replica) global attention runs for ALL tokens through the dense path and is
still multiplied by d: the forward value is unchanged but rejected tokens give the router a
gradient. Otherwise the global branch runs for the active queries only (`ops.attention` with an
active set: the compacted-query kernel).

Decode (ctx.decode): two caches per layer, a window ring for `self_attn` and a full cache for
`global_attn`; the new tokens' K/V always go into the full cache, and global attention runs only
for the queries that route global (per row: a row with none does no work in the kernel; with
the option `decode_skip`, the whole call is skipped when no query of the chunk routes global: a
`lax.cond` a layer), over the full cache's fill read from its length counter.

Pruned layers (`pruned_layers`) are the layer variant 'pruned': no global branch, router or global
norm, only the window cache. They are scanned as groups of their own (`layer_variants`).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax.attention import options
from condattn_jax.attention.l2a.options import L2AOptions
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, attend, make_norm, mlp_residual

def _bernoulli_uniform(key, positions_BT, layer_idx):
  """Uniform draws that depend only on (key, layer, row, position): stable under decoding."""
  B = positions_BT.shape[0]
  key = jax.random.fold_in(key, layer_idx)

  def one(b, pos):
    return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, b), pos))

  rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], positions_BT.shape)
  return jax.vmap(jax.vmap(one))(rows, positions_BT.astype(jnp.int32))


class Router(nn.Module):
  """z = g @ kernel: one logit per token, shared by the heads; `kernel` [D], zero init, no bias.
  Computed in float32."""
  config: ModelConfig

  @nn.compact
  def __call__(self, g_BTD):
    cfg = self.config
    w = self.param("kernel", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                   (cfg.hidden_size,), cfg.weight_dtype)
    return jnp.einsum("btd,d->bt", g_BTD.astype(jnp.float32), w.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)




def layer_variants(config) -> tuple[str, ...]:
  """'pruned' for the layers in pruned_layers, 'global' for the others."""
  pruned = set(options(config).pruned_layers)
  return tuple("pruned" if i in pruned else "global" for i in range(config.num_layers))


class L2ALayer(nn.Module):
  """One L2A decoder layer. Returns (x, aux) with per-layer aux values:

  p_mean   mean router score p over non-padding tokens (learned / soft routing; for the other
           routings the fraction of tokens routed global)
  p2_mean  mean p^2 over non-padding tokens (the regulariser's term)
  sparsity fraction of non-padding tokens with d = 0 (1 for a pruned layer)
  forced   1.0 when this step ran the forced-global (dense) path
  global_tokens_B / tokens_B   per-row counts of d = 1 tokens and of non-padding tokens
  """
  config: ModelConfig
  variant: str = "global"

  @nn.compact
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    o = options(cfg)
    B, T, _ = x_BTD.shape
    valid_BT = ctx.valid_BT
    n_valid_B = jnp.sum(valid_BT, axis=1).astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(n_valid_B), 1.0)

    # ---- local branch: s = x + LocalAttn(RMSNorm_in(x))
    local = Attention(cfg, window=o.window, name="self_attn")
    h = make_norm(cfg, "input_layernorm")(x_BTD)
    if o.window == 0:  # a window of 0 keys attends to nothing (and keeps no cache)
      if self.is_initializing():
        local.qkv(h, ctx.positions_BT)  # the params still exist (a converted layer)
        local.project_out(jnp.zeros((B, T, cfg.num_heads, cfg.head_dim), h.dtype))
      s_BTD = x_BTD
    else:
      s_BTD = x_BTD + local(h, ctx)

    zeros = jnp.zeros((), jnp.float32)
    if self.variant == "pruned":
      aux = dict(p_mean=zeros, p2_mean=zeros, sparsity=jnp.ones((), jnp.float32), forced=zeros,
                 global_tokens_B=jnp.zeros((B,), jnp.float32), tokens_B=n_valid_B)
      return mlp_residual(cfg, s_BTD), aux

    # ---- router on g = RMSNorm_global(s)
    g_BTD = make_norm(cfg, "global_layernorm")(s_BTD)
    z_BT = Router(cfg, name="router")(g_BTD)
    p_BT = jax.nn.sigmoid(z_BT / o.tau)
    learned = o.routing in ("learned", "soft")
    if o.routing == "learned":
      hard_BT = p_BT >= o.theta
    elif o.routing == "bernoulli":
      key = (self.make_rng("router") if (ctx.train and self.has_rng("router"))
             else jax.random.PRNGKey(o.bernoulli_seed))
      hard_BT = _bernoulli_uniform(key, ctx.positions_BT, ctx.layer_idx) < o.bernoulli_q
    elif o.routing in ("all", "soft"):
      hard_BT = jnp.ones((B, T), bool)
    else:  # none
      hard_BT = jnp.zeros((B, T), bool)
    hard_BT = hard_BT & valid_BT
    hard_f = hard_BT.astype(jnp.float32)
    if o.routing == "learned":
      d_BT = hard_f + p_BT - lax.stop_gradient(p_BT)  # STE
    elif o.routing == "soft":
      d_BT = p_BT * valid_BT
    else:
      d_BT = hard_f

    # ---- forced-global step (training, learned routing only)
    forced = jnp.zeros((), bool)
    if ctx.train and o.routing == "learned" and o.p_force > 0:
      if not self.has_rng("router"):
        raise ValueError("L2A training with p_force > 0 needs the step RNG: call the model with "
                         "rngs={'router': key} (the same key on every replica).")
      forced = jax.random.bernoulli(self.make_rng("router"), o.p_force)

    # ---- global branch
    glob = Attention(cfg, window=None, name="global_attn")
    q, k, v = glob.qkv(g_BTD, ctx.positions_BT)
    if ctx.decode:
      k_all, v_all, kv_pos, kv_valid = glob.write_cache(k, v, ctx)
      # the fill (valid prefix of the full cache) from its length counter after the write, not a
      # reduction over its valid slots: a full cache holds a row's tokens in slots 0..length-1
      fill_B = jnp.minimum(glob.kv_cache.get_variable("cache", "length"), k_all.shape[1])

      def run_global(q, k_all, v_all):
        return attend(q, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                      kv_segment_ids_BS=kv_valid, active=hard_BT, impl=o.compact_impl,
                      full_cache=True, kv_lengths_B=fill_B)

      if o.decode_skip:
        a_BTNH = lax.cond(jnp.any(hard_BT), run_global, lambda q, *_: jnp.zeros_like(q),
                          q, k_all, v_all)
      else:
        a_BTNH = run_global(q, k_all, v_all)
    else:
      dense = lambda q, k, v: glob.attend(q, k, v, ctx)
      compact = lambda q, k, v: glob.attend(q, k, v, ctx, active=hard_BT, impl=o.compact_impl)
      if o.routing in ("all", "soft"):
        a_BTNH = dense(q, k, v)
      elif o.routing == "none":
        a_BTNH = jnp.zeros_like(q)
      elif ctx.train and o.routing == "learned" and o.p_force > 0:
        a_BTNH = lax.cond(forced, dense, compact, q, k, v)
      else:
        a_BTNH = compact(q, k, v)
    a_BTD = glob.project_out(a_BTNH)
    self.sow("intermediates", "router_p", p_BT)
    self.sow("intermediates", "decision", hard_BT)
    x_BTD = s_BTD + d_BT[..., None].astype(a_BTD.dtype) * a_BTD

    vf = valid_BT.astype(jnp.float32)
    glob_B = jnp.sum(hard_f, axis=1)
    if learned:
      p_mean = jnp.sum(p_BT * vf) / n_valid
      p2_mean = jnp.sum(jnp.square(p_BT) * vf) / n_valid
    else:
      p_mean = jnp.sum(hard_f) / n_valid
      p2_mean = zeros  # no router in the loop: no regulariser
    aux = dict(p_mean=p_mean, p2_mean=p2_mean,
               sparsity=1.0 - jnp.sum(glob_B) / n_valid, forced=forced.astype(jnp.float32),
               global_tokens_B=glob_B, tokens_B=n_valid_B)
    return mlp_residual(cfg, x_BTD), aux

# ----------------------------------------------------------------------------------------------
# Regulariser and metrics
# ----------------------------------------------------------------------------------------------
def lambda_at(step, opts: L2AOptions):
  """The regulariser weight at `step` (traced or Python int)."""
  step = jnp.asarray(step, jnp.float32)
  if opts.lambda_schedule == "constant":
    return jnp.full((), opts.lambda_max, jnp.float32)
  after = step - opts.lambda_warmup_steps
  frac = jnp.clip(after / max(opts.lambda_ramp_steps, 1), 0.0, 1.0)
  if opts.lambda_ramp_steps == 0:
    frac = (after >= 0).astype(jnp.float32)
  return jnp.where(after < 0, 0.0, opts.lambda_max * frac)


def aux_loss(aux, batch, step, config):
  """`lambda(step) * (1/L) * sum_l mean_{b,t} p_{l,b,t}^2` and the L2A metrics.

  aux: the decoder's stacked per-layer dict (leading axis L); batch: unused; config: the ModelConfig (or a run
  config with a `model` section, or the options). Metrics (scalars): l2a/lambda, l2a/reg,
  l2a/sparsity (mean over layers with a global branch), l2a/router_p, l2a/forced_frac (fraction
  of layers that took the forced-global step), and per layer l2a/sparsity_layer_{i},
  l2a/router_p_layer_{i}.
  """
  del batch
  opts = options(config)
  lam = lambda_at(step, opts)
  p2 = aux["p2_mean"]
  L = p2.shape[0]
  reg = jnp.mean(p2)
  live = [i for i in range(L) if i not in opts.pruned_layers] or list(range(L))
  live_idx = jnp.asarray(live)
  metrics = {
      "l2a/lambda": lam,
      "l2a/reg": reg,
      "l2a/sparsity": jnp.mean(aux["sparsity"][live_idx]),
      "l2a/router_p": jnp.mean(aux["p_mean"][live_idx]),
      "l2a/forced_frac": jnp.mean(aux["forced"][live_idx]),
  }
  for i in range(L):
    metrics[f"l2a/sparsity_layer_{i}"] = aux["sparsity"][i]
    metrics[f"l2a/router_p_layer_{i}"] = aux["p_mean"][i]
  return lam * reg, metrics


