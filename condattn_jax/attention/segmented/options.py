"""Options of scheme 'segmented' (docs/schemes/segmented.md) and the static head / layer partition."""
from __future__ import annotations

import dataclasses

import numpy as np

from condattn_jax.attention import options

from condattn_jax.models.config import ModelConfig

# docs/schemes/segmented.md#choices: 32-head LLaMA-2 defaults (paper; the authors' code agrees on the heads).
LLAMA2_LONG_HEADS = (0, 1, 2, 4, 9, 12, 14, 15, 16, 18, 19, 22, 23, 26, 29, 30)
LLAMA2_LONG_LAYERS = (6, 8, 11, 18)  # the authors' code uses 16 instead of 18 (a config list)
TBPTT_BOUNDARIES = ("true_state", "empty_restart")
LOSS_NORMALISATIONS = ("tokens", "segment_mean")


@dataclasses.dataclass(frozen=True)
class SegmentedOptions:
  """The options (`model.scheme.<name>`) of scheme 'segmented' (defaults: docs/schemes/segmented.md#options / the paper).

  segment_len     S: tokens per segment (segments never overlap; attention is causal inside).
  tail_len        M: carried KV tail, the last M pre-RoPE K/V of the previous segment (local
                  heads); the only differentiable cross-segment state.
  retrieve_len    R: retrieved prefix per long head of a long layer (forward-only).
  tbptt           K: gradients flow through the carried tail for exactly K segment transitions
                  (K = 0: every carried state is stop_gradient, Transformer-XL style).
  long_heads      KV-head indices of the long-range heads (for MHA models = query heads); a
                  query head is long iff its KV head is (GQA groups are never split).
  long_layers     layers whose long heads attend to [retrieved prefix ; segment]; long heads of
                  other layers attend to their segment only.
  query_len       Lq: last pre-RoPE long-head queries of a segment summarised for retrieval.
  summary_window, summary_stride, summary_tail: summaries = means of sliding windows (8, stride
                  4: 15 vectors over 64 queries) plus the mean of the last `summary_tail` (4).
  topk            top-k pool keys per summary (dedupe keeps the max score per key).
  anchors         anchors kept after dedupe (highest scores).
  expand          (lo, hi): each anchor expands to offsets lo..hi (inclusive), -3..+4.
  refresh         retrieval refresh period in segments: the retrieved prefix is recomputed at
                  segments 1, 1 + refresh, ... and reused in between (training and inference
                  alike; 1 = every segment, the paper).
  remat_segments  training forward: rematerialise each segment step in the backward pass
                  (activation memory O(S), not O(T)).
  tbptt_boundary  where the training forward's gradient window starts (docs/schemes/segmented.md#choices):
                  'true_state' (the paper, Def. 3.2): the oldest recomputed segment starts from
                  stop_gradient of the TRUE carried state, so values equal inference's;
                  'empty_restart' (the authors' trainer): the oldest recomputed segment runs as
                  a first segment (no carried tail, no retrieved prefix), so the loss's segment
                  sees a tail computed from an empty start. Needs tbptt >= 1.
  loss_normalisation  the train step's CE normalisation: 'tokens' (sum over target tokens /
                  their number) or 'segment_mean' (the authors' trainer: the mean over segments
                  of each segment's mean CE over the batch; a target belongs to its input
                  position's segment). Equal when every segment holds the same number of
                  targets. `forward.loss_weights`.
  """
  segment_len: int = 4096
  tail_len: int = 512
  retrieve_len: int = 512
  tbptt: int = 1
  long_heads: tuple = LLAMA2_LONG_HEADS
  long_layers: tuple = LLAMA2_LONG_LAYERS
  query_len: int = 64
  summary_window: int = 8
  summary_stride: int = 4
  summary_tail: int = 4
  topk: int = 16
  anchors: int = 64
  expand: tuple = (-3, 4)
  refresh: int = 1
  remat_segments: bool = True
  tbptt_boundary: str = "true_state"
  loss_normalisation: str = "tokens"

  def __post_init__(self):
    object.__setattr__(self, "long_heads", tuple(int(h) for h in self.long_heads))
    object.__setattr__(self, "long_layers", tuple(int(l) for l in self.long_layers))
    object.__setattr__(self, "expand", tuple(int(e) for e in self.expand))
    for f in ("segment_len", "retrieve_len", "query_len", "summary_window", "summary_stride",
              "summary_tail", "topk", "anchors", "refresh"):
      v = getattr(self, f)
      if int(v) != v or v < 1:
        raise ValueError(f"model.scheme.{f}={v!r} must be an int >= 1.")
    for f in ("tail_len", "tbptt"):
      v = getattr(self, f)
      if int(v) != v or v < 0:
        raise ValueError(f"model.scheme.{f}={v!r} must be an int >= 0.")
    if self.tbptt_boundary not in TBPTT_BOUNDARIES:
      raise ValueError(f"model.scheme.tbptt_boundary={self.tbptt_boundary!r} must be one of "
                       f"{TBPTT_BOUNDARIES}.")
    if self.tbptt_boundary == "empty_restart" and self.tbptt < 1:
      raise ValueError("model.scheme.tbptt_boundary='empty_restart' needs tbptt >= 1 (with "
                       "tbptt=0 every segment would restart empty); set tbptt or 'true_state'.")
    if self.loss_normalisation not in LOSS_NORMALISATIONS:
      raise ValueError(f"model.scheme.loss_normalisation={self.loss_normalisation!r} must be one "
                       f"of {LOSS_NORMALISATIONS}.")
    if self.tail_len > self.segment_len:
      raise ValueError(f"model.scheme.tail_len={self.tail_len} must be <= segment_len="
                       f"{self.segment_len} (the tail is cut from one segment).")
    if self.query_len > self.segment_len:
      raise ValueError(f"model.scheme.query_len={self.query_len} must be <= segment_len="
                       f"{self.segment_len}.")
    if self.summary_window > self.query_len or self.summary_tail > self.query_len:
      raise ValueError(f"model.scheme.summary_window={self.summary_window} and "
                       f"summary_tail={self.summary_tail} must be <= query_len={self.query_len}.")
    if len(self.expand) != 2 or self.expand[0] > self.expand[1]:
      raise ValueError(f"model.scheme.expand={self.expand!r} must be (lo, hi) with lo <= hi.")
    if self.anchors * self.expansion > self.retrieve_len:
      raise ValueError(f"model.scheme.anchors={self.anchors} x expansion {self.expansion} "
                       f"exceeds retrieve_len={self.retrieve_len}; lower anchors or raise "
                       "retrieve_len.")
    if len(set(self.long_heads)) != len(self.long_heads):
      raise ValueError(f"model.scheme.long_heads={self.long_heads} has duplicates.")

  @property
  def expansion(self) -> int:
    return self.expand[1] - self.expand[0] + 1

  @property
  def num_summaries(self) -> int:
    return (self.query_len - self.summary_window) // self.summary_stride + 2


