"""Claims of the recorded GPU runs of bench/decode_mlp.py (decode_mlp_<device>.json; see
bench/claims/__init__.py): every kernel variant's output within the bench's bf16 tolerance of the
reference, the speedups and bandwidths follow from the stored times, and the recorded adoption is
the registered rule re-applied to the stored rows. The bench and its kernels
(pallas_kernels/decode_mlp) were removed after the rule rejected them (run mlp_ab); they are in
the tree of commit 135bd6a."""
from bench.claims import approx, claim, expect

RUNS = ("mlp_ab",)


def adoption(rows: list[dict], rule: dict) -> dict:
  """The bench's rule on its rows: {adopt, failed: [reasons], speedup: {M: xla us / fused us}};
  adopt iff every kernel row is within tolerance and the candidate is >= min_speedup x the
  baseline at every M of the rule on its shapes."""
  failed = []
  bad = [f"{r['shapes']} M={r['M']} {r['variant']}" for r in rows
         if r["variant"] not in ("xla", "xla_ref") and not r["within_tol"]]
  if bad:
    failed.append(f"outside tolerance: {bad}")
  speed = {}
  for M in rule["M"]:
    got = {r["variant"]: r for r in rows if r["shapes"] == rule["shapes"] and r["M"] == M}
    if rule["baseline"] not in got or rule["candidate"] not in got:
      failed.append(f"{rule['shapes']} M={M}: not measured")
      continue
    speed[M] = got[rule["baseline"]]["us"] / got[rule["candidate"]]["us"]
    if speed[M] < rule["min_speedup"]:
      failed.append(f"{rule['shapes']} M={M}: {speed[M]:.3f}x < {rule['min_speedup']}x")
  return dict(adopt=not failed, failed=failed, speedup=speed)


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
  the recorded adoption equals `adoption` (the bench's ADOPTION_RULE) on the stored rows with the
  rule stored on the run."""
  import statistics
  rows = run["rows"]
  for r in rows:
    expect(r["us"] == approx(statistics.median(r["runs_us"])), (r["shapes"], r["M"], r["variant"]))
    xla = next(x for x in rows
               if (x["shapes"], x["M"], x["variant"]) == (r["shapes"], r["M"], "xla"))
    expect(r["speedup"] == approx(xla["us"] / r["us"]))
    expect(r["tbps"] == approx(r["bytes"] / r["us"] / 1e6))
  rule = dict(run["settings"]["rule_fields"], M=tuple(run["settings"]["rule_fields"]["M"]))
  got = adoption(rows, rule)
  want = run["adoption"]
  expect(got["adopt"] == want["adopt"] and got["failed"] == want["failed"], (got, want))
  expect(sorted(str(k) for k in got["speedup"]) == sorted(want["speedup"]))
  for k, v in got["speedup"].items():
    expect(v == approx(want["speedup"][str(k)]), k)
