"""Claims of bench/decode_mlp.py's recorded GPU runs (decode_mlp_<device>.json; see
bench/claims/__init__.py): every kernel variant's output within the bench's bf16 tolerance of the
reference, the speedups and bandwidths follow from the stored times, and the recorded adoption is
ADOPTION_RULE re-applied to the stored rows."""
from bench.claims import approx, claim, expect

RUNS = ("mlp_ab",)


@claim("decode_mlp", run=RUNS, file="decode_mlp_*NVIDIA*")
def every_kernel_variant_within_bf16_tolerance(rec, run):
  """Every fused / sweep row's max |out - ref| / max |ref| is at most the tolerance stored on the
  run (the bench's TOL)."""
  tol = run["settings"]["tol"]
  for r in run["rows"]:
    if r["variant"] not in ("xla", "xla_ref"):
      expect(r["max_rel_err"] <= tol and r["within_tol"], (r["shapes"], r["M"], r["variant"]))


@claim("decode_mlp", run=RUNS, file="decode_mlp_*NVIDIA*")
def adoption_is_the_registered_rule_on_the_stored_rows(rec, run):
  """us = the median of the stored rounds, speedup = xla's us / the row's, TB/s = bytes / us, and
  the recorded adoption equals decode_mlp.adoption (ADOPTION_RULE) on the stored rows with the
  rule stored on the run."""
  import statistics
  from bench import decode_mlp as dm
  rows = run["rows"]
  for r in rows:
    expect(r["us"] == approx(statistics.median(r["runs_us"])), (r["shapes"], r["M"], r["variant"]))
    xla = next(x for x in rows if (x["shapes"], x["M"], x["variant"]) == (r["shapes"], r["M"], "xla"))
    expect(r["speedup"] == approx(xla["us"] / r["us"]))
    expect(r["tbps"] == approx(r["bytes"] / r["us"] / 1e6))
  rule = dict(run["settings"]["rule_fields"], M=tuple(run["settings"]["rule_fields"]["M"]))
  got = dm.adoption(rows, rule)
  want = run["adoption"]
  expect(got["adopt"] == want["adopt"] and got["failed"] == want["failed"], (got, want))
  expect(sorted(str(k) for k in got["speedup"]) == sorted(want["speedup"]))
  for k, v in got["speedup"].items():
    expect(v == approx(want["speedup"][str(k)]), k)