def check(config: ModelConfig, o: SegmentedOptions) -> None:
  """The whole-config check: a full-attention base, and long_heads / long_layers inside the
  model's KV heads and layers."""
  if config.sliding_window is not None:
    raise ValueError(f"model.sliding_window={config.sliding_window}: 'segmented' converts a "
                     "full-attention model; set model.sliding_window=None.")
  bad = [h for h in o.long_heads if not 0 <= h < config.num_kv_heads]
  if bad:
    raise ValueError(f"model.scheme.long_heads has {bad} outside 0..{config.num_kv_heads - 1}"
                     " (KV-head indices); set long_heads for this model.")
  bad = [l for l in o.long_layers if not 0 <= l < config.num_layers]
  if bad:
    raise ValueError(f"model.scheme.long_layers has {bad} outside 0.."
                     f"{config.num_layers - 1}; set long_layers for this model.")


@dataclasses.dataclass(frozen=True)
class HeadGroups:
  """Static head partition: KV-head and query-head indices of the long and local groups (query
  heads listed KV head by KV head, so group-local GQA keeps query n -> kv n // G)."""
  long_kv: np.ndarray
  local_kv: np.ndarray
  long_q: np.ndarray
  local_q: np.ndarray


def head_groups(config: ModelConfig, o: SegmentedOptions) -> HeadGroups:
  K, G = config.num_kv_heads, config.num_heads // config.num_kv_heads
  long_kv = np.asarray(sorted(o.long_heads), np.int32)
  local_kv = np.asarray([h for h in range(K) if h not in set(o.long_heads)], np.int32)
  q_of = lambda kv: (kv[:, None] * G + np.arange(G)[None]).reshape(-1).astype(np.int32)
  return HeadGroups(long_kv, local_kv, q_of(long_kv), q_of(local_kv))


def layer_variants(config: ModelConfig) -> tuple:
  """'long' for the layers of long_layers (they hold a retrieval pool), else 'local'."""
  o = options(config)
  return tuple("long" if i in o.long_layers else "local" for i in range(config.num_layers))
