"""AHA's options (`model.scheme.<name>` of scheme 'aha'); whole-config check:
`refuse_sliding_window` (AHA converts a full-attention model, its window is an option)."""
from __future__ import annotations

import dataclasses

from condattn_jax import ops

MODES = ("exact", "sparse")
ROUTINGS = ("learned", "all", "none", "soft")


@dataclasses.dataclass(frozen=True)
class AHAOptions:
  """The options (`model.scheme.<name>`) of scheme 'aha' (defaults: docs/schemes/aha.md#options / the paper).

  window           local window w (keys t-w+1..t), >= 1; paper: 16..256, released checkpoint 128.
  tau              threshold: g = (s > tau); a test-time knob (higher = fewer full heads).
  lam              weight of the L1 regulariser lam * mean_{layers, tokens, heads} s (paper 3e-4).
  mode             'exact' | 'sparse' (see the module docstring).
  p_force          sparse mode: per layer per step probability of the forced-global (dense) step.
  routing          'learned' (router + STE); 'all' (every head full: the base model); 'none'
                   (every head local: a sliding-window model); 'soft' (analysis only: head =
                   s * Full + (1 - s) * Local, dense).
  router_bias      True: r = x W_r + b_r (the released checkpoint's layout); False: r = x W_r
                   (the paper's eq. 1 has no bias; with W_r = 0 every score starts at 0.5, on
                   the threshold, so g = s > tau is 0: every head starts LOCAL, not the base
                   model).
  router_bias_init b_r at conversion / init (W_r = 0): sigmoid(2) = 0.88 > 0.5 = every head full.
  decode_skip      decode of a multi-token chunk: skip a path's call (local / full) when no
                   (token, head) of the chunk takes it; a one-token step runs both calls
                   branch-free unless decode_skip_steps.
  decode_skip_steps  decode_skip on one-token steps too: a lax.cond per call and layer (on a GPU
                   a host round trip each, slower than the call it skips: docs/performance.md);
                   the previous step's program, kept for same-process A/Bs.
  compact_impl     ops.attention impl of the per-head active-set calls (sparse mode, decode).
  num_tasks        > 0: aux_loss reports usage per task id 0..num_tasks-1 (batch['task_ids']).
  """
  window: int = 128
  tau: float = 0.5
  lam: float = 3e-4
  mode: str = "exact"
  p_force: float = 0.05
  routing: str = "learned"
  router_bias: bool = True
  router_bias_init: float = 2.0
  decode_skip: bool = True
  decode_skip_steps: bool = False
  compact_impl: str = "auto"
  num_tasks: int = 0

  def __post_init__(self):
    if int(self.window) != self.window or self.window < 1:
      raise ValueError(f"model.scheme.window={self.window!r} must be an int >= 1.")
    if not 0.0 < self.tau < 1.0:
      raise ValueError(f"model.scheme.tau={self.tau} must be in (0, 1) (a sigmoid "
                       "score threshold).")
    if self.lam < 0:
      raise ValueError(f"model.scheme.lam={self.lam} must be >= 0.")
    if not isinstance(self.router_bias, bool):
      raise ValueError(f"model.scheme.router_bias={self.router_bias!r} must be True or False.")
    if not self.router_bias and self.router_bias_init != 0.0:
      raise ValueError(f"model.scheme.router_bias_init={self.router_bias_init} needs "
                       "router_bias=True (set router_bias_init=0 for a router without bias).")
    if self.mode not in MODES:
      raise ValueError(f"model.scheme.mode={self.mode!r}: choose one of {MODES}.")
    if not 0.0 <= self.p_force <= 1.0:
      raise ValueError(f"model.scheme.p_force={self.p_force} must be in [0, 1].")
    if self.routing not in ROUTINGS:
      raise ValueError(f"model.scheme.routing={self.routing!r}: choose one of {ROUTINGS}.")
    if self.compact_impl not in ops.IMPLS:
      raise ValueError(f"model.scheme.compact_impl={self.compact_impl!r}: choose one of "
                       f"{ops.IMPLS}.")
    if int(self.num_tasks) != self.num_tasks or self.num_tasks < 0:
      raise ValueError(f"model.scheme.num_tasks={self.num_tasks!r} must be an int >= 0.")


