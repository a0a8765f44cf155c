"""Exploratory (issue 28): which dense pretraining recipe of the head-to-head's h100 model learns
the suite's NIAH tasks? Runs several short trainings at once on one GPU (one process each, the
same h100 model), prints each one's answer-token accuracy every 100 steps.

    python -m bench.h2h_recipe_probe --round=2 --budget_s=390 --out_dir=$OUT       # one GPU call
    python -m bench.h2h_recipe_probe --round=2 --record=DIR --device="NVIDIA H200" \
        --commit=SHA --date=ISO                            # its probe_*.json into bench/results
    python -m bench.h2h_recipe_probe --record_dense=<state_dir>/dense/metrics.jsonl \
        --device=... --commit=... --date=...    # a head-to-head dense pretraining's log (a run)

Each variant trains the h100 model for up to 10000 steps within the budget, then is scored on
held-out rows (the eval seed) per task at its training length and twice it (`per_task`,
teacher-forced answer-token accuracy). A variant qualifies when its mean held-out NIAH accuracy
at its training length is >= QUALIFY.
"""
import json
import os
import shutil
import subprocess
import sys
import time

from absl import flags

from bench import common
from bench import eval_head_to_head as h2h

NIAH = list(h2h.NIAH_TASKS)
SHORT_MIX = NIAH + ["vt", "fwe", "json_kv", "passkey"]  # cwe / mqar do not fit 128-id samples
# Round 1 (one H200, 2026-11-28, tree 33fff36, rows read in the training thread:
# read_threads=0): train accuracy only (per_task came after it).
ROUND1 = {
    "mix1024": dict(seq_len=1024, lr=1e-3, tasks=None),  # the h100 preset's first phase
    "niah1024": dict(seq_len=1024, lr=1e-3, tasks=NIAH),
    "niah128": dict(seq_len=128, lr=1e-3, tasks=NIAH),
    "mix128": dict(seq_len=128, lr=1e-3, tasks=SHORT_MIX),
    "niah256_lr3e-4": dict(seq_len=256, lr=3e-4, tasks=NIAH),
    "niah128_b64": dict(seq_len=128, lr=1e-3, tasks=NIAH, batch=64),
}
# Round 2, registered before it runs (revised before it ran: a 90 s smoke of the first draft,
# batch {64, 256} x lr at 128-token rows, showed the 256-row arms bound by generating the rows:
# step 100 in the 90 s budget (compile included) where the 64-row arms reached 500-700; and a
# CPU toy (2 x 64 wide, 1500 steps, NIAH single) learned with 4 samples of 64 ids
# packed in a 256-id row (0.18 train, 0.18 held out at 64) where one 256-id sample a row stayed at
# chance; the same toy on a 3000-step schedule, stopped by its 600 s budget at step 1300: 0.90
# train, held out 0.945 at 64 ids and 0.83 at 128): rows of 1024 ids holding `pack` samples as
# documents, so a step scores pack x the answers at the same row length. Crossed: samples of
# 64 / 128 / 256 ids, lr 1e-3 / 3e-4 (16 rows); the short mixture once. niah128_b64 is round 1's
# best (unpacked, as a control).
ROUND2 = {
    "niah_p8": dict(seq_len=1024, pack=8, lr=1e-3, tasks=NIAH),
    "niah_p8_lr3e-4": dict(seq_len=1024, pack=8, lr=3e-4, tasks=NIAH),
    "niah_p16_lr3e-4": dict(seq_len=1024, pack=16, lr=3e-4, tasks=NIAH),
    "niah_p4_lr3e-4": dict(seq_len=1024, pack=4, lr=3e-4, tasks=NIAH),
    "mix_p8_lr3e-4": dict(seq_len=1024, pack=8, lr=3e-4, tasks=SHORT_MIX),
    "niah128_b64": dict(seq_len=128, lr=1e-3, tasks=NIAH, batch=64),
}
ROUNDS = {"1": ROUND1, "2": ROUND2}
# A variant qualifies as the pretraining's first phase when its held-out NIAH accuracy (per_task,
# mean over the 4 NIAH tasks at its training length) is >= 0.9 (round 1 has no per_task: judged on
# its train accuracy, which no variant brought above 0.32).
QUALIFY = 0.9
RUNS_DIR = "/tmp/probe_runs"  # the trainings' workdirs (each variant's is emptied first)
VARIANTS = dict(ROUND2)


