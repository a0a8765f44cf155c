"""Claims of bench/decode_program.py's recorded A/B runs (decode_program_<device>.json; see
bench/claims/__init__.py): each run's recorded decision is its registered rule re-applied to the
stored rows, and docs/performance.md quotes the newest A/B's rows."""
from bench.claims import approx, claim, expect, quote

H100 = "decode_program_NVIDIA_H100_80GB_HBM3.json"
AB_RUNS = ("l2a_ab_b1", "cbupd_a", "cbupd_b", "l2a_draws_ab", "d_split_mgpu_ab",
           "d_oproj_minsplit_ab", "aha10_ab", "aha10_ab2", "aha10_adopt",
           "aha10_windowparts", "aha11_windowparts_8k", "greedy_split_ab", "exhaustive_ab",
           "pdl_ab")


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


@claim("decode_program", run="d_oproj_minsplit_ab", file=H100)
def oproj_and_minsplit_fail_the_rule_at_8k(rec, run):
  """d_oproj_minsplit_ab ran only T = 8192 (the call's limit stopped the 128K compiles); each
  candidate fails its pair of the rule there already (the batched o_proj on wall, the unsplit
  ring on logits rel_err), so the missing half cannot change the decision: none adopted."""
  from bench import decode_program as dp
  s = run["settings"]
  expect({r["T"] for r in run["rows"]} == {8192})
  got = dp.settle_pairs(run["rows"], s["scheme"], s["pairs"], dict(_rule(run), T=(8192,)))
  expect(got["adopt"] == [] and not any(got["passed"].values()), got["passed"])
  expect(any("wall" in f for f in got["scheme"]["stacked"]["failed"]), got["scheme"]["stacked"])
  expect(any("rel_err" in f for f in got["scheme"]["stacked:minsplit"]["failed"]),
         got["scheme"]["stacked:minsplit"])


@claim("decode_program", run="d_oproj_minsplit_ab", file=H100)
def batched_oproj_removes_the_slice_copy_exactly(rec, run):
  """The batched o_proj contraction's compiled H100 programs copy no weights (copy_bytes under
  1 KB) where the previous contraction's copy one o_proj slice per attention block a step
  (Qwen2.5-1.5B: 12 * 128 * 1536 bf16 = 4.72 MB; 28 blocks dense, 56 L2A), with bit-identical
  first-step logits and lower busy time."""
  rows = {(r["scheme"], r["variant"]): r for r in run["rows"]}
  kernel = 12 * 128 * 1536 * 2
  for sch, blocks in (("dense", 28), ("l2a", 56)):
    old, new = rows[(sch, "stacked:oldoproj")], rows[(sch, "stacked")]
    expect(new["copy_bytes"] < 1024 and old["copy_bytes"] - new["copy_bytes"]
           == approx(blocks * kernel, rel=1e-3), (sch, old["copy_bytes"], new["copy_bytes"]))
    expect(new["rel_err"] == 0.0 and new["busy_ms"] < old["busy_ms"], sch)


@quote("docs/performance.md", H100, run="d_oproj_minsplit_ab")
def performance_oproj_minsplit_table(rec, run):
  """docs/performance.md's table of d_oproj_minsplit_ab: each row's wall (min-max), host, busy
  and kernels / launches, and the unsplit ring's logits error."""
  rows = run["rows"]
  lines = [_ab_line(rows, "l2a", v) for v in ("stacked:oldoproj", "stacked", "stacked:minsplit")]
  lines += [_ab_line(rows, "dense", v) for v in ("stacked:oldoproj", "stacked")]
  err = next(r["rel_err"] for r in rows if r["variant"] == "stacked:minsplit")
  return lines + [f"rel_err {err:.1e}".replace("e-02", "e-2")]


@claim("decode_program", run=("d_fp32_check", "d_fp32_check_l2a"), file=H100)
def fp32_check_verdicts_follow_from_the_checks(rec, run):
  """An fp32_check run: each program ran the kernel it names (custom calls: the default cuDNN's
  decode, 'mgpu' the Mosaic GPU decode kernel and no cuDNN, 'refattn' and the float32
  reference neither), each rel_err is the stored one, and the recorded rule_check verdict and
  'mgpu' logits tests are rule_check / fp32_logits_test re-applied to the stored checks with the
  rules stored on the run."""
  from bench import decode_program as dp
  ok = [c for c in run["rows"] if c.get("status") == "ok"]
  expect(ok, "no check ran")
  for c in ok:
    calls = c["custom_calls"]
    expect(set(calls["default"]) == {"__cudnn$fmhaSoftmax"}, ("default", calls["default"]))
    expect(set(calls.get("mgpu", {"mosaic_gpu_v2": 1})) == {"mosaic_gpu_v2"}, calls.get("mgpu"))
    expect(not calls.get("refattn") and not calls["float32"], calls)
    expect(c["default"]["vs_default"]["rel_err"] == 0.0, c["scheme"])
  s = run["settings"]
  rule = dict(s["rule"], T=tuple(s["rule"]["T"]))
  expect(dp.rule_check(run["rows"], rule) == run["rule_check"], "rule_check")
  mg = [dict(scheme=c["scheme"], T=c["T"], **dp.fp32_logits_test(c, "mgpu", s["fp32_rule"]))
        for c in ok if "mgpu" in c]
  expect(mg == run["mgpu_fp32_logits_test"], "mgpu_fp32_logits_test")


@claim("decode_program", run=("d_fp32_check", "d_fp32_check_l2a"), file=H100)
def the_logits_bound_rejects_a_correct_bf16_program(rec, run):
  """ADOPTION_RULE's logits bound (max_rel_err of a candidate's first-step logits against the
  default's) fails for a correct bfloat16 program: the XLA reference attention in bf16 differs
  from the default (cuDNN) by more than the bound at a measured point, while both are about as
  far from the float32 reference (each within 2x of the other's error)."""
  rc = run["rule_check"]
  expect(rc["sane"] is False and rc["failed"], rc)
  for p in rc["failed"]:
    expect(p["default_vs_refattn"] > rc["bound"], p)
    expect(max(p["default_vs_fp32"], p["refattn_vs_fp32"])
           <= 2 * min(p["default_vs_fp32"], p["refattn_vs_fp32"]), p)


@quote("docs/performance.md", H100, run="d_fp32_check")
def performance_fp32_check_table(rec, run):
  """docs/performance.md's fp32 check table: per program its logits rel_err against float32 and
  against the default, and the argmax agreement."""
  out = []
  for c in run["rows"]:
    if c.get("status") != "ok":
      continue
    for n in ("default", "refattn", "mgpu"):
      if n in c:
        r = c[n]
        out.append(f"| {c['scheme']} | {c['T'] // 1024}K | {n} | {r['rel_err']:.1e} | "
                   f"{r['vs_default']['rel_err']:.1e} | {r['same_argmax']} |")
  return out


# the L2A point of the same check, its own call (lead, 0cff01a): its rows in the same table
quote("docs/performance.md", H100, run="d_fp32_check_l2a",
      name="performance_fp32_check_table_l2a")(performance_fp32_check_table)
