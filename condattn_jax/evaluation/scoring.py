"""Scoring rules of the task suite (RULER's metrics, and their token-level twins).

  string_match_all(output, answers)   fraction of the answers found in the output
                                      (case-insensitive substring; RULER's niah / vt / cwe / fwe)
  string_match_part(output, answers)  1 if any answer is found, else 0 (RULER's qa; passkey,
                                      json_kv: one answer)
  token_match_all / token_match_part  the same on token ids: an answer (a tuple of ids) counts
                                      when it occurs as a contiguous run in the generated ids

RULER averages these per task and reports x100; `score` returns one sample's score in [0, 1].
"""
from __future__ import annotations

from typing import Sequence

METRICS = ("all", "part")


def string_match_all(output: str, answers: Sequence[str]) -> float:
  out = output.lower()
  return sum(1.0 for a in answers if a.lower() in out) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
  out = output.lower()
  return max(1.0 if a.lower() in out else 0.0 for a in answers)


def _contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
  n = len(sub)
  return n > 0 and any(tuple(seq[i:i + n]) == tuple(sub) for i in range(len(seq) - n + 1))


def token_match_all(output: Sequence[int], answers: Sequence[Sequence[int]]) -> float:
  return sum(1.0 for a in answers if _contains(output, a)) / len(answers)


def token_match_part(output: Sequence[int], answers: Sequence[Sequence[int]]) -> float:
  return max(1.0 if _contains(output, a) else 0.0 for a in answers)


def score(output, answers, metric: str) -> float:
  """One sample's score in [0, 1]: `output` is text (str) or generated ids (token-level task)."""
  if metric not in METRICS:
    raise ValueError(f"unknown metric {metric!r}; valid: {METRICS}")
  if not answers:
    raise ValueError("a sample needs at least one answer to be scored.")
  if isinstance(output, str):
    return (string_match_all if metric == "all" else string_match_part)(output, answers)
  output = [int(t) for t in output]
  return (token_match_all if metric == "all" else token_match_part)(output, answers)
