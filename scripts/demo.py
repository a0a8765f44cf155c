r"""`make demo`: train a tiny decoder on a synthetic long-context recall task on this CPU, evaluate
it before and after, and print what it learned. A few minutes on 2 cores.

  python scripts/demo.py --workdir=/tmp/condattn_demo [--config_arg=steps=1200,...]

The same run through the two entry points:
  python train.py --config=configs/tiny.py:<config_arg> --workdir=DIR
  python eval.py  --config=configs/tiny.py:<config_arg> --workdir=DIR
"""
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/condattn_demo", "Where the demo run lives "
                               "(re-created on every run).")
_ARG = flags.DEFINE_string("config_arg", "demo", "Arg of configs/tiny.py (the 'demo' variant by "
                           "default).")
MARKER = ".condattn_demo"


def _fresh_workdir(path: str) -> str:
  if os.path.exists(path) and os.listdir(path):
    if not os.path.exists(os.path.join(path, MARKER)):
      raise app.UsageError(f"--workdir={path} is not empty and was not made by the demo; "
                           "choose another directory.")
    shutil.rmtree(path)
  os.makedirs(path, exist_ok=True)
  open(os.path.join(path, MARKER), "w").close()
  return path


def main(argv):
  del argv
  t0 = time.time()
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
  import jax
  from condattn_jax.train import loop
  from condattn_jax.train.cli import load_recipe

  workdir = _fresh_workdir(_WORKDIR.value)
  config = load_recipe(os.path.join(ROOT, "configs", "tiny.py") + ":" + _ARG.value)
  task = config.data.task
  chance = 1.0 / (int(task.vocab_size) - int(task.vocab_size) // 2)
  print(f"condattn-jax demo: a {config.model.num_layers}-layer {config.model.family} decoder "
        f"(width {config.model.hidden_size}) learns MQAR, multi-query associative recall: "
        f"{task.num_pairs} key-value pairs at the start of a {config.data.seq_len}-token sequence, "
        "then queries of the keys; the model must answer each with its value. It is evaluated "
        "on sequences up to 8x longer than it was trained on (more filler between the pairs and "
        f"the queries). Devices: {jax.device_count()} x {jax.devices()[0].platform}.\n")

  config.eval.at_start = True  # evaluate the untrained model first
  print(f"Evaluating the untrained model, training for {config.train.num_steps} steps (batch "
        f"{config.data.batch_size}), evaluating again ...")
  result = loop.run(config, workdir)
  before, after = result["eval_start"], result["eval"]
  print("done.\n")

  lines = ["| context length | token accuracy before | after | exact match before | after "
           "| answer ppl before | after |", "|---|---|---|---|---|---|---|"]
  for L in sorted(after["results"]):
    b, a = before["results"][L], after["results"][L]
    x = L // int(config.data.seq_len)
    lines.append(f"| {L}{' (trained)' if x == 1 else f' ({x}x longer)'} | "
                 f"{b['token_acc']:.3f} | **{a['token_acc']:.3f}** | {b['exact_match']:.3f} | "
                 f"**{a['exact_match']:.3f}** | {b['ppl']:.2f} | {a['ppl']:.2f} |")
  table = "\n".join(lines)
  print(table)
  L0 = int(config.data.seq_len)
  acc0, acc1 = before["results"][L0]["token_acc"], after["results"][L0]["token_acc"]
  n = int(task.num_pairs)
  q = int(task.get("num_queries") or n)
  # Knowing only which values are in the context and which were already asked: query i of q
  # picks among the n - i values not asked yet.
  context_only = sum(1.0 / (n - i) for i in range(q)) / q
  print(f"\nAnswer accuracy at the trained length: {acc0:.1%} before -> {acc1:.1%} after.\n"
        f"  chance (one of {int(round(1 / chance))} values): {chance:.1%}\n"
        f"  using the context without pairing keys to values (pick a value of this sequence not "
        f"asked yet): {context_only:.1%}\n"
        f"  exact key -> value recall: 100%")
  if acc1 > context_only + 0.05:
    longest = max(after["results"])
    print("What it learned: to recall the value stored with each queried key from earlier in the "
          f"sequence (associative recall); at {longest} tokens ({longest // L0}x the training "
          f"length) it still answers {after['results'][longest]['token_acc']:.1%} of the queries.")
  else:
    print("What it learned: which values occur in this sequence and which were already asked, "
          "i.e. to read its context; pairing each key with its value (an induction circuit) "
          "did not happen in this run (try --config_arg=demo,seed=1 or more steps).")
  with open(os.path.join(workdir, "demo.md"), "w") as f:
    f.write(table + "\n")
  print(f"Metrics: {workdir}/metrics.jsonl, TensorBoard: {workdir}/tb, eval: {workdir}/eval, "
        f"table: {workdir}/demo.md. Total {time.time() - t0:.0f}s.")
  if acc1 <= acc0 + 0.05:
    print("WARNING: accuracy did not rise; something is wrong.", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
