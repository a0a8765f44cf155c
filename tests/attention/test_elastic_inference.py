"""Elastic inference: the decision is made once (the first cached call: the prompt, or the first
chunk) and cached in the layer's cache collection, equal to the full forward's decision with
prompt_lengths = the pooled tokens, with a real FA / SSA mix; the per-row generation stats hold
that decision and the decode's skipped pairs. Greedy generation over ragged prompts (one-shot
and chunked) == that full forward: tests/schemes/test_conformance.py."""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.inference import Engine
from condattn_jax.models.decoder import Decoder

# the longest prompt is 24 = 6 blocks of 4: the one-shot prefill runs per-block lists (block_q =
# block); decode steps run per-query lists (block_q = 1): tests/schemes
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 12, 200, 31, 8, 14, 15, 16, 1, 2, 3, 4, 9, 9, 30, 31, 44, 45],
           [9, 1, 4, 8, 8, 100, 101, 7, 6, 5, 4, 3, 2],
           [250, 251, 3, 3, 60, 61, 62, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]]
SMALL = dict(block=4, sinks=4, local=8, boundary=3)


@pytest.fixture(scope="module")
def tiny():
  """Elastic's tiny model (Scheme.tiny: the conformance suite's, its dense params drawn on the
  host as there: test_conformance.host_init_dense), made once for the module."""
  from condattn_jax.attention import get_scheme
  with mock.patch.object(attention, "init_dense", lambda c, seed=0: host_init(
      c.replace(scheme="dense", scheme_kwargs=()), seed)):
    cfg, make = get_scheme("elastic").tiny()
    return cfg, make(0)


def _full_forward(cfg, params, seqs, pooled):
  L = max(map(len, seqs))
  tok = np.zeros((len(seqs), L), np.int32)
  seg = np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  full, aux = jax.jit(Decoder(cfg).apply)(
      {"params": params}, tok, pos, seg, fields={"prompt_lengths": np.asarray(pooled, np.int32)})
  return full, np.asarray(aux["fa_BK"])


def test_prefill_decides_once_like_the_full_forward(tiny):
  """The decision cached by the prefill (the first cached call) is the full forward's with
  prompt_lengths = the prompt; a real FA / SSA mix; SSA heads matter (the control). Generation
  == that full forward (ragged, one-shot and chunked) is tests/schemes/test_conformance.py on
  Elastic's tiny model, the same model as here."""
  cfg, params = tiny
  assert dict(cfg.scheme_kwargs) == {**SMALL, "seed": 5}
  eng = Engine(cfg, params, cache_len=32)
  cache, _, _ = eng.prefill(PROMPTS)
  cache = eng.stacked_cache(cache)  # one cache per layer, viewed with a leading layer axis
  decided = np.asarray(cache["layers"]["elastic_decision"])[..., 0]      # [L, B, K]
  np.testing.assert_array_equal(cache["layers"]["elastic_decided"], 1)
  full, fa = _full_forward(cfg, params, PROMPTS, [len(p) for p in PROMPTS])
  np.testing.assert_array_equal(decided, fa)
  assert 0 < fa.mean() < 1
  # control: SSA heads matter here (every head FA gives other logits), so the check can fail
  full_fa, _ = _full_forward(attention.configure(cfg, "elastic", routing="fa"), params, PROMPTS,
                             [len(p) for p in PROMPTS])
  assert float(jnp.abs(full_fa - full).max()) > 1e-3


def test_engine_says_what_it_cannot_serve_as_trained(tiny):
  """A prefill chunk shorter than the prompt decides on the first chunk, and XA is not run over
  the cache: the engine says each once (a warning naming the fix); one-shot FA-SSA prefill says
  nothing."""
  import warnings
  from condattn_jax.attention import get_scheme
  cfg, params = tiny
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    Engine(cfg, params, cache_len=32).prefill(PROMPTS)           # one shot, fa_ssa: silent
  chunked = Engine(cfg, params, cache_len=32, prefill_chunk=4)
  with pytest.warns(UserWarning, match=r"prefill chunk 4 < the prompt's \d+ tokens.*"
                                       r"prefill_chunk=None"):
    chunked.prefill(PROMPTS)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    chunked.prefill(PROMPTS)                                     # once per engine
  notes = get_scheme("elastic").layer_cls.serving_notes
  xcfg = attention.configure(cfg, "elastic", modes="fa_xa", xa_stride=2)
  assert notes(xcfg, 24, 24) == ()                              # one shot, block-aligned
  assert len(notes(xcfg, 8, 24)) == 2 and "runs XA heads full" in notes(xcfg, 8, 24)[1]


