"""configs/match_qwen.py: pinned numbers, the three Qwen3 variants' SWA / full layer patterns
(through the run config -> ModelConfig path), required fields, and the tiny variant's forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from _train_helpers import random_params, recipe_loader
from condattn_jax import attention
from condattn_jax.attention import match
from condattn_jax.data.config import is_required_marker
from condattn_jax.train import config as config_lib

recipe = recipe_loader("match_qwen.py")


def test_variants_and_pinned_numbers():
  for variant, n_full in (("", 18), ("qwen3-8b-swa0.8", 7), ("qwen3-8b-allswa", 0)):
    c = recipe(variant)
    s = c.model.scheme
    assert (s.name, s.chunk, s.top_k, s.retriever, s.window) == ("match", 128, 4, "minilm", 2048)
    assert is_required_marker(s.retriever_kwargs.tokenizer)
    assert is_required_marker(c.model.init_from) and is_required_marker(c.data.paths)
    c.model.init_from = None  # the architecture from the fields (Qwen3-8B: 36 layers)
    c.model.num_layers = 36
    mc, _ = config_lib.model_config(c)
    kinds = match.layer_kinds(mc)
    assert kinds.count("full") == n_full, (variant, kinds)
  v = recipe("qwen3-8b-swa0.8,window=4096,top_k=8")
  assert (v.model.scheme.window, v.model.scheme.top_k) == (4096, 8)


def test_tiny_variant_runs():
  c = recipe("tiny")
  mc, _ = config_lib.model_config(c)
  o = attention.options(mc)
  assert (o.window, o.chunk, o.top_k, o.retriever, mc.num_layers) == (32, 2, 4, "exact", 2)
  from condattn_jax.models.decoder import Decoder
  tok = jnp.ones((1, 96), jnp.int32)
  # host random params on the init's shapes (eval_shape: no init program compiled)
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(mc).init(jax.random.PRNGKey(0), tok)))
  params = {"params": random_params(shapes["params"])}
  logits, aux = jax.jit(Decoder(mc).apply)(params, tok)
  assert logits.shape == (1, 96, 128) and aux["retrieved"].shape == (2,)
