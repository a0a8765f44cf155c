"""Claims of bench/aha_repro.py's runs and bench/elastic_repro.py's (see bench/claims/__init__.py).

The benches' pre-registered criteria may fail: their verdicts live in the run's
`recorded["criteria"]`, not in its claims. What is claimed (and must hold) is that the record is
honest: the criteria are the bench's CRITERIA as registered (unchanged since), the summary
metrics follow from the per-seed numbers, and every verdict follows from the metrics."""
from bench.claims import approx, claim, expect, quote


def _settings(bench, rec):
  """The run's Settings (lists back to tuples)."""
  d = {k: tuple(v) if isinstance(v, list) else v for k, v in rec["settings"].items()
       if k in bench.Settings.__dataclass_fields__}
  return bench.Settings(**d)


def honest_record(bench, rec):
  from bench import aha_elastic_repro_common as rc
  s = _settings(bench, rec)
  # the criteria the run's settings register (a bench without `criteria(s)`: its CRITERIA)
  crits = bench.criteria(s) if hasattr(bench, "criteria") else bench.CRITERIA
  want = {k: [c.metric, c.op, c.value] for k, c in crits.items()}
  got = {k: [c["metric"], c["op"], c["value"]] for k, c in rec["criteria"].items()}
  expect(got == want, f"criteria differ from the registered CRITERIA: {got} vs {want}")
  again = bench.summarize(s, rec["seeds"])
  for k, v in again["metrics"].items():
    old = rec["metrics"].get(k)
    expect((v is None and old is None) or (v is not None and old is not None
                                             and old == approx(v, rel=1e-9, abs=1e-12)),
           f"metric {k}: recorded {old}, re-derived {v}")
  expect(set(again["metrics"]) == set(rec["metrics"]), "metric names differ")
  for k, c in rc.judge(crits, rec["metrics"]).items():
    expect(c["passed"] == rec["criteria"][k]["passed"], f"criterion {k}: verdict flipped")


def quotes(rec):
  """One line per criterion: `name`: PASS|FAIL (metric = value)."""
  out = []
  for k, c in rec["criteria"].items():
    got = c["got"]
    val = "n/a" if got is None else f"{got:.3g}"
    out.append(f"`{k}`: {'PASS' if c['passed'] else 'FAIL'} ({c['metric']} = {val})")
  return out


@claim("aha_repro", run="*")
def aha_repro_record_is_honest(rec, run):
  """Every run: criteria as registered, metrics re-derived from the seeds, verdicts from them."""
  from bench import aha_repro as bench
  honest_record(bench, rec)


@claim("aha_repro", run="cpu", file="aha_repro.json")
def aha_repro_cpu_run_is_the_preset(rec, run):
  """The recorded CPU run: the preset's settings, >= 3 seeds, >= 2 windows, a lambda sweep of
  >= 3 values (on the first `sweep_seeds` seeds), a curve per arm."""
  import dataclasses
  import json
  from bench import aha_repro as bench
  want = json.loads(json.dumps(dataclasses.asdict(bench.PRESETS["cpu"])))
  default = json.loads(json.dumps(dataclasses.asdict(bench.Settings())))
  # a field added after the run (e.g. fact_tokens) must be at its default in the preset
  expect(all(want[k] == default[k] for k in set(want) - set(rec["settings"])))
  expect({k: want[k] for k in rec["settings"]} == rec["settings"] and rec["platform"] == "cpu")
  expect(len(rec["seeds"]) >= 3 and len(rec["settings"]["windows"]) >= 2)
  w0 = str(min(rec["settings"]["windows"]))
  sweep = rec["seeds"][:rec["settings"]["sweep_seeds"]]
  expect(sweep and all(len(r[w0]["lams"]) >= 3 for r in sweep))
  expect(all(lr["curves"]["accuracy"] for r in rec["seeds"] for wr in r.values()
             for lr in wr["lams"].values()))


@quote("docs/schemes/aha.md", "aha_repro.json", run="cpu")
def aha_doc_repro(rec, run):
  return quotes(rec)


@claim("elastic_repro", run="*")
def elastic_repro_record_is_honest(rec, run):
  """Every run: criteria as registered, metrics re-derived from the seeds, verdicts from them."""
  from bench import elastic_repro as bench
  honest_record(bench, rec)


