"""MATCH served as the paper pins it (docs/schemes/match.md#inference): the engine's prefill
retrieves only for the blocks of the last m = prefill_last prompt positions (earlier prompt
blocks: the window only), generation (one-shot and chunked prefill, ragged rows) equals the
declared serving forward with that m, m really changes the forward, a prefill call builds
auxiliary rows for at most ceil(m / c) + 1 blocks instead of every block it touches, and runs
them only in the calls that hold a retrieving block."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import match
from condattn_jax.inference import Engine
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.decoder import Decoder

RNG = np.random.default_rng(3)
PROMPTS = [list(RNG.integers(1, 6, 29)), list(RNG.integers(1, 6, 22)), list(RNG.integers(1, 6, 9))]
# the generation tests' batch: PROMPTS + a 4th row, as wide as serve's 4 slots (the chunk-5
# engine's prefill and decode programs at 4 rows are shared with test_serve_with_padding_rows_...)
ROWS = PROMPTS + [list(RNG.integers(1, 6, 14))]
NEW = 7
M = 4  # prefill_last: blocks holding the last 4 prompt positions retrieve


def _cfg(layers=3, **kw):
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=layers, vocab_size=16)
  return attention.configure(base, "match", **{**dict(window=6, chunk=3, top_k=2, swa_ratio=0.7,
                                                      prefill_last=M), **kw})


@pytest.fixture(scope="module")
def model():
  cfg = _cfg()
  params = host_init(cfg, 0)
  return cfg, params


@pytest.fixture(scope="module")
def model2():
  """A 2-layer model (SWA + retrieval, full) for the tests whose checks are each SWA layer's or
  the model's (their step programs grow with the depth)."""
  cfg = _cfg(layers=2)
  assert match.layer_kinds(cfg) == ("swa", "full")
  return cfg, host_init(cfg, 0)


def _rows(seqs):
  L = max(map(len, seqs))
  tok, seg = np.zeros((len(seqs), L), np.int32), np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  return tok, np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape), seg


@functools.lru_cache(maxsize=None)
def _serving_fn(cfg):
  """The declared serving forward of cfg, jitted once per config (calls with inputs of the same
  shapes share its trace)."""
  return jax.jit(lambda p, t, po, sg, pl: match.serving_forward(Decoder(cfg), p, t, po, sg, None,
                                                                prompt_lengths_B=pl)[0])


def _serving(cfg, params, seqs, prompt_lengths):
  """The declared serving forward (jitted) with each row's prompt length."""
  return _serving_fn(cfg)(params, *_rows(seqs), np.asarray(prompt_lengths, np.int32))


@pytest.fixture(scope="module")
def generated(model):
  """Engine.generate(ROWS, NEW) in 5-token prefill calls over 3-token blocks, with logits."""
  cfg, params = model
  return Engine(cfg, params, cache_len=48, prefill_chunk=5).generate(ROWS, NEW,
                                                                     return_logits=True)


def test_generation_equals_the_serving_forward_with_last_m_retrieval(model, generated):
  """Chunked prefill (5-token chunks over 3-token blocks: calls that hold several blocks, and
  blocks split across calls); one-shot prefill with the default m is the conformance suite's
  match case, and one call's auxiliary rows for the last m blocks are
  test_prefill_builds_aux_rows_for_the_last_m_blocks_only."""
  cfg, params = model
  gen = generated
  seqs = [p + g[:-1] for p, g in zip(ROWS, gen.tokens)]
  full = np.asarray(_serving(cfg, params, seqs, [len(p) for p in ROWS]))
  for b, p in enumerate(ROWS):
    want = full[b, len(p) - 1:len(seqs[b])]
    np.testing.assert_allclose(gen.logits[b], want, atol=1e-4, rtol=0)
    assert gen.tokens[b] == list(want.argmax(-1))


