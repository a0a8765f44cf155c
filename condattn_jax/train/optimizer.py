"""Learning-rate schedules, AdamW, gradient clipping and the trainable-parameter mask.

Parameters are labelled by regex on their '/'-joined path (e.g. `layers_3/self_attn/q_proj/kernel`,
matched with `re.fullmatch`):
  1. the first of `train.param_groups` whose `regex` matches -> that group (always trainable);
  2. else `train.trainable_regex` (None = everything) matches -> 'default';
  3. else 'frozen': no gradient is applied and NO optimizer state is allocated.
The transformation is
  zero frozen grads -> clip_by_global_norm(train.grad_clip) over the trainable grads ->
  multi_transform({default: AdamW, <group>: AdamW with the group's overrides, frozen: zero}).
Weight decay applies to parameters with ndim >= 2 (kernels, embeddings), never to norms/biases.
A group with `maximize=True` does gradient ASCENT on its parameters (e.g. Lagrange multipliers).
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

FROZEN = "frozen"
DEFAULT = "default"
SCHEDULES = ("cosine", "linear", "constant", "rsqrt")
GROUP_FIELDS = ("regex", "lr", "weight_decay", "b1", "b2", "maximize")


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_paths(params) -> list[str]:
  return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def warmup_steps(tc) -> int:
  if tc.get("warmup_steps") is not None:
    return int(tc.warmup_steps)
  return int(round(float(tc.warmup_frac) * int(tc.num_steps)))


def make_schedule(tc, peak: float | None = None) -> optax.Schedule:
  """Linear warmup from 0 to `peak` (train.lr) then `train.lr_schedule` down to end_lr_frac*peak."""
  peak = float(tc.lr if peak is None else peak)
  total = int(tc.num_steps)
  warm = warmup_steps(tc)
  if not 0 <= warm <= total:
    raise ValueError(f"train.warmup_frac/warmup_steps give {warm} warmup steps, outside "
                     f"[0, train.num_steps={total}].")
  end = peak * float(tc.end_lr_frac)
  rest = max(total - warm, 1)
  kind = tc.lr_schedule
  if kind == "cosine":
    decay = optax.cosine_decay_schedule(peak, rest, alpha=end / peak if peak else 0.0)
  elif kind == "linear":
    decay = optax.linear_schedule(peak, end, rest)
  elif kind == "constant":
    decay = optax.constant_schedule(peak)
  elif kind == "rsqrt":
    decay = lambda s: peak * jax.lax.rsqrt(1.0 + jnp.asarray(s, jnp.float32))
  else:
    raise ValueError(f"train.lr_schedule={kind!r}: choose one of {SCHEDULES}.")
  if warm == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def _groups(tc) -> list[tuple[str, dict]]:
  groups = tc.get("param_groups") or {}
  if hasattr(groups, "to_dict"):
    groups = groups.to_dict()
  out = []
  for name, g in groups.items():
    g = dict(g)
    unknown = sorted(set(g) - set(GROUP_FIELDS))
    if unknown:
      raise ValueError(f"train.param_groups.{name}: unknown field(s) {unknown}; valid: "
                       f"{list(GROUP_FIELDS)}.")
    if not g.get("regex"):
      raise ValueError(f"train.param_groups.{name}.regex is required.")
    if name in (FROZEN, DEFAULT):
      raise ValueError(f"train.param_groups: {name!r} is reserved; pick another group name.")
    out.append((name, g))
  return out


def param_labels(params, tc) -> Any:
  """Tree of labels ('frozen' | 'default' | group name) with the structure of `params`."""
  groups = [(n, re.compile(g["regex"]), g) for n, g in _groups(tc)]
  trainable = tc.get("trainable_regex")
  trainable_re = re.compile(trainable) if trainable not in (None, "") else None

  def label(path, _):
    p = path_str(path)
    for name, rx, _g in groups:
      if rx.fullmatch(p):
        return name
    if trainable_re is None or trainable_re.fullmatch(p):
      return DEFAULT
    return FROZEN
  labels = jax.tree_util.tree_map_with_path(label, params)
  flat = jax.tree.leaves(labels)
  if all(l == FROZEN for l in flat):
    raise ValueError(f"train.trainable_regex={trainable!r} matches no parameter (paths look like "
                     f"{param_paths(params)[:3]}; matched with re.fullmatch).")
  for name, _rx, g in groups:
    if name not in flat:
      raise ValueError(f"train.param_groups.{name}.regex={g['regex']!r} matches no parameter.")
  return labels


def _adamw(schedule, b1, b2, eps, weight_decay, maximize):
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  parts = [optax.scale(-1.0)] if maximize else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                           mask=decay_mask))
  return optax.chain(*parts)


def make_optimizer(tc, params) -> tuple[optax.GradientTransformation, Any, optax.Schedule]:
  """(tx, labels, lr schedule of the default group) for `params` (arrays or ShapeDtypeStructs)."""
  labels = param_labels(params, tc)
  schedule = make_schedule(tc)
  transforms = {
      FROZEN: optax.set_to_zero(),
      DEFAULT: _adamw(schedule, tc.b1, tc.b2, tc.eps, tc.weight_decay, False),
  }
  for name, g in _groups(tc):
    pick = lambda k: tc[k] if g.get(k) is None else g[k]
    sched = schedule if g.get("lr") is None else make_schedule(tc, peak=g["lr"])
    transforms[name] = _adamw(sched, pick("b1"), pick("b2"), tc.eps, pick("weight_decay"),
                              bool(g.get("maximize", False)))
  frozen_mask = jax.tree.map(lambda l: l == FROZEN, labels)
  # The chain keeps one structure whatever the values (clip off = identity), so a run can resume
  # with a changed grad_clip / lr.
  clip = (optax.clip_by_global_norm(float(tc.grad_clip)) if tc.grad_clip and tc.grad_clip > 0
          else optax.identity())
  chain = [optax.masked(optax.set_to_zero(), frozen_mask), clip,
           optax.multi_transform(transforms, labels)]
  return optax.chain(*chain), labels, schedule


def count_params(params, labels=None) -> dict[str, int]:
  """{'total': n, 'trainable': n, 'frozen': n} (+ per group when labels are given)."""
  sizes = [int(x.size) for x in jax.tree.leaves(params)]
  out = {"total": sum(sizes)}
  if labels is not None:
    for l, n in zip(jax.tree.leaves(labels), sizes):
      out[l] = out.get(l, 0) + n
    out["trainable"] = out["total"] - out.get(FROZEN, 0)
  return out
