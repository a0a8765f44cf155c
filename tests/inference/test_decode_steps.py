"""The engine's decode step: the split-layers engine (its default) generates what the stacked
one does; a one-token write into a full cache equals the general
dropping scatter; the unrolled decode's cuts (bookkeeping kept once, one fill a step, the 2-D
o_proj, 2-row projections) decode what the scanned decode and the forward do."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _programs
from _train_helpers import decoder_shapes, random_params
from condattn_jax.inference import Engine
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

S = 32


CFG = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, vocab_size=64, hidden_size=32,
                  intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8)


def _host_params(cfg, seed):
  """Host random params of cfg's init shapes (eval_shape: no init program compiled; norm scales
  1 + N(0, 0.1), other leaves N(0, 0.1): _train_helpers.random_params)."""
  return random_params(decoder_shapes(cfg), seed)


PROMPTS = [[3, 9, 4, 1, 7, 2, 8], [5, 2], [8]]  # ragged: chunked prefill ends mid-chunk


@pytest.fixture(scope="module")
def params():
  return _host_params(CFG, 0)


def test_split_layers_engine_generates_what_the_stacked_engine_does(params):
  """Engine's default (split_layers: each layer's weights arrays of their own, adopted in run
  greedy_split_ab) generates the tokens and logits (1e-6) of an engine stepping on the
  stacked tree, through both decode loops (greedy on the device; kept logits on the host);
  stacked_params() gives the stacked tree back exactly."""
  prompts = PROMPTS  # (and chunks of 4: the split engine's programs are the decode test's)
  stacked = Engine(CFG, params, cache_len=S, prefill_chunk=4, split_layers=False)
  split = Engine(CFG, params, cache_len=S, prefill_chunk=4)
  assert isinstance(split.params["layers"], tuple) and len(split.params["layers"]) == 2
  assert not isinstance(stacked.params["layers"], tuple)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(split.stacked_params()),
               jax.device_get(stacked.params))
  a = stacked.generate(prompts, 5, return_logits=True)
  b = split.generate(prompts, 5, return_logits=True)
  assert a.tokens == b.tokens == split.generate(prompts, 5).tokens
  for x, y in zip(a.logits, b.logits):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["full", "window"])
@pytest.mark.parametrize("B", [1, 3])
def test_one_token_write_equals_the_dropping_scatter(B, kind):
  """A one-token write (one in-place update per array, a dynamic-update-slice at B = 1, a
  scatter of B in-range slots else) leaves the cache, and returns the keys, exactly as the
  general scatter that drops padding (the same token as a 2-token chunk whose second token is
  padding), for ragged fills (a full cache's slots past a row's length hold zeros; a ring that
  wrapped, one empty, one partial) with an inactive row (nothing changes), and its program
  holds no scatter at B = 1 (a one-index scatter is a bounds check + old-value select on
  XLA:GPU)."""
  from condattn_jax.models import layers
  size, K, H = 5, 2, 8
  rng = np.random.default_rng(0)
  length = np.asarray([3 if kind == "full" else 7, 0, 4][:B], np.int32)
  filled = (np.arange(size)[None] < np.minimum(length, size)[:, None])
  cache = dict(key=jnp.asarray(rng.standard_normal((B, size, K, H)) * filled[..., None, None],
                               jnp.float32),
               value=jnp.asarray(rng.standard_normal((B, size, K, H)) * filled[..., None, None],
                                 jnp.float32),
               positions=jnp.asarray(np.where(filled, rng.integers(1, 9, (B, size)), 0),
                                     jnp.int32),
               valid=jnp.asarray(filled, jnp.int32), length=jnp.asarray(length))
  k = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, 1, K, H)), jnp.float32)
  pos = jnp.asarray(length[:, None])
  for valid in ([[True], [False], [True]][:B], [[False]] * B):
    valid = jnp.asarray(valid)

    def write(k=k, v=v, pos=pos, valid=valid):
      return layers.KVCache().apply({"cache": cache}, k, v, pos, valid, kind=kind, size=size,
                                    after_write=True, mutable=["cache"])
    seen, new = jax.jit(write)()
    if B == 1:
      assert "scatter" not in str(jax.make_jaxpr(write)())
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
    ref_seen, ref = write(pad(k), pad(v), pad(pos), pad(valid))  # the dropping scatter
    jax.tree.map(np.testing.assert_array_equal, (seen, new), (ref_seen, ref))
    new = new["cache"]
    np.testing.assert_array_equal(new["length"], length + np.asarray(valid)[:, 0])
    if bool(valid[0, 0]):
      np.testing.assert_array_equal(new["key"][0, length[0] % size], k[0, 0])


@functools.lru_cache(maxsize=None)
def _scanned(cfg):
  """The scanned decode of one chunk, jitted once per config (params an argument: the tests
  that share a config share its compiled programs): (cache, logits of each row's last valid
  token, prev where a row has none)."""
  model = Decoder(cfg)

  @jax.jit
  def scanned(params, cache, tok, posn, valid, prev):
    (logits, _), v = model.apply({"params": params, "cache": cache}, tok, posn,
                                 valid.astype(jnp.int32), decode=True, cache_len=S,
                                 mutable=["cache"])
    n = jnp.sum(valid, 1)
    last = jnp.take_along_axis(logits, jnp.maximum(n - 1, 0)[:, None, None], 1)[:, 0]
    return v["cache"], jnp.where((n > 0)[:, None], last, prev)
  return scanned


def _decode_matches_scanned_and_forward(eng, model, params, prompts, c, l, pos, active, steps):
  """The engine's cache `c` / logits `l` after its chunked prefill of `prompts` (chunks of 4,
  right-padded to 8) == the scanned decode's (`model` = `Decoder` without unroll_layers: every
  layer its own bookkeeping) within 1e-6; then `steps` greedy steps with the rows `active`:
  logits within 1e-6 of the scanned decode's each step, every layer's view of the cache
  (`stacked_cache`) == the scanned decode's cache within 1e-6 and `per_layer_cache` back to the
  engine's structure; the logits == the full forward's at those positions (1e-5).
  Returns (the engine's cache, positions, per_layer_cache(stacked_cache(cache)))."""
  B = len(prompts)
  scanned = functools.partial(_scanned(model.config), params)
  ref_c = eng.stacked_cache(eng.init_cache(B))
  toks = np.zeros((B, 8), np.int32)
  for b, p in enumerate(prompts):
    toks[b, :len(p)] = p
  posn = np.broadcast_to(np.arange(8, dtype=np.int32), (B, 8))
  ref_l = jnp.zeros_like(l)
  for ch in (slice(0, 4), slice(4, 8)):
    ref_c, ref_l = scanned(ref_c, toks[:, ch], posn[:, ch], posn[:, ch] < pos[:, None], ref_l)
  np.testing.assert_allclose(l, ref_l, rtol=1e-6, atol=1e-6)
  seqs = [list(p) for p in prompts]
  want_at, outs = [[len(p) - 1 for p in prompts]], [l]
  for _ in range(steps):
    t = np.asarray(jnp.argmax(l, -1), np.int32)
    c, l = eng.decode_step(c, t, pos, active, l)
    ref_c, ref_l = scanned(ref_c, t[:, None], pos[:, None], active[:, None], ref_l)
    np.testing.assert_allclose(l, ref_l, rtol=1e-6, atol=1e-6)
    for b in np.flatnonzero(active):
      seqs[b].append(int(t[b]))
    pos = pos + active
    want_at.append(list(pos - 1))
    outs.append(l)
  got = eng.stacked_cache(c)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), got, ref_c)
  back = eng.per_layer_cache(got)
  assert jax.tree.structure(back) == jax.tree.structure(c)
  # the full forward over each row's tokens (right-padded), at the positions the logits chose
  n = max(map(len, seqs))
  full = np.zeros((B, n), np.int32)
  for b, q in enumerate(seqs):
    full[b, :len(q)] = q
  seg = (np.arange(n)[None] < np.asarray([len(q) for q in seqs])[:, None]).astype(np.int32)
  fwd, _ = _programs.apply(model.config)(params, full, None, seg)
  for step, (lo, at) in enumerate(zip(outs, want_at)):
    for b in range(B):
      if step == 0 or active[b]:
        np.testing.assert_allclose(lo[b], fwd[b, at[b]], rtol=1e-5, atol=1e-5)
  return c, pos, back


