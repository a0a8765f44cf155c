"""Shared by the CPU tests and the benchmark: random block-sparse problems, SSA lists, checks."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compact_attention.testing import TOL, random_operands, rel_err

from .api import HEAD_BLOCKS, HEAD_FULL, block_sparse_attention


def ssa_lists(B, N, T, S, *, block_q, block_k, sink_blocks, local_blocks, q_offset=None):
  """Streaming (sink + local) lists [B, N, nq, sink_blocks + local_blocks]: the first
  `sink_blocks` kv blocks and the `local_blocks` blocks ending at the query block's diagonal
  (queries at key slots q_offset + t, default S - T); -1 where a block would be out of range."""
  q_offset = S - T if q_offset is None else q_offset
  nq = T // block_q
  i = np.arange(nq)
  diag = (q_offset + (i + 1) * block_q - 1) // block_k                   # [nq]
  local = diag[:, None] - np.arange(local_blocks)[None, ::-1]            # [nq, local]
  sink = np.broadcast_to(np.arange(sink_blocks), (nq, sink_blocks))
  lst = np.concatenate([sink, local], axis=1)
  lst = np.where(lst >= 0, lst, -1)   # local blocks may repeat sink blocks: duplicates are fine
  return np.broadcast_to(lst, (B, N) + lst.shape).astype(np.int32)


@dataclasses.dataclass
class Problem:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  ct: jax.Array
  ct_lse: jax.Array
  kw: dict   # kv_blocks_BNQL, head_mode_BN, block sizes, positions, segments, window, ...


def make_problem(seed, *, B=1, T=64, S=None, N=4, K=2, H=16, dtype=jnp.float32, block_q=16,
                 block_k=16, L=3, full_frac=0.5, segments=0, window=None, sinks=0,
                 active=None, kv_positions=False, dup_pad=True):
  """A random problem: random lists (with -1 padding and duplicates), a random HEAD_FULL /
  HEAD_BLOCKS mix, optional packed documents (positions restart), window / sinks, active
  ('token' or 'head'), a cache-like prefix (S > T) with kv_positions."""
  S = T if S is None else S
  rng = np.random.default_rng(seed)
  q, k, v, ct, ct_lse = random_operands(seed, B, T, S, N, K, H, dtype)
  nq, nk = -(-T // block_q), -(-S // block_k)
  lists = rng.integers(-1, nk, size=(B, N, nq, L)).astype(np.int32)
  if dup_pad and L > 1:
    lists[..., -1] = lists[..., 0]          # duplicates
  mode = np.where(rng.random((B, N)) < full_frac, HEAD_FULL, HEAD_BLOCKS).astype(np.int32)
  kw = dict(kv_blocks_BNQL=jnp.asarray(lists), head_mode_BN=jnp.asarray(mode), block_q=block_q,
            block_k=block_k)
  if window is not None:
    kw.update(window=window, sinks=sinks)
  if segments:
    assert S == T, "segments with a prefix are not generated here"
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
      cuts = np.sort(rng.choice(np.arange(1, T), size=segments, replace=False))
      start = 0
      for d, end in enumerate(cuts):
        seg[b, start:end] = d + 1
        pos[b, start:end] = np.arange(end - start)
        start = end
      pos[b, start:] = np.arange(T - start)  # trailing padding (segment 0)
    kw.update(q_segment_ids_BT=jnp.asarray(seg), kv_segment_ids_BS=jnp.asarray(seg),
              q_positions_BT=jnp.asarray(pos), kv_positions_BS=jnp.asarray(pos))
  elif kv_positions:
    kp = np.sort(rng.choice(np.arange(4 * S), size=(B, S), replace=True), axis=1).astype(np.int32)
    kw["kv_positions_BS"] = jnp.asarray(kp)
    kw["q_positions_BT"] = jnp.asarray(kp[:, S - T:] + rng.integers(0, 2, (B, T)).astype(np.int32))
    kw["kv_segment_ids_BS"] = jnp.asarray((rng.random((B, S)) < 0.9).astype(np.int32))  # validity
  if active == "token":
    kw["active"] = jnp.asarray(rng.random((B, T)) < 0.7)
  elif active == "head":
    kw["active"] = jnp.asarray(rng.random((B, T, N)) < 0.7)
  return Problem(q, k, v, ct, ct_lse, kw)


def run(p: Problem, *, grads=True, **kw):
  """(out, lse, (dq, dk, dv) or None) of block_sparse_attention on problem p, in one jit."""
  def f(q, k, v):
    return block_sparse_attention(q, k, v, return_lse=True, **p.kw, **kw)

  def fg(q, k, v):
    (o, l), vjp = jax.vjp(f, q, k, v)
    ct_l = jnp.where(jnp.isfinite(l), 0.5 * p.ct_lse, 0.0)
    return o, l, vjp((p.ct.astype(o.dtype), ct_l))

  if not grads:
    o, l = jax.jit(f)(p.q, p.k, p.v)
    return o, l, None
  return jax.jit(fg)(p.q, p.k, p.v)


def compare(p: Problem, impl_kw: dict, *, grads=True, tol=None, outputs=False, reference=None):
  """Errors of the kernel (poisoned outputs) vs the reference: (errs, bad); NaN fails.
  outputs=True: (errs, bad, the kernel's (out, lse, grads)). reference: the reference's
  run(p, grads=grads, impl='reference') computed before (one compile for several kernels)."""
  tol = TOL[jnp.dtype(p.q.dtype).name] if tol is None else tol
  o, l, g = run(p, grads=grads, poison=True, **impl_kw)
  o_r, l_r, g_r = reference or run(p, grads=grads, impl="reference")
  errs = {"out": rel_err(o, o_r)}
  fin = np.isfinite(np.asarray(l_r))
  errs["lse_inf_pattern"] = 0.0 if np.array_equal(fin, np.isfinite(np.asarray(l))) else np.nan
  errs["lse"] = rel_err(np.where(fin, l, 0), np.where(fin, l_r, 0))
  # rows that see nothing come back exactly zero
  errs["empty_rows_zero"] = 0.0 if np.all(np.asarray(o)[~fin] == 0) else np.nan
  if grads:
    for n, a, b in zip(("dq", "dk", "dv"), g, g_r):
      errs[n] = rel_err(a, b)
  bad = {n: e for n, e in errs.items() if not e <= tol}
  return (errs, bad, (o, l, g)) if outputs else (errs, bad)
