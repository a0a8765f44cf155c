r"""Evaluate a model: perplexity at several context lengths + synthetic-task accuracy.

  python eval.py --config=configs/<recipe>.py[:arg] --workdir=DIR          # latest checkpoint
  python eval.py --config=... --checkpoint=DIR/checkpoints/400             # one checkpoint
  python eval.py --checkpoint=DIR                                          # config saved with it
  python eval.py --checkpoint=DIR --config.model.scheme.theta=0.7          # ... with a knob changed
  python eval.py --config=... --init                                       # step-0 params
                                                                           # (random / init_from)
  --config.eval.context_lengths='(512,1024)' --config.model.scheme.theta=0.7   test-time knobs

Generation-scored long-context suite, several checkpoints head to head (one report):

  python eval.py --suite=tiny --checkpoint=runs/dense --checkpoint=runs/l2a
  python eval.py --suite=ruler --lengths=4096,8192 --num_samples=20 --checkpoint=runs/l2a@theta=0.7
  python eval.py --suite=ruler --checkpoint=runs/dense --checkpoint=runs/l2a --sweep=theta=0.3,0.5
  python eval.py --suite=tiny --config=configs/tiny.py --init    # step-0 params of a recipe

  A checkpoint is DIR[@knob=value,...]: test-time scheme options for that model
  (`--config.model.scheme.<knob>=v` sets one for every model); --sweep evaluates each
  checkpoint whose scheme has that knob once per value (an accuracy-vs-TTFT curve; the others,
  e.g. the dense base, once). Efficiency is compared with the first dense checkpoint given (the
  dense base). --ppl_docs adds perplexity by position on user documents. Writes
  <out_dir>/h2h_<suite>_<hash>.{json,md} and PNGs (accuracy vs length, accuracy vs TTFT,
  routing heatmaps), the hash covering every knob (never overwriting a result with other
  knobs); out_dir defaults to <first run's workdir>/eval. See condattn_jax/evaluation/README.md.

Perplexity / teacher-forced mode (no --suite) writes <out_dir>/eval_step<N>.json and .md
(out_dir: --out_dir, else <run workdir>/eval) and prints the markdown table. The JSON records the knobs (scheme hyper-parameters, eval section);
knobs that differ from the run's own add a tag to the name (eval_step<N>_theta=0.7.json), so an
earlier eval with other knobs is never overwritten. A bad input (missing / corrupt checkpoint, a
file given as --checkpoint, an unknown override) is one line starting with ERROR: and exit code 2
(--debug shows the traceback); without --step a corrupt newest checkpoint is skipped with a
warning.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from condattn_jax.train import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe: configs/<name>.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of train.py.")
_CHECKPOINT = flags.DEFINE_multi_string(
    "checkpoint", None, "A workdir, its checkpoints/ dir or one step dir; with --suite, "
    "repeatable, each DIR[@knob=value,...].")
_SUITE = flags.DEFINE_string("suite", None, "Generation-scored task suite (tiny, ruler, long, "
                             "synthetic): head-to-head mode.")
_LENGTHS = flags.DEFINE_list("lengths", None, "--suite: context lengths (default: the suite's).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None, "--suite: samples per task and length.")
_TASKS = flags.DEFINE_list("tasks", None, "--suite: only these tasks.")
_SEED = flags.DEFINE_integer("seed", 0, "--suite: seed of the generated samples.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "--suite: prompts per generate call.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", None, "--suite: prefill chunk (tokens).")
_SWEEP = flags.DEFINE_string("sweep", None, "--suite: knob=v1,v2,... evaluated per checkpoint.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "--suite: tokenizer dir (default: the run's).")
_HAYSTACK = flags.DEFINE_string("haystack_file", None, "--suite: text file for the essay "
                                "haystack tasks.")
_QA_FILE = flags.DEFINE_string("qa_file", None, "--suite: JSON / JSONL QA rows for the qa task.")
_PPL_DOCS = flags.DEFINE_string("ppl_docs", None, "--suite: documents (.jsonl rows {text} or "
                                "{tokens}, or a text file) for perplexity by position.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_INIT = flags.DEFINE_bool("init", False, "Evaluate the initial params instead of a checkpoint.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to write the JSON / markdown results.")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "always", "never"],
                                 "jax.distributed.initialize() policy.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SUITE.value:
    return suite_main()
  paths = _CHECKPOINT.value or []
  if len(paths) > 1:
    raise app.UsageError("several --checkpoint need --suite (head-to-head mode).")
  path = (paths[0] if paths else None) or _WORKDIR.value
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


def _parse_value(raw: str):
  import ast
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return raw


def _parse_checkpoint(spec: str) -> tuple[str, dict]:
  """'DIR@theta=0.7,window=64' -> ('DIR', {'theta': 0.7, 'window': 64})."""
  path, _, opts = spec.partition("@")
  knobs = {}
  for item in filter(None, opts.split(",")):
    k, eq, v = item.partition("=")
    if not eq or not k:
      raise ValueError(f"--checkpoint={spec}: options are knob=value pairs after '@' "
                       f"(e.g. {path}@theta=0.7).")
    knobs[k.strip()] = _parse_value(v.strip())
  return path, knobs


def _global_scheme_options() -> dict:
  """--config.model.scheme.<knob>=v given without --config: an option for every model."""
  out = {}
  for dotted, raw in cli.PENDING_OVERRIDES:
    if not dotted.startswith("model.scheme."):
      raise ValueError(f"--config.{dotted}: with --suite only test-time scheme options "
                       f"(--config.model.scheme.<knob>=...) apply; give the others to train.py.")
    out[dotted[len("model.scheme."):]] = _parse_value(raw)
  return out


def suite_main():
  from condattn_jax import checkpoint as ckpt_lib
  from condattn_jax.evaluation import harness, headtohead
  paths = _CHECKPOINT.value or []
  if not paths and not _INIT.value:
    raise app.UsageError("--suite needs --checkpoint=DIR (repeatable) or --config=... --init.")
  specs = [_parse_checkpoint(p) for p in paths]
  for path, _ in specs:
    ckpt_lib.resolve_checkpoint_path(path)  # a missing path: one line, before jax starts
  common = _global_scheme_options()
  sweep = None
  if _SWEEP.value:
    knob, eq, values = _SWEEP.value.partition("=")
    if not eq or not values:
      raise ValueError(f"--sweep={_SWEEP.value}: write knob=v1,v2,... (e.g. theta=0.3,0.5,0.7).")
    sweep = (knob, [_parse_value(v) for v in values.split(",")])
  tokenizer = None
  if _TOKENIZER.value:
    from condattn_jax.data.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(_TOKENIZER.value)

  def load(path, **opts):  # --step: that step of every checkpoint (default: the newest)
    return harness.load_model(path, step=_STEP.value, tokenizer=tokenizer, **opts)

  models, swept = [], 0
  for path, knobs in specs:
    opts = {**common, **knobs}
    if sweep:
      try:
        first = load(path, **{**opts, sweep[0]: sweep[1][0]})
      except ValueError as e:
        if sweep[0] not in str(e):
          raise
        print(f"--sweep: {path} has no option {sweep[0]!r}: evaluated once.", file=sys.stderr)
        models.append(load(path, **opts))
        continue
      swept += 1
      for value in sweep[1]:
        m = first if value == sweep[1][0] else load(path, **{**opts, sweep[0]: value})
        m.knobs["sweep"] = {sweep[0]: value}
        models.append(m)
    else:
      models.append(load(path, **opts))
  if sweep and not swept:
    raise ValueError(f"--sweep={_SWEEP.value}: no checkpoint has the option {sweep[0]!r}.")
  if _INIT.value:
    models += _init_models(common, tokenizer)
  lengths = [int(x) for x in _LENGTHS.value] if _LENGTHS.value else None
  report = headtohead.run_suite(
      models, _SUITE.value, lengths=lengths, num_samples=_NUM_SAMPLES.value, seed=_SEED.value,
      batch_size=_BATCH.value, prefill_chunk=_PREFILL_CHUNK.value, tasks=_TASKS.value,
      haystack_file=_HAYSTACK.value, qa_file=_QA_FILE.value, ppl_docs=_PPL_DOCS.value)
  out_dir = _OUT_DIR.value or _default_out_dir(specs[0][0] if specs else None)
  files = headtohead.write_report(report, out_dir)
  print(headtohead.markdown(report))
  print("written to " + ", ".join(files))


def _init_models(common: dict, tokenizer):
  """--init with --suite: the recipe's step-0 params (random, or model.init_from converted)."""
  from condattn_jax.evaluation import harness
  from condattn_jax.train import loop
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--init needs --config=configs/<recipe>.py.")
  with config.unlocked():
    for k, v in common.items():
      config.model.scheme[k] = v
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
    config.mesh.sequence = 1  # one device: a recipe's sequence parallelism does not apply
  import jax
  setup = loop.build(config, devices=jax.local_devices()[:1])
  params = loop.init_params(setup)
  name = f"{setup.model_cfg.scheme}-init"
  return [harness.model_from_params(name, setup.model_cfg, params, tokenizer=tokenizer,
                                    knobs={"init": True, "step": 0})]


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
