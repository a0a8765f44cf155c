"""Claims of bench/eval_head_to_head.py's runs (bench/results/eval_head_to_head_<device>.json):
the GPU head-to-head (issue 28). The verdict (CRITERIA['dense_solves_niah'], pre-registered) and
the comparison with dense are functions of the recorded rows; `h100_partial` holds the models a
stopped run had evaluated (the dense arm), `h100` the finished run (its whole report, per-sample
records and routing statistics, in eval_head_to_head_<device>_report.json.gz beside it)."""
import gzip
import json
import os

import numpy as np

from bench.claims import approx, claim, expect, quote

README = "README.md"
FILE = "eval_head_to_head_NVIDIA_H200.json"
LENGTHS = (4096, 8192, 16384)
# the routing statistic of each scheme that says how much of it runs the full / global path
# (headtohead.markdown's: mean over layers and heads, prompt tokens)
ROUTING = {"l2a": ("global_tokens_B", "of tokens global"),
           "aha": ("full_BN", "of (token, head) pairs full"),
           "elastic": ("fa_BK", "of (layer, KV head) pairs full attention")}


@claim("eval_head_to_head", run=("h100_partial", "h100"))
def verdict_follows_from_the_rows(rec, run):
  from bench import eval_head_to_head as h2h
  v = h2h.verdict_from_rows(run["rows"], rec["training_length"])
  expect(v["judged"] == rec["judged"] == rec["verdict"]["judged"], ("judged", v["judged"]))
  expect(v["value"] == approx(rec["verdict"]["value"]), ("value", v["value"]))
  expect(h2h.versus_dense(run["rows"]) == rec["versus_dense"], "versus_dense differs")


@claim("eval_head_to_head", run="h100")
def the_report_beside_it_holds_the_same_accuracies(rec, run):
  """The gzipped report (per-sample records) is the one the run's rows were made from."""
  expect_records_give_the_means(report(run), rec, LENGTHS, per_length=10 * rec["settings"][
      "num_samples"])


def report(run) -> dict:
  """The run's whole report beside FILE: eval_head_to_head.write_outputs' _report.json.gz for
  the head-to-head, write_sweep's _sweep_<scheme>_<knob>_report.json.gz for a sweep run."""
  from bench import common
  name = run["settings"]["name"]
  tail = name[name.index("_sweep_"):] if "_sweep_" in name else ""
  with gzip.open(os.path.join(common.RESULTS, FILE.replace(".json", f"{tail}_report.json.gz")),
                 "rt") as f:
    return json.load(f)


def expect_records_give_the_means(rep: dict, rec: dict, lengths, per_length=None) -> None:
  """Every model's per-sample scores at each length average to the recorded mean accuracy (and
  number per_length when given)."""
  expect([m["name"] for m in rep["models"]] == list(rec["mean_accuracy"]), "models differ")
  for m in rep["models"]:
    for L in lengths:
      scores = [r["score"] for r in m["records"] if r["length"] == L]
      expect(per_length is None or len(scores) == per_length, (m["name"], L, len(scores)))
      expect(float(np.mean(scores)) == approx(rec["mean_accuracy"][m["name"]][str(L)], abs=1e-9),
             (m["name"], L))


def routing_fraction(rep: dict, name: str, length: int) -> float:
  """Mean over tasks of the ROUTING statistic of model `name` (its scheme: the name's first
  word, e.g. 'l2a theta=0.3') at `length`."""
  key, _ = ROUTING[name.split()[0]]
  m = next(m for m in rep["models"] if m["name"] == name)
  return float(np.mean([np.mean(v[str(length)][key]) for v in m["routing"].values()
                        if str(length) in v]))


@quote(README, FILE, run="h100")
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


def table_rows(rec, run) -> list[str]:
  """The README's table: a row per model (means over the ten tasks; ratios: the model's over
  dense's; the routing statistic at the training length)."""
  rep = report(run)
  eff = {(r["model"], r["length"]): r for r in run["rows"] if r["kind"] == "efficiency"}
  niah = {}
  for r in run["rows"]:
    if r["kind"] == "accuracy" and r["length"] == 8192 and r["task"].startswith("niah"):
      niah.setdefault(r["model"], []).append(r["accuracy"])
  out = []
  for name, acc in rec["mean_accuracy"].items():
    tr = rec["training"]["models"][name]
    cells = [name] + [f"{acc[str(L)]:.2f}" for L in LENGTHS] + [f"{np.mean(niah[name]):.3f}"]
    for L in (8192, 16384):
      e, d = eff[(name, L)], eff[("dense", L)]
      cells.append(f"{1e3 * e['ttft_s']:.0f} ms" + ("" if name == "dense" else
                                                     f" ({e['ttft_s'] / d['ttft_s']:.2f}x)"))
    e, d = eff[(name, 8192)], eff[("dense", 8192)]
    cells.append(f"{e['kv_cache_bytes'] / d['kv_cache_bytes']:.2f}x")
    cells.append(f"{e['decode_tok_s']:.0f}")
    cells.append(f"{tr['ft_loss']:.2f}")
    cells.append(f"{routing_fraction(rep, name, 8192):.2f} {ROUTING[name][1]}"
                 if name in ROUTING else "-")
    out.append("| " + " | ".join(cells) + " |")
  return out


@quote(README, FILE, run="h100")
def quote_finished_run(rec, run):
  vd = rec["versus_dense"]
  lines = table_rows(rec, run)
  for m in ("l2a", "aha", "elastic", "match", "segmented"):  # accuracy minus dense's at 4K/8K/16K
    lines.append(f"**{m}** (" + " / ".join(
        f"{vd[m][str(L)]['accuracy_minus_dense']:+.2f}" for L in LENGTHS) + ")")
  return lines


SWEEPS = ("h100_sweep_l2a_theta", "h100_sweep_aha_tau")  # run name: <preset>_sweep_<scheme>_<knob>


@claim("eval_head_to_head", run=SWEEPS)
def the_sweeps_report_holds_the_same_accuracies(rec, run):
  expect_records_give_the_means(report(run), rec, rec["lengths"])


def sweep_rows(rec, run) -> list[str]:
  """A sweep's README table: a row per model (mean accuracy, the scheme's ROUTING statistic
  from the sweep's report, TTFT against the dense export timed in the same process)."""
  rep = report(run)
  L = rec["lengths"][0]
  eff = {r["model"]: r for r in run["rows"] if r["kind"] == "efficiency" and r["length"] == L}
  ref = eff["dense_export"]["ttft_s"]
  out = []
  for m in rep["models"]:
    name = m["name"]
    routed = f"{routing_fraction(rep, name, L):.2f}" if m["routing"] else "-"
    out.append(f"| {name} | {rec['mean_accuracy'][name][str(L)]:.2f} | {routed} | "
               f"{1e3 * eff[name]['ttft_s']:.1f} ms ({eff[name]['ttft_s'] / ref:.2f}x) |")
  return out


quote(README, FILE, run="h100_sweep_l2a_theta", name="quote_theta_sweep")(sweep_rows)
quote(README, FILE, run="h100_sweep_aha_tau", name="quote_tau_sweep")(sweep_rows)
