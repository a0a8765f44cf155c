"""The XLA flags tests/conftest.py gives every test process (not a test module; no jax import:
conftest imports this before jax)."""

# LLVM optimisation level 0 and its expensive passes off: the tests' programs are tiny, so their
# time is mostly compilation, which these flags cut by about 40% (the programs then run up to 2x
# slower, which only long trainings notice).
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def user_env(env: dict) -> dict:
  """env without the test-only compile flags: a process as a user runs it."""
  env = dict(env)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if f not in TEST_COMPILE_FLAGS)
  return env


# The subprocesses that TRAIN for a minute or more (scripts/demo.py in tests/cli/test_demo*.py,
# bench/elastic_repro.py's CI preset) run near a user's optimisation level (the suite's -O0 makes
# their train steps ~2x slower): without LLVM's expensive passes (the same values bit for bit:
# scripts/demo.py --preset=ci, every metric of demo_metrics.json identical; elastic 68.4 -> 58.6
# CPU-s, aha 101.3 -> 96.0) and with LLVM at -O1 (XLA's default is -O2), which compiles faster
# and runs the steps as fast: the demo's accuracies, sparsities and claims identical, a logged
# router_p mean off in its 7th digit (L2A 108 -> 84 CPU-s, MATCH 95 -> 77; test_elastic_repro.py
# 45.3 -> 39.5, its checks unchanged).
TRAINING_COMPILE_FLAGS = ("--xla_llvm_disable_expensive_passes=true",
                          "--xla_backend_optimization_level=1")


def training_env(env: dict) -> dict:
  """user_env(env) with TRAINING_COMPILE_FLAGS: cheaper compilation than a user's, the same
  numbers up to float rounding."""
  env = user_env(env)
  env["XLA_FLAGS"] = " ".join([env["XLA_FLAGS"], *TRAINING_COMPILE_FLAGS]).strip()
  return env


# The directory of the run's shared compilation cache (tests/conftest.py makes it): one-device
# programs of every process of a run share it; multi-device ones never (conftest's docstring).
SHARED_CACHE_ENV = "CONDATTN_TEST_COMPILE_CACHE"
# Programs that compile faster than this are not written (writing costs about as much as a
# sub-0.1 s compile saves: 200 tiny programs, 11.5 -> 12.2 CPU-s with every one written).
MIN_CACHED_COMPILE_S = 0.2
_JAX_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def shared_cache_env(env: dict, devices: int) -> dict:
  """env of a subprocess with `devices` CPU devices: with one device, jax's persistent cache in
  the run's shared directory for every program it compiles; with several, none (a subprocess
  has no conftest to keep its multi-device programs out)."""
  env = {k: v for k, v in env.items() if k not in _JAX_CACHE_VARS}
  if devices == 1 and env.get(SHARED_CACHE_ENV):
    env.update(dict(zip(_JAX_CACHE_VARS, (env[SHARED_CACHE_ENV], str(MIN_CACHED_COMPILE_S), "0"))))
  return env
