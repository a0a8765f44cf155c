"""AHA inference: greedy generation over ragged prompts equals one full forward per row (fp32,
1e-4) with a real mix of full / local heads on a GQA qwen3 without decode_skip (OLMo-2, one-shot
and chunked, with decode_skip: tests/schemes/test_conformance.py on AHA's tiny model, whose mix
is checked here);
ONE full KV cache per layer, as large as the scheme's analytic count; routed-local heads read
only the window of it; tau is a test-time knob of the served model."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import aha
from condattn_jax.inference import Engine, cache_bytes
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 12, 200, 31, 8], [9, 1, 4], [250, 251, 3, 3, 60, 61, 62]]
NEW = 6
FAMILIES = {"qwen3": dict(qk_norm="head"), "olmo2": dict(qk_norm="full", post_norm=True)}


@functools.lru_cache(maxsize=None)
def _dense(family):
  """The dense model's (config, params), built once per family (attention.convert copies); the
  params drawn on the host from the init's distributions (host_init: no init program)."""
  cfg = ModelConfig(family=family, num_layers=3).replace(**FAMILIES[family])
  return cfg, host_init(cfg, 3)


def _aha(family="olmo2", **kw):
  cfg, dp = _dense(family)
  acfg, ap = attention.convert(dp, cfg, "aha", **{"window": 4, **kw})
  r = ap["layers"]["router"]  # a random router: a real mix of full / local heads
  r["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(0), r["kernel"].shape)
  r["bias"] = jnp.zeros_like(r["bias"])
  return acfg, ap


@functools.lru_cache(maxsize=None)
def _gated_forward(cfg):
  """(params, tokens, positions, segment_ids) -> (logits, the gates [L, B, T, N]) of Decoder(cfg),
  jitted once per config (the same shapes share its program)."""
  def run(params, tok, pos, seg):
    (full, _), st = Decoder(cfg).apply({"params": params}, tok, pos, seg,
                                       mutable=["intermediates"])
    return full, st["intermediates"]["layers"]["gate"][0]
  return jax.jit(run)


def _rows(seqs):
  """Right-padded rows (tokens, positions, segment ids; padding = segment 0)."""
  L = max(map(len, seqs))
  tok = np.zeros((len(seqs), L), np.int32)
  seg = np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  return tok, np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape), seg


def _full_forward(cfg, params, gen):
  """One full forward over prompt + generated tokens (right-padded, padding = segment 0)."""
  seqs = [prompt + gen.tokens[b][:-1] for b, prompt in enumerate(PROMPTS)]
  tok, pos, seg = _rows(seqs)
  full, gate = _gated_forward(cfg)(params, tok, pos, seg)
  return seqs, full, np.asarray(gate), seg


def _check(cfg, params, gen):
  seqs, full, gate, seg = _full_forward(cfg, params, gen)
  for b, prompt in enumerate(PROMPTS):
    want = np.asarray(full[b, len(prompt) - 1:len(seqs[b])])
    np.testing.assert_allclose(gen.logits[b], want, atol=1e-4, rtol=0)
    assert gen.tokens[b] == list(want.argmax(-1))
  return gate, seg


@pytest.mark.parametrize("family,chunk,skip", [("qwen3", 4, False)])  # olmo2, skip: tests/schemes
def test_generation_equals_full_forward_ragged(family, chunk, skip):
  cfg, params = _aha(family, decode_skip=skip)
  gen = Engine(cfg, params, cache_len=32, prefill_chunk=chunk).generate(
      PROMPTS, NEW, return_logits=True)
  assert [len(t) for t in gen.tokens] == [NEW] * len(PROMPTS)
  gate, seg = _check(cfg, params, gen)
  g = gate[:, seg.astype(bool)]  # [L, tokens, N]
  assert 0.2 < g.mean() < 0.8  # both paths really served
  assert (g.any(-1) & ~g.all(-1)).mean() > 0.3  # heads of one token disagree often


