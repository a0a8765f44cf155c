"""Orbax checkpoints of a run: params, optimizer state, data iterator state, metadata.

Layout (orbax CheckpointManager, one directory per step, keep-last-N, atomic finalisation):
  <workdir>/checkpoints/<step>/params      StandardSave of the param tree
                              /opt_state   StandardSave of the optax state
                              /data        grain iterator state, one process_<i>-of-<n>.json per process
                              /meta        JSON: step, config, model config, mesh, process count
Restores go into any mesh / process count: arrays are resharded to the target shardings by
orbax; the data state is re-split by lanes (condattn_jax.data: row r of every global batch is
lane r), so a run saved by 2 processes continues in 1 (or 4) with the same global batches.

Errors (all name the step directory):
  CheckpointNotFoundError   no such path / step
  CheckpointMismatchError   the saved tree (paths, shapes, optimizer leaves) is not this config's
                            model / optimizer: a config change, not damage; never skipped
  CorruptCheckpointError    the step cannot be read (truncated / missing files, bad JSON): the
                            caller may skip it (`quarantine` moves it to <step>.corrupt, which
                            orbax ignores) and fall back to an older step
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

ITEMS = ("params", "opt_state", "data", "meta")
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")


class CheckpointNotFoundError(FileNotFoundError):
  pass


class CheckpointMismatchError(ValueError):
  pass


class CheckpointWriteError(OSError):
  """The checkpoint directory cannot be written (permissions, immutable / read-only directory,
  disk full): raised before the first step and before each save, never after a half-written
  save (orbax would wait ~300 s for a step directory that can never appear). `cause` is the
  short reason (without the advice), for callers that compose their own message."""

  def __init__(self, msg: str, cause: str | None = None):
    super().__init__(msg)
    self.cause = cause or msg


class CorruptCheckpointError(ValueError):
  def __init__(self, msg: str, step: int | None = None):
    super().__init__(msg)
    self.step = step


def _first_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split("See full TensorStore details")[0].split())
  return f"{type(e).__name__}: {text[:limit]}"


def _leaves(tree) -> list[tuple[str, tuple]]:
  """('a/b/c', shape) of every array leaf (orbax metadata or arrays / ShapeDtypeStructs)."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not hasattr(x, "shape"):
      continue
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    out.append(("/".join(keys), tuple(int(d) for d in x.shape)))
  return out


class _StateSnapshot:
  """What grain's handler saves: the iterator state captured at save() time (the real iterator
  keeps moving while an async save is in flight)."""

  def __init__(self, state: dict):
    self._blob = json.dumps(state, indent=1).encode()

  def get_state(self) -> bytes:
    return self._blob