def test_last_m_changes_the_forward_only_before_the_last_m(model, generated):
  """The serving forward with m = 4 differs from the every-block forward (m >= the prompt) on
  the prompt's early blocks (they lose their retrieved chunks) and equals it before any block
  has a candidate; with m = 0 no block ending before the prompt's end retrieves. The sequences:
  the generation test's (ROWS and their generated tokens: its m = 4 serving program)."""
  cfg, params = model
  seqs = [p + g[:-1] for p, g in zip(ROWS, generated.tokens)]
  P = [len(p) for p in ROWS]
  last_m = np.asarray(_serving(cfg, params, seqs, P))
  every = np.asarray(_serving(_cfg(prefill_last=1000), params, seqs, P))
  early = slice(9, 21)  # row 0: blocks 3..6 have candidates (window 6) and end before P - m = 25
  assert np.abs(last_m[0, early] - every[0, early]).max() > 1e-3
  np.testing.assert_allclose(last_m[0, :7], every[0, :7], atol=1e-5)  # no candidates yet
  # m = 0: only the generated tokens' blocks (and the block holding the prompt's end) retrieve
  o0 = match.MatchOptions(window=6, chunk=3, top_k=2, prefill_last=0)
  ids = jax.jit(lambda t, po, pl: match.block_inputs(o0, t, po, prompt_len_B=pl)[1][
      "match_chunks_BGk"])(*_rows(seqs)[:2], np.asarray(P))
  blocks = np.nonzero((np.asarray(ids)[0] >= 0).any(-1))[0]
  assert blocks.size and blocks.min() * 3 + 2 >= P[0]


def test_prefill_builds_aux_rows_for_the_last_m_blocks_only():
  """A one-shot prefill call of 29 tokens (chunk 3, top_k 2): 11 blocks; with m = 4 only
  ceil(4 / 3) + 1 = 3 blocks get auxiliary rows (18 rows instead of 66), mapped to the blocks
  holding positions >= 25 - 2."""
  cfg = _cfg()
  o = match.MatchOptions(window=6, chunk=3, top_k=2, prefill_last=M)
  tok = jnp.asarray([PROMPTS[0]], jnp.int32)
  pos = jnp.arange(29, dtype=jnp.int32)[None]
  ctx = LayerContext(tokens_BT=tok, positions_BT=pos, segment_ids_BT=jnp.ones_like(tok),
                     fields={"prompt_len_B": jnp.asarray([29])}, decode=True, cache_len=48)
  mod = match.MatchInputs(cfg)
  run = jax.jit(lambda t, c: mod.init_with_output(jax.random.PRNGKey(0), t, c)[0])
  aux_BA, f, _ = run(tok, ctx)
  assert aux_BA.shape == (1, 3 * 2 * 3)
  idx = np.asarray(f["match_aux_block_BG"])[0]
  assert list(np.nonzero(idx >= 0)[0]) == [8, 9, 10] and list(idx[8:]) == [0, 1, 2]
  ids = np.asarray(f["match_chunks_BGk"])[0]
  assert (ids[:8] < 0).all() and (ids[8:] >= 0).any()
  # without the prompt lengths (a caller that passes none): every block, 11 * 6 rows
  aux_all, f_all, _ = run(tok, ctx.replace(fields={}))
  assert aux_all.shape == (1, 11 * 2 * 3) and "match_aux_block_BG" not in f_all
  np.testing.assert_array_equal(np.asarray(f_all["match_chunks_BGk"])[0, 8:], ids[8:])
  assert o.prefill_last == M


