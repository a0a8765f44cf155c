"""Claims of the AHA benches' recorded runs: bench/aha_sparse_vs_exact.py (one GPU) and
bench/aha_window_sweep.py (CPU presets 'cpu' and 'cpu_hint'); see bench/claims/__init__.py."""
from bench.claims import approx, claim, expect


@claim("aha_sparse_vs_exact", file="*NVIDIA*")
def gpu_run_sparse_is_cheaper_than_exact(doc, run):
  """bench/results/aha_sparse_vs_exact_<GPU>.json (the issue's evidence, T = 32K): at every
  usage the sparse step is measurably cheaper than the exact one (same run), the calibrated usage
  was hit, and exact / sparse computed the same first-step CE."""
  expect(doc["platform"] == "gpu" and doc["settings"]["T"] >= 32768, "a GPU run at T >= 32K")
  expect(doc["jax_version"] and doc["date"] and doc["device"])
  rows = {r["name"]: r for r in doc["rows"]}
  for p in doc["settings"]["usages"]:
    ex, sp = rows[f"exact_u{p}"], rows[f"sparse_u{p}"]
    expect(abs(sp["mu_f"] - p) < 0.02 * max(1.0, p / 0.05), (p, sp["mu_f"]))
    expect(sp["ce_first"] == approx(ex["ce_first"], abs=1e-2))
    expect(sp["speedup_vs_exact"] == approx(ex["train_ms"] / sp["train_ms"]))
    expect(sp["speedup_vs_exact"] > 1.05, (p, sp["speedup_vs_exact"]))
  low = min(doc["settings"]["usages"])
  expect(rows[f"sparse_u{low}"]["speedup_vs_exact"] > 1.3)  # rarely-full heads: a real saving


@claim("aha_window_sweep", run=("main", "cpu"), file="aha_window_sweep.json")
def sweep(doc, run):
  """bench/results/aha_window_sweep.json (CPU preset, fused recall at T=256): at every window the
  AHA model stays within 2 points of the dense model's accuracy while running full attention for
  a small fraction of (token, head) pairs, and at the query tokens (where the long-range need is)
  the full-attention usage falls as the window grows. Overall mu_f is NOT monotone here (it is
  dominated by a small off-query baseline): recorded as is, see the issue's closing note."""
  expect(doc["date"] and doc["jax_version"] and doc["task"]["distance"].startswith("log-uniform"))
  ws = sorted(int(w) for w in doc["per_window"])
  expect(ws == [16, 32, 64, 128], ws)
  dense = doc["dense_accuracy"]
  expect(dense >= 0.98)
  at_q = []
  for w in ws:
    r = doc["per_window"][str(w)]
    expect(r["accuracy"] >= dense - 0.02, (w, r["accuracy"], dense))
    expect(r["mu_f"] < 0.05, (w, r["mu_f"]))
    # the window alone loses the facts beyond it: routing buys the accuracy
    expect(r["local_only_accuracy_at_conversion"] <= r["accuracy"] - 0.1, w)
    at_q.append(r["usage_at_queries"])
  expect(all(a > b for a, b in zip(at_q, at_q[1:])), at_q)


@claim("aha_window_sweep", run=("main", "cpu_hint"), file="aha_window_sweep_hint.json")
def sweep_with_observable_distance(doc, run):
  """bench/results/aha_window_sweep_hint.json ('cpu_hint': the query token carries its distance
  bucket, so the router can see the need): full-attention usage falls as the window grows, at
  every window within 2 points of the dense model's accuracy (the paper's long-tail finding)."""
  expect(doc["settings"]["distance_hint"] is True and doc["preset"] == "cpu_hint")
  ws = sorted(int(w) for w in doc["per_window"])
  expect(ws == [16, 32, 64, 128], ws)
  dense = doc["dense_accuracy"]
  expect(dense >= 0.98)
  mu = [doc["per_window"][str(w)]["mu_f"] for w in ws]
  for w in ws:
    r = doc["per_window"][str(w)]
    expect(r["accuracy"] >= dense - 0.02, (w, r["accuracy"], dense))
    expect(r["local_only_accuracy_at_conversion"] <= r["accuracy"] - 0.1, w)
  expect(all(a > b for a, b in zip(mu, mu[1:])), mu)
  expect(mu[-1] < 0.5 * mu[0], mu)  # a long tail: 8x the window, under half the usage
