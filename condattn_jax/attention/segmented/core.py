"""The segment operator of scheme 'segmented': ONE pure function used verbatim by the training
forward (a scan over segments), the full-sequence forward and cached inference.

    out_BCNH, state = segment_step(state, q_BCNH, k_BCKH, v_BCKH, positions_BC, valid_BC, ...)

A call takes a chunk of C tokens per row that lies inside one segment (a whole segment in
training, a prefill chunk dividing S, one decode token); q/k/v are PRE-RoPE (after q/k norm).
Per layer the state (one attention layer's; every leaf has the batch first) is

  seg_k, seg_v    [B, S, K, H]   the current segment's K/V (all KV heads), pre-RoPE
  tail_k, tail_v  [B, M, Kloc, H] the carried tail: last M K/V of the previous segment (local
                                 heads); the only gradient-carrying cross-segment state
  long layers only:
  qlast           [B, Lq, Nl, H] ring of the current segment's last Lq long-head queries
  pool_k, pool_v  [B, P, Kl, H]  every finished segment's long-head K/V (no eviction), P >=
                                 cache length; forward-only (stop_gradient)
  ret_k, ret_v    [B, R, Kl, H]  the retrieved prefix; ret_pos [B, Kl, R] its pool positions,
                                 ret_valid [B, R] (0 while the pool holds fewer than R keys)

At a row's segment boundary (its first token of the chunk at offset 0 of segment i > 0) the
state transitions first: the tail rolls (last M of segment i-1), segment i-1's long K/V are
appended to the pool, and (every `refresh` segments) the retrieved prefix is recomputed from
summaries of segment i-1's last Lq long-head queries over the pool (segments 0..i-1).
Then the chunk's K/V are written into the segment buffer and each head group attends, through
`ops.attention` with explicit positions (the compacted-query kernel on GPU/TPU):
  local heads                [tail (positions 0..M-1) ; segment (M..M+S-1)]
  long heads, long layer     [retrieved (0..R-1) ; segment (R..R+S-1)]
  long heads, other layers   [segment (0..S-1)]
(RoPE re-indexing: a prefix of length P gets 0..P-1, the segment P..; keys are rotated at
attention time, K/V are stored pre-RoPE.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from condattn_jax.attention.segmented.options import HeadGroups, SegmentedOptions
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.layers import apply_rope, attend, rope_inv_freq

sg = lax.stop_gradient


def pool_size(o: SegmentedOptions, cache_len: int) -> int:
  """Pool slots for sequences of up to cache_len tokens: every finished segment, >= R."""
  n_seg = -(-int(cache_len) // o.segment_len)
  return max(n_seg * o.segment_len, o.retrieve_len, o.topk, o.anchors)


def state_shapes(config: ModelConfig, o: SegmentedOptions, groups: HeadGroups, long_layer: bool,
                 batch: int, cache_len: int, dtype) -> dict:
  """name -> (shape, dtype) of one layer's state (see the module docstring)."""
  B, H = batch, config.head_dim
  S, M, R, Lq = o.segment_len, o.tail_len, o.retrieve_len, o.query_len
  K, Kloc, Kl, Nl = config.num_kv_heads, len(groups.local_kv), len(groups.long_kv), len(groups.long_q)
  out = {"seg_k": ((B, S, K, H), dtype), "seg_v": ((B, S, K, H), dtype),
         "tail_k": ((B, M, Kloc, H), dtype), "tail_v": ((B, M, Kloc, H), dtype)}
  if long_layer and Kl:
    P = pool_size(o, cache_len)
    out.update(qlast=((B, Lq, Nl, H), dtype), pool_k=((B, P, Kl, H), dtype),
               pool_v=((B, P, Kl, H), dtype), ret_k=((B, R, Kl, H), dtype),
               ret_v=((B, R, Kl, H), dtype), ret_pos=((B, Kl, R), jnp.int32),
               ret_valid=((B, R), jnp.int32))
  return out


def init_state(*args, **kw) -> dict:
  return {k: jnp.zeros(s, d) for k, (s, d) in state_shapes(*args, **kw).items()}


