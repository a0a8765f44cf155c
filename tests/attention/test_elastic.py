"""Elastic Attention: conversion == base model (every head FA), the mixed per-head layer against
an obviously-right per-head dense-mask reference (FA-SSA, FA-XA, XA-SSA; eval and training
forward), XA block scores against a brute-force anti-diagonal loop, Omega_ESR pair counts, the
STE gradient, the Gumbel / tau schedule, the Lagrangian's ascent direction, task-name errors."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax import ops
from condattn_jax.attention import elastic, get_scheme
from condattn_jax.attention.elastic import masks
from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.decoder import Decoder
from condattn_jax.models.layers import Attention, RMSNorm
from condattn_jax.train import optimizer as opt_lib
from pallas_kernels.compact_attention.reference import dense_mask, reference_attention

FAMILIES = {
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(qk_norm="full", post_norm=True),  # post-norm: the router reads the raw x
}
B, T = 4, 32
# xa_chunk=3: the layers score XA in two chunks of query blocks (nq = 4), the reference in one
SMALL = dict(block=8, sinks=8, local=16, xa_stride=4, boundary=5, xa_threshold=0.5, xa_chunk=3)


@functools.cache
def _dense(family, seed=1):
  """(config, dense params as numpy: callers get fresh trees from the conversion, tokens)."""
  cfg = ModelConfig(family=family, num_heads=4, num_kv_heads=2).replace(**FAMILIES[family])
  tok = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, cfg.vocab_size)
  params = host_init(cfg, seed)
  return cfg, jax.tree.map(np.asarray, params), tok


def test_conversion_every_head_fa_is_the_base_model_and_reverses(family="olmo2"):
  cfg, dp, tok = _dense(family)
  fwd = lambda c, p: jax.jit(Decoder(c).apply)({"params": p}, tok)
  base, _ = fwd(cfg, dp)
  ecfg, ep = attention.convert(jax.tree.map(np.asarray, dp), cfg, "elastic", modes="fa_xa",
                                      routing="fa", **SMALL)
  out, aux = fwd(ecfg, ep)
  np.testing.assert_allclose(out, base, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(aux["fa_BK"], 1.0)
  np.testing.assert_array_equal(aux["rho_BN"], 0.0)
  # every head SA really changes the output: the check above can fail
  out, aux = fwd(attention.configure(ecfg, "elastic", modes="fa_ssa", routing="sa"), ep)
  assert float(jnp.abs(out - base).max()) > 1e-3 and float(aux["rho_BN"].min()) > 0.1
  # the converted tree is the model's own (init) structure; to_dense is the exact inverse
  init = nn.unbox(jax.eval_shape(Decoder(ecfg).init, jax.random.PRNGKey(0), tok)["params"])
  assert jax.tree.structure(init) == jax.tree.structure(ep)
  assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ep)))
  assert ep["scheme"]["lagrange"].shape == (2, 2)
  assert 0 <= ep["scheme"]["lagrange"].min() and ep["scheme"]["lagrange"].max() <= 0.5
  dcfg, back = elastic.to_dense(ep, ecfg)
  assert dcfg.scheme == "dense" and jax.tree.structure(back) == jax.tree.structure(dp)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(dp)):
    np.testing.assert_array_equal(a, b)
  assert get_scheme("elastic").from_dense is elastic.from_dense
  with pytest.raises(ValueError, match="router"):
    elastic.from_dense({k: v for k, v in ep.items() if k != "scheme"}, ecfg)


# ----------------------------------------------------------------------------------------------
# One layer against per-head dense masks
# ----------------------------------------------------------------------------------------------
def _layer_setup(modes, seed=3, family="qwen3"):
  cfg, dp, _ = _dense(family)
  ecfg, ep = attention.convert(jax.tree.map(np.asarray, dp), cfg, "elastic", modes=modes, seed=seed,
                                      **SMALL)
  layer = jax.tree.map(jnp.asarray, stacking.unstack_layers(ep)["layers_0"])
  layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
  # a sharper router (the init is N(0, 0.02)): decisions differ across rows and kv heads
  layer["router"]["router_fc3"]["kernel"] = layer["router"]["router_fc3"]["kernel"] * 300.0
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return ecfg, layer, x, pos


def _apply(cfg, layer, x, pos, train=False, seed=0, fields=None):
  ctx = LayerContext(tokens_BT=pos, positions_BT=pos, train=train, fields=fields or {})
  return _jit_apply(cfg, layer, x, ctx, jax.random.PRNGKey(seed))


def _jit_apply(cfg, layer, x, ctx, key):
  f = _JIT.get(cfg)
  if f is None:
    f = _JIT[cfg] = jax.jit(lambda l, x, c, k: elastic.ElasticLayer(cfg).apply(
        {"params": l}, x, c, rngs={"router": k}))
  return f(layer, x, ctx, key)


_JIT = {}


def _ssa_token_mask(o):
  """[T, S] SSA by its definition on tokens: causal, and the key's block is a sink block or one
  of the query's local / block most recent blocks."""
  t = np.arange(T)[:, None]
  s = np.arange(T)[None, :]
  n_sink, n_local = -(-o.sinks // o.block), o.local // o.block
  return (s <= t) & ((s // o.block < n_sink) | (t // o.block - s // o.block < n_local))


@functools.lru_cache(maxsize=None)
def _reference_programs(cfg):
  """_reference's array parts, jitted once per config (run eagerly, every op compiled alone):
  (layer, x, pos) -> (router logits z [B, K, 2], q, k, v, XA keep [B, K, nq, nk]) and
  (q, k, v, [B, N, T, S] mask) -> the reference attention's heads."""
  o = attention.options(cfg)
  pooled_t = np.flatnonzero((np.arange(T) < o.boundary) | (np.arange(T) >= T - o.boundary))

  def project(layer, x, pos):
    x_in = RMSNorm(eps=cfg.rms_norm_eps).apply({"params": layer["input_layernorm"]}, x)
    _, k0, _ = Attention(cfg).apply({"params": layer["self_attn"]}, x_in, method="project")
    pooled = k0[:, pooled_t].mean(axis=1)                                   # [B, K, H]
    r = layer["router"]
    lin = lambda n, h: h @ r[n]["kernel"] + r[n]["bias"]
    h = lin("task_fc2", jax.nn.silu(lin("task_fc1", pooled)))
    z = lin("router_fc3", jax.nn.silu(lin("router_fc2", jax.nn.silu(lin("router_fc1", h)))))
    q, k, v = Attention(cfg).apply({"params": layer["self_attn"]}, x_in, pos, method="qkv")
    keep = masks.xa_keep(q, k, jnp.ones((B, T), bool), block=o.block, stride=o.xa_stride,
                         threshold=o.xa_threshold)
    return z, q, k, v, keep
  return jax.jit(project), jax.jit(lambda q, k, v, m: reference_attention(q, k, v, m)[0])


def _reference(cfg, layer, x, pos, fa_BK=None):
  """(out, fa_BK, fa_mask, sa_mask): router from its equations, then ONE reference attention
  with a per-head [B, N, T, S] dense mask (the head's class-1 or class-0 mask)."""
  o = attention.options(cfg)
  project, attend = _reference_programs(cfg)
  z, q, k, v, keep = project(layer, x, pos)
  if fa_BK is None:
    fa_BK = np.asarray(z[..., 1] > z[..., 0], np.float32)
  causal = np.asarray(dense_mask(pos, pos))[:, None]                      # [B, 1, T, S]
  ssa = np.broadcast_to(_ssa_token_mask(o)[None, None], causal.shape)
  keep = np.asarray(keep)
  xa = np.repeat(np.repeat(keep, o.block, 2), o.block, 3)[:, :, :T, :T] & causal
  cls1 = {"fa_ssa": causal, "fa_xa": causal, "xa_ssa": xa}[o.modes]
  cls0 = {"fa_ssa": ssa, "fa_xa": xa, "xa_ssa": ssa}[o.modes]
  G = cfg.num_heads // cfg.num_kv_heads
  on = np.repeat(fa_BK, G, axis=1)[:, :, None, None] > 0.5
  per_head = np.where(on, cls1, cls0)
  heads = attend(q, k, v, jnp.asarray(per_head))
  out = x + jnp.einsum("btnh,nhd->btd", heads, layer["self_attn"]["o_proj"]["kernel"])
  full = lambda m: attend(q, k, v, jnp.asarray(np.broadcast_to(m, per_head.shape)))
  return dict(out=out, fa_BK=fa_BK, heads1=full(cls1), heads0=full(cls0), per_head=per_head)


@pytest.mark.parametrize("modes", elastic.MODES)
def test_mixed_layer_matches_per_head_reference(modes):
  cfg, layer, x, pos = _layer_setup(modes)
  ref = _reference(cfg, layer, x, pos)
  fa = ref["fa_BK"]
  assert 0 < fa.mean() < 1 and (fa.min(axis=1) != fa.max(axis=1)).any()  # mixed within rows
  out, aux = _apply(cfg, layer, x, pos)
  np.testing.assert_array_equal(aux["fa_BK"], fa)
  np.testing.assert_allclose(out, ref["out"], atol=1e-5, rtol=0)
  # the SA masks really skip pairs (else the test could not tell modes apart)
  assert (ref["per_head"].sum(axis=(2, 3)) < np.asarray(dense_mask(pos, pos)).sum(axis=(1, 2))[:, None]).any()
  # rho = skipped fraction of the head's causal pairs, counted on the dense masks
  causal = np.asarray(dense_mask(pos, pos)).sum(axis=(1, 2))[:, None]
  want_rho = 1 - ref["per_head"].sum(axis=(2, 3)) / causal
  if modes.startswith("fa"):
    want_rho = np.where(np.repeat(fa, 2, axis=1) > 0.5, 0.0, want_rho)
  np.testing.assert_allclose(aux["rho_BN"], want_rho, atol=1e-6)
  # training forward (Gumbel noise): the value is the hard mix of the noisy decision
  t_out, t_aux = _apply(cfg, layer, x, pos, train=True, seed=1, fields={"step": jnp.int32(0)})
  t_ref = _reference(cfg, layer, x, pos, fa_BK=np.asarray(t_aux["fa_BK"]))
  np.testing.assert_allclose(t_out, t_ref["out"], atol=1e-5, rtol=0)
  assert float(t_aux["tau"]) == pytest.approx(1.5)


@pytest.mark.parametrize("q_chunk", [masks.XA_Q_CHUNK, 4])  # one chunk; 4 not dividing 6
def test_xa_block_scores_match_brute_force(q_chunk):
  S, blk, H, n = 4, 8, 8, 6
  Tl = n * blk
  q = jax.random.normal(jax.random.PRNGKey(0), (1, Tl, 2, H))
  k = jax.random.normal(jax.random.PRNGKey(1), (1, Tl, 1, H))
  # the kept blocks and the lists in one jitted program (eagerly: op by op, each op compiled alone)
  keep, lists = jax.device_get(jax.jit(lambda q, k: (
      masks.xa_keep(q, k, jnp.ones((1, Tl), bool), block=blk, stride=S, threshold=0.3,
                    q_chunk=q_chunk),
      masks.xa_lists(q, k, jnp.ones((1, Tl), bool), block=blk, stride=S, threshold=0.3)))(q, k))
  qn, kn = np.asarray(q, np.float64)[0], np.asarray(k, np.float64)[0]
  Ts, r = Tl // S, blk // S
  for head in range(2):
    sc = np.full((Ts, Ts), -np.inf)
    for a in range(Ts):
      for b in range(a + 1):
        sc[a, b] = sum(qn[a * S + s, head] @ kn[b * S + S - 1 - s, 0] for s in range(S))
    p = np.exp(sc / (np.sqrt(H) * S) - (sc / (np.sqrt(H) * S)).max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    mass = p.reshape(n, r, n, r).sum(axis=(1, 3)) / r
    for i in range(n):  # XAttention: first + diagonal blocks, their mass counted first
      want = np.zeros(n, bool)
      forced = {0, i}
      taken = sum(mass[i, j] for j in forced)
      for j in sorted(set(range(n)) - forced, key=lambda j: -mass[i, j]):
        if taken < 0.3 * mass[i].sum():
          want[j] = True
        taken += mass[i, j]
      want[0] = want[i] = True
      want[i + 1:] = False
      np.testing.assert_array_equal(keep[0, head, i], want)
  causal = np.tril(np.ones((n, n), bool))
  assert (~keep[0] & causal).any()  # the threshold dropped causal blocks
  for i in range(n):
    got = lists[0, 0, i]
    np.testing.assert_array_equal(got[got >= 0], np.flatnonzero(keep[0, 0, i]))


def test_xa_selection_counts_the_forced_blocks_first():
  """XAttention's find_blocks_chunked: first + diagonal (mass .04) count first, so .5 and .38 are
  taken (.54 < .9) and .08 is not (.92); ranking the forced blocks by their own mass instead
  would also keep .08 (.88 < .9). Threshold relative to the row's total mass."""
  mass = jnp.array([[.02, .5, .38, .08, .02], [.01, .25, .19, .04, .01]])
  forced = jnp.array([True, False, False, False, True])
  keep = np.asarray(masks.threshold_select(mass, jnp.broadcast_to(forced, mass.shape), 0.9))
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0, 1]] * 2)


def test_xa_chunked_scoring_is_bit_identical_to_one_chunk():
  """xa_keep / xa_lists for chunk sizes dividing nq or not (and >= nq: the single-chunk path,
  the former unchunked computation), GQA, T not a multiple of the block, a padded row."""
  B, T, N, K, H, blk, S = 2, 75, 4, 2, 8, 8, 4                           # nq = 10
  q = 2 * jax.random.normal(jax.random.PRNGKey(2), (B, T, N, H))
  k = 2 * jax.random.normal(jax.random.PRNGKey(3), (B, T, K, H))
  valid = jnp.arange(T)[None, :] < jnp.array([T, 61])[:, None]
  kw = dict(block=blk, stride=S, threshold=0.9)
  # xa_keep and xa_lists of one chunk size in one jitted program (eagerly: op by op)
  both = lambda c: jax.device_get(jax.jit(lambda a, b, v: (
      masks.xa_keep(a, b, v, q_chunk=c, **kw), masks.xa_lists(a, b, v, q_chunk=c, **kw)))(
          q, k, valid))
  whole, lists = both(10)
  assert whole.shape == (B, N, 10, 10) and 0.2 < whole.mean() < 0.9     # a real selection
  for c in (1, 3, 4, 7, 64):
    keep_c, lists_c = both(c)
    np.testing.assert_array_equal(keep_c, whole)
    np.testing.assert_array_equal(lists_c, lists)
  with pytest.raises(ValueError, match="q_chunk"):
    masks.xa_keep(q, k, valid, q_chunk=0, **kw)


def test_ssa_lists_sorted_unique_and_exact():
  lists = np.asarray(masks.ssa_lists(jnp.arange(0, 80, 8)[None], sinks=16, local=24, block=8))
  for i, row in enumerate(lists[0]):
    got = sorted(row[row >= 0].tolist())
    assert got == sorted(set(got))
    assert set(got) == {j for j in range(i + 1) if j < 2 or i - j < 3}


# ----------------------------------------------------------------------------------------------
# STE, Gumbel / tau, Lagrangian
# ----------------------------------------------------------------------------------------------
def test_ste_gradient_is_fa_minus_sa():
  """dL/db (router_fc3 bias) = sum_k dL/dfa_k * dfa_k/db with dL/dfa_k = <dL/dheads, FA - SA>
  over the group's heads (hard forward, soft gradient)."""
  cfg, layer, x, pos = _layer_setup("fa_ssa")
  fields = {"step": jnp.int32(0)}
  c = jax.random.normal(jax.random.PRNGKey(9), (cfg.hidden_size,))
  b0 = 1

  def loss(bias, which="out"):
    p = dict(layer, router=dict(layer["router"], router_fc3=dict(layer["router"]["router_fc3"],
                                                                 bias=bias)))
    out, aux = _apply(cfg, p, x, pos, train=True, seed=2, fields=fields)
    return jnp.sum(out[b0] @ c) if which == "out" else aux["fa_BK"][b0]
  bias = layer["router"]["router_fc3"]["bias"]
  got = np.asarray(jax.grad(loss)(bias))
  dfa_db = np.asarray(jax.jacobian(lambda b: loss(b, "fa"))(bias))        # [K, 2]
  _, aux = _apply(cfg, layer, x, pos, train=True, seed=2, fields=fields)
  ref = _reference(cfg, layer, x, pos, fa_BK=np.asarray(aux["fa_BK"]))
  dhead = np.einsum("nhd,d->nh", layer["self_attn"]["o_proj"]["kernel"], c)
  diff = np.asarray(ref["heads1"] - ref["heads0"])[b0]                    # [T, N, H]
  dL_dfa = np.einsum("nh,tnh->n", dhead, diff).reshape(cfg.num_kv_heads, -1).sum(1)
  want = dL_dfa @ dfa_db
  assert np.abs(want).max() > 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_gumbel_is_categorical_sampling_with_ste_and_tau_schedule():
  logits = jnp.array([0.4, -0.3])
  u = jax.random.uniform(jax.random.PRNGKey(0), (40000, 2))
  ste, hard = elastic.gumbel_ste(jnp.broadcast_to(logits, (40000, 2)), u, 1.3)
  np.testing.assert_array_equal(ste, hard)  # forward = the hard decision
  assert abs(float(hard.mean()) - float(jax.nn.softmax(logits)[1])) < 0.01  # Gumbel-max
  g = jax.grad(lambda l: elastic.gumbel_ste(l, u[:1], 1.3)[0][0])(logits)
  eps = 1e-10
  soft = lambda l: jax.nn.softmax((l - jnp.log(-jnp.log(u[0] + eps) + eps)) / 1.3)[1]
  np.testing.assert_allclose(g, jax.grad(soft)(logits), rtol=1e-5)
  o = elastic.ElasticOptions(anneal_steps=100)
  taus = [float(elastic.tau_at(s, o)) for s in (0, 50, 100, 250)]
  np.testing.assert_allclose(taus, [1.5, 1.25, 1.0, 1.0], atol=1e-6)
  oe = elastic.ElasticOptions(anneal_steps=100, tau_schedule="exp")
  np.testing.assert_allclose(float(elastic.tau_at(30, oe)), 1.5 * np.exp(-0.6 * 0.3), rtol=1e-6)
  assert float(elastic.tau_at(100, oe)) == 1.0
  assert float(elastic.tau_at(None, o)) == 1.0


def _aux(fa_LBK, lam):
  L, Bb, K = fa_LBK.shape
  return dict(fa_BK=fa_LBK, p_fa_BK=fa_LBK, rho_BN=jnp.zeros((L, Bb, 2 * K)), tau=jnp.ones(L),
              scheme={"lagrange": lam})


def test_lagrangian_value_and_ascent_direction():
  """The 'abs' form (authors' code) and the ascent plumbing: values, the flipped gradient, the
  param group, weight decay on the [2, tasks] leaf."""
  cfg = attention.configure(ModelConfig(), "elastic", task_names=("qa", "summ", "code"),
                               targets=(0.7, 1.0, 0.9), lagrangian="abs")
  lam = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
  fa = jnp.array([[[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])                # Omega 0, .5, .5
  batch = {"task_ids": jnp.array([0, 0, 1])}                               # code absent
  loss, m = elastic.aux_loss(_aux(fa, lam), batch, 0, cfg)
  qa = (0.1 * 0.7 + 0.4 * 0.49 + 0.1 * 0.2 + 0.4 * 0.04) / 2
  summ = 0.2 * 0.5 + 0.5 * 0.25
  np.testing.assert_allclose(float(loss), (qa + summ) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["elastic/msr_sum_task"], [0.5, 0.5, 0.0])
  np.testing.assert_allclose(float(m["elastic/msr/qa"]), 0.25)
  # the signed form (paper eq. 8, the default): lambda1 times the signed violation
  signed = attention.configure(ModelConfig(), "elastic", task_names=("qa", "summ", "code"),
                               targets=(0.7, 1.0, 0.9))
  assert attention.options(signed).lagrangian == "signed"
  qa_s = (0.1 * -0.7 + 0.4 * 0.49 + 0.1 * -0.2 + 0.4 * 0.04) / 2
  summ_s = 0.2 * -0.5 + 0.5 * 0.25
  np.testing.assert_allclose(float(elastic.aux_loss(_aux(fa, lam), batch, 0, signed)[0]),
                             (qa_s + summ_s) / 2, rtol=1e-6)
  with pytest.raises(ValueError, match=r"model.scheme.lagrangian='sign'.*\('signed', 'abs'\)"):
    attention.configure(ModelConfig(), "elastic", lagrangian="sign")
  # gradient ascent on lambda (declared by the scheme, Scheme.ascent_params: the train step
  # flips its gradient): under 'abs' lambdas of a task missing its target grow, the absent
  # task's stay; the router's gradient pushes Omega toward the target
  from condattn_jax.attention import get_scheme
  from condattn_jax.train import step as step_lib
  params = {"scheme": {"lagrange": lam}, "w": jnp.zeros((2, 2))}
  group = dict(regex="scheme/lagrange", lr=1e-2, weight_decay=0.1)
  tc = ConfigDict(dict(lr=1e-3, num_steps=10, warmup_frac=0.0, warmup_steps=None,
                       lr_schedule="constant", end_lr_frac=0.0, grad_clip=5.0, weight_decay=0.0,
                       b1=0.9, b2=0.95, eps=1e-8, trainable_regex="w",
                       param_groups={"lagrange": group}))
  tx, labels, _ = opt_lib.make_optimizer(tc, params)
  assert labels["scheme"]["lagrange"] == "lagrange"
  grads = jax.grad(lambda p: elastic.aux_loss(_aux(fa, p["scheme"]["lagrange"]), batch, 0,
                                              cfg)[0])(params)
  g = np.asarray(grads["scheme"]["lagrange"])
  assert (g[:, :2] > 0).all() and (g[:, 2] == 0).all()
  scheme = get_scheme("elastic")
  flipped = step_lib.ascent_flip(grads, scheme)
  np.testing.assert_array_equal(flipped["scheme"]["lagrange"], -g)
  np.testing.assert_array_equal(flipped["w"], grads["w"])
  step_lib.check_ascent_groups(scheme, tc, labels)
  # a recipe asking for the ascent again would flip it back: refused, naming the group
  tc_twice = ConfigDict(tc.to_dict())
  tc_twice.param_groups.lagrange.maximize = True
  with pytest.raises(ValueError, match="param_groups.lagrange.maximize=True.*drop maximize"):
    step_lib.check_ascent_groups(scheme, tc_twice, labels)
  upd, _ = tx.update(flipped, tx.init(params), params)
  new = np.asarray(optax.apply_updates(params, upd)["scheme"]["lagrange"])
  assert (new[:, :2] > np.asarray(lam)[:, :2]).all()
  assert (new[:, 2] < np.asarray(lam)[:, 2]).all()  # only weight decay: the [2, tasks] leaf decays
  for c in (cfg, signed):
    d_fa = jax.grad(lambda f: elastic.aux_loss(_aux(f, lam), batch, 0, c)[0])(fa)
    assert (np.asarray(d_fa)[0, :2] > 0).all()  # qa rows (Omega < 0.7): raising FA raises loss
    assert (np.asarray(d_fa)[0, 2] > 0).all()   # summ row (Omega .5 < 1): more SA lowers it


def _ascend(cfg, fa_LBK, lam, batch, steps=20, lr=1e-2):
  """`steps` steps of the train step's ascent on lambda alone (Adam, no weight decay, the router
  frozen: Omega fixed) -> lambda [2, tasks] after each step."""
  from condattn_jax.attention import get_scheme
  from condattn_jax.train import step as step_lib
  tx = optax.adam(lr)
  params = {"scheme": {"lagrange": lam}}
  state = tx.init(params)
  grad = jax.jit(jax.grad(lambda p: elastic.aux_loss(_aux(fa_LBK, p["scheme"]["lagrange"]),
                                                     batch, 0, cfg)[0]))
  out = []
  for _ in range(steps):
    g = step_lib.ascent_flip(grad(params), get_scheme("elastic"))
    upd, state = tx.update(g, state, params)
    params = optax.apply_updates(params, upd)
    out.append(np.asarray(params["scheme"]["lagrange"]))
  return np.stack(out)


@pytest.mark.parametrize("where", ["below", "on", "above", "mixed_on_mean"])
def test_signed_lagrangian_moves_lambda_toward_reducing_the_violation(where):
  """Signed (paper eq. 8): the ascent moves lambda1 by the signed violation, so after the steps
  the Lagrangian's pull on Omega (d term / d Omega = lambda1 + 2 lambda2 (Omega - t)) points
  toward the target, and on target (every row, or rows on both sides averaging to it: lambda1
  sees the batch mean) lambda1 stays put. 'abs' (authors' code) grows lambda1 in every case
  with a violation, the mixed one included: the old 'np.diff(lam) > 0' test held whatever
  Omega did, this one fails if the signed form does not follow Omega."""
  t = 0.5
  omegas = {"below": [0.25, 0.25], "on": [0.5, 0.5], "above": [0.75, 0.75],
            "mixed_on_mean": [0.25, 0.75]}[where]
  # Omega_b = class-0 fraction of 4 KV heads in one layer: fa rows with round(4 (1 - Omega)) ones
  fa = jnp.asarray([[[1.0] * int(round(4 * (1 - w))) + [0.0] * int(round(4 * w))
                     for w in omegas]])
  batch = {"task_ids": jnp.array([0, 0])}
  lam0 = jnp.array([[0.3], [0.3]])
  signed = attention.configure(ModelConfig(), "elastic", task_names=("x",), targets=(t,))
  lam = _ascend(signed, fa, lam0, batch)
  d1 = lam[-1, 0, 0] - 0.3
  if where == "below":      # Omega < t: lambda1 falls (a negative lambda1 pushes Omega up)
    assert d1 < -0.1, lam[:, 0, 0]
  elif where == "above":    # Omega > t: lambda1 grows (pushes Omega down)
    assert d1 > 0.1, lam[:, 0, 0]
  else:                     # on target (per row or on the batch mean): lambda1 stays put
    np.testing.assert_allclose(lam[:, 0, 0], 0.3, atol=1e-6)
  if where == "on":
    np.testing.assert_allclose(lam[:, 1, 0], 0.3, atol=1e-6)  # no violation: lambda2 too
  # the pull on Omega after the steps points at the target
  omega_mean = float(np.mean(omegas))
  pull = lam[-1, 0, 0] + 2 * lam[-1, 1, 0] * (omega_mean - t)
  if where == "below":
    assert pull < 0
  elif where == "above":
    assert pull > 0
  # 'abs': lambda1 only grows while any row misses (the authors' code)
  absolute = attention.configure(ModelConfig(), "elastic", task_names=("x",), targets=(t,),
                                 lagrangian="abs")
  lam_abs = _ascend(absolute, fa, lam0, batch)
  if where == "on":
    np.testing.assert_allclose(lam_abs[:, 0, 0], 0.3, atol=1e-6)
  else:
    assert (np.diff(lam_abs[:, 0, 0]) > 0).all()


def test_unknown_task_name_is_a_one_line_error():
  np.testing.assert_array_equal(elastic.task_ids(["summ", "qa", "qa"], ("qa", "summ")), [1, 0, 0])
  with pytest.raises(ValueError, match=r"task 'poem' is not one of .*\['qa', 'summ'\]") as e:
    elastic.task_ids(["qa", "poem"], ("qa", "summ"))
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="targets"):
    elastic.ElasticOptions(task_names=("a", "b"), targets=(0.7,))
  with pytest.raises(ValueError, match="modes"):
    attention.configure(ModelConfig(), "elastic", modes="fa_moba")


def test_report_msr_esr_per_task_and_heatmap(tmp_path):
  dcfg, dp, tok = _dense("qwen3")
  ecfg, ep = attention.convert(jax.tree.map(np.asarray, dp), dcfg, "elastic", modes="fa_ssa",
                                      seed=3, **SMALL)
  ep["layers"]["router"]["router_fc3"]["kernel"] = ep["layers"]["router"]["router_fc3"]["kernel"] * 300
  batches = [dict(inputs=np.asarray(tok), task_ids=np.array([0, 1, 0, 1]))]
  rep = elastic.sparsity_report(Decoder(ecfg), ep, batches, out_dir=str(tmp_path))
  _, aux = jax.jit(Decoder(ecfg).apply)({"params": ep}, tok)
  fa = np.asarray(aux["fa_BK"])
  np.testing.assert_allclose(rep["omega_msr"], 1 - fa.mean(), atol=1e-6)
  np.testing.assert_allclose(rep["tasks"]["robust"]["omega_msr"], 1 - fa[:, 1::2].mean(), atol=1e-6)
  np.testing.assert_allclose(rep["omega_esr"], float(np.asarray(aux["rho_BN"]).mean()), atol=1e-6)
  assert np.asarray(rep["fa_freq"]).shape == (ecfg.num_layers, ecfg.num_heads)
  assert (tmp_path / "elastic_sparsity.png").stat().st_size > 1000
  kv = elastic.kv_cache_bytes(ecfg, 1024)
  assert kv["full"] == 2 * ecfg.num_layers * 1024 * ecfg.num_kv_heads * ecfg.head_dim * 4


def test_pooling_boundary_and_prompt_mean_over_the_prompt():
  """boundary: mean over the first / last `boundary` valid tokens of the prompt (the union when
  they overlap); prompt_mean: all of them; padding and tokens past prompt_lengths never count."""
  k = jax.random.normal(jax.random.PRNGKey(0), (3, 12, 2, 4))
  valid = np.arange(12)[None] < np.array([[12], [9], [4]])
  plen = np.array([10, 12, 4])
  ob = elastic.ElasticOptions(boundary=3)
  om = elastic.ElasticOptions(pooling="prompt_mean")
  got_b = np.asarray(elastic.pool_keys(k, valid, plen, ob))
  got_m = np.asarray(elastic.pool_keys(k, valid, plen, om))
  got_all = np.asarray(elastic.pool_keys(k, valid, None, om))
  kn = np.asarray(k)
  for b, n in enumerate([10, 9, 4]):
    idx = sorted(set(range(3)) | set(range(n - 3, n)))
    np.testing.assert_allclose(got_b[b], kn[b, idx].mean(0), atol=1e-6)
    np.testing.assert_allclose(got_m[b], kn[b, :n].mean(0), atol=1e-6)
  np.testing.assert_allclose(got_all[0], kn[0].mean(0), atol=1e-6)


def test_fixed_routing_is_a_static_head_split():
  """routing='fixed': the listed KV heads are class 1 in every row (the per-head reference with
  that decision), the others class 0; bad head indices and a list without 'fixed' are errors."""
  cfg, layer, x, pos = _layer_setup("fa_ssa")
  fcfg = attention.configure(cfg, "elastic", routing="fixed", fixed_fa_kv_heads=(1,))
  out, aux = _apply(fcfg, layer, x, pos)
  np.testing.assert_array_equal(aux["fa_BK"], np.tile([0.0, 1.0], (B, 1)))
  ref = _reference(cfg, layer, x, pos, fa_BK=np.tile(np.float32([0, 1]), (B, 1)))
  np.testing.assert_allclose(out, ref["out"], atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match=r"fixed_fa_kv_heads has \[2\]: KV heads are 0..1"):
    _apply(attention.configure(cfg, "elastic", routing="fixed", fixed_fa_kv_heads=(0, 2)), layer, x, pos)
  with pytest.raises(ValueError, match="needs routing='fixed'"):
    attention.configure(cfg, "elastic", fixed_fa_kv_heads=(0,))


def test_fixed_routing_per_layer_head_sets():
  """fixed_fa_kv_heads as one tuple per layer: each scanned layer takes its own split (an Omega
  between the 1/K steps); the wrong number of tuples is a one-line error naming num_layers."""
  dcfg, dp, tok = _dense("qwen3")
  L = dcfg.num_layers
  assert L >= 2
  per_layer = tuple((layer % 2,) for layer in range(L))
  ecfg, ep = attention.convert(jax.tree.map(np.asarray, dp), dcfg, "elastic", modes="fa_ssa",
                                      routing="fixed", fixed_fa_kv_heads=per_layer, **SMALL)
  _, aux = jax.jit(Decoder(ecfg).apply)({"params": ep}, tok)
  want = np.stack([np.tile(np.float32([1 - layer % 2, layer % 2]), (B, 1)) for layer in range(L)])
  np.testing.assert_array_equal(np.asarray(aux["fa_BK"]), want)
  bad = attention.configure(ecfg, "elastic", fixed_fa_kv_heads=per_layer + ((0,),))
  with pytest.raises(ValueError, match=f"{L + 1} per-layer tuples; the model has num_layers={L}"):
    jax.jit(Decoder(bad).apply)({"params": ep}, tok)


def test_task_mean_constraint_is_one_constraint_on_the_batch_mean_omega():
  """constraint='task_mean' with one task name: rows on both sides of the target whose MEAN is on
  target cost nothing and every row gets the same pull (lambda1's on the mean: the router may
  allocate sparsity between rows);
  per-sample ('sample') the same rows are each pulled toward t. Mean off target: the term is
  lambda1 (mean - t) + lambda2 (mean - t)^2."""
  fa = jnp.asarray([[[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])       # Omega .25, .75
  lam = jnp.array([[0.3], [0.7]])
  batch = {"task_ids": jnp.array([0, 0])}
  one = attention.configure(ModelConfig(), "elastic", task_names=("any",), targets=(0.5,),
                            constraint="task_mean")
  per = attention.configure(ModelConfig(), "elastic", task_names=("any",), targets=(0.5,))
  loss_one = lambda f, c: elastic.aux_loss(_aux(f, lam), batch, 0, c)[0]
  assert float(loss_one(fa, one)) == 0.0
  np.testing.assert_allclose(float(loss_one(fa, per)), 0.7 * 0.0625, rtol=1e-6)
  d_one = np.asarray(jax.grad(loss_one)(fa, one))  # only lambda1's pull on the mean: the same
  np.testing.assert_allclose(d_one, -0.3 / 8)      # for every row (no row pulled toward t)
  d_per = np.asarray(jax.grad(loss_one)(fa, per))
  # each row pulled toward t: less FA for the row below t (Omega .25), more for the one above
  assert (d_per[0, 0] > 0).all() and (d_per[0, 1] < 0).all()
  off = jnp.asarray([[[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]]])      # mean .375
  np.testing.assert_allclose(float(loss_one(off, one)), 0.3 * -0.125 + 0.7 * 0.015625, rtol=1e-6)
  with pytest.raises(ValueError, match=r"model.scheme.constraint='mean'.*\('sample', 'task_mean'\)"):
    attention.configure(ModelConfig(), "elastic", constraint="mean")
