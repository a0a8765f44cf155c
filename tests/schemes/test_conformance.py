"""Conformance: every registered scheme with a `Scheme.tiny` factory passes the same checks
through one harness (registering `tiny` is all a new scheme needs):

  to and from dense     `attention.convert` lays params out as the scheme's model does, and the
                        scheme's `to_dense` gives back exactly the dense params (stacked or under
                        a top-level 'params' key)
  generation            `inference.Engine` greedy generation over ragged prompts, one-shot and
                        chunked prefill, equals the forward the scheme declares for serving
                        (`Scheme.serving_forward`; else its training forward) in fp32 to 1e-4,
                        logits and tokens
  cache bytes           the Engine's cache bytes == `Scheme.kv_cache_bytes` at its cache_len,
                        the KVCache bookkeeping words (length / positions / valid) aside
  routing statistics    Generation.stats per row (chunked prefill): L2A's / AHA's routed counts
                        == the full forward's aux counts, prompt and generated apart; MATCH
                        searches once a prefill call and once per block a decode step enters
  packed documents      two documents packed in one row (+ padding) give each document's own
                        outputs, or the scheme declares them refused (`packed_documents=False`)
  aux                   every aux leaf has the layer axis first (model-level entries excepted)
  training              tests/schemes/test_training.py (the tiny recipes: loop and lowering)

The tiny models are built and their Engines compiled once per module (shared fixtures); their
dense starting params are drawn on the host (`host_init_dense`: the init's distributions, no
init program compiled).
The per-row cache insert / reset of continuous batching (`Engine.serve` through 2 slots == this
suite's generation, every scheme; `reset_rows`): tests/schemes/test_serving.py, which runs in
this file's scope (tests/conftest.py SHARED_SCOPE) and reads its module-cached engines and runs.
"""
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _programs
from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.inference import Engine, cache_bytes
from condattn_jax.models.decoder import Decoder

attention._load_builtin()
NAMES = sorted(n for n, s in attention.SCHEMES.items() if s.tiny is not None)
RNG = np.random.default_rng(0)
PROMPTS = [list(map(int, RNG.integers(1, 6, n))) for n in (21, 13, 6)]  # a small alphabet:
NEW = 8                                                  # MATCH's exact retrieval finds chunks
CACHE_LEN = 48
CHUNKS = (None, 4)


def host_init_dense(config, seed=0):
  """`attention.init_dense`'s tree (config's dense base model, unboxed) drawn on the host from
  the init's distributions (_train_helpers.host_init: kernels and embeddings N(0, INIT_STD),
  norm scales 1, biases 0) instead of a jitted init (~1.3 CPU-s of compilation a config)."""
  return host_init(config.replace(scheme="dense", scheme_kwargs=()), seed)


def tiny_params(name, seed=0):
  """Scheme.tiny's (config, make(seed)), the scheme's own conversion of dense params from
  host_init_dense (tests/attention/test_aha_inference.py checks AHA's routing mix on these)."""
  with mock.patch.object(attention, "init_dense", host_init_dense):
    cfg, make = attention.get_scheme(name).tiny()
    return cfg, make(seed)


@functools.lru_cache(maxsize=None)
def tiny(name):
  return tiny_params(name, 0)


@functools.lru_cache(maxsize=None)
def engine(name, chunk):
  cfg, params = tiny(name)
  return Engine(cfg, params, cache_len=CACHE_LEN, prefill_chunk=chunk)


@functools.lru_cache(maxsize=None)
def generated(name, chunk):
  """engine(name, chunk)'s greedy generation of PROMPTS (NEW tokens, logits kept): the
  generation and the routing-statistics checks read one run."""
  return engine(name, chunk).generate(PROMPTS, NEW, return_logits=True)


def _rows(seqs, lengths=None):
  """(tokens, positions, segment ids) of the rows right-padded to the longest (padding: segment
  0); lengths: each row's tokens (the rest of it is padding), default its length."""
  L = max(map(len, seqs))
  tok = np.zeros((len(seqs), L), np.int32)
  seg = np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    n = len(s) if lengths is None else lengths[b]
    tok[b, :n], seg[b, :n] = s[:n], 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  return jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg)


def serving_forward(name, cfg, params, tok, pos, seg, prefill_lengths):
  """The forward the scheme declares generation equals (its training forward by default),
  jitted once per config (tests/_programs.py: both prefill chunkings share its compilation)."""
  assert cfg.scheme == name, (cfg.scheme, name)
  return _programs.serving_forward(cfg)(params, tok, pos, seg,
                                        np.asarray(prefill_lengths, np.int32))