def test_the_conformance_models_routing_is_a_real_mix(monkeypatch):
  """tests/schemes checks generation on AHA's tiny model (OLMo-2, chunked and one-shot, with
  decode_skip; its dense params from host_init: test_conformance.tiny_params): its routing
  really serves both paths there."""
  from condattn_jax.attention import get_scheme
  monkeypatch.setattr(attention, "init_dense", lambda c, seed=0: host_init(
      c.replace(scheme="dense", scheme_kwargs=()), seed))  # test_conformance.host_init_dense
  cfg, make = get_scheme("aha").tiny()
  params = make(0)
  seqs = [p + [1, 2, 3, 4, 5] for p in PROMPTS]  # the shapes of _full_forward's rows
  tok, pos, seg = _rows(seqs)
  g = np.asarray(_gated_forward(cfg)(params, tok, pos, seg)[1])[:, seg.astype(bool)]  # [L, tok, N]
  assert 0.2 < g.mean() < 0.8  # both paths really served
  assert (g.any(-1) & ~g.all(-1)).mean() > 0.3  # heads of one token disagree often


def test_one_full_cache_per_layer_and_its_bytes():
  cfg, params = _aha()
  eng = Engine(cfg, params, cache_len=32)
  cache, _, lengths = eng.prefill(PROMPTS)
  layers = eng.stacked_cache(cache)["layers"]
  assert set(layers) == {"self_attn"} and set(layers["self_attn"]) == {"cache"}  # one cache
  c = layers["self_attn"]["cache"]
  assert c["key"].shape == (cfg.num_layers, len(PROMPTS), 32, cfg.num_kv_heads, cfg.head_dim)
  np.testing.assert_array_equal(c["length"], np.broadcast_to(lengths, c["length"].shape))
  kv = aha.kv_cache_bytes(cfg, 32, batch=len(PROMPTS))["total"]
  assert kv <= cache_bytes(cache) <= 1.5 * kv
  with pytest.raises(ValueError, match="routing='soft'"):
    Engine(attention.configure(cfg, "aha", routing="soft"), params, cache_len=32).prefill(PROMPTS)


def test_local_heads_read_only_the_window():
  """Every head local: K/V older than the window may hold anything; decoding is unchanged."""
  cfg, params = _aha(routing="none")
  eng = Engine(cfg, params, cache_len=32)
  cache, logits, lengths = eng.prefill(PROMPTS)
  cache = eng.stacked_cache(cache)  # one cache per layer, viewed with a leading layer axis
  c = cache["layers"]["self_attn"]["cache"]
  old = c["positions"] < (lengths[None, :, None] - 3)  # outside the window of the next token (w=4)
  assert old.any()
  bad = jax.tree.map(lambda x: x, cache)
  for name in ("key", "value"):
    bad["layers"]["self_attn"]["cache"][name] = jnp.where(old[..., None, None], 1e3, c[name])
  tok = np.asarray(logits).argmax(-1)
  cache, bad = eng.per_layer_cache(cache), eng.per_layer_cache(bad)
  ok_out = eng.decode_step(jax.tree.map(jnp.copy, cache), tok, lengths, np.ones(3, bool), logits)[1]
  bad_out = eng.decode_step(bad, tok, lengths, np.ones(3, bool), logits)[1]
  np.testing.assert_allclose(bad_out, ok_out, atol=1e-5, rtol=0)
  # ... and the same corruption does change the learned-routing model (a real mix of full and
  # local heads: the conformance tiny's construction, test_the_conformance_models_routing_
  # is_a_real_mix), on the engine of test_one_full_cache_per_layer_and_its_bytes and the
  # branch-free test (their programs)
  full_eng = Engine(_aha()[0], params, cache_len=32)
  cache, logits, _ = full_eng.prefill(PROMPTS)
  cache = full_eng.stacked_cache(cache)
  bad = jax.tree.map(lambda x: x, cache)
  for name in ("key", "value"):
    bad["layers"]["self_attn"]["cache"][name] = jnp.where(
        old[..., None, None], 1e3, cache["layers"]["self_attn"]["cache"][name])
  cache, bad = full_eng.per_layer_cache(cache), full_eng.per_layer_cache(bad)
  ok_out = full_eng.decode_step(jax.tree.map(jnp.copy, cache), tok, lengths, np.ones(3, bool),
                                logits)[1]
  bad_out = full_eng.decode_step(bad, tok, lengths, np.ones(3, bool), logits)[1]
  assert float(jnp.abs(bad_out - ok_out).max()) > 1e-2


