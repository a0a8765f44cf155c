"""Sequence parallelism across processes: two train.py processes (2 fake CPU devices each, gloo
collectives, jax.distributed) with a 4-device `sequence` axis spanning both (every row split over
the two hosts' devices; the K/V all-gather and the batch's replicated rows cross processes) give
one process's losses step for step (tests/train/test_multihost.py's harness)."""
import subprocess

import numpy as np
import pytest

from _train_helpers import PY, ROOT, free_port, logged_losses, subprocess_env

STEPS = 3
ARGS = ["--config=configs/tiny.py:steps=%d,seq=32" % STEPS, "--config.train.log_every=1",
        "--config.train.checkpoint_every=0", "--config.eval.at_end=False",
        "--config.train.progress_bar=False"]


@pytest.mark.slow
def test_sequence_axis_across_two_processes_matches_one_process(tmp_path):
  port = free_port()
  seq = ["--config.mesh.fsdp=1", "--config.mesh.sequence=4"]
  runs = [(str(tmp_path / "mh"), seq, subprocess_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                     JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i))
          for i in range(2)]
  runs.append((str(tmp_path / "ref"), [], subprocess_env(1)))  # one device, no sequence axis
  procs = [subprocess.Popen([PY, "train.py", *ARGS, *extra, f"--workdir={wd}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for wd, extra, env in runs]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, o in zip(procs, outs):
    assert p.returncode == 0, o[-4000:]
  assert "mesh {'data': 1, 'fsdp': 1, 'sequence': 4, 'tensor': 1}" in outs[0]  # host 0's log
  a, b = logged_losses(runs[0][0]), logged_losses(runs[2][0])
  assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)
