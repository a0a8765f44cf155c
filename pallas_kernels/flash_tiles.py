"""Flash-attention tile math shared by the kernel packages (compact_attention, block_sparse).

Constants of the online softmax (base-2 exponentials), the shared-memory budget of a Triton
program, and the small in-kernel helpers both packages' Triton and Mosaic TPU kernels use:
  dot(a, b, trans_a, trans_b)   a Triton-lowered matrix product
  bwd_lse2(lse)                 natural-log lse -> base 2, empty rows (-inf) -> +inf (so p = 0)
  lanes / rows / bcast_lanes    the TPU layout: per-query values over the 128 lanes, per-key
                                values over the 8 sublanes
  lse_safe(lse)                 TPU backward: empty rows (-inf) -> +inf (so p = 0)
  poison_buffers(shapes, on)    NaN-filled output buffers (a testing aid: an element a kernel fails
                                to write shows up as NaN)
Importable without condattn_jax; nothing here depends on the platform a program is lowered for.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = float("-inf")
TRITON_SMEM_BYTES = 227 * 1024  # Hopper's per-block limit (232448)

# TPU layout
LANES = 128
SUBLANES = 8
NT_DIMS = (((1,), (1,)), ((), ()))  # lax.dot_general dimension numbers of a @ b.T


def dot(a, b, trans_a=False, trans_b=False):
  """A matrix product inside a Triton-lowered kernel."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b)


def bwd_lse2(lse):
  """Natural-log lse -> base-2, with empty rows (-inf) mapped to +inf so that p = 0."""
  lse2 = lse * LOG2E
  return jnp.where(lse2 == NEG_INF, jnp.inf, lse2)


def lse_safe(lse):
  """Natural-log lse with empty rows (-inf) mapped to +inf so that p = exp(s - lse) = 0."""
  return jnp.where(lse == NEG_INF, jnp.inf, lse)


def lanes(x_BIC):
  """[..., C] -> [..., C, 128]: a per-query value replicated over the lanes."""
  return jnp.broadcast_to(x_BIC[..., None], x_BIC.shape + (LANES,))


def rows(x_BS):
  """[B, S] -> [B, 8, S]: a per-key value replicated over the sublanes."""
  return jnp.broadcast_to(x_BS[:, None, :], (x_BS.shape[0], SUBLANES, x_BS.shape[1]))


def bcast_lanes(x, n):
  """(rows, 128) lane-replicated -> (rows, n)."""
  if n == LANES:
    return x
  if n < LANES:
    return x[:, :n]
  return jnp.tile(x, (1, n // LANES))


def poison_buffers(shapes, poison):
  """([NaN arrays], [their ANY-memory BlockSpecs]) for output buffers aliased by a Mosaic TPU
  kernel when `poison`, else ([], [])."""
  if not poison:
    return [], []
  return ([jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes],
          [pl.BlockSpec(memory_space=pl.ANY) for _ in shapes])