def one(name, budget_s, out_dir, steps=10000):
  from condattn_jax.train import loop
  v = VARIANTS[name]
  p = dict(h2h.PRESETS["h100"], batch=v.get("batch", 16), read_threads=2)
  c = h2h.run_config(p, seq_len=v["seq_len"], num_steps=steps, lr=v["lr"],
                     pack=v.get("pack", 1))  # pack: samples of seq_len // pack ids a row
  if v["tasks"]:
    c.data.task.tasks = list(v["tasks"])
  c.train.log_every = 100
  wd = os.path.join(RUNS_DIR, name)
  shutil.rmtree(wd, ignore_errors=True)
  t = time.time()
  loop.run(c, wd, time_budget_s=budget_s)
  wall = time.time() - t
  rows = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  out = dict(variant=name, settings=v, wall_s=round(wall, 1), per_task=per_task(c, wd, v),
             curve=[(m["step"], round(m["train/accuracy"], 4), round(m["train/ce"], 4))
                    for m in rows if "train/accuracy" in m])
  with open(os.path.join(out_dir, f"probe_{name}.json"), "w") as f:
    json.dump(out, f)


def per_task(c, wd, v, batches=4):
  """Teacher-forced answer-token accuracy of the trained model per task (held-out rows: the eval
  seed, one sample a row), at the samples' training length (seq_len // pack) and twice it; a
  task whose sample does not fit a length is not scored there."""
  import copy

  import ml_collections

  from condattn_jax.evaluation import perplexity
  from condattn_jax.evaluation import tasks as suite_lib
  from condattn_jax.train import loop
  setup, params, _ = loop.load_params(c, wd)
  suite, vocab = c.data.task.suite, c.data.task.vocab_size
  out = {}
  for task in v["tasks"] or suite_lib.suite_tasks(suite, token_level=True):
    n = v["seq_len"] // v.get("pack", 1)  # the samples' length
    for L in (n, 2 * n):
      if not h2h.fits(task, L, vocab=vocab, suite=suite):
        continue
      ct = copy.deepcopy(c)
      ct.data.task = ml_collections.ConfigDict(dict(c.data.task.to_dict(), tasks=[task], pack=1))
      ct.eval.num_batches = batches
      ct.eval.batch_size = 16
      r = perplexity.evaluate(ct, params, setup.model_cfg, setup.mesh, lengths=[L])
      out[f"{task}@{L}"] = round(float(r["results"][L]["token_acc"]), 3)
  return out


def niah_score(r) -> float | None:
  """Mean held-out accuracy over the NIAH tasks at the variant's training length, else None."""
  pt = r.get("per_task") or {}
  L = r["settings"]["seq_len"] // r["settings"].get("pack", 1)
  vals = [pt.get(f"{t}@{L}") for t in NIAH]
  return None if None in vals else sum(vals) / len(vals)


def verdict(rows) -> dict:
  """The round's verdict from its rows: the variants that qualify (held-out NIAH accuracy, or
  train accuracy where a round has no per_task, >= QUALIFY)."""
  q = [r["variant"] for r in rows if r["qualifies"]]
  return dict(qualified=q, verdict=("qualified: " + ", ".join(q)) if q else "no variant qualifies")


def record(src: str, rnd: str, device: str, commit: str, date: str, out: str) -> dict:
  """The round's probe_*.json in `src` as one run appended to
  <out>/h2h_recipe_probe_<device>.json (rows: per variant its curve and per_task accuracies)."""
  from bench import common
  run = common.new_run("h2h_recipe_probe", dict(name=f"round{rnd}", round=int(rnd),
                                                 variants=ROUNDS[rnd], qualify=QUALIFY),
                       device=device, date=date, commit=commit)
  for n in ROUNDS[rnd]:
    r = json.load(open(os.path.join(src, f"probe_{n}.json")))
    score = niah_score(r)
    last = r["curve"][-1]
    run["rows"].append(dict(variant=n, **r["settings"], wall_s=r["wall_s"], steps=last[0],
                            train_accuracy=last[1], train_ce=last[2], niah_heldout=score,
                            qualifies=bool((score if score is not None else last[1]) >= QUALIFY),
                            per_task=r.get("per_task"), curve=r["curve"]))
  run["recorded"] = verdict(run["rows"])  # bench/claims/h2h_recipe_probe.py re-derives it
  common.append_run(common.result_path("h2h_recipe_probe", out, device), run)
  return run


