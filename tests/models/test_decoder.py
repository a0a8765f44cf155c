"""Decoder: the four families build, decode equals the full forward, documents never mix, layers
are scanned (one traced body whatever the layer count), per-layer <-> stacked params round-trip."""
import numpy as np
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import pytest

from condattn_jax.models import stacking
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

FAMILIES = {
    "llama": dict(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8)),
    "qwen2": dict(attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(qk_norm="full", post_norm=True),
}


def _model(family, **kw):
  cfg = ModelConfig(family=family).replace(**FAMILIES[family], **kw)
  m = Decoder(cfg)
  tok = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, cfg.vocab_size)
  params = nn.unbox(jax.jit(m.init)(jax.random.PRNGKey(1), tok)["params"])
  return m, params, tok


# every family once, each window mode on two families (the window ring does not depend on the
# family; the full grid cost ~4 minutes of CI for no extra coverage)
# (qwen3 without a window is `manual`: it is the dense scheme's tiny model, whose generation
# tests/schemes/test_conformance.py::test_generation_equals_the_declared_forward[dense-*] checks)
@pytest.mark.parametrize("family,window", [("llama", None), ("qwen2", 5),
                                           pytest.param("qwen3", None, marks=pytest.mark.manual),
                                           ("olmo2", 5)])
def test_decode_equals_full_forward(family, window):
  # jitted: one compile each for the forward, the 7-token prefill and the 1-token step (eager
  # apply dispatches op by op)
  m, params, tok = _model(family, sliding_window=window)
  full, _ = jax.jit(lambda p, t: m.apply({"params": p}, t))(params, tok)
  prefill = jax.jit(lambda p, t: m.apply({"params": p}, t, decode=True, cache_len=16,
                                         mutable=["cache"]))
  step = jax.jit(lambda p, c, t, pos: m.apply({"params": p, "cache": c}, t, pos, decode=True,
                                              cache_len=16, mutable=["cache"]))
  logits, v = prefill(params, tok[:, :7])
  steps = [logits]
  for t in range(7, 16):
    (lg, _), v = step(params, v["cache"], tok[:, t:t + 1], jnp.full((2, 1), t))
    steps.append(lg)
  np.testing.assert_allclose(jnp.concatenate([steps[0][0]] + steps[1:], 1), full, atol=1e-4)


@pytest.mark.manual
def test_packed_documents_do_not_interact():
  """Logits of a packed row equal the logits of each document run alone. Manual: the default
  cover is tests/schemes/test_conformance.py::test_packed_documents_are_independent[dense] (the
  dense scheme's tiny qwen3 model, two packed documents and padding)."""
  m, params, tok = _model("qwen3")
  a, b = tok[0, :9], tok[1, :7]
  packed = jnp.concatenate([a, b])[None]
  seg = jnp.array([[1] * 9 + [2] * 7])
  pos = jnp.array([list(range(9)) + list(range(7))])
  fwd = jax.jit(lambda *x: m.apply({"params": params}, *x)[0])
  out, alone_a, alone_b = fwd(packed, pos, seg), fwd(a[None]), fwd(b[None])
  np.testing.assert_allclose(out[0, :9], alone_a[0], atol=1e-5)
  np.testing.assert_allclose(out[0, 9:], alone_b[0], atol=1e-5)


def test_params_carry_logical_axes():
  cfg = ModelConfig(family="qwen2", attention_bias=True)
  boxed = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
  specs = nn.get_partition_spec(boxed)["params"]
  q = ("layers", "embed", "q_heads", "head_dim")
  assert tuple(specs["layers"]["self_attn"]["q_proj"]["kernel"]) == q
  assert tuple(specs["layers"]["mlp"]["down_proj"]["kernel"]) == ("layers", "mlp", "embed")
  assert tuple(specs["embed_tokens"]["embedding"]) == ("vocab", "embed")


def test_bf16_compute_with_fp32_master_params():
  m, params, tok = _model("llama", dtype="bfloat16")
  assert params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.float32
  logits, _ = jax.jit(lambda p: m.apply({"params": p}, tok))(params)
  ref, _ = jax.jit(lambda p: Decoder(m.config.replace(dtype="float32")).apply({"params": p}, tok))(
      params)
  assert logits.dtype == jnp.float32
  assert float(jnp.abs(logits - ref).max()) < 0.05


def test_bad_config_names_the_field():
  with pytest.raises(ValueError, match="model.family"):
    ModelConfig(family="gpt2")
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(num_heads=4, num_kv_heads=3)


def _count_eqns(jaxpr) -> int:
  n = 0
  for e in jaxpr.eqns:
    n += 1
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      n += _count_eqns(sub)
  return n


@pytest.mark.parametrize("remat", ["none", "full"])
def test_layers_are_scanned_not_unrolled(remat):
  """The traced program (what XLA compiles) has the same size for 2 and 12 layers."""
  sizes = []
  for L in (2, 12):
    cfg = ModelConfig(num_layers=L, remat_policy=remat)
    tok = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(0), tok)))
    jaxpr = jax.make_jaxpr(lambda p: jax.grad(
        lambda p: Decoder(cfg).apply(p, tok)[0].sum())(p))(params)
    sizes.append(_count_eqns(jaxpr.jaxpr))
    assert params["params"]["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == L
  assert sizes[0] == sizes[1], sizes


def test_stacked_and_per_layer_params_round_trip():
  m, params, tok = _model("qwen3")
  per = stacking.unstack_layers(params, m.config.num_layers)
  assert sorted(k for k in per if k.startswith("layers")) == ["layers_0", "layers_1"]
  np.testing.assert_array_equal(per["layers_1"]["mlp"]["up_proj"]["kernel"],
                                params["layers"]["mlp"]["up_proj"]["kernel"][1])
  back = stacking.to_model_layout(per, m.config)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  # a per-layer tree runs the same model once restacked; groups split where variants change
  assert stacking.layer_groups(["a", "a", "b", "a"]) == [(0, 2, "a"), (2, 3, "b"), (3, 4, "a")]
  regrouped = stacking.stack_layers(per, ["x", "y"])
  assert sorted(k for k in regrouped if k.startswith("layers")) == ["layers_0_1", "layers_1_2"]
  with pytest.raises(ValueError, match="3 layers"):
    stacking.stack_layers(per, ["x"] * 3)
