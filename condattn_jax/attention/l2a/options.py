"""L2A's options (`model.scheme.<name>` of scheme 'l2a') and its whole-config check."""
from __future__ import annotations

import dataclasses

from condattn_jax import ops

ROUTINGS = ("learned", "bernoulli", "all", "none", "soft")
LAMBDA_SCHEDULES = ("ramp", "constant")


@dataclasses.dataclass(frozen=True)
class L2AOptions:
  """The options (`model.scheme.<name>`) of scheme 'l2a' (defaults: docs/schemes/l2a.md#options / authors' code).

  window              local attention window w (keys t-w+1..t); 0 = no local attention.
  tau                 router temperature: p = sigmoid(z / tau).
  theta               threshold d = (p >= theta); a test-time knob (higher = sparser).
  p_force             per layer per training step probability of the forced-global step.
  lambda_max          regulariser weight on mean_{l,b,t} p^2 (mean form of the authors' 1e-8 * sum
                      over 131072 tokens = 1.3e-3).
  lambda_schedule     'ramp': 0 for lambda_warmup_steps, then linear to lambda_max over
                      lambda_ramp_steps (authors' code); 'constant': lambda_max from step 0 (paper).
  routing             'learned' (router + STE), 'bernoulli' (context-free baseline: each token global
                      with probability bernoulli_q, paper Sec. 4.4), 'all' (every token global),
                      'none' (global branch never runs), 'soft' (analysis only: d = p, dense path).
  bernoulli_q         the context-free routing probability.
  bernoulli_seed      key for the context-free draws when no `router` RNG is given (eval/decode);
                      the draw of token (row b, position t) is the same in a full forward and in
                      token-by-token decoding.
  pruned_layers       layer indices without a global branch (post-training pruning).
  decode_skip         decode: skip the global attention compute when no query routes global (a
                      `lax.cond` a layer; off by default: on XLA:GPU a conditional copies its
                      predicate to the host each layer, see docs/performance.md).
  compact_impl        ops.attention impl of the global branch's active-query calls
                      ('auto' | 'reference' | 'pallas' | ...).
  """
  window: int = 4096
  tau: float = 0.1
  theta: float = 0.5
  p_force: float = 0.1
  lambda_max: float = 1.3e-3
  lambda_schedule: str = "ramp"
  lambda_warmup_steps: int = 0
  lambda_ramp_steps: int = 0
  routing: str = "learned"
  bernoulli_q: float = 0.2
  bernoulli_seed: int = 0
  pruned_layers: tuple[int, ...] = ()
  decode_skip: bool = False
  compact_impl: str = "auto"

  def __post_init__(self):
    if self.window < 0:
      raise ValueError(f"model.scheme.window={self.window} must be >= 0.")
    if self.tau <= 0:
      raise ValueError(f"model.scheme.tau={self.tau} must be > 0.")
    if not 0.0 <= self.p_force <= 1.0:
      raise ValueError(f"model.scheme.p_force={self.p_force} must be in [0, 1].")
    if not 0.0 <= self.bernoulli_q <= 1.0:
      raise ValueError(f"model.scheme.bernoulli_q={self.bernoulli_q} must be in [0, 1].")
    if self.routing not in ROUTINGS:
      raise ValueError(f"model.scheme.routing={self.routing!r}: choose one of {ROUTINGS}.")
    if self.lambda_schedule not in LAMBDA_SCHEDULES:
      raise ValueError(f"model.scheme.lambda_schedule={self.lambda_schedule!r}: choose one "
                       f"of {LAMBDA_SCHEDULES}.")
    if self.lambda_warmup_steps < 0 or self.lambda_ramp_steps < 0:
      raise ValueError("model.scheme.lambda_warmup_steps / lambda_ramp_steps must be >= 0.")
    if self.compact_impl not in ops.IMPLS:
      raise ValueError(f"model.scheme.compact_impl={self.compact_impl!r}: choose one of "
                       f"{ops.IMPLS}.")
    object.__setattr__(self, "pruned_layers", tuple(sorted(int(i) for i in self.pruned_layers)))




def check(config, options) -> None:
  """L2A's whole-config check: pre-norm families only (the global branch reuses the input norm)."""
  del options
  if config.post_norm:
    raise ValueError(f"L2A is defined for pre-norm families (llama, qwen2, qwen3); "
                     f"model.family={config.family!r} is post-norm.")
