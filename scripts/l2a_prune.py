r"""L2A post-training pruning (docs/schemes/l2a.md#inference): measure, prune, report KV-cache bytes, re-evaluate,
save the pruned model.

  python scripts/l2a_prune.py --workdir=DIR                       # the run's own config
  python scripts/l2a_prune.py --config=configs/l2a_qwen.py:tiny --workdir=DIR
  python scripts/l2a_prune.py --checkpoint=DIR/checkpoints/4000 --context_len=131072 \
      --threshold=0.95 --config.model.scheme.theta=0.5

1. per-layer sparsity (fraction of tokens with d = 0) on held-out batches: the eval harness at
   --eval_len (default data.seq_len) with config.eval.num_batches batches of the eval stream;
2. layers with sparsity >= --threshold lose their global branch (global_attn, global_layernorm,
   router) and its full KV cache;
3. KV-cache bytes at --context_len for the dense base model, the L2A model before and after;
4. the pruned model is evaluated on the same batches (accuracy / ppl before and after);
5. the pruned model is saved as a params-only checkpoint whose saved config carries
   model.scheme.pruned_layers: <pruned_dir>/checkpoints/<step>/ (pruned_dir: --pruned_dir, else
   DIR/pruned). Serve or evaluate it like any run:
     python eval.py --checkpoint=DIR/pruned
   (it cannot be resumed: it holds no optimizer or data state).
Writes <out_dir>/l2a_prune.json and .md (out_dir: --out_dir, else DIR/eval).

Without --config the config saved with the checkpoint is used (`--config.a.b=v` then applies to
it, as in eval.py). A missing path, a run that is not L2A, or a checkpoint without a readable
config is one line starting with ERROR: (exit code 2).
"""
import os

from absl import app, flags
from ml_collections import config_flags

from condattn_jax.train import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe: configs/<name>.py[:arg] "
                                          "(default: the config saved with the checkpoint).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of train.py.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A workdir, its checkpoints/ dir or a step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.95, "Prune layers with sparsity >= this.")
_CONTEXT = flags.DEFINE_integer("context_len", None, "Context length of the KV-byte report "
                                "(default: data.seq_len).")
_EVAL_LEN = flags.DEFINE_integer("eval_len", None, "Held-out row length (default: data.seq_len).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write l2a_prune.{json,md}.")
_PRUNED_DIR = flags.DEFINE_string("pruned_dir", None, "Where to save the pruned model "
                                  "(default: <workdir>/pruned).")


def _workdir_of(path: str) -> str:
  from condattn_jax import checkpoint as ckpt_lib
  directory, _ = ckpt_lib.resolve_checkpoint_path(path)
  return os.path.dirname(directory) if os.path.basename(directory) == "checkpoints" else directory


def pruned_run_config(config, pruned_model_cfg):
  """`config` with model.scheme.pruned_layers set to the pruned model's."""
  import copy
  out = copy.deepcopy(config)
  pruned = tuple(int(i) for i in dict(pruned_model_cfg.scheme_kwargs).get("pruned_layers", ()))
  with out.unlocked():
    out.model.scheme.pruned_layers = pruned
  return out


def save_pruned(config, pruned_model_cfg, params, step: int, pruned_dir: str,
                source: str = "") -> str:
  """Writes the pruned model to <pruned_dir>/checkpoints/<step> (params + meta with the config)
  and <pruned_dir>/config.json; returns the step directory."""
  import dataclasses
  import json
  import jax
  from condattn_jax import checkpoint as ckpt_lib
  cfg = pruned_run_config(config, pruned_model_cfg)
  ckpt_lib.check_writable(os.path.join(pruned_dir, "checkpoints"))
  ck = ckpt_lib.Checkpointer(os.path.join(pruned_dir, "checkpoints"), keep=1)
  try:
    meta = dict(config=json.loads(cfg.to_json_best_effort()),
                model_config=dataclasses.asdict(pruned_model_cfg),
                process_count=jax.process_count(), pruned_from=os.path.abspath(source))
    ck.save_params(step, params, meta)
  finally:
    ck.close()
  with open(os.path.join(pruned_dir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort(indent=2))
  return ck.step_dir(step)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  path = _CHECKPOINT.value or _WORKDIR.value
  if not path:
    raise app.UsageError("give --workdir or --checkpoint (the L2A run to prune).")
  workdir = _workdir_of(path)  # a missing path / a file: one line, before jax starts
  from condattn_jax.train import loop
  config = _CONFIG.value
  if config is None:
    config = loop.config_from_checkpoint(path, _STEP.value)
    cli.apply_overrides(config, cli.PENDING_OVERRIDES)
  scheme = config.model.scheme.get("name")
  if scheme != "l2a":
    raise ValueError(f"{path}: L2A pruning needs an L2A run (model.scheme.name='l2a'); this "
                     f"config's scheme is {scheme!r}.")
  from condattn_jax.attention.l2a import report as l2a_report
  setup, params, step = loop.load_params(config, path, step=_STEP.value)
  rep = l2a_report.prune_and_evaluate(
      config, params, setup.model_cfg, setup.mesh, threshold=_THRESHOLD.value,
      context_len=_CONTEXT.value, eval_len=_EVAL_LEN.value)
  rep["report"]["step"] = int(step)
  pruned_dir = os.path.abspath(_PRUNED_DIR.value or os.path.join(workdir, "pruned"))
  step_dir = save_pruned(config, rep["config"], rep["params"], int(step), pruned_dir, path)
  rep["report"]["pruned_checkpoint"] = step_dir
  out_dir = _OUT_DIR.value or os.path.join(workdir, "eval")
  jp, mp = l2a_report.write(rep["report"], out_dir)
  print(open(mp).read())
  print(f"written to {jp} and {mp}")
  print(f"pruned model saved to {step_dir}; evaluate or serve it with: "
        f"python eval.py --checkpoint={pruned_dir}")


if __name__ == "__main__":
  cli.run(main)
