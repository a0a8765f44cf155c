"""Claims of bench/match_mqar.py's and bench/match_memory.py's recorded runs (see
bench/claims/__init__.py)."""
from bench.claims import claim, expect, quote


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
