"""Training: config errors, optimizer masks / groups / schedule, chunked CE, microbatches, NaN
stop, dry run, TPU export of the sharded step, init from a Hugging Face checkpoint."""
import functools
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from _train_helpers import HF, assert_trees_close, host, random_params, synthetic_batch, tiny
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.train import config as config_lib
from condattn_jax.train import loop
from condattn_jax.train import optimizer as opt_lib
from condattn_jax.train import sharding as shd
from condattn_jax.train.step import make_loss_and_grads

ONE = lambda: [jax.devices()[0]]


# ------------------------------------------------------------------------------ bad input
def test_unknown_config_field_in_recipe():
  c = tiny()
  with c.train.unlocked():
    c.train.lr_warmup = 3
  with pytest.raises(ValueError, match=r"unknown config field 'config.train.lr_warmup'.*warmup_frac"):
    config_lib.validate_config(c)
  c = tiny()
  with c.unlocked():
    c.optimizer = {}
  with pytest.raises(ValueError, match=r"unknown config field 'config.optimizer'"):
    config_lib.validate_config(c)


def test_wrong_family():
  c = tiny()
  c.model.family = "gpt2"
  with pytest.raises(ValueError, match=r"model.family='gpt2' is not supported"):
    loop.build(c, devices=ONE())
  c = tiny()
  c.model.init_from = os.path.join(HF, "qwen2")
  c.model.family = "llama"
  with pytest.raises(ValueError, match=r"model.family='llama'.*is a 'qwen2' model"):
    loop.build(c, devices=ONE())


def test_missing_checkpoint_files(tmp_path):
  c = tiny()
  with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="does not exist"):
    loop.evaluate_checkpoint(c, str(tmp_path / "nope"))
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="no checkpoint in"):
    loop.load_params(c, str(tmp_path / "run"), devices=ONE())
  c.model.init_from = str(tmp_path / "no_such_hf_dir")
  with pytest.raises(FileNotFoundError, match="no_such_hf_dir"):
    loop.build(c, devices=ONE())


def test_lengths_and_batches_that_do_not_divide():
  c = tiny()
  c.train.loss_chunk_size = 48  # seq_len 64
  with pytest.raises(ValueError, match=r"loss_chunk_size=48 must divide config.data.seq_len=64"):
    loop.build(c, devices=ONE())
  c = tiny()
  c.data.batch_size = 6
  c.mesh.data, c.mesh.fsdp = -1, 1  # a hand-set mesh is not laid out automatically
  with pytest.raises(ValueError, match=r"batch_size=6 .* divisible by mesh data\*fsdp=8"):
    loop.build(c)  # 8 devices, data fills
  c = tiny()
  c.train.microbatches = 3
  with pytest.raises(ValueError, match=r"microbatches=3 must divide"):
    loop.build(c, devices=ONE())
  c = tiny()
  c.mesh.fsdp, c.mesh.tensor = 2, 2
  with pytest.raises(ValueError, match=r"needs 4 devices, but 8 are available"):
    loop.build(c)
  c = tiny()
  c.model.num_heads = 5
  with pytest.raises(ValueError, match=r"num_heads=5 must be a multiple of"):
    loop.build(c, devices=ONE())


# ------------------------------------------------------------------------------ optimizer
def test_schedule_warmup_cosine():
  c = tiny("steps=100")
  c.train.warmup_frac, c.train.lr, c.train.end_lr_frac = 0.1, 1.0, 0.0
  s = opt_lib.make_schedule(c.train)
  np.testing.assert_allclose([s(0), s(5), s(10), s(55), s(100)], [0.0, 0.5, 1.0, 0.5, 0.0],
                             atol=1e-6)
  c.train.lr_schedule = "nope"
  with pytest.raises(ValueError, match="lr_schedule='nope'"):
    opt_lib.make_schedule(c.train)


def test_frozen_params_have_no_optimizer_state_and_do_not_move():
  c = tiny()
  c.train.trainable_regex = r".*self_attn/.*"
  c.train.param_groups.norms = dict(regex=r".*norm/scale", lr=1e-2, weight_decay=0.0)
  setup = loop.build(c, devices=ONE())
  labels = jax.tree.leaves(setup.labels)
  assert set(labels) == {"frozen", "default", "norms"}
  n_trainable = sum(l != "frozen" for l in labels)
  opt_arrays = [x for x in jax.tree.leaves(setup.abstract_state.opt_state) if x.ndim > 0]
  assert len(opt_arrays) == 2 * n_trainable  # Adam mu + nu for trainable leaves only
  state = loop.init_state(setup)
  before = host(state.params)
  step = loop.jit_train_step(setup)
  batch = synthetic_batch(c)
  with shd.mesh_context(setup.mesh):
    for _ in range(2):
      state, m = step(state, batch)
  after = host(state.params)
  for (path, a), b, l in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                             jax.tree.leaves(after), jax.tree.leaves(setup.labels)):
    moved = not np.array_equal(a, b)
    assert moved == (l != "frozen"), (jax.tree_util.keystr(path), l)
  with pytest.raises(ValueError, match="matches no parameter"):
    c.train.trainable_regex = "nothing_like_this"
    c.train.param_groups = {}
    loop.build(c, devices=ONE())