def test_multi_query_decode_search_is_served_and_counted(model2):
  """decode_queries=(2, 5): a block entered at decode searches with the 2 and the 5 tokens
  ending at its first token (2 kept chunks each, duplicates dropped: 4 slots); generation
  (chunked prefill, ragged rows) equals the serving forward, which uses the multi-query ids on
  the blocks decode enters only (prompt positions: the single-query forward's logits); where
  the multi-query ids differ from the single query's, the logits differ; the engine's cache
  bytes equal kv_cache_bytes (4-slot retrieved-K/V cache and ids). Two layers (SWA + retrieval,
  full): the decode search is the model's, once for every layer (the step programs, 7 here,
  grow with the depth)."""
  from condattn_jax.inference import cache_bytes
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(1, 15, 29)), list(rng.integers(1, 15, 23))]
  _, params = model2
  cfg = _cfg(layers=2, decode_queries=(2, 5))
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=5)
  gen = eng.generate(prompts, NEW, return_logits=True)
  seqs = [p + g[:-1] for p, g in zip(prompts, gen.tokens)]
  P = [len(p) for p in prompts]
  full = np.asarray(_serving(cfg, params, seqs, P))
  for b, p in enumerate(prompts):
    np.testing.assert_allclose(gen.logits[b], full[b, len(p) - 1:len(seqs[b])], atol=1e-4, rtol=0)
  single = np.asarray(_serving(_cfg(layers=2), params, seqs, P))
  tok, pos, _ = _rows(seqs)
  ids = lambda c: np.asarray(jax.jit(lambda t, po, pl: match.block_inputs(
      attention.options(c), t, po, prompt_len_B=pl)[1]["match_chunks_BGk"])(tok, pos, np.asarray(P)))
  multi_ids, single_ids = ids(cfg), ids(_cfg(layers=2))
  assert multi_ids.shape[-1] == attention.options(cfg).slots == 4
  differ = []
  for b in range(len(seqs)):
    np.testing.assert_allclose(full[b, :P[b]], single[b, :P[b]], atol=1e-5)
    for g in range(-(-P[b] // 3), -(-len(seqs[b]) // 3)):  # blocks entered at decode
      m = multi_ids[b, g][multi_ids[b, g] >= 0]
      assert len(set(m)) == len(m)
      if set(m) != set(single_ids[b, g][single_ids[b, g] >= 0]):
        differ.append((b, g))
        assert np.abs(full[b, 3 * g:3 * g + 3] - single[b, 3 * g:3 * g + 3]).max() > 1e-4
  assert differ
  cache = eng.init_cache(2)
  book = sum(x.size * x.dtype.itemsize for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]
             if [getattr(p, "key", None) for p in path][-2:] in (["cache", "length"],
                                                                 ["cache", "positions"],
                                                                 ["cache", "valid"]))
  assert cache_bytes(cache) - book == match.kv_cache_bytes(cfg, 48, batch=2)["total"]


def test_prefill_call_holds_one_cond_a_layer_and_no_per_block_kv_outside_it(model):
  """Chunked prefill in 12-token calls (5 blocks of 3 a call, 3 aux blocks mapped to the last 3:
  match_aux_block_BG is not the identity) then decode: logits equal the serving forward's,
  including the decode steps that reuse the retrieved K/V the last prefill call stored
  (RetrievedCache, read off the aux blocks through the map). The compiled prefill program holds
  one conditional a layer (the aux rows with the attention over their K/V, or SWA's attention;
  on a GPU each is a predicate read on the host: two a layer cost twice the waits; the last
  layer's aux rows feed nothing, so its cond is dropped), and its
  jaxpr builds no per-block [B, G, R, K, H] K/V outside a cond (the calls that do not retrieve
  pay no such copy)."""
  from jax.extend.core import jaxprs_in_params
  cfg, params = model
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=12)
  gen = eng.generate(ROWS, NEW, return_logits=True)   # ROWS: the serving forward's program of
  seqs = [p + g[:-1] for p, g in zip(ROWS, gen.tokens)]   # the generation test
  full = np.asarray(_serving(cfg, params, seqs, [len(p) for p in ROWS]))
  for b, p in enumerate(ROWS):
    np.testing.assert_allclose(gen.logits[b], full[b, len(p) - 1:len(seqs[b])], atol=1e-4, rtol=0)

  B, C = 1, 12
  sds = jax.ShapeDtypeStruct
  args = (eng.params, eng.cache_shapes(B), sds((B, C), jnp.int32), sds((B, C), jnp.int32),
          sds((B, C), jnp.bool_), sds((B, cfg.vocab_size), jnp.float32), sds((B,), jnp.int32))
  traced = Engine._step.trace(eng, *args)  # one trace for the compiled program and the jaxpr
  hlo = traced.lower().compile().as_text()
  # one a layer, bar the last layer's aux rows, which no later layer reads (XLA drops them)
  assert hlo.count(" conditional(") == cfg.num_layers - 1
  o = attention.options(cfg)
  G, R = -(-(C + o.chunk - 1) // o.chunk), o.top_k * o.chunk
  per_block = (B, G, R, cfg.num_kv_heads, cfg.head_dim)
  seen = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      seen.extend(tuple(v.aval.shape) for v in eqn.outvars)
      if eqn.primitive.name == "cond":
        continue
      for sub in jaxprs_in_params(eqn.params):
        walk(sub)
  walk(traced.jaxpr.jaxpr)
  assert seen and per_block not in seen, per_block


def _prefill_on(eng, fields=None, monkeypatch=None):
  """eng.prefill(PROMPTS[:2]) (cache, logits), its calls' static fields replaced by `fields`
  (None: the engine's own; () the unknown path, else a dict every call gets)."""
  if fields is not None:
    monkeypatch.setattr(Engine, "_prefill_fields",
                        lambda self, *a: tuple(sorted(dict(fields).items())))
  cache, logits, _ = eng.prefill(PROMPTS[:2])
  monkeypatch.undo() if fields is not None else None
  return jax.device_get(cache), np.asarray(logits)


def test_prefill_with_the_engine_s_static_fact_equals_the_cond_path(model2, monkeypatch):
  """Chunked ragged prefill (29 / 22 tokens in 5-token calls, m = 4): the engine tells each
  call whether one of its blocks retrieves (host geometry, MatchLayer.prefill_fields), and
  the calls that do not compile to SWA's call, the one that does to its branch without a cond.
  The logits and every cache leaf equal the path where the fact is unknown (one nn.cond a
  layer, decided on the device), also when the fact says 'retrieves' for every call (the data
  then retrieves nothing in most: the retrieving branch must give what the other one does).
  A call marked non-retrieving that does retrieve is refused (NaN logits), never silently run
  without its retrieval. At most two programs for the chunk shape."""
  cfg, params = model2
  C = 5
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=C)
  lengths = np.asarray([len(p) for p in PROMPTS[:2]])
  facts = [dict(eng._prefill_fields(c, C, lengths))["match_call_retrieves"]
           for c in range(0, 30, C)]
  # row 1's block 18..20 (positions 15..19), row 0's 24..26, and a finished row's blocks
  # (start >= its length) retrieve as MatchInputs has them
  assert facts == [False, False, False, True, True, True], facts
  before = Engine._step._cache_size()
  cache, logits = _prefill_on(eng)
  assert Engine._step._cache_size() - before == 2  # a non-retrieving and a retrieving program
  ref_cache, ref_logits = _prefill_on(eng, (), monkeypatch)
  every_call, every_logits = _prefill_on(eng, {"match_call_retrieves": True}, monkeypatch)
  for got, got_cache in ((logits, cache), (every_logits, every_call)):
    np.testing.assert_allclose(got, ref_logits, atol=1e-4, rtol=0)
    leaves = jax.tree_util.tree_flatten_with_path(ref_cache)[0]
    assert len(leaves) == len(jax.tree.leaves(got_cache))
    for (path, ref), x in zip(leaves, jax.tree.leaves(got_cache)):
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(ref, np.float64),
                                 atol=1e-4, rtol=0, err_msg=jax.tree_util.keystr(path))
  # the stored retrieved K/V are not all zeros (the comparison above reads real values)
  assert any(np.abs(np.asarray(c["retrieved_cache"]["key"])).max() > 0
             for n, c in cache.items() if n.startswith("layers_") and "retrieved_cache" in c)
  _, wrong = _prefill_on(eng, {"match_call_retrieves": False}, monkeypatch)
  assert np.isnan(wrong).all(axis=1).all(), "a retrieving call run as SWA's must be refused"


