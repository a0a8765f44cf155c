"""Every test process sees 8 fake CPU devices (set before jax is imported).

Test time is mostly XLA compilation of tiny programs, so every test process (the pytest workers
and the train.py / eval.py subprocesses they start, which inherit this environment) compiles with
LLVM's optimisation level 0 and its expensive passes off (tests/_test_env.py:
TEST_COMPILE_FLAGS): the programs compute the same values up to float rounding and run slower,
which only long trainings notice (`make demo`'s test runs the demo with XLA's default flags, as a
user runs it: tests/cli/test_demo.py). jax's persistent compilation cache is NOT used: with jax 0.11.2
on CPU a process that runs a train step loaded from it aborts (tests/train/test_checkpoint.py, run twice
on one cache directory).
"""
import os

from _test_env import TEST_COMPILE_FLAGS

_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags] + [f for f in TEST_COMPILE_FLAGS if f.split("=")[0] not in _flags] +
    ["--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """Files that hold a slow test first, the rest in collection order: `make test` hands whole files
  to its 2 workers in this order (--dist loadfile --no-loadscope-reorder), and a long file handed
  out last would end the run alone on one worker."""
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow)
