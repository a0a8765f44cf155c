"""Two real JAX processes (2 CPU devices each) build one global batch from their halves.

Each process loads only its shard (`data_shard_for_sharding` -> make_train_iterator),
turns it into global arrays with `make_global_batch`, and the gathered global batch must
equal the batch a single process builds alone.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from _train_helpers import free_port
from condattn_jax import data

WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, cfg_json, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    from jax.experimental import multihost_utils
    from condattn_jax import data
    cfg = json.loads(cfg_json)
    B, T = cfg["batch_size"], cfg["seq_len"]
    mesh = jax.make_mesh((4,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    idx, cnt = data.data_shard_for_sharding(sharding, (B, T))
    it = data.make_train_iterator(cfg, process_index=idx, process_count=cnt)
    got = {}
    for step in range(3):
      local = next(it)
      g = data.make_global_batch(local, sharding, global_batch_size=B)
      total = jax.jit(lambda x: x.sum())(g["inputs"])  # a real computation on the global array
      full = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
              for k, v in g.items()}
      got[step] = {k: v.tolist() for k, v in full.items()}
      got[step]["sum"] = int(total)
      got[step]["shard"] = [idx, cnt, local["inputs"].shape[0]]
    it.close()
    if pid == 0:
      with open(out, "w") as f:
        json.dump(got, f)
    jax.distributed.shutdown()
""")


def test_two_processes_build_the_single_process_batch(tmp_path):
  cfg = {"source": "mqar", "seq_len": 64, "batch_size": 8, "prefetch": 0,
         "task": {"vocab_size": 128, "num_pairs": 4, "min_gap": 8}}
  worker = tmp_path / "worker.py"
  worker.write_text(WORKER)
  out = tmp_path / "out.json"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), json.dumps(cfg),
                             str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT) for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=120)[0].decode())
    finally:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)
  got = json.loads(out.read_text())
  it = data.make_train_iterator(cfg)
  for step in range(3):
    want = next(it)
    g = got[str(step)]
    assert g["shard"] == [0, 2, 4]
    for k, v in want.items():
      np.testing.assert_array_equal(np.asarray(g[k], v.dtype), v)
    assert g["sum"] == int(want["inputs"].sum())
  it.close()