# ---------------------------------------------------------------------------- to and from dense
@pytest.mark.parametrize("name", NAMES)
def test_to_and_from_dense(name):
  import flax.linen as nn
  cfg, _ = attention.get_scheme(name).tiny()
  base = cfg.replace(scheme="dense", scheme_kwargs=())
  tok = jnp.zeros((1, 8), jnp.int32)
  shapes = lambda c: nn.meta.unbox(jax.eval_shape(
      lambda: Decoder(c).init(jax.random.PRNGKey(0), tok)["params"]))
  rng = np.random.default_rng(1)
  dense = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes(base))
  scfg, sp = attention.convert(dense, base, name, **dict(cfg.scheme_kwargs))
  assert scfg == cfg
  # the layout the scheme's model builds (names, stacking, shapes)
  want = jax.tree.map(lambda s: (s.shape, s.dtype), shapes(cfg))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), sp) == want
  s = attention.get_scheme(name)
  if s.to_dense is None:
    return
  for wrap in (False, True):
    dcfg, dp = s.to_dense({"params": sp} if wrap else sp, cfg)
    dp = dp["params"] if wrap else dp
    assert dcfg.scheme == "dense" and dcfg.num_layers == cfg.num_layers
    assert jax.tree_util.tree_structure(dp) == jax.tree_util.tree_structure(dense)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dense)):
      np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", NAMES)
def test_generation_equals_the_declared_forward(name, chunk):
  cfg, params = tiny(name)
  eng = engine(name, chunk)
  gen = generated(name, chunk)
  assert [len(t) for t in gen.tokens] == [NEW] * len(PROMPTS)
  seqs = [p + g[:-1] for p, g in zip(PROMPTS, gen.tokens)]
  first = eng.chunk_for(max(map(len, PROMPTS))) if chunk is None else chunk
  prefill = [min(len(p), first) for p in PROMPTS]
  full, _ = serving_forward(name, cfg, params, *_rows(seqs), prefill)
  for b, p in enumerate(PROMPTS):
    want = np.asarray(full[b, len(p) - 1:len(seqs[b])])
    np.testing.assert_allclose(gen.logits[b], want, atol=1e-4, rtol=0)
    assert gen.tokens[b] == list(want.argmax(-1))


# -------------------------------------------------------------------------- routing statistics
ROUTED_COUNTS = {"l2a": "global_tokens_B", "aha": "full_BN"}  # the aux's per-layer counts


@pytest.mark.parametrize("name", NAMES)
def test_greedy_on_device_equals_the_host_loop(name, monkeypatch):
  """Engine.generate greedy without kept logits (Engine._greedy_on_device: ids fed back on the
  device, the host reads them once) == the host loop (return_logits=True) in tokens, finish
  reasons, steps and both parts' statistics (its ids buffer of 2 steps copied out and reused);
  with stop tokens that end every row by its third token the same (the done flags read every 2
  steps: the loop ends early, after steps with no row active, which count for nothing). A scheme with host fields for its steps (Elastic,
  MATCH) takes the host loop when a stop token may end a row."""
  gen, eng = generated(name, 4), engine(name, 4)
  stop = tuple(sorted({t[2] for t in gen.tokens}))   # every row ends by its third token
  monkeypatch.setattr(Engine, "GREEDY_CHECK_EVERY", 2)
  monkeypatch.setattr(Engine, "GREEDY_IDS_BLOCK", 2)  # the ids buffer copied out, reused
  for kw, want in (({}, gen), ({"stop_tokens": stop},
                               eng.generate(PROMPTS, NEW, stop_tokens=stop, return_logits=True))):
    got = eng.generate(PROMPTS, NEW, **kw)
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, kw
    assert got.steps == want.steps and got.logits is None
    for g, w in zip(got.stats, want.stats):
      for k, (a, b) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(w))):
        np.testing.assert_allclose(a, b, atol=1e-6, err_msg=f"{name} {kw} leaf {k}")
      assert jax.tree.structure(g) == jax.tree.structure(w)
  assert set(want.finish_reason) == {"stop_token"} and want.steps <= 2


@pytest.mark.parametrize("name", sorted(ROUTED_COUNTS))
def test_routing_stats_equal_the_full_forwards_counts(name):
  """Generation.stats (chunked prefill: chunks of 4, rows ending mid-chunk): per row and layer,
  the prompt's tokens and routed fraction (L2A: tokens routed global; AHA: full-attention usage
  per head) == the full forward's aux counts over the prompt / len(prompt), and the generated
  tokens' (the NEW - 1 fed back) == the forward over prompt + generated minus the prompt's;
  the fractions are a real mix (the check can tell the paths apart). The forward: the
  generation check's program (the same rows, right-padded to the same length)."""
  cfg, params = tiny(name)
  count = ROUTED_COUNTS[name]
  gen = generated(name, 4)
  seqs = [p + g[:-1] for p, g in zip(PROMPTS, gen.tokens)]
  n = max(map(len, seqs))
  aux = lambda rows: jax.device_get(_programs.apply(cfg)(params, *_rows(
      [r + [0] * (n - len(r)) for r in rows], lengths=[len(r) for r in rows]))[1])
  prompt, both = aux(PROMPTS), aux(seqs)
  L = cfg.num_layers
  for b, p in enumerate(PROMPTS):
    st = gen.stats[b]
    np.testing.assert_allclose(st["prompt"]["tokens"], [len(p)] * L)
    np.testing.assert_allclose(st["prompt"][count], prompt[count][:, b] / len(p), atol=1e-6)
    np.testing.assert_allclose(st["generated"]["tokens"], [NEW - 1] * L)
    np.testing.assert_allclose(st["generated"][count],
                               (both[count][:, b] - prompt[count][:, b]) / (NEW - 1), atol=1e-6)
  frac = np.stack([s["prompt"][count] for s in gen.stats])
  assert frac.shape[1] == L and 0 < frac.mean() < 1


