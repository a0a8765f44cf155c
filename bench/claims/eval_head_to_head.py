"""Claims of bench/eval_head_to_head.py's runs (bench/results/eval_head_to_head_<device>.json):
the GPU head-to-head (issue 28). The verdict (CRITERIA['dense_solves_niah'], pre-registered) and
the comparison with dense are functions of the recorded rows; `h100_partial` holds the models a
stopped run had evaluated (the dense arm), `h100` the finished run."""
from bench.claims import approx, claim, expect, quote

README = "README.md"
FILE = "eval_head_to_head_NVIDIA_H200.json"


@claim("eval_head_to_head", run=("h100_partial", "h100"))
def verdict_follows_from_the_rows(rec, run):
  from bench import eval_head_to_head as h2h
  v = h2h.verdict_from_rows(run["rows"], rec["training_length"])
  expect(v["judged"] == rec["judged"] == rec["verdict"]["judged"], ("judged", v["judged"]))
  expect(v["value"] == approx(rec["verdict"]["value"]), ("value", v["value"]))
  expect(h2h.versus_dense(run["rows"]) == rec["versus_dense"], "versus_dense differs")


@quote(README, FILE, run="h100_partial")
def quote_dense_arm(rec, run):
  v = rec["verdict"]
  acc = {(r["task"], r["length"]): r["accuracy"] for r in run["rows"]
         if r["kind"] == "accuracy" and r["model"] == "dense"}
  eff = {r["length"]: r for r in run["rows"] if r["kind"] == "efficiency" and r["model"] == "dense"}
  L = v["length"]
  means = rec["mean_accuracy"]["dense"]
  return [f"mean accuracy **{v['value']:.3f}**",
          ", ".join(f"{t} {acc[(t, L)]:.2f}" for t in ("vt", "passkey", "fwe", "cwe")),
          f"json_kv {acc[('json_kv', L)]:.2f}, mqar {acc[('mqar', L)]:.2f}",
          " ".join(f"{means[str(n)]:.2f} at {n}," for n in (4096, 8192))
          + f" {means['16384']:.2f} at 16384",
          f"TTFT {1e3 * eff[L]['ttft_s']:.0f} ms, decode {eff[L]['decode_tok_s']:.0f} tokens/s"]
