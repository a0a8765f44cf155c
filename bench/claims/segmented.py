"""Claims of bench/segmented_fidelity.py's (CPU) and bench/segmented_memory.py's (one GPU)
recorded runs; see bench/claims/__init__.py."""
from bench.claims import claim, expect, quote


@claim("segmented_fidelity", run=("main", "cpu"), file="segmented_fidelity.json")
def fidelity_claims_follow_from_the_numbers(r, run):
  """The CPU run: settings as the preset is now, finite perplexities, its claims and findings
  recomputed from its perplexities (segmented_fidelity.claims_of) all hold; aligned flat,
  misaligned above it beyond one segment."""
  import math
  from bench import segmented_fidelity as fid
  expect(r["preset"] == "cpu" and r["date"][:4] >= "2026" and r["platform"] == "cpu")
  expect(r["settings"]["segmented"] == {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in fid.SEG.items()})
  expect(r["settings"]["eval_lens"] == list(fid.PRESETS["cpu"]["eval_lens"]))
  ppl = {k: {int(L): v for L, v in d.items()} for k, d in r["perplexity"].items()}
  a, m = ppl["aligned_segmented"], ppl["misaligned_segmented"]
  expect(all(math.isfinite(x) and x > 1 for d in ppl.values() for x in d.values()))
  claims, findings = fid.claims_of(ppl, fid.PRESETS["cpu"])
  expect(claims == r["claims"] and findings == r["findings"])
  expect(all(claims.values()), claims)
  # the recorded numbers themselves: aligned flat, misaligned above it beyond one segment
  expect(max(a.values()) / min(a.values()) < 1.5)
  expect(all(m[L] > a[L] for L in a if L > fid.SEG["segment_len"]))


@claim("segmented_memory", run=("main", "gpu"), file="segmented_memory.json")
def gpu_memory_and_latency_meet_the_targets(r, run):
  """bench/results/segmented_memory.json (one GPU, LLaMA-2-7B shape, S/M/R = 4096/512/512): at
  64K the segmented prefill's peak (minus weights) is <= 1/4 of dense's, even of an ideal dense
  engine holding nothing but its KV cache, and it is no slower; the ratios follow from the rows."""
  from bench import segmented_memory as mem
  expect(r["preset"] == "gpu" and r["device"].startswith("NVIDIA") and r["jax_version"])
  rows = {(x["row"], x["T"]): x for x in r["rows"]}
  expect(all("error" not in x and x["logits_finite"] for x in rows.values()))
  expect({T for _, T in rows} == {16384, 32768, 65536})
  expect(mem.summarise(mem.PRESETS["gpu"], r["rows"]) == (r["summary"], r["targets"]))
  expect(r["targets"] == dict(at_length=65536, memory_quarter_at_max_len=True,
                              latency_no_worse_at_max_len=True))
  seg, dense = rows["segmented", 65536], rows["dense", 65536]
  expect(seg["peak_minus_weights"] <= 0.25 * dense["cache_bytes"])
  expect(seg["prefill_s"] <= rows["dense_chunked", 65536]["prefill_s"])
  # segmented memory grows only with the pool (long heads of long layers), dense with T
  expect(rows["segmented", 65536]["peak_minus_weights"]
          < 1.5 * rows["segmented", 16384]["peak_minus_weights"])


@quote("README.md", "segmented_memory.json", run=("main", "gpu"))
def readme_segmented_memory(rec, run):
  """README's memory section: peak over the weights and prefill latency, segmented vs dense
  one-shot prefill, at 16K / 32K / 64K."""
  rows = {(x["row"], x["T"]): x for x in rec["rows"]}
  Ts = (16384, 32768, 65536)
  gib = lambda row: " / ".join(f"{rows[row, T]['peak_minus_weights'] / 2**30:.1f}" for T in Ts)
  sec = lambda row: " / ".join(f"{rows[row, T]['prefill_s']:.2f}" for T in Ts)
  return [f"{gib('segmented')} GiB vs {gib('dense')} GiB",
          f"Prefill latency: {sec('segmented')} s vs {sec('dense')} s"]


@claim("segmented_fidelity", run="*")
def claims_and_findings_follow_from_the_perplexities(r, run):
  """Every run (the test preset's too): the claims and findings it recorded are what
  segmented_fidelity.claims_of gives for its perplexities and preset."""
  from bench import segmented_fidelity as fid
  ppl = {k: {int(L): v for L, v in d.items()} for k, d in r["perplexity"].items()}
  claims, findings = fid.claims_of(ppl, fid.PRESETS[r["preset"]])
  expect(claims == r["claims"], ("claims", claims, r["claims"]))
  expect(findings == r["findings"], ("findings", findings, r["findings"]))
