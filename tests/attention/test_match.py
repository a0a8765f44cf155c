"""MATCH full forward (docs/schemes/match.md#tests): retrieval geometry and exact match against a numpy
brute force, the per-block fused attention against a dense masked reference (window OR
retrieved chunks), causality, the SWA / sink baselines, layer variants, recompute mode, MiniLM
bi-encoder and reranker plug-ins, options errors."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import match
from condattn_jax.attention.match import layer as match_layer
from condattn_jax.attention.match import retrieval
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

BASE = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, vocab_size=32)


def _model(cfg, seed=0):
  """Params as host (numpy) arrays: conversions regroup layers in numpy (on device arrays each
  eager slice / stack compiles on its own); jit takes them as they are."""
  return host_init(cfg, seed, numpy=True)


def _apply(cfg):
  return jax.jit(Decoder(cfg).apply)


def _tokens(B, T, hi=8, seed=1):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 1, hi)


# ------------------------------------------------------------------------------ retrieval
def _brute_force_ids(tok, seg, c, w, k, ignore=(0,)):
  """numpy: per row and block, the top-k chunks by distinct-query-token overlap (ties: later)."""
  B, T = tok.shape
  G, J = -(-T // c), T // c
  out = np.full((B, G, k), -1)
  for b in range(B):
    for g in range(G):
      s = g * c
      qs = [t for t in range(s - c + 1, s + 1) if t >= 0 and seg[b, t] == seg[b, s]]
      query = {int(tok[b, t]) for t in qs} - set(ignore)
      scored = []
      for j in range(J):
        rows = range(j * c, (j + 1) * c)
        if (j + 1) * c > s - w + 1 or any(seg[b, r] != seg[b, s] for r in rows) or seg[b, s] == 0:
          continue
        score = len(query & {int(tok[b, r]) for r in rows})
        if score > 0:
          scored.append((score, j))
      scored.sort(reverse=True)
      for i, (_, j) in enumerate(scored[:k]):
        out[b, g, i] = j
  return out


@pytest.mark.parametrize("c,w,k,packed", [(2, 8, 4, False), (4, 8, 2, True), (3, 5, 1, False)])
def test_exact_match_retrieval_equals_brute_force(c, w, k, packed):
  T = 45
  tok = np.asarray(_tokens(2, T, hi=12, seed=c))
  seg = np.ones((2, T), np.int32)
  if packed:
    seg[0, 20:] = 2
    seg[1, 40:] = 0
  o = match.MatchOptions(window=w, chunk=c, top_k=k)
  # jitted (block_inputs dispatched op by op compiles every op on its own)
  got = np.asarray(jax.jit(lambda *a: match.block_inputs(o, *a)[1]["match_chunks_BGk"])(
      jnp.asarray(tok), jnp.asarray(np.arange(T)[None].repeat(2, 0)), jnp.asarray(seg)))
  want = _brute_force_ids(tok, seg, c, w, k)
  assert got.shape == want.shape
  for b in range(2):
    for g in range(got.shape[1]):
      assert sorted(got[b, g]) == sorted(want[b, g]), (b, g, got[b, g], want[b, g])
  assert (got >= 0).any()
  # geometry: nothing retrieved before the context exceeds the window; never in the window
  for g in range(got.shape[1]):
    for j in got[:, g].ravel():
      assert j < 0 or (j + 1) * c <= g * c - w + 1


def test_random_retrieval_fills_k_candidates_blind_to_content():
  """retriever='random' (the MQAR control): every block with >= k candidates gets k distinct
  candidates (never in the window, causal), the same ids in a second forward, other ids for
  other query tokens, and ids that do not follow the exact-match ones."""
  T, c, w, k = 64, 2, 8, 4
  tok = _tokens(2, T, hi=12, seed=3)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  o = match.MatchOptions(window=w, chunk=c, top_k=k, retriever="random")
  ids = lambda o, t: np.asarray(jax.jit(
      lambda t: match.block_inputs(o, t, pos)[1]["match_chunks_BGk"])(t))
  got = ids(o, tok)
  assert np.array_equal(got, ids(o, tok))
  for g in range(got.shape[1]):
    n_cand = max(0, (g * c - w + 1) // c)
    row = got[:, g]
    assert ((row >= 0).sum(-1) == min(k, n_cand)).all(), (g, row)
    assert all(len(set(r[r >= 0])) == (r >= 0).sum() for r in row)
    assert ((row < 0) | ((row + 1) * c <= g * c - w + 1)).all()
  other = ids(o, (tok + 1) % 12)
  exact = ids(match.MatchOptions(window=w, chunk=c, top_k=k), tok)
  late = slice(10, None)  # blocks with >> k candidates
  assert (np.sort(got[:, late], -1) != np.sort(other[:, late], -1)).any(-1).mean() > 0.8
  assert (np.sort(got[:, late], -1) != np.sort(exact[:, late], -1)).any(-1).mean() > 0.8


def test_precomputed_retrieval_is_used_as_given():
  o = match.MatchOptions(window=8, chunk=4, top_k=2)
  tok, pos = _tokens(1, 24), jnp.arange(24)[None]
  ids = jnp.asarray([[[-1, -1]] * 4 + [[0, -1], [1, 0]]], jnp.int32)
  aux, f = jax.jit(lambda t, p, i: match.block_inputs(o, t, p, chunks_BGk=i, recompute=True))(
      tok, pos, ids)
  np.testing.assert_array_equal(f["match_chunks_BGk"], ids)
  np.testing.assert_array_equal(aux[0, -8:-4], tok[0, 4:8])  # block 5's first chunk: chunk 1
  with pytest.raises(ValueError, match="match_chunks_BGk.*top_k"):
    match.block_inputs(o, tok, pos, chunks_BGk=ids[..., :1])


def test_mqar_query_key_retrieves_its_pair():
  from condattn_jax.data.synthetic import MQAR
  task = MQAR(seq_len=128, vocab_size=64, num_pairs=8, min_gap=40)
  ex = task.example(0, 3)
  tok = jnp.asarray(ex["inputs"])[None]
  o = match.MatchOptions(window=32, chunk=2, top_k=4)
  ids = np.asarray(jax.jit(lambda t, p: match.block_inputs(o, t, p)[1]["match_chunks_BGk"])(
      tok, jnp.arange(128)[None]))[0]
  qpos = np.flatnonzero(ex["loss_mask"])
  assert len(qpos) == 8
  for t in qpos:  # the query key is at t (the block's first slot): its pair is chunk j = key's
    key = int(ex["inputs"][t])
    j = int(np.flatnonzero(ex["inputs"][:16:2] == key)[0])
    assert j in ids[t // 2], (t, key, ids[t // 2])


# ------------------------------------------------------------------------------ attention
def _dense_block_attend(self, q, k, v, ctx, f, retrieved):
  """The dense masked reference: causal AND same document AND (window OR retrieved chunk)."""
  assert retrieved is None
  o = attention.options(self.config)
  B, T, N, H = q.shape
  pos = ctx.positions_BT
  seg = jnp.ones((B, T), jnp.int32) if ctx.segment_ids_BT is None else ctx.segment_ids_BT
  ids = f["match_chunks_BGk"]
  g_T = jnp.arange(T) // o.chunk
  ret = jnp.any(ids[:, g_T, :, None] == (jnp.arange(T) // o.chunk)[None, None, None, :], axis=2)
  d = pos[:, :, None] - pos[:, None, :]
  m = (d >= 0) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
  m &= (d < o.window) | ret
  kr, vr = (jnp.repeat(x, N // x.shape[2], axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, kr, precision="highest") / np.sqrt(H)
  s = jnp.where(m[:, None], s, -jnp.inf)
  p = jnp.where(m[:, None], jax.nn.softmax(s, axis=-1), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", jnp.nan_to_num(p), vr, precision="highest")


@pytest.fixture(scope="module")
def olmo():
  """OLMo-2 (post-norm, GQA), SWA / SWA / full layers, two packed documents + padding in row 1;
  one jitted forward shared by the tests below (same shapes: one compile)."""
  base = ModelConfig(family="olmo2", num_layers=3, vocab_size=32).replace(qk_norm="full",
                                                                         post_norm=True)
  cfg = attention.configure(base, "match", window=8, chunk=4, top_k=2, swa_ratio=0.7)
  assert match.layer_kinds(cfg) == ("swa", "swa", "full")
  params = _model(cfg)
  tok = _tokens(2, 43)
  seg = np.ones((2, 43), np.int32)
  seg[1, 25:] = 2
  seg[1, 41:] = 0
  pos = np.concatenate([np.arange(25), np.arange(18)])
  pos = np.stack([np.arange(43), np.where(seg[1] == 0, 0, pos)]).astype(np.int32)
  return cfg, params, _apply(cfg), tok, jnp.asarray(pos), jnp.asarray(seg)


def test_fused_blocks_equal_dense_masked_reference(olmo, monkeypatch):
  cfg, params, fwd, tok, pos, seg = olmo
  got, aux = fwd({"params": params}, tok, pos, seg)
  assert float(aux["retrieved"][0]) > 0.2 and float(aux["retrieved"][2]) == 0.0
  monkeypatch.setattr(match_layer.MatchLayer, "_block_attend", _dense_block_attend)
  want, _ = _apply(cfg)({"params": params}, tok, pos, seg)
  live = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=2e-5)
  # and retrieval matters: the same model without retrieval differs
  swa = cfg.replace(scheme_kwargs=dict(cfg.scheme_options, top_k=0))
  other, _ = _apply(swa)({"params": params}, tok, pos, seg)
  assert np.abs(np.asarray(other) - np.asarray(got))[live].max() > 1e-3


def test_causal_including_retrieval(olmo):
  cfg, params, fwd, tok, pos, seg = olmo
  a, _ = fwd({"params": params}, tok, pos, seg)
  b, _ = fwd({"params": params}, tok.at[0, 30].set(7 if tok[0, 30] != 7 else 6), pos, seg)
  np.testing.assert_array_equal(np.asarray(a)[0, :30], np.asarray(b)[0, :30])
  assert np.abs(np.asarray(a)[0, 30:] - np.asarray(b)[0, 30:]).max() > 1e-4
  np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])  # other rows untouched
  # documents: a change in row 1's first document never reaches its second one
  c, _ = fwd({"params": params}, tok.at[1, 3].set(7 if tok[1, 3] != 7 else 6), pos, seg)
  np.testing.assert_array_equal(np.asarray(a)[1, 25:41], np.asarray(c)[1, 25:41])


def test_no_retrieval_is_the_sliding_window_model():
  cfg = attention.configure(BASE, "match", window=8, chunk=4, top_k=0)
  params = _model(cfg)
  tok = _tokens(2, 40)
  got, _ = _apply(cfg)({"params": params}, tok)
  dense = BASE.replace(sliding_window=8)
  want, _ = _apply(dense)({"params": params}, tok)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_sinks_baseline_sees_the_first_tokens():
  cfg = attention.configure(BASE, "match", window=8, chunk=4, top_k=0, sinks=2)
  params = _model(cfg)
  tok = _tokens(1, 40)
  fwd = _apply(cfg)  # one trace for the three rows
  a, _ = fwd({"params": params}, tok)
  b, _ = fwd({"params": params}, tok.at[0, 1].set(7 if tok[0, 1] != 7 else 6))
  assert np.abs(np.asarray(a)[0, 39] - np.asarray(b)[0, 39]).max() > 1e-4  # a sink: visible
  c, _ = fwd({"params": params}, tok.at[0, 5].set(7 if tok[0, 5] != 7 else 6))
  np.testing.assert_array_equal(np.asarray(a)[0, 39], np.asarray(c)[0, 39])  # out of reach


def test_one_layer_recompute_equals_sequence():
  """Layer-0 K/V depend on the token and position only: recomputing them is exact."""
  cfg = attention.configure(BASE.replace(num_layers=1), "match", window=8, chunk=4, top_k=2)
  params = _model(cfg)
  tok = _tokens(2, 40)
  a, _ = _apply(cfg)({"params": params}, tok)
  rc = cfg.replace(scheme_kwargs=dict(cfg.scheme_options, retrieved_kv="recompute"))
  b, _ = _apply(rc)({"params": params}, tok)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  # (deeper layers: an approximation; test_match_inference checks that the modes differ)


def test_dense_params_load_and_convert_back():
  cfg = attention.configure(BASE.replace(num_layers=4), "match", window=8, chunk=4, swa_ratio=0.5)
  assert match.layer_kinds(cfg) == ("swa", "full", "swa", "full")
  dense_p = _model(BASE.replace(num_layers=4))
  mp = match.from_dense(dense_p, cfg)
  assert set(mp) >= {"layers_0_1", "layers_1_2", "layers_2_3", "layers_3_4"}
  dcfg, back = match.to_dense(mp, cfg)
  assert dcfg.scheme == "dense"
  jax.tree.map(np.testing.assert_array_equal, back, dense_p)
  # a pre-sparsified all-SWA model with w >= T and no retrieval is the dense model
  full_w = attention.configure(BASE.replace(num_layers=4), "match", window=64, chunk=4, top_k=0)
  tok = _tokens(1, 40)
  a, _ = _apply(full_w)({"params": match.from_dense(dense_p, full_w)}, tok)
  b, _ = _apply(BASE.replace(num_layers=4))({"params": dense_p}, tok)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_layer_kinds_ratios():
  L28 = BASE.replace(num_layers=28)
  k5 = match.layer_kinds(attention.configure(L28, "match", swa_ratio=0.5))
  assert k5.count("swa") == 14 and k5[1] == "full" and k5[0] == "swa"
  k8 = match.layer_kinds(attention.configure(L28, "match", swa_ratio=0.8))
  assert k8.count("full") == 6 and k8[-1] == "full"
  assert set(match.layer_kinds(attention.configure(L28, "match"))) == {"swa"}


def test_option_errors_name_the_field():
  with pytest.raises(ValueError, match="chunk=16 must be <= window=8"):
    match.MatchOptions(window=8, chunk=16)
  with pytest.raises(ValueError, match="retrieved_kv"):
    match.MatchOptions(retrieved_kv="cached")
  with pytest.raises(ValueError, match="sinks=4 .* top_k=0"):
    match.MatchOptions(sinks=4)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for scheme 'match'"):
    attention.get_scheme("match").parse_options({"windw": 3})
  with pytest.raises(ValueError, match="needs retriever_kwargs tokenizer"):
    retrieval.make_retriever(match.MatchOptions(retriever="minilm"))
  with pytest.raises(ValueError, match=r"prefill_last=-1 must be an int >= 0"):
    match.MatchOptions(prefill_last=-1)
  with pytest.raises(ValueError, match=r"decode_queries=\(64, 64\) must be distinct"):
    match.MatchOptions(decode_queries=(64, 64))
  assert match.MatchOptions(top_k=3, decode_queries=(64, 128)).slots == 6


# ------------------------------------------------------------------------------ plug-ins
WORDS = ["<pad>", "the", "cat", "sat", "on", "mat", "stock", "market", "rallied", "today",
         "kitten", "rug", "shares", "rose", "sharply", "ocean", "waves", "crashed", "shore"]


def test_minilm_bi_encoder_retrieves_the_related_chunk():
  r = retrieval.MiniLMRetriever(tokenizer=lambda ids: " ".join(WORDS[i] for i in ids))
  ix = {w: i for i, w in enumerate(WORDS)}
  ids = lambda s: [ix[w] for w in s.split()]
  chunks = [ids("the cat sat on"), ids("stock market rallied today"), ids("ocean waves crashed shore")]
  filler = ids("the the the the")
  seq = sum(chunks, []) + filler + ids("shares rose sharply today") + filler
  tok = jnp.asarray(seq, jnp.int32)[None]
  # window 8, chunk 4: block 5 (slots 20..23) may retrieve chunks 0..2 (end <= 20 - 8 + 1); its
  # query is slots 17..20: "rose sharply today the"
  o = match.MatchOptions(window=8, chunk=4, top_k=1, retriever="minilm",
                         retriever_kwargs=(("tokenizer", None),))
  retrieval._CACHE[("retriever", "minilm", o.retriever_kwargs)] = r
  _, f = match.block_inputs(o, tok, jnp.arange(len(seq))[None])
  got = np.asarray(f["match_chunks_BGk"])[0]
  assert got[5, 0] == 1, got
  e = r.embed_host(np.asarray(chunks)[None], np.ones((1, 3, 4), bool))
  assert e.shape == (1, 3, 384) and np.allclose(np.linalg.norm(e, axis=-1), 1.0, atol=1e-5)


class LastChunkReranker:
  """Test double of a cross-encoder: prefers the latest chunk (scores = first token's value)."""

  def scores(self, q_tok_Bc, q_ok_Bc, cand_tok_Bkc, cand_ok_Bkc):
    return jnp.where(cand_ok_Bkc[..., 0], cand_tok_Bkc[..., 0].astype(jnp.float32), -1.0)


def test_reranker_keeps_its_best(monkeypatch):
  import sys
  monkeypatch.setitem(sys.modules, "match_rerank_double", sys.modules[__name__])
  o = match.MatchOptions(window=4, chunk=2, top_k=3, reranker="match_rerank_double:LastChunkReranker",
                         rerank_k=1)
  ids = jnp.asarray([[[0, 2, 1]]], jnp.int32)
  chunk_tok = jnp.asarray([[[5, 5], [9, 9], [7, 7]]], jnp.int32)
  q = jnp.zeros((1, 1, 2), jnp.int32)
  kept = retrieval.rerank(o, ids, q, q, chunk_tok, jnp.ones((1, 3), bool))
  assert kept.tolist() == [[[1]]]


# ------------------------------------------------------------ auxiliary rows (recompute mode)
def _reference_layer_call(self, x_BTD, ctx):
  """MatchLayer.__call__ with the attention of every row written as ONE dense boolean mask over
  [query rows ; auxiliary rows] (the rules, not the per-block gather of layer.py):
    query t -> query s   same document, causal on positions, t - s < w in SWA layers
    query t -> aux a     SWA layers with retrieval: a is one of the retrieved chunks of t's
                         block (block = t // c) and t is in that block's document
    aux a -> aux a'      same block, both real, causal on their (real) positions
    aux a -> query s     never
  RoPE at every row's real position; projections, norms and MLP are the layer's own."""
  cfg = self.config
  o = attention.options(cfg)
  f = ctx.fields
  B, T = ctx.positions_BT.shape
  A = x_BTD.shape[1] - T
  R = o.top_k * o.chunk
  swa = self.variant == "swa" and o.top_k > 0
  pos = ctx.positions_BT.astype(jnp.int32)
  seg = ctx.segment_ids_BT.astype(jnp.int32)
  apos, aok = f["match_aux_pos_BA"], f["match_aux_ok_BA"] != 0
  blk_t, blk_a = jnp.arange(T) // o.chunk, jnp.arange(A) // R
  d = pos[:, :, None] - pos[:, None, :]
  mm = (d >= 0) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
  if self.variant == "swa":
    mm &= d < o.window
  doc_blk = seg[:, ::o.chunk][:, blk_t]                                         # [B, T]
  ma = ((blk_t[:, None] == blk_a[None, :])[None] & aok[:, None, :]
        & (seg == doc_blk)[:, :, None] & (seg != 0)[:, :, None] & swa)
  da = apos[:, :, None] - apos[:, None, :]
  aa = ((blk_a[:, None] == blk_a[None, :])[None] & (da >= 0) & aok[:, None, :] & aok[:, :, None])
  m = jnp.concatenate([jnp.concatenate([mm, ma], 2),
                       jnp.concatenate([jnp.zeros((B, A, T), bool), aa], 2)], 1)
  P = jnp.concatenate([pos, apos], 1)
  q, k, v = self.self_attn.project(self._attn_in(x_BTD))
  q, k = self.self_attn.rope(q, P), self.self_attn.rope(k, P)
  N, H = q.shape[2:]
  kr, vr = (jnp.repeat(x, N // x.shape[2], axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, kr, precision="highest") / np.sqrt(H)
  s = jnp.where(m[:, None], s, -jnp.inf)
  p = jnp.where(m[:, None], jax.nn.softmax(s, axis=-1), 0.0)
  out = jnp.einsum("bnts,bsnh->btnh", jnp.nan_to_num(p), vr, precision="highest")
  x = self._mlp_residual(self._attn_residual(x_BTD, self.self_attn.project_out(out)))
  return x, {"retrieved": jnp.zeros((), jnp.float32)}


def test_auxiliary_rows_equal_dense_mask_reference(olmo, monkeypatch):
  """retrieved_kv='recompute' through 3 layers (SWA, SWA, full; post-norm GQA; two packed
  documents + padding): the per-block gathered attention of the query rows and the auxiliary
  rows' own attention equal one dense mask over [queries ; aux rows] in every layer (deeper
  layers are where the aux rows' hidden states matter: layer >= 1 K/V depend on them)."""
  cfg, params, _, tok, pos, seg = olmo
  rc = cfg.replace(scheme_kwargs=dict(cfg.scheme_options, retrieved_kv="recompute"))
  got, aux = _apply(rc)({"params": params}, tok, pos, seg)
  assert float(aux["retrieved"][0]) > 0.2
  monkeypatch.setattr(match_layer.MatchLayer, "__call__", _reference_layer_call)
  want, _ = jax.jit(Decoder(rc).apply)({"params": params}, tok, pos, seg)
  live = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=2e-5)
