"""Shared by the CPU tests, the GPU smoke test and the benchmark: random problems and checks."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .api import compact_attention

# Relative-error bounds ||x - ref|| / ||ref|| (device tool METHOD.md: float32 far under 1e-3,
# bf16 operands between 1e-3 and 1e-2). Gradients go through one more bf16 rounding of P / dS.
TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}


@dataclasses.dataclass
class Problem:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  active: jax.Array
  ct: jax.Array           # cotangent for the output
  ct_lse: jax.Array       # cotangent for the lse (finite entries only)
  kw: dict                # positions / segments / window keyword arguments


def random_operands(seed, B, T, S, N, K, H, dtype):
  """(q [B,T,N,H], k, v [B,S,K,H], ct [B,T,N,H] in dtype; ct_lse [B,T,N] float32): standard
  normal draws (numpy, a stream of its own per seed), rounded to dtype on the host: no program
  is compiled to make a problem."""
  rng = np.random.default_rng([seed, 1])
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  cast = lambda x: jnp.asarray(x.astype(jnp.dtype(dtype)))
  return (cast(draw(B, T, N, H)), cast(draw(B, S, K, H)), cast(draw(B, S, K, H)),
          cast(draw(B, T, N, H)), jnp.asarray(draw(B, T, N)))


def make_problem(seed, *, B=1, T=128, S=None, N=4, K=2, H=32, dtype=jnp.float32,
                 sparsity=0.5, per_head=False, segments=0, window=None, q_offset=0,
                 packed_positions=False, kv_positions=False, empty_rows=()):
  """A random problem. segments > 0 packs that many documents (contiguous, random lengths, some
  padding with id 0 at the end); packed_positions restarts positions per document."""
  S = T + q_offset if S is None else S
  rng = np.random.default_rng(seed)
  q, k, v, ct, ct_lse = random_operands(seed, B, T, S, N, K, H, dtype)
  shape = (B, T, N) if per_head else (B, T)
  active = rng.random(shape) >= sparsity
  for r in empty_rows:
    active[r] = False
  active = jnp.asarray(active)
  kw = {}
  if window is not None:
    kw["window"] = window
  if q_offset:
    kw["q_offset"] = q_offset
  if segments:
    assert S == T, "segments with a prefix are not generated here"
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
      cuts = np.sort(rng.choice(np.arange(1, T), size=segments, replace=False))
      seg[b], pos[b] = packed_documents(T, cuts)
    kw["q_segment_ids_BT"] = jnp.asarray(seg)
    kw["kv_segment_ids_BS"] = jnp.asarray(seg)
    if packed_positions:
      kw["q_positions_BT"] = jnp.asarray(pos)
      kw["kv_positions_BS"] = jnp.asarray(pos)
  elif kv_positions:
    # keys at arbitrary (sorted, distinct) positions; queries at the last T of them
    kp = np.sort(rng.choice(np.arange(4 * S), size=(B, S), replace=True), axis=1).astype(np.int32)
    kw["kv_positions_BS"] = jnp.asarray(kp)
    kw["q_positions_BT"] = jnp.asarray(kp[:, S - T:] + rng.integers(0, 2, (B, T)).astype(np.int32))
  return Problem(q, k, v, active, ct, ct_lse, kw)


def packed_documents(S: int, cuts) -> tuple[np.ndarray, np.ndarray]:
  """(segment ids, positions) [S] int32 of len(cuts) documents packed in a row of S slots:
  document d (id d + 1) holds [cuts[d - 1], cuts[d]) (from 0), the slots from cuts[-1] on are
  padding (id 0); positions restart at 0 in each document and in the padding."""
  seg = np.zeros(S, np.int32)
  pos = np.zeros(S, np.int32)
  start = 0
  for d, end in enumerate(cuts):
    seg[start:end] = d + 1
    pos[start:end] = np.arange(end - start)
    start = end
  pos[start:] = np.arange(S - start)
  return seg, pos


def rel_err(x, ref):
  # widened on the host (exact from bf16 / f16 / f32; an eager jnp cast compiles a program per
  # shape and dtype)
  x = np.asarray(x).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  if np.isnan(x).any():
    return float("nan")
  den = np.linalg.norm(ref)
  num = np.linalg.norm(x - ref)
  return float(num / den) if den > 0 else float(num)


_RUNS: dict = {}  # (grads, static keywords) -> run's jitted function


def run(p: Problem, *, grads=True, **kw):
  """(out, lse, (dq, dk, dv) or None) of compact_attention on problem p, in one jit. The
  problem's arrays (operands, active set, positions, segment ids, cotangents) are the jitted
  function's arguments, one function per static configuration: problems of the same shapes and
  keywords share one compile."""
  arrays = {n: x for n, x in p.kw.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = {n: x for n, x in p.kw.items() if n not in arrays}

  def fn(q, k, v, active, ct, ct_lse, arrays):
    def f(q, k, v):
      return compact_attention(q, k, v, active, return_lse=True, **arrays, **static, **kw)
    if not grads:
      return (*f(q, k, v), None)
    (o, l), vjp = jax.vjp(f, q, k, v)
    ct_l = jnp.where(jnp.isfinite(l), 0.5 * ct_lse, 0.0)
    return o, l, vjp((ct.astype(o.dtype), ct_l))

  key = (grads, tuple(sorted(kw.items())), tuple(sorted(static.items())))
  try:
    if key not in _RUNS:
      _RUNS[key] = jax.jit(fn)
    jitted = _RUNS[key]
  except TypeError:   # an unhashable keyword: a compile of its own
    jitted = jax.jit(fn)
  return jitted(p.q, p.k, p.v, p.active, p.ct, p.ct_lse, arrays)


def compare(p: Problem, impl_kw: dict, *, grads=True, tol=None, reference=None):
  """Errors of the kernel vs the reference: dict name -> relative error (NaN fails). reference:
  the reference's run(p, grads=grads, impl='reference') computed before (one compile for several
  kernels)."""
  tol = TOL[jnp.dtype(p.q.dtype).name] if tol is None else tol
  o, l, g = run(p, grads=grads, poison=True, **impl_kw)
  o_r, l_r, g_r = reference or run(p, grads=grads, impl="reference")
  errs = {"out": rel_err(o, o_r)}
  fin = np.isfinite(np.asarray(l_r))
  # 0.0 = the lse is -inf exactly where the reference's is (no key seen); NaN (fails) otherwise
  errs["lse_inf_pattern"] = 0.0 if np.array_equal(fin, np.isfinite(np.asarray(l))) else np.nan
  errs["lse"] = rel_err(np.where(fin, l, 0), np.where(fin, l_r, 0))
  inactive = ~np.asarray(p.active)
  if inactive.ndim == 2:
    inactive = np.broadcast_to(inactive[:, :, None], o.shape[:3])
  # 0.0 = inactive queries give exactly zero; NaN (fails) otherwise
  errs["inactive_zero"] = 0.0 if np.all(np.asarray(o)[inactive] == 0) else np.nan
  if grads:
    for n, a, b in zip(("dq", "dk", "dv"), g, g_r):
      errs[n] = rel_err(a, b)
  bad = {n: e for n, e in errs.items() if not e <= tol}  # NaN never passes
  return errs, bad