def test_maximize_group_ascends():
  c = tiny()
  c.train.param_groups.up = dict(regex=r"norm/scale", maximize=True, lr=0.1, weight_decay=0.0)
  c.train.grad_clip = 0.0
  setup = loop.build(c, devices=ONE())
  state = loop.init_state(setup)
  batch = synthetic_batch(c)
  lg, step = make_loss_and_grads(setup.model_cfg, c.train), loop.jit_train_step(setup)
  with shd.mesh_context(setup.mesh):  # one compilation for both
    (grads, _), (state2, _) = jax.jit(lambda s, b: (lg(s.params, b, 0), step(s, b)))(state, batch)
  g = np.asarray(grads["norm"]["scale"])
  delta = np.asarray(state2.params["norm"]["scale"]) - 1.0
  big = np.abs(g) > 1e-6
  assert np.all(np.sign(delta[big]) == np.sign(g[big]))  # ascent: moves along the gradient


# -------------------------------------------------------------------------------- loss
def _one_program(*fns):
  """The functions (same arguments) jitted as ONE program: one compilation instead of one each
  (XLA shares what they have in common, e.g. the decoder forward); each output is its own."""
  return jax.jit(lambda *args: tuple(f(*args) for f in fns))


@functools.lru_cache(maxsize=None)
def _loss_program(tied):
  """(params, batch, program) on configs/tiny.py with tied or untied embeddings: host params, the
  first batch and ONE program (_one_program) of make_loss_and_grads with the plain CE, the
  chunked CE (chunks of 16) and, untied, 4 microbatches: (params, batch, step) -> their
  (grads, metrics). Built once per `tied`: the tests below share its compilation."""
  c = tiny()
  c.model.tie_word_embeddings = tied
  setup = loop.build(c, devices=ONE())
  batch = synthetic_batch(c)
  fns = [make_loss_and_grads(setup.model_cfg, c.train)]
  c.train.loss_chunk_size = 16
  fns.append(make_loss_and_grads(setup.model_cfg, c.train))
  if not tied:
    c.train.loss_chunk_size, c.train.microbatches = 0, 4
    fns.append(make_loss_and_grads(setup.model_cfg, c.train))
  return random_params(setup.abstract_params), batch, _one_program(*fns)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_cross_entropy_equals_plain(tied):
  params, batch, program = _loss_program(tied)
  batch = dict(batch, loss_mask=np.ones_like(batch["loss_mask"]))  # score every token
  plain, chunked = program(params, batch, 0)[:2]
  np.testing.assert_allclose(chunked[1]["loss"], plain[1]["loss"], rtol=1e-6)
  np.testing.assert_allclose(chunked[1]["accuracy"], plain[1]["accuracy"])
  assert_trees_close(chunked[0], plain[0], atol=1e-6, rtol=1e-5)


def test_microbatches_equal_full_batch():
  params, batch, program = _loss_program(tied=False)
  full, _, micro = program(params, batch, 3)
  np.testing.assert_allclose(micro[1]["loss"], full[1]["loss"], rtol=1e-6)
  assert_trees_close(micro[0], full[0], atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------ NaN stop
def test_skip_nonfinite_leaves_the_state_untouched():
  from condattn_jax.train import guards

  def step(state, batch):
    new = jax.tree.map(lambda x: x + 1.0, state)
    return new, {"loss": batch["loss"], "grad_norm": batch["gn"]}

  fn = jax.jit(guards.skip_nonfinite(step))
  state = {"w": np.arange(3.0), "step": np.float32(7)}
  for loss, gn, moved in ((1.0, 2.0, True), (np.nan, 2.0, False), (1.0, np.inf, False)):
    new, _ = fn(state, {"loss": np.float32(loss), "gn": np.float32(gn)})
    assert np.array_equal(host(new)["w"], state["w"] + 1.0 if moved else state["w"])
    assert float(new["step"]) == (8.0 if moved else 7.0)


@pytest.mark.manual
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  """loop.run in process: a non-finite loss stops the run, the checkpoint whose params produced
  it is set aside, the newest kept one is finite. Default cover: tests/cli/test_cli_errors.py::
  test_resume_skips_corrupt_and_nonfinite_never_reaches_a_checkpoint (the same stop through
  train.py: message, step bad-1 set aside, newest kept == bad-2, all kept finite)."""
  wd = str(tmp_path / "run")
  c = tiny("steps=4", checkpoint_every=4)
  loop.run(c, wd)
  good = host(loop.load_params(c, wd)[1])
  c = tiny("steps=8", checkpoint_every=1, lr=1e30, warmup_frac=0.0, grad_clip=0.0)
  with pytest.raises(loop.NonFiniteLossError, match=r"non-finite .* at step [5-8]: the update was "
                     r"skipped.*last good checkpoint is step [4-7]") as e:
    loop.run(c, wd)
  bad = int(str(e.value).split(" at step ")[1].split(":")[0])
  ck = ckpt_lib.Checkpointer(os.path.join(wd, "checkpoints"), read_only=True)
  last = ck.latest_step()
  ck.close()
  # the checkpoint of step bad-1 holds the params that produced the non-finite values: set aside
  assert last == max(4, bad - 2)
  assert os.path.isdir(os.path.join(wd, "checkpoints", f"{bad - 1}.nonfinite")) == (bad - 1 > 4)
  _, params, step = loop.load_params(c, wd)
  assert step == last and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host(params)))
  if last == 4:
    assert_trees_close(params, good, atol=0)