def test_tau_is_a_serving_knob():
  """The served model's full-head usage falls as tau rises (tau configured on the trained
  params: 0.4 vs 0.6), measured on the forward's gates over the prompts + 5 tokens. The router's
  gate (s > tau) is one code path for the forward and the engine's prefill / decode, and the
  engine's generation == the forward on this model (OLMo-2, window 4, chunked and one-shot) is
  tests/schemes/test_conformance.py's AHA case (tau is a threshold constant of that path)."""
  cfg, params = _aha()
  tok, pos, seg = _rows([p + [1, 2, 3, 4, 5] for p in PROMPTS])
  usage = []
  for tau in (0.4, 0.6):
    gate = np.asarray(_gated_forward(attention.configure(cfg, "aha", tau=tau))(
        params, tok, pos, seg)[1])
    usage.append(gate[:, seg.astype(bool)].mean())
  assert usage[0] > usage[1] + 0.05



def test_branch_free_step_equals_the_skipping_step_and_reads_per_head():
  """The engine's one-token step (both attention calls, no lax.cond) == the previous step under
  decode_skip's lax.cond (decode_skip_steps=True: bench/decode_program's 'stepskip'), cache
  and logits, on a model whose heads of one token disagree; and old K/V outside the window
  changes the output through the kv heads of full query heads but never through those of local
  ones (a swapped mode or a wrong window fails)."""
  cfg, params = _aha(decode_skip=True)
  r = params["layers"]["router"]   # static routing: the query heads of even kv heads full
  G = cfg.num_heads // cfg.num_kv_heads
  full_K = np.arange(cfg.num_kv_heads) % 2 == 0
  r["kernel"] = jnp.zeros_like(r["kernel"])
  r["bias"] = jnp.broadcast_to(jnp.where(np.repeat(full_K, G), 2.0, -2.0),
                               r["bias"].shape).astype(r["bias"].dtype)
  outs, conds = {}, {}
  for skip in (False, True):
    eng = Engine(attention.configure(cfg, "aha", decode_skip_steps=skip), params, cache_len=32)
    cache, logits, lengths = eng.prefill(PROMPTS)
    tok = np.asarray(logits).argmax(-1)
    step = jax.make_jaxpr(eng.decode_step)(cache, tok, lengths, np.ones(3, bool), logits)
    conds[skip] = str(step).count(" cond[")   # the step's own program
    outs[skip] = eng.decode_step(cache, tok, lengths, np.ones(3, bool), logits)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), outs[True],
               outs[False])
  assert conds[True] - conds[False] == 2 * cfg.num_layers   # the local and full calls' conds
  eng = Engine(cfg, params, cache_len=32)
  cache, logits, lengths = eng.prefill(PROMPTS)
  tok = np.asarray(logits).argmax(-1)
  stacked = eng.stacked_cache(cache)
  c = stacked["layers"]["self_attn"]["cache"]
  old = c["positions"] < (lengths[None, :, None] - 3)   # outside the next token's window (w=4)
  ok = eng.decode_step(eng.per_layer_cache(jax.tree.map(jnp.copy, stacked)), tok, lengths,
                       np.ones(3, bool), logits)[1]
  for heads, changes in ((~full_K, False), (full_K, True)):
    bad = jax.tree.map(lambda x: x, stacked)
    hit = old[..., None, None] & jnp.asarray(heads)[None, None, None, :, None]   # kv heads
    for name in ("key", "value"):
      bad["layers"]["self_attn"]["cache"][name] = jnp.where(hit, 1e3, c[name])
    out = eng.decode_step(eng.per_layer_cache(bad), tok, lengths, np.ones(3, bool), logits)[1]
    assert (float(jnp.abs(out - ok).max()) > 1e-2) == changes