@pytest.mark.parametrize("modes", ["fa_xa", "xa_ssa"])
def test_served_xa_runs_xa_at_prefill_like_the_full_forward(tiny, modes):
  """One-shot prefill (the longest prompt, 24 tokens, a multiple of block 4) through the engine
  runs XA heads on their XA lists: its last-token logits == the full forward's (prompt_lengths =
  the prompt); the control: the same prefill with every XA head full differs."""
  cfg, params = tiny
  xcfg = attention.configure(cfg, "elastic", modes=modes, xa_stride=2, xa_threshold=0.5)
  _, logits, lengths = Engine(xcfg, params, cache_len=32).prefill(PROMPTS)
  full, fa = _full_forward(xcfg, params, PROMPTS, [len(p) for p in PROMPTS])
  assert 0 < fa.mean() < 1
  last = np.stack([np.asarray(full)[b, n - 1] for b, n in enumerate(lengths)])
  np.testing.assert_allclose(np.asarray(logits), last, atol=2e-4, rtol=0)
  # control: XA heads run full (the old serving) give other logits, so the check can fail
  dense = attention.configure(xcfg, "elastic", xa_threshold=1.0)
  fulld, _ = _full_forward(dense, params, PROMPTS, [len(p) for p in PROMPTS])
  lastd = np.stack([np.asarray(fulld)[b, n - 1] for b, n in enumerate(lengths)])
  assert np.abs(lastd - last).max() > 1e-3


