"""Elastic's composite attention: the KV heads whose query heads are all full (FA) in ONE dense
cuDNN call, the other heads in the block-sparse launch.

    out_BTNH = composite.attention(q, k, v, mask, dense_full_heads=True)

`mask.block_lists` carries Elastic's per-head modes (ops.HEAD_FULL / ops.HEAD_BLOCKS). With
dense_full_heads and impl='auto', lowered for cuda, a contiguous self-attention mask cuDNN can
take otherwise (no documents, active set, window or sinks) runs through `split_full_heads` with
cuDNN as the dense kernel (its head count is the batch's largest count of all-full KV heads,
picked at run time among K + 1 compiled variants); every other platform, mask or impl is plain
ops.attention. Same result either way (tests/kernels/test_ops.py); faster where cuDNN outruns the
block-sparse kernel's full heads (bench/results/elastic_prefill_*.json, docs/performance.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax import ops


def split_full_heads(q, k, v, mask: ops.MaskSpec, dense_fn, sparse_fn):
  """Attention under `mask` (block lists with head modes) as two kernels: the KV heads whose G
  query heads are all ops.HEAD_FULL through dense_fn(q_BTMH, k_BSCH, v_BSCH, mask without block
  lists) over C gathered KV heads (M = C * G query heads), the rest through sparse_fn(q, k, v,
  mask) with those heads' lists emptied (no work). C = the batch's largest count of such KV
  heads, a run-time value: lax.switch over the K + 1 static head counts (rows with fewer take
  other KV heads into the spare slots, computed and discarded)."""
  bl = mask.block_lists
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  full_BK = jnp.all(bl.head_mode_BN.reshape(B, K, G) == ops.HEAD_FULL, axis=-1)
  full_BN = jnp.repeat(full_BK, G, axis=1)
  order_BK = jnp.argsort(1 - full_BK.astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
  slot_BK = jnp.argsort(order_BK, axis=1).astype(jnp.int32)     # kv head -> its dense slot
  g_N = jnp.tile(jnp.arange(G, dtype=jnp.int32), K)
  out_idx_BN = jnp.repeat(slot_BK, G, axis=1) * G + g_N[None, :]
  lists_off = dataclasses.replace(mask, block_lists=None)

  def dense_with(C):
    def branch(q, k, v):
      if C == 0:
        return jnp.zeros(q.shape, q.dtype)
      pick_BC = order_BK[:, :C]
      q_idx = (pick_BC[:, :, None] * G + jnp.arange(G, dtype=jnp.int32)).reshape(B, C * G)
      qd = jnp.take_along_axis(q, q_idx[:, None, :, None], axis=2)
      kd = jnp.take_along_axis(k, pick_BC[:, None, :, None], axis=2)
      vd = jnp.take_along_axis(v, pick_BC[:, None, :, None], axis=2)
      od = dense_fn(qd, kd, vd, lists_off)                       # [B, T, C * G, H]
      idx = jnp.minimum(out_idx_BN, C * G - 1)
      return jnp.take_along_axis(od, idx[:, None, :, None], axis=2)
    return branch

  C_run = jnp.max(jnp.sum(full_BK, axis=1)).astype(jnp.int32)
  out_dense = lax.switch(C_run, [dense_with(C) for C in range(K + 1)], q, k, v)
  sparse_lists = jnp.where(full_BN[:, :, None, None], -1, bl.kv_blocks_BNQL)
  sparse_mode = jnp.where(full_BN, ops.HEAD_BLOCKS, bl.head_mode_BN).astype(jnp.int32)
  sparse_mask = dataclasses.replace(mask, block_lists=dataclasses.replace(
      bl, kv_blocks_BNQL=sparse_lists, head_mode_BN=sparse_mode))
  out_sparse = sparse_fn(q, k, v, sparse_mask)
  return jnp.where(full_BN[:, None, :, None], out_dense, out_sparse)


def splits_full_heads(q, mask: ops.MaskSpec) -> bool:
  """Whether `attention(..., dense_full_heads=True)` on cuda runs `mask` through split_full_heads
  with cuDNN: head modes given, and the mask without its lists is one cuDNN takes (no window)."""
  bl = mask.block_lists
  if bl is None or bl.head_mode_BN is None:
    return False
  dense = dataclasses.replace(mask, block_lists=None)
  return (not ops.cudnn_reasons(q, dense) and dense.window is None
          and ops.cudnn_available() is None)


def attention(q_BTNH, k_BSKH, v_BSKH, mask: ops.MaskSpec, *, dense_full_heads: bool,
              impl: str = "auto", scale: float | None = None):
  """ops.attention, except that with dense_full_heads and impl='auto', lowered for cuda, the
  all-full KV heads run in one cuDNN call (module docstring)."""
  q, k, v = map(jnp.asarray, (q_BTNH, k_BSKH, v_BSKH))
  mask = jax.tree.map(jnp.asarray, mask)
  run = lambda impl: lambda q, k, v, m: ops.attention(q, k, v, m, impl=impl, scale=scale)
  if not dense_full_heads or impl != "auto" or not splits_full_heads(q, mask):
    return run(impl)(q, k, v, mask)
  split = ops.per_shard(functools.partial(split_full_heads, dense_fn=run("cudnn"),
                                          sparse_fn=run("auto")))
  return ops.by_lowering_platform(q, k, v, mask, default=run("auto"), cuda=lambda _: split)
