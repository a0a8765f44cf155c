"""Claims of bench/match_mqar.py's and bench/match_memory.py's recorded runs (see
bench/claims/__init__.py)."""
from bench.claims import approx, claim, expect, quote


@claim("match_mqar", run=("main", "cpu"), file="match_mqar.json")
def mqar_result_holds_the_claims(r, run):
  """The first (superseded) single-lr MQAR run: window 32, lengths 64..512, every method's
  accuracy at every length in [0, 1], MATCH >= 0.9 at 512 while SWA and sink+window <= 0.3
  there. Its baselines never learned the task (issue 29); the pre-registered sweep
  (`sweep_cpu`) replaces it as the evidence."""
  expect(r["preset"] == "cpu" and r["date"] and r["settings"]["window"] == 32)
  lengths = [str(n) for n in r["settings"]["lengths"]]
  expect(lengths == ["64", "128", "256", "512"])
  for m in ("swa", "sink", "match"):
    expect(sorted(r["methods"][m], key=int) == lengths)
    expect(all(0.0 <= r["methods"][m][n] <= 1.0 for n in lengths))
  n = lengths[-1]
  m = r["methods"]  # the old bench's check: MATCH >= 0.9 at 512, SWA and sink <= 0.3 there
  expect(m["match"][n] >= 0.9 and m["swa"][n] <= 0.3 and m["sink"][n] <= 0.3)
  expect(r["failed_claims"] == [])


@claim("match_mqar", run=("sweep_cpu", "sweep_h100"), file="match_mqar*.json")
def mqar_sweep_records_its_preregistered_verdict(r, run):
  """A pre-registered MQAR sweep (bench/match_mqar.py CRITERIA): its summary (best lr by the
  seed mean, per semantics) re-derives from the recorded final accuracies and curves, every
  method and length is present (MATCH and random under both semantics), and the recorded
  criteria and verdict are CRITERIA evaluated on those numbers. Pass or fail of the criteria is
  data (the README reports it); this claim is that the record is complete and consistent."""
  import dataclasses
  from bench import match_mqar
  expect(run["device"] == r["device"], "the run's device is not the units' device")
  s = match_mqar.Settings(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in r["settings"].items()
                             if k in {f.name for f in dataclasses.fields(match_mqar.Settings)}})
  lengths = [str(n) for n in s.lengths]
  expect(sorted(r["finals"]) == sorted(match_mqar.METHODS))
  for m, by in r["finals"].items():
    M = len(match_mqar.method_lrs(s, m)) * len(s.seeds)
    expect(sorted(by, key=int) == lengths, f"{m}: lengths {sorted(by)}")
    for n, fin in by.items():
      want = {"sequence", "recompute"} if m in match_mqar.RETRIEVES else {"sequence"}
      expect(set(fin) == want and all(len(a) == M and all(0 <= x <= 1 for x in a)
                                      for a in fin.values()), f"{m}/{n}: finals")
  per = {m: {int(n): {"final": r["finals"][m][n], "curves": r["curves"][m][n]} for n in by}
         for m, by in r["finals"].items()}
  expect(match_mqar.summarize(s, per) == r["summary"], "summary does not re-derive")
  crit = match_mqar.check_criteria(r["summary"], names=r["criteria_text"])
  expect(crit == r["criteria"] and match_mqar.verdict(crit) == r["verdict"],
         "criteria / verdict do not re-derive")
  # the criteria the run registered, unchanged since (criteria added later are not applied)
  expect(all(match_mqar.CRITERIA.get(k) == v for k, v in r["criteria_text"].items()),
         "CRITERIA changed after the run")


@claim("match_memory", run=("main", "gpu"), file="match_memory.json")
def gpu_memory_is_flat_for_match_and_grows_for_dense(r, run):
  """bench/results/match_memory.json (H200, one process per row, merged): MATCH's K/V and
  device peak stay flat from 8K to 128K while dense's grow with the context."""
  from bench import match_memory
  expect(r["device"].startswith("NVIDIA") and r["jax_version"] and r["date"][:4] >= "2026")
  rows = {(x["model"], x["context"]): x for x in r["rows"]}
  expect(sorted(rows) == [(m, n) for m in ("dense", "match") for n in (8192, 32768, 131072)])
  expect(match_memory.check_flat(r) == [] == r["failed_claims"])
  m = [rows["match", n] for n in (8192, 32768, 131072)]
  d = [rows["dense", n] for n in (8192, 32768, 131072)]
  expect(len({x["kv_bytes"] for x in m}) == 1)
  expect(d[2]["kv_bytes"] >= 15 * d[0]["kv_bytes"] and d[2]["kv_bytes"] > 50 * m[2]["kv_bytes"])
  expect(max(x["peak_bytes"] for x in m) <= 1.05 * min(x["peak_bytes"] for x in m))
  expect(d[2]["peak_bytes"] > d[0]["peak_bytes"] + 2 * 2**30)


