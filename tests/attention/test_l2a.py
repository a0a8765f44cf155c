"""L2A: exactness against the base model, forced-global, STE gradient, decode, pruning, schedule."""
import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import get_scheme, l2a
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.decoder import Decoder

FAMILIES = {
    "llama": dict(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8)),
    "qwen2": dict(attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(qk_norm="head"),
}
B, T = 2, 16


def _dense(family, seed=2):
  cfg = ModelConfig(family=family).replace(**FAMILIES[family])
  tok = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, cfg.vocab_size)
  # host (numpy) params: the conversions, (un)stacking and router draws below stay numpy (on
  # device arrays each eager jnp op of theirs compiles on its own); jit takes them as they are
  params = host_init(cfg, seed, numpy=True)
  if cfg.attention_bias:  # non-zero biases, so copying them is tested too
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x, params)
  return cfg, params, tok


@functools.lru_cache(maxsize=None)
def _jitted(model, method, kw):
  """jax.jit of model.<method> with the static keywords kw (a sorted tuple of items), one per
  (model config, method, kw) for the module: a model applied again (another test, other inputs
  of the same shapes) reuses its compilation instead of tracing a new partial."""
  return jax.jit(functools.partial(getattr(model, method), **dict(kw)))


def _apply(model, params, *args, rngs=None, **kw):
  """model.apply({'params': params}, *args, rngs=rngs, **kw) jitted (eager apply dispatches op
  by op); rngs are traced, the other keywords static."""
  kw = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))
  return _jitted(model, "apply", kw)({"params": params}, *args, rngs=rngs)


def _per_layer(params):
  return jax.tree.map(lambda x: x, stacking.unstack_layers(params))


def _random_router(params, scale=0.05, seed=0):
  """A random router kernel per layer (stacked params in, stacked params out)."""
  per = _per_layer(params)
  variants = []
  for i in range(stacking.num_layers_of(per)):
    variants.append("global" if "router" in per[f"layers_{i}"] else "pruned")
    if "router" in per[f"layers_{i}"]:
      k = per[f"layers_{i}"]["router"]["kernel"]
      per[f"layers_{i}"]["router"]["kernel"] = np.asarray(scale * jax.random.normal(
          jax.random.PRNGKey(seed + i), k.shape, k.dtype))
  return stacking.stack_layers(per, variants)


def _decisions(state):
  """[L_live, B, T] hard decisions sown by the L2A layers, in layer order."""
  inter = state["intermediates"]
  groups = sorted((k for k in inter if "decision" in inter[k]),
                  key=lambda k: 0 if k == "layers" else int(k.split("_")[1]))
  return np.concatenate([np.asarray(inter[k]["decision"][0]) for k in groups])


