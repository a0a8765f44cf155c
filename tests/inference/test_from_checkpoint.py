"""Engine.from_checkpoint over a real train.py run (configs/tiny.py with scheme L2A, a few
steps, trained once for the module): the loaded engine generates what an Engine over the
checkpoint's params generates (== the full forward), from a workdir, its checkpoints/ dir or a
step dir; test-time scheme options reach the model; bad paths are one-line errors."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.inference import Engine
from condattn_jax.models.decoder import Decoder
from condattn_jax.train import loop
from tests._train_helpers import tiny

STEPS = 3
PROMPTS = [[3, 9, 17, 4, 22, 8, 1], [5, 6], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A tiny L2A run (window 4, so prompts longer than the window use both branches)."""
  wd = str(tmp_path_factory.mktemp("run"))
  c = tiny(f"steps={STEPS},seq=32", checkpoint_every=STEPS)
  c.model.scheme = ml_collections.ConfigDict(dict(name="l2a", window=4, theta=0.5))
  loop.run(c, wd)
  return wd


def test_loads_the_checkpoint_and_generates_like_the_full_forward(run):
  eng = Engine.from_checkpoint(run, cache_len=24)
  assert eng.step == STEPS and eng.tokenizer is None and eng.cache_len == 24
  assert eng.config.scheme == "l2a" and eng.config.scheme_options["window"] == 4
  _, params, step = loop.load_params(loop.config_from_checkpoint(run), run,
                                     devices=[jax.devices()[0]])
  assert step == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(eng.params), jax.device_get(params))
  gen = eng.generate(PROMPTS, 4, return_logits=True)
  for b, p in enumerate(PROMPTS):
    seq = p + gen.tokens[b][:-1]
    full, _ = Decoder(eng.config).apply({"params": params}, jnp.asarray([seq]))
    np.testing.assert_allclose(gen.logits[b], np.asarray(full[0, len(p) - 1:]), atol=1e-4)
  # the checkpoints/ dir and the step dir load the same step; default cache_len = data.seq_len
  for path in (os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints", str(STEPS))):
    other = Engine.from_checkpoint(path)
    assert other.step == STEPS and other.cache_len == 32
    assert other.generate(PROMPTS, 4).tokens == gen.tokens


def test_scheme_options_override_the_runs(run):
  eng = Engine.from_checkpoint(run, cache_len=24, theta=0.9)
  assert eng.config.scheme_options["theta"] == 0.9
  assert eng.run_config.model.scheme.theta == 0.9
  assert Engine.from_checkpoint(run, cache_len=24).config.scheme_options["theta"] == 0.5
  with pytest.raises(ValueError, match="thetaa"):
    Engine.from_checkpoint(run, thetaa=0.9)
  with pytest.raises(ValueError, match="cannot be changed"):
    Engine.from_checkpoint(run, name="dense")


def test_bad_paths_are_one_line_errors(run, tmp_path):
  with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="does not exist"):
    Engine.from_checkpoint(str(tmp_path / "nope"))
  with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="neither a workdir"):
    Engine.from_checkpoint(str(tmp_path))
  with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="is a file"):
    Engine.from_checkpoint(os.path.join(run, "config.json"))
  with pytest.raises(FileNotFoundError, match="no_tokenizer does not exist"):
    Engine.from_checkpoint(run, tokenizer=str(tmp_path / "no_tokenizer"))
