"""Conformance, training half (the other checks: test_conformance.py): every registered scheme
with a `Scheme.tiny` factory has a tiny recipe (configs/<recipe>.py:tiny whose model.scheme.name
is the scheme; dense: configs/tiny.py) that runs three steps through train.loop.run with a finite
loss (or, for the schemes in LOOP_TESTED, the recipe test that already runs it for more steps),
and whose sharded train step cross-lowers for TPU and for CUDA from this host
(train.loop.export_train_step on a 2x2x2 mesh of abstract devices)."""
import functools
import glob
import os

import jax
import numpy as np
import pytest

from _train_helpers import ROOT
from condattn_jax import attention

attention._load_builtin()
NAMES = sorted(n for n, s in attention.SCHEMES.items() if s.tiny is not None)


# ------------------------------------------------------------------------------------ training
@functools.lru_cache(maxsize=None)
def recipes() -> dict:
  """scheme name -> the recipe whose tiny variant trains it (configs/tiny.py for dense)."""
  from condattn_jax.train.cli import load_recipe
  out = {"dense": os.path.join(ROOT, "configs", "tiny.py") + ":"}
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    if os.path.basename(path) != "tiny.py":
      out.setdefault(load_recipe(path + ":tiny").model.scheme.name, path + ":tiny,")
  return out


def tiny_recipe(name, steps=3):
  from condattn_jax.train.cli import load_recipe
  if name not in recipes():
    pytest.skip(f"no configs/*.py tiny recipe trains scheme {name!r}")
  c = load_recipe(recipes()[name] + f"steps={steps}")
  if c.train.get("warmup_steps") is not None:  # a recipe's fixed warmup longer than the run
    c.train.warmup_steps = min(int(c.train.warmup_steps), steps)
  c.train.log_every, c.train.checkpoint_every, c.train.progress_bar = 1, 0, False
  c.eval.at_end, c.eval.context_lengths, c.eval.num_batches = False, (), 1
  return c


# Schemes whose tiny recipe a recipe test already runs through train.loop.run (more steps, the
# same step / stopped_early / finite-loss assertions, and the scheme's own metrics): the
# three-step run below would compile the same train step again, so it runs for the others only.
LOOP_TESTED = {
    "dense": "tests/train/test_checkpoint.py::straight",
    "l2a": "tests/configs/test_l2a_recipe.py::test_tiny_recipe_trains_evaluates_and_prunes",
    "aha": "tests/configs/test_aha_recipe.py::test_tiny_recipe_router_learns",
    "elastic": "tests/configs/test_elastic_recipe.py::test_tiny_run_moves_omega_toward_the_target",
    "segmented": "tests/configs/test_segmented_recipe.py::"
                 "test_tiny_recipe_trains_through_the_segmented_forward",
}


@pytest.mark.parametrize("name", sorted(LOOP_TESTED))
def test_loop_tested_schemes_name_a_test_that_runs_their_tiny_recipe(name):
  """The test LOOP_TESTED names exists, runs the scheme's tiny recipe through train.loop.run and
  asserts the finished step (a renamed or rewritten test brings the three-step run back)."""
  path, func = LOOP_TESTED[name].split("::")
  src = open(os.path.join(ROOT, path)).read()
  body = src[src.index(f"def {func}("):]
  end = body.find("\ndef ", 1)
  body = body if end < 0 else body[:end]
  assert "loop.run(" in body and "stopped_early" in body, LOOP_TESTED[name]
  if name == "dense":
    assert "tiny(" in body, LOOP_TESTED[name]  # _train_helpers.tiny: configs/tiny.py
  else:
    recipe_file = os.path.basename(recipes()[name].split(":")[0])
    assert f'"{recipe_file}"' in src and 'recipe("tiny' in body, (LOOP_TESTED[name], recipe_file)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n not in LOOP_TESTED])
def test_three_steps_through_the_loop(name, tmp_path):
  """Rows of the tiny recipe's length and layout, 4 of them a batch (the recipe's 32 add step
  time, not code paths: the step's program is the same but for the batch dimension)."""
  from condattn_jax.train import loop
  c = tiny_recipe(name)
  c.data.batch_size = min(int(c.data.batch_size), 4)
  res = loop.run(c, str(tmp_path), devices=jax.devices()[:1])  # not sharding
  assert res["step"] == 3 and not res["stopped_early"]
  assert np.isfinite(res["train"]["loss"]), res["train"]


@functools.lru_cache(maxsize=None)
def sharded_setup(name):
  """loop.build of the scheme's tiny recipe on a 2x2x2 mesh (abstract: no weights), built once
  for both platforms' exports (export_train_step reads it, never changes it)."""
  from condattn_jax.train import loop
  c = tiny_recipe(name)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  return loop.build(c)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", NAMES)
def test_train_step_cross_lowers(name, platform):
  from condattn_jax.train import loop
  exp = loop.export_train_step(sharded_setup(name), platform)
  assert exp.platforms == (platform,) and exp.nr_devices == 8
