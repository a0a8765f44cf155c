"""Elastic Attention's decoder layer, options, router and Lagrangian loss (docs/schemes/elastic.md#semantics).

Per decoder layer, with k the key states after k_norm and BEFORE RoPE ([B, T, K, H]):

    x_K   = pool(k)                      # boundary: mean of the first and last `boundary` valid
                                         # tokens of the row's prompt; prompt_mean: all of them
    z     = RouterMLP(TaskMLP(x_K))      # [B, K, 2] logits, one pair of MLPs per layer, shared by
                                         # the layer's KV heads; class 1 = FA, class 0 = SA
    train : y = softmax((z + Gumbel) / tau); fa = onehot(argmax y)[1] + y[1] - sg(y[1])  (STE)
    eval  : fa = argmax(z) == 1   (no noise)
    head_n = fa[kv(n)] * FA_n + (1 - fa[kv(n)]) * SA_n           (same q/k/v/o weights)

`modes` picks (class 1, class 0): 'fa_ssa' (FA, SSA: default), 'fa_xa' (FA, XA), 'xa_ssa'
(XA, SSA). SA modes are `ops.BlockLists` (see masks.py). Training computes both modes for every
head (the STE needs FA - SA); eval and decode run ONE `ops.attention` call per layer whose
`BlockLists.head_mode_BN` gives each head its mode (HEAD_FULL for FA heads, HEAD_BLOCKS with the
head's SSA / XA list otherwise), so the block-sparse kernel runs a layer's mixed heads in one
launch.

The prompt: the valid tokens of the row, cut at ctx.fields[prompt_field][b] when the batch has
that field ([B] int). Decode: the decision is made by the first cached call of a row (the prompt
of a one-shot prefill; with chunked prefill, the first chunk), cached in the layer's 'cache'
collection (`elastic_decision` [B, K, 2]: the modes and their router probability;
`elastic_decided` [B]) and reused by every later call (a one-token step that the engine knows
every active row has decided reads them and runs no router: `ElasticLayer.decode_fields`); a
full forward over prompt + continuation with prompt_field = the prompt length computes the
same function. XA is a prefill method: XA heads run their XA lists on a row's first cached call
when it starts at position 0 with a multiple of `block` tokens (a one-shot prefill: the same
lists as the full forward), full attention on later calls (chunks after the first, decode).
SSA lists over the cache: per query block for chunks of a multiple of `block` tokens
(block-aligned prefill), per query (block_q = 1) otherwise.

Tau (Gumbel temperature) at train step s = ctx.fields['step'] (the train step passes it):
cosine tau_start -> tau_end over anneal_steps (authors' code), or 'exp':
max(tau_end, tau_start * exp(-tau_exp_rate * s / anneal_steps)) (paper eq. 14, with the step
read as training progress). Without a step: tau_end.

Loss (aux_loss): Omega_b = fraction of the sample's query heads (all layers) in class 0 (with the
STE: the router gets the gradient), per-sample term
lambda1[task] (Omega_b - t_task) + lambda2[task] (Omega_b - t_task)^2 (lagrangian 'signed', paper
eq. 8; 'abs': lambda1[task] |Omega_b - t_task|, the authors' code), averaged within each
task, then over the tasks present in the batch (constraint 'sample'; 'task_mean': the same
terms of the task's batch-mean Omega instead of each sample's). lambda = params['scheme']['lagrange'] [2, tasks]
(row 0: lambda1, row 1: lambda2; init U(0, lambda_init_max)), trained by gradient ASCENT: the
scheme declares it (`Scheme.ascent_params`) and the train step flips its gradient (one 2-D leaf,
so AdamW's weight decay applies to it).
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from condattn_jax import ops
from condattn_jax.attention.elastic import composite, masks
from condattn_jax.attention import options
from condattn_jax.attention.elastic.options import FA, ElasticOptions
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import Attention, make_norm, mlp_residual
from condattn_jax.parallel import context

def fixed_fa_head_sets(spec, num_layers: int) -> tuple:
  """routing 'fixed': the class-1 KV heads of each layer (num_layers tuples) from
  `fixed_fa_kv_heads` (one tuple for every layer, or one per layer)."""
  spec = tuple(spec)
  if not (spec and isinstance(spec[0], (tuple, list))):
    return (spec,) * num_layers
  if len(spec) != num_layers:
    raise ValueError(f"model.scheme.fixed_fa_kv_heads has {len(spec)} per-layer "
                     f"tuples; the model has num_layers={num_layers} (give one tuple "
                     "per layer, or one tuple of heads for every layer).")
  return tuple(tuple(hs) for hs in spec)


def task_ids(names: Sequence[str], task_names: Sequence[str]) -> np.ndarray:
  """int32 [len(names)]: each record's task name -> its index in `task_names` (the config's
  model.scheme.task_names); an unknown name is a ValueError naming it and the known ones.
  The file pipeline maps records the same way with data.task_field (condattn_jax.data)."""
  from condattn_jax.data.sources import task_id  # the one name -> id map (the file pipeline's)
  return np.asarray([task_id(n, task_names) for n in names], np.int32).reshape(len(names))


def tau_at(step, o: ElasticOptions):
  """Gumbel-softmax temperature at train step `step` (None: tau_end)."""
  if step is None or o.anneal_steps == 0:
    return jnp.asarray(o.tau_end, jnp.float32)
  p = jnp.clip(jnp.asarray(step, jnp.float32) / o.anneal_steps, 0.0, 1.0)
  if o.tau_schedule == "cosine":
    return o.tau_end + (o.tau_start - o.tau_end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
  return jnp.maximum(o.tau_end, o.tau_start * jnp.exp(-o.tau_exp_rate * p))


def gumbel_ste(logits_BK2, u_BK2, tau):
  """(fa_BK with the straight-through estimator, fa_hard_BK): y = softmax((z + g) / tau),
  g = -log(-log u); forward = onehot(argmax y)[FA] exactly, gradient = d y[FA]."""
  eps = 1e-10
  g = -jnp.log(-jnp.log(u_BK2 + eps) + eps)
  y = jax.nn.softmax((logits_BK2 + g) / tau, axis=-1)
  hard = (jnp.argmax(y, axis=-1) == FA).astype(jnp.float32)
  soft = y[..., FA]
  return hard + (soft - lax.stop_gradient(soft)), hard


def pool_keys(k_BTKH, valid_BT, prompt_len_B, o: ElasticOptions):
  """float32 [B, K, H]: the router's input (module docstring: boundary / prompt_mean)."""
  valid_BT = jnp.asarray(valid_BT, bool)
  j = jnp.cumsum(valid_BT, axis=1) - 1                                    # index among valid
  n = jnp.sum(valid_BT, axis=1)
  if prompt_len_B is not None:
    n = jnp.minimum(n, jnp.asarray(prompt_len_B, jnp.int32))
  w = valid_BT & (j < n[:, None])
  if o.pooling == "boundary":
    w &= (j < o.boundary) | (j >= n[:, None] - o.boundary)
  wf = w.astype(jnp.float32)
  s = jnp.einsum("bt,btkh->bkh", wf, k_BTKH.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  return s / jnp.maximum(jnp.sum(wf, axis=1), 1.0)[:, None, None]


class Router(nn.Module):
  """Task MLP Linear(H,4H)-SiLU-Linear(4H,H), router MLP Linear(H,4H)-SiLU-Linear(4H,H)-SiLU-
  Linear(H,2); float32; init N(0, 0.02), zero bias. [B, K, H] -> logits [B, K, 2]."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BKH):
    H = self.config.head_dim
    dense = lambda f, name: nn.Dense(f, dtype=jnp.float32, param_dtype=self.config.weight_dtype,
                                     kernel_init=nn.initializers.normal(0.02),
                                     bias_init=nn.initializers.zeros,
                                     precision=lax.Precision.HIGHEST, name=name)
    h = dense(H, "task_fc2")(nn.silu(dense(4 * H, "task_fc1")(x_BKH)))
    r = nn.silu(dense(H, "router_fc2")(nn.silu(dense(4 * H, "router_fc1")(h))))
    return dense(2, "router_fc3")(r)


def router_shapes(config: ModelConfig) -> dict:
  """{name: (kernel shape, bias shape)} of one layer's Router."""
  H = config.head_dim
  dims = dict(task_fc1=(H, 4 * H), task_fc2=(4 * H, H), router_fc1=(H, 4 * H),
              router_fc2=(4 * H, H), router_fc3=(H, 2))
  return {k: (v, (v[1],)) for k, v in dims.items()}


class ElasticLayer(nn.Module):
  """One Elastic decoder layer. Returns (x, aux) with per-layer values (stacked to [L, ...]):

  fa_BK      the decision per (row, KV head), 1.0 = class 1 (FA; XA under xa_ssa), with the STE
             gradient in training (the Lagrangian's Omega is built from it)
  p_fa_BK    router probability of class 1 without noise (softmax at temperature 1); decode:
             the deciding call's, cached with the decision
  rho_BN     per query head: fraction of its causal (query, key) pairs skipped (Omega_ESR's rho)
  tau        the Gumbel temperature used (tau_end outside training)
  """
  config: ModelConfig
  variant: object = None

  @staticmethod
  def serving_notes(config: ModelConfig, chunk: int, longest_prompt: int) -> tuple[str, ...]:
    """What the engine cannot serve as trained (the engine warns each once): a prefill chunk
    shorter than the prompt decides on the first chunk (the decision at layer l pools keys that
    depend on every earlier layer's output over the whole prompt, so no chunked pass can take
    the whole-prompt decision: use prefill_chunk=None); XA lists are built only on a one-shot
    prefill of a multiple of `block` tokens (later chunks and decode run XA heads full)."""
    o = options(config)
    notes = []
    if chunk < longest_prompt:
      notes.append(f"Elastic decides on a row's first prefill call: prefill chunk {chunk} < the "
                   f"prompt's {longest_prompt} tokens, so the router pools only the first chunk "
                   "(the question at the prompt's end is not seen); set prefill_chunk=None "
                   "(one-shot prefill) for the trained decision.")
    if "xa" in o.modes and (chunk < longest_prompt or chunk % o.block):
      notes.append(f"Elastic modes={o.modes!r}: XA runs on a one-shot prefill of a multiple of "
                   f"block={o.block} tokens; this prefill (chunk {chunk}, prompt "
                   f"{longest_prompt} tokens) runs XA heads full after the first chunk (dense "
                   "on those heads); set prefill_chunk=None.")
    return tuple(notes)

  @staticmethod
  def decode_fields(config, positions_B, active_B) -> dict:
    """The engine's static fields of a one-token decode step (Engine._decode_fields), on the
    host: elastic_step_decided = every active row is past its first token (position > 0), so
    an earlier cached call (its prefill) has decided its heads' modes. True compiles the step
    that reads the cached decision and runs neither the keys' pooling nor the router (about ten
    kernels a layer on a GPU, their result discarded once a row has decided); a row that turns
    out undecided after all (a decode step on a fresh cache) gets NaN heads: a refusal, never
    a silent all-SSA decision."""
    del config
    on = np.asarray(active_B, bool).reshape(-1)
    pos = np.asarray(positions_B).reshape(-1)
    return {"elastic_step_decided": bool(np.all(pos[on] > 0))}

  @nn.compact
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    o = options(cfg)
    B, T, _ = x_BTD.shape
    N, K = cfg.num_heads, cfg.num_kv_heads
    G = N // K
    attn = Attention(cfg, window=None, name="self_attn")
    x_in = x_BTD if cfg.post_norm else make_norm(cfg, "input_layernorm")(x_BTD)
    q0, k0, v = attn.project(x_in)                                        # pre-RoPE
    valid_BT = ctx.valid_BT
    refuse_B = first_B = None
    if ctx.decode and ctx.fields.get("elastic_step_decided") is True:
      # every active row has decided (decode_fields): the cached decision, no pooling, no router
      fa_BK, p_fa_BK, refuse_B = self._stored_decision(B, K, valid_BT)
      tau = jnp.asarray(o.tau_end, jnp.float32)
    else:
      fa_BK, p_fa_BK, tau = self._route(k0, valid_BT, ctx, o)
      if ctx.decode:
        fa_BK, p_fa_BK, first_B = self._cached_decision(fa_BK, p_fa_BK, valid_BT)

    q, k = attn.rope(q0, ctx.positions_BT), attn.rope(k0, ctx.positions_BT)
    fa_BN = jnp.repeat(fa_BK, G, axis=1)
    impl = cfg.attention_impl
    if ctx.decode:
      heads, rho_BN = self._decode(attn, q, k, v, ctx, fa_BN, o, impl, first_B)
    else:
      heads, rho_BN = self._self_attention(q, k, v, ctx, fa_BN, o, impl)
    if refuse_B is not None:  # the engine's fact was wrong for these rows: refused
      heads = jnp.where(refuse_B[:, None, None, None], jnp.asarray(jnp.nan, heads.dtype), heads)
    out_BTD = attn.project_out(heads)
    if cfg.post_norm:
      x_BTD = x_BTD + make_norm(cfg, "post_attention_layernorm")(out_BTD)
    else:
      x_BTD = x_BTD + out_BTD
    aux = dict(fa_BK=fa_BK, p_fa_BK=p_fa_BK, rho_BN=rho_BN, tau=tau)
    return mlp_residual(cfg, x_BTD), aux

  def _route(self, k0, valid_BT, ctx, o):
    """(fa_BK, p_fa_BK, tau): the router's decision on the pooled pre-RoPE keys (Gumbel STE in
    training, argmax otherwise; `routing` 'fa' / 'sa' / 'fixed' override it), its noise-free
    probability of class 1 and the temperature used."""
    cfg = self.config
    B, K = k0.shape[0], cfg.num_kv_heads
    prompt_len = ctx.fields.get(o.prompt_field)
    n_lay = context.layout_size()  # sequence parallel: the router pools the natural row
    logits_BK2 = Router(cfg, name="router")(pool_keys(
        context.from_layout(k0, n_lay), context.from_layout(valid_BT, n_lay), prompt_len, o))
    p_fa_BK = jax.nn.softmax(logits_BK2, axis=-1)[..., FA]
    tau = jnp.asarray(o.tau_end, jnp.float32)
    if o.routing == "fa":
      fa_BK = jnp.ones((B, K), jnp.float32)
    elif o.routing == "sa":
      fa_BK = jnp.zeros((B, K), jnp.float32)
    elif o.routing == "fixed":
      sets = fixed_fa_head_sets(o.fixed_fa_kv_heads, cfg.num_layers)
      bad = sorted({h for hs in sets for h in hs if not 0 <= h < K})
      if bad:
        raise ValueError(f"model.scheme.fixed_fa_kv_heads has {bad}: KV heads are "
                         f"0..{K - 1}.")
      fa_LK = np.stack([np.isin(np.arange(K), np.asarray(hs, int)) for hs in sets])
      fa_BK = jnp.broadcast_to(jnp.asarray(fa_LK, jnp.float32)[ctx.layer_idx], (B, K))
    elif ctx.train:
      if not self.has_rng("router"):
        raise ValueError("Elastic training draws Gumbel noise: call the model with "
                         "rngs={'router': key}.")
      tau = tau_at(ctx.fields.get("step"), o)
      u = jax.random.uniform(self.make_rng("router"), (B, K, 2), jnp.float32)
      fa_BK, _ = gumbel_ste(logits_BK2, u, tau)
    else:
      fa_BK = (jnp.argmax(logits_BK2, axis=-1) == FA).astype(jnp.float32)
    return fa_BK, p_fa_BK, tau

  # ------------------------------------------------------------------------------------------
  def _decision_cache(self, B: int, K: int):
    """The layer's cached decision: (elastic_decision [B, K, 2] float32 (the modes, their
    router probability: one buffer, as a decode step's host cost grows with its buffers),
    elastic_decided [B] int32) cache variables."""
    return (self.variable("cache", "elastic_decision", jnp.zeros, (B, K, 2), jnp.float32),
            self.variable("cache", "elastic_decided", jnp.zeros, (B,), jnp.int32))

  def _stored_decision(self, B: int, K: int, valid_BT):
    """A decode call whose active rows have all decided (decode_fields' elastic_step_decided):
    (fa_BK, p_fa_BK) as cached, nothing written, and refuse_B: the rows with a valid token and
    no decision (the engine's fact was wrong for them)."""
    c_dec, c_done = self._decision_cache(B, K)
    refuse_B = (c_done.value == 0) & jnp.any(valid_BT, axis=1)
    return c_dec.value[..., 0], c_dec.value[..., 1], refuse_B

  def _cached_decision(self, fa_BK, p_fa_BK, valid_BT):
    """Decode: the first call of a row with valid tokens decides; later calls reuse it.
    Returns (fa_BK, p_fa_BK: the decision's router probability, first_B: bool, rows that had
    not decided before this call)."""
    c_dec, c_done = self._decision_cache(*fa_BK.shape)
    done = c_done.value > 0
    fa_BK = jnp.where(done[:, None], c_dec.value[..., 0], fa_BK)
    p_fa_BK = jnp.where(done[:, None], c_dec.value[..., 1], p_fa_BK.astype(jnp.float32))
    c_dec.value = jnp.stack([fa_BK, p_fa_BK], axis=-1)
    c_done.value = (done | jnp.any(valid_BT, axis=1)).astype(jnp.int32)
    return fa_BK, p_fa_BK, ~done

  def _self_attention(self, q, k, v, ctx, fa_BN, o, impl):
    """(heads [B, T, N, H], rho_BN) of the full forward: training computes both modes for every
    head and mixes them (STE); otherwise ONE call with a per-head mode."""
    B, T, N, _ = q.shape
    nq = -(-T // o.block)
    rows = jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32) * o.block, (B, nq))
    ssa = masks.ssa_lists(rows, sinks=o.sinks, local=o.local, block=o.block)
    ssa = jnp.broadcast_to(ssa[:, None], (B, N, nq, ssa.shape[-1]))
    xa = None
    n_lay = context.layout_size()  # lists of the natural row's blocks; laid out in `blocks`
    if "xa" in o.modes:
      nat = lambda x: context.from_layout(x, n_lay)
      xa = masks.xa_lists(nat(q), nat(k), nat(ctx.valid_BT), block=o.block, stride=o.xa_stride,
                          threshold=o.xa_threshold, q_chunk=o.xa_chunk)
    L = ssa.shape[-1] if xa is None else max(ssa.shape[-1], xa.shape[-1])
    ssa = masks.pad_lists(ssa, L)
    xa = None if xa is None else masks.pad_lists(xa, L)
    cls1 = None if o.modes.startswith("fa") else xa                       # None = FA
    cls0 = xa if o.modes == "fa_xa" else ssa
    base = dict(q_positions_BT=ctx.positions_BT, kv_positions_BS=ctx.positions_BT,
                q_segment_ids_BT=ctx.segment_ids_BT, kv_segment_ids_BS=ctx.segment_ids_BT,
                contiguous=True)
    blocks = lambda lists, mode: ops.BlockLists(context.to_layout(lists, n_lay, axis=2), mode,
                                                block_q=o.block, block_k=o.block)
    # sequence parallel: every head through ops.attention (context.attention per shard); the
    # cuDNN split of full heads runs per batch / head shard over the whole row, not per shard
    run = lambda bl: composite.attention(q, k, v, ops.MaskSpec(**base, block_lists=bl), impl=impl,
                                         dense_full_heads=o.dense_full_heads and n_lay == 1)
    fa_on = fa_BN > 0.5
    head_mode = jnp.where(fa_on & (cls1 is None), ops.HEAD_FULL, ops.HEAD_BLOCKS).astype(jnp.int32)
    lists = cls0 if cls1 is None else jnp.where(fa_on[..., None, None], cls1, cls0)
    n_valid = jnp.sum(ctx.valid_BT, axis=1)
    rho_BN = masks.skipped_fraction(lists, head_mode, n_valid, T, o.block)
    learned = ctx.train and o.routing == "learned"
    if not learned:
      return run(blocks(lists, head_mode)), rho_BN
    all_blocks = jnp.full((B, N), ops.HEAD_BLOCKS, jnp.int32)
    out1 = (run(None) if cls1 is None else run(blocks(cls1, all_blocks)))
    out0 = run(blocks(cls0, all_blocks))
    z = fa_BN[:, None, :, None].astype(q.dtype)
    return z * out1 + (1 - z) * out0, rho_BN

  def _decode(self, attn, q, k, v, ctx, fa_BN, o, impl, first_B=None):
    """ONE call over the layer's full KV cache: FA heads full, SSA heads their lists (slots =
    positions in the full cache), XA heads their XA lists on a row's first call when it starts
    at position 0 with a multiple of `block` tokens (a one-shot prefill: the cache then holds
    exactly this chunk's keys, so the lists are the full forward's), full attention otherwise
    (later chunks, decode: XA is a prefill method; without XA lists every query head of a kv
    head has the same lists and mode: BlockLists.shared_by_kv_head). A chunk of a multiple of
    `block` tokens (prefill) uses block_q = block (the kernels' tile), lists from each query
    block's first and last positions (exact when chunks start at block-aligned positions, as
    the engine's prefill does with a chunk size that `block` divides); other chunks (decode:
    T = 1) use per-query lists (block_q = 1, exact). Returns (heads, rho_BN: the fraction of
    this call's causal (query, key) pairs each head skips, `decode_skipped_fraction`)."""
    B, T, N, _ = q.shape
    k_all, v_all, kv_pos, kv_valid = attn.write_cache(k, v, ctx)
    bq = o.block if T % o.block == 0 else 1
    pos = ctx.positions_BT.reshape(B, T // bq, bq)
    ssa = masks.ssa_lists(pos[..., 0], sinks=o.sinks, local=o.local, block=o.block,
                          q_last_BQ=pos[..., -1])
    lists = jnp.broadcast_to(ssa[:, None], (B, N, T // bq, ssa.shape[-1]))
    ssa_on = (fa_BN < 0.5) if o.modes.endswith("ssa") else jnp.zeros((B, N), bool)
    mode = jnp.where(ssa_on, ops.HEAD_BLOCKS, ops.HEAD_FULL).astype(jnp.int32)
    xa_call = "xa" in o.modes and bq == o.block and first_B is not None
    if xa_call:
      xa = masks.xa_lists(q, k, ctx.valid_BT, block=o.block, stride=o.xa_stride,
                          threshold=o.xa_threshold, q_chunk=o.xa_chunk)     # chunk = the cache
      xa_head = (fa_BN > 0.5) if o.modes == "xa_ssa" else (fa_BN < 0.5)
      use_xa = xa_head & (first_B & (ctx.positions_BT[:, 0] == 0))[:, None]
      L = max(lists.shape[-1], xa.shape[-1])
      lists = jnp.where(use_xa[..., None, None], masks.pad_lists(xa, L),
                        masks.pad_lists(lists, L))
      mode = jnp.where(use_xa, ops.HEAD_BLOCKS, mode).astype(jnp.int32)
    # a one-token step: the cache's fill too (MaskSpec.kv_lengths_B: the full cache's keys are
    # its first `fill` slots); the decode kernels then read it instead of the validity, bounding
    # their reads by arithmetic on the fill instead of a pass over the [B, S] slots a layer
    fill_B = attn.fill_after_write(ctx, k_all.shape[1]) if T == 1 else None
    mask = ops.MaskSpec(q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                        kv_segment_ids_BS=kv_valid, kv_lengths_B=fill_B,
                        block_lists=ops.BlockLists(lists, mode, block_q=bq, block_k=o.block,
                                                   shared_by_kv_head=not xa_call))
    return (ops.attention(q, k_all, v_all, mask, impl=impl),
            decode_skipped_fraction(lists, mode, ctx.positions_BT, ctx.valid_BT, bq, o.block))


def decode_skipped_fraction(lists_BNQL, mode_BN, positions_BT, valid_BT, block_q: int,
                            block: int):
  """float32 [B, N]: the fraction of a decode call's causal (query, key) pairs a head skips
  (Omega_ESR's rho over the call's valid queries; 0 for HEAD_FULL heads and rows without a
  query). Slots are positions (the full cache): a query at position p sees, of each listed key
  block j, the keys j * block .. min(p, (j + 1) * block - 1); it has p + 1 causal keys."""
  p_BT1 = positions_BT.astype(jnp.int32)[:, None, :, None]
  lists = jnp.repeat(lists_BNQL, block_q, axis=2)                         # [B, N, T, L]
  seen = jnp.where(lists >= 0, jnp.clip(p_BT1 + 1 - lists * block, 0, block), 0)
  ok = jnp.asarray(valid_BT, jnp.float32)[:, None, :]
  seen_BN = jnp.sum(jnp.sum(seen, -1) * ok, -1)
  total_BN = jnp.sum((p_BT1[..., 0] + 1) * ok, -1)
  rho = 1.0 - seen_BN / jnp.maximum(total_BN, 1.0)
  return jnp.where((mode_BN == ops.HEAD_FULL) | (total_BN == 0), 0.0, rho).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Lagrangian loss and metrics
# ----------------------------------------------------------------------------------------------
class Multipliers(nn.Module):
  """Elastic's scheme module (`Scheme.module`): the model-level params['scheme']['lagrange']
  [2, num_tasks] (lambda1; lambda2), float32, U(0, lambda_init_max); handed to aux_loss as
  aux['scheme']['lagrange'] (the train step ascends them: `Scheme.ascent_params`)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BT, ctx):
    del tokens_BT, ctx
    o = options(self.config)
    init = lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, 0.0, o.lambda_init_max)
    return None, {}, {"lagrange": self.param("lagrange", init, (2, o.num_tasks), jnp.float32)}


def _task_ids(batch, B):
  t = None if batch is None else batch.get("task_ids")
  return jnp.zeros((B,), jnp.int32) if t is None else jnp.asarray(t, jnp.int32)


def aux_loss(aux, batch, step, config):
  """The Lagrangian sparsity term (module docstring) and the Elastic metrics.

  Metrics: elastic/omega_msr (mean per-sample Omega_MSR: the headline), elastic/omega_esr,
  elastic/msr_sum_task, esr_sum_task, samples_task [tasks] (sums: Omega of task k =
  msr_sum_task[k] / samples_task[k], averageable over batches), elastic/msr/<task> (this batch,
  0 when absent), elastic/lambda1, lambda2 [tasks], elastic/tau, elastic/fa_freq [L, N] (mean
  class-1 decision per layer x query head), elastic/p_fa [L, K].
  """
  del step
  o = options(config)
  fa_LBK = aux["fa_BK"]
  L, B, K = fa_LBK.shape
  N = aux["rho_BN"].shape[-1]
  omega_B = 1.0 - jnp.mean(fa_LBK, axis=(0, 2))                          # class-0 fraction
  esr_B = jnp.mean(aux["rho_BN"], axis=(0, 2))
  tid = _task_ids(batch, B)
  onehot = jax.nn.one_hot(tid, o.num_tasks, dtype=jnp.float32)            # [B, tasks]
  target_B = jnp.asarray(o.targets, jnp.float32)[tid]
  lam = aux["scheme"]["lagrange"]
  count = jnp.sum(onehot, axis=0)
  first = jnp.abs if o.lagrangian == "abs" else (lambda d: d)
  if o.constraint == "task_mean":  # the task's batch-mean Omega against its target
    dev_K = (omega_B @ onehot) / jnp.maximum(count, 1.0) - jnp.asarray(o.targets, jnp.float32)
    per_task = lam[0] * first(dev_K) + lam[1] * dev_K * dev_K
  else:
    dev = omega_B - target_B
    term_B = lam[0][tid] * first(dev) + lam[1][tid] * dev * dev
    per_task = (term_B @ onehot) / jnp.maximum(count, 1.0)
  present = (count > 0).astype(jnp.float32)
  loss = jnp.sum(per_task * present) / jnp.maximum(jnp.sum(present), 1.0)
  msr_sum = lax.stop_gradient(omega_B) @ onehot
  metrics = {
      "elastic/omega_msr": jnp.mean(lax.stop_gradient(omega_B)),
      "elastic/omega_esr": jnp.mean(esr_B),
      "elastic/msr_sum_task": msr_sum,
      "elastic/esr_sum_task": esr_B @ onehot,
      "elastic/samples_task": count,
      "elastic/lambda1": lam[0],
      "elastic/lambda2": lam[1],
      "elastic/lagrangian": lax.stop_gradient(loss),
      "elastic/tau": jnp.mean(aux["tau"]),
      "elastic/fa_freq": jnp.repeat(jnp.mean(lax.stop_gradient(fa_LBK), axis=1), N // K, axis=1),
      "elastic/p_fa": jnp.mean(aux["p_fa_BK"], axis=1),
  }
  for i, name in enumerate(o.task_names):
    metrics[f"elastic/msr/{name}"] = msr_sum[i] / jnp.maximum(count[i], 1.0)
  return loss, metrics


def serving_forward(model, params, tokens_BT, positions_BT, segment_ids_BT, prefill_lengths_B):
  """Scheme.serving_forward: generation decides once per row on its first engine call, so it
  equals the full forward whose router pools the first `prefill_lengths_B` tokens."""
  o = options(model.config)
  return model.apply({"params": params}, tokens_BT, positions_BT, segment_ids_BT,
                     fields={o.prompt_field: jnp.asarray(prefill_lengths_B, jnp.int32)})