def test_progress_bar_shows_the_scheme_headline_metric():
  import io
  from condattn_jax.train import metrics as metrics_lib
  assert loop.headline_metric("l2a") == "l2a/sparsity" and loop.headline_metric("dense") is None
  buf = io.StringIO()
  bar = metrics_lib.ProgressBar(10, 0, stream=buf)
  means = {"loss": 1.0, "accuracy": 0.5, "l2a/sparsity": np.array([0.2, 0.4])}
  bar.update(5, 1.0, 100.0, loop._bar_extra(means, loop.headline_metric("l2a")))
  assert "loss 1.0000 acc 0.500 sparsity 0.300" in buf.getvalue()


# ------------------------------------------------------------------------- workdir lock
def test_workdir_lock_refuses_live_owner_and_takes_over_stale_one(tmp_path, caplog):
  from condattn_jax.train import workdir
  wd = workdir.prepare(str(tmp_path / "w"))
  lock = workdir.WorkdirLock.acquire(wd)
  info = json.load(open(os.path.join(wd, workdir.LOCK_NAME)))
  assert info["pid"] == os.getpid() and info["host"]
  with pytest.raises(workdir.WorkdirBusyError, match="already runs in workdir"):
    workdir.WorkdirLock.acquire(wd)
  lock.release()
  assert not os.path.exists(os.path.join(wd, workdir.LOCK_NAME))
  # a live process on this host (the parent of this test) holds it
  with open(os.path.join(wd, workdir.LOCK_NAME), "w") as f:
    json.dump(dict(info, pid=os.getppid(), proc_start=workdir._proc_start(os.getppid())), f)
  with pytest.raises(workdir.WorkdirBusyError, match=rf"in use by another run \(pid {os.getppid()}"):
    workdir.WorkdirLock.acquire(wd)
  # another host: cannot be checked from here
  with open(os.path.join(wd, workdir.LOCK_NAME), "w") as f:
    json.dump(dict(info, host="some-other-host"), f)
  with pytest.raises(workdir.WorkdirBusyError, match="on host some-other-host.*delete the lock"):
    workdir.WorkdirLock.acquire(wd)
  # a dead pid on this host (a run that was SIGKILLed): stale, taken over with a warning
  dead = subprocess.Popen(["true"])
  dead.wait()
  with open(os.path.join(wd, workdir.LOCK_NAME), "w") as f:
    json.dump(dict(info, pid=dead.pid), f)
  with caplog.at_level("WARNING"):
    lock = workdir.WorkdirLock.acquire(wd)
  assert "stale lock" in caplog.text
  assert json.load(open(os.path.join(wd, workdir.LOCK_NAME)))["pid"] == os.getpid()
  lock.release()


# ------------------------------------------------------------------------ dry run / export
def test_dry_run_on_fake_devices(capsys):
  c = tiny()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.train.dry_run = True
  r = loop.run(c, "")
  assert r["dry_run"]["mesh"] == {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
  assert r["dry_run"]["params"]["total"] == r["dry_run"]["params"]["trainable"] > 0
  assert r["dry_run"]["memory_per_device"]["peak_estimate_bytes"] > 0
  out = capsys.readouterr().out
  assert "memory per device [CPU-lowering estimate (reference attention)]" in out
  assert "params: total" in out and "model: qwen2, 2 layers" in out


# ---------------------------------------------------------------------- Hugging Face init
def test_init_from_hf_checkpoint_then_train(tmp_path):
  from condattn_jax.convert import load_hf_checkpoint
  c = tiny("steps=2")
  for f in config_lib.MODEL_FIELDS:
    c.model[f] = None  # architecture from config.json
  c.model.init_from = os.path.join(HF, "qwen2")  # vocab 96 >= MQAR vocab 64
  setup = loop.build(c, devices=ONE())
  assert setup.model_cfg.hidden_size == 32 and setup.model_cfg.tie_word_embeddings
  _, ref = load_hf_checkpoint(c.model.init_from)
  assert_trees_close(loop.init_params(setup), ref, atol=0)
  r = loop.run(c, str(tmp_path / "run"), devices=ONE())
  assert r["step"] == 2 and np.isfinite(r["train"]["loss"])
  saved = json.load(open(tmp_path / "run" / "config.json"))
  assert saved["model"]["init_from"].endswith("qwen2")