def test_decode_equals_the_scanned_decode_and_the_forward(params):
  """The engine's decode (layers unrolled; a dense model keeps positions / valid / length in
  layers_0 only, the other layers write key / value at its slots; one fill a step for every
  layer; o_proj as a 2-D dot for one token a row; one-row projections padded to 2 rows) ==
  the scanned decode (`Decoder` without unroll_layers: every layer its own bookkeeping and
  fill) on a chunked ragged prefill (chunks of 4) + 3 greedy steps with an inactive row:
  logits and caches (every layer's key / value, its bookkeeping = layer 0's) within 1e-6, and
  the logits == the full forward's at those positions (1e-5). `stacked_cache` views the
  engine's cache in the scanned layout and `per_layer_cache` goes back. The B = 1 step's
  program holds 4 in-place updates in layer 0 and 2 in each later one, the 2-D o_proj dot and
  2-row dots."""
  import re
  eng = Engine(CFG, params, cache_len=S, prefill_chunk=4)
  prompts = PROMPTS
  c, l, pos, _ = eng._prefill([np.asarray(p, np.int32) for p in prompts])
  assert sorted(c["layers_1"]["self_attn"]["cache"]) == ["key", "value"]
  _decode_matches_scanned_and_forward(eng, Decoder(CFG), params, prompts, c, l, pos,
                                      active=np.array([True, False, True]), steps=3)
  i32, one = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
  text = eng._step.lower(eng, eng.params, eng.init_cache(1), i32, i32, one,
                         jnp.zeros((1, CFG.vocab_size))).as_text()
  assert text.count("stablehlo.dynamic_update_slice") == 4 + 2 * (CFG.num_layers - 1)
  assert "(tensor<2x32xf32>, tensor<32x32xf32>) -> tensor<2x32xf32>" in text  # o: [N*H, D]
  assert re.search(r"dot_general.*: \(tensor<2x", text)