def test_elastic_stats_hold_each_rows_cached_per_head_mode(tiny):
  """Elastic's fa_BK (no token count: a per-row value) is the mean over the steps that ran
  the row: the mode decided at the prefill, equal to the full forward's decision, for the prompt
  and the generated tokens alike; its decode rho_BN (the causal pairs an SSA head skips) equals
  the count from the sinks + local rule, 0 for FA heads."""
  from _train_helpers import decoder_shapes, random_params
  cfg, _ = tiny
  base = cfg.replace(scheme="dense", scheme_kwargs=())  # the tiny's make on host random params
  _, params = attention.convert(random_params(decoder_shapes(base), 3), base, "elastic",
                                **dict(cfg.scheme_kwargs))  # (N(0, 0.1): every row has SSA heads)
  r = params["layers"]["router"]["router_fc3"]  # a sharpened router: a real FA / SSA mix
  r["kernel"] = r["kernel"] * 300.0
  ROWS = PROMPTS  # the shapes of test_prefill_decides_once_like_the_full_forward: its programs
  # the host loop (kept logits): its steps are the decided-fact test's programs (the on-device
  # loop's statistics equal the host loop's: tests/schemes/test_conformance.py)
  gen = Engine(cfg, params, cache_len=32).generate(ROWS, 5, return_logits=True)
  _, fa_LBK = _full_forward(cfg, params, ROWS, [len(p) for p in ROWS])
  assert 0 < fa_LBK.mean() < 1  # a real FA / SSA mix
  for b in range(len(ROWS)):
    for part in ("prompt", "generated"):
      np.testing.assert_array_equal(gen.stats[b][part]["fa_BK"], fa_LBK[:, b])
  # decode rho: per generated token at position p, an SSA head sees the keys j <= p in the sink
  # blocks (j < ceil(sinks / block) * block) or the local blocks (j // block > p // block -
  # max(local // block, 1)), out of p + 1; FA heads skip nothing; averaged over the steps
  o = attention.options(cfg)
  n_sink, n_local = -(-o.sinks // o.block), max(o.local // o.block, 1)
  G = cfg.num_heads // cfg.num_kv_heads
  for b, p0 in enumerate(len(r) for r in ROWS):
    rho_p = []
    for p in range(p0, p0 + 4):  # the 4 generated tokens fed back
      j = np.arange(p + 1)
      seen = ((j < n_sink * o.block) | (j // o.block > p // o.block - n_local)).sum()
      rho_p.append(1 - seen / (p + 1))
    ssa_LN = np.repeat(fa_LBK[:, b] < 0.5, G, axis=1)
    np.testing.assert_allclose(gen.stats[b]["generated"]["rho_BN"],
                               np.where(ssa_LN, np.mean(rho_p), 0.0), atol=1e-6)
    assert gen.stats[b]["generated"]["rho_BN"].max() > 0.1  # past the sinks + local window


def test_decode_steps_with_the_engine_s_decided_fact_equal_the_router_path(tiny):
  """Ragged decode after a prefill: the engine tells each one-token step that every active row
  has decided (ElasticLayer.decode_fields, host positions > 0); that step reads the cached
  decision and runs no pooling and no router (6 fewer dots a layer in the lowered program).
  Logits and every cache leaf equal the router path's (the fact unknown) at every step; a step
  told 'decided' for a row that has not decided (a fresh cache) is refused: NaN logits for that
  row only."""
  cfg, params = tiny
  eng = Engine(cfg, params, cache_len=32)
  cache, logits, lengths = eng.prefill(PROMPTS)
  B = len(PROMPTS)
  pos, on = np.asarray(lengths, np.int32), np.asarray([True, False, True])
  step = lambda c, t, p, lg, sf: eng._step(eng.params, c, jnp.asarray(t)[:, None],
                                           jnp.asarray(p)[:, None], jnp.asarray(on)[:, None],
                                           lg, static_fields=sf)
  for _ in range(3):
    tok = np.asarray(logits).argmax(-1).astype(np.int32)
    sf = eng._decode_fields(pos, on)
    assert sf == (("elastic_step_decided", True),)
    ref_cache, ref_logits, ref_aux = step(jax.tree.map(jnp.copy, cache), tok, pos, logits, ())
    cache, logits, aux = step(cache, tok, pos, logits, sf)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
    for (path, r), x in zip(jax.tree_util.tree_flatten_with_path(ref_cache)[0],
                            jax.tree.leaves(cache)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(r), err_msg=jax.tree_util.keystr(path))
    for name in ("fa_BK", "p_fa_BK", "rho_BN"):  # the routing statistics the engine returns
      np.testing.assert_allclose(np.asarray(aux[name]), np.asarray(ref_aux[name]), atol=1e-6)
    pos = pos + on
  # the cached probability is the deciding call's: the full forward's p_FA over the prompt
  assert 0 < np.asarray(aux["p_fa_BK"]).min() and np.asarray(aux["p_fa_BK"]).max() < 1
  # row 1 emptied (reset_rows: no decision), the fact says every row has decided: row 1's
  # logits NaN (refused), the others as the router path gives them
  tok = np.asarray(logits).argmax(-1).astype(np.int32)
  reset = eng.reset_rows(cache, [False, True, False])
  on = np.ones(B, bool)
  _, ref, _ = step(jax.tree.map(jnp.copy, reset), tok, pos, logits, ())
  _, wrong, _ = step(jax.tree.map(jnp.copy, reset), tok, pos, logits,
                     (("elastic_step_decided", True),))
  wrong, ref = np.asarray(wrong), np.asarray(ref)
  assert np.isnan(wrong[1]).all() and np.isfinite(ref[1]).all()
  np.testing.assert_allclose(wrong[[0, 2]], ref[[0, 2]], atol=1e-5, rtol=0)
  assert eng._decode_fields(np.asarray([3, 0, 5]), np.ones(3, bool)) == (
      ("elastic_step_decided", False),)
  # the programs the steps above ran (the same arguments: jit's lowerings, not new ones)
  args = (eng.params, reset, jnp.asarray(tok)[:, None], jnp.asarray(pos)[:, None],
          jnp.asarray(on)[:, None], logits)
  dots = lambda sf: Engine._step.lower(eng, *args, static_fields=sf).as_text().count(
      "stablehlo.dot_general")
  # the router's five dense layers a layer and the pooling's dot: 6 fewer a layer
  assert dots(()) - dots((("elastic_step_decided", True),)) == 6 * cfg.num_layers