# The conversion copies the same attention / MLP leaves for every family: qwen2 (kept biases,
# tied embeddings) and qwen3 (q/k norm) by default, llama (rope scaling only) `manual`; default
# cover of llama: the qwen2 / qwen3 cases and tests/schemes/test_conformance.py::
# test_to_and_from_dense[l2a]
CONVERSION_FAMILIES = [pytest.param(f, marks=pytest.mark.manual if f == "llama" else ())
                       for f in sorted(FAMILIES)]


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
def test_global_disabled_full_window_equals_base(family):
  cfg, dp, tok = _dense(family)
  base, _ = _apply(Decoder(cfg), dp, tok)
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=T, routing="none")
  out, aux = _apply(Decoder(lcfg), lp, tok)
  np.testing.assert_allclose(out, base, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(aux["sparsity"], 1.0)
  # the same through pruning every layer, and through the reverse conversion
  pcfg = attention.configure(lcfg, "l2a", routing="learned", pruned_layers=range(cfg.num_layers))
  pp = l2a.prune_params(lp, range(cfg.num_layers))
  out, _ = _apply(Decoder(pcfg), pp, tok)
  np.testing.assert_allclose(out, base, atol=1e-5, rtol=0)
  # the reverse conversion: the base params exactly, as a dense model with the L2A window (T
  # here: the full causal mask, so the base model; a window w >= T masks nothing: dense
  # attention's own tests)
  dcfg, back = l2a.to_dense(lp, lcfg)
  assert dcfg.scheme == "dense" and dcfg.sliding_window == T
  assert jax.tree.structure(back) == jax.tree.structure(dp)
  jax.tree.map(np.testing.assert_array_equal, back, dp)


@pytest.mark.parametrize("family", CONVERSION_FAMILIES)
def test_router_on_window0_equals_base_through_global_branch(family):
  cfg, dp, tok = _dense(family)
  base, _ = _apply(Decoder(cfg), dp, tok)
  for routing in ("all", "learned"):  # zero-init router: p = 0.5 >= theta, every token global
    lcfg, lp = attention.convert(dp, cfg, "l2a", window=0, routing=routing)
    # scramble the local branch: with window 0 it must not matter
    lp = jax.tree.map(lambda x: x, lp)
    lp["layers"]["self_attn"] = jax.tree.map(lambda x: 3.0 * x + 1.0, lp["layers"]["self_attn"])
    out, aux = _apply(Decoder(lcfg), lp, tok)
    np.testing.assert_allclose(out, base, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(aux["sparsity"], 0.0)


def test_converted_params_layout_and_registry():
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4, pruned_layers=(1,))
  assert get_scheme("l2a").from_dense is l2a.from_dense
  assert sorted(k for k in lp if k.startswith("layers")) == ["layers_0_1", "layers_1_2"]
  per = stacking.unstack_layers(lp)
  l0, l1 = per["layers_0"], per["layers_1"]
  assert set(l0) == {"input_layernorm", "self_attn", "global_layernorm", "router", "global_attn",
                     "post_attention_layernorm", "mlp"}
  assert "global_attn" not in l1 and "router" not in l1
  np.testing.assert_array_equal(l0["router"]["kernel"], 0.0)
  for a, b in zip(jax.tree.leaves(l0["global_attn"]),
                  jax.tree.leaves(stacking.unstack_layers(dp)["layers_0"]["self_attn"])):
    np.testing.assert_array_equal(a, b)
  # the converted tree is exactly the tree a fresh init of the L2A config builds
  init = jax.eval_shape(lambda: Decoder(lcfg).init(jax.random.PRNGKey(0), tok))["params"]
  init = nn.unbox(init)
  assert jax.tree.structure(init) == jax.tree.structure(lp)
  specs = nn.get_partition_spec(jax.eval_shape(
      lambda: Decoder(lcfg).init(jax.random.PRNGKey(0), tok)))["params"]
  assert tuple(specs["layers_0_1"]["router"]["kernel"]) == ("layers", "embed")
  with pytest.raises(ValueError, match="already has a global_attn"):
    l2a.from_dense(lp, lcfg)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for scheme 'l2a'"):
    attention.configure(cfg, "l2a", windw=4)
  with pytest.raises(ValueError, match="post-norm"):
    attention.configure(ModelConfig(family="olmo2", qk_norm="full", post_norm=True), "l2a")


def test_forced_and_normal_paths_same_forward():
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4)
  lp = _random_router(lp)
  rng = {"router": jax.random.PRNGKey(7)}
  ev, aux_ev = _apply(Decoder(lcfg), lp, tok)
  assert 0.2 < float(aux_ev["sparsity"].mean()) < 0.8  # a real mix of decisions
  outs = {}
  for p_force in (0.0, 1e-9, 1.0):
    m = Decoder(attention.configure(lcfg, "l2a", p_force=p_force))
    outs[p_force], aux = _apply(m, lp, tok, train=True, rngs=rng)
    np.testing.assert_array_equal(aux["forced"], 1.0 if p_force == 1.0 else 0.0)
    np.testing.assert_allclose(aux["sparsity"], aux_ev["sparsity"])
  for o in outs.values():
    np.testing.assert_allclose(o, ev, atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="rngs=\\{'router'"):  # raised while tracing: abstractly
    jax.eval_shape(lambda: Decoder(lcfg).apply({"params": lp}, tok, train=True))


def test_forced_step_draw_is_per_layer_and_from_step_key():
  cfg, dp, tok = _dense("llama")
  cfg = cfg.replace(num_layers=8)
  dp = host_init(cfg, 1, numpy=True)
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4, p_force=0.5)
  m = Decoder(lcfg)
  f = jax.jit(lambda key: m.apply({"params": lp}, tok, train=True, rngs={"router": key})[1]["forced"])
  draws = np.stack([np.asarray(f(jax.random.PRNGKey(s))) for s in range(12)])
  np.testing.assert_array_equal(draws[3], np.asarray(f(jax.random.PRNGKey(3))))  # same key, same draw
  assert 0.25 < draws.mean() < 0.75
  assert len({tuple(r) for r in draws}) > 1 and len({tuple(c) for c in draws.T}) > 1


