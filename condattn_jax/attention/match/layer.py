"""MATCH's decoder layer (docs/schemes/match.md).

Variants (`Scheme.layer_variants`, see options.layer_kinds): 'swa' layers (sliding window w +
retrieval) and 'full' layers (plain causal attention: the full-attention layers a post-sparsified
model keeps). Parameter names are the dense layer's, so a dense checkpoint loads as is.

An SWA layer, for query t in block g (slots g*c .. g*c+c-1, see retrieval.py):
    visible(t, s) = causal AND (t - s < w  OR  s in one of block g's retrieved chunks)
Two ways to run it (options.attention_path; 'auto' picks per lowering platform):
Block-sparse (every call of more than one token): one ops.attention call over the whole row
with block lists: query block g (block_q = c) of every head lists block g's retrieved chunks
(block_k = c) in head mode HEAD_WINDOW_BLOCKS (window OR listed blocks whole, under causality
and documents): pallas_kernels.block_sparse's Mosaic GPU kernel on Hopper, no gathered keys (K/V
read in place: a training forward's memory is SWA's plus the kernel's step tables). With
retrieved_kv='sequence' the lists name chunks of the row; with recomputed retrieved K/V
(recompute mode, the engine's prefill calls) every block's retrieved K/V are appended after the
keys (this forward's, or the cache's after the write) at a position before every query and
outside every window, and block g lists its own; a call starting inside a block takes its
queries shifted so that MATCH's blocks are the kernel's query tiles. The retrieved chunks lie
before the window of every query of their block (retrieval.py's candidates), so window and
listed blocks never overlap and the union is what the gathered path computes. One-token decode
steps gather.
Gathered (never a dense T x T mask): per block, gather the block's queries [c], its local keys
(slots g*c-w+1 .. g*c+c-1: the window of every query of the block) and its k*c retrieved keys,
and run ops.attention on [B*G, c] x [B*G, w+c-1+k*c] with explicit positions, the keys padded
with invisible slots to a multiple of 128 (whole kv tiles of the kernels; impl 'auto': the
compacted-query Pallas kernel on GPU/TPU, the reference on CPU). The window applies to the local
keys through their real positions; the retrieved keys get the block's first position as their
mask slot (inside every block query's window, never after it; RoPE was applied with their real
positions before), so one MaskSpec expresses "window OR retrieved".

Retrieved K/V (options.retrieved_kv):
  sequence   the chunks' K/V in this forward (training; the paper's mask).
  recompute  the auxiliary input: the decoder appends the retrieved chunks' raw tokens (fields
             from inputs.MatchInputs) as extra rows; every layer runs them (attention among the
             block's retrieved chunks, causal on positions; then the MLP) and the block's queries
             attend to their K/V. Decode always works this way.
Decode (ctx.decode): a window-only ring cache (Attention's KVCache with `window` slots) for the
SWA layers, a full cache for 'full' layers; the retrieved chunks' K/V are recomputed once per
decoding block (when a row enters a new block) and kept in a fixed-size cache (RetrievedCache:
k*c slots) that the block's later tokens reuse; between refreshes the aux rows are skipped: the
engine knows on the host which steps enter a block (MatchLayer.decode_fields ->
ctx.fields['match_step_enters'], static: two programs, no cond), unknown keeps an nn.cond a layer.
So SWA-layer memory is flat in the context length. An engine prefill call with the
prompt lengths carries auxiliary rows only for the blocks that retrieve (the last m prompt
positions: inputs.block_retrieves), mapped to their blocks by match_aux_block_BG, and runs them
only when one of them retrieves a chunk: one nn.cond a layer (MatchLayer._prefill_attend) holds
the aux rows and the attention over their K/V, else SWA's attention over the cache (on a GPU
each cond is a predicate read on the host). A long prompt's calls before its last m positions
cost what SWA's do, bar the retrieval search (once a call, in MatchInputs), the aux tokens'
embedding and that cond; the block-sparse call appends only the aux blocks' K/V. The engine
knows on the host which calls hold a retrieving block (MatchLayer.prefill_fields ->
ctx.fields['match_call_retrieves'], static): False compiles SWA's call (no search, no aux rows,
no cond: `_prefill_window`), True the retrieving branch without the cond; unknown keeps the cond.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import numpy as np
import jax.numpy as jnp

from condattn_jax import ops
from condattn_jax.attention.match.inputs import (_take, block_inputs, call_aux_blocks,
                                                 call_retrieves)
from condattn_jax.attention import options
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import MLP, Attention, RMSNorm, attend
from condattn_jax.parallel import context


_AFTER_ALL = 2 ** 30     # key position of padding slots: after every query (never visible)
# Retrieved keys appended after the row's: a position before every query and outside every
# window, so only their block's listing shows them; -2^29, not lower: the block-sparse kernels
# test a listed pair's distance against 2^30 (positions < 2^29, windows <= 2^29).
_BEFORE_ALL = -2 ** 29
# The gathered path's per-block keys are padded to a multiple of this (invisible slots): the
# compacted kernels' kv tiles (Triton 16, Mosaic GPU 64, Mosaic TPU 128).
_GATHERED_KV_MULTIPLE = 128


def _per_block(aux_blocks):
  """(k, v, ok) [B, G, R, ...] of each block from the aux blocks' (k, v, ok) [B, Ga, R, ...] and
  the map block g -> aux block [B, G] (-1: none, ok 0; None: aux block g is block g)."""
  k, v, ok, idx = aux_blocks
  if idx is None:
    return k, v, ok
  at = lambda t: jnp.take_along_axis(
      t, jnp.maximum(idx, 0).reshape(idx.shape + (1,) * (t.ndim - 2)), axis=1)
  return at(k), at(v), jnp.where((idx >= 0)[..., None], at(ok), 0)


def block_sparse_runs(o, q_shape, kv_shape, dtype, platform) -> bool:
  """Whether options.attention_path='auto' runs the block-sparse path when lowered for `platform`
  (a pallas_kernels.backends.Platform): the one resolver (ops.resolve) has a block-sparse kernel
  for HEAD_WINDOW_BLOCKS heads at chunk-sized blocks, this shape and dtype, under options.impl
  ('auto' / 'pallas' / a kernel name; any other impl keeps the gathered path)."""
  if o.impl not in ("auto", "pallas", *ops.KERNEL_IMPLS):
    return False
  backend, _ = ops.resolve("block_sparse", o.impl, q_shape, kv_shape, dtype, platform,
                           block_q=o.chunk, block_k=o.chunk, window_blocks=True)
  return backend is not None


class RetrievedCache(nn.Module):
  """Decode: the fixed-size temporary cache of the current block's recomputed retrieved K/V.

  Variables: key/value [B, R, K, H] (R = k*c), ok [B, R] int32.
  `__call__(k, v, ok [B, G, R, ...] fresh ones, fresh_B, g_last_B, all_fresh)` returns the K/V
  each block uses (the fresh ones where `all_fresh` or the row refreshed, else the stored ones)
  and stores the fresh K/V of the block of each refreshed row's last token. picked=True (an
  engine prefill call): k, v [B, R, K, H], ok [B, R] are already that block's; only stored.
  `stored()` (a decode step the engine knows enters no block): the stored K/V and ok as one
  block [B, 1, R, ...], nothing written."""

  def stored(self):
    k, v, ok = (self.get_variable("cache", n) for n in ("key", "value", "ok"))
    return k[:, None], v[:, None], ok[:, None]

  @nn.compact
  def __call__(self, k_BGRKH, v_BGRKH, ok_BGR, fresh_B, g_last_B, all_fresh: bool,
               picked: bool = False):
    if picked:  # [B, R, ...]: as the last block of a call of one block
      k_BGRKH, v_BGRKH, ok_BGR = k_BGRKH[:, None], v_BGRKH[:, None], ok_BGR[:, None]
    B, G, R, K, H = k_BGRKH.shape
    ck = self.variable("cache", "key", jnp.zeros, (B, R, K, H), k_BGRKH.dtype)
    cv = self.variable("cache", "value", jnp.zeros, (B, R, K, H), v_BGRKH.dtype)
    cok = self.variable("cache", "ok", jnp.zeros, (B, R), jnp.int32)
    if all_fresh:
      use = (k_BGRKH, v_BGRKH, ok_BGR)
    else:
      f = fresh_B[:, None, None]
      use = (jnp.where(f[..., None, None], k_BGRKH, ck.value[:, None]),
             jnp.where(f[..., None, None], v_BGRKH, cv.value[:, None]),
             jnp.where(f, ok_BGR, cok.value[:, None]))
    pick = (lambda x: x[:, 0]) if picked else (lambda x: jnp.take_along_axis(
        x, g_last_B.reshape((B, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0])
    fr = fresh_B.reshape((B,) + (1,) * 3)
    ck.value = jnp.where(fr, pick(k_BGRKH), ck.value)
    cv.value = jnp.where(fr, pick(v_BGRKH), cv.value)
    cok.value = jnp.where(fresh_B[:, None], pick(ok_BGR), cok.value)
    return use


class MatchLayer(nn.Module):
  """One MATCH decoder layer: `(x_BTD, ctx) -> (x_BTD, aux)`; x may carry the auxiliary rows
  after the T query rows (see the module docstring). aux: `retrieved` = mean fraction of the k
  retrieval slots filled per block with queries (0 in 'full' layers and without retrieval)."""
  config: object
  variant: object = "swa"

  def setup(self):
    cfg = self.config
    o = options(cfg)
    if self.variant not in ("swa", "full"):
      raise ValueError(f"MATCH layer variant {self.variant!r}: 'swa' or 'full'.")
    self.self_attn = Attention(cfg, window=o.window if self.variant == "swa" else None)
    norm = lambda: RMSNorm(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype,
                           param_dtype=cfg.weight_dtype)
    if cfg.post_norm:
      self.post_attention_layernorm = norm()
      self.post_feedforward_layernorm = norm()
    else:
      self.input_layernorm = norm()
      self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg)
    self.retrieved_cache = RetrievedCache()

  @staticmethod
  def prefill_fields(config, start: int, chunk: int, lengths) -> dict:
    """The engine's static fields of a prefill call (Engine._prefill_fields):
    match_call_retrieves = whether a block of the call retrieves for some row
    (inputs.call_retrieves, on the host): False compiles SWA's call (no search, no aux rows, no
    cond), True the retrieving branch without a cond; and where it retrieves, match_aux_blocks
    = the aux blocks it needs (inputs.call_aux_blocks: the retrieving blocks that hold a query
    of the call, at most ceil(m / c) + 1). A program per (chunk shape, fields)."""
    o = options(config)
    if not o.top_k:
      return {}
    if not call_retrieves(o, start, chunk, lengths):
      return {"match_call_retrieves": False}
    return {"match_call_retrieves": True,
            "match_aux_blocks": call_aux_blocks(o, start, chunk, lengths)}

  @staticmethod
  def decode_fields(config, positions_B, active_B) -> dict:
    """The engine's static fields of a one-token decode step (Engine._decode_fields), on the
    host: match_step_enters = whether an active row's token starts a block (position % chunk
    == 0), i.e. enters a new block after the row's previous token (the engine's loops decode a
    row's positions in order after its prefill): True compiles the refreshing step (search and
    the aux rows through every layer) without a cond, False the step that reuses the block's
    retrieved K/V (no aux rows: RetrievedCache's stored K/V), neither searching nor running
    the aux rows. Where the data says a row is fresh after all (a row decoded out of order), a
    False step's heads are NaN (match_step_refuse): a refusal, never a silently stale
    retrieval. A program per value, no predicate read on the host (each lax.cond of the step
    would be one on a GPU: one a layer)."""
    o = options(config)
    if not o.top_k:
      return {}
    on = np.asarray(active_B, bool).reshape(-1)
    pos = np.asarray(positions_B).reshape(-1)
    return {"match_step_enters": bool(np.any(on & (pos % o.chunk == 0)))}

  # ------------------------------------------------------------------------- block halves
  def _attn_in(self, x):
    return x if self.config.post_norm else self.input_layernorm(x)

  def _attn_residual(self, x, out):
    return x + (self.post_attention_layernorm(out) if self.config.post_norm else out)

  def _mlp_residual(self, x):
    if self.config.post_norm:
      return x + self.post_feedforward_layernorm(self.mlp(x))
    return x + self.mlp(self.post_attention_layernorm(x))

  # ------------------------------------------------------------------------- auxiliary rows
  def _aux_update(self, x_BAD, pos_BA, ok_BA, G: int):
    """The retrieved chunks' rows through this layer: attention among the block's retrieved
    chunks (causal on positions), then the MLP. Returns (x, k [B, G, R, K, H], v)."""
    o = options(self.config)
    B, A, _ = x_BAD.shape
    R = A // G
    q, k, v = self.self_attn.project(self._attn_in(x_BAD))
    q, k = self.self_attn.rope(q, pos_BA), self.self_attn.rope(k, pos_BA)
    blk = lambda t: t.reshape((B * G, R) + t.shape[2:])
    mask = ops.MaskSpec(q_positions_BT=blk(pos_BA), kv_positions_BS=blk(pos_BA),
                        q_segment_ids_BT=blk(ok_BA), kv_segment_ids_BS=blk(ok_BA))
    out = ops.attention(blk(q), blk(k), blk(v), mask, impl=o.impl).reshape(q.shape)
    x = self._mlp_residual(self._attn_residual(x_BAD, self.self_attn.project_out(out)))
    split = lambda t: t.reshape((B, G, R) + t.shape[2:])
    return x, split(k), split(v)

  def _aux_skip(self, x_BAD, pos_BA, ok_BA, G: int):
    cfg = self.config
    B, A, _ = x_BAD.shape
    z = jnp.zeros((B, G, A // G, cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype)
    return x_BAD, z, z

  # ------------------------------------------------------------------------- attention
  def _block_attend(self, q, k, v, ctx: LayerContext, f: dict, retrieved, cache=None):
    """Window OR retrieved chunks, per block (see the module docstring). retrieved: None (the
    chunks' K/V are gathered from this forward's k/v) or (k, v, ok) [B, G, R, ...]. cache
    (decode): write_cache's (k, v, positions, valid) when the caller wrote the chunk already."""
    o = options(self.config)
    c, w = o.chunk, o.window
    B, T, N, H = q.shape
    start, base = f["match_block_BG"], f["match_base_B"]
    G = start.shape[1]
    pos = ctx.positions_BT.astype(jnp.int32)
    seg = (ctx.valid_BT.astype(jnp.int32) if ctx.decode or ctx.segment_ids_BT is None
           else ctx.segment_ids_BT.astype(jnp.int32))
    # queries of each block (chunk row index = slot - base)
    qt = start[..., None] - base[:, None, None] + jnp.arange(c, dtype=jnp.int32)    # [B, G, c]
    q_in = (qt >= 0) & (qt < T)
    q_seg = jnp.where(q_in, _take(seg, qt), 0)
    q_pos = _take(pos, qt)
    # local keys: the window of every query of the block
    ls = start[..., None] - (w - 1) + jnp.arange(w + c - 1, dtype=jnp.int32)       # slots
    if ctx.decode:
      k_all, v_all, kv_pos, kv_valid = (self.self_attn.write_cache(k, v, ctx) if cache is None
                                        else cache)
      ring = k_all.shape[1] - T
      if ring < ctx.cache_len:  # window ring (before the write) + this chunk
        idx = jnp.where(ls >= base[:, None, None], ring + ls - base[:, None, None], ls % ring)
      else:  # full cache (window >= cache_len): slot = position
        idx = ls
      l_ok = (ls >= 0) & (_take(kv_valid, idx) != 0) & (_take(kv_pos, idx) == ls)
      kl, vl, l_pos, l_seg = _take(k_all, idx), _take(v_all, idx), ls, l_ok.astype(jnp.int32)
    else:
      lt = ls - base[:, None, None]
      l_ok = (lt >= 0) & (lt < T)
      kl, vl, l_pos = _take(k, lt), _take(v, lt), _take(pos, lt)
      l_seg = jnp.where(l_ok, _take(seg, lt), 0)
    # retrieved keys, all at the block's first position (their mask slot)
    ids = f["match_chunks_BGk"]
    if retrieved is None:
      rows = (ids[..., None] * c + jnp.arange(c, dtype=jnp.int32)).reshape(B, G, -1)
      r_ok = jnp.repeat(ids >= 0, c, axis=-1)
      kr, vr = _take(k, rows), _take(v, rows)
      r_seg = jnp.where(r_ok, _take(seg, rows), 0)
    else:
      kr, vr, r_ok = retrieved
      r_seg = jnp.where(r_ok != 0, (f["match_doc_BG"][..., None] if not ctx.decode else 1), 0)
    R = kr.shape[2]
    r_pos = jnp.broadcast_to(f["match_block_pos_BG"][..., None], (B, G, R))
    kk = jnp.concatenate([kl, kr.astype(kl.dtype)], axis=2)
    vv = jnp.concatenate([vl, vr.astype(vl.dtype)], axis=2)
    # the w + c - 1 + R keys padded to a multiple of _GATHERED_KV_MULTIPLE with invisible
    # slots (segment 0, a position after every query): the compacted kernels take only whole
    # kv tiles (w = 2048, c = 128, k = 4: 2687 keys, which no GPU kernel takes, -> 2688)
    S = kk.shape[2]
    fill = (-S) % _GATHERED_KV_MULTIPLE
    padded = lambda x, value: jnp.concatenate(
        [x, jnp.full(x.shape[:2] + (fill,) + x.shape[3:], value, x.dtype)], axis=2)
    kv_pos = padded(jnp.concatenate([l_pos, r_pos.astype(jnp.int32)], axis=-1), _AFTER_ALL)
    kv_seg = padded(jnp.concatenate([l_seg, r_seg.astype(jnp.int32)], axis=-1), 0)
    flat = lambda t: t.reshape((B * G,) + t.shape[2:])
    mask = ops.MaskSpec(q_positions_BT=flat(q_pos), kv_positions_BS=flat(kv_pos),
                        q_segment_ids_BT=flat(q_seg), kv_segment_ids_BS=flat(kv_seg), window=w)
    out = ops.attention(flat(_take(q, qt)), flat(padded(kk, 0)), flat(padded(vv, 0)), mask,
                        impl=o.impl)
    rows_BG = jnp.broadcast_to(jnp.arange(B)[:, None, None], qt.shape)
    return jnp.zeros_like(q).at[rows_BG, jnp.where(q_in, qt, T)].set(
        out.reshape(B, G, c, N, H), mode="drop")

  def _row_mask(self, ctx: LayerContext, f: dict, N: int, n: int = 1):
    """The whole row's mask: window OR block g's retrieved chunks for query block g (block lists
    in head mode HEAD_WINDOW_BLOCKS, block_q = block_k = chunk). n > 1: the row is in the zigzag
    layout of n sequence shards (context.layout_size): the lists' query blocks are laid out like
    the tokens and the call is contiguous self-attention (run per shard)."""
    o = options(self.config)
    B, T = ctx.positions_BT.shape
    pos = ctx.positions_BT.astype(jnp.int32)
    seg = (ctx.valid_BT.astype(jnp.int32) if ctx.segment_ids_BT is None
           else ctx.segment_ids_BT.astype(jnp.int32))
    ids = f["match_chunks_BGk"]
    lists = jnp.broadcast_to(ids[:, None], (B, N) + ids.shape[1:]).astype(jnp.int32)
    mode = jnp.full((B, N), ops.HEAD_WINDOW_BLOCKS, jnp.int32)
    return ops.MaskSpec(q_positions_BT=pos, kv_positions_BS=pos, q_segment_ids_BT=seg,
                        kv_segment_ids_BS=seg, window=o.window, contiguous=n > 1,
                        block_lists=ops.BlockLists(context.to_layout(lists, n, axis=2), mode,
                                                   block_q=o.chunk,
                                                   block_k=o.chunk, window_blocks=True))

  def _sequence_attend(self, q, k, v, ctx: LayerContext, f: dict):
    """Full forward, retrieved_kv='sequence': block-sparse or gathered (options.attention_path;
    'auto' decides per lowering platform with `block_sparse_runs`)."""
    o = options(self.config)
    n = context.layout_size()
    if n > 1:  # sequence parallel: the gathered path reads the row by slot (the natural row's,
      # as the fields' blocks are); the block-sparse call runs per shard (context.attention)
      nat = lambda x: context.from_layout(x, n)
      ctx_nat = dataclasses.replace(ctx, tokens_BT=nat(ctx.tokens_BT),
                                    positions_BT=nat(ctx.positions_BT),
                                    segment_ids_BT=nat(ctx.segment_ids_BT))
      gathered = lambda q, k, v, _: context.to_layout(
          self._block_attend(nat(q), nat(k), nat(v), ctx_nat, f, None), n)
    else:
      gathered = lambda q, k, v, _: self._block_attend(q, k, v, ctx, f, None)
    if o.attention_path == "gathered":
      return gathered(q, k, v, None)
    mask = self._row_mask(ctx, f, q.shape[2], n)
    listed = lambda q, k, v, m: ops.attention(q, k, v, m, impl=o.impl)
    if o.attention_path == "block_sparse":
      return listed(q, k, v, mask)
    make = lambda platform: (listed if block_sparse_runs(o, q.shape, k.shape, q.dtype, platform)
                             else gathered)
    return ops.by_lowering_platform(q, k, v, mask, default=gathered, cuda=make, rocm=make,
                                    tpu=make)

  def _retrieved_attend(self, q, k, v, ctx: LayerContext, f: dict, retrieved):
    """Recomputed retrieved K/V (retrieved_kv='recompute': a full forward, or a decode step of
    one token) (k, v, ok) [B, G, R, ...] per block: `_retrieving_attend` over this forward's
    keys, or the cache's after the write (decode). An engine call of several tokens runs
    `_prefill_attend` instead."""
    if ctx.decode and q.shape[1] == 1:
      return self._decode_attend(q, k, v, ctx, f, retrieved)
    cache = self.self_attn.write_cache(k, v, ctx) if ctx.decode else None
    return self._retrieving_attend(q, k, v, ctx, f, retrieved, None, cache)

  def _decode_attend(self, q, k, v, ctx: LayerContext, f: dict, retrieved):
    """A decode step of one token: its write into the window ring, then one decode call over
    the ring AFTER the write (every key it holds is in the query's window: `window` slots, or
    the whole cache where window >= cache_len, masked by positions) followed by the block's R
    retrieved keys (at the block's first position), padded (invalid) to a multiple of 8 slots
    (the Mosaic GPU decode kernel's ragged tile). No copy of the ring: read before its write,
    the ring would be copied to keep the old keys (two copies of K and V a layer a step)."""
    o = options(self.config)
    B = q.shape[0]
    k_all, v_all, kv_pos, kv_valid = self.self_attn.write_cache(k, v, ctx, after_write=True)
    kr, vr, r_ok = (x[:, 0] for x in retrieved)                 # the one block: [B, R, ...]
    R = kr.shape[1]
    r_pos = jnp.broadcast_to(f["match_block_pos_BG"][:, :1], (B, R))
    S = k_all.shape[1] + R
    pad = lambda x: jnp.zeros((B, (-S) % 8) + x.shape[2:], x.dtype)
    cat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype), pad(a)], axis=1)
    mask = ops.MaskSpec(q_positions_BT=ctx.positions_BT.astype(jnp.int32),
                        kv_positions_BS=cat(kv_pos.astype(jnp.int32), r_pos),
                        kv_segment_ids_BS=cat(kv_valid.astype(jnp.int32),
                                              (r_ok != 0).astype(jnp.int32)),
                        window=o.window, active=ctx.valid_BT != 0)
    return ops.attention(q, cat(k_all, kr), cat(v_all, vr), mask, impl=o.impl)

  def _prefill_attend(self, x_aux, q, k, v, ctx: LayerContext, f: dict, Ga: int):
    """An engine call of several tokens (a prefill chunk) of an SWA layer with auxiliary rows
    for Ga aux blocks: ONE nn.cond (one predicate read a layer on a GPU: a lax.cond's
    ConditionalThunk copies it to the host and waits) on whether one of the call's aux rows is
    real (one of its blocks retrieves a chunk: with the prompt lengths, only the call(s)
    holding the prompt's last m positions):
      retrieving: the aux rows through this layer (`_aux_update`), then window OR retrieved
        chunks over the cache after the write and the aux blocks' fresh K/V
        (`_retrieving_attend`: the block-sparse call appends only the Ga aux blocks, which the
        blocks mapped to them by match_aux_block_BG list);
      else: the aux rows unchanged and SWA's attention over the cache (the ops.attention call
        Attention.attend makes: window over the written ring + chunk, the same keys visible).
    Returns (x_aux, heads). RetrievedCache stores the fresh K/V of the block of each row's last
    token (zeros, ok 0, where the aux rows did not run), read off the aux blocks inside the
    branch: no per-block [B, G, R, K, H] copy is made outside it."""
    o = options(self.config)
    cfg = self.config
    apos, aok = f["match_aux_pos_BA"], f["match_aux_ok_BA"]
    B, A = aok.shape
    R = A // Ga
    ok_BGR = aok.reshape(B, Ga, R)
    aux_of_BG = f.get("match_aux_block_BG")   # block -> aux block (-1: none); None: identity
    g_last = f["match_g_last_B"]
    a_last = (g_last if aux_of_BG is None
              else jnp.take_along_axis(aux_of_BG, g_last[:, None], axis=1)[:, 0])
    cache = self.self_attn.write_cache(k, v, ctx)

    def retrieving(m, x_aux, q, k, v, cache):
      x_aux, k_aux, v_aux = m._aux_update(x_aux, apos, aok, Ga)
      aux_blocks = (k_aux, v_aux, ok_BGR, aux_of_BG)
      heads = m._retrieving_attend(q, k, v, ctx, f, _per_block(aux_blocks), aux_blocks, cache)
      # the last token's block's (what _per_block then RetrievedCache's pick would give)
      at = lambda t: jnp.take_along_axis(
          t, jnp.maximum(a_last, 0).reshape((B, 1) + (1,) * (t.ndim - 2)), axis=1)[:, 0]
      return x_aux, heads, (at(k_aux), at(v_aux), jnp.where((a_last >= 0)[:, None], at(ok_BGR), 0))

    def window_only(m, x_aux, q, k, v, cache):
      k_all, v_all, kv_pos, kv_valid = cache
      heads = attend(q, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                     kv_segment_ids_BS=kv_valid, window=o.window, impl=o.impl)
      z = jnp.zeros((B, R, cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype)
      return x_aux, heads, (z, z, jnp.zeros((B, R), ok_BGR.dtype))

    if f.get("match_call_retrieves") is True:
      # the engine's static fact (inputs.call_retrieves): a block of this call retrieves, so
      # the retrieving branch runs without a cond. Where the data retrieves nothing after all
      # (every aux row empty) it equals the other branch: the same keys visible (the aux rows
      # are masked), and the stored K/V are zeroed as window_only's (one select)
      x_aux, heads, last = retrieving(self, x_aux, q, k, v, cache)
      real = jnp.any(aok != 0)
      last = tuple(jnp.where(real, t, jnp.zeros_like(t)) for t in last)
    else:  # unknown (None): decided on the device
      x_aux, heads, last = nn.cond(jnp.any(aok != 0), retrieving, window_only, self, x_aux, q,
                                   k, v, cache)
    self.retrieved_cache(*last, f["match_fresh_B"], g_last, all_fresh=True, picked=True)
    return x_aux, heads

  def _prefill_window(self, q, k, v, ctx: LayerContext, f: dict):
    """An engine call of several tokens that the engine knows retrieves nothing (the static
    fact ctx.fields['match_call_retrieves'] = False; MatchInputs then builds no aux rows):
    SWA's call (the cache write and the window attention over it: no cond, no aux rows) and
    RetrievedCache stores what `_prefill_attend`'s window_only branch stores (zeros, ok 0).
    Where the data says a block of the call retrieves (match_refuse: the host's fact was
    wrong) the heads are NaN: a refusal, never a silently skipped retrieval."""
    o = options(self.config)
    cfg = self.config
    k_all, v_all, kv_pos, kv_valid = self.self_attn.write_cache(k, v, ctx)
    heads = attend(q, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                   kv_segment_ids_BS=kv_valid, window=o.window, impl=o.impl)
    heads = jnp.where(f["match_refuse"], jnp.asarray(jnp.nan, heads.dtype), heads)
    B, R = q.shape[0], f["match_chunks_BGk"].shape[-1] * o.chunk
    z = jnp.zeros((B, R, cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype)
    self.retrieved_cache(z, z, jnp.zeros((B, R), jnp.int32), f["match_fresh_B"],
                         f["match_g_last_B"], all_fresh=True, picked=True)
    return heads

  def _retrieving_attend(self, q, k, v, ctx: LayerContext, f: dict, retrieved, aux_blocks,
                         cache):
    """`_retrieved_attend`'s window OR retrieved chunks; cache: write_cache's result (decode)
    or None."""
    o = options(self.config)
    kw = {} if cache is None else dict(cache=cache)
    gathered = lambda: self._block_attend(q, k, v, ctx, f, retrieved, **kw)
    if o.attention_path == "gathered" or q.shape[1] == 1:
      return gathered()
    c, w = o.chunk, o.window
    B, T, N, H = q.shape
    start, base = f["match_block_BG"], f["match_base_B"]
    G = start.shape[1]
    valid = (ctx.valid_BT.astype(jnp.int32) if ctx.decode or ctx.segment_ids_BT is None
             else ctx.segment_ids_BT.astype(jnp.int32))
    # kernel query row j = this call's query j - (base - block 0's first slot): MATCH's block g
    # is query tile g
    t_BJ = jnp.arange(G * c, dtype=jnp.int32)[None, :] + (start[:, :1] - base[:, None])
    inside = (t_BJ >= 0) & (t_BJ < T)
    shift = lambda x: jnp.where(inside.reshape(inside.shape + (1,) * (x.ndim - 2)),
                                _take(x, t_BJ), 0).astype(x.dtype)
    unshift = lambda x: _take(x, jnp.arange(T, dtype=jnp.int32)[None, :] - t_BJ[:, :1])
    if cache is None:
      k_all, v_all, kv_pos, kv_seg = k, v, ctx.positions_BT.astype(jnp.int32), valid
    else:
      k_all, v_all, kv_pos, kv_seg = cache
    S0 = k_all.shape[1]
    pad = -(-S0 // c) * c - S0
    kr, vr, r_ok, aux_of_BG = retrieved + (None,) if aux_blocks is None else aux_blocks
    Ga, R = kr.shape[1], kr.shape[2]
    if aux_of_BG is None:
      aux_of_BG = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32), (B, G))
    r_seg = jnp.where(r_ok != 0, 1 if ctx.decode else f["match_doc_BG"][..., None], 0)
    cat = lambda a, fill, b: jnp.concatenate(
        [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill),
         b.reshape((B, Ga * R) + b.shape[3:]).astype(a.dtype)], axis=1)
    keys = (cat(k_all, 0, kr), cat(v_all, 0, vr))
    kv_pos = cat(kv_pos.astype(jnp.int32), _AFTER_ALL, jnp.full((B, Ga, R), _BEFORE_ALL,
                                                               jnp.int32))
    kv_seg = cat(kv_seg.astype(jnp.int32), 0, r_seg.astype(jnp.int32))
    # block g lists the R / c kv blocks of its aux block (none without one)
    first_BG = (S0 + pad) // c + aux_of_BG * (R // c)
    lists = jnp.where((aux_of_BG >= 0)[..., None],
                      first_BG[..., None] + jnp.arange(R // c, dtype=jnp.int32), -1)
    lists = jnp.broadcast_to(lists[:, None], (B, N, G, R // c))
    mask = ops.MaskSpec(
        q_positions_BT=shift(ctx.positions_BT.astype(jnp.int32)), kv_positions_BS=kv_pos,
        q_segment_ids_BT=shift(valid), kv_segment_ids_BS=kv_seg, window=w,
        block_lists=ops.BlockLists(lists, jnp.full((B, N), ops.HEAD_WINDOW_BLOCKS, jnp.int32),
                                   block_q=c, block_k=c, window_blocks=True))
    listed = lambda qs, ks, vs, m: ops.attention(qs, ks, vs, m, impl=o.impl)
    if o.attention_path == "block_sparse":
      return unshift(listed(shift(q), *keys, mask))
    make = lambda platform: (listed if block_sparse_runs(o, (B, G * c, N, H), keys[0].shape,
                                                         q.dtype, platform)
                             else lambda *_: shift(gathered()))
    return unshift(ops.by_lowering_platform(shift(q), *keys, mask,
                                            default=lambda *_: shift(gathered()), cuda=make,
                                            rocm=make, tpu=make))

  def _plain_attend(self, q, k, v, ctx: LayerContext):
    """Full layers, or SWA without retrieval (with StreamingLLM sinks when options.sinks)."""
    o = options(self.config)
    if self.variant == "swa" and o.sinks:
      if ctx.decode:
        raise ValueError(f"model.scheme.sinks={o.sinks}: the sink+window baseline runs "
                         "the full forward only (no decode cache for sinks).")
      mask = ops.MaskSpec(q_positions_BT=ctx.positions_BT, kv_positions_BS=ctx.positions_BT,
                          q_segment_ids_BT=ctx.segment_ids_BT,
                          kv_segment_ids_BS=ctx.segment_ids_BT, window=o.window, sinks=o.sinks,
                          contiguous=True)
      return ops.attention(q, k, v, mask, impl=self.config.attention_impl)
    return self.self_attn.attend(q, k, v, ctx)

  # ------------------------------------------------------------------------- the layer
  def __call__(self, x_BTD, ctx: LayerContext):
    cfg = self.config
    o = options(cfg)
    B, T = ctx.positions_BT.shape
    A = x_BTD.shape[1] - T
    f = dict(ctx.fields)
    retrieves = self.variant == "swa" and o.top_k > 0
    if "match_chunks_BGk" not in f and retrieves:
      if ctx.decode or o.retrieved_kv == "recompute":
        raise ValueError("MATCH decode / retrieved_kv='recompute' needs the auxiliary input of "
                         "the decoder's MATCH input step (Scheme.module); call the layer "
                         "through models.decoder.Decoder.")
      nat = lambda x: context.from_layout(x, context.layout_size())
      f.update(block_inputs(o, nat(ctx.tokens_BT), nat(ctx.positions_BT),
                            nat(ctx.segment_ids_BT), recompute=False)[1])
    x_main, x_aux = x_BTD[:, :T], x_BTD[:, T:]

    # aux blocks: one per block (G), or (engine prefill with prompt lengths) only the Ga blocks
    # that retrieve, mapped to blocks by match_aux_block_BG
    Ga = A // (f["match_chunks_BGk"].shape[-1] * o.chunk) if A else 0
    # an engine call of several tokens (prefill) of an SWA layer: the aux rows and the attention
    # over their K/V in one nn.cond (_prefill_attend), after this layer's q / k / v
    prefill = bool(A) and ctx.decode and T > 1 and retrieves
    retrieved = None
    if A and not prefill:
      apos, aok = f["match_aux_pos_BA"], f["match_aux_ok_BA"]
      # the aux rows run only where one is real: decode steps when a row enters a new block;
      # a 'full' layer's engine calls of several tokens when one of its blocks retrieves
      enters = f.get("match_step_enters") if ctx.decode and T == 1 else None
      run_aux = (None if enters is True  # (the engine's static facts)
                 else jnp.any(f["match_fresh_B"]) if ctx.decode and T == 1
                 else None if f.get("match_call_retrieves") is True
                 else jnp.any(aok != 0) if ctx.decode else None)
      if run_aux is None:
        x_aux, k_aux, v_aux = self._aux_update(x_aux, apos, aok, Ga)
      else:
        x_aux, k_aux, v_aux = nn.cond(run_aux, lambda m, *a: m._aux_update(*a, Ga),
                                      lambda m, *a: m._aux_skip(*a, Ga), self, x_aux, apos, aok)
      if retrieves:  # (a 'full' layer only carries the aux rows on)
        # the Ga aux blocks mapped to blocks (block g -> aux block: match_aux_block_BG, -1
        # none; absent: aux block g is block g)
        k_aux, v_aux, ok_BGR = _per_block((k_aux, v_aux, aok.reshape(B, Ga, A // Ga),
                                           f.get("match_aux_block_BG")))
        if ctx.decode:  # a decode step of one token
          k_aux, v_aux, ok_BGR = self.retrieved_cache(k_aux, v_aux, ok_BGR, f["match_fresh_B"],
                                                      f["match_g_last_B"], all_fresh=False)
        retrieved = (k_aux, v_aux, ok_BGR)

    if retrieves and ctx.decode and T == 1 and f.get("match_step_enters") is False:
      retrieved = self.retrieved_cache.stored()  # (MatchInputs built no aux rows: A == 0)
    q, k, v = self.self_attn.qkv(self._attn_in(x_main), ctx.positions_BT)
    if prefill:
      x_aux, heads = self._prefill_attend(x_aux, q, k, v, ctx, f, Ga)
    elif retrieves and ctx.decode and T > 1 and "match_refuse" in f:  # (no aux rows: A == 0)
      heads = self._prefill_window(q, k, v, ctx, f)
    elif retrieves and retrieved is None and not ctx.decode:
      heads = self._sequence_attend(q, k, v, ctx, f)
    elif retrieves and retrieved is not None:
      heads = self._retrieved_attend(q, k, v, ctx, f, retrieved)
    elif retrieves:
      heads = self._block_attend(q, k, v, ctx, f, retrieved)
    else:
      heads = self._plain_attend(q, k, v, ctx)
    if "match_step_refuse" in f:  # a decode step the engine said enters no block: a row does
      heads = jnp.where(f["match_step_refuse"], jnp.asarray(jnp.nan, heads.dtype), heads)
    x_main = self._mlp_residual(self._attn_residual(x_main, self.self_attn.project_out(heads)))
    x_out = jnp.concatenate([x_main, x_aux], axis=1) if A else x_main

    if retrieves:
      ids = f["match_chunks_BGk"]
      filled = jnp.mean((ids >= 0).astype(jnp.float32), axis=-1)                   # [B, G]
      frac = jnp.mean(filled)
    else:
      frac = jnp.zeros((), jnp.float32)
    return x_out, {"retrieved": frac}
