"""Claims of bench/elastic_tasks.py's recorded CPU run (see bench/claims/__init__.py)."""
from bench.claims import claim, expect


@claim("elastic_tasks", run=("main", "cpu"), file="elastic_tasks.json")
def cpu_result_holds_the_claims(r, run):
  """The CPU preset's run (settings as the preset is now): the robust task clearly sparser
  (Omega_MSR local > retrieval + 0.15), retrieval within 2 points of dense, the dense model
  solved retrieval and SSA alone cannot."""
  import dataclasses
  import json
  from bench import elastic_tasks as bench
  want = json.loads(json.dumps(dataclasses.asdict(bench.PRESETS["cpu"])))
  expect(r["platform"] == "cpu" and r["settings"] == want)
  expect(r["omega_msr"]["local"] > r["omega_msr"]["retrieval"] + 0.15, r["omega_msr"])
  expect(r["retrieval_gap_points"] <= 2.0, r["retrieval_gap_points"])
  expect(r["dense_accuracy"]["retrieval"] > 0.9)  # the dense model solved the task
  expect(r["all_ssa_accuracy"]["retrieval"] < 0.5)  # and SSA alone cannot


@claim("elastic_tasks", run="*")
def every_task_reported(r, run):
  """Every run (the test preset's too): accuracies and Omega for every task of the mix."""
  from bench import elastic_tasks as bench
  for k in ("dense_accuracy", "elastic_accuracy", "all_ssa_accuracy", "omega_msr", "omega_esr"):
    expect(set(r[k]) == set(bench.TASKS), k)