def record_dense(metrics: str, device: str, commit: str, date: str, out: str) -> dict:
  """A head-to-head dense pretraining's log (<state_dir>/dense/metrics.jsonl, loop.run's) as run
  `h100_preset_dense` of <out>/h2h_recipe_probe_<device>.json: its train curve and the best
  answer accuracy it reached."""
  rows = [json.loads(l) for l in open(metrics)]
  run = common.new_run("h2h_recipe_probe", dict(
      name="h100_preset_dense", preset="h100", phases=[list(ph) for ph in h2h.phases(
          h2h.PRESETS["h100"])], batch=h2h.PRESETS["h100"]["batch"], lr=h2h.PRESETS["h100"]["lr"],
      source=f"bench.eval_head_to_head --preset=h100: {metrics}"),
      device=device, date=date, commit=commit)
  run["rows"] = [dict(step=m["step"], train_accuracy=round(m["train/accuracy"], 4),
                      train_ce=round(m["train/ce"], 4), grad_norm=round(m["train/grad_norm"], 3),
                      steps_per_s=round(m["train/steps_per_s"], 2))
                 for m in rows if "train/accuracy" in m]
  best = max(r["train_accuracy"] for r in run["rows"])
  learned = "learned" if best >= QUALIFY else "did not learn"
  run["recorded"] = dict(verdict=f"{learned}: train answer accuracy <= {best:.3f} over "
                                 f"{run['rows'][-1]['step']} steps",
                         best_train_accuracy=best)
  common.append_run(common.result_path("h2h_recipe_probe", out, device), run)
  return run


FLAGS = common.flag_values()
flags.DEFINE_enum("round", "2", sorted(ROUNDS), "the round of variants", flag_values=FLAGS)
flags.DEFINE_float("budget_s", 390.0, "each variant's training budget (compile included)",
                   flag_values=FLAGS)
flags.DEFINE_string("variant", None, "train this one variant (the probe's subprocesses)",
                    flag_values=FLAGS)
flags.DEFINE_string("record", None, "record the round's probe_*.json of this directory into "
                    "--out_dir (with --device, --commit, --date)", flag_values=FLAGS)
flags.DEFINE_string("record_dense", None, "record this head-to-head dense metrics.jsonl into "
                    "--out_dir (with --device, --commit, --date)", flag_values=FLAGS)
flags.DEFINE_string("device", None, "the device a recorded run ran on", flag_values=FLAGS)
flags.DEFINE_string("commit", None, "the tree a recorded run ran", flag_values=FLAGS)
flags.DEFINE_string("date", None, "ISO date of a recorded run", flag_values=FLAGS)


def main(argv=None):
  common.parse_flags(FLAGS, argv)
  f = FLAGS
  budget, out_dir = f.budget_s, f.out_dir
  VARIANTS.clear()
  VARIANTS.update(ROUNDS[f.round])
  if f.record or f.record_dense:
    for name in ("device", "commit", "date"):
      if not f[name].value:
        raise SystemExit(f"--{name} is required with --record / --record_dense.")
    if f.record_dense:
      return record_dense(f.record_dense, f.device, f.commit, f.date, out_dir)
    return record(f.record, f.round, f.device, f.commit, f.date, out_dir)
  if f.variant:
    return one(f.variant, budget, out_dir)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  procs = {n: subprocess.Popen([sys.executable, "-m", "bench.h2h_recipe_probe", f"--variant={n}",
                                f"--round={f.round}",
                                f"--budget_s={budget}", f"--out_dir={out_dir}"], env=env,
                               stdout=open(f"/tmp/probe_{n}.log", "w"), stderr=subprocess.STDOUT)
           for n in VARIANTS}
  for n, pr in procs.items():
    pr.wait()
    print(n, "rc", pr.returncode, flush=True)
  for n in VARIANTS:
    f = os.path.join(out_dir, f"probe_{n}.json")
    if not os.path.exists(f):
      print(n, "NO RESULT:", open(f"/tmp/probe_{n}.log").read()[-600:])
      continue
    r = json.load(open(f))
    c = r["curve"]
    print(n, r["wall_s"], "s;", " ".join(f"{s}:{a}" for s, a, _ in c[::max(1, len(c) // 12)]),
          "| last", c[-1] if c else None)
    print("   per task:", r["per_task"])


if __name__ == "__main__":
  main()