def test_decode_steps_with_the_engine_s_static_fact_equal_the_cond_path(model2):
  """Ragged decode (rows at 29.. and 22.., blocks of 3): the engine tells each one-token step
  whether an active row enters a block (MatchLayer.decode_fields, host positions); the steps
  that do compile to the refreshing step, the others to the step reusing the block's retrieved
  K/V, both without a conditional (the unknown path holds one a layer plus the search's: each
  a predicate read on the host on a GPU). Logits and every cache leaf equal the unknown path's
  at every step; a step told 'enters no block' while a row does is refused (NaN logits)."""
  cfg, params = model2
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=5)
  cache, logits, lengths = eng.prefill(PROMPTS[:2])
  pos, on = np.asarray(lengths, np.int32), np.ones(2, bool)
  step = lambda c, t, p, lg, sf: eng._step(eng.params, c, jnp.asarray(t)[:, None],
                                           jnp.asarray(p)[:, None], jnp.asarray(on)[:, None],
                                           lg, static_fields=sf)
  facts = []
  for _ in range(7):
    tok = np.asarray(logits).argmax(-1).astype(np.int32)
    sf = eng._decode_fields(pos, on)
    facts.append(dict(sf)["match_step_enters"])
    ref_cache, ref_logits, _ = step(jax.tree.map(jnp.copy, cache), tok, pos, logits, ())
    cache, logits, _ = step(cache, tok, pos, logits, sf)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
    for (path, r), x in zip(jax.tree_util.tree_flatten_with_path(ref_cache)[0],
                            jax.tree.leaves(cache)):
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(r, np.float64),
                                 atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    pos = pos + 1
  assert facts == [False, True, True, False, True, True, False], facts
  tok = np.asarray(logits).argmax(-1).astype(np.int32)
  assert (pos % 3 == 0).any()  # (pos 36: row 0 enters a block)
  _, wrong, _ = step(jax.tree.map(jnp.copy, cache), tok, pos, logits,
                     (("match_step_enters", False),))
  assert np.isnan(np.asarray(wrong)).all(), "a step entering a block run as reuse: refused"
  # the programs the steps above ran (the same arguments: jit's compiled programs, not new ones)
  args = (eng.params, cache, jnp.asarray(tok)[:, None], jnp.asarray(pos)[:, None],
          jnp.asarray(on)[:, None], logits)
  conds = lambda sf: Engine._step.lower(eng, *args, static_fields=sf).compile().as_text().count(
      " conditional(")
  assert conds((("match_step_enters", True),)) == conds((("match_step_enters", False),)) == 0
  assert conds(()) >= 2