L2A = dict(routing="bernoulli", bernoulli_q=0.4, window=4)


@pytest.fixture(scope="module")
def l2a_params():
  import dataclasses
  cfg = dataclasses.replace(CFG, scheme="l2a", scheme_kwargs=tuple(sorted(L2A.items())))
  return _host_params(cfg, 1)


@pytest.mark.parametrize("skip", [True, False], ids=["decode_skip", "noskip"])
def test_l2a_decode_equals_the_scanned_decode_and_the_forward(l2a_params, skip):
  """L2A's engine decode (issue 33's A/B, adopted: the global call's fill read from the full
  cache's length counter; the engine keeping each kind of cache's positions / valid / length
  once, in layers_0: 4 cache leaves a layer + 6) == the scanned decode (`Decoder` without
  unroll_layers: every layer its own bookkeeping) and the full forward, with and without
  decode_skip's per-layer lax.cond (the references: the model without it, L2A's default; the
  skip changes no number, so both engines share their compiled references): a chunked ragged prefill (chunks of 4) + 6 greedy steps,
  one active and one inactive row, over steps where a layer's only active row routes global
  and steps where it routes local (both branches of the skip run): logits within 1e-6 of the
  scanned decode's and 1e-5 of the forward's at those positions, every layer's view of the
  cache (`stacked_cache`) == the scanned decode's cache within 1e-6, `per_layer_cache` back."""
  import dataclasses
  from condattn_jax.attention.l2a.layer import _bernoulli_uniform
  pos_a = jnp.arange(7, 13, dtype=jnp.int32)[None]  # the active row's decode positions
  glob = np.stack([np.asarray(_bernoulli_uniform(jax.random.PRNGKey(0), pos_a, i))[0] < 0.4
                   for i in range(CFG.num_layers)])
  assert glob.any() and not glob.all()
  cfg = dataclasses.replace(CFG, scheme="l2a", scheme_kwargs=tuple(sorted(
      {**L2A, "decode_skip": skip}.items())))
  eng = Engine(cfg, l2a_params, cache_len=S, prefill_chunk=4)
  prompts = [[3, 9, 4, 1, 7, 2, 8], [5, 2]]
  c, l, pos, _ = eng._prefill([np.asarray(p, np.int32) for p in prompts])
  L = CFG.num_layers
  assert len(jax.tree.leaves(c)) == 4 * L + 6  # layers_0: 10 leaves, each later layer key / value x2
  assert sorted(c["layers_1"]["global_attn"]["cache"]) == ["key", "value"]
  ref = Decoder(dataclasses.replace(CFG, scheme="l2a", scheme_kwargs=tuple(sorted(L2A.items()))))
  c, pos, back = _decode_matches_scanned_and_forward(
      eng, ref, l2a_params, prompts, c, l, pos, active=np.array([True, False]), steps=6)
  assert list(pos) == [13, 2]
  jax.tree.map(np.testing.assert_array_equal, back, c)
