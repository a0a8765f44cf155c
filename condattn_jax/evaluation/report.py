"""Evaluation results -> JSON + a markdown table."""
from __future__ import annotations

import json
import os
from typing import Any

COLUMNS = (("ppl", "ppl", "{:.3f}"), ("ce", "CE", "{:.4f}"), ("token_acc", "token acc", "{:.3f}"),
           ("exact_match", "exact match", "{:.3f}"), ("tokens", "scored tokens", "{}"))


def markdown_table(results: dict[str, Any], title: str | None = None) -> str:
  """One row per context length; scalar scheme metrics (aux/...) as extra columns; per-layer
  metrics are shown as their mean."""
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
      if isinstance(v, list):
        v = sum(v) / max(len(v), 1)
      cells.append("" if v is None else f"{v:.4f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], out_dir: str, name: str | None = None,
                  title: str | None = None) -> tuple[str, str]:
  """Writes <out_dir>/<name>.json and .md (name defaults to eval_step<step>)."""
  os.makedirs(out_dir, exist_ok=True)
  name = name or f"eval_step{results.get('step', 0)}"
  jp, mp = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".md")
  with open(jp, "w") as f:
    json.dump({**results, "results": {str(k): v for k, v in results["results"].items()}}, f,
              indent=2)
  with open(mp, "w") as f:
    f.write(markdown_table(results, title or f"Evaluation at step {results.get('step', 0)}"))
  return jp, mp
