"""Evaluation results -> JSON + a markdown table, named so that evals with other knobs coexist.

`write_results` names the files eval_step<N>[_<tag>].{json,md}: no tag when the results' knobs
(scheme hyper-parameters + eval section, see perplexity.eval_knobs) equal `reference_knobs` (the
run's own, e.g. the config saved with the checkpoint); else the tag lists what differs
(`eval_step400_theta=0.7`). An existing file is only overwritten by results with the same knobs;
otherwise a short hash of the knobs is appended.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import numpy as np

COLUMNS = (("ppl", "ppl", "{:.3f}"), ("ce", "CE", "{:.4f}"), ("token_acc", "token acc", "{:.3f}"),
           ("exact_match", "exact match", "{:.3f}"), ("tokens", "scored tokens", "{}"))


def markdown_table(results: dict[str, Any], title: str | None = None) -> str:
  """One row per context length; scalar scheme metrics (aux/...) as extra columns; per-layer
  metrics are shown as their mean in the table and in full below it (`_array_tables`: one
  row per layer, one column per head for [L, N] metrics)."""
  rows = results["results"]
  aux = sorted({k for r in rows.values() for k in r if k.startswith("aux/")})
  head = ["context length"] + [c[1] for c in COLUMNS] + [k[4:] for k in aux]
  lines = []
  if title:
    lines += [f"### {title}", ""]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for L in sorted(rows, key=int):
    r = rows[L]
    cells = [str(L)] + [fmt.format(r[k]) for k, _, fmt in COLUMNS]
    for k in aux:
      v = r.get(k)
      if isinstance(v, list):  # per layer [L] or per layer x head [L, N] (nested lists)
        v = float(np.mean(v)) if len(v) else 0.0
      cells.append("" if v is None else f"{v:.4f}")
    lines.append("| " + " | ".join(cells) + " |")
  lines += _array_tables(rows, aux)
  return "\n".join(lines) + "\n"


def _array_tables(rows: dict, aux: list[str]) -> list[str]:
  """The list-valued aux metrics in full (the main table shows their mean): per context length,
  one row per layer ([L]) or per layer with one column per head ([L, N])."""
  out = []
  for k in aux:
    for L in sorted(rows, key=int):
      v = rows[L].get(k)
      if not isinstance(v, list) or not v:
        continue
      a = np.asarray(v, np.float64)
      if a.ndim == 1:
        a = a[:, None]
        head = ["layer", "value"]
      elif a.ndim == 2:
        head = ["layer"] + [f"head {j}" for j in range(a.shape[1])]
      else:
        continue
      out += ["", f"{k[4:]} at context length {L} per layer{' x head' if len(head) > 2 else ''} "
              "(the table above shows the mean):",
              "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
      out += ["| " + " | ".join([str(i)] + [f"{x:.4f}" for x in row]) + " |"
              for i, row in enumerate(a)]
  return out


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _normal(x):
  return json.loads(json.dumps(x, sort_keys=True))


def knobs_hash(knobs) -> str:
  return hashlib.sha1(json.dumps(_normal(knobs), sort_keys=True).encode()).hexdigest()[:8]


def knobs_tag(knobs: dict, reference: dict) -> str:
  """'theta=0.7,num_batches=2' for the knobs that differ from `reference` (a hash if long)."""
  a, b = _flatten(_normal(knobs)), _flatten(_normal(reference))
  diff = [(k, a.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
  parts = []
  for k, v in diff:
    v = ",".join(map(str, v)) if isinstance(v, list) else v
    parts.append(f"{k.split('.')[-1]}={v}")
  tag = re.sub(r"[^A-Za-z0-9_=.,+-]", "", "_".join(parts))
  return tag if 0 < len(tag) <= 60 else knobs_hash(knobs)


def result_name(results: dict[str, Any], out_dir: str, reference_knobs: dict | None = None) -> str:
  """eval_step<N>, + _<tag> when the knobs differ from the reference or from an existing file's."""
  name = f"eval_step{results.get('step', 0)}"
  knobs = results.get("knobs")
  if knobs is None:
    return name
  if reference_knobs is not None and _normal(knobs) != _normal(reference_knobs):
    name += "_" + knobs_tag(knobs, reference_knobs)
  path = os.path.join(out_dir, name + ".json")
  if os.path.exists(path):
    try:
      with open(path) as f:
        old = json.load(f).get("knobs")
    except (OSError, ValueError):
      old = None
    if old is None or _normal(old) != _normal(knobs):
      name += "_" + knobs_hash(knobs)
  return name


def write_results(results: dict[str, Any], out_dir: str, name: str | None = None,
                  title: str | None = None, reference_knobs: dict | None = None) -> tuple[str, str]:
  """Writes <out_dir>/<name>.json and .md; name defaults to `result_name` (eval_step<N>[_tag])."""
  os.makedirs(out_dir, exist_ok=True)
  name = name or result_name(results, out_dir, reference_knobs)
  jp, mp = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".md")
  with open(jp, "w") as f:
    json.dump({**results, "results": {str(k): v for k, v in results["results"].items()}}, f,
              indent=2)
  with open(mp, "w") as f:
    f.write(markdown_table(results, title or f"Evaluation at step {results.get('step', 0)}"))
  return jp, mp
