"""Next-token choice from one row's logits: greedy (argmax, the default) or sampling at a
temperature with nucleus (top-p) truncation, on the host in float64.

    rng = row_rng(seed, row)
    tok = choose(logits_V, temperature=0.8, top_p=0.95, rng=rng)

A row's draws come from its own generator (`row_rng(seed, row)`), so a row's sample depends on
its own logits, the seed and its row index only, never on the other rows of the batch.
"""
from __future__ import annotations

import numpy as np


def check_sampling(temperature: float, top_p: float) -> None:
  """One-line errors for knobs outside their range."""
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy).")
  if not (0 < top_p <= 1):
    raise ValueError(f"top_p={top_p} must be in (0, 1] (1: no truncation).")


def row_rng(seed: int, row: int) -> np.random.Generator:
  return np.random.default_rng([int(seed), int(row)])


def nucleus_probs(logits_V: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
  """p(token) after temperature and top-p: the smallest set of most likely tokens whose
  probability reaches top_p (ties at the boundary kept by sort order), renormalised."""
  z = np.asarray(logits_V, np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  if top_p < 1:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]     # mass of the more likely tokens
    keep = order[before < top_p]                # always keeps the most likely token
    q = np.zeros_like(p)
    q[keep] = p[keep]
    p = q / q.sum()
  return p


def choose(logits_V: np.ndarray, *, temperature: float = 0.0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
  """The next token: argmax at temperature 0 (exact, first index on ties), else a draw from
  `nucleus_probs` with `rng`."""
  if temperature == 0:
    return int(np.argmax(logits_V))
  p = nucleus_probs(logits_V, temperature, top_p)
  return int(rng.choice(p.shape[0], p=p))
