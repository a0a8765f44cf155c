"""AHA: exactness against the base model at conversion (every family, OLMo-2 post-norm included),
the mixed per-head forward against an obviously-right reference (one attention with a per-head
full-or-window mask), exact == sparse forward, the STE gradient d head / d s = Full - Local, the
regulariser and metrics, tau as a test-time knob, packed documents."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import aha, get_scheme
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.decoder import Decoder
from condattn_jax.models.layers import Attention, RMSNorm
from pallas_kernels.compact_attention.reference import dense_mask, reference_attention

FAMILIES = {
    "llama": dict(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8)),
    "qwen2": dict(attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(qk_norm="full", post_norm=True),
}
B, T = 2, 16


@functools.lru_cache(maxsize=None)
def _dense(family, seed=1):
  """(config, params, tokens) of the dense model, built once per (family, seed): the tests copy
  before they change a params tree (_random_router, _layer_setup)."""
  cfg = ModelConfig(family=family).replace(**FAMILIES[family])
  tok = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, cfg.vocab_size)
  # host (numpy) params: the conversions and router draws stay numpy (on device arrays each
  # eager jnp op of theirs compiles on its own); jit takes them as they are
  params = host_init(cfg, seed, numpy=True)
  if cfg.attention_bias:  # non-zero biases, so keeping them is tested too
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x, params)
  return cfg, params, tok


@functools.lru_cache(maxsize=None)
def _jitted(model, kw):
  """jax.jit of model.apply with the static keywords kw (sorted items), one per (model config,
  kw): eagerly, apply compiles its layer scan as a program of its own and every op outside it
  alone; a model applied again (other params or inputs of the same shapes) reuses the compile."""
  return jax.jit(functools.partial(model.apply, **dict(kw)))


def _apply(model, params, *args, **kw):
  """model.apply({'params': params}, *args, **kw) in one jitted program: array keywords traced,
  the others static."""
  static = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()
                        if not isinstance(v, jax.Array)))
  arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
  return _jitted(model, static)({"params": params}, *args, **arrays)


def _random_router(params, scale=0.3, seed=0):
  """Router kernel ~ N(0, scale^2), bias 0: about half of the (token, head) pairs go full."""
  params = jax.tree.map(lambda x: x, params)
  r = params["layers"]["router"]
  r["kernel"] = np.asarray(scale * jax.random.normal(jax.random.PRNGKey(seed), r["kernel"].shape))
  r["bias"] = np.zeros_like(r["bias"])
  return params


# qwen2 (kept biases) and olmo2 (post-norm, full qk-norm) by default; llama and qwen3 (the
# conversion copies the same attention / MLP leaves, nothing family-specific) are `manual`
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=() if f in ("qwen2", "olmo2") else pytest.mark.manual)
    for f in sorted(FAMILIES)])
def test_conversion_is_the_base_model_and_reverses(family):
  """dense -> AHA (exact and sparse) is the base model, AHA -> dense gives the params back, every
  head local is the sliding-window model. Default cover of the manual families: the qwen2 /
  olmo2 cases here and tests/schemes/test_conformance.py::test_to_and_from_dense[aha]."""
  cfg, dp, tok = _dense(family)
  base, _ = _apply(Decoder(cfg), dp, tok)
  for mode in ("exact", "sparse"):
    acfg, ap = attention.convert(dp, cfg, "aha", window=4, mode=mode)
    out, aux = _apply(Decoder(acfg), ap, tok)
    np.testing.assert_allclose(out, base, atol=1e-6, rtol=0)
    assert aux["usage_N"].shape == (cfg.num_layers, cfg.num_heads)
    np.testing.assert_array_equal(aux["usage_N"], 1.0)  # every head full at init
  # the reverse conversion gives the base params back exactly
  dcfg, back = aha.to_dense(ap, acfg)
  assert dcfg.scheme == "dense" and dcfg.sliding_window is None
  assert jax.tree.structure(back) == jax.tree.structure(dp)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(dp)):
    np.testing.assert_array_equal(a, b)
  # every head local (routing 'none', any router) == the dense sliding-window model
  lcfg, lparams = aha.to_dense(ap, acfg, keep="local")
  assert lcfg.sliding_window == 4
  want, _ = _apply(Decoder(lcfg), lparams, tok)
  out, aux = _apply(Decoder(attention.configure(acfg, "aha", routing="none")),
                    _random_router(ap), tok)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(aux["usage_N"], 0.0)
  assert float(jnp.abs(want - base).max()) > 1e-2  # the window matters at T=16


def test_params_layout_registry_and_errors():
  cfg, dp, tok = _dense("olmo2")
  acfg, ap = attention.convert(dp, cfg, "aha", window=4)
  assert get_scheme("aha").from_dense is aha.from_dense
  per = stacking.unstack_layers(ap)
  dper = stacking.unstack_layers(dp)
  assert set(per["layers_0"]) == set(dper["layers_0"]) | {"router"}  # one attention, shared
  r = per["layers_0"]["router"]
  assert r["kernel"].shape == (cfg.hidden_size, cfg.num_heads)  # one score per QUERY head
  np.testing.assert_array_equal(r["kernel"], 0.0)
  np.testing.assert_array_equal(r["bias"], 2.0)
  # a fresh init of the AHA config builds exactly this tree, router initialised the same way
  variables = Decoder(acfg).init(jax.random.PRNGKey(0), tok)
  init = nn.unbox(variables["params"])
  assert jax.tree.structure(init) == jax.tree.structure(ap)
  np.testing.assert_array_equal(init["layers"]["router"]["bias"], 2.0)
  specs = nn.get_partition_spec(variables)["params"]["layers"]["router"]
  assert tuple(specs["kernel"]) == ("layers", "embed", "q_heads")
  assert tuple(specs["bias"]) == ("layers", "q_heads")
  with pytest.raises(ValueError, match="already has a router"):
    aha.from_dense(ap, acfg)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for scheme 'aha'"):
    attention.configure(cfg, "aha", windw=4)
  with pytest.raises(ValueError, match="mode="):
    attention.configure(cfg, "aha", mode="fast")
  with pytest.raises(ValueError, match="sliding_window"):
    attention.configure(cfg.replace(sliding_window=8), "aha")


# ----------------------------------------------------------------------------------------------
# One layer against an obviously-right reference
# ----------------------------------------------------------------------------------------------
def _layer_setup(family, window=3):
  """One AHA layer (random router, MLP output zeroed so the layer output is the attention half)."""
  cfg, dp, _ = _dense(family)
  acfg, ap = attention.convert(dp, cfg, "aha", window=window)
  layer = jax.tree.map(lambda x: x, stacking.unstack_layers(_random_router(ap))["layers_0"])
  layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return acfg, layer, x, pos


def _reference_parts(cfg, layer, x, pos, tau=0.5):
  """_reference_equations in one jitted program per (config, tau) (eagerly: op by op, each op
  compiled alone)."""
  return _reference_program(cfg, tau)(layer, x, pos)


@functools.lru_cache(maxsize=None)
def _reference_program(cfg, tau):
  return jax.jit(functools.partial(_reference_equations, cfg, tau=tau))


def _reference_equations(cfg, layer, x, pos, tau=0.5):
  """(x_in, s, g, full, local, out) computed directly from the equations: ONE attention call
  per path (full: causal mask; local: causal + window) and the layer output from ONE attention
  with the per-head mask 'full if g else window' (paper eq. 4)."""
  o = attention.options(cfg)
  x_in = x if cfg.post_norm else RMSNorm(eps=cfg.rms_norm_eps).apply(
      {"params": layer["input_layernorm"]}, x)
  r = jnp.einsum("btd,dn->btn", x_in, layer["router"]["kernel"],
                 precision=jax.lax.Precision.HIGHEST) + layer["router"]["bias"]
  s = jax.nn.sigmoid(r)
  g = s > tau
  q, k, v = Attention(cfg).apply({"params": layer["self_attn"]}, x_in, pos, method="qkv")
  causal = dense_mask(pos, pos)
  window = dense_mask(pos, pos, window=o.window)
  full = reference_attention(q, k, v, causal)[0]
  local = reference_attention(q, k, v, window)[0]
  per_head = jnp.where(jnp.moveaxis(g, 2, 1)[..., None], causal[:, None], window[:, None])
  heads = reference_attention(q, k, v, per_head)[0]  # [B, N, T, S] mask: K/V shared by groups
  attn_out = jnp.einsum("btnh,nhd->btd", heads, layer["self_attn"]["o_proj"]["kernel"],
                        precision=jax.lax.Precision.HIGHEST)
  if cfg.post_norm:
    attn_out = RMSNorm(eps=cfg.rms_norm_eps).apply(
        {"params": layer["post_attention_layernorm"]}, attn_out)
  return dict(x_in=x_in, s=s, g=g, full=full, local=local, out=x + attn_out)


@functools.lru_cache(maxsize=None)
def _layer_program(cfg, mutable):
  """AHALayer(cfg).apply jitted (eagerly: op by op, each op compiled alone), one per config."""
  return jax.jit(lambda layer, x, ctx, key: aha.AHALayer(cfg).apply(
      {"params": layer}, x, ctx, rngs={"router": key},
      mutable=["intermediates"] if mutable else False))


def _apply_layer(cfg, layer, x, pos, train=False, seed=0, mutable=False):
  ctx = LayerContext(tokens_BT=pos, positions_BT=pos, train=train)
  return _layer_program(cfg, mutable)(layer, x, ctx, jax.random.PRNGKey(seed))


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_mixed_routing_matches_reference_and_modes_agree(family):
  cfg, layer, x, pos = _layer_setup(family)
  assert cfg.num_heads > cfg.num_kv_heads  # GQA: query heads of a group route independently
  ref = _reference_parts(cfg, layer, x, pos)
  g = np.asarray(ref["g"])
  assert 0.25 < g.mean() < 0.75
  # heads sharing a kv head take different paths at some tokens
  G = cfg.num_heads // cfg.num_kv_heads
  grouped = g.reshape(B, T, cfg.num_kv_heads, G)
  assert (grouped.any(-1) & ~grouped.all(-1)).any()
  (out, aux), st = _apply_layer(cfg, layer, x, pos, mutable=True)
  np.testing.assert_allclose(out, ref["out"], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(st["intermediates"]["gate"][0], g)
  np.testing.assert_allclose(aux["usage_N"], g.mean(axis=(0, 1)), atol=1e-6)
  np.testing.assert_allclose(aux["score_N"], np.asarray(ref["s"]).mean(axis=(0, 1)), atol=1e-6)
  np.testing.assert_array_equal(aux["full_BN"], g.sum(axis=1))
  # sparse mode (full only for routed pairs), in eval, in training and on a forced step
  for p_force, train in ((0.05, False), (0.0, True), (1.0, True)):
    scfg = attention.configure(cfg, "aha", mode="sparse", p_force=p_force)
    s_out, s_aux = _apply_layer(scfg, layer, x, pos, train=train)
    np.testing.assert_allclose(s_out, out, atol=1e-5, rtol=0)
    assert float(s_aux["forced"]) == (1.0 if p_force == 1.0 else 0.0)


def test_ste_router_gradient_is_full_minus_local():
  """dL/ds at one token = <dL/dhead, Full - Local> per head (exact mode, and sparse forced
  steps); sparse non-forced steps keep it only for the heads routed full. Read off the router
  bias gradient with the objective on a single token: dL/db_n = dL/ds_n * s_n (1 - s_n)."""
  cfg, layer, x, pos = _layer_setup("qwen3")
  ref = _reference_parts(cfg, layer, x, pos)
  s, g = np.asarray(ref["s"]), np.asarray(ref["g"])
  wo = layer["self_attn"]["o_proj"]["kernel"]  # [N, H, D]
  cvec = jax.random.normal(jax.random.PRNGKey(9), (cfg.hidden_size,))

  def bias_grad(cfg_, b0, t0, train, seed=0):
    def f(bias):
      p = dict(layer, router=dict(layer["router"], bias=bias))
      out, _ = _apply_layer(cfg_, p, x, pos, train=train, seed=seed)
      return jnp.dot(out[b0, t0], cvec)
    return np.asarray(jax.grad(f)(layer["router"]["bias"]))

  dhead = np.einsum("nhd,d->nh", wo, cvec)  # dL/dhead at the chosen token
  mixed = [(b, t) for b in range(B) for t in range(4, T) if 0 < g[b, t].sum() < cfg.num_heads]
  assert len(mixed) >= 2
  for b0, t0 in mixed[:2]:
    want = np.einsum("nh,nh->n", dhead, np.asarray(ref["full"] - ref["local"])[b0, t0])
    sig = s[b0, t0] * (1 - s[b0, t0])
    got = bias_grad(cfg, b0, t0, train=True) / sig
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    forced = bias_grad(attention.configure(cfg, "aha", mode="sparse", p_force=1.0), b0, t0, train=True) / sig
    np.testing.assert_allclose(forced, want, rtol=1e-4, atol=1e-5)
    sparse = bias_grad(attention.configure(cfg, "aha", mode="sparse", p_force=0.0), b0, t0, train=True) / sig
    np.testing.assert_allclose(sparse, want * g[b0, t0], rtol=1e-4, atol=1e-5)
    assert np.abs(want[~g[b0, t0]]).min() > 1e-4  # so the masking above is visible


# ----------------------------------------------------------------------------------------------
# Whole model: regulariser, metrics, knobs
# ----------------------------------------------------------------------------------------------
def _scores_and_gates(m, params, tok, **kw):
  _, st = _apply(m, params, tok, mutable=["intermediates"], **kw)
  inter = st["intermediates"]["layers"]
  return np.asarray(inter["score"][0]), np.asarray(inter["gate"][0])  # [L, B, T, N]


def test_regulariser_metrics_and_task_usage():
  cfg, dp, tok = _dense("olmo2")
  acfg, ap = attention.convert(dp, cfg, "aha", window=4, lam=0.5, num_tasks=3)
  ap = _random_router(ap)
  m = Decoder(acfg)
  task_ids = jnp.array([2, 0])
  _, aux = _apply(m, ap, tok, task_ids_B=task_ids)
  s, g = _scores_and_gates(m, ap, tok)
  loss, met = aha.aux_loss(aux, {"task_ids": task_ids}, 0, acfg)
  # the paper's eq. 7: lam * mean over layers, tokens and heads of the scores
  assert float(loss) == pytest.approx(0.5 * s.mean(), rel=1e-5)
  assert np.shape(met["aha/usage"]) == (cfg.num_layers, cfg.num_heads)
  np.testing.assert_allclose(met["aha/usage"], g.mean(axis=(1, 2)), atol=1e-6)
  assert float(met["aha/mu_f"]) == pytest.approx(g.mean(), abs=1e-6)
  np.testing.assert_allclose(met["aha/usage_layer"], g.mean(axis=(1, 2, 3)), atol=1e-6)
  per_row = g.mean(axis=(0, 2, 3))  # [B]
  full, slots = np.asarray(met["aha/full_task"]), np.asarray(met["aha/slots_task"])
  np.testing.assert_allclose(full / np.maximum(slots, 1), [per_row[1], 0.0, per_row[0]],
                             atol=1e-6)
  np.testing.assert_array_equal(slots, [T * cfg.num_layers * cfg.num_heads, 0,
                                        T * cfg.num_layers * cfg.num_heads])
  assert "aha/full_task" not in aha.aux_loss(aux, {}, 0, acfg)[1]  # no task ids, no task metrics
  # the regulariser's gradient reaches every layer's router (kernel and bias)
  def reg(params):
    return aha.aux_loss(m.apply({"params": params}, tok)[1], None, 0, acfg)[0]
  gr = jax.jit(jax.grad(reg))(ap)["layers"]["router"]
  assert float(jnp.abs(gr["bias"]).min()) > 0 and float(jnp.abs(gr["kernel"]).max()) > 0
  # no router in the loop: no regulariser
  _, aux_all = _apply(Decoder(attention.configure(acfg, "aha", routing="all")), ap, tok)
  assert float(aha.aux_loss(aux_all, None, 0, acfg)[0]) == 0.0


def test_tau_is_a_test_time_knob():
  cfg, dp, tok = _dense("qwen3")
  acfg, ap = attention.convert(dp, cfg, "aha", window=4)
  ap = _random_router(ap)
  mu = []
  for tau in (0.3, 0.5, 0.7):
    _, aux = _apply(Decoder(attention.configure(acfg, "aha", tau=tau)), ap, tok)
    mu.append(float(aux["usage_N"].mean()))
  assert 1.0 > mu[0] > mu[1] > mu[2] > 0.0


def test_packed_documents_and_padding():
  cfg, dp, tok = _dense("olmo2")
  acfg, ap = attention.convert(dp, cfg, "aha", window=3)
  ap = _random_router(ap)
  m = Decoder(acfg)
  a, b = tok[0, :9], tok[1, :5]
  packed = jnp.concatenate([a, b, jnp.zeros((2,), tok.dtype)])[None]
  seg = jnp.array([[1] * 9 + [2] * 5 + [0] * 2])
  pos = jnp.array([list(range(9)) + list(range(5)) + [0, 0]])
  # each document alone, padded to the packed row's length: one compiled program for the three
  fwd = jax.jit(lambda t, p, s: m.apply({"params": ap}, t, p, s))
  out, aux = fwd(packed, pos, seg)
  alone = lambda d: fwd(*(jnp.asarray([list(x) + [0] * (16 - len(d))], jnp.int32) for x in
                          (d, range(len(d)), [1] * len(d))))
  (alone_a, aux_a), (alone_b, aux_b) = alone(a), alone(b)
  np.testing.assert_allclose(out[0, :9], alone_a[0, :9], atol=1e-5)
  np.testing.assert_allclose(out[0, 9:14], alone_b[0, :5], atol=1e-5)
  np.testing.assert_array_equal(aux["tokens_B"][:, 0], 14.0)  # padding is not counted
  np.testing.assert_array_equal(aux["full_BN"][:, 0], aux_a["full_BN"][:, 0] + aux_b["full_BN"][:, 0])


def test_kv_cache_bytes_is_one_full_cache():
  cfg, _, _ = _dense("olmo2")
  acfg = attention.configure(cfg, "aha", window=4)
  per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4
  kv = aha.kv_cache_bytes(acfg, 1024, batch=2)
  assert kv == {"total": cfg.num_layers * 1024 * per_tok * 2,
                "full": cfg.num_layers * 1024 * per_tok * 2, "window": 0}


def test_router_without_bias_is_the_papers_eq1():
  """router_bias=False (paper eq. 1, no b_r): no bias param (converted and fresh trees agree),
  r = x_in @ W_r, so at W_r = 0 every score is 0.5, not above tau: every head starts LOCAL (the
  sliding-window model, not the base model). A bias init without a bias is refused."""
  cfg, dp, tok = _dense("olmo2")
  acfg, ap = attention.convert(dp, cfg, "aha", window=4, router_bias=False,
                               router_bias_init=0.0)
  assert set(ap["layers"]["router"]) == {"kernel"}
  init = nn.unbox(jax.eval_shape(Decoder(acfg).init, jax.random.PRNGKey(0), tok)["params"])
  assert jax.tree.structure(init) == jax.tree.structure(ap)
  out, aux = _apply(Decoder(acfg), ap, tok)
  np.testing.assert_array_equal(aux["usage_N"], 0.0)   # every head local at init
  np.testing.assert_allclose(aux["score_N"], 0.5)
  wcfg = cfg.replace(sliding_window=4)                  # == the sliding-window dense model
  np.testing.assert_allclose(out, _apply(Decoder(wcfg), dp, tok)[0], atol=1e-5)
  # a random kernel: scores are sigmoid(x_in @ W_r), no offset
  ap["layers"]["router"]["kernel"] = 0.3 * jax.random.normal(
      jax.random.PRNGKey(1), ap["layers"]["router"]["kernel"].shape)
  _, aux = _apply(Decoder(acfg), ap, tok)
  assert 0.0 < float(jnp.mean(aux["usage_N"])) < 1.0
  with pytest.raises(ValueError, match=r"router_bias_init=2.0 needs router_bias=True"):
    attention.configure(cfg, "aha", router_bias=False)
