"""Claims of bench/decode_program.py's recorded A/B runs (decode_program_<device>.json; see
bench/claims/__init__.py): each run's recorded decision is its registered rule re-applied to the
stored rows, and docs/performance.md quotes the newest A/B's rows."""
from bench.claims import approx, claim, expect, quote

H100 = "decode_program_NVIDIA_H100_80GB_HBM3.json"
AB_RUNS = ("l2a_ab_b1", "cbupd_a", "cbupd_b", "l2a_draws_ab", "d_split_mgpu_ab")


def _rule(run):
  return dict(run["settings"]["rule"], T=tuple(run["settings"]["rule"]["T"]))


@claim("decode_program", run=AB_RUNS, file="decode_program_*NVIDIA*")
def ab_decision_is_the_registered_rule_on_the_stored_rows(rec, run):
  """An `--ab` run: every row that ran has its median of the repeats, a logits error within the
  rule's bound or recorded above it, and the recorded adoption equals ADOPTION_RULE (with the
  dense extension `settle` where the run stores its verdict that way) re-applied to the stored
  rows with the rule stored on the run (settle_pairs where the run settled candidates in
  pairs)."""
  import statistics
  from bench import decode_program as dp
  s = run["settings"]
  ok = [r for r in run["rows"] if r.get("status") == "ok"]
  expect(ok, "no row ran")
  for r in ok:
    expect(r["ms"] == approx(statistics.median(r["runs_ms"])), (r["scheme"], r["variant"]))
  rule = _rule(run)
  if "pairs" in run["adoption"]:    # settle_pairs' form (each candidate against its own default)
    got = dp.settle_pairs(run["rows"], s["scheme"], s["pairs"], rule)
    expect(got["adopt"] == run["adoption"]["adopt"] and got["passed"] == run["adoption"]["passed"]
           and got["pairs"] == run["adoption"]["pairs"], ("settle_pairs", got["passed"]))
  elif "passed" in run["adoption"]:   # settle's form (the dense extension)
    dense = s["dense_variants"]
    got = dp.settle(run["rows"], s["scheme"], s["variants"][0],
                    dense[0] if len(dense) > 1 else None, rule)
    expect(got["adopt"] == run["adoption"]["adopt"] and got["passed"] == run["adoption"]["passed"],
           ("settle", got["adopt"], got["passed"]))
  else:
    got = dp.adoption(run["rows"], s["scheme"], s["variants"][0], rule)
    expect({c: (v["adopt"], v["failed"]) for c, v in got.items()}
           == {c: (v["adopt"], v["failed"]) for c, v in run["adoption"].items()}, "adoption")


@claim("decode_program", run="d_split_mgpu_ab", file=H100)
def split_and_mgpu_fail_the_rule_at_8k(rec, run):
  """d_split_mgpu_ab ran only T = 8192 (the call's limit stopped the 128K compiles); every
  candidate fails the rule there already, so the missing half cannot change the decision: none
  adopted."""
  from bench import decode_program as dp
  s = run["settings"]
  expect({r["T"] for r in run["rows"]} == {8192})
  rule = dict(_rule(run), T=(8192,))
  got = dp.settle(run["rows"], s["scheme"], s["variants"][0], s["dense_variants"][0], rule)
  expect(got["adopt"] is None and not any(got["passed"].values()), got["passed"])


def _ab_line(rows, scheme, variant):
  r = next(x for x in rows if (x["scheme"], x["variant"]) == (scheme, variant))
  return (f"{r['ms']:.2f} ({min(r['runs_ms']):.2f}-{max(r['runs_ms']):.2f}) | {r['host_ms']:.2f} "
          f"| {r['busy_ms']:.3f} | {r['kernels']:.0f} / {r['launches']}")


@quote("docs/performance.md", H100, run="d_split_mgpu_ab")
def performance_split_mgpu_table(rec, run):
  """docs/performance.md's table of d_split_mgpu_ab: each L2A row's wall (min-max), host, busy
  and kernels / launches, and the logits errors of the decode kernel."""
  rows = run["rows"]
  lines = [_ab_line(rows, "l2a", v) for v in ("stacked", "split", "stacked:mgpu", "split:mgpu")]
  lines.append(_ab_line(rows, "dense", "stacked"))
  err = {r["scheme"]: r["rel_err"] for r in rows if r["variant"] == "stacked:mgpu"}
  return lines + [f"by {err['l2a']:.1e} / {err['dense']:.1e}".replace("e-02", "e-2")]
