"""Head-to-head: several models on one suite (the same prompts and budget), one report.

    report = run_suite([load_model("runs/dense"), load_model("runs/l2a", theta=0.7)],
                       "ruler", lengths=(4096, 8192), num_samples=20)
    files = write_report(report, "eval_out/")   # <name>.json, .md, *.png

The report records every knob that shaped it: the suite's (suite, tasks, lengths, samples per
(task, length), seed, batch size, prefill chunk), the device (platform, device kind, count) and
jax version, and per model its own knobs (checkpoint, step, scheme and options, overrides, sweep
value). The file name carries a hash of all of them (`h2h_<suite>_<hash>`): results with other
knobs never overwrite each other; the same knobs again write the same file.

Models with the same tokenizer (or none, with the same vocabulary) get the very same samples;
the samples' token budget is counted by that tokenizer.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Sequence

import numpy as np

from condattn_jax.evaluation import harness, plots
from condattn_jax.evaluation import tasks as tasks_lib


def device_knobs() -> dict:
  import jax
  d = jax.local_devices()[0]
  return dict(platform=d.platform, device_kind=d.device_kind, local_devices=jax.local_device_count(),
              jax=jax.__version__)


def _tok_key(model: harness.EvalModel):
  tok = model.tokenizer
  return ("tokens", model.vocab_size) if tok is None else ("text", getattr(tok, "source", id(tok)))


def run_suite(models: Sequence[harness.EvalModel], suite: str, *,
              lengths: Sequence[int] | None = None, num_samples: int | None = None,
              seed: int = 0, batch_size: int = 4, prefill_chunk: int | None = None,
              tasks: Sequence[str] | None = None, haystack_file: str | None = None,
              qa_file: str | None = None, ppl_docs: str | None = None,
              progress: bool = True) -> dict[str, Any]:
  """Evaluates every model on the suite; see the module docstring. A progress bar over
  tasks x lengths x models (with an ETA) goes to stderr. ppl_docs: a documents file
  (`harness.load_documents`): each model's perplexity by position at every length
  (`harness.perplexity_by_position`, 8 bins) under 'perplexity'."""
  from condattn_jax.train.metrics import ProgressBar
  if not models:
    raise ValueError("run_suite needs at least one model.")
  seen: dict[str, int] = {}
  for m in models:  # unique names: the report's columns
    seen[m.name] = seen.get(m.name, 0) + 1
    if seen[m.name] > 1:
      m.name = f"{m.name}#{seen[m.name]}"
  spec = tasks_lib.SUITES.get(suite)
  if spec is None:
    raise ValueError(f"unknown suite {suite!r}; valid: {sorted(tasks_lib.SUITES)}")
  lengths = [int(x) for x in (lengths or spec.lengths)]
  num_samples = int(num_samples or spec.num_samples)
  samples_for: dict = {}
  for m in models:
    key = _tok_key(m)
    if key not in samples_for:
      samples_for[key] = tasks_lib.build_samples(
          suite, lengths, num_samples=num_samples, seed=seed, tokenizer=m.tokenizer,
          vocab_size=m.vocab_size, tasks=tasks, haystack_file=haystack_file, qa_file=qa_file)
  task_names = sorted({s.task for ss in samples_for.values() for s in ss})
  total = sum(len({(s.task, s.length) for s in samples_for[_tok_key(m)]}) for m in models)
  bar = ProgressBar(total, enabled=progress)
  done = [0]

  def tick(task, L):
    done[0] += 1
    bar.update(done[0], extra=None)

  results = []
  for m in models:
    r = harness.evaluate_model(m, samples_for[_tok_key(m)], batch_size=batch_size,
                               prefill_chunk=prefill_chunk, on_group=tick)
    if ppl_docs:
      docs = harness.load_documents(ppl_docs, m.tokenizer)
      params = m.make_engine(1, None).stacked_params()
      r["perplexity"] = {str(L): harness.perplexity_by_position(m.model_cfg, params, docs, L,
                                                                batch_size=batch_size)
                         for L in lengths}
    if m.release is not None:
      m.release()  # one model's weights on the device at a time
    results.append(r)
  bar.close()
  knobs = dict(suite=suite, tasks=task_names, lengths=lengths, num_samples=num_samples,
               seed=int(seed), batch_size=int(batch_size), prefill_chunk=prefill_chunk,
               decoding="greedy, each sample's max_new_tokens, stop at EOS (text)",
               haystack_file=haystack_file, qa_file=qa_file, ppl_docs=ppl_docs,
               device=device_knobs())
  return dict(knobs=knobs, date=datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), models=results)


def merge_reports(reports: Sequence[dict]) -> dict[str, Any]:
  """One report from several `run_suite` reports with the same knobs (suite, tasks, lengths,
  samples, seed, batch size, device, jax version...), e.g. one model each, run in separate
  processes: their models in order, the latest date. Knobs that differ (another device: TTFTs
  would not compare) or a model name twice are a one-line ValueError."""
  if not reports:
    raise ValueError("merge_reports needs at least one report.")
  knobs = reports[0]["knobs"]
  for i, r in enumerate(reports[1:], 1):
    diff = sorted(k for k in set(knobs) | set(r["knobs"]) if knobs.get(k) != r["knobs"].get(k))
    if diff:
      raise ValueError(f"report {i} was run with other knobs than report 0: "
                       + ", ".join(f"{k}={r['knobs'].get(k)!r} vs {knobs.get(k)!r}" for k in diff)
                       + "; merge only reports of the same suite settings and device.")
  models = [m for r in reports for m in r["models"]]
  names = [m["name"] for m in models]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ValueError(f"model name(s) {twice} in more than one report; name the models apart.")
  return dict(knobs=knobs, date=max(r["date"] for r in reports), models=models)


def report_hash(report: dict) -> str:
  what = dict(knobs={k: v for k, v in report["knobs"].items()},
              models=[m["knobs"] for m in report["models"]])
  return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _dense_reference(report) -> dict | None:
  """The model efficiency is compared with: the first dense one ('scheme': {'name': 'dense'})."""
  return next((m for m in report["models"] if m["knobs"].get("scheme", {}).get("name") == "dense"),
              None)


def _mib(x):
  return "" if x is None else f"{x / 2**20:.2f}"


def markdown(report: dict) -> str:
  """Accuracy table (task x length rows, a column per model, a mean row per length), then the
  efficiency table (per length and model: TTFT, decode tokens/s, KV-cache MiB per row, peak
  MiB; x dense: the first dense model's TTFT / KV bytes over this model's), the routing
  statistics per model, task and length (mean over layers and heads: L2A's fraction routed
  global = 1 - sparsity, AHA's full-attention usage, Elastic's FA mode / rho), perplexity by
  position."""
  k = report["knobs"]
  models = report["models"]
  names = [m["name"] for m in models]
  lines = [f"### Suite `{k['suite']}`: {len(k['tasks'])} tasks x lengths {k['lengths']} x "
           f"{len(models)} models ({k['num_samples']} samples per task and length, seed "
           f"{k['seed']}, {k['device']['device_kind']})", "",
           "| task | length | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
  for L in map(str, k["lengths"]):
    for t in k["tasks"]:
      cells = [f"{m['accuracy'].get(t, {}).get(L, float('nan')):.3f}" for m in models]
      lines.append(f"| {t} | {L} | " + " | ".join(cells) + " |")
    cells = [f"**{m['mean_accuracy'].get(L, float('nan')):.3f}**" for m in models]
    lines.append(f"| **mean** | {L} | " + " | ".join(cells) + " |")
  ref = _dense_reference(report)
  lines += ["", "| model | length | TTFT ms | decode tok/s | KV MiB / row | peak MiB | "
            "TTFT x dense | KV x dense |", "|---|---|---|---|---|---|---|---|"]
  for m in models:
    for L in map(str, k["lengths"]):
      e = m["efficiency"].get(L)
      if not e:
        continue
      r = ref["efficiency"].get(L) if ref is not None else None
      sp = f"{r['ttft_s'] / e['ttft_s']:.2f}" if r and e["ttft_s"] > 0 else ""
      kv = f"{r['kv_cache_bytes'] / e['kv_cache_bytes']:.2f}" if r and e["kv_cache_bytes"] else ""
      tok_s = "" if e["decode_tok_s"] is None else f"{e['decode_tok_s']:.1f}"
      lines.append(f"| {m['name']} | {L} | {1e3 * e['ttft_s']:.2f} | {tok_s} | "
                   f"{_mib(e['kv_cache_bytes'])} | {_mib(e['peak_bytes'])} | {sp} | {kv} |")
  routed = [m for m in models if m.get("routing")]
  if routed:  # the schemes' routing statistics per task: mean over layers (and heads)
    lines += ["", "| routing (mean over layers / heads, prompt tokens) | task | " +
              " | ".join(map(str, k["lengths"])) + " |",
              "|---|---|" + "---|" * len(k["lengths"])]
    for m in routed:
      for t in k["tasks"]:
        by_len = m["routing"].get(t, {})
        stats = sorted({st for v in by_len.values() for st in v})
        for st in stats:
          cells = [f"{float(np.mean(by_len[L][st])):.3f}" if st in by_len.get(L, {}) else ""
                   for L in map(str, k["lengths"])]
          lines.append(f"| {m['name']} {st} | {t} | " + " | ".join(cells) + " |")
  for L in map(str, k["lengths"]):  # perplexity by position (ppl_docs), a table per length
    rows = [(m["name"], m["perplexity"][L]) for m in models if L in (m.get("perplexity") or {})]
    if rows:
      bins = rows[0][1]["bins"]
      lines += ["", f"| ppl by position, length {L} | " + " | ".join(
          f"{b['start']}-{b['end']}" for b in bins) + " | all |",
                "|---|" + "---|" * (len(bins) + 1)]
      for name, p in rows:
        lines.append(f"| {name} ({p['documents']} docs) | " + " | ".join(
            f"{b['ppl']:.3f}" for b in p["bins"]) + f" | {p['ppl']:.3f} |")
  return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str, name: str | None = None) -> list[str]:
  """Writes <name>.json (everything, per-sample records included), <name>.md, and PNGs:
  <name>_accuracy_vs_length.png, <name>_accuracy_vs_ttft.png, <name>_routing_<i>.png per model
  with routing statistics, and <name>_routing.json (the maps alone). Returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  name = name or f"h2h_{report['knobs']['suite']}_{report_hash(report)}"
  base = os.path.join(out_dir, name)
  files = []
  with open(base + ".json", "w") as f:
    json.dump(report, f, indent=1, default=str)
  files.append(base + ".json")
  with open(base + ".md", "w") as f:
    f.write(markdown(report))
  files.append(base + ".md")
  files.append(plots.accuracy_vs_length(report, base + "_accuracy_vs_length.png"))
  files.append(plots.accuracy_vs_ttft(report, base + "_accuracy_vs_ttft.png"))
  maps = {}
  for i, m in enumerate(report["models"]):
    if m.get("routing"):
      maps[m["name"]] = m["routing"]
      p = plots.routing_heatmaps(m, f"{base}_routing_{i}.png")
      if p:
        files.append(p)
  if maps:
    with open(base + "_routing.json", "w") as f:
      json.dump(maps, f, indent=1)
    files.append(base + "_routing.json")
  return files
