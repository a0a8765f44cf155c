"""AHA reports: usage (mu_f) per layer x head and per task on held-out batches, the per-head gap
between full-attention calls (against a brute-force loop over documents), the heatmap PNG."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import aha, get_scheme
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder


def _brute_gap(gate_LBTN, seg_BT):
  """Mean tokens between consecutive triggers of each (layer, head), within documents."""
  L, B, T, N = gate_LBTN.shape
  out = np.full((L, N), np.nan)
  for l in range(L):
    for n in range(N):
      gaps = []
      for b in range(B):
        for doc in set(seg_BT[b].tolist()) - {0}:
          ts = [t for t in range(T) if seg_BT[b, t] == doc and gate_LBTN[l, b, t, n]]
          gaps += [y - x for x, y in zip(ts, ts[1:])]
      if gaps:
        out[l, n] = np.mean(gaps)
  return out


def test_gap_counts_match_brute_force():
  rng = np.random.default_rng(0)
  L, B, T, N = 2, 3, 20, 4
  p = np.array([0.05, 0.3, 0.9, 0.0])  # per head: rare, medium, almost always, never
  gate = rng.random((L, B, T, N)) < p
  seg = np.array([[1] * 8 + [2] * 12, [1] * 20, [1] * 5 + [2] * 10 + [0] * 5])
  gate &= (seg != 0)[None, :, :, None]
  gs, gc = aha.gap_counts(gate, seg)
  got = np.where(gc.sum(1) > 0, gs.sum(1) / np.maximum(gc.sum(1), 1), np.nan)
  np.testing.assert_allclose(got, _brute_gap(gate, seg), rtol=1e-12)
  assert np.isnan(got[:, 3]).all() and (got[:, 2] < 1.3).all()
  # a head firing on every token: gap 1; across a document boundary nothing is counted
  every = np.ones((1, 1, 6, 1), bool)
  gs, gc = aha.gap_counts(every, np.array([[1, 1, 1, 2, 2, 2]]))
  assert gs.sum() == 4 and gc.sum() == 4


def test_usage_report_per_layer_head_and_task(tmp_path):
  cfg = ModelConfig(family="olmo2", qk_norm="full", post_norm=True, num_layers=3)
  tok = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 1, cfg.vocab_size)
  dp = host_init(cfg, 1)
  acfg, ap = attention.convert(dp, cfg, "aha", window=4)
  r = ap["layers"]["router"]
  r["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(2), r["kernel"].shape)
  r["bias"] = jnp.broadcast_to(jnp.asarray([-1.0, 0.0, 0.5, 2.0]), (3, 4))  # heads differ
  seg = np.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4])
  batches = [dict(inputs=tok, segment_ids=seg, task_ids=np.array([0, 1])),
             dict(inputs=(tok * 5 + 1) % cfg.vocab_size, task_ids=np.array([1, 1]))]
  m = Decoder(acfg)
  rep = get_scheme("aha").reports["usage"](m, ap, batches, out_dir=str(tmp_path), name="u")
  # usage == the layer's own counts (aux full_BN / tokens_B), pooled over batches and by task
  # one forward per batch (its aux and its sown gates), jitted
  fwd = jax.jit(lambda t, s: m.apply({"params": ap}, t, None, s, mutable=["intermediates"]))
  runs = [fwd(jnp.asarray(b["inputs"]), jnp.asarray(b.get("segment_ids", np.ones(
      b["inputs"].shape, np.int32)), jnp.int32)) for b in batches]
  auxes = [aux for (_, aux), _ in runs]
  full = np.concatenate([np.asarray(a["full_BN"]) for a in auxes], axis=1)   # [L, 4 rows, N]
  toks = np.concatenate([np.asarray(a["tokens_B"]) for a in auxes], axis=1)[0]
  tasks = np.array([0, 1, 1, 1])
  np.testing.assert_allclose(rep["usage"], full.sum(1) / toks.sum(), atol=1e-12)
  for t in (0, 1):
    sel = tasks == t
    np.testing.assert_allclose(rep["tasks"][str(t)]["usage"],
                               full[:, sel].sum(1) / toks[sel].sum(), atol=1e-12)
    assert rep["tasks"][str(t)]["tokens"] == toks[sel].sum()
  u = np.asarray(rep["usage"])
  assert u.shape == (3, 4) and np.ptp(u.mean(0)) > 0.3  # heads really differ
  assert rep["mu_f"] == pytest.approx(u.mean())
  assert rep["heads_by_usage"] == sorted(u.ravel().tolist(), reverse=True)
  # the gap of each head == the brute-force mean over documents of the sown gates
  gates = [np.asarray(st["intermediates"]["layers"]["gate"][0]) for _, st in runs]
  segs = [b.get("segment_ids", np.ones(b["inputs"].shape, np.int64)) for b in batches]
  want = _brute_gap(np.concatenate(gates, axis=1), np.concatenate(segs, axis=0))
  got = np.array([[np.nan if x is None else x for x in row] for row in rep["gap"]])
  np.testing.assert_allclose(got, want, rtol=1e-9)
  # tau is a knob of the measurement too
  assert aha.measure_usage(m, ap, batches, tau=0.8)["mu_f"] < rep["mu_f"] - 0.05
  # the files: JSON as returned, a PNG heatmap with a panel per task (not blank)
  with open(rep["json"]) as f:
    assert json.load(f)["usage"] == rep["usage"]
  import matplotlib.image as mpimg
  img = mpimg.imread(rep["png"])
  one = mpimg.imread(aha.plot_usage_heatmap(u, str(tmp_path / "one.png")))
  assert img.shape[1] > 2 * one.shape[1] and img.std() > 0.05
