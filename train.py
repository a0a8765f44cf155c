r"""Train a model:  python train.py --config=configs/<recipe>.py[:arg] --workdir=DIR

  --config.train.num_steps=2000     override any existing config field (the config is locked:
                                    unknown fields are errors)
  --config.train.dry_run=True       build mesh + shapes, AOT-compile the sharded step, print
  (or --dry_run)                    the model, parameter counts and per-device memory, exit
  --dry_run_device=v5p|h100|h200    dry run judged against that accelerator's memory ("fits
                                    with X GiB to spare" / "short by X GiB, try ..."): v5p is
                                    compiled for a TPU topology of this host's device count
                                    (needs libtpu), h100 / h200 on this host's GPUs, or on a
                                    CPU host as a labelled CPU-lowering estimate
  --stop_after=N                    save and stop after N steps of this invocation
  --distributed=auto|always|never   jax.distributed.initialize() for multi-host runs (auto:
                                    when the environment says so: TPU pod, SLURM, Open MPI,
                                    JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID)

  --debug                           tracebacks for user errors, library logs below WARNING

Re-running the same command resumes from the latest checkpoint in DIR/checkpoints (a corrupt or
partial one is skipped with a warning). Re-running with changed settings (--config.train.lr,
num_steps, ...) resumes too and says so: a warning lists the changed fields, they apply from the
resumed step on (the lr schedule is recomputed), and the previous DIR/config.json is kept as
DIR/config.step<N>.json. Metrics: DIR/metrics.jsonl (one record per logged step, also after a
kill -9: the records after the resumed checkpoint are replaced), DIR/metrics.png (loss, lr, the
scheme's headline metric; at the end and on a stop), TensorBoard event files in DIR/tb (view with
`pip install tensorboard; tensorboard --logdir DIR/tb`). A DIR/checkpoints that cannot be written
is refused before the first step, and stops the run at the next save (one line naming the last
good checkpoint). SIGTERM or Ctrl-C saves a checkpoint and exits (code 0);
a second Ctrl-C exits at once (code 130). A NaN / inf loss or gradient norm skips that update,
stops the run (code 3) and leaves the last good checkpoint in place. One run per workdir (a lock
file DIR/run.lock). Any bad input (config, files, checkpoint, data) is one line starting with
ERROR: and exit code 2.
"""
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from condattn_jax.train import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe: configs/<name>.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, eval).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Same as --config.train.dry_run=True.")
_DRY_RUN_DEVICE = flags.DEFINE_enum("dry_run_device", None, ["v5p", "h100", "h200"],
                                    "Implies --dry_run; judges the memory against this "
                                    "accelerator (same as --config.train.dry_run_device).")
_STOP_AFTER = flags.DEFINE_integer("stop_after", None, "Stop (with a checkpoint) after this many "
                                   "steps in this invocation; re-run to continue.")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "always", "never"],
                                 "jax.distributed.initialize() policy.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from condattn_jax.train import distributed
  distributed.maybe_initialize(_DISTRIBUTED.value)
  from condattn_jax.train import loop
  config = _CONFIG.value
  if _DRY_RUN.value or _DRY_RUN_DEVICE.value:
    config.train.dry_run = True
  if _DRY_RUN_DEVICE.value:
    config.train.dry_run_device = _DRY_RUN_DEVICE.value
  if not config.train.dry_run and not _WORKDIR.value:
    raise app.UsageError("--workdir is required (except with --dry_run).")
  try:
    result = loop.run(config, _WORKDIR.value or "", stop_after=_STOP_AFTER.value)
  except loop.NonFiniteLossError as e:
    print(f"ERROR: {cli.one_line(e)}", file=sys.stderr)
    sys.exit(3)
  if result.get("stopped_early") and not config.train.dry_run:
    logging.warning("stopped at step %d before num_steps; re-run the same command to resume.",
                    result["step"])


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)
