r"""L2A post-training pruning (SCHEMES.md 1): measure, prune, report KV-cache bytes, re-evaluate.

  python scripts/l2a_prune.py --config=configs/l2a_qwen.py:tiny --workdir=DIR
  python scripts/l2a_prune.py --config=configs/l2a_qwen.py --checkpoint=DIR/checkpoints/4000 \
      --context_len=131072 --threshold=0.95 --config.model.scheme.theta=0.5

1. per-layer sparsity (fraction of tokens with d = 0) on held-out batches: the eval harness at
   --eval_len (default data.seq_len) with config.eval.num_batches batches of the eval stream;
2. layers with sparsity >= --threshold lose their global branch (global_attn, global_layernorm,
   router) and its full KV cache;
3. KV-cache bytes at --context_len for the dense base model, the L2A model before and after;
4. the pruned model is evaluated on the same batches (accuracy / ppl before and after).
Writes <out_dir>/l2a_prune.json and .md (out_dir: --out_dir, else DIR/eval). Serve the pruned
model with --config.model.scheme.pruned_layers='(i, j, ...)' and the pruned params.
"""
import json
import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe: configs/<name>.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of train.py.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A workdir, its checkpoints/ dir or a step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.95, "Prune layers with sparsity >= this.")
_CONTEXT = flags.DEFINE_integer("context_len", None, "Context length of the KV-byte report "
                                "(default: data.seq_len).")
_EVAL_LEN = flags.DEFINE_integer("eval_len", None, "Held-out row length (default: data.seq_len).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write l2a_prune.{json,md}.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from condattn_jax.attention.l2a import report as l2a_report
  from condattn_jax.train import loop
  path = _CHECKPOINT.value or _WORKDIR.value
  if not path:
    raise app.UsageError("give --workdir or --checkpoint.")
  config = _CONFIG.value
  setup, params, step = loop.load_params(config, path, step=_STEP.value)
  rep = l2a_report.prune_and_evaluate(
      config, params, setup.model_cfg, setup.mesh, threshold=_THRESHOLD.value,
      context_len=_CONTEXT.value, eval_len=_EVAL_LEN.value)
  rep["report"]["step"] = int(step)
  out_dir = _OUT_DIR.value or os.path.join(os.path.abspath(_WORKDIR.value or path), "eval")
  jp, mp = l2a_report.write(rep["report"], out_dir)
  print(open(mp).read())
  print(f"written to {jp} and {mp}")


if __name__ == "__main__":
  from condattn_jax.train.cli import parse_flags
  app.run(main, flags_parser=parse_flags)
