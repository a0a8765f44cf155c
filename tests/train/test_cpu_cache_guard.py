"""train.py on several CPU devices with jax's persistent compilation cache set. Under XLA:CPU's
concurrency-optimized scheduler (its default), jax 0.11.2 loads a multi-device CPU program from
that cache that can deadlock in its collectives' rendezvous (the second of two identical runs
aborts after a minute of 'may be stuck' messages, devices waiting at different collectives),
so the loop turns the cache off for such a run and says so in one line
(condattn_jax.train.loop._no_persistent_cache_for_cpu_collectives). With the scheduler off
(loop.CPU_CACHE_SAFE_FLAG in XLA_FLAGS) the cache stays on and a second run loads every program
from it and finishes. (The suite's own processes keep the scheduler and their multi-device
programs out of the cache: with the flag in every test process the suite ran slower.)"""
import os
import subprocess

from _train_helpers import PY, ROOT, subprocess_env
from condattn_jax.train import loop

ARGS = ["train.py", "--config=configs/tiny.py:steps=2", "--config.train.progress_bar=False",
        "--config.train.log_every=1", "--config.eval.at_end=False"]


def _env(cache, safe: bool):
  env = dict(subprocess_env(8), JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  flags = [f for f in env["XLA_FLAGS"].split() if f != loop.CPU_CACHE_SAFE_FLAG]
  env["XLA_FLAGS"] = " ".join(flags + [loop.CPU_CACHE_SAFE_FLAG] * safe)
  return env


def _train(tmp_path, run, env):
  p = subprocess.run([PY, *ARGS, f"--workdir={tmp_path / run}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=240)
  assert p.returncode == 0, (run, p.stderr[-3000:])
  assert "may be stuck" not in p.stderr, (run, p.stderr[-3000:])
  return p.stderr


def _entries(cache):
  return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def test_without_the_safe_flag_the_cache_is_off_for_the_run(tmp_path):
  """(The guard patched out, the second of two such runs aborts in its first step.)"""
  cache = tmp_path / "jit_cache"
  err = _train(tmp_path, "guarded", _env(cache, safe=False))
  assert "persistent compilation cache" in err and "is off for this run" in err, err[-2000:]
  assert loop.CPU_CACHE_SAFE_FLAG in err  # the line names the flag that keeps it
  assert _entries(cache) == []  # nothing written, so nothing can be loaded


def test_with_the_safe_flag_a_second_run_loads_every_program_and_finishes(tmp_path):
  cache = tmp_path / "jit_cache"
  env = _env(cache, safe=True)
  err = _train(tmp_path, "first", env)
  assert "is off for this run" not in err, err[-2000:]
  written = _entries(cache)
  assert written  # the 8-device programs are in the cache
  _train(tmp_path, "second", env)
  assert _entries(cache) == written  # all loaded: none compiled again