def _dot_flops(mlir: str) -> int:
  """2 * prod(out) * prod(contracted lhs dims), summed over the module's dot_generals."""
  import re
  total = 0
  for line in mlir.splitlines():
    if "stablehlo.dot_general" not in line:
      continue
    cd = re.search(r"contracting_dims = \[([\d, ]*)\] x", line)
    sig = re.search(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", line)
    dims = lambda t: [int(d) for d in t[len("tensor<"):-1].split("x")[:-1]]
    lhs, out = dims(sig.group(1)), dims(sig.group(3))
    total += 2 * int(np.prod(out)) * int(np.prod([lhs[int(i)] for i in cd.group(1).split(",")]))
  return total


def test_prefill_call_known_not_to_retrieve_is_swa_s_program(model2):
  """One 5-token prefill call of 2 rows (SWA + retrieval, full; the chunk shape whose three
  programs test_prefill_with_the_engine_s_static_fact_equals_the_cond_path runs): with the
  engine's fact 'retrieves nothing' the compiled step holds 0 conditionals (SWA's: 0; unknown:
  num_layers - 1, each a predicate read on the host on a GPU) and, exported for cuda, the dot
  FLOPs and kernels (custom calls) of SWA's call (no aux rows); with 'retrieves' 0
  conditionals and more dot FLOPs (the aux rows)."""
  import re
  from jax.sharding import AbstractDevice, AbstractMesh
  cfg, params = model2
  swa = Engine(_cfg(layers=2, top_k=0), params, cache_len=48, prefill_chunk=5)
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=5)
  B, C = 2, 5
  sds = jax.ShapeDtypeStruct
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))

  def program(e, fact, cuda=True):
    chunk = (sds((B, C), jnp.int32), sds((B, C), jnp.int32), sds((B, C), jnp.bool_))
    args = (e.params, e.cache_shapes(B), *chunk, sds((B, cfg.vocab_size), jnp.float32),
            sds((B,), jnp.int32))
    sf = () if fact is None else (("match_call_retrieves", fact),)
    # compiled with the argument placement of Engine.prefill's calls (cache, logits and prompt
    # lengths on the params' device): the programs the prefill of the static-fact test ran
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          (e.init_cache(B), e._commit(jnp.zeros((B, cfg.vocab_size))),
                           e._commit(jnp.zeros((B,), jnp.int32))))
    conds = Engine._step.lower(e, e.params, placed[0], *chunk, *placed[1:],
                               static_fields=sf).compile().as_text().count(" conditional(")
    if not cuda:
      return conds
    with jax.sharding.use_abstract_mesh(mesh):
      t = Engine._step.trace(e, *args, static_fields=sf).lower(
          lowering_platforms=("cuda",)).as_text()
    return conds, _dot_flops(t), sorted(re.findall(r"stablehlo.custom_call @(\w+)", t))

  ref = program(swa, None)
  assert ref[0] == 0 and ref[1] > 0
  assert program(eng, False) == ref
  on = program(eng, True)
  assert on[0] == 0 and on[1] > ref[1]
  assert program(eng, None, cuda=False) == cfg.num_layers - 1


