"""Sharding: a (data=2, fsdp=2, tensor=2) mesh over 8 host CPU devices gives the same loss,
gradients and updated params as one device; params really are sharded by the rules table."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _train_helpers import assert_trees_close, host, synthetic_batch, tiny
from condattn_jax.data import make_global_batch
from condattn_jax.train import loop
from condattn_jax.train import sharding as shd
from condattn_jax.train.step import make_loss_and_grads


def _sharded_setup(config, shape):
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = shape
  return loop.build(config)


@pytest.fixture(scope="module")
def runs():
  c1 = tiny()
  one = loop.build(c1, devices=[jax.devices()[0]])
  state1 = loop.init_state(one)
  batch = synthetic_batch(c1)
  c8 = tiny()
  eight = _sharded_setup(c8, (2, 2, 2))
  # Same values, laid out on the 8-device mesh.
  state8 = jax.device_put(host(state1), eight.state_shardings)
  out = {}
  for name, setup, state in (("one", one, state1), ("eight", eight, state8)):
    gbatch = make_global_batch(batch, setup.batch_sharding, 16)
    lg = jax.jit(make_loss_and_grads(setup.model_cfg, setup.config.train),
                 in_shardings=(setup.param_shardings, setup.batch_sharding, None),
                 out_shardings=(setup.param_shardings, None))
    with shd.mesh_context(setup.mesh):
      grads, metrics = lg(state.params, gbatch, 0)
      new_state, step_metrics = loop.jit_train_step(setup)(state, gbatch)
    out[name] = dict(grads=grads, metrics=metrics, new=new_state, step_metrics=step_metrics,
                     setup=setup)
  return out


def test_params_and_batches_are_sharded(runs):
  s = runs["eight"]["setup"]
  sh = s.param_shardings
  assert sh["embed_tokens"]["embedding"].spec == P("tensor", "fsdp")  # vocab, embed
  # scanned layers: a leading (unsharded) layer axis, then the per-layer rule
  assert sh["layers"]["self_attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
  assert sh["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
  assert sh["norm"]["scale"].spec == P()
  assert s.batch_sharding.spec == P(("data", "fsdp"))
  # Adam moments follow their params.
  g = runs["eight"]["new"].params["layers"]["mlp"]["up_proj"]["kernel"]
  assert g.sharding.spec == P(None, "fsdp", "tensor")
  mus = [x for x in jax.tree.leaves(runs["eight"]["new"].opt_state)
         if getattr(x, "shape", None) == g.shape]
  assert mus and all(m.sharding.spec == P(None, "fsdp", "tensor") for m in mus)


def test_same_loss_and_gradients_as_one_device(runs):
  a, b = runs["one"], runs["eight"]
  np.testing.assert_allclose(b["metrics"]["loss"], a["metrics"]["loss"], rtol=1e-5, atol=1e-5)
  assert_trees_close(b["grads"], a["grads"], atol=1e-5)


def test_same_train_step_as_one_device(runs):
  a, b = runs["one"], runs["eight"]
  for k in ("loss", "grad_norm", "accuracy", "lr"):
    np.testing.assert_allclose(b["step_metrics"][k], a["step_metrics"][k], rtol=1e-5, atol=1e-6)
  # AdamW's first update is lr * g / (|g| + eps): where |g| is at float-rounding level its sign
  # (and so the update) is noise, so params are compared where the gradient is clearly non-zero
  # (the gradients themselves are compared everywhere above).
  ga, pa, pb = host(a["grads"]), host(a["new"].params), host(b["new"].params)
  checked = 0
  for (path, g), x, y in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(pa),
                             jax.tree.leaves(pb)):
    sure = np.abs(g) > 1e-4
    checked += int(sure.sum())
    np.testing.assert_allclose(y[sure], x[sure], atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert checked > 0.5 * sum(x.size for x in jax.tree.leaves(pa))


def test_mesh_fill_and_indivisible_dims_fall_back_to_replicated():
  c = tiny()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 8
  c.data.batch_size = 16
  s = loop.build(c)
  assert dict(s.mesh.shape) == {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 8}
  # 2 kv heads / 4 q heads cannot split 8 ways: replicated on 'tensor' instead of failing.
  for proj in ("q_proj", "k_proj"):
    spec = s.param_shardings["layers"]["self_attn"][proj]["kernel"].spec
    assert "tensor" not in jax.tree.leaves(tuple(spec)), spec
  # mlp (128) and vocab (64) do split 8 ways.
  assert "tensor" in s.param_shardings["layers"]["mlp"]["up_proj"]["kernel"].spec
