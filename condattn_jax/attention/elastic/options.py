"""Elastic Attention's options (`model.scheme.<name>` of scheme 'elastic'); whole-config check:
`refuse_sliding_window` (Elastic converts a full-attention model)."""
from __future__ import annotations

import dataclasses

MODES = ("fa_ssa", "fa_xa", "xa_ssa")
POOLINGS = ("boundary", "prompt_mean")
TAU_SCHEDULES = ("cosine", "exp")
LAGRANGIANS = ("signed", "abs")
CONSTRAINTS = ("sample", "task_mean")
ROUTINGS = ("learned", "fa", "sa", "fixed")
FA, SA = 1, 0  # router classes


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
  """The options (`model.scheme.<name>`) of scheme 'elastic' (defaults: docs/schemes/elastic.md#options).

  modes          'fa_ssa' | 'fa_xa' | 'xa_ssa': (class-1 mode, class-0 mode).
  pooling        'boundary' (first and last `boundary` prompt tokens) | 'prompt_mean'.
  boundary       tokens pooled at each end of the prompt (paper: 100).
  sinks, local   SSA sink tokens and local tokens (128, 2048), at `block` granularity.
  block          block size of the SA modes' lists (128); XA's stride divides it.
  xa_stride, xa_threshold   XA anti-diagonal stride (16) and cumulative-mass threshold (0.9).
  xa_chunk       XA scoring: query blocks scored at a time (memory only; the kept blocks do not
                 depend on it, masks.xa_keep).
  tau_start, tau_end, anneal_steps, tau_schedule, tau_exp_rate   Gumbel temperature schedule.
  task_names     the data's task names; task id = index (batches carry 'task_ids').
  targets        target Omega_MSR per task (sensitive 0.7, robust 1.0), same order.
  lambda_init_max  lambda1, lambda2 init U(0, lambda_init_max) (0.0; the paper and the authors'
                 code draw U(0, 0.5)). Under 'signed' a positive lambda1 at init pulls Omega
                 toward 0 (dense) until the ascent takes it below -2 lambda2 (Omega - t): the
                 tiny recipe with U(0, 0.5) went p_FA 0.50 -> 0.95 in 40 steps (away from
                 t = 0.7), with 0 p_FA 0.50 -> 0.29 (docs/schemes/elastic.md).
  lagrangian     'signed' (paper eq. 8: lambda1 (Omega - t) + lambda2 (Omega - t)^2; the
                 ascent moves lambda1 by the signed violation, so it can shrink and change
                 sign, and stays put on target) | 'abs' (the authors' code: lambda1 |Omega - t|,
                 under which lambda1 can only grow).
  constraint     'sample' (the paper's eq. 8 per sample, averaged within each task: every row
                 of task k pulled toward t_k) | 'task_mean' (the deviation of the task's MEAN
                 Omega over the batch's rows: with ONE task name and one target, a single
                 task-agnostic constraint on the batch-mean Omega, under which the router is free
                 to give some rows more sparsity than others; bench/elastic_repro.py's arm).
  seed           seed of from_dense's fresh router and lambdas.
  routing        'learned' | 'fa' (every head FA: the base model under fa_* modes) | 'sa' |
                 'fixed' (the KV heads in `fixed_fa_kv_heads` are class 1 in every row and layer,
                 the others class 0: a static head split, for ablations and speed measurements
                 at an exact Omega).
  fixed_fa_kv_heads  KV head indices of class 1 under routing 'fixed': one tuple for every
                 layer, or a tuple of num_layers tuples (per layer: an Omega between the
                 1/K steps, e.g. 0.7 with K = 8).
  prompt_field   batch field [B] with each row's prompt length (absent: the whole row).
  dense_full_heads  eval / prefill on a CUDA GPU: FA KV heads run in one cuDNN call, the SA heads
                 in the block-sparse launch (elastic/composite.py; same result,
                 bench/results/elastic_prefill_*.json times both). False: one fused launch.
  """
  modes: str = "fa_ssa"
  pooling: str = "boundary"
  boundary: int = 100
  sinks: int = 128
  local: int = 2048
  block: int = 128
  xa_stride: int = 16
  xa_threshold: float = 0.9
  xa_chunk: int = 16
  tau_start: float = 1.5
  tau_end: float = 1.0
  anneal_steps: int = 180
  tau_schedule: str = "cosine"
  tau_exp_rate: float = 0.6
  task_names: tuple = ("sensitive", "robust")
  targets: tuple = (0.7, 1.0)
  lambda_init_max: float = 0.0
  lagrangian: str = "signed"
  constraint: str = "sample"
  seed: int = 0
  routing: str = "learned"
  fixed_fa_kv_heads: tuple = ()
  prompt_field: str = "prompt_lengths"
  dense_full_heads: bool = True

  def __post_init__(self):
    f = "model.scheme"
    if self.modes not in MODES:
      raise ValueError(f"{f}.modes={self.modes!r}: choose one of {MODES}.")
    if self.pooling not in POOLINGS:
      raise ValueError(f"{f}.pooling={self.pooling!r}: choose one of {POOLINGS}.")
    if self.tau_schedule not in TAU_SCHEDULES:
      raise ValueError(f"{f}.tau_schedule={self.tau_schedule!r}: choose one of {TAU_SCHEDULES}.")
    if self.lagrangian not in LAGRANGIANS:
      raise ValueError(f"{f}.lagrangian={self.lagrangian!r}: choose one of {LAGRANGIANS}.")
    if self.constraint not in CONSTRAINTS:
      raise ValueError(f"{f}.constraint={self.constraint!r}: choose one of {CONSTRAINTS}.")
    if self.lambda_init_max < 0:
      raise ValueError(f"{f}.lambda_init_max={self.lambda_init_max} must be >= 0.")
    if self.routing not in ROUTINGS:
      raise ValueError(f"{f}.routing={self.routing!r}: choose one of {ROUTINGS}.")
    if self.fixed_fa_kv_heads and self.routing != "fixed":
      raise ValueError(f"{f}.fixed_fa_kv_heads={tuple(self.fixed_fa_kv_heads)} needs "
                       f"routing='fixed' (got {self.routing!r}).")
    if not isinstance(self.dense_full_heads, bool):
      raise ValueError(f"{f}.dense_full_heads={self.dense_full_heads!r} must be True or False.")
    for name in ("boundary", "block", "xa_stride", "local", "xa_chunk"):
      if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
        raise ValueError(f"{f}.{name}={getattr(self, name)!r} must be an int >= 1.")
    if self.sinks < 0 or self.anneal_steps < 0:
      raise ValueError(f"{f}.sinks and anneal_steps must be >= 0.")
    if "xa" in self.modes and self.block % self.xa_stride:
      raise ValueError(f"{f}.block={self.block} must be a multiple of xa_stride={self.xa_stride}.")
    if not 0.0 < self.xa_threshold <= 1.0:
      raise ValueError(f"{f}.xa_threshold={self.xa_threshold} must be in (0, 1].")
    if self.tau_start <= 0 or self.tau_end <= 0:
      raise ValueError(f"{f}.tau_start / tau_end must be > 0.")
    if not self.task_names or len(self.task_names) != len(self.targets):
      raise ValueError(f"{f}.task_names {tuple(self.task_names)} and targets "
                       f"{tuple(self.targets)} must be non-empty and of equal length.")
    if len(set(self.task_names)) != len(self.task_names):
      raise ValueError(f"{f}.task_names {tuple(self.task_names)} has duplicates.")
    if any(not 0.0 <= t <= 1.0 for t in self.targets):
      raise ValueError(f"{f}.targets {tuple(self.targets)} must be sparsities in [0, 1].")

  @property
  def num_tasks(self) -> int:
    return len(self.task_names)


