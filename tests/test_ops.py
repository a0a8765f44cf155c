"""ops.attention: the reference against a per-query loop, and the fused-kernel mask paths."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from condattn_jax import ops


def _loop_attention(q, k, v, qpos, kpos, qseg, kseg, window):
  """Obviously right: one query at a time, numpy float64."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, H = q.shape
  K = k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      for n in range(N):
        keys = [s for s in range(k.shape[1]) if kpos[b, s] <= qpos[b, t]
                and (window is None or qpos[b, t] - kpos[b, s] < window)
                and kseg[b, s] != 0 and kseg[b, s] == qseg[b, t]]
        if not keys:
          continue
        kk, vv = k[b, keys, n // (N // K)], v[b, keys, n // (N // K)]
        logits = kk @ q[b, t, n] / np.sqrt(H)
        p = np.exp(logits - logits.max())
        out[b, t, n] = (p / p.sum()) @ vv
  return out


def _packed(B, T, rng):
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    t, s = 0, 1
    while t < T - 3:
      n = int(rng.integers(1, T - t))
      seg[b, t:t + n] = s
      pos[b, t:t + n] = np.arange(n)
      t, s = t + n, s + 1
  return seg, pos  # trailing tokens stay padding (segment 0)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("impl", ["xla", "tokamax"])
def test_attention_matches_loop(window, impl):
  rng = np.random.default_rng(0)
  B, T, N, K, H = 2, 12, 4, 2, 8
  q, k, v = (rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, K, K))
  seg, pos = _packed(B, T, rng)
  out = ops.attention(q, k, v, q_positions_BT=pos, kv_positions_BS=pos, q_segment_ids_BT=seg,
                      kv_segment_ids_BS=seg, window=window, impl=impl, self_attention=True)
  want = _loop_attention(q, k, v, pos, pos, seg, seg, window)
  valid = seg != 0  # the fused path leaves padding rows unspecified
  np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5)
  assert not np.isnan(np.asarray(out)).any()


def test_fully_masked_rows_are_zero_not_nan():
  q = jnp.ones((1, 2, 2, 4)); k = v = jnp.ones((1, 2, 1, 4))
  pos = jnp.array([[0, 1]])
  out = ops.attention(q, k, v, q_positions_BT=pos, kv_positions_BS=pos,
                      q_segment_ids_BT=jnp.array([[0, 0]]), kv_segment_ids_BS=jnp.array([[0, 0]]))
  assert np.all(np.asarray(out) == 0)


def test_unknown_impl_is_a_clear_error():
  x = jnp.ones((1, 2, 1, 4)); pos = jnp.array([[0, 1]])
  with pytest.raises(ValueError, match="unknown impl"):
    ops.attention(x, x, x, q_positions_BT=pos, kv_positions_BS=pos, impl="nope", self_attention=True)