def _layer_setup():
  """One qwen3 L2A layer with the MLP zeroed: its output is exactly x' = s + d * a."""
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=3)
  lp = _random_router(lp, scale=0.03)
  layer = _per_layer(lp)["layers_0"]
  layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  c = jax.random.normal(jax.random.PRNGKey(6), (B, T, cfg.hidden_size))
  return lcfg, layer, x, pos, c


def _objective(cfg, layer, x, pos, c, train, c_mask=None):
  mod = l2a.L2ALayer(cfg)
  cc = c if c_mask is None else c * c_mask[..., None]
  ctx = LayerContext(tokens_BT=pos, positions_BT=pos, train=train)

  def out(w):
    p = dict(layer, router={"kernel": w})
    return mod.apply({"params": p}, x, ctx, rngs={"router": jax.random.PRNGKey(0)})[0]

  out0 = out(layer["router"]["kernel"])

  def f(w):  # minus a constant: keeps float32 rounding of the sum small for finite differences
    return jnp.sum(cc * (out(w) - out0))
  return f


def test_ste_router_gradient_matches_soft_path_finite_difference():
  cfg, layer, x, pos, c = _layer_setup()
  w = layer["router"]["kernel"]
  soft = jax.jit(_objective(attention.configure(cfg, "l2a", routing="soft"), layer, x, pos, c, False))
  g_forced = jax.jit(jax.grad(_objective(attention.configure(cfg, "l2a", p_force=1.0), layer, x, pos, c, True)))(w)
  g_normal = jax.jit(jax.grad(_objective(attention.configure(cfg, "l2a", p_force=0.0), layer, x, pos, c, True)))(w)
  # decisions of this input
  d = jax.jit(lambda layer, x: l2a.L2ALayer(cfg).apply(  # one program (eagerly: op by op)
      {"params": layer}, x, LayerContext(tokens_BT=pos, positions_BT=pos),
      mutable=["intermediates"])[1]["intermediates"]["decision"][0])(layer, x)
  assert 0 < int(d.sum()) < d.size
  soft_acc = jax.jit(_objective(attention.configure(cfg, "l2a", routing="soft"), layer, x, pos, c,
                               False, c_mask=d.astype(jnp.float32)))

  def fd(f, direction, eps=2e-2):
    """Central differences with one Richardson step (float32: small steps drown in rounding)."""
    d = lambda e: (f(w + e * direction) - f(w - e * direction)) / (2 * e)
    return (4 * d(eps / 2) - d(eps)) / 3

  for k in range(4):
    u = jax.random.normal(jax.random.PRNGKey(100 + k), w.shape)
    u = u / jnp.linalg.norm(u)
    # forced step: the router gradient of every token = that of the soft path d = p
    np.testing.assert_allclose(jnp.dot(g_forced, u), fd(soft, u), rtol=5e-3, atol=1e-3)
    # normal step: only accepted tokens (a = 0 for the others) give gradient
    np.testing.assert_allclose(jnp.dot(g_normal, u), fd(soft_acc, u), rtol=5e-3, atol=1e-3)
  assert float(jnp.linalg.norm(g_forced - g_normal)) > 1e-2 * float(jnp.linalg.norm(g_forced))


def _decode_all(m, params, tok, prefill=7):
  @jax.jit
  def step(variables, tokens, positions):
    return m.apply(variables, tokens, positions, decode=True, cache_len=T, mutable=["cache"])

  pos = jnp.broadcast_to(jnp.arange(T), tok.shape)
  (logits, _), v = step({"params": params}, tok[:, :prefill], pos[:, :prefill])
  steps = [logits]
  for t in range(prefill, T):
    (lg, _), v = step({"params": params, "cache": v["cache"]}, tok[:, t:t + 1], pos[:, t:t + 1])
    steps.append(lg)
  return jnp.concatenate(steps, axis=1)


