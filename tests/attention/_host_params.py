"""Dense decoder params without an init program (tests/attention helper, not a test module)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.models.decoder import Decoder
from condattn_jax.models.layers import INIT_STD


def host_init(cfg, seed):
  """Decoder(cfg)'s params drawn on the host from its init's distributions (kernels and
  embeddings N(0, INIT_STD), norm scales 1, biases 0), as device arrays: the tree a jitted
  `Decoder(cfg).init` gives (its shapes from eval_shape), without compiling the init program
  (~2-4 CPU-s a config on the test host). Dense leaves only (a scheme leaf is refused: convert
  dense params instead)."""
  shapes = nn.unbox(jax.eval_shape(lambda: Decoder(cfg).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  rng = np.random.default_rng(seed)

  def one(path, a):
    name = jax.tree_util.keystr(path)
    if name.endswith("['scale']") or name.endswith("['bias']"):
      return jnp.asarray(np.full(a.shape, 1.0 if name.endswith("['scale']") else 0.0, a.dtype))
    assert name.endswith("['kernel']") or name.endswith("['embedding']"), name
    return jnp.asarray(rng.normal(0.0, INIT_STD, a.shape), a.dtype)
  return jax.tree_util.tree_map_with_path(one, shapes)
