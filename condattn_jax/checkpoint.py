"""Orbax checkpoints of a run: params, optimizer state, data iterator state, metadata.

Layout (orbax CheckpointManager, one directory per step, keep-last-N, atomic finalisation):
  <workdir>/checkpoints/<step>/params      StandardSave of the param tree
                              /opt_state   StandardSave of the optax state
                              /data        grain iterator state, one process_<i>-of-<n>.json per process
                              /meta        JSON: step, config, model config, mesh, process count
Restores go into any mesh / process count: arrays are resharded to the target shardings by
orbax; the data state is re-split by lanes (condattn_jax.data: row r of every global batch is
lane r), so a run saved by 2 processes continues in 1 (or 4) with the same global batches.
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


class Checkpointer:
  """Saves / restores one run's checkpoints under `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=async_save)
    self.mgr = ocp.CheckpointManager(
        self.directory, options=opts, item_names=ITEMS,
        item_handlers={"data": grain.checkpoint.CheckpointHandler()})

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
  def save(self, step: int, state, data_state: dict | None, meta: dict[str, Any]) -> None:
    args = dict(params=ocp.args.StandardSave(state.params),
                opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(dict(meta, step=int(step))))
    if data_state is not None:
      args["data"] = grain.checkpoint.CheckpointSave(_StateSnapshot(data_state))
    self.mgr.save(int(step), args=ocp.args.Composite(**args), force=True)

  def wait(self) -> None:
    self.mgr.wait_until_finished()

  def close(self) -> None:
    self.mgr.wait_until_finished()
    self.mgr.close()

  # -------------------------------------------------------------------------------- restore
  def restore_meta(self, step: int | None = None) -> dict:
    step = self._require(step)
    out = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out["meta"])

  def restore_params(self, target, step: int | None = None):
    """Params into `target`'s shapes/dtypes/shardings (arrays or ShapeDtypeStructs)."""
    step = self._require(step)
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(target))))
    except (ValueError, KeyError) as e:
      raise ValueError(f"checkpoint {self.step_dir(step)}/params does not match the model of this "
                       f"config (different architecture or scheme?): {e}") from e
    return out["params"]

  def restore_state(self, target_state, step: int | None = None):
    """TrainState (params + optimizer state + step) into `target_state`'s shardings."""
    step = self._require(step)
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(target_state.params)),
          opt_state=ocp.args.StandardRestore(_abstract(target_state.opt_state))))
    except (ValueError, KeyError) as e:
      raise ValueError(f"checkpoint {self.step_dir(step)} does not match this run's model / "
                       f"optimizer (changed architecture, scheme, trainable_regex or "
                       f"param_groups?): {e}") from e
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
      raise CheckpointNotFoundError(f"checkpoint {self.step_dir(step)} has no data iterator state "
                                    f"({d}/process_*-of-*.json).")
    states = []
    for i in sorted(files):
      with open(files[i][1]) as fh:
        states.append(json.load(fh))
    return split_data_state(merge_data_states(states, where=d), shard_index, shard_count)


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
