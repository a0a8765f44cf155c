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
