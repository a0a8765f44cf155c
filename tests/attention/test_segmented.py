"""Scheme 'segmented' (docs/schemes/segmented.md#tests): the segment operator against a per-head numpy
reference of the spec (tail / retrieved prefix / segment-only contexts, RoPE re-indexing,
retrieval: summaries, top-k, dedupe by max, anchors, expansion, earliest-position padding, sort,
refresh period), S >= T == the base model (fp32), the training forward (segment-major scan) ==
the full-sequence forward, TBPTT depth K (gradients two segments back: zero for K=1, non-zero
for K=2), conversions, option errors."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import segmented as sgm
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder
from condattn_jax.models.layers import rope_inv_freq

OPTS = dict(segment_len=8, tail_len=4, retrieve_len=8, long_heads=(0,), long_layers=(1,),
            query_len=8, summary_window=4, summary_stride=2, summary_tail=2, topk=3, anchors=2,
            expand=(-1, 2))
FAMILIES = {"llama": dict(num_heads=4, num_kv_heads=2),
            "qwen3": dict(num_heads=4, num_kv_heads=2, qk_norm="head")}


def _dense(family="llama", layers=2):
  cfg = ModelConfig(family=family, vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=layers, head_dim=8, rope_theta=100.0).replace(**FAMILIES[family])
  return cfg, _init(cfg)


@functools.lru_cache(maxsize=None)
def _init(cfg):
  """Dense params as host (numpy) arrays: the conversions' regrouping of layers stays numpy (on
  device arrays each eager slice / stack compiles on its own); jit takes them as they are."""
  return host_init(cfg, 0, numpy=True)


# ------------------------------------------------------------------------- numpy reference
def _ref_retrieve(pool_k, pool_len, q_last, o):
  """pool_k [P, Kl, H], q_last [Lq, Nl, H] (time order) -> (idx [Kl, R], valid [R])."""
  P, Kl, _ = pool_k.shape
  G = q_last.shape[1] // Kl
  starts = range(0, o.query_len - o.summary_window + 1, o.summary_stride)
  out = []
  for h in range(Kl):
    best = {}
    for n in range(h * G, (h + 1) * G):
      summ = [q_last[s:s + o.summary_window, n].mean(0) for s in starts]
      summ.append(q_last[o.query_len - o.summary_tail:, n].mean(0))
      for s in summ:
        sc = pool_k[:pool_len, h] @ s
        for p in np.argsort(-sc)[:o.topk]:
          best[int(p)] = max(best.get(int(p), -np.inf), sc[p])
    anchors = sorted(best, key=lambda p: -best[p])[:o.anchors]
    sel = {a + d for a in anchors for d in range(o.expand[0], o.expand[1] + 1)
           if 0 <= a + d < pool_len}
    rest = [p for p in range(P) if p not in sel]
    out.append(sorted(sorted(sel) + rest[:o.retrieve_len - len(sel)]))
  return np.asarray(out), np.arange(o.retrieve_len) < min(pool_len, o.retrieve_len)


def _rope(x, pos, inv_freq):
  """numpy RoPE (rotate-half), x [n, H], pos [n]."""
  f = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None]
  c, s = np.cos(np.concatenate([f, f], -1)), np.sin(np.concatenate([f, f], -1))
  x1, x2 = np.split(x, 2, axis=-1)
  return x * c + np.concatenate([-x2, x1], -1) * s


def _softmax_attend(q, ks, vs, q_pos, k_pos, inv_freq):
  """One query head: q [H] at q_pos; keys [n, H] at k_pos (RoPE applied here)."""
  rq = _rope(q[None], [q_pos], inv_freq)[0]
  s = _rope(ks, k_pos, inv_freq) @ rq / np.sqrt(q.shape[-1])
  w = np.exp(s - s.max())
  return (w / w.sum()) @ vs


def _ref_layer(q, k, v, cfg, o, long_layer):
  """Per-head, per-token reference of one layer's segmented attention over one row."""
  T, N, H = q.shape
  S, M, R = o.segment_len, o.tail_len, o.retrieve_len
  G = N // cfg.num_kv_heads
  inv = rope_inv_freq(cfg)
  long_kv = sorted(o.long_heads)
  out = np.zeros_like(q)
  ret = None
  for i in range(-(-T // S)):
    lo = i * S
    if long_layer and i > 0 and (i - 1) % o.refresh == 0:
      q_last = q[lo - o.query_len:lo][:, [n for h in long_kv for n in range(h * G, (h + 1) * G)]]
      ret = _ref_retrieve(k[:lo, long_kv], lo, q_last, o)
    for t in range(lo, min(lo + S, T)):
      j = t - lo
      for n in range(N):
        h = n // G
        if h not in long_kv:
          P = M
          pk = k[lo - M:lo, h] if i > 0 else np.zeros((0, H))
          pv = v[lo - M:lo, h] if i > 0 else np.zeros((0, H))
          ppos = np.arange(M)[:len(pk)]
        elif long_layer and i > 0:
          P = R
          idx, ok = ret
          r = idx[long_kv.index(h)][ok]
          pk, pv, ppos = k[r, h], v[r, h], np.arange(R)[ok]
        else:
          P, pk, pv, ppos = 0, np.zeros((0, H)), np.zeros((0, H)), np.zeros(0, int)
        ks = np.concatenate([pk, k[lo:t + 1, h]])
        vs = np.concatenate([pv, v[lo:t + 1, h]])
        kp = np.concatenate([ppos, P + np.arange(j + 1)])
        out[t, n] = _softmax_attend(q[t, n], ks, vs, P + j, kp, inv)
  return out


@pytest.mark.parametrize("long_layer,refresh,kv_heads", [(True, 1, 2), (True, 2, 1), (False, 1, 2)])
def test_operator_matches_per_head_reference(long_layer, refresh, kv_heads):
  cfg = ModelConfig(family="llama", num_heads=4, num_kv_heads=kv_heads, head_dim=8,
                    rope_theta=100.0)
  o = sgm.SegmentedOptions(**{**OPTS, "refresh": refresh})
  g = sgm.head_groups(cfg, o)
  T = 37  # 5 segments, the last one short; the pool outgrows R at segment 2
  ks = jax.random.split(jax.random.PRNGKey(1), 3)
  q = jax.random.normal(ks[0], (1, T, 4, 8))
  k = jax.random.normal(ks[1], (1, T, kv_heads, 8))
  v = jax.random.normal(ks[2], (1, T, kv_heads, 8))
  got = jax.jit(lambda q, k, v: sgm.full_sequence(
      q, k, v, jnp.ones((1, T), bool), config=cfg, o=o, groups=g, long_layer=long_layer,
      impl="reference"))(q, k, v)
  want = _ref_layer(np.asarray(q[0]), np.asarray(k[0]), np.asarray(v[0]), cfg, o, long_layer)
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-5, rtol=0)


def test_retrieve_matches_reference_vectorised_over_batch_and_heads():
  o = sgm.SegmentedOptions(**{**OPTS, "anchors": 2, "topk": 3})
  P, Kl, G, H = 24, 2, 2, 8
  ks = jax.random.split(jax.random.PRNGKey(2), 2)
  pool = jax.random.normal(ks[0], (3, P, Kl, H))
  ql = jax.random.normal(ks[1], (3, o.query_len, Kl * G, H))
  lens = jnp.asarray([5, 16, 24])  # a short pool (< R: invalid tail slots), partial, full
  idx, valid = jax.jit(lambda *a: sgm.retrieve(*a, o))(pool, lens, ql)
  assert idx.shape == (3, Kl, o.retrieve_len) and valid.shape == (3, o.retrieve_len)
  for b in range(3):
    want_idx, want_ok = _ref_retrieve(np.asarray(pool[b]), int(lens[b]), np.asarray(ql[b]), o)
    np.testing.assert_array_equal(np.asarray(valid[b]).astype(bool), want_ok)
    np.testing.assert_array_equal(np.asarray(idx[b])[:, want_ok], want_idx[:, want_ok])


def test_segment_len_at_least_T_is_the_base_model():
  toks = jax.random.randint(jax.random.PRNGKey(3), (2, 20), 0, 64)
  apply = jax.jit(lambda c, p, t: Decoder(c).apply({"params": p}, t)[0], static_argnums=0)
  for family in ("llama",):  # qwen3 (q/k norm) == base: the HF / recipe and inference tests
    cfg, dp = _dense(family)
    base = apply(cfg, dp, toks)
    scfg, sp = attention.convert(dp, cfg, "segmented", **{**OPTS, "segment_len": 24})
    np.testing.assert_allclose(apply(scfg, sp, toks), base, atol=1e-5, rtol=0)
    if family == "llama":
      seg = jax.jit(lambda p, t: sgm.forward(Decoder(scfg), p, t)[0])(sp, toks)
      np.testing.assert_allclose(seg, base, atol=1e-5, rtol=0)
      small = attention.configure(cfg, "segmented", **OPTS)
      assert np.abs(np.asarray(apply(small, sgm.from_dense(dp, small), toks) - base)).max() > 1e-2


def test_training_forward_equals_full_sequence_forward_ragged():
  cfg, dp = _dense("qwen3")
  scfg, sp = attention.convert(dp, cfg, "segmented", **OPTS)
  toks = jax.random.randint(jax.random.PRNGKey(4), (2, 29), 0, 64)
  seg_ids = (jnp.arange(29)[None] < jnp.asarray([[29], [19]])).astype(jnp.int32)
  full = jax.jit(lambda p: Decoder(scfg).apply({"params": p}, toks, None, seg_ids)[0])(sp)
  seg = jax.jit(lambda p: sgm.forward(Decoder(scfg), p, toks, None, seg_ids, train=True)[0])(sp)
  ok = np.asarray(seg_ids, bool)
  np.testing.assert_allclose(np.asarray(seg)[ok], np.asarray(full)[ok], atol=1e-5, rtol=0)
  hid = jax.eval_shape(lambda p: sgm.forward(Decoder(scfg), p, toks, None, seg_ids,
                                             return_hidden=True)[0], sp)
  assert hid.shape == (2, 29, cfg.hidden_size)


def _grads_two_back(*Ks):
  """Per TBPTT depth K: |d loss(last segment) / d embeddings| of the tokens that occur only in
  segment 0 / 1. The depths' gradients are ONE jitted program (one compilation)."""
  cfg, dp = _dense("llama", layers=2)
  S = OPTS["segment_len"]
  rng = np.random.default_rng(0)
  toks = np.concatenate([rng.integers(1, 10, S), rng.integers(10, 20, S),
                         rng.integers(20, 30, S)])[None]

  def loss(scfg, p):
    logits, _ = sgm.forward(Decoder(scfg), p, jnp.asarray(toks), train=True)
    return jnp.mean(jax.nn.logsumexp(logits[:, 2 * S:], -1) - logits[0, 2 * S:, 0])

  convert = lambda K: attention.convert(dp, cfg, "segmented",
                                        **{**OPTS, "tbptt": K, "remat_segments": False})
  cfgs, params = zip(*map(convert, Ks))
  # d loss / d embeddings only (the other params closed over: no weight cotangents traced)
  emb = lambda c, p: lambda e: loss(c, {**p, "embed_tokens": {**p["embed_tokens"], "embedding": e}})
  grads = jax.jit(lambda ps: [jax.grad(emb(c, p))(p["embed_tokens"]["embedding"])
                              for c, p in zip(cfgs, ps)])(list(params))
  return [(float(jnp.abs(g[1:10]).max()), float(jnp.abs(g[10:20]).max())) for g in grads]


def test_tbptt_depth_gradients_two_segments_back():
  (two_back_1, one_back_1), (two_back_2, one_back_2) = _grads_two_back(1, 2)
  assert two_back_1 == 0.0 and one_back_1 > 1e-6
  assert two_back_2 > 1e-6 and one_back_2 > 1e-6


def test_conversion_is_identity_on_weights_and_options_errors():
  cfg, dp = _dense("llama")
  scfg, sp = attention.convert(dp, cfg, "segmented", **OPTS)
  assert set(k for k in sp if k.startswith("layers")) == {"layers_0_1", "layers_1_2"}
  dcfg, back = sgm.to_dense(sp, scfg)
  assert dcfg.scheme == "dense"
  jax.tree.map(np.testing.assert_array_equal, back, dp)
  with pytest.raises(ValueError, match="long_heads"):
    attention.configure(cfg, "segmented", **{**OPTS, "long_heads": (5,)})
  with pytest.raises(ValueError, match="long_layers"):
    attention.configure(cfg, "segmented", **{**OPTS, "long_layers": (2,)})
  with pytest.raises(ValueError, match="tail_len"):
    sgm.SegmentedOptions(**{**OPTS, "tail_len": 9})
  with pytest.raises(ValueError, match="anchors"):
    sgm.SegmentedOptions(**{**OPTS, "anchors": 3})
  with pytest.raises(ValueError, match="unknown option.*segment_length.*for scheme 'segmented'"):
    attention.get_scheme("segmented").parse_options({"segment_length": 8})


def test_recipes_refuse_packed_rows_for_one_document_schemes():
  """segmented runs a row as one stream (tail, pool and segments cross documents) and declares
  packed_documents=False: a file-source config that packs several documents in a row is refused
  at validation naming data.packing; the recipe packs one document per row."""
  from condattn_jax.attention import get_scheme
  from condattn_jax.train import config as config_lib
  from condattn_jax.train.cli import load_recipe
  import os
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert get_scheme("segmented").packed_documents is False
  c = load_recipe(os.path.join(root, "configs", "segmented_llama.py") + ":llama2-7b-32k")
  assert c.data.packing == "one_per_row"
  c.model.init_from = "/checkpoint"  # validation does not read it
  config_lib.validate_config(c, needs_data=False)
  for packing in ("concat_then_split", "first_fit"):
    c.data.packing = packing
    with pytest.raises(ValueError, match=r"config.data.packing='%s'.*'one_per_row'" % packing):
      config_lib.validate_config(c, needs_data=False)


def test_empty_restart_boundary_is_the_authors_recompute_from_an_empty_start():
  """tbptt_boundary='empty_restart' (the authors' trainer): with K = 1 the loss's segment i sees
  segment i-1 recomputed from an empty start, i.e. exactly the plain segmented forward over the
  two-segment window [i-1, i] (no retrieval here: long_layers=()); 'true_state' differs from it
  from segment 2 on and equals it on segments 0 and 1. The operator's restart_B also drops the
  retrieved prefix: a restarted chunk of a long layer with a full pool == the first segment's."""
  cfg, dp = _dense("llama", layers=2)
  S = OPTS["segment_len"]
  kw = {**OPTS, "long_layers": (), "remat_segments": False}
  rcfg, sp = attention.convert(dp, cfg, "segmented", **kw, tbptt_boundary="empty_restart")
  tcfg = attention.configure(cfg, "segmented", **kw)
  toks = np.asarray(jax.random.randint(jax.random.PRNGKey(7), (1, 4 * S), 0, 64))
  # rows: the sequence, then the windows [i-1, i] (i = 1, 2, 3) at its start, zero-padded
  rows = np.concatenate([toks] + [np.pad(toks[:, (i - 1) * S:(i + 1) * S], ((0, 0), (0, 2 * S)))
                                  for i in (1, 2, 3)])
  run = lambda c: np.asarray(jax.jit(lambda p, t: sgm.forward(Decoder(c), p, t, train=True)[0])(
      sp, jnp.asarray(rows)))
  restart, true = run(rcfg), run(tcfg)
  for i in (1, 2, 3):
    np.testing.assert_allclose(restart[0, i * S:(i + 1) * S], true[i, S:2 * S], atol=1e-5, rtol=0)
  np.testing.assert_allclose(restart[0, :2 * S], true[0, :2 * S], atol=1e-5, rtol=0)
  assert np.abs(restart[0, 2 * S:] - true[0, 2 * S:]).max() > 1e-3
  with pytest.raises(ValueError, match="tbptt_boundary='empty_restart' needs tbptt >= 1"):
    sgm.SegmentedOptions(**OPTS, tbptt=0, tbptt_boundary="empty_restart")
  with pytest.raises(ValueError, match="tbptt_boundary='empty' must be one of"):
    sgm.SegmentedOptions(**OPTS, tbptt_boundary="empty")
  # operator level, a long layer: segment 3 restarted == the same chunk as a first segment
  o = sgm.SegmentedOptions(**OPTS)
  mcfg = ModelConfig(family="llama", num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=100.0)
  g = sgm.head_groups(mcfg, o)
  q, k, v = (jax.random.normal(key, (1, 4 * S, n, 8)) for key, n in
             zip(jax.random.split(jax.random.PRNGKey(2), 3), (4, 2, 2)))
  step = jax.jit(functools.partial(sgm.segment_step, config=mcfg, o=o, groups=g,
                                   long_layer=True, impl="reference"))
  st = sgm.init_state(mcfg, o, g, True, 1, 4 * S, jnp.float32)
  ok = jnp.ones((1, S), bool)
  pos = lambda i: jnp.arange(i * S, (i + 1) * S)[None]
  for i in range(3):
    _, st = step(st, q[:, i * S:(i + 1) * S], k[:, i * S:(i + 1) * S], v[:, i * S:(i + 1) * S],
                 pos(i), ok, restart_B=jnp.zeros(1, bool))
  c = slice(3 * S, 4 * S)
  # (restart_B all False: the call signature of the steps above, one compiled step for all)
  first, _ = step(sgm.init_state(mcfg, o, g, True, 1, 4 * S, jnp.float32), q[:, c], k[:, c],
                  v[:, c], pos(0), ok, restart_B=jnp.zeros(1, bool))
  restarted, st2 = step(st, q[:, c], k[:, c], v[:, c], pos(3), ok, restart_B=jnp.ones(1, bool))
  carried, st3 = step(st, q[:, c], k[:, c], v[:, c], pos(3), ok, restart_B=jnp.zeros(1, bool))
  np.testing.assert_allclose(np.asarray(restarted), np.asarray(first), atol=1e-5, rtol=0)
  assert np.abs(np.asarray(carried) - np.asarray(first)).max() > 1e-3
  jax.tree.map(np.testing.assert_array_equal, st2, st3)  # the state transitions as usual


@pytest.mark.slow
def test_segment_mean_loss_is_the_authors_per_segment_mean_through_the_train_step():
  """loss_normalisation='segment_mean' (the authors' trainer): the train step's gradient (in 2
  microbatches) == the gradient of the mean over segments of each segment's
  mean CE over the batch, written here from the definition; on a ragged batch (segments with
  14 / 7 / 6 targets) it differs from the token mean's. One layer: the normalisation is the
  loss's, whatever the depth (the train step's and the reference's compiles grow with it)."""
  import ml_collections
  from condattn_jax.train.step import make_loss_and_grads, token_cross_entropy
  cfg, dp = _dense("llama", layers=1)
  S = OPTS["segment_len"]
  kw = {**OPTS, "long_layers": (), "remat_segments": False}
  scfg, sp = attention.convert(dp, cfg, "segmented", **kw, loss_normalisation="segment_mean")
  T = 3 * S
  rng = np.random.default_rng(3)
  toks = rng.integers(1, 64, (2, T + 1)).astype(np.int32)
  lens = np.asarray([[T], [S + 2]])
  seg_ids = (np.arange(T)[None] < lens).astype(np.int32)
  mask = ((np.arange(T)[None] < lens - 1) & (np.arange(T)[None] % S != 0)).astype(np.int32)
  batch = dict(inputs=toks[:, :T], targets=toks[:, 1:], positions=np.tile(np.arange(T), (2, 1)),
               segment_ids=seg_ids, loss_mask=mask)
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}

  def objectives(p):  # [per-segment mean, token mean]
    logits, _ = sgm.forward(Decoder(scfg), p, batch["inputs"], None, batch["segment_ids"],
                            train=True)
    ce = token_cross_entropy(logits, batch["targets"])[0] * batch["loss_mask"]
    m = batch["loss_mask"].astype(jnp.float32)
    means = [jnp.sum(ce[:, j * S:(j + 1) * S]) / jnp.sum(m[:, j * S:(j + 1) * S])
             for j in range(3)]
    return jnp.stack([sum(means) / 3, jnp.sum(ce) / jnp.sum(m)])

  both = jax.jit(jax.jacrev(objectives))(sp)  # one forward, both gradients
  per_segment, token_mean = (jax.tree.map(lambda g: g[i], both) for i in (0, 1))
  # 2 microbatches of one row each: the weights come from the whole batch (segment 1's targets
  # are all in row 0), so a per-microbatch normalisation would fail here
  tc = ml_collections.ConfigDict(dict(microbatches=2, loss_chunk_size=0, seed=0))
  grads, _ = jax.jit(make_loss_and_grads(scfg, tc))(sp, batch, 0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4), grads,
               per_segment)
  diff = max(float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(per_segment), jax.tree.leaves(token_mean)))
  assert diff > 1e-3, diff
  with pytest.raises(ValueError, match="loss_normalisation='segment' must be one of"):
    sgm.SegmentedOptions(**OPTS, loss_normalisation="segment")
