"""Shared helpers for the training / checkpoint / eval tests (not a test module)."""
import json
import os
import socket
import sys

import jax
import numpy as np
from _test_env import shared_cache_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "tests", "fixtures", "hf")


def tiny(arg="steps=8", **train):
  """configs/tiny.py with fast test settings (no periodic eval / checkpoints unless asked)."""
  from condattn_jax.train.cli import load_recipe
  c = load_recipe(os.path.join(ROOT, "configs", "tiny.py") + (":" + arg if arg else ""))
  c.train.log_every = 1
  c.train.checkpoint_every = 0
  c.train.progress_bar = False
  c.eval.at_end = False
  c.eval.context_lengths = ()
  c.eval.num_batches = 1
  for k, v in train.items():
    c.train[k] = v
  return c


def recipe_loader(recipe_file: str):
  """The tests/configs recipe tests' one loader: `recipe(arg='')` = load_recipe of
  configs/<recipe_file>[:arg] (a variant and overrides, e.g. recipe('tiny,steps=6'))."""
  path = os.path.join(ROOT, "configs", recipe_file)

  def recipe(arg=""):
    from condattn_jax.train.cli import load_recipe
    return load_recipe(path + (":" + arg if arg else ""))
  return recipe


def count_compiles():
  """(events, stop): `events` grows by one entry (its duration) per XLA backend compilation
  until stop() is called."""
  from jax._src import monitoring
  events = []

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(duration)
  monitoring.register_event_duration_secs_listener(listener)
  return events, lambda: monitoring.unregister_event_duration_listener(listener)


def host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def decoder_shapes(cfg):
  """Decoder(cfg)'s params as ShapeDtypeStructs (eval_shape of its init: nothing compiled)."""
  import flax.linen as nn
  import jax.numpy as jnp
  from condattn_jax.models.decoder import Decoder
  return nn.unbox(jax.eval_shape(lambda: Decoder(cfg).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))


def host_init(cfg, seed, *, numpy=False):
  """Decoder(cfg)'s params drawn on the host from its init's distributions (kernels and
  embeddings N(0, INIT_STD), norm scales 1, biases 0), as device arrays: the tree a jitted
  `Decoder(cfg).init` gives (decoder_shapes), without compiling the init program (~2-4 CPU-s a
  config on the test host). Dense leaves only (a scheme leaf is refused: convert dense params
  instead). numpy=True: the same values as numpy arrays (conversions, stacking and router
  draws on them then run in numpy, where on device arrays each eager jnp op compiles alone;
  jit takes them as they are)."""
  import jax.numpy as jnp
  from condattn_jax.models.layers import INIT_STD
  rng = np.random.default_rng(seed)

  def one(path, a):
    name = jax.tree_util.keystr(path)
    if name.endswith("['scale']") or name.endswith("['bias']"):
      return jnp.asarray(np.full(a.shape, 1.0 if name.endswith("['scale']") else 0.0, a.dtype))
    assert name.endswith("['kernel']") or name.endswith("['embedding']"), name
    return jnp.asarray(rng.normal(0.0, INIT_STD, a.shape), a.dtype)
  params = jax.tree_util.tree_map_with_path(one, decoder_shapes(cfg))
  return jax.tree.map(np.asarray, params) if numpy else params


def random_params(abstract, seed=0, router_std=None):
  """Host params of the abstract params' shapes (e.g. loop.build's `abstract_params`: no init
  program compiled) at the default init's scale: norm scales 1 + N(0, 0.1), every other leaf
  N(0, 0.1); router kernels N(0, router_std) when given (the zero init routes every token one
  way: no real active set)."""
  rng = np.random.default_rng(seed)

  def one(path, a):
    name = jax.tree_util.keystr(path)
    std = router_std if router_std is not None and "router" in name and "kernel" in name else 0.1
    return (rng.normal(size=a.shape) * std + (1.0 if name.endswith("['scale']") else 0.0)
            ).astype(a.dtype)
  return jax.tree_util.tree_map_with_path(one, abstract)


def assert_trees_close(a, b, atol, rtol=0.0):
  fa, ta = jax.tree_util.tree_flatten_with_path(host(a))
  fb, tb = jax.tree_util.tree_flatten_with_path(host(b))
  assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
  for (p, x), (_, y) in zip(fa, fb):
    np.testing.assert_allclose(x, y, atol=atol, rtol=rtol, err_msg=jax.tree_util.keystr(p))


def synthetic_batch(config, seed=0):
  """One global host batch of the config's data (first batch of the train iterator)."""
  from condattn_jax.data import make_train_iterator
  return next(make_train_iterator(config))


def subprocess_env(devices: int, **extra):
  env = dict(os.environ)
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  env["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={devices}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update({k: str(v) for k, v in extra.items()})
  return shared_cache_env(env, devices)


PY = sys.executable


def assert_l2a_pruning_kv_bytes(settings, layer_sparsity, pruning, ctx=131072):
  """bench/l2a_learning.py's pruning section, recomputed from the settings (a dict of its
  Settings): the claim bench/claims/l2a_learning.py checks on the recorded runs, as an assertion."""
  from bench.claims import ClaimFailed
  from bench.claims.l2a_learning import expect_l2a_pruning_kv_bytes
  try:
    expect_l2a_pruning_kv_bytes(settings, layer_sparsity, pruning, ctx)
  except ClaimFailed as e:
    raise AssertionError(str(e)) from None


def free_port() -> int:
  """A free TCP port on localhost (a jax.distributed coordinator for multi-process tests)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def logged_losses(workdir) -> dict:
  """{step: train/loss} from a run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
