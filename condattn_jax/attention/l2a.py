"""L2A (Learning To Attend): token-level conditional global attention (SCHEMES.md section 1).

Per decoder layer (pre-norm families: llama, qwen2, qwen3):

    s  = x + LocalAttn(RMSNorm_in(x))          # `self_attn`, sliding window w
    g  = RMSNorm_global(s)                     # `global_layernorm` (init: copy of input_layernorm)
    p  = sigmoid(g @ w_r / tau)                # `router/kernel` [D], zero init, no bias
    d  = STE(p >= theta)                       # hard forward, sigmoid gradient backward
    a  = GlobalAttn(g)                         # `global_attn`, only for tokens with d = 1
    x' = s + d * a
    out = x' + MLP(RMSNorm_post(x'))

Options live in `ModelConfig.scheme_kwargs` (hashable (name, value) pairs); see `L2AOptions`.
Every choice where the paper and the authors' code differ is a field there.

Training: with probability `p_force` per layer and step (drawn from the `router` RNG stream, the
same key on every replica) global attention runs for ALL tokens through the dense path and is
still multiplied by d: the forward value is unchanged but rejected tokens give the router a
gradient. Otherwise the global branch goes through `ops.compact_attention` (active queries only).

Decode (decode=True, mutable=['cache']): two caches per layer, a window ring for `self_attn` and a
full cache for `global_attn`; the new tokens' K/V always go into the full cache, and the global
attention compute is skipped (lax.cond) when no query of the chunk routes global.

Pruned layers (`pruned_layers`) have no global branch, router or global norm and keep only the
window cache: `prune_params` drops those params, `measure_sparsity` finds the layers to prune.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from condattn_jax import ops
from condattn_jax.attention import Scheme, register
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.layers import Attention, make_norm, mlp_residual

ROUTINGS = ("learned", "bernoulli", "all", "none", "soft")
LAMBDA_SCHEDULES = ("ramp", "constant")


@dataclasses.dataclass(frozen=True)
class L2AOptions:
  """The `scheme_kwargs` of scheme 'l2a' (defaults: SCHEMES.md section 1 / authors' code).

  window              local attention window w (keys t-w+1..t); 0 = no local attention.
  tau                 router temperature: p = sigmoid(z / tau).
  theta               threshold d = (p >= theta); a test-time knob (higher = sparser).
  p_force             per layer per training step probability of the forced-global step.
  lambda_max          regulariser weight on mean_{l,b,t} p^2 (mean form of the authors' 1e-8 * sum
                      over 131072 tokens = 1.3e-3).
  lambda_schedule     'ramp': 0 for lambda_warmup_steps, then linear to lambda_max over
                      lambda_ramp_steps (authors' code); 'constant': lambda_max from step 0 (paper).
  routing             'learned' (router + STE), 'bernoulli' (context-free baseline: each token global
                      with probability bernoulli_q, paper Sec. 4.4), 'all' (every token global),
                      'none' (global branch never runs), 'soft' (analysis only: d = p, dense path).
  bernoulli_q         the context-free routing probability.
  bernoulli_seed      key for the context-free draws when no `router` RNG is given (eval/decode);
                      the draw of token (row b, position t) is the same in a full forward and in
                      token-by-token decoding.
  pruned_layers       layer indices without a global branch (post-training pruning).
  decode_skip         decode: skip the global attention compute when no query routes global.
  compact_impl        ops.compact_attention impl ('auto' | 'reference' | 'xla' | 'triton' | ...).
  """
  window: int = 4096
  tau: float = 0.1
  theta: float = 0.5
  p_force: float = 0.1
  lambda_max: float = 1.3e-3
  lambda_schedule: str = "ramp"
  lambda_warmup_steps: int = 0
  lambda_ramp_steps: int = 0
  routing: str = "learned"
  bernoulli_q: float = 0.2
  bernoulli_seed: int = 0
  pruned_layers: tuple[int, ...] = ()
  decode_skip: bool = True
  compact_impl: str = "auto"

  def __post_init__(self):
    if self.window < 0:
      raise ValueError(f"model.scheme_kwargs.window={self.window} must be >= 0.")
    if self.tau <= 0:
      raise ValueError(f"model.scheme_kwargs.tau={self.tau} must be > 0.")
    if not 0.0 <= self.p_force <= 1.0:
      raise ValueError(f"model.scheme_kwargs.p_force={self.p_force} must be in [0, 1].")
    if not 0.0 <= self.bernoulli_q <= 1.0:
      raise ValueError(f"model.scheme_kwargs.bernoulli_q={self.bernoulli_q} must be in [0, 1].")
    if self.routing not in ROUTINGS:
      raise ValueError(f"model.scheme_kwargs.routing={self.routing!r}: choose one of {ROUTINGS}.")
    if self.lambda_schedule not in LAMBDA_SCHEDULES:
      raise ValueError(f"model.scheme_kwargs.lambda_schedule={self.lambda_schedule!r}: choose one "
                       f"of {LAMBDA_SCHEDULES}.")
    if self.lambda_warmup_steps < 0 or self.lambda_ramp_steps < 0:
      raise ValueError("model.scheme_kwargs.lambda_warmup_steps / lambda_ramp_steps must be >= 0.")
    if not isinstance(self.pruned_layers, tuple):
      raise ValueError("model.scheme_kwargs.pruned_layers must be a tuple of ints (hashable), got "
                       f"{self.pruned_layers!r}.")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(L2AOptions))


def l2a_options(config) -> L2AOptions:
  """L2AOptions from a ModelConfig (its scheme_kwargs), a dict, or L2AOptions."""
  if isinstance(config, L2AOptions):
    return config
  if isinstance(config, ModelConfig):
    kw = config.scheme_options
  elif isinstance(config, dict):
    kw = dict(config)
  elif hasattr(config, "model"):  # a run config holding a model section
    return l2a_options(config.model)
  else:
    kw = dict(getattr(config, "scheme_kwargs", ()))
  unknown = sorted(set(kw) - set(OPTION_NAMES))
  if unknown:
    raise ValueError(f"model.scheme_kwargs has unknown L2A option(s) {unknown}; valid: "
                     f"{sorted(OPTION_NAMES)}.")
  if "pruned_layers" in kw:
    kw["pruned_layers"] = tuple(int(i) for i in kw["pruned_layers"])
  return L2AOptions(**kw)


def l2a_config(base: ModelConfig, **options) -> ModelConfig:
  """`base` (any scheme) turned into scheme 'l2a' with these options (validated)."""
  if base.post_norm:
    raise ValueError(f"L2A is defined for pre-norm families (llama, qwen2, qwen3); "
                     f"model.family={base.family!r} is post-norm.")
  kw = dict(base.scheme_kwargs) if base.scheme == "l2a" else {}
  kw.update(options)
  if "pruned_layers" in kw:
    kw["pruned_layers"] = tuple(sorted(int(i) for i in kw["pruned_layers"]))
  l2a_options(kw)  # validate
  return base.replace(scheme="l2a", scheme_kwargs=tuple(sorted(kw.items())))


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


class L2ALayer(nn.Module):
  """One L2A decoder layer. Returns (x, aux) with per-layer aux scalars:

  p_mean   mean router score p over non-padding tokens (learned / soft routing; for the other
           routings the fraction of tokens routed global)
  p2_mean  mean p^2 over non-padding tokens (the regulariser's term)
  sparsity fraction of non-padding tokens with d = 0 (1 for a pruned layer)
  forced   1.0 when this step ran the forced-global (dense) path
  global_tokens_B / tokens_B   per-row counts of d = 1 tokens and of non-padding tokens
  """
  config: ModelConfig
  layer_idx: int = 0

  @nn.compact
  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, train=False, decode=False,
               cache_len=None):
    cfg = self.config
    o = l2a_options(cfg)
    if cfg.post_norm:
      raise ValueError(f"L2A is defined for pre-norm families; model.family={cfg.family!r}.")
    B, T, _ = x_BTD.shape
    valid_BT = (jnp.ones((B, T), bool) if segment_ids_BT is None or decode
                else segment_ids_BT != 0)
    n_valid_B = jnp.sum(valid_BT, axis=1).astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(n_valid_B), 1.0)
    if decode and cache_len is None:
      raise ValueError("decode=True needs cache_len (the longest sequence to decode).")

    # ---- local branch: s = x + LocalAttn(RMSNorm_in(x))
    local = Attention(cfg, window=o.window, name="self_attn")
    h = make_norm(cfg, "input_layernorm")(x_BTD)
    if o.window == 0:  # a window of 0 keys attends to nothing (and keeps no cache)
      if self.is_initializing():
        local(h, positions_BT, segment_ids_BT)  # the params still exist (a converted layer)
      s_BTD = x_BTD
    elif not decode:
      s_BTD = x_BTD + local(h, positions_BT, segment_ids_BT)
    else:
      q, k, v = local.qkv(h, positions_BT)
      size = min(o.window, cache_len)  # a ring of cache_len slots already holds every key
      k_all, v_all, kv_pos, kv_valid = local.cache(k, v, positions_BT, size)
      out = ops.attention(q, k_all, v_all, q_positions_BT=positions_BT, kv_positions_BS=kv_pos,
                          kv_segment_ids_BS=kv_valid, window=o.window)
      s_BTD = x_BTD + local.project_out(out)

    zeros = jnp.zeros((), jnp.float32)
    if self.layer_idx in o.pruned_layers:
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
      key = (self.make_rng("router") if (train and self.has_rng("router"))
             else jax.random.PRNGKey(o.bernoulli_seed))
      hard_BT = _bernoulli_uniform(key, positions_BT, self.layer_idx) < o.bernoulli_q
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
    if train and o.routing == "learned" and o.p_force > 0:
      if not self.has_rng("router"):
        raise ValueError("L2A training with p_force > 0 needs the step RNG: call the model with "
                         "rngs={'router': key} (the same key on every replica).")
      forced = jax.random.bernoulli(self.make_rng("router"), o.p_force)

    # ---- global branch
    glob = Attention(cfg, window=None, name="global_attn")
    q, k, v = glob.qkv(g_BTD, positions_BT)
    impl = o.compact_impl
    if decode:
      k_all, v_all, kv_pos, kv_valid = glob.cache(k, v, positions_BT, cache_len)

      def run_global(q, k_all, v_all):
        return ops.compact_attention(q, k_all, v_all, hard_BT, q_positions_BT=positions_BT,
                                     kv_positions_BS=kv_pos, kv_segment_ids_BS=kv_valid,
                                     impl=impl)

      if o.decode_skip:
        a_BTNH = lax.cond(jnp.any(hard_BT), run_global, lambda q, *_: jnp.zeros_like(q),
                          q, k_all, v_all)
      else:
        a_BTNH = run_global(q, k_all, v_all)
    else:
      def dense(q, k, v):
        return ops.attention(q, k, v, q_positions_BT=positions_BT, kv_positions_BS=positions_BT,
                             q_segment_ids_BT=segment_ids_BT, kv_segment_ids_BS=segment_ids_BT,
                             impl=cfg.attention_impl, self_attention=True)

      def compact(q, k, v):
        return ops.compact_attention(q, k, v, hard_BT, q_positions_BT=positions_BT,
                                     kv_positions_BS=positions_BT, q_segment_ids_BT=segment_ids_BT,
                                     kv_segment_ids_BS=segment_ids_BT, impl=impl)

      if o.routing in ("all", "soft"):
        a_BTNH = dense(q, k, v)
      elif o.routing == "none":
        a_BTNH = jnp.zeros_like(q)
      elif train and o.routing == "learned" and o.p_force > 0:
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


def aux_loss(aux, step, config):
  """`lambda(step) * (1/L) * sum_l mean_{b,t} p_{l,b,t}^2` and the L2A metrics.

  aux: the decoder's stacked per-layer dict (leading axis L); config: the ModelConfig (or a run
  config with a `model` section, or the options). Metrics (scalars): l2a/lambda, l2a/reg,
  l2a/sparsity (mean over layers with a global branch), l2a/router_p, l2a/forced_frac (fraction
  of layers that took the forced-global step), and per layer l2a/sparsity_layer_{i},
  l2a/router_p_layer_{i}.
  """
  opts = l2a_options(config)
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


# ----------------------------------------------------------------------------------------------
# Conversion: dense <-> L2A, pruning
# ----------------------------------------------------------------------------------------------
def _copy_tree(tree):
  return jax.tree.map(lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a, tree)


def _strip(params):
  """(inner params, rewrap) for trees given with or without a top-level 'params' key."""
  if "params" in params and "embed_tokens" not in params:
    return params["params"], lambda p: {**params, "params": p}
  return params, lambda p: p


def _num_layers(params) -> int:
  return sum(1 for k in params if k.startswith("layers_"))


def from_dense(params, config):
  """Dense params -> L2A params (SCHEMES.md 1): per layer `global_attn` = copy of `self_attn`,
  `global_layernorm` = copy of `input_layernorm`, `router` = zeros [D] (every token global at
  init). Layers in `pruned_layers` get no global branch. Works on plain or nn.Partitioned-boxed
  trees (numpy or jax arrays), with or without a top-level 'params' key. `config` is the target
  L2A ModelConfig (or the options)."""
  opts = l2a_options(config)
  inner, rewrap = _strip(params)
  out = dict(inner)
  for i in range(_num_layers(inner)):
    name = f"layers_{i}"
    layer = dict(inner[name])
    if "global_attn" in layer:
      raise ValueError(f"from_dense: {name} already has a global_attn (params are not dense).")
    if "input_layernorm" not in layer:
      raise ValueError(f"from_dense: {name} has no input_layernorm: L2A needs a pre-norm family.")
    if i not in opts.pruned_layers:
      layer["global_attn"] = _copy_tree(layer["self_attn"])
      layer["global_layernorm"] = _copy_tree(layer["input_layernorm"])
      scale = layer["input_layernorm"]["scale"]
      if isinstance(scale, nn.Partitioned):
        router = scale.replace(value=jnp.zeros(scale.value.shape, scale.value.dtype),
                               names=("embed",))
      elif isinstance(scale, np.ndarray):
        router = np.zeros(scale.shape, scale.dtype)
      else:
        router = jnp.zeros(scale.shape, scale.dtype)
      layer["router"] = {"kernel": router}
    out[name] = layer
  return rewrap(out)


GLOBAL_BRANCH = ("global_attn", "global_layernorm", "router")


def prune_params(params, layers: Iterable[int]):
  """Drops the global branch (global_attn, global_layernorm, router) of these layers."""
  inner, rewrap = _strip(params)
  out = dict(inner)
  for i in layers:
    layer = {k: v for k, v in inner[f"layers_{i}"].items() if k not in GLOBAL_BRANCH}
    out[f"layers_{i}"] = layer
  return rewrap(out)


def to_dense(params, config: ModelConfig):
  """L2A -> dense: keep the LOCAL branch (self_attn) and drop every global branch.

  Returns (dense config with sliding_window = w, params): exactly the function of the L2A model
  with every layer pruned (or routing='none'), i.e. the reverse of `from_dense` up to the
  global weights. For window 0 there is no dense equivalent (a layer that attends to nothing)."""
  opts = l2a_options(config)
  if opts.window == 0:
    raise ValueError("to_dense: window=0 has no dense (sliding-window) equivalent.")
  inner, rewrap = _strip(params)
  dense_params = prune_params(inner, range(_num_layers(inner)))
  return config.replace(scheme="dense", scheme_kwargs=(), sliding_window=opts.window), \
      rewrap(dense_params)


def dense_to_l2a(params, config: ModelConfig, **options) -> tuple[ModelConfig, Any]:
  """(dense config, params) -> (L2A config with `options`, L2A params)."""
  cfg = l2a_config(config, **options)
  return cfg, from_dense(params, cfg)


def prune(params, config: ModelConfig, layer_sparsity, threshold: float = 0.95):
  """Post-training pruning: layers with sparsity >= threshold lose their global branch.

  Returns (pruned config, pruned params, the newly pruned layer indices)."""
  opts = l2a_options(config)
  sp = np.asarray(layer_sparsity, np.float64)
  new = tuple(int(i) for i in np.nonzero(sp >= threshold)[0] if int(i) not in opts.pruned_layers)
  cfg = l2a_config(config, pruned_layers=tuple(sorted(set(opts.pruned_layers) | set(new))))
  return cfg, prune_params(params, new), new


# ----------------------------------------------------------------------------------------------
# Measuring sparsity, KV-cache bytes
# ----------------------------------------------------------------------------------------------
def measure_sparsity(model, params, batches, *, theta: float | None = None) -> dict[str, Any]:
  """Per-layer sparsity (fraction of non-padding tokens with d = 0) over held-out batches.

  model: a Decoder with an L2A config (theta overrides its threshold); batches: iterable of dicts
  with `inputs` (+ optional `positions`, `segment_ids`). Returns {'layer_sparsity': [L],
  'sparsity': mean over layers with a global branch, 'tokens': count}.
  """
  from condattn_jax.models.decoder import Decoder  # avoid an import cycle at module load

  cfg = model.config
  if theta is not None:
    cfg = l2a_config(cfg, theta=float(theta))
  m = Decoder(cfg)

  @jax.jit
  def counts(params, inputs, positions, segment_ids):
    _, aux = m.apply({"params": params}, inputs, positions, segment_ids)
    return jnp.sum(aux["global_tokens_B"], axis=1), jnp.sum(aux["tokens_B"], axis=1)

  glob = tokens = None
  for batch in batches:
    inputs = jnp.asarray(batch["inputs"])
    pos = batch.get("positions")
    seg = batch.get("segment_ids")
    g, t = counts(params, inputs, None if pos is None else jnp.asarray(pos),
                  None if seg is None else jnp.asarray(seg))
    g, t = np.asarray(g, np.float64), np.asarray(t, np.float64)
    glob = g if glob is None else glob + g
    tokens = t if tokens is None else tokens + t
  if glob is None:
    raise ValueError("measure_sparsity: no batches.")
  layer_sparsity = 1.0 - glob / np.maximum(tokens, 1.0)
  opts = l2a_options(cfg)
  live = [i for i in range(cfg.num_layers) if i not in opts.pruned_layers]
  return {"layer_sparsity": [float(x) for x in layer_sparsity],
          "sparsity": float(np.mean(layer_sparsity[live])) if live else 1.0,
          "tokens": float(tokens[0])}


def kv_cache_bytes(config: ModelConfig, context_len: int, *, batch: int = 1,
                   dtype: str | None = None) -> dict[str, int]:
  """Decode KV-cache bytes at `context_len` tokens (K and V only).

  dense : every layer a full cache (a dense `sliding_window` layer: a ring of w slots).
  l2a   : per layer a window ring of min(w, context_len) slots for `self_attn`, plus a full cache
          of context_len slots for `global_attn` unless the layer is pruned.
  Returns {'total', 'full', 'window'} in bytes.
  """
  per_token = 2 * config.num_kv_heads * config.head_dim * jnp.dtype(
      dtype or config.dtype).itemsize * batch
  full = window = 0
  for i in range(config.num_layers):
    if config.scheme == "l2a":
      o = l2a_options(config)
      window += min(o.window, context_len) * per_token
      if i not in o.pruned_layers:
        full += context_len * per_token
    elif config.sliding_window is not None:
      window += min(config.sliding_window, context_len) * per_token
    else:
      full += context_len * per_token
  return {"total": int(full + window), "full": int(full), "window": int(window)}


def kv_bytes_report(config: ModelConfig, pruned: ModelConfig, context_len: int,
                    dtype: str | None = None) -> dict[str, Any]:
  """KV-cache bytes of the dense base model, the L2A model before pruning and after, and the
  reductions relative to both (one context of `context_len` tokens)."""
  base = config.replace(scheme="dense", scheme_kwargs=(), sliding_window=None)
  dense = kv_cache_bytes(base, context_len, dtype=dtype)["total"]
  before = kv_cache_bytes(config, context_len, dtype=dtype)["total"]
  after = kv_cache_bytes(pruned, context_len, dtype=dtype)["total"]
  return {
      "kv_bytes_dense_base": dense,
      "kv_bytes_before": before,
      "kv_bytes_after": after,
      "kv_reduction_vs_before": 1.0 - after / max(before, 1),
      "kv_reduction_vs_dense": 1.0 - after / max(dense, 1),
  }


def prune_report(model, params, batches, *, context_len: int, threshold: float = 0.95,
                 theta: float | None = None, dtype: str | None = None) -> dict[str, Any]:
  """Measure per-layer sparsity, prune layers >= threshold, report KV-cache bytes.

  Returns a dict with the pruned config and params under 'config' / 'params' and a JSON-ready
  'report': layer_sparsity, pruned_layers, kv bytes for the dense base model, the L2A model before
  pruning and after, and the reduction relative to both.
  """
  cfg = model.config
  if theta is not None:
    cfg = l2a_config(cfg, theta=float(theta))
  from condattn_jax.models.decoder import Decoder
  meas = measure_sparsity(Decoder(cfg), params, batches)
  pcfg, pparams, new = prune(params, cfg, meas["layer_sparsity"], threshold)
  report = {
      "context_len": int(context_len),
      "threshold": float(threshold),
      "theta": float(l2a_options(cfg).theta),
      "layer_sparsity": meas["layer_sparsity"],
      "sparsity": meas["sparsity"],
      "pruned_layers": list(l2a_options(pcfg).pruned_layers),
      "newly_pruned": list(new),
      **kv_bytes_report(cfg, pcfg, context_len, dtype),
  }
  return {"config": pcfg, "params": pparams, "report": report}


L2A = register(Scheme(name="l2a", layer_cls=L2ALayer, aux_loss=aux_loss, from_dense=from_dense))