@quote("README.md", "match_memory.json", run=("main", "gpu"))
def readme_match_memory(rec, run):
  """README's memory section: MATCH's decode K/V (flat) and device peak vs dense's."""
  rows = {(x["model"], x["context"]): x for x in rec["rows"]}
  m = [rows["match", n] for n in (8192, 32768, 131072)]
  d = [rows["dense", n] for n in (8192, 131072)]
  peaks = [x["peak_bytes"] / 1e9 for x in m]
  return [f"Decode K/V is {m[0]['kv_bytes'] / 1e6:.1f} MB at 8K, 32K and 128K (dense: "
          f"{d[0]['kv_bytes'] / 1e6:.0f} MB -> {d[1]['kv_bytes'] / 1e9:.2f} GB)",
          f"the device peak stays at {min(peaks):.1f}-{max(peaks):.1f} GB (dense: "
          f"{d[0]['peak_bytes'] / 1e9:.1f} -> {d[1]['peak_bytes'] / 1e9:.1f} GB)"]


@quote("README.md", "match_mqar.json", run="sweep_cpu")
def readme_match_mqar(rec, run):
  """README's MATCH reproduction paragraph: the CPU sweep's best-lr accuracies at 64 and its
  verdict under the pre-registered criteria."""
  s = rec["summary"]
  g = lambda m, sem="sequence": f"{s[m]['64'][sem]:.2f}"
  return [f"full attention {g('full')}, SWA {g('swa')}, MATCH {g('match')} (training mask) / "
          f"{g('match', 'recompute')} (decode semantics), random retrieval {g('random')}",
          f"verdict: {rec['verdict']}"]


@claim("match_ttft", run=("gpu",), file="match_ttft_*.json")
def ttft_run_records_its_verdict(r, run):
  """A GPU time-to-first-token run (bench/match_ttft.py): one SWA and one MATCH row at the
  preset's context, both finite, each TTFT the median of its repetitions, and the recorded
  ratio / pass re-derive from the rows (match_ttft.verdict against the CRITERION registered in
  the bench). Pass or fail of the criterion is data (docs/schemes/match.md reports it); this
  claim is that the record is complete and consistent."""
  import statistics
  from bench import match_ttft
  expect(r["device"].startswith("NVIDIA") and r["jax_version"] and run["git_commit"])
  rows = {x["model"]: x for x in r["rows"]}
  expect(sorted(rows) == ["match", "swa"])
  for x in rows.values():
    expect(x["context"] == r["settings"]["context"] and x["logits_finite"])
    expect(len(x["ttft_reps_s"]) == r["settings"]["reps"])
    expect(x["ttft_s"] == approx(statistics.median(x["ttft_reps_s"]), rel=0.02))
  expect(match_ttft.verdict(r["rows"]) == {"match_over_swa": r["match_over_swa"],
                                           "passed": r["passed"]})


@quote("docs/schemes/match.md", "match_ttft_NVIDIA_H100_80GB_HBM3.json", run="gpu")
def match_md_ttft(rec, run):
  """docs/schemes/match.md's TTFT result: both medians and the ratio with its verdict."""
  g = {x["model"]: x for x in rec["rows"]}
  return [f"SWA {g['swa']['ttft_s'] * 1e3:.1f} ms, MATCH {g['match']['ttft_s'] * 1e3:.1f} ms: "
          f"{rec['match_over_swa']:.2f}x ({'PASS' if rec['passed'] else 'FAIL'})"]


@quote("docs/schemes/match.md", "match_mqar_NVIDIA_H200.json", run="sweep_h100")
def match_md_mqar_h100(rec, run):
  """docs/schemes/match.md's H100-preset sweep: best-lr seed means per length and the verdict."""
  s = rec["summary"]
  row = lambda m, sem="sequence": " / ".join(f"{s[m][n][sem]:.3f}" for n in ("64", "128", "256",
                                                                            "512"))
  return [f"| full attention | {row('full')} |", f"| SWA (window 32) | {row('swa')} |",
          f"| MATCH, training mask | {row('match')} |",
          f"| MATCH, decode semantics | {row('match', 'recompute')} |",
          f"| random retrieval (control) | {row('random')} |", f"verdict: {rec['verdict']}"]


@quote("docs/schemes/match.md", "match_mqar_NVIDIA_H100_80GB_HBM3_NVIDIA_H200.json",
       run="sweep_h100")
def match_md_mqar_h100_complete(rec, run):
  """docs/schemes/match.md's complete H100-preset sweep (168 models at 12,800 steps, units from
  H100s and H200s): best-lr seed means per length, the best lrs and the verdict."""
  s = rec["summary"]
  row = lambda m, sem="sequence": " / ".join(f"{s[m][n][sem]:.3f}" for n in ("64", "128", "256",
                                                                            "512"))
  lrs = lambda m: " / ".join(f"{s[m][n]['best_lr']:g}" for n in ("64", "128", "256", "512"))
  return [f"| full attention | {row('full')} | {lrs('full')} |",
          f"| SWA (window 32) | {row('swa')} | {lrs('swa')} |",
          f"| MATCH, training mask | {row('match')} | {lrs('match')} |",
          f"| MATCH, decode semantics | {row('match', 'recompute')} | {lrs('match')} |",
          f"| random retrieval (control) | {row('random')} | {lrs('random')} |",
          f"verdict (registered criteria): {rec['verdict']}"]
