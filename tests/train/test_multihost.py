"""Multi-host on one machine: two train.py processes (2 fake CPU devices each, gloo collectives,
jax.distributed via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) with
per-process data loading match a one-process 4-device run step for step; the checkpoint they
write restores (params, optimizer, data iterator) in a single process, which continues exactly
like the reference."""
import os
import subprocess

import numpy as np
import pytest

from _train_helpers import (PY, ROOT, assert_trees_close, free_port, logged_losses,
                            subprocess_env, tiny)
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.train import loop

STEPS, HALF = 6, 4
ARGS = ["--config=configs/tiny.py:steps=%d" % STEPS, "--config.train.log_every=1",
        "--config.train.checkpoint_every=2", "--config.eval.at_end=False",
        "--config.train.progress_bar=False", "--config.mesh.data=1", "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  mh = str(tmp_path_factory.mktemp("multihost"))
  ref = str(tmp_path_factory.mktemp("reference"))
  port = free_port()
  procs = []
  for i in range(2):
    env = subprocess_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                         JAX_PROCESS_ID=i)
    procs.append(subprocess.Popen([PY, "train.py", *ARGS, f"--workdir={mh}", f"--stop_after={HALF}"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  procs.append(subprocess.Popen([PY, "train.py", *ARGS, f"--workdir={ref}"], cwd=ROOT,
                                env=subprocess_env(4), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, o in zip(procs, outs):
    assert p.returncode == 0, o[-4000:]
  return mh, ref


def test_two_processes_match_one_process(runs):
  mh, ref = runs
  a, b = logged_losses(mh), logged_losses(ref)
  assert sorted(a) == list(range(1, HALF + 1)) and sorted(b) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)
  ck = ckpt_lib.Checkpointer(os.path.join(mh, "checkpoints"), read_only=True)
  meta = ck.restore_meta()
  files = sorted(f for f in os.listdir(os.path.join(ck.step_dir(HALF), "data"))
                 if f.startswith("process_"))
  ck.close()
  assert meta["process_count"] == 2 and meta["step"] == HALF
  assert files == ["process_0-of-2.json", "process_1-of-2.json"]  # per-process data state


def test_multihost_checkpoint_restores_and_continues_in_one_process(runs):
  mh, ref = runs
  c = tiny(f"steps={STEPS}", checkpoint_every=2)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 2  # 8 local devices, another mesh
  _, p_mh, step = loop.load_params(c, mh, step=HALF)
  _, p_ref, _ = loop.load_params(c, ref, step=HALF)
  assert step == HALF
  assert_trees_close(p_mh, p_ref, atol=1e-5)
  losses = {}
  r = loop.run(c, mh, on_step=lambda s, m: losses.__setitem__(s, float(m["loss"])))
  assert r["step"] == STEPS
  want = logged_losses(ref)
  np.testing.assert_allclose([losses[s] for s in range(HALF + 1, STEPS + 1)],
                             [want[s] for s in range(HALF + 1, STEPS + 1)], rtol=1e-5)
  _, final_mh, _ = loop.load_params(c, mh)
  _, final_ref, _ = loop.load_params(c, ref)
  assert_trees_close(final_mh, final_ref, atol=1e-5)
