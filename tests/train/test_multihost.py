"""Multi-host on one machine: two train.py processes (2 fake CPU devices each, gloo collectives,
jax.distributed via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) with
per-process data loading match a one-process 4-device run (in this process) step for step; the
checkpoint they write restores (params, optimizer, data iterator) in a single process, which
continues exactly like the reference. In the same fixture, two more train.py processes with a
4-device `sequence` axis spanning both (context parallelism: every row split over the two hosts'
devices; the K/V all-gather and the batch's replicated rows cross processes) give the same
one-process losses."""
import os
import subprocess

import jax
import numpy as np
import pytest

from _train_helpers import (PY, ROOT, assert_trees_close, free_port, logged_losses,
                            subprocess_env, tiny)
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.train import loop

STEPS, HALF = 6, 4
COMMON = ["--config=configs/tiny.py:steps=%d" % STEPS, "--config.train.log_every=1",
          "--config.eval.at_end=False", "--config.train.progress_bar=False", "--config.mesh.data=1"]
ARGS = COMMON + ["--config.train.checkpoint_every=%d" % HALF, "--config.mesh.fsdp=2",
                 "--config.mesh.tensor=2"]
# context parallelism across the two processes: sequence 4 (a 64-token row in 8 zigzag chunks),
# the 16 rows in 2 microbatches of 8 (set by hand: the derived layout, one row per data*fsdp=1
# shard, is 16 microbatches of one row, 8x the cross-process collectives: ~16 CPU-s more for the
# same code; the derivation is tested in test_context_parallel.py)
SEQ_ARGS = COMMON + ["--config.train.checkpoint_every=0", "--config.mesh.fsdp=1",
                     "--config.mesh.sequence=4", "--config.mesh.tensor=1",
                     "--config.train.microbatches=2"]
SEQ_STEPS = 3


def _train(args, env):
  """Two train.py processes (one jax.distributed job) run together; their outputs."""
  port = free_port()
  envs = [dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i)) for i in range(2)]
  procs = [subprocess.Popen([PY, "train.py", *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for e in envs]
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
  return outs


def _one_process(devices=4):
  """(config, devices) of a one-process run: configs/tiny.py as ARGS trains it (a checkpoint
  every 2 steps) on this process's first `devices` devices: 4 give the two-process runs' mesh
  (data 1, fsdp 2, tensor 2), 8 another one (fsdp 4)."""
  c = tiny(f"steps={STEPS}", checkpoint_every=2)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 2
  return c, jax.devices()[:devices]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Workdirs of the fsdp x tensor two-process run (stopped after HALF steps), the one-process
  4-device reference (all STEPS: loop.run in this process, whose compiled train step the
  restored run continues with) and the sequence-4 two-process run (SEQ_STEPS); host 0's log of
  the last. One run at a time: fewer processes whose collectives wait on a peer the 2 cores do
  not schedule (their sys time grows with the load; ~3 CPU-s in one measurement)."""
  mh = str(tmp_path_factory.mktemp("multihost"))
  ref = str(tmp_path_factory.mktemp("reference"))
  seq = str(tmp_path_factory.mktemp("sequence"))
  c, devices = _one_process()
  assert loop.run(c, ref, devices=devices)["step"] == STEPS
  _train(ARGS + [f"--workdir={mh}", f"--stop_after={HALF}"], subprocess_env(2))
  outs = _train(SEQ_ARGS + [f"--workdir={seq}", f"--stop_after={SEQ_STEPS}"], subprocess_env(2))
  return mh, ref, seq, outs[0]


def test_two_processes_match_one_process(runs):
  mh, ref, _, _ = runs
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
  """The two processes' checkpoint restored in one process onto another mesh (8 devices) equals
  the reference's; the run resumed from it in one process (on the reference's 4-device mesh)
  continues exactly like the reference."""
  mh, ref, _, _ = runs
  c8, eight = _one_process(8)  # 8 local devices, another mesh than the checkpoints'
  _, p_mh, step = loop.load_params(c8, mh, step=HALF, devices=eight)
  _, p_ref, _ = loop.load_params(c8, ref, step=HALF, devices=eight)
  assert step == HALF
  assert_trees_close(p_mh, p_ref, atol=1e-5)
  losses = {}
  c, devices = _one_process()
  r = loop.run(c, mh, on_step=lambda s, m: losses.__setitem__(s, float(m["loss"])),
               devices=devices)
  assert r["step"] == STEPS
  want = logged_losses(ref)
  np.testing.assert_allclose([losses[s] for s in range(HALF + 1, STEPS + 1)],
                             [want[s] for s in range(HALF + 1, STEPS + 1)], rtol=1e-5)
  _, final_mh, _ = loop.load_params(c8, mh, devices=eight)
  _, final_ref, _ = loop.load_params(c8, ref, devices=eight)
  assert_trees_close(final_mh, final_ref, atol=1e-5)


@pytest.mark.slow  # the file's fixture runs 4 train.py processes: scheduled first
def test_sequence_axis_across_two_processes_matches_one_process(runs):
  _, ref, seq, log = runs
  assert "mesh {'data': 1, 'fsdp': 1, 'sequence': 4, 'tensor': 1}" in log  # host 0's log
  a, b = logged_losses(seq), logged_losses(ref)
  assert sorted(a) == list(range(1, SEQ_STEPS + 1))
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)
