"""The XLA flags and the persistent compilation cache tests/conftest.py gives every test process
(not a test module; no jax import: conftest imports this before jax)."""
import os
import tempfile

# LLVM optimisation level 0 and its expensive passes off: the tests' programs are tiny, so their
# time is mostly compilation, which these flags cut by about 40% (the programs then run up to 2x
# slower, which only long trainings notice).
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def user_env(env: dict) -> dict:
  """env without the test-only compile flags and persistent compilation cache: a process as a user
  runs it."""
  env = {k: v for k, v in env.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if f not in TEST_COMPILE_FLAGS)
  return env


JAX_CACHE_ENV = "CONDATTN_TEST_JAX_CACHE"  # the run's cache directory ("off": no cache)
OWN_JAX_CACHE = []  # the directory this process made (the controller / a lone pytest): removed at exit


def _jax_cache_dir():
  """The run's persistent-cache directory: made by the first test process (the xdist controller,
  or a lone pytest) and handed to its workers and subprocesses through JAX_CACHE_ENV; a run never
  sees another run's entries. None on a GPU / TPU run or under CONDATTN_TEST_JAX_CACHE=off."""
  if os.environ.get("JAX_PLATFORMS") != "cpu" or os.environ.get(JAX_CACHE_ENV) == "off":
    return None
  if not os.environ.get(JAX_CACHE_ENV):
    os.environ[JAX_CACHE_ENV] = tempfile.mkdtemp(prefix="condattn_jax_cache_")
    OWN_JAX_CACHE.append(os.environ[JAX_CACHE_ENV])
  return os.environ[JAX_CACHE_ENV]


def persistent_cache_env(devices: int) -> dict:
  """Environment variables that give a subprocess of `devices` fake CPU devices (one process, no
  jax.distributed) the run's persistent compilation cache: one device only (tests/conftest.py's
  docstring says why). Also makes the run's directory (the first call)."""
  d = _jax_cache_dir()
  if d is None or devices != 1:
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": d, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
          # a size limit turns on the cache's file lock: a reader never sees a half-written entry
          "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 34)}