def test_match_stats_count_one_search_per_block_entered():
  """MATCH's module stats (Generation.stats[...]['scheme'], chunked prefill in calls of 4): a
  decode step searches (and recomputes the retrieved K/V) only when the row's token enters a
  new block (positions p with p % chunk == 0); every prefill call searches; the chunks read
  per call are at most the retrieval slots, and some are read (a real retrieval)."""
  cfg, _ = tiny("match")
  o = attention.options(cfg)
  gen = generated("match", 4)
  read = 0.0
  for b, p in enumerate(PROMPTS):
    pr, ge = gen.stats[b]["prompt"]["scheme"], gen.stats[b]["generated"]["scheme"]
    assert pr["calls"] == pr["searches_B"] == -(-len(p) // 4)
    fed = range(len(p), len(p) + len(gen.tokens[b]) - 1)
    assert ge["calls"] == len(fed) == NEW - 1
    assert ge["searches_B"] == sum(q % o.chunk == 0 for q in fed)
    assert 0 <= ge["retrieved_B"] <= ge["calls"] * o.slots
    read += ge["retrieved_B"]
  assert read > 0


# --------------------------------------------------------------------------------- cache bytes
def _bookkeeping_bytes(cache) -> int:
  """Bytes of the engine's KVCache bookkeeping (the int32 length / positions / valid words of
  every ring and full cache), which the schemes' analytic counts leave out."""
  n = 0
  for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
    keys = [getattr(p, "key", None) for p in path]
    if len(keys) >= 2 and keys[-2] == "cache" and keys[-1] in ("length", "positions", "valid"):
      n += x.size * x.dtype.itemsize
  return n


@pytest.mark.parametrize("name", NAMES)
def test_engine_cache_bytes_equal_kv_cache_bytes(name):
  cfg, _ = tiny(name)
  s = attention.get_scheme(name)
  eng = engine(name, 4)
  for batch in (1, 3):
    cache = eng.init_cache(batch)
    want = s.kv_cache_bytes(cfg, CACHE_LEN, batch=batch)["total"]
    assert cache_bytes(cache) - _bookkeeping_bytes(cache) == want, (name, batch)


# ---------------------------------------------------------------------------- packed documents
@functools.lru_cache(maxsize=None)
def apply_fn(name):
  """(tokens, positions, segment_ids) -> the decoder's (logits, aux), jitted once per scheme
  (the packed-documents and aux checks share its compilation)."""
  cfg, params = tiny(name)
  f = _programs.apply(cfg)
  return lambda t, pos, seg: f(params, t, pos, seg)


A, B = PROMPTS[0][:11], PROMPTS[1][:7]
FWD_LEN = max(map(len, PROMPTS)) + NEW - 1  # the generation check's forward rows: [3, FWD_LEN]


def _doc_rows(*docs):
  """One row: the documents packed (segments 1, 2, ..., positions restarting at 0 in each),
  then padding (segment 0) to FWD_LEN."""
  tok = [t for d in docs for t in d]
  pos = [i for d in docs for i in range(len(d))]
  seg = [k + 1 for k, d in enumerate(docs) for _ in d]
  pad = [0] * (FWD_LEN - len(tok))
  return tok + pad, pos + pad, seg + pad


# rows: A and B packed, A alone, B alone (rows never attend to each other): one call, at the
# shapes of the generation check's forward (the schemes whose declared forward is the decoder's
# apply share its program)
PACKED = tuple(jnp.asarray(x, jnp.int32) for x in zip(_doc_rows(A, B), _doc_rows(A), _doc_rows(B)))


@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_are_independent(name):
  cfg, params = tiny(name)
  s = attention.get_scheme(name)
  if not s.packed_documents:
    pytest.skip(f"scheme {name!r} declares packed_documents=False (one document per row)")
  if s.forward is None:
    run = lambda *x: apply_fn(name)(*x)[0]
  else:
    run = jax.jit(lambda t, p, g: s.forward(Decoder(cfg), params, t, p, g)[0])
  out = np.asarray(run(*PACKED))
  assert PACKED[2][0, len(A)] == 2 and out.shape[:2] == (3, FWD_LEN)
  for row, doc, lo in ((1, A, 0), (2, B, len(A))):  # each document alone in its own row
    np.testing.assert_allclose(out[0, lo:lo + len(doc)], out[row, :len(doc)], atol=1e-5)


# ---------------------------------------------------------------------------------------- aux
@pytest.mark.parametrize("name", NAMES)
def test_aux_leaves_have_the_layer_axis_first(name):
  cfg, _ = tiny(name)
  _, aux = apply_fn(name)(*PACKED)
  for key, leaf in jax.tree_util.tree_flatten_with_path(
      {k: v for k, v in aux.items() if k != "scheme"})[0]:
    assert leaf.shape[:1] == (cfg.num_layers,), (name, jax.tree_util.keystr(key), leaf.shape)