@claim("elastic_repro", run="cpu", file="elastic_repro.json")
def elastic_repro_cpu_run_is_the_preset(rec, run):
  """The recorded CPU run: the preset's settings, >= 3 seeds, the single arm and the static
  control on every seed, every arm on the first `ablation_seeds`, each with its curves."""
  import dataclasses
  import json
  from bench import elastic_repro as bench
  want = json.loads(json.dumps(dataclasses.asdict(bench.PRESETS["cpu"])))
  default = json.loads(json.dumps(dataclasses.asdict(bench.Settings())))
  # a field added after the run (e.g. the dense gate's) must be at its default in the preset
  expect(all(want[k] == default[k] for k in set(want) - set(rec["settings"])))
  expect({k: want[k] for k in rec["settings"]} == rec["settings"] and rec["platform"] == "cpu")
  expect(len(rec["seeds"]) >= 3)
  for r in rec["seeds"]:
    expect("single" in r["arms"] and "static" in r)
  for r in rec["seeds"][:rec["settings"]["ablation_seeds"]]:
    expect(set(r["arms"]) == set(bench.PRESETS["cpu"].arms))
    expect(all(a["curves"]["accuracy"] for a in r["arms"].values()))


@quote("docs/schemes/elastic.md", "elastic_repro.json", run="cpu")
def elastic_doc_repro(rec, run):
  return quotes(rec)


@quote("docs/schemes/aha.md", "aha_repro_NVIDIA_H200.json", run="h100")
def aha_doc_repro_gpu(rec, run):
  return quotes(rec)


@quote("docs/schemes/aha.md", "aha_repro_NVIDIA_H200.json", run="h100_pairs")
def aha_doc_repro_gpu_pairs(rec, run):
  return quotes(rec)


@quote("docs/schemes/elastic.md", "elastic_repro_NVIDIA_H200.json", run="h100")
def elastic_doc_repro_gpu(rec, run):
  return quotes(rec)


@quote("docs/schemes/aha.md", "aha_repro_NVIDIA_H200.json", run="h100_pairs_pre")
def aha_doc_repro_gpu_pairs_pre(rec, run):
  return quotes(rec)


@quote("docs/schemes/aha.md", "aha_repro_NVIDIA_H200.json", run="h100_pairs_pre_plateau")
def aha_doc_repro_gpu_pairs_pre_plateau(rec, run):
  return quotes(rec)


@claim("aha_repro_plateau_probe", run="*")
def plateau_probe_verdicts_follow_from_its_curves(rec, run):
  """The until-plateau probe's record is honest: every check's 'moved' is `plateau` re-applied to
  the stored per-step curves cut at that check's step (the definition unchanged: < 1% relative
  over the last 20%), the checks are the rule's (the recipe's end, then every check_every steps),
  at_plateau is the last check's verdict on every curve, and a run that stopped before its cap
  says why (plateau only if at_plateau; otherwise the call's limit)."""
  from bench import aha_elastic_repro_common as rc
  r = run["recorded"]
  curves = r["curves"]
  expect(all(len(v) == r["steps"] for v in curves.values()), "curves != steps taken")
  steps = [s for s, _ in r["checks"]]
  want = [r["recipe_steps"]] + list(range(r["recipe_steps"] + r["check_every"], r["steps"] + 1,
                                          r["check_every"]))
  expect(steps == want[: len(steps)] and steps[-1] == r["steps"], (steps, want))
  for s, moved in r["checks"]:
    for k, v in moved.items():
      # (the stored curves are rounded: 1e-3 relative)
      expect(v == approx(rc.plateau(curves[k][:s])["moved"], rel=1e-3), (s, k, v))
  last = {k: rc.plateau(v) for k, v in curves.items()}
  expect(r["at_plateau"] == all(p["at_plateau"] for p in last.values()), "at_plateau")
  expect({k: p["at_plateau"] for k, p in last.items()}
         == {k: p["at_plateau"] for k, p in r["plateau"].items()}, "per-curve verdicts")
  if r["stopped"] == "plateau":
    expect(r["at_plateau"], "stopped at plateau but not at plateau")
  elif r["stopped"] == "cap":
    expect(r["steps"] == r["cap"] and not r["at_plateau"], "stopped at the cap")
  else:
    expect(r["stopped"] == "call_limit" and r["steps"] < r["cap"] and not r["at_plateau"],
           r["stopped"])
