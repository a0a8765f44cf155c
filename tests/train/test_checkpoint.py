"""Checkpoints: exact resume (N straight == N/2, SIGTERM, resume, N/2; runs on one device:
loop.run(devices=...)), keep-last-N, restore into other meshes, data iterator state re-split
across process counts."""
import os
import signal

import jax
import numpy as np
import pytest

from _train_helpers import assert_trees_close, count_compiles, tiny
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.data import make_train_iterator
from condattn_jax.train import loop

N = 8
ONE = lambda: jax.devices()[:1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("straight"))
  c = tiny(f"steps={N}", checkpoint_every=2, keep_checkpoints=2)
  losses = {}
  r = loop.run(c, wd, on_step=lambda s, m: losses.__setitem__(s, float(m["loss"])),
               devices=ONE())
  assert r["step"] == N and not r["stopped_early"]
  assert np.isfinite(r["train"]["loss"]), r["train"]
  return wd, c, losses


def test_resume_after_sigterm_is_exact(straight, tmp_path):
  wd_a, c, losses_a = straight
  wd_b = str(tmp_path / "b")
  c = tiny(f"steps={N}", checkpoint_every=100)  # saves only at the end / on SIGTERM

  def kill_at_half(step, metrics):
    if step == N // 2:
      os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: save, then stop

  losses_b = {}
  r1 = loop.run(c, wd_b, on_step=lambda s, m: (losses_b.__setitem__(s, float(m["loss"])),
                                               kill_at_half(s, m)), devices=ONE())
  assert r1["stopped_early"] and r1["step"] in (N // 2, N // 2 + 1)
  ck = ckpt_lib.Checkpointer(os.path.join(wd_b, "checkpoints"), read_only=True)
  assert ck.all_steps() == [r1["step"]]
  assert ck.restore_meta()["mesh"] == {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1}
  ck.close()
  r2 = loop.run(c, wd_b, on_step=lambda s, m: losses_b.__setitem__(s, float(m["loss"])),
                devices=ONE())
  assert r2["step"] == N and not r2["stopped_early"]
  _, pa, _ = loop.load_params(c, wd_a)
  _, pb, _ = loop.load_params(c, wd_b)
  assert_trees_close(pb, pa, atol=1e-6)
  assert sorted(losses_b) == list(range(1, N + 1))
  np.testing.assert_allclose([losses_b[s] for s in range(1, N + 1)],
                             [losses_a[s] for s in range(1, N + 1)], rtol=1e-6)


def test_stop_after_and_keep_last_n(straight, tmp_path):
  wd_a, _, _ = straight
  ck = ckpt_lib.Checkpointer(os.path.join(wd_a, "checkpoints"), read_only=True)
  assert ck.all_steps() == [N - 2, N]  # keep_checkpoints=2
  meta = ck.restore_meta()
  ck.close()
  assert meta["step"] == N and meta["model_config"]["family"] == "qwen2"
  assert meta["config"]["train"]["num_steps"] == N


def test_restore_into_another_mesh(straight):
  wd, c, _ = straight  # saved from one device
  _, ref, _ = loop.load_params(c, wd, devices=ONE())
  c2 = tiny(f"steps={N}")
  c2.mesh.data, c2.mesh.fsdp, c2.mesh.tensor = 2, 1, 4
  setup, p2, step = loop.load_params(c2, wd)
  assert step == N
  up = [x for path, x in jax.tree_util.tree_flatten_with_path(p2)[0]
        if jax.tree_util.keystr(path).endswith("['mlp']['up_proj']['kernel']")]
  assert up and all("tensor" in tuple(x.sharding.spec) for x in up)  # [.., D, F]: F on tensor
  assert_trees_close(p2, ref, atol=0)
  setup, p8, _ = loop.load_params(tiny(f"steps={N}"), wd)  # the 8-device fsdp mesh
  assert dict(setup.mesh.shape)["fsdp"] == 8
  assert_trees_close(p8, ref, atol=0)


def test_config_from_checkpoint_roundtrip(straight):
  wd, c, _ = straight
  c2 = loop.config_from_checkpoint(wd)
  assert c2.train.num_steps == N and c2.data.task.num_pairs == c.data.task.num_pairs
  assert tuple(c2.eval.context_lengths) == tuple(c.eval.context_lengths)
  assert c2.model.scheme.name == "dense"


def test_data_state_resplits_across_process_counts():
  c = tiny()
  B = int(c.data.batch_size)
  its = [make_train_iterator(c, process_index=i, process_count=2) for i in range(2)]
  for _ in range(3):
    for it in its:
      next(it)
  merged = ckpt_lib.merge_data_states([it.get_state() for it in its][::-1])
  assert merged["num_lanes"] == B and merged["lane_start"] == 0
  want = np.concatenate([next(it)["inputs"] for it in its])
  one = make_train_iterator(c)
  one.set_state(ckpt_lib.split_data_state(merged, 0, 1))
  np.testing.assert_array_equal(next(one)["inputs"], want)
  # ... and into 4 processes
  quarters = []
  for i in range(4):
    it = make_train_iterator(c, process_index=i, process_count=4)
    it.set_state(ckpt_lib.split_data_state(merged, i, 4))
    quarters.append(next(it)["inputs"])
  np.testing.assert_array_equal(np.concatenate(quarters), want)
  with pytest.raises(ValueError, match="do not tile the batch"):
    ckpt_lib.merge_data_states([its[0].get_state()] * 2)


def _truncate_params(step_dir):
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "params"))
           for f in fs if os.sep + "d" + os.sep in os.path.join(r, f)]
  big = max(files, key=os.path.getsize)
  os.truncate(big, os.path.getsize(big) // 2)


def test_corrupt_checkpoint_is_named_skipped_and_a_changed_model_is_not(straight, tmp_path, caplog):
  import shutil
  wd_a, c, _ = straight
  wd = str(tmp_path / "copy")
  shutil.copytree(wd_a, wd)
  _truncate_params(os.path.join(wd, "checkpoints", str(N)))
  setup = loop.build(c)
  ck = ckpt_lib.Checkpointer(os.path.join(wd, "checkpoints"), read_only=True)
  with pytest.raises(ckpt_lib.CorruptCheckpointError, match=rf"{wd}/checkpoints/{N} cannot be read"):
    ck.restore_state(setup.abstract_state, N)
  ck.close()
  with caplog.at_level("WARNING"):
    _, params, step = loop.load_params(c, wd)  # newest readable: N - 2
  assert step == N - 2 and f"{wd}/checkpoints/{N}" in caplog.text
  _, want, _ = loop.load_params(c, wd_a, step=N - 2)
  assert_trees_close(params, want, atol=0)
  with pytest.raises(ckpt_lib.CorruptCheckpointError):
    loop.load_params(c, wd, step=N)  # an explicit step is never replaced by another
  # a different model is a config error, not damage: named, never skipped
  c3 = tiny(f"steps={N}")
  c3.model.num_layers = 3
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="does not match the model"):
    loop.load_params(c3, wd_a)


def test_saving_on_cpu_devices_compiles_nothing(tmp_path):
  """A CPU save writes each array from its replica 0 (ckpt_lib._no_replica_parallel_on_cpu):
  replicated arrays of distinct shapes on 8 devices are saved without one compiled program
  (orbax's replica-parallel default slices each on the devices: a program per shape), with the
  array metadata orbax's default handler writes, and restore equal, into that sharding."""
  mesh = jax.make_mesh((8,), ("data",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rng = np.random.default_rng(0)
  tree = {f"l{i}": jax.device_put(rng.standard_normal((8, 3 + i)).astype(np.float32), rep)
          for i in range(6)}
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), async_save=False)
  compiles, stop = count_compiles()
  try:
    ck.save_params(1, tree, {"note": "probe"})
    ck.wait()
  finally:
    stop()
  assert compiles == []
  # orbax's default handler otherwise: its per-process array metadata is written
  assert os.listdir(tmp_path / "ck" / "1" / "params" / "array_metadatas")
  got = ck.restore_params(tree, 1)
  ck.close()
  for k, x in tree.items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(x))
    assert got[k].sharding == rep, k
