"""Engine.from_checkpoint over a real train.py run (configs/tiny.py with scheme L2A, a few
steps, trained once: conftest's tiny_l2a_run): the loaded engine generates what an Engine over the
checkpoint's params generates (== the full forward), from a workdir, its checkpoints/ dir or a
step dir; test-time scheme options reach the model; bad paths are one-line errors."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _programs
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.inference import Engine
from condattn_jax.train import loop

PROMPTS = [[3, 9, 17, 4, 22, 8, 1], [5, 6], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def run(tiny_l2a_run):
  return tiny_l2a_run


STEPS = 3  # the run's train.num_steps (conftest.RUN_STEPS), checked below


def test_loads_the_checkpoint_and_generates_like_the_full_forward(run):
  eng = Engine.from_checkpoint(run, cache_len=24)
  assert eng.run_config.train.num_steps == STEPS and eng.step == STEPS
  assert eng.tokenizer is None and eng.cache_len == 24
  assert eng.config.scheme == "l2a" and eng.config.scheme_options["window"] == 4
  _, params, step = loop.load_params(loop.config_from_checkpoint(run), run,
                                     devices=[jax.devices()[0]])
  assert step == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(eng.stacked_params()),
               jax.device_get(params))
  gen = eng.generate(PROMPTS, 4, return_logits=True)
  seqs = [p + g[:-1] for p, g in zip(PROMPTS, gen.tokens)]  # one forward, right-padded
  lens = np.asarray([len(s) for s in seqs])
  tok = np.zeros((len(seqs), lens.max()), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)] = s
  seg = (np.arange(lens.max()) < lens[:, None]).astype(np.int32)  # padding: segment 0
  pos = np.broadcast_to(np.arange(lens.max(), dtype=np.int32), tok.shape)
  full, _ = _programs.apply(eng.config)(params, jnp.asarray(tok), jnp.asarray(pos),
                                       jnp.asarray(seg))  # jitted: eagerly op by op
  for b, p in enumerate(PROMPTS):
    np.testing.assert_allclose(gen.logits[b], np.asarray(full[b, len(p) - 1:len(seqs[b])]),
                               atol=1e-4)
  # the checkpoints/ dir and the step dir load the same step and weights; default cache_len is
  # the run's data.seq_len
  for path in (os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints", str(STEPS))):
    other = Engine.from_checkpoint(path)
    assert other.step == STEPS and other.cache_len == 32
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(other.stacked_params()),
                 jax.device_get(params))


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