def _abstract(tree):
  """Arrays / ShapeDtypeStructs with shardings -> ShapeDtypeStructs for a restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_writable(directory: str) -> None:
  """CheckpointWriteError unless a step directory can be created and removed in `directory`
  (created if missing), which is what a save does first. Catches what os.access cannot:
  `chattr +i`, read-only mounts, a full disk, directories root may not write either. Call it
  before a writing Checkpointer is made: orbax's own background writes into an unwritable
  directory fail noisily at exit."""
  directory = os.path.abspath(directory)
  probe = os.path.join(directory, f".write_probe.{os.getpid()}")
  try:
    os.makedirs(directory, exist_ok=True)
    os.mkdir(probe)
    with open(os.path.join(probe, "x"), "w") as f:
      f.write("x")
    os.remove(os.path.join(probe, "x"))
    os.rmdir(probe)
  except OSError as e:
    try:
      if os.path.isdir(probe):
        for n in os.listdir(probe):
          os.remove(os.path.join(probe, n))
        os.rmdir(probe)
    except OSError:
      pass
    cause = f"checkpoint directory {directory} cannot be written ({e.strerror or e})"
    raise CheckpointWriteError(
        f"{cause}: make it writable (chmod u+w / chattr -i / free disk space) or use another "
        "--workdir.", cause) from None


def _no_replica_parallel_on_cpu() -> None:
  """On a CPU backend, orbax writes each jax.Array from its replica 0 (use_replica_parallel
  off, as orbax itself defaults on GPUs). Replica-parallel saving splits a replicated array's
  write across its replicas by slicing it on the devices: one compiled slice program per array
  shape and device count, which on CPU devices (one host's memory) buys nothing
  (tests/train/test_checkpoint.py: a save on 8 CPU devices compiles nothing and restores
  equal). Orbax's registry is process-wide: the handler is registered once, silently."""
  global _CPU_ARRAY_HANDLER
  if _CPU_ARRAY_HANDLER is None and jax.default_backend() == "cpu":
    # (orbax 0.12 exports neither the registry's silent add nor the metadata store)
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import type_handler_registry
    _CPU_ARRAY_HANDLER = ocp.type_handlers.ArrayHandler(  # orbax's default, one field changed
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array, _CPU_ARRAY_HANDLER, override=True, ignore_warnings=True)


_CPU_ARRAY_HANDLER = None


class Checkpointer:
  """Saves / restores one run's checkpoints under `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    _no_replica_parallel_on_cpu()
    self.directory = os.path.abspath(directory)
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise NotADirectoryError(f"checkpoint directory {self.directory} is a file.")
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointNotFoundError(f"checkpoint directory {self.directory} does not exist.")
    # a writer removes the <step>.orbax-checkpoint-tmp directories of saves that never finished
    # Step directories are made in save() itself (not in orbax's background thread, whose
    # failure leaves the commit waiting ~300 s for a 'step_directory_creation' signal).
    extra = dict(save_interval_steps=0) if read_only else dict(
        cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._in_flight: int | None = None  # step of the async save not yet known to be complete
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=async_save, **extra)
    self.mgr = ocp.CheckpointManager(
        self.directory, options=opts, item_names=ITEMS,
        item_handlers={"data": grain.checkpoint.CheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler(),
                       "params": ocp.StandardCheckpointHandler(),
                       "opt_state": ocp.StandardCheckpointHandler()})

  # -------------------------------------------------------------------------------- queries
  def latest_step(self) -> int | None:
    return self.mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.mgr.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _require(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointNotFoundError(f"no checkpoint in {self.directory} (expected step "
                                      "directories written by train.py).")
      return max(steps)
    if step not in steps:
      raise CheckpointNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available steps: {sorted(steps)}.")
    return step

  # ----------------------------------------------------------------------------------- save
  def check_writable(self) -> None:
    """`check_writable(self.directory)`."""
    check_writable(self.directory)

  def save(self, step: int, state, data_state: dict | None, meta: dict[str, Any]) -> None:
    args = dict(params=ocp.args.StandardSave(state.params),
                opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(dict(meta, step=int(step))))
    if data_state is not None:
      args["data"] = grain.checkpoint.CheckpointSave(_StateSnapshot(data_state))
    self.wait()  # a failed earlier save is reported as such (orbax would raise it from save)
    try:
      self.mgr.save(int(step), args=ocp.args.Composite(**args), force=True)
    except OSError as e:
      cause = f"the checkpoint of step {step} could not be written to {self.directory} ({e})"
      raise CheckpointWriteError(cause + ".", cause) from e
    self._in_flight = int(step)

  def save_params(self, step: int, params, meta: dict[str, Any]) -> None:
    """A params-only checkpoint (<step>/params + meta, no optimizer or data state): a model to
    evaluate or serve (restore_params / config_from_checkpoint), not a run to resume. Waits
    until it is on disk."""
    self.wait()
    try:
      self.mgr.save(int(step), args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(dict(meta, step=int(step)))),
          force=True)
    except OSError as e:
      cause = f"the checkpoint of step {step} could not be written to {self.directory} ({e})"
      raise CheckpointWriteError(cause + ".", cause) from e
    self._in_flight = int(step)
    self.wait()

  def wait(self) -> None:
    """Waits for the async save in flight; CheckpointWriteError (one line, naming the step and
    the newest complete checkpoint) when it failed in the background."""
    try:
      self.mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  (orbax re-raises the thread's error)
      step, self._in_flight = self._in_flight, None
      try:
        self.mgr.reload()
        good = max(self.all_steps(), default=None)
      except Exception:  # pylint: disable=broad-except
        good = None
      cause = (f"the checkpoint of step {step} could not be written to {self.directory} "
               f"({_first_line(e)})")
      raise CheckpointWriteError(
          f"{cause}; the newest complete checkpoint is "
          f"{'step ' + str(good) if good is not None else 'none'}. Make the directory writable "
          "(or free disk space) and re-run the same command to resume.", cause) from e
    self._in_flight = None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      try:
        # orbax removes unfinished saves' tmp directories in a background thread started by the
        # manager, and its close() does not wait for it: a process exiting right after (a user
        # error before the first step) printed that thread's traceback at interpreter shutdown.
        getattr(self.mgr, "_maybe_await_cleanup_tmp_directory", lambda: None)()
      except Exception:  # pylint: disable=broad-except  (cleanup is best effort)
        pass
      try:
        self.mgr.close()
      except Exception:  # pylint: disable=broad-except  (the failed save was reported by wait)
        pass

  # ------------------------------------------------------------------------ damaged steps
  def quarantine(self, step: int, suffix: str = "corrupt") -> str:
    """Moves <step>/ to <step>.<suffix>/ (orbax ignores it; the data stays for inspection) and
    returns the new path. Call on the primary process only."""
    src = self.step_dir(step)
    dst, i = f"{src}.{suffix}", 1
    while os.path.exists(dst):
      i += 1
      dst = f"{src}.{suffix}{i}"
    os.rename(src, dst)
    self.mgr.reload()
    return dst

  def _saved_leaves(self, step: int, item: str):
    try:
      meta = self.mgr.item_metadata(step)[item]
    except Exception as e:  # pylint: disable=broad-except  (unreadable / missing metadata)
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}/{item} cannot be read "
                                   f"({_first_line(e)}).", step) from e
    if meta is None:
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)} has no readable {item}/ "
                                   "(missing or incomplete).", step)
    return _leaves(getattr(meta, "tree", meta))

  def check_compatible(self, step: int, params=None, opt_state=None) -> None:
    """CheckpointMismatchError when the saved trees are not `params` / `opt_state`'s (paths and
    shapes; optimizer leaves by count and shapes); CorruptCheckpointError when unreadable."""
    if params is not None:
      saved = dict(self._saved_leaves(step, "params"))
      want = dict(_leaves(params))
      missing = sorted(set(want) - set(saved))
      extra = sorted(set(saved) - set(want))
      shapes = [f"{k} {saved[k]} vs {want[k]}" for k in sorted(set(want) & set(saved))
                if saved[k] != want[k]]
      if missing or extra or shapes:
        raise CheckpointMismatchError(
            f"checkpoint {self.step_dir(step)}/params does not match the model of this config "
            f"(changed architecture or scheme?): missing {missing[:4]}, unexpected {extra[:4]}, "
            f"shapes (saved vs this config) {shapes[:4]}.")
    if opt_state is not None:
      saved = sorted(s for _, s in self._saved_leaves(step, "opt_state"))
      want = sorted(s for _, s in _leaves(opt_state))
      if saved != want:
        raise CheckpointMismatchError(
            f"checkpoint {self.step_dir(step)}/opt_state holds {len(saved)} optimizer arrays, this "
            f"config's optimizer has {len(want)} (changed train.trainable_regex, param_groups or "
            "the optimizer?); use a new --workdir or the config the run was started with.")

  # -------------------------------------------------------------------------------- restore
  def restore_meta(self, step: int | None = None) -> dict:
    step = self._require(step)
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      meta = out["meta"]
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}/meta cannot be read "
                                   f"({_first_line(e)}).", step) from e
    if not isinstance(meta, dict) or "config" not in meta:
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}/meta holds no run config.",
                                   step)
    return dict(meta)

  def restore_params(self, target, step: int | None = None):
    """Params into `target`'s shapes/dtypes/shardings (arrays or ShapeDtypeStructs)."""
    step = self._require(step)
    self.check_compatible(step, params=target)
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(target))))
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)}/params cannot be read "
                                   f"(truncated or damaged files?): {_first_line(e)}", step) from e
    return out["params"]

  def restore_state(self, target_state, step: int | None = None):
    """TrainState (params + optimizer state + step) into `target_state`'s shardings."""
    step = self._require(step)
    self.check_compatible(step, params=target_state.params, opt_state=target_state.opt_state)
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(target_state.params)),
          opt_state=ocp.args.StandardRestore(_abstract(target_state.opt_state))))
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)} cannot be read (truncated "
                                   f"or damaged files?): {_first_line(e)}", step) from e
    import jax.numpy as jnp
    step_arr = jax.device_put(jnp.asarray(step, jnp.int32), target_state.step.sharding)
    return target_state.replace(step=step_arr, params=out["params"], opt_state=out["opt_state"])

  def restore_data_state(self, step: int, shard_index: int, shard_count: int) -> dict:
    """The data iterator state for shard `shard_index` of `shard_count`, from whatever process
    layout saved it (lanes re-split)."""
    d = os.path.join(self.step_dir(step), "data")
    files = {}
    for f in glob.glob(os.path.join(d, "process_*-of-*.json")):
      m = _DATA_FILE.search(f)
      files[int(m.group(1))] = (int(m.group(2)), f)
    if not files:
      raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)} has no data iterator state "
                                   f"({d}/process_*-of-*.json).", step)
    states = []
    for i in sorted(files):
      try:
        with open(files[i][1]) as fh:
          states.append(json.load(fh))
      except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"data iterator state {files[i][1]} cannot be read "
                                     f"({_first_line(e)}).", step) from e
    try:
      merged = merge_data_states(states, where=d)
    except (KeyError, TypeError, ValueError) as e:
      raise CorruptCheckpointError(f"data iterator state in {d} is damaged ({_first_line(e)}).",
                                   step) from e
    return split_data_state(merged, shard_index, shard_count)


