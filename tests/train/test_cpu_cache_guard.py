"""train.py on several CPU devices with jax's persistent compilation cache set: jax 0.11.2 loads
a multi-device CPU program from that cache that can deadlock in its collectives' rendezvous
(without the guard, the second of two identical runs aborts after a minute of 'may be stuck'
messages), so the loop turns the cache off for such a run and says so in one line
(condattn_jax.train.loop._no_persistent_cache_for_cpu_collectives)."""
import subprocess

from _train_helpers import PY, ROOT, subprocess_env


def test_second_run_with_a_compilation_cache_on_8_cpu_devices_finishes(tmp_path):
  env = dict(subprocess_env(8), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jit_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  # 2 steps (was 16): with the guard patched out (loop._no_persistent_cache_for_cpu_collectives
  # a no-op), the second run at steps=2 still aborts (SIGABRT after ~60 s of 'may be stuck'): the
  # hang comes in the first step of a program loaded from the cache. A run's time is its startup
  # and compilation; each further step only adds time (~2.5 CPU-s for both runs at 16).
  for run in ("first", "second"):
    p = subprocess.run([PY, "train.py", "--config=configs/tiny.py:steps=2",
                        f"--workdir={tmp_path / run}", "--config.train.progress_bar=False",
                        "--config.train.log_every=1", "--config.eval.at_end=False"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (run, p.stderr[-3000:])
    assert "may be stuck" not in p.stderr, (run, p.stderr[-3000:])
    assert "persistent compilation cache" in p.stderr and "is off for this run" in p.stderr, (
        run, p.stderr[-2000:])