# manual: qwen3 / llama with the skip branch and nothing pruned (the default cover: qwen2 with
# the skip branch here, and tests/schemes/test_conformance.py::test_generation_equals_the_declared_
# forward[l2a-*], L2A's tiny qwen3 model with the default skip and layer 1 pruned)
@pytest.mark.parametrize("family,skip,pruned", [
    pytest.param("qwen3", True, (), marks=pytest.mark.manual), ("qwen3", False, ()),
    ("qwen2", True, (1,)), pytest.param("llama", True, (), marks=pytest.mark.manual),
    ("llama", False, (0,))])
def test_decode_equals_full_forward(family, skip, pruned):
  cfg, dp, tok = _dense(family)
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4, theta=0.8, decode_skip=skip,
                              pruned_layers=pruned)
  lp = _random_router(lp)
  m = Decoder(lcfg)
  (full, aux), st = _apply(m, lp, tok, mutable=["intermediates"])
  d = _decisions(st)
  assert d.shape[0] == cfg.num_layers - len(pruned)
  # some decode steps have no global query in some layer (the skip branch runs) and some do
  assert (~d[:, :, 7:].any(axis=1)).any() and d[:, :, 7:].any()
  np.testing.assert_allclose(_decode_all(m, lp, tok), full, atol=1e-4, rtol=0)


def test_context_free_routing_draws_ignore_the_tokens():
  """Context-free (bernoulli) routing: the draws do not depend on the tokens, in training they
  come from the step key, no regulariser. Its decode (chunked prefill + steps, with and without
  decode_skip) == the full forward: tests/inference/test_decode_steps.py::test_l2a_decode_equals_
  the_scanned_decode_and_the_forward (the scanned Decoder decode this test ran, and the engine's)."""
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4, routing="bernoulli", bernoulli_q=0.3)
  m = Decoder(lcfg)
  _, aux = _apply(m, lp, tok)
  assert 0.4 < float(aux["sparsity"].mean()) < 0.95
  # context-free: the draws do not depend on the tokens
  _, aux2 = _apply(m, lp, (tok + 1) % cfg.vocab_size)
  np.testing.assert_array_equal(aux["global_tokens_B"], aux2["global_tokens_B"])
  # in training they come from the step key
  _, a1 = _apply(m, lp, tok, train=True, rngs={"router": jax.random.PRNGKey(1)})
  _, a2 = _apply(m, lp, tok, train=True, rngs={"router": jax.random.PRNGKey(2)})
  assert not np.array_equal(a1["global_tokens_B"], a2["global_tokens_B"])
  np.testing.assert_array_equal(a1["p2_mean"], 0.0)  # no router in the loop, no regulariser


def test_theta_is_a_test_time_knob():
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4)
  lp = _random_router(lp)
  sp = [float(_apply(Decoder(attention.configure(lcfg, "l2a", theta=th)), lp, tok)[1]["sparsity"].mean())
        for th in (0.1, 0.5, 0.9)]
  assert sp[0] < sp[1] < sp[2]


def test_packed_documents_and_padding():
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=3)
  lp = _random_router(lp)
  m = Decoder(lcfg)
  a, b = tok[0, :9], tok[1, :5]
  packed = jnp.concatenate([a, b, jnp.zeros((2,), tok.dtype)])[None]
  seg = jnp.array([[1] * 9 + [2] * 5 + [0] * 2])
  pos = jnp.array([list(range(9)) + list(range(5)) + [0, 0]])
  out, aux = _apply(m, lp, packed, pos, seg)
  # each document alone, padded to the packed row's length: one compiled program for the three
  alone = lambda d: _apply(m, lp, *(jnp.asarray([list(x) + [0] * (16 - len(d))], jnp.int32)
                                    for x in (d, range(len(d)), [1] * len(d))))
  (alone_a, aux_a), (alone_b, aux_b) = alone(a), alone(b)
  np.testing.assert_allclose(out[0, :9], alone_a[0, :9], atol=1e-5)
  np.testing.assert_allclose(out[0, 9:14], alone_b[0, :5], atol=1e-5)
  np.testing.assert_array_equal(aux["tokens_B"][:, 0], 14.0)  # padding is not counted
  np.testing.assert_allclose(aux["global_tokens_B"][:, 0],
                             aux_a["global_tokens_B"][:, 0] + aux_b["global_tokens_B"][:, 0])