def merge_data_states(states: list[dict], where: str = "") -> dict:
  """Per-process iterator states -> one global state with every lane (in lane order)."""
  if any(s.get("version") != 1 or "lanes" not in s for s in states):
    raise ValueError(f"data iterator state in {where} has an unknown format (expected "
                     "condattn_jax.data version 1 lane states).")
  states = sorted(states, key=lambda s: s["lane_start"])
  B = states[0]["global_batch_size"]
  lanes, exhausted, pos = [], [], 0
  for s in states:
    if s["lane_start"] != pos or s["global_batch_size"] != B or s["step"] != states[0]["step"]:
      raise ValueError(f"data iterator states in {where} do not tile the batch: lane_start "
                       f"{[x['lane_start'] for x in states]}, steps {[x['step'] for x in states]}.")
    lanes += s["lanes"]
    exhausted += s["exhausted"]
    pos += s["num_lanes"]
  if pos != B:
    raise ValueError(f"data iterator states in {where} hold {pos} lanes, expected {B}.")
  return dict(states[0], lane_start=0, num_lanes=B, lanes=lanes, exhausted=exhausted)


def split_data_state(full: dict, shard_index: int, shard_count: int) -> dict:
  B = full["global_batch_size"]
  if B % shard_count:
    raise ValueError(f"data.batch_size={B} is not divisible by {shard_count} data shards.")
  n = B // shard_count
  a = shard_index * n
  return dict(full, lane_start=a, num_lanes=n, lanes=full["lanes"][a:a + n],
              exhausted=full["exhausted"][a:a + n])


def resolve_checkpoint_path(path: str) -> tuple[str, int | None]:
  """A run's workdir, its checkpoints dir, or one step dir -> (checkpoints dir, step or None)."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointNotFoundError(f"checkpoint path {path} does not exist.")
  if not os.path.isdir(path):
    raise CheckpointNotFoundError(f"checkpoint path {path} is a file; give a run's workdir, its "
                                  "checkpoints/ directory or one <step>/ directory in it.")
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  base = os.path.basename(path.rstrip("/"))
  if base.isdigit() and os.path.isdir(os.path.join(path, "params")):
    return os.path.dirname(path), int(base)
  if any(n.isdigit() for n in os.listdir(path)):
    return path, None
  raise CheckpointNotFoundError(f"{path} is neither a workdir (with checkpoints/), a checkpoints "
                                "directory (with <step>/ subdirectories) nor a step directory "
                                "(<step>/params).")
