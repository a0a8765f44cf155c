"""Pure-jnp pieces of the decode kernels: the reference (the tree's one mask builder and one
reference attention, pallas_kernels/compact_attention/reference.py) and the log-sum-exp merge of
the kernels' kv parts (condattn_jax.ops.merge_attention_parts is this function; the decode paths
merge through `merge_decode_parts`).

Importable without condattn_jax.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.compact_attention.reference import dense_mask, reference_attention


def decode_mask(q_positions_BT, kv_positions_BS, *, kv_lengths_B=None, kv_valid_BS=None,
                active=None, window=None, sinks=0, kv_blocks_BNQL=None, head_mode_BN=None,
                block_q=None, list_block_k=None):
  """bool [B, T, S] (or [B, N, T, S] with a per-head active set [B, T, N] or block lists): query
  t of row b sees slot s iff s < kv_lengths_B[b] (when given), kv_valid_BS[b, s] != 0 (when
  given), and dense_mask's causal / window / sinks / active conditions on positions; with block
  lists (kv_blocks_BNQL [B, N, ceil(T / block_q), L] of key blocks of list_block_k slots, head
  modes HEAD_FULL / HEAD_BLOCKS / HEAD_WINDOW_BLOCKS) the block-sparse kernels' mask
  (pallas_kernels.block_sparse.api.reference_mask: ops.BlockLists' contract)."""
  if kv_blocks_BNQL is not None:
    from pallas_kernels.block_sparse.api import reference_mask
    m = reference_mask(q_positions_BT, kv_positions_BS, None, kv_valid_BS, window=window,
                       sinks=sinks, active=active, kv_blocks_BNQL=kv_blocks_BNQL,
                       head_mode_BN=head_mode_BN, block_q=block_q, block_k=list_block_k)
  else:
    m = dense_mask(q_positions_BT, kv_positions_BS, None, kv_valid_BS, window=window,
                   sinks=sinks, active=active)
  if kv_lengths_B is None:
    return m
  S = kv_positions_BS.shape[1]
  filled_BS = jnp.arange(S, dtype=jnp.int32)[None, :] < kv_lengths_B[:, None]
  return m & (filled_BS[:, None, :] if m.ndim == 3 else filled_BS[:, None, None, :])


def reference_decode_attention(q_BTNH, k_BSKH, v_BSKH, *, q_positions_BT, kv_positions_BS,
                               kv_lengths_B=None, kv_valid_BS=None, active=None, window=None,
                               sinks=0, scale=None, **lists):
  """(out [B, T, N, H] in q's dtype, lse [B, T, N] float32) under `decode_mask` (lists: its
  block-list arguments); queries that see no key (inactive ones included) give zeros and
  lse = -inf."""
  mask = decode_mask(q_positions_BT, kv_positions_BS, kv_lengths_B=kv_lengths_B,
                     kv_valid_BS=kv_valid_BS, active=active, window=window, sinks=sinks, **lists)
  return reference_attention(q_BTNH, k_BSKH, v_BSKH, mask, scale=scale)


def merge_parts(o, lse, axis: int):
  """Online-softmax merge of partial attentions stacked on `axis` (a non-negative axis of lse):
  o [..., P, ..., H] each normalised over its own keys, lse the same shape without H. A part
  with lse = -inf (no visible key) weighs 0; all parts empty -> zeros and lse -inf (no NaN).
  Returns (o without the P axis, in the dtype of o * lse; lse of the union)."""
  mx = lax.stop_gradient(jnp.max(lse, axis=axis, keepdims=True))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  w = jnp.exp(lse - mx)
  tot = jnp.sum(w, axis=axis)
  empty = tot == 0
  tot = jnp.where(empty, 1.0, tot)
  out = jnp.sum(o * jnp.expand_dims(w, -1), axis=axis) / tot[..., None]
  return out, jnp.where(empty, -jnp.inf, jnp.squeeze(mx, axis) + jnp.log(tot))


# True: the decode paths (this package's kernels, ops' cuDNN split-KV path) merge their kv parts
# with `merge_parts_one_pass` (one variadic reduction) instead of `merge_parts` (a max, a sum of
# weights, the weights and a weighted sum). Off: measured no faster on a GPU (XLA:GPU fuses
# merge_parts' reductions already; docs/performance.md); bench/decode_program.py trace set
# 'onepass' turns it on.
ONE_PASS_MERGE = False


def merge_parts_one_pass(o, lse, axis: int):
  """`merge_parts`' output (not its lse; forward only: no gradient) as ONE reduction over
  `axis`: each element carries (running max m, sum of weights s, weighted sum a), combined as
  an online softmax. A part with lse = -inf weighs 0; all parts empty -> zeros. float32."""
  m = jnp.broadcast_to(jnp.expand_dims(lse.astype(jnp.float32), -1), o.shape)
  seen = m != -jnp.inf  # an empty part is (-inf, 0, 0): the combiner's identity, as XLA assumes
  o = jnp.where(seen, o.astype(jnp.float32), 0.0)

  def combine(x, y):
    (m1, s1, a1), (m2, s2, a2) = x, y
    mx = jnp.maximum(m1, m2)
    w1 = jnp.where(m1 == -jnp.inf, 0.0, jnp.exp(m1 - mx))
    w2 = jnp.where(m2 == -jnp.inf, 0.0, jnp.exp(m2 - mx))
    return mx, s1 * w1 + s2 * w2, a1 * w1 + a2 * w2
  zero = jnp.zeros((), jnp.float32)
  _, tot, acc = lax.reduce((m, seen.astype(jnp.float32), o), (jnp.float32(-jnp.inf), zero, zero),
                           combine, (axis,))
  return acc / jnp.where(tot == 0, 1.0, tot)


def merge_decode_parts(o, lse, axis: int):
  """The decode paths' merge of kv parts: `merge_parts_one_pass` (ONE_PASS_MERGE), else
  `merge_parts`' output."""
  return merge_parts_one_pass(o, lse, axis) if ONE_PASS_MERGE else merge_parts(o, lse, axis)[0]