# ------------------------------------------------------------------------------------------------
# Retrieval (forward-only), vectorised over batch and heads
# ------------------------------------------------------------------------------------------------

def query_summaries(q_BLNH, o: SegmentedOptions):
  """[B, Q, N, H] float32: means of sliding windows (summary_window, summary_stride) over the
  Lq time-ordered queries, then the mean of the last summary_tail (Q = 15 + 1 by default)."""
  q = q_BLNH.astype(jnp.float32)
  starts = np.arange(0, o.query_len - o.summary_window + 1, o.summary_stride)
  idx = starts[:, None] + np.arange(o.summary_window)[None, :]  # [Qw, W]
  win = jnp.mean(q[:, idx], axis=2)  # [B, Qw, N, H]
  last = jnp.mean(q[:, o.query_len - o.summary_tail:], axis=1, keepdims=True)
  return jnp.concatenate([win, last], axis=1)


def retrieve(pool_k_BPKH, pool_len_B, q_BLNH, o: SegmentedOptions):
  """Retrieved pool positions per (row, long KV head): (idx_BKR int32 sorted ascending,
  valid_BR int32). Per head: dot scores of the query summaries (of the head's query heads)
  against the pool keys, top-k per summary, dedupe keeping the max score, the top `anchors`,
  each expanded by offsets expand[0]..expand[1] (inside the pool), dedupe, padded with the
  earliest pool positions to exactly R, sorted. Slots past a short pool (< R keys) are invalid."""
  B, P, Kl, H = pool_k_BPKH.shape
  R = o.retrieve_len
  G = q_BLNH.shape[2] // Kl
  s = query_summaries(q_BLNH, o)  # [B, Q, Kl*G, H]
  Q = s.shape[1]
  s = s.reshape(B, Q, Kl, G, H).transpose(0, 2, 1, 3, 4).reshape(B, Kl, Q * G, H)
  scores = jnp.einsum("bksh,bpkh->bksp", s, pool_k_BPKH.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
  p = jnp.arange(P, dtype=jnp.int32)
  in_pool_BP = p[None, :] < pool_len_B[:, None]
  scores = jnp.where(in_pool_BP[:, None, None, :], scores, -jnp.inf)
  vals, top = lax.top_k(scores, min(o.topk, P))  # [B, Kl, QG, k]
  bi = jnp.arange(B)[:, None, None, None]
  ki = jnp.arange(Kl)[None, :, None, None]
  best = jnp.full((B, Kl, P), -jnp.inf, jnp.float32).at[bi, ki, top].max(vals)  # dedupe: max
  avals, anchors = lax.top_k(best, min(o.anchors, P))  # [B, Kl, A]
  offs = jnp.arange(o.expand[0], o.expand[1] + 1, dtype=jnp.int32)
  e = anchors[..., None] + offs  # [B, Kl, A, E]
  ok = (avals > -jnp.inf)[..., None] & (e >= 0) & (e < pool_len_B[:, None, None, None])
  e = jnp.where(ok, e, P).reshape(B, Kl, -1)
  sel = jnp.zeros((B, Kl, P), bool).at[bi[..., 0], ki[..., 0], e].set(True, mode="drop")
  key = jnp.where(sel, p, jnp.where(in_pool_BP[:, None, :], P + p, 2 * P + p))
  _, pick = lax.top_k(-key, R)  # the R smallest keys: selected, then earliest, then invalid
  idx = jnp.sort(pick.astype(jnp.int32), axis=-1)
  valid = (jnp.arange(R)[None, :] < jnp.minimum(pool_len_B, R)[:, None]).astype(jnp.int32)
  return idx, valid


# ------------------------------------------------------------------------------------------------
# The segment operator
# ------------------------------------------------------------------------------------------------

def _rows_put(buf, rows_BT, slots_BT, val):
  return buf.at[rows_BT, slots_BT].set(val.astype(buf.dtype), mode="drop")


def _transition(state, boundary_B, seg_B, config, o: SegmentedOptions, groups: HeadGroups,
                long_layer: bool):
  """The state at a segment boundary (rows where boundary_B; others unchanged)."""
  S, M, Lq = o.segment_len, o.tail_len, o.query_len
  new = dict(state)
  pick = lambda a, b: jnp.where(boundary_B.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  if M and len(groups.local_kv):
    for n in ("k", "v"):
      tail = jnp.take(state[f"seg_{n}"][:, S - M:], groups.local_kv, axis=2)
      new[f"tail_{n}"] = pick(tail, state[f"tail_{n}"])
  if "pool_k" in state:
    B, P = state["pool_k"].shape[:2]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
    slots = jnp.where(boundary_B[:, None], (seg_B[:, None] - 1) * S + jnp.arange(S)[None], P)
    for n in ("k", "v"):
      long = sg(jnp.take(state[f"seg_{n}"], groups.long_kv, axis=2))
      new[f"pool_{n}"] = _rows_put(state[f"pool_{n}"], rows, slots, long)
    pool_len_B = seg_B * S
    ring = (S - Lq + np.arange(Lq)) % Lq  # time order of the finished segment's last Lq queries
    idx_BKR, valid_BR = retrieve(new["pool_k"], pool_len_B, state["qlast"][:, ring], o)
    refresh_B = boundary_B & ((seg_B - 1) % o.refresh == 0)
    gather = lambda pool: jnp.take_along_axis(pool, idx_BKR.transpose(0, 2, 1)[..., None], axis=1)
    pk = lambda a, b: jnp.where(refresh_B.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    new["ret_k"] = pk(sg(gather(new["pool_k"])), state["ret_k"])
    new["ret_v"] = pk(sg(gather(new["pool_v"])), state["ret_v"])
    new["ret_pos"] = pk(idx_BKR, state["ret_pos"])
    new["ret_valid"] = pk(valid_BR, state["ret_valid"])
  return new


def segment_step(state: dict, q_BCNH, k_BCKH, v_BCKH, positions_BC, valid_BC, *,
                 config: ModelConfig, o: SegmentedOptions, groups: HeadGroups, long_layer: bool,
                 impl: str | None = None, restart_B=None):
  """One chunk inside one segment (per row): (out_BCNH, new state). See the module docstring.

  positions_BC: absolute token positions (row b's valid tokens first, padding after);
  valid_BC: bool, real tokens. impl: ops.attention's (default config.attention_impl).
  restart_B: None, or per row: run this chunk as a first segment's (no carried tail, no
  retrieved prefix; the state still transitions and is written as usual): the authors'
  empty-tail TBPTT restart (`tbptt_boundary='empty_restart'`, forward.py)."""
  B, C, N, H = q_BCNH.shape
  S, M = o.segment_len, o.tail_len
  if C > S:
    raise ValueError(f"a chunk of {C} tokens is longer than segment_len={S}; prefill in chunks "
                     f"that divide segment_len (Engine(prefill_chunk=...)).")
  impl = config.attention_impl if impl is None else impl
  valid_BC = jnp.asarray(valid_BC, bool)
  n_B = jnp.sum(valid_BC, axis=1, dtype=jnp.int32)
  p0_B = positions_BC[:, 0].astype(jnp.int32)
  seg_B, off0_B = p0_B // S, p0_B % S
  boundary_B = (n_B > 0) & (off0_B == 0) & (p0_B > 0)
  state = lax.cond(jnp.any(boundary_B),
                   lambda st: _transition(st, boundary_B, seg_B, config, o, groups, long_layer),
                   lambda st: dict(st), state)
  state = dict(state)

  # ---- write the chunk (valid tokens only) into the segment buffer / the query ring
  j_C = jnp.arange(C, dtype=jnp.int32)
  off_BC = off0_B[:, None] + j_C[None]
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, C))
  slots = jnp.where(valid_BC, off_BC, S)
  state["seg_k"] = _rows_put(state["seg_k"], rows, slots, k_BCKH)
  state["seg_v"] = _rows_put(state["seg_v"], rows, slots, v_BCKH)
  if "qlast" in state:
    Lq = o.query_len
    keep = valid_BC & (j_C[None] >= n_B[:, None] - Lq)  # the chunk's last Lq: no slot clashes
    qslot = jnp.where(keep, off_BC % Lq, Lq)
    state["qlast"] = _rows_put(state["qlast"], rows, qslot,
                               sg(jnp.take(q_BCNH, groups.long_q, axis=2)))

  # ---- attention per head group over [prefix ; segment]
  inv_freq = rope_inv_freq(config)

  def run(q_idx, kv_idx, prefix):
    k_seg = jnp.take(state["seg_k"], kv_idx, axis=2)
    v_seg = jnp.take(state["seg_v"], kv_idx, axis=2)
    P = 0 if prefix is None else prefix[0].shape[1]
    kv_pos = jnp.broadcast_to(jnp.arange(P + S, dtype=jnp.int32), (B, P + S))
    kv_ids = jnp.ones((B, P + S), jnp.int32)
    if prefix is not None:
      pk, pv, pvalid_BP = prefix
      k_seg = jnp.concatenate([pk.astype(k_seg.dtype), k_seg], axis=1)
      v_seg = jnp.concatenate([pv.astype(v_seg.dtype), v_seg], axis=1)
      kv_ids = jnp.concatenate([pvalid_BP.astype(jnp.int32), kv_ids[:, P:]], axis=1)
    q_pos = P + off_BC
    q_g = apply_rope(jnp.take(q_BCNH, q_idx, axis=2), q_pos, inv_freq)
    k_g = apply_rope(k_seg, kv_pos, inv_freq)
    return attend(q_g, k_g, v_seg, q_positions_BT=q_pos, kv_positions_BS=kv_pos,
                  kv_segment_ids_BS=kv_ids, impl=impl)

  carried_B = seg_B > 0  # the row has a carried state (tail / retrieved prefix) to attend to
  if restart_B is not None:
    carried_B = carried_B & ~jnp.asarray(restart_B, bool)
  out = jnp.zeros_like(q_BCNH)
  if len(groups.local_q):
    prefix = None
    if M:
      has_prev = jnp.broadcast_to(carried_B[:, None], (B, M))
      prefix = (state["tail_k"], state["tail_v"], has_prev)
    out = out.at[:, :, groups.local_q].set(run(groups.local_q, groups.local_kv, prefix))
  if len(groups.long_q):
    prefix = None
    if "ret_k" in state:
      prefix = (state["ret_k"], state["ret_v"], state["ret_valid"] * carried_B[:, None])
    out = out.at[:, :, groups.long_q].set(run(groups.long_q, groups.long_kv, prefix))
  return out, state


def full_sequence(q_BTNH, k_BTKH, v_BTKH, valid_BT, *, config, o, groups, long_layer,
                  impl=None):
  """The segmented forward of one layer over whole rows (positions 0..T-1, right padding):
  a lax.scan of `segment_step` over the segments, the state carried (values equal to the
  segment-major forward; its gradient is not truncated: training uses `forward.forward`)."""
  B, T, N, H = q_BTNH.shape
  S = o.segment_len
  n = -(-T // S)
  padT = lambda x: jnp.pad(x, [(0, 0), (0, n * S - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  to_seg = lambda x: padT(x).reshape(B, n, S, *x.shape[2:]).swapaxes(0, 1)
  state = init_state(config, o, groups, long_layer, B, n * S, k_BTKH.dtype)
  pos = jnp.broadcast_to(jnp.arange(n * S, dtype=jnp.int32), (B, n * S))

  def body(st, xs):
    q, k, v, p, ok = xs
    out, st = segment_step(st, q, k, v, p, ok, config=config, o=o, groups=groups,
                           long_layer=long_layer, impl=impl)
    return st, out

  _, out = lax.scan(body, state, tuple(map(to_seg, (q_BTNH, k_BTKH, v_BTKH, pos,
                                                     jnp.asarray(valid_BT, bool)))))
  return out.swapaxes(0, 1).reshape(B, n * S, N, H)[:, :T]
