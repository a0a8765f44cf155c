"""The decode MLP in plain jnp: the model's pre-norm MLP half after its norm.

condattn_jax/models/layers.py (MLP, mlp_residual): x + down(silu(gate(xn)) * up(xn)), each
projection a flax nn.Dense(use_bias=False, dtype=compute dtype), i.e. a product of xn and the
kernel cast to the compute dtype, summed in float32 (XLA's dot of two bf16 operands) and returned
in the compute dtype. The rounding points, in the activation dtype (xn's):
  g = round(xn @ Wg), u = round(xn @ Wu)          the gate_proj / up_proj outputs
  h = round(silu(g) * u)                           silu * mul evaluated in float32 (one rounding:
                                                   XLA's GPU fusion of the model's bf16 ops does
                                                   that, its default xla_allow_excess_precision)
  y = round(h @ Wd)                                the down_proj output
  out = x + y                                      the residual add, in x's dtype
Each rounding is `round_to` (lax.reduce_precision, then the cast): XLA's simplifier drops a
float32 -> bf16 -> float32 convert pair inside a fusion (xla_allow_excess_precision, on by default
on CPU and GPU), so a plain `.astype(bf16)` followed by float32 math may not round at all;
reduce_precision is an op XLA keeps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def round_to(v, dtype):
  """float32 `v` rounded to `dtype` (nearest even), kept under XLA's excess-precision rewrites."""
  fi = jnp.finfo(dtype)
  return lax.reduce_precision(v.astype(jnp.float32), exponent_bits=fi.nexp,
                              mantissa_bits=fi.nmant).astype(dtype)


def silu_mul(g, u, dtype):
  """round(silu(g) * u) to `dtype`, evaluated in float32 (g, u: the rounded projections)."""
  return round_to(jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32), dtype)


def project(a, w, dtype):
  """round(a @ w) to `dtype`: an nn.Dense(use_bias=False, dtype=dtype) output (w cast to dtype,
  float32 sums)."""
  return round_to(jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32),
                  dtype)


def reference_hidden(xn_MD, w_gate_DF, w_up_DF):
  """h [M, F] in xn's dtype: the model's silu(gate_proj(xn)) * up_proj(xn)."""
  dt = xn_MD.dtype
  return silu_mul(project(xn_MD, w_gate_DF, dt), project(xn_MD, w_up_DF, dt), dt)


def reference_decode_mlp(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD):
  """x + down_proj(silu(gate_proj(xn)) * up_proj(xn)) [M, D] in x's dtype (the weights cast to
  xn's dtype first, as nn.Dense does)."""
  h = reference_hidden(xn_MD, w_gate_DF, w_up_DF)
  return x_MD + project(h, w_down_FD, xn_MD.dtype).astype(x_MD.dtype)
