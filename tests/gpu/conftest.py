"""`make gpu-smoke` (pytest tests/gpu) on a GPU machine.

tests/conftest.py pins JAX to the CPU for the CPU suite (JAX_PLATFORMS=cpu unless set). When
pytest is asked for tests/gpu alone and a CUDA device is present, let JAX use it, with XLA's
default compile flags (the CPU suite's test-only flags are dropped here, before any backend
starts).
"""
import os
import pathlib


def _cuda_present():
  return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))


def pytest_configure(config):
  here = pathlib.Path(__file__).resolve().parent
  args = [pathlib.Path(a.split("::")[0]).resolve() for a in config.args]
  only_gpu = bool(args) and all(a == here or here in a.parents for a in args)
  if only_gpu and _cuda_present() and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    import jax
    from _test_env import user_env
    os.environ["JAX_PLATFORMS"] = ""
    jax.config.update("jax_platforms", None)
    os.environ["XLA_FLAGS"] = user_env(dict(os.environ))["XLA_FLAGS"]
