"""The L2A train step under the 8-device CPU mesh (data=2, fsdp=2, tensor=2) with the global
branch on the Pallas compacted-query kernel (model.scheme.compact_impl='pallas': on CPU the
kernel runs in Pallas interpret mode, per shard in jax.shard_map) gives the same loss, gradients,
metrics and updated params as the unsharded run on the reference attention (one device); params,
batches and Adam moments really are sharded by the rules table. (The suite's one compiled
sharded-equivalence run: the L2A decoder's dense parameters and local attention are the dense
model's; tests/train/test_train_sharding.py keeps the layout rules that need no compilation.)"""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _train_helpers import ROOT, assert_trees_close, host, host_init, synthetic_batch
from condattn_jax.data import make_global_batch
from condattn_jax.train import loop
from condattn_jax.train import sharding as shd
from condattn_jax.train.cli import load_recipe
from condattn_jax.train.step import make_loss_and_grads

# tiny L2A recipe: 2 layers, 4 query / 2 kv heads (head_dim 16), window 4, MQAR rows of 32 tokens
ARG = "tiny,steps=4,batch=8,seq=32,pairs=4,gap=8,window=4"


def _config(compact_impl, mesh):
  c = load_recipe(f"{ROOT}/configs/l2a_qwen.py:{ARG}")
  c.model.scheme.compact_impl = compact_impl
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.train.progress_bar = False
  return c


def _random_router(params, scale=0.3):
  """A random router kernel (the zero init routes every token global: no real active set).
  Per-layer or stacked layout alike: every leaf named router/kernel."""
  def one(path, x):
    if "router" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path):
      return scale * jax.random.normal(jax.random.key(3), x.shape, x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(one, params)


def _run(setup, state, batch):
  """(grads, metrics) of loss_and_grads at step 0, then two train steps of the loop's jitted step
  (metrics of both, params after the second); plus the program's jaxpr. loss_and_grads and the
  step are jitted functions called inside ONE jitted program (one compilation: XLA shares their
  common forward / backward), which keeps the step's in / out shardings."""
  gbatch = make_global_batch(batch, setup.batch_sharding, batch["inputs"].shape[0])
  lg = jax.jit(make_loss_and_grads(setup.model_cfg, setup.config.train),
               in_shardings=(setup.param_shardings, setup.batch_sharding, None),
               out_shardings=(setup.param_shardings, None))
  step = loop.jit_train_step(setup)
  both = jax.jit(lambda s, b: (lg(s.params, b, s.step), step(s, b)))
  with shd.mesh_context(setup.mesh):
    traced = both.trace(state, gbatch)
    compiled = traced.lower().compile()
    (grads, metrics), (s1, m1) = compiled(state, gbatch)
    _, (s2, m2) = compiled(s1, gbatch)
  return dict(grads=host(grads), metrics=host(metrics), m1=host(m1), m2=host(m2),
              params=host(s2.params), jaxpr=str(traced.jaxpr), state=s2)


@pytest.fixture(scope="module")
def runs():
  c1 = _config("reference", (1, 1, 1))
  one = loop.build(c1, devices=[jax.devices()[0]])
  # the init's distributions drawn on the host (no init program), the router randomised
  state = loop.init_state(one, _random_router(host_init(one.model_cfg, seed=0)))
  batch = synthetic_batch(c1)
  eight = loop.build(_config("pallas", (2, 2, 2)))
  state8 = jax.device_put(host(state), eight.state_shardings)  # same values, sharded
  return dict(one=_run(one, state, batch), eight=_run(eight, state8, batch), eight_setup=eight)


def test_the_sharded_step_runs_the_pallas_kernel_per_shard(runs):
  s = runs["eight_setup"]
  assert dict(s.mesh.shape) == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
  assert s.model_cfg.scheme == "l2a"
  jaxpr = runs["eight"]["jaxpr"]
  assert "pallas_call" in jaxpr and "shard_map" in jaxpr
  assert "pallas_call" not in runs["one"]["jaxpr"]  # the reference run really is the reference
  # the steps took the compacted path with a real mix of decisions (not all / no tokens global)
  m = runs["eight"]["metrics"]
  assert 0.2 < float(m["l2a/sparsity"]) < 0.8, float(m["l2a/sparsity"])
  assert float(runs["eight"]["m1"]["l2a/forced_frac"]) < 1.0


def test_params_batches_and_moments_are_sharded(runs):
  """The rules table on the 2x2x2 mesh (moved from test_train_sharding.py, same specs)."""
  s = runs["eight_setup"]
  sh = s.param_shardings
  assert sh["embed_tokens"]["embedding"].spec == P("tensor", "fsdp")  # vocab, embed
  # scanned layers: a leading (unsharded) layer axis, then the per-layer rule
  assert sh["layers"]["self_attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
  assert sh["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
  assert sh["norm"]["scale"].spec == P()
  assert s.batch_sharding.spec == P(("data", "fsdp"))
  # the updated params keep their layout, and Adam moments follow their params
  new = runs["eight"]["state"]
  g = new.params["layers"]["mlp"]["up_proj"]["kernel"]
  assert g.sharding.spec == P(None, "fsdp", "tensor")
  mus = [x for x in jax.tree.leaves(new.opt_state) if getattr(x, "shape", None) == g.shape]
  assert mus and all(m.sharding.spec == P(None, "fsdp", "tensor") for m in mus)


def test_same_loss_gradients_and_metrics_as_the_unsharded_reference(runs):
  a, b = runs["one"], runs["eight"]
  for k in ("loss", "ce", "aux_loss", "accuracy", "l2a/sparsity", "l2a/router_p",
            "l2a/sparsity_layer_0", "l2a/sparsity_layer_1"):
    np.testing.assert_allclose(b["metrics"][k], a["metrics"][k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert_trees_close(b["grads"], a["grads"], atol=1e-5)
  # the router gets a gradient (through the STE and the regulariser), and it is the same
  router = [x for p, x in jax.tree_util.tree_flatten_with_path(a["grads"])[0]
            if "router" in jax.tree_util.keystr(p)]
  assert router and all(np.abs(x).max() > 0 for x in router)


def test_same_train_steps_as_the_unsharded_reference(runs):
  a, b = runs["one"], runs["eight"]
  for m in ("m1", "m2"):
    for k in ("loss", "grad_norm", "accuracy", "lr", "l2a/sparsity", "l2a/forced_frac"):
      np.testing.assert_allclose(b[m][k], a[m][k], rtol=1e-5, atol=1e-6, err_msg=f"{m} {k}")
  # after two AdamW steps (update ~ lr * m / sqrt(v), lr 3e-3): near-zero gradients turn float
  # rounding into update differences of ~1e-5 even between two correct runs (measured 1.2e-5
  # with the sharded reference); a wrong gradient moves a param by up to 2 * lr per step
  assert_trees_close(b["params"], a["params"], atol=5e-5)
