"""Multi-host start-up: `jax.distributed.initialize()` when the environment says the run spans
several processes (TPU pod slices, SLURM / Open MPI multi-node GPU jobs, or explicit
JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID). Call it before anything touches
jax devices. On CPU it selects gloo collectives so fake-device processes can talk."""
from __future__ import annotations

import logging
import os

import jax


def _int_env(name: str) -> int | None:
  v = os.environ.get(name)
  try:
    return int(v) if v not in (None, "") else None
  except ValueError:
    return None


def multihost_environment() -> str | None:
  """A short description of the multi-process environment found, or None (single process)."""
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS") and (_int_env("JAX_NUM_PROCESSES") or 1) > 1:
    return "explicit (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
  if (_int_env("SLURM_NTASKS") or 1) > 1 and env.get("SLURM_JOB_ID"):
    return "SLURM"
  if (_int_env("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "Open MPI"
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  if len([h for h in hosts.split(",") if h.strip()]) > 1 or (_int_env("MEGASCALE_NUM_SLICES") or 1) > 1:
    return "Cloud TPU pod"
  return None


def is_initialized() -> bool:
  from jax._src import distributed
  return distributed.global_state.client is not None


def maybe_initialize(mode: str = "auto") -> bool:
  """mode 'auto' (initialize when `multihost_environment()` finds one), 'always', 'never'.
  Returns whether jax.distributed is initialized afterwards."""
  if mode not in ("auto", "always", "never"):
    raise ValueError(f"--distributed={mode!r}: choose auto, always or never.")
  if is_initialized():
    return True
  if mode == "never":
    return False
  found = multihost_environment()
  if mode == "auto" and found is None:
    return False
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms in ("", "cpu") or "cpu" in platforms.split(","):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kw = {}
  if os.environ.get("JAX_COORDINATOR_ADDRESS") and _int_env("JAX_NUM_PROCESSES"):
    kw = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
              num_processes=_int_env("JAX_NUM_PROCESSES"), process_id=_int_env("JAX_PROCESS_ID"))
  logging.info("jax.distributed.initialize (%s)", found or "forced")
  jax.distributed.initialize(**kw)
  logging.info("process %d of %d, %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True
