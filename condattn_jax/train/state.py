"""TrainState: the whole mutable state of a run (the data iterator state is saved beside it).

The step RNG is not stored: it is `fold_in(key(train.seed), step)`, identical on every replica
and after a resume.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: number of updates applied
  params: Any  # plain (unboxed) param tree, sharded by the logical rules
  opt_state: Any  # optax state; frozen params have none


def step_rng(seed: int, step) -> jax.Array:
  """The RNG of update `step` (a typed key): same on every process, exact on resume."""
  return jax.random.fold_in(jax.random.key(seed), jnp.asarray(step, jnp.uint32))
