r"""Evaluate a model: perplexity at several context lengths + synthetic-task accuracy.

  python eval.py --config=configs/<recipe>.py[:arg] --workdir=DIR          # latest checkpoint
  python eval.py --config=... --checkpoint=DIR/checkpoints/400             # one checkpoint
  python eval.py --checkpoint=DIR                                          # config saved with it
  python eval.py --checkpoint=DIR --config.model.scheme.theta=0.7          # ... with a knob changed
  python eval.py --config=... --init                                       # step-0 params
                                                                           # (random / init_from)
  --config.eval.context_lengths='(512,1024)' --config.model.scheme.theta=0.7   test-time knobs

Writes <out_dir>/eval_step<N>.json and .md (out_dir: --out_dir, else <run workdir>/eval) and
prints the markdown table. The JSON records the knobs (scheme hyper-parameters, eval section);
knobs that differ from the run's own add a tag to the name (eval_step<N>_theta=0.7.json), so an
earlier eval with other knobs is never overwritten. A bad input (missing / corrupt checkpoint, a
file given as --checkpoint, an unknown override) is one line starting with ERROR: and exit code 2
(--debug shows the traceback); without --step a corrupt newest checkpoint is skipped with a
warning.
"""
import os

from absl import app, flags
from ml_collections import config_flags

from condattn_jax.train import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe: configs/<name>.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of train.py.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "A workdir, its checkpoints/ dir or one step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_INIT = flags.DEFINE_bool("init", False, "Evaluate the initial params instead of a checkpoint.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write the JSON / markdown results.")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "always", "never"],
                                 "jax.distributed.initialize() policy.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  path = _CHECKPOINT.value or _WORKDIR.value
  if not _INIT.value and not path:
    raise app.UsageError("give --workdir or --checkpoint (or --init to evaluate step-0 params).")
  config = _CONFIG.value
  if config is None and _INIT.value:
    raise app.UsageError("--config is required with --init.")
  from condattn_jax import checkpoint as ckpt_lib
  if path:
    ckpt_lib.resolve_checkpoint_path(path)  # a missing path / a file: one line, before jax starts
  from condattn_jax.train import distributed
  distributed.maybe_initialize(_DISTRIBUTED.value)
  import jax
  from condattn_jax import evaluation
  from condattn_jax.train import loop
  if config is None:
    config = loop.config_from_checkpoint(path, _STEP.value)
    cli.apply_overrides(config, cli.PENDING_OVERRIDES)  # --config.x=... given without --config
  out_dir = _OUT_DIR.value or _default_out_dir(path)
  res = loop.evaluate_checkpoint(config, None if _INIT.value else path, step=_STEP.value,
                                 out_dir=out_dir)
  if jax.process_index() == 0:
    print(evaluation.markdown_table(res, f"Evaluation at step {res['step']}"))
    print("written to " + " and ".join(res.get("files", [])))


def _default_out_dir(path):
  """<workdir>/eval for a workdir, checkpoints dir or step dir; ./eval for --init."""
  if not path:
    return os.path.abspath("eval")
  from condattn_jax import checkpoint as ckpt_lib
  directory, _ = ckpt_lib.resolve_checkpoint_path(path)
  workdir = os.path.dirname(directory) if os.path.basename(directory) == "checkpoints" else directory
  return os.path.join(workdir, "eval")


if __name__ == "__main__":
  cli.run(main)
