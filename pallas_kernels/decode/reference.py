"""Pure-jnp pieces of the decode kernels: the reference (the tree's one mask builder and one
reference attention, pallas_kernels/compact_attention/reference.py) and the log-sum-exp merge of
the kernels' kv parts (`merge_parts`: condattn_jax.ops.merge_attention_parts, with the union's
lse and a gradient; `merge_decode_parts`: the decode paths' forward-only merge).

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


def merge_decode_parts(o, lse, axis: int, lse_perm: tuple[int, ...] | None = None):
  """The decode paths' merge of kv parts (this package's kernels and condattn_jax.ops' cuDNN
  split-KV path): `merge_parts`' output, float32, forward only. o [..., P, ..., H] (P on
  `axis`), each part normalised over its own keys; lse the same axes without H, in o's order,
  or in another order with `lse_perm` (lse.transpose(lse_perm) is in o's order: a kernel's
  native lse layout, e.g. cuDNN's [.., K, G] beside outputs [.., G, K, H]). The max over parts
  is taken in lse's own layout and only the weights are reordered; the weight total is an
  extra channel of the one weighted sum over the parts. A part with lse = -inf weighs 0; all
  parts empty -> zeros."""
  lse = lse.astype(jnp.float32)
  lse_axis = axis if lse_perm is None else lse_perm[axis]
  mx = lax.stop_gradient(jnp.max(lse, axis=lse_axis, keepdims=True))
  w = jnp.exp(lse - jnp.where(jnp.isfinite(mx), mx, 0.0))  # 0 for an empty part
  if lse_perm is not None:
    w = w.transpose(lse_perm)
  o = o.astype(jnp.float32)
  ext = jnp.concatenate([o, jnp.ones(o.shape[:-1] + (1,), jnp.float32)], axis=-1)
  acc = jnp.sum(ext * w[..., None], axis=axis)  # [..., H + 1]: weighted o, weight total
  H = o.shape[-1]
  tot = acc[..., H:]
  return acc[..., :H] / jnp.where(tot == 0, 1.0, tot)
