"""Scheme options through the registry (`attention.options` / `configure` / `convert`): one
parser for every scheme, errors that name the flag a user sets (`model.scheme.<name>`), and the
same errors from train.py as one ERROR line (`python train.py ...` in a fork of one process that
imported its modules once, tests/_cli_runner.py, like tests/cli/test_cli_errors.py's `cli`)."""
import dataclasses
import numpy as np
import pytest

from _cli_runner import Runner
from _train_helpers import ROOT, subprocess_env
from condattn_jax import attention
from condattn_jax.models.config import ModelConfig

BUILTIN = ("l2a", "aha", "elastic", "match", "segmented")


def test_every_builtin_scheme_declares_an_options_dataclass_and_the_same_files():
  import os
  for name in BUILTIN:
    s = attention.get_scheme(name)
    assert dataclasses.is_dataclass(s.options) and s.options.__dataclass_params__.frozen, name
    assert s.option_names and set(s.option_names) == {f.name for f in dataclasses.fields(s.options)}
    folder = os.path.join(ROOT, "condattn_jax", "attention", name)
    for f in ("options.py", "layer.py", "convert.py", "report.py"):
      assert os.path.exists(os.path.join(folder, f)), (name, f)
  assert attention.get_scheme("dense").options is attention.NoOptions


@pytest.mark.parametrize("name", BUILTIN)
def test_unknown_option_lists_the_valid_ones(name):
  with pytest.raises(ValueError) as e:
    attention.configure(ModelConfig(), name, windw=3)
  msg = str(e.value)
  assert f"unknown option(s) ['windw'] for scheme {name!r}" in msg
  assert all(repr(n) in msg for n in attention.get_scheme(name).option_names)
  assert "scheme_kwargs" not in msg


def test_values_are_coerced_to_the_field_type_and_stored_normalised():
  cfg = attention.configure(ModelConfig(), "l2a", window=4.0, pruned_layers=[1, np.int64(0)],
                            tau=1)
  o = attention.options(cfg)
  assert o.window == 4 and type(o.window) is int
  assert o.pruned_layers == (0, 1) and all(type(i) is int for i in o.pruned_layers)
  assert o.tau == 1.0 and type(o.tau) is float
  assert dict(cfg.scheme_kwargs) == {"window": 4, "pruned_layers": (0, 1), "tau": 1.0}
  hash(cfg)  # stays hashable: a static jit argument
  m = attention.configure(ModelConfig(), "match", window=8, chunk=4,
                          retriever_kwargs={"b": [1, 2], "a": 0})
  assert attention.options(m).retriever_kwargs == (("a", 0), ("b", (1, 2)))
  e = attention.configure(ModelConfig(num_layers=2), "elastic", routing="fixed",
                          fixed_fa_kv_heads=[[0], [1]])
  assert attention.options(e).fixed_fa_kv_heads == ((0,), (1,))
  with pytest.raises(ValueError, match=r"model.scheme.window=4.5 must be an int"):
    attention.configure(ModelConfig(), "l2a", window=4.5)
  with pytest.raises(ValueError, match=r"model.scheme.decode_skip='yes' must be True or False"):
    attention.configure(ModelConfig(), "aha", decode_skip="yes")
  with pytest.raises(ValueError, match=r"model.scheme.routing=3 must be a string"):
    attention.configure(ModelConfig(), "aha", routing=3)
  # the dataclass's own checks name the flag too
  with pytest.raises(ValueError, match=r"model.scheme.tau=-1.0 must be > 0"):
    attention.configure(ModelConfig(), "l2a", tau=-1)


def test_whole_config_checks_are_scheme_hooks():
  with pytest.raises(ValueError, match="pre-norm families.*model.family='olmo2'"):
    attention.configure(ModelConfig(family="olmo2", qk_norm="full", post_norm=True), "l2a")
  for name in ("aha", "elastic", "match", "segmented"):
    with pytest.raises(ValueError, match="model.sliding_window=8.*set model.sliding_window=None"):
      attention.configure(ModelConfig(sliding_window=8), name,
                          **({"long_heads": (0,), "long_layers": (0,)} if name == "segmented"
                             else {}))
  # checked whenever options are read from a config, not only in configure
  bad = ModelConfig(scheme="aha", sliding_window=8)
  with pytest.raises(ValueError, match="model.sliding_window=8"):
    attention.options(bad)
  with pytest.raises(ValueError, match=r"model.scheme.long_heads has \[5\] outside 0..1"):
    attention.configure(ModelConfig(), "segmented", long_heads=(5,), long_layers=(0,))


def test_configure_keeps_the_schemes_own_options_and_drops_anothers():
  a = attention.configure(ModelConfig(), "aha", window=4, tau=0.3)
  b = attention.configure(a, "aha", tau=0.7)
  assert dict(b.scheme_kwargs) == {"window": 4, "tau": 0.7}
  c = attention.configure(a, "l2a", window=8)
  assert c.scheme == "l2a" and dict(c.scheme_kwargs) == {"window": 8}


def test_convert_is_the_one_dense_entry_point_and_refuses_a_scheme_model():
  import flax.linen as nn
  import jax
  from condattn_jax.models.decoder import Decoder
  cfg = ModelConfig(num_layers=2)
  shapes = nn.meta.unbox(jax.eval_shape(
      lambda: Decoder(cfg).init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"]))
  dense = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  lcfg, lp = attention.convert(dense, cfg, "l2a", window=4)
  assert lcfg.scheme == "l2a" and attention.options(lcfg).window == 4
  assert "global_attn" in str(jax.tree_util.tree_structure(lp))
  with pytest.raises(ValueError, match=r"convert\(\) takes a dense model.*'l2a'"):
    attention.convert(lp, lcfg, "aha")


def test_options_of_a_run_config_and_of_options():
  from _train_helpers import tiny
  c = tiny()
  with c.unlocked():
    c.model.scheme.name = "aha"
    c.model.scheme.window = 3
  o = attention.options(c)
  assert o.window == 3 and attention.options(o) is o


def test_a_scheme_without_options_refuses_any():
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['window'\] for scheme 'dense'; "
                                       "valid: none"):
    attention.options(ModelConfig(scheme_kwargs=(("window", 4),)))


# ------------------------------------------------------------------ the command line
RUNNER = Runner(subprocess_env(1))


@pytest.fixture(scope="module", autouse=True)
def cli_runner_per_module():
  """RUNNER's process ends with the module (its CPU time counts in the module)."""
  yield
  RUNNER.close()


def _train(*args):
  return RUNNER.run("train.py", "--workdir=/tmp/unused_scheme_options", *args)


def _error_line(p) -> str:
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
  line = [l for l in p.stderr.splitlines() if l.strip()][-1]
  assert line.startswith("ERROR: "), p.stderr[-3000:]
  return line


def test_cli_bad_scheme_option_is_one_line_naming_the_flag():
  # Elastic's targets: one per task (issue 27 found the error naming model.scheme_kwargs)
  line = _error_line(_train("--config=configs/elastic_qwen.py:tiny",
                            "--config.model.scheme.targets=(0.7,0.5)"))
  assert "model.scheme.task_names ('mqar',) and targets (0.7, 0.5)" in line, line
  assert "scheme_kwargs" not in line
  line = _error_line(_train("--config=configs/l2a_qwen.py:tiny",
                            "--config.model.scheme.routing=sometimes"))
  assert "model.scheme.routing='sometimes': choose one of" in line, line