def test_aux_loss_schedule_and_metrics():
  cfg = attention.configure(ModelConfig(), "l2a", lambda_max=2e-3, lambda_warmup_steps=10,
                       lambda_ramp_steps=20, pruned_layers=(1,))
  o = attention.options(cfg)
  lam = [float(l2a.lambda_at(s, o)) for s in (0, 9, 10, 20, 30, 100)]
  np.testing.assert_allclose(lam, [0, 0, 0, 1e-3, 2e-3, 2e-3], atol=1e-9)
  oc = attention.options(attention.configure(cfg, "l2a", lambda_schedule="constant"))
  assert float(l2a.lambda_at(0, oc)) == pytest.approx(2e-3)
  aux = dict(p2_mean=jnp.array([0.25, 0.0]), p_mean=jnp.array([0.5, 0.0]),
             sparsity=jnp.array([0.3, 1.0]), forced=jnp.array([1.0, 0.0]))
  loss, metrics = l2a.aux_loss(aux, None, 30, cfg)
  assert float(loss) == pytest.approx(2e-3 * 0.125)
  assert float(metrics["l2a/sparsity"]) == pytest.approx(0.3)  # pruned layer left out
  assert float(metrics["l2a/forced_frac"]) == pytest.approx(1.0)
  assert float(metrics["l2a/sparsity_layer_1"]) == 1.0
  assert float(metrics["l2a/router_p_layer_0"]) == 0.5
  # the regulariser gradient reaches the router through p^2
  cfg2, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg2, "l2a", window=4, lambda_schedule="constant", lambda_max=1.0)

  def reg(params):
    _, aux = Decoder(lcfg).apply({"params": params}, tok)
    return l2a.aux_loss(aux, None, 0, lcfg)[0]
  g = jax.jit(jax.grad(reg))(lp)
  assert float(jnp.abs(g["layers"]["router"]["kernel"]).min()) > 0  # every layer's router


def test_measure_prune_and_kv_bytes(tmp_path):
  cfg, dp, tok = _dense("qwen3")
  lcfg, lp = attention.convert(dp, cfg, "l2a", window=4)
  lp = _random_router(lp)
  batches = [{"inputs": tok}, {"inputs": (tok * 7 + 3) % cfg.vocab_size}]
  meas = l2a.measure_sparsity(Decoder(lcfg), lp, batches)
  aux = [_apply(Decoder(lcfg), lp, b["inputs"])[1]["sparsity"] for b in batches]
  np.testing.assert_allclose(meas["layer_sparsity"], np.mean(aux, axis=0), atol=1e-6)
  sp = meas["layer_sparsity"]
  hi = int(np.argmax(sp))
  res = l2a.prune_report(Decoder(lcfg), lp, batches, context_len=1024, threshold=float(np.mean(sp)),
                         out_dir=str(tmp_path), name="p")
  rep = res["report"]
  # the reports' out_dir: JSON (the report), markdown, per-layer plot
  assert res["json"] == str(tmp_path / "p.json") and json.load(open(res["json"])) == rep
  assert "| layer | sparsity | pruned |" in open(res["md"]).read()
  assert open(res["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert rep["layer_sparsity"] == sp and rep["pruned_layers"] == [hi]
  per = stacking.unstack_layers(res["params"])
  assert "global_attn" not in per[f"layers_{hi}"]
  assert "global_attn" in per[f"layers_{1 - hi}"]
  # the 0.95 default
  _, _, new = l2a.prune(lp, lcfg, [0.96, 0.94])
  assert new == (0,)
  per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4
  assert rep["kv_bytes_dense_base"] == 2 * 1024 * per_tok
  assert rep["kv_bytes_before"] == 2 * (1024 + 4) * per_tok
  assert rep["kv_bytes_after"] == (1024 + 2 * 4) * per_tok
  # the pruned config and params are the layout a fresh init of that config builds (a pruned
  # L2A model's decode == its full forward: test_conformance's L2A tiny, layer 1 pruned, and
  # test_decode_equals_full_forward's pruned cases)
  fresh = nn.unbox(jax.eval_shape(lambda: Decoder(res["config"]).init(jax.random.PRNGKey(0), tok)))
  assert (jax.tree.map(lambda a: (a.shape, a.dtype), fresh["params"])
          == jax.tree.map(lambda a: (a.shape, a.dtype), res["params"]))