def test_serve_with_padding_rows_equals_generation(model, generated):
  """Engine.serve admits 3 prompts into 4 rows (one padding row of prompt length 0, which holds
  no chunk to retrieve: the host's fact leaves it out, and so does the refusal) in 5-token
  prefill calls: each request's tokens are what generate gives it (its row of the `generated`
  batch, which test_generation_equals_the_serving_forward_with_last_m_retrieval checks against
  the serving forward; that batch's 4th row makes it as wide as the 4 slots: one set of
  programs)."""
  cfg, params = model
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=5)
  assert not dict(eng._prefill_fields(0, 5, [len(PROMPTS[1]), 0]))["match_call_retrieves"]
  got = eng.serve(PROMPTS, NEW, slots=4)
  assert got.tokens == generated.tokens[:len(PROMPTS)], got.tokens


def test_prefill_loop_reads_nothing_back_and_compiles_nothing_new(model2, monkeypatch):
  """Engine.prefill's calls (chunked, ragged: non-retrieving and retrieving calls) only enqueue
  work: after a first prefill compiled the step's programs, a second one converts no device
  value on the host (int / bool / float / item / tolist / np.asarray through __array__ /
  device_get go through ArrayImpl._value; block_until_ready) and compiles no program (the
  static fields hit the same jit entries). On a GPU such a read blocks the host until the call
  ran and the next dispatch waits on it. (np.asarray of a CPU array reads its buffer directly,
  past this probe; a cond's predicate read is a GPU runtime's: the conditional counts of
  test_prefill_call_known_not_to_retrieve_is_swa_s_program.)"""
  from jax._src import array as jax_array
  cfg, params = model2
  eng = Engine(cfg, params, cache_len=48, prefill_chunk=5)
  _, want, _ = eng.prefill(PROMPTS[:2])
  want = np.asarray(want)
  before = Engine._step._cache_size()

  def refuse(*_, **__):
    raise AssertionError("a device value read on the host inside Engine.prefill")
  with monkeypatch.context() as m:
    m.setattr(jax_array.ArrayImpl, "_value", property(refuse))
    m.setattr(jax_array.ArrayImpl, "block_until_ready", refuse)
    m.setattr(jax, "device_get", refuse)
    m.setattr(jax, "block_until_ready", refuse)
    with pytest.raises(AssertionError, match="read on the host"):  # the probe sees a read
      bool(jnp.asarray(1) > 0)
    _, got, _ = eng.prefill(PROMPTS[:2])
  assert Engine._step._cache_size() == before
  np.testing.assert_array_equal(np.asarray(got), want)


def test_call_aux_blocks_covers_every_retrieving_block_with_a_query():
  """The engine's static aux-block count of a retrieving prefill call (inputs.call_aux_blocks:
  ceil(m / c), or the bound ceil(m / c) + 1 where a row needs it): over random ragged calls,
  the aux window aux_blocks places with it holds every block of every row that holds one of
  the row's prompt tokens of the call and retrieves, as the bound's window does (what the
  queries read is the same); at bench/match_ttft.py's sizes (32K, m = 1000, c = 128, the last
  4096-token call) 8 blocks, not the bound's 9 (the 9th: the block the first generated token
  enters, which no prompt query reads)."""
  from condattn_jax.attention.match import inputs
  rng = np.random.default_rng(0)
  for c, m in ((3, 4), (4, 24), (128, 1000), (5, 5)):
    o = attention.options(_cfg(chunk=c, window=max(6, c), prefill_last=m))
    for _ in range(300):
      T = int(rng.integers(2, 40)) * (c if rng.random() < 0.5 else 1)
      start = int(rng.integers(0, 12)) * T
      P = rng.integers(0, start + 2 * T + m, size=int(rng.integers(1, 4)))
      if not inputs.call_retrieves(o, start, T, P):
        continue
      G = inputs.num_blocks(T, c, decode=True)
      Ga = inputs.call_aux_blocks(o, start, T, P)
      assert Ga in (-(-m // c), -(-m // c) + 1)
      start_G = (start // c) * c + np.arange(G) * c
      _, g_aux = inputs.aux_blocks(o, G, P, start_G[0], np, Ga=Ga)
      need = ((start_G[None] < np.minimum(start + T, P)[:, None]) & (P[:, None] > 0)
              & inputs.block_retrieves(o, start_G[None], P))
      for b in range(len(P)):
        assert set(np.flatnonzero(need[b])) <= set(g_aux[b]), (c, m, T, start, P, b)
  o = attention.options(_cfg(chunk=128, window=2048, prefill_last=1000, top_k=4))
  assert inputs.call_aux_blocks(o, 28672, 4096, [32768]) == 8
  assert inputs.aux_blocks(o, 33, np.asarray([32768]), 28672, np)[0] == 9
