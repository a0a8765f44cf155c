"""Claims of bench/h2h_recipe_probe.py's runs (bench/results/h2h_recipe_probe_<device>.json): the
head-to-head's dense pretraining recipe search (issue 28). Each round's verdict is a function of
its rows (held-out NIAH accuracy, or train accuracy for round 1, against QUALIFY); the h100
preset's first dense pretraining (lr 1e-3, one sample a row), stopped at step 8001, stayed at
chance; round 2 is quoted row by row in the README."""
from bench.claims import claim, expect, quote

README = "README.md"
FILE = "h2h_recipe_probe_NVIDIA_H200.json"


@claim("h2h_recipe_probe", run=("round1", "round2"))
def verdict_follows_from_the_rows(rec, run):
  from bench import h2h_recipe_probe as probe
  for r in run["rows"]:
    score = r["niah_heldout"] if r["niah_heldout"] is not None else r["train_accuracy"]
    expect(r["qualifies"] == (score >= probe.QUALIFY), (r["variant"], score, r["qualifies"]))
  expect(probe.verdict(run["rows"]) == {k: rec[k] for k in ("qualified", "verdict")},
         ("verdict", rec["verdict"]))


@claim("h2h_recipe_probe", run="h100_preset_dense")
def h100_preset_dense_stayed_at_chance(rec, run):
  best = max(r["train_accuracy"] for r in run["rows"])
  expect(best == rec["best_train_accuracy"] and best < 0.05, ("best train accuracy", best))


@quote(README, FILE, run="h100_preset_dense")
def quote_dense(rec, run):
  last = run["rows"][-1]
  return [f"step {last['step']}: train answer accuracy {last['train_accuracy']:.3f}"]


@quote(README, FILE, run="round1")
def quote_round1(rec, run):
  acc = {r["variant"]: r["train_accuracy"] for r in run["rows"]}
  return [f"niah128_b64 {acc['niah128_b64']:.2f}", f"niah128 {acc['niah128']:.3f}",
          rec["verdict"]]


@quote(README, FILE, run="round2")
def quote_round2(rec, run):
  """Each variant's README row: held-out NIAH at its samples' length and at twice it."""
  from bench import h2h_recipe_probe as probe
  out = [rec["verdict"]]
  for r in run["rows"]:
    n = r["seq_len"] // r.get("pack", 1)
    twice = [r["per_task"][f"{t}@{2 * n}"] for t in probe.NIAH]
    out.append(f"| {r['niah_heldout']:.2f} | {sum(twice) / len(twice):.2f} |")
  return out
