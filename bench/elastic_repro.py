"""Elastic Attention, pre-registered reproduction (issue 34): does the router allocate sparsity
by task when ONE task-agnostic constraint leaves it free to, and does that beat a static head
split at the same mean Omega?

    python -m bench.elastic_repro                      # CPU preset -> bench/results/elastic_repro.json
    python -m bench.elastic_repro --preset=ci --out_dir=/tmp/e   # the CI preset (tests/bench)
    python -m bench.elastic_repro --preset=h100 --out_dir=$OUT  # one H100 (docs/schemes/elastic.md)
    python -m bench.aha_elastic_gpu --gpus=2 --runs=elastic_repro:h100_need --write=.gpu/need.sh

Tasks (numpy only): ONE vocabulary; a row is [instruction] [filler + F one-token facts
(key k, value v_k) in [sink_pad, T/2)] ... [question marker] then Q times [fact (k, v'_k)]
[query k] [answer], the facts restated inside the local window with ANOTHER value v'_k != v_k.
'recall' (sensitive) asks for the FIRST value v_k (beyond SSA's sinks + local window: needs FA
heads); 'recent' (robust) for the restated v'_k (SSA's local window suffices). The two tasks
differ only in the instruction token (position 0) and the question marker (the prompt's last
tokens): the body is drawn from the same distribution. Batches carry `prompt_lengths` (the
prompt ends at the first query; boundary pooling sees both ends) and `task_ids`.

Arms (per seed; the dense model trained first, every arm converts it, FA-SSA):
  per_task     task targets (t_recall, t_recent), constraint 'sample' (the paper's setting)
  single       ONE task name, one target (their mean), constraint 'task_mean': a single lambda
               pair on the batch-mean Omega (the router may allocate between tasks)
  single_mean  single + pooling 'prompt_mean'
  single_abs   single + lagrangian 'abs' (the authors' code)
  static       the best static head split (routing 'fixed') with at least single's measured
               FA budget (candidates: the heads single uses most, overall and on recall rows),
               frozen and fine-tuned (every weight; its own lr sweep, best on selection rows)
Need design (presets cpu_need, h100_need; Settings.hops 2, recall_every 4, need_counts):
on the recorded task a static split of 1-2 FA heads already recalls (the single target's whole
budget), so no allocation can beat the static control. Here recall is two-hop: a link token
(k -> k') in the far region's first part and the value fact (k', v) in its last part, each
beyond SSA's reach of the other and of the query, so one retrieval per layer in two layers is
needed (one FA head cannot answer); recent rows (3 in 4) answer the restated value. The single
target (mean of the per-task targets) then allows 1 FA head a row: every static split at that
budget has one head, while recall rows with 2+ heads and recent rows with none fit it. The
'need' unit records the need curve (need_curve: recall of frozen static splits by FA heads) and
CRITERIA_NEED (pre-registered for these presets only) check the design on each dense model.
The ablation arms (all but 'single') run on the first `ablation_seeds` seeds (CPU: 1; H100:
all). Router arms train the router and the multipliers (recipe: warmup 0.2 + cosine, weight decay
0.1); each arm's accuracy and Omega curves are recorded with the plateau check. CRITERIA
(below, fixed before any run) are judged on the means over seeds and recorded pass or fail.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import sys
import time
from typing import Any, ClassVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench import aha_elastic_repro_common as rc  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from condattn_jax.attention import configure, convert  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402

TASKS = ("recall", "recent")  # sensitive, robust
TRAINABLE_REGEX = r"layers(_\d+_\d+)?/router/.*"
LAGRANGE_REGEX = r"scheme/lagrange"

# Pre-registered (written before the first run; judged on the means over seeds):
CRITERIA = {
    "sparsity_gap_under_one_constraint": rc.Criterion(
        "single.omega_gap", ">=", 0.15,
        "Omega_MSR(recent) - Omega_MSR(recall) >= 0.15 under ONE task-agnostic constraint"),
    "adaptive_beats_static_on_sensitive": rc.Criterion(
        "single_minus_static_recall_points", ">=", 5.0,
        "recall accuracy (points): single (learned) >= the best static split at >= its FA "
        "budget (frozen or fine-tuned, own lr sweep) + 5"),
    "dense_solves_both_tasks": rc.Criterion(
        "dense.min_accuracy", ">=", 0.9, "the dense model solved both tasks (else void)"),
    "ssa_cannot_recall": rc.Criterion(
        "all_ssa.recall", "<=", 0.5, "every head SSA fails recall (the task needs FA heads)"),
    "every_arm_at_plateau": rc.Criterion(
        "plateau_fraction", ">=", 1.0, "every router arm's accuracy and Omega curves moved < 1% "
        "relative over the last 20% of steps, every seed"),
}

# Pre-registered for the need presets (Settings.need_counts set: cpu_need, h100_need; written
# before their first run, in addition to CRITERIA, which stay as they are): the design holds
# on the seed's dense model, i.e. a frozen static split at the single arm's mean FA budget
# cannot recall (so an adaptive allocation has something to gain) and one at the recall rows'
# budget (the per-task recall target) can (so the gain is reachable). 'best' = the best of the
# need unit's head sets of that size (need_curve).
CRITERIA_NEED = {
    "static_at_single_budget_fails_recall": rc.Criterion(
        "need.at_single_budget", "<=", 0.6,
        "the best frozen static split with the single target's FA heads fails recall"),
    "static_at_recall_budget_solves_recall": rc.Criterion(
        "need.at_recall_budget", ">=", 0.9,
        "the best frozen static split with the recall target's FA heads solves recall"),
}

# tests/bench/test_elastic_repro.py: a fresh CI-preset run must point the way the recorded CPU
# run's verdict does: (criterion, metric of the CI run, the bound the CI metric must meet (same
# op as the criterion) where the recorded verdict passed); where it failed, the CI metric must
# stay on the criterion's failing side. The CI preset's static control is frozen (no fine-tune):
# its recall is <= the fine-tuned best's, so single - static below 5 points there implies it
# below 5 points against the tuned control too.
CI_DIRECTIONS = (("sparsity_gap_under_one_constraint", "single.omega_gap", 0.05),
                 ("adaptive_beats_static_on_sensitive", "single_minus_static_recall_points", 0.0),
                 ("dense_solves_both_tasks", "dense.min_accuracy", 0.85),
                 ("ssa_cannot_recall", "all_ssa.recall", 0.5))


@dataclasses.dataclass
class Settings:
  # task
  seq_len: int = 64
  num_keys: int = 8
  num_values: int = 8
  num_facts: int = 4
  num_queries: int = 2
  num_filler: int = 16
  sink_pad: int = 8
  # model (MHA: 2 layers x 4 KV heads = 8 decisions, Omega in steps of 1/8)
  num_layers: int = 2
  hidden_size: int = 64
  num_heads: int = 4
  num_kv_heads: int = 4
  # Elastic (SSA: 1 sink block + 2 local blocks of 8)
  block: int = 8
  sinks: int = 8
  local: int = 16
  boundary: int = 8
  targets: tuple = (0.75, 1.0)   # per_task arm; the single arm's one target is their mean
  # training
  batch_size: int = 32
  dense_steps: int = 800         # the cap of the gated dense training (dense_unit)
  # pre-registered gate: the dense model's worst task accuracy on the selection rows, checked
  # every dense_check_every steps (0: once, at the cap); the defaults (no gate, cosine over
  # the cap) are the recipe the recorded cpu run used; gated presets: constant lr after warmup
  dense_gate: float = 0.0
  dense_check_every: int = 0
  dense_schedule: str = "cosine"
  dense_lr: float = 3e-3
  # the dense model's own lr sweep (gated presets): tried in this order, each from the same init
  # for up to dense_steps, the first to reach the gate is kept (none: the best gate value; the
  # seed is NOT JUDGED); () = dense_lr alone
  dense_lrs: tuple = ()
  router_steps: int = 200
  router_lr: float = 1e-2
  lambda_lr: float = 3e-2
  static_lrs: tuple = (1e-3, 3e-3)
  arms: tuple = ("per_task", "single", "single_mean", "single_abs")
  seeds: tuple = (0, 1, 2)
  ablation_seeds: int = 1        # arms other than 'single' run on the first this many seeds
  eval_rows: int = 512
  select_rows: int = 256
  log_every: int = 200
  # --- the need design (presets *_need; the defaults are every recorded run's task) ---
  # hops 2: recall asks value(link(k)): a link token (k -> k') in the far region's first part and
  # a value fact (k', v) in its last part, the two beyond SSA's reach of each other (and the
  # query), so no single head can answer: FA heads in two layers (one retrieval each) are needed
  hops: int = 1
  # row i is a recall row iff i % recall_every == 0 (2: alternate, the recorded runs): 4 makes
  # the batch-mean FA budget of an allocation that serves recall rows small
  recall_every: int = 2
  # induction pretraining steps before the dense training (bench/aha_repro.py's repeat_batch)
  pretrain_steps: int = 0
  # the 'need' unit: recall of frozen static splits with these many FA heads (empty: no unit)
  need_counts: tuple = ()
  need_sets: int = 12            # head sets sampled per count (all when fewer)
  # fields added after the committed fixtures / work dirs: left out of a store's settings at
  # these values (bench/aha_elastic_repro_common._settings_json)
  STORE_DEFAULTS: ClassVar[dict] = dict(hops=1, recall_every=2, pretrain_steps=0,
                                        need_counts=(), need_sets=12)


PRESETS = {
    "cpu": Settings(),   # the recorded run (bench/results/elastic_repro.json): no dense gate
    # the cpu preset with the pre-registered dense gate (to record next: NOT JUDGED seeds)
    "cpu_gated": Settings(dense_steps=2000, dense_gate=0.95, dense_check_every=100,
                          dense_schedule="constant"),
    # CI (tests/bench/test_elastic_repro.py, by default, ~20 CPU-s from its committed dense
    # model): a smaller body (4 keys x 4 values, 2 facts, 2 queries), one seed, the single arm
    # and the static control frozen. Its dense model keeps the recipe of the recorded CPU run it
    # is compared with (400 steps, cosine, no gate: that run predates the gate). With the gated
    # recipe (constant lr, gate 0.85, passed at step 400) the single arm's gap was 0.158 (>=
    # 0.15, the recorded verdict's other side): re-record the cpu run before moving ci to it
    "ci": Settings(num_keys=4, num_values=4, num_facts=2, num_queries=2, batch_size=16,
                   dense_steps=400, dense_gate=0.0, dense_check_every=400,
                   dense_schedule="cosine", router_steps=100, static_lrs=(), arms=("single",),
                   seeds=(0,), eval_rows=128, select_rows=128, log_every=100),
    "h100": Settings(seq_len=512, num_keys=32, num_values=32, num_facts=16, num_queries=4,
                     sink_pad=64, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
                     block=64, sinks=64, local=128, boundary=32, batch_size=64,
                     dense_steps=4000, dense_gate=0.95, dense_check_every=250,
                     dense_schedule="constant", dense_lrs=(3e-3, 1e-3), router_steps=1500,
                     static_lrs=(3e-4, 1e-3, 3e-3),
                     seeds=(0, 1, 2), ablation_seeds=3, eval_rows=2048, select_rows=1024,
                     log_every=500),
    "test": Settings(dense_steps=3, dense_gate=0.0, dense_check_every=2,
                     dense_schedule="constant", router_steps=5,
                     static_lrs=(1e-3,), arms=("single",), seeds=(0,), eval_rows=32,
                     select_rows=32, log_every=1),
}
# The need design (docs/schemes/elastic.md, "Need curve"): on the recorded task 1-2 FA heads
# recall 95-99% as a static split, the single target's whole budget, so no allocation can beat
# the static control. Here recall is two-hop (hops 2: no single head can answer, FA heads in two
# layers are needed), recall rows are 1 in 4 (recall_every 4) and the single target (the mean
# of the per-task targets) allows 1 FA head a row on average: every static split at that budget
# has ONE FA head (cannot recall), while an allocation giving recall rows 2-4 heads and recent
# rows none fits it (0.5-1 head a row). CRITERIA_NEED check both on each seed's dense model
# (the 'need' unit); the dense model gets bench/aha_repro.py's induction pretraining.
PRESETS["cpu_need"] = Settings(
    seq_len=128, num_keys=8, num_values=8, num_facts=3, num_queries=2, hops=2, recall_every=4,
    targets=(0.75, 1.0), pretrain_steps=300, dense_steps=3000, dense_gate=0.95,
    dense_check_every=250, dense_schedule="constant", router_steps=300,
    static_lrs=(1e-3, 3e-3), arms=("per_task", "single"), seeds=(0, 1, 2), ablation_seeds=3,
    eval_rows=512, select_rows=256, need_counts=(0, 1, 2, 4), need_sets=12, log_every=100)
# Its dense model does not learn two-hop recall on CPU (probes, not recorded; seed 0, one process
# on a shared 2-core host, gate = recall on the 256 selection rows, lr 3e-3 constant unless said):
# T 128 + 300 / 600 pretraining steps (repeats 0.05-0.09: no induction head) 0.40 -> 0.55 at
# steps 250-1750; T 80, training rows recall 1 in 2: 0.52 at 1000, 0.48 at 1200; the same at
# hidden 128: 0.28 at 400; + one-hop curriculum rows (half the training rows: the queried key's
# value fact keyed by the key itself) 0.56 at 1600; lr 1e-2: 0.53 at 1000; 4 layers (h100_need's
# depth): 0.49 at 1400 (0.55 at 1200); 4000 steps: 0.50-0.59
# from step 500 to 4000 (0.54 at 4000), recent 1.0 throughout. The plateau is consistent with a
# guess among the row's far values (not checked row by row), the slow phase of in-context
# two-hop learning. With 2 facts and 2 queries (T 80, 4 keys) it sat at 0.77-0.79: both facts
# are asked, so the second answer follows by elimination (keep num_queries < num_facts).
# The GPU run's first call (the dense units) is its learnability check (docs/schemes/elastic.md)
PRESETS["h100_need"] = Settings(
    seq_len=512, num_keys=32, num_values=32, num_facts=16, num_queries=4, sink_pad=64,
    num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, block=64, sinks=64, local=64,
    boundary=32, hops=2, recall_every=4, targets=(0.875, 1.0), batch_size=64,
    pretrain_steps=1500, dense_steps=4000, dense_gate=0.95, dense_check_every=250,
    dense_schedule="constant", dense_lrs=(3e-3, 1e-3), router_steps=1500,
    static_lrs=(3e-4, 1e-3, 3e-3), arms=("per_task", "single"), seeds=(0, 1, 2),
    ablation_seeds=3, eval_rows=2048, select_rows=1024, need_counts=(0, 1, 2, 4), need_sets=12,
    log_every=500)
PRESETS["tiny_need"] = Settings(
    seq_len=128, num_keys=8, num_values=8, num_facts=3, num_queries=2, hops=2, recall_every=4,
    targets=(0.75, 1.0), pretrain_steps=2, arms=PRESETS["h100_need"].arms, seeds=(0,),
    static_lrs=(1e-3,), batch_size=8, dense_steps=2, dense_gate=0.0, dense_check_every=2,
    dense_schedule="constant", router_steps=2, eval_rows=16, select_rows=16,
    need_counts=(0, 1, 2), need_sets=3, log_every=1)
# the GPU plan's dry run (bench/aha_elastic_gpu.py --tiny): h100's units of one seed (arms, static
# lrs), the cpu task and two steps each (the gate passes at once)
PRESETS["tiny"] = Settings(
    arms=PRESETS["h100"].arms, seeds=(0,), static_lrs=PRESETS["h100"].static_lrs,
    batch_size=8, dense_steps=2, dense_gate=0.0, dense_check_every=2,
    dense_schedule="constant", router_steps=2,
    eval_rows=16, select_rows=16, log_every=1)
FILES = {"cpu": "elastic_repro.json"}


class InstructedRecall:
  """The two tasks (module docstring); `batch(start, n, stream)` is a pure function of
  (seed, stream, start, n); rows alternate recall / recent."""

  def __init__(self, s: Settings, seed: int):
    self.s, self.seed = s, seed
    K, V = s.num_keys, s.num_values
    self.fact0 = 1
    self.query0 = self.fact0 + K * V
    self.answer0 = self.query0 + K
    self.filler0 = self.answer0 + V
    self.instr0 = self.filler0 + s.num_filler     # instruction per task
    self.marker0 = self.instr0 + len(TASKS)       # question marker per task
    self.link0 = self.marker0 + len(TASKS)        # hops 2: link tokens (k -> k'), K x K
    self.vocab_size = -(-(self.link0 + (K * K if s.hops == 2 else 0)) // 16) * 16
    T = s.seq_len
    if s.hops not in (1, 2) or s.recall_every < 2:
      raise ValueError("hops is 1 or 2, recall_every >= 2.")
    # hops 2: links in [sink_pad, link_end), value facts in [link_end + local + block, T / 2)
    self.link_end = s.sink_pad + (T // 2 - s.sink_pad - s.local - s.block) // 2
    if s.hops == 2 and (2 * s.num_facts > K or self.link_end - s.sink_pad < s.num_facts
                        or T // 2 - self.link_end - s.local - s.block < s.num_facts):
      raise ValueError("hops 2 does not fit: 2 num_facts <= num_keys, and num_facts links and "
                       "value facts each in (seq_len / 2 - sink_pad - local - block) / 2 slots.")
    self.end = 1 + 3 * s.num_queries              # marker + Q x (restated fact, query, answer)
    if s.num_queries > s.num_facts or s.sink_pad + s.num_facts > T // 2:
      raise ValueError("task does not fit: num_queries <= num_facts and sink_pad + num_facts "
                       "<= seq_len / 2.")
    if T - self.end - T // 2 < s.local + s.block or s.sinks > s.sink_pad:
      raise ValueError("the first facts must lie beyond SSA's reach: seq_len / 2 - "
                       f"{self.end} >= local + block and sinks <= sink_pad.")
    if self.end > s.local:
      raise ValueError("the restated facts must lie in the local window: 1 + 3 num_queries "
                       "<= local.")

  def example(self, rng, task: int):
    s, T = self.s, self.s.seq_len
    toks = self.filler0 + rng.integers(0, s.num_filler, T + 1)
    toks[0] = self.instr0 + task
    if s.hops == 1:
      keys = rng.choice(s.num_keys, s.num_facts, replace=False)
      first = rng.integers(0, s.num_values, s.num_facts)
      pos = rng.choice(np.arange(s.sink_pad, T // 2), s.num_facts, replace=False)
      toks[pos] = self.fact0 + keys * s.num_values + first
    else:   # link (k -> k') far from the value fact (k', v): recall needs two retrievals
      kk = rng.choice(s.num_keys, 2 * s.num_facts, replace=False)
      keys, dst = kk[:s.num_facts], kk[s.num_facts:]
      first = rng.integers(0, s.num_values, s.num_facts)    # v = value(link(k))
      lpos = rng.choice(np.arange(s.sink_pad, self.link_end), s.num_facts, replace=False)
      vpos = rng.choice(np.arange(self.link_end + s.local + s.block, T // 2), s.num_facts,
                        replace=False)
      toks[lpos] = self.link0 + keys * s.num_keys + dst
      toks[vpos] = self.fact0 + dst * s.num_values + first
    e = T - self.end + 1                    # token index of the marker (row has T + 1 tokens)
    toks[e] = self.marker0 + task
    mask = np.zeros(T, np.float32)
    for j, i in enumerate(rng.choice(s.num_facts, s.num_queries, replace=False)):
      recent = (first[i] + 1 + rng.integers(0, s.num_values - 1)) % s.num_values  # != first
      p = e + 1 + 3 * j
      toks[p] = self.fact0 + keys[i] * s.num_values + recent
      toks[p + 1] = self.query0 + keys[i]
      toks[p + 2] = self.answer0 + (first[i] if task == 0 else recent)
      mask[p + 1] = 1.0
    return dict(inputs=toks[:T].astype(np.int32), targets=toks[1:].astype(np.int32),
                loss_mask=mask, positions=np.arange(T, dtype=np.int32),
                segment_ids=np.ones(T, np.int32), prompt_lengths=np.int32(e + 3),
                task=np.int32(task))

  def batch(self, start: int, n: int, stream: int = 0) -> dict[str, np.ndarray]:
    ex = [self.example(np.random.default_rng([self.seed, stream, start + i]),
                       int((start + i) % self.s.recall_every != 0)) for i in range(n)]
    return {k: np.stack([e[k] for e in ex]) for k in ex[0]}


def base_config(s: Settings, task: InstructedRecall) -> ModelConfig:
  return ModelConfig(family="qwen3", qk_norm="head", vocab_size=task.vocab_size,
                     hidden_size=s.hidden_size, intermediate_size=2 * s.hidden_size,
                     num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                     head_dim=s.hidden_size // s.num_heads, rope_theta=10000.0,
                     attention_impl="reference" if jax.default_backend() == "cpu" else "auto")


def _with_task_ids(b: dict, single: bool) -> dict:
  b = dict(b)
  t = b.pop("task")
  b["task_ids"] = np.zeros_like(t) if single else t
  return b


_EVAL: dict = {}


def evaluate(cfg, params, rows: dict) -> dict[str, Any]:
  """Per task: scored-token accuracy; Elastic configs also Omega_MSR and the FA frequency per
  layer x KV head (eval: argmax decisions on the row's prompt)."""
  if cfg not in _EVAL:
    m = Decoder(cfg)
    elastic_cfg = cfg.scheme == "elastic"

    @jax.jit
    def f(params, b):
      fields = {"prompt_lengths": b["prompt_lengths"]} if elastic_cfg else None
      logits, aux = m.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"],
                            fields=fields)
      ok = (jnp.argmax(logits, -1) == b["targets"]).astype(jnp.float32) * b["loss_mask"]
      fa = aux["fa_BK"] if elastic_cfg else jnp.ones((1, b["inputs"].shape[0], 1))
      p_fa = aux["p_fa_BK"] if elastic_cfg else fa
      return ok.sum(1) / b["loss_mask"].sum(1), fa, p_fa
    _EVAL[cfg] = f
  f = _EVAL[cfg]
  oks, fas, ps = [], [], []
  n = len(rows["inputs"])
  for i in range(0, n, 128):
    b = {k: jnp.asarray(v[i:i + 128]) for k, v in rows.items() if k != "task"}
    ok, fa, p_fa = jax.device_get(f(params, b))
    oks.append(ok)
    fas.append(np.moveaxis(np.asarray(fa), 1, 0))                       # [B, L, K]
    ps.append(np.moveaxis(np.asarray(p_fa), 1, 0))                      # [B, L, K]
  ok, fa, p_fa = np.concatenate(oks), np.concatenate(fas), np.concatenate(ps)
  out: dict[str, Any] = {}
  for t, name in enumerate(TASKS):
    sel = rows["task"] == t
    out[name] = float(ok[sel].mean())
    if cfg.scheme == "elastic":
      out[f"omega_{name}"] = float(1.0 - fa[sel].mean())
      out[f"fa_freq_{name}"] = fa[sel].mean(0).round(4).tolist()
  out["min_accuracy"] = min(out[n] for n in TASKS)
  if cfg.scheme == "elastic":
    out["omega"] = float(1.0 - fa.mean())
    out["omega_gap"] = out["omega_recent"] - out["omega_recall"]
    out["fa_freq"] = fa.mean(0).round(4).tolist()
    out.update(saturation(p_fa))
  return out


SATURATED = 0.01


def saturation(p_fa) -> dict[str, Any]:
  """Router saturation of (row, layer, KV head) decisions from the noise-free class-1
  probabilities p_fa [B, L, K]: the fraction at 0 (p <= SATURATED) and at 1 (p >= 1 -
  SATURATED), their sum, and the mean |p - 0.5| per layer x KV head. A saturated router makes
  the same choice for every input (the Gumbel noise no longer flips it)."""
  p = np.asarray(p_fa, np.float64)
  at0, at1 = float((p <= SATURATED).mean()), float((p >= 1 - SATURATED).mean())
  return dict(p_fa_at_0=at0, p_fa_at_1=at1, p_fa_saturated=at0 + at1,
              p_fa_margin=np.abs(p - 0.5).mean(0).round(4).tolist())


def _elastic_cfg(s, cfg, arm, **extra):
  single = arm != "per_task"
  return dict(modes="fa_ssa", block=s.block, sinks=s.sinks, local=s.local, boundary=s.boundary,
              task_names=("any",) if single else TASKS,
              targets=(float(np.mean(s.targets)),) if single else tuple(s.targets),
              constraint="task_mean" if single else "sample",
              pooling="prompt_mean" if arm == "single_mean" else "boundary",
              lagrangian="abs" if arm == "single_abs" else "signed",
              anneal_steps=int(round(0.6 * s.router_steps)), **extra)


def _seed_data(s: Settings, seed: int):
  task = InstructedRecall(s, seed)
  return task, base_config(s, task), task.batch(0, s.eval_rows, stream=1), \
      task.batch(0, s.select_rows, stream=2)


def dense_unit(s: Settings, seed: int, store: rc.Store, log=print) -> dict[str, Any]:
  """The dense model, trained until its worst task's accuracy on the selection rows reaches
  s.dense_gate (checked every s.dense_check_every steps; warmup then a constant lr, so the
  model does not depend on the cap) or s.dense_steps (the cap), at each lr of s.dense_lrs in
  turn (its own sweep: the first lr whose model reaches the gate is kept; if none does, the one
  of the best last gate value, and the seed is NOT JUDGED). Saved as the store's 'dense' tree;
  with a work dir each lr's training state is saved at every check ('dense_state', then
  'dense_state_lr<i>') and a rerun goes on from it."""
  task, cfg, ev, sel = _seed_data(s, seed)
  init = jax.device_get(nn.unbox(Decoder(cfg).init(   # host copy: each lr starts from it
      jax.random.key(seed), jnp.zeros((1, s.seq_len), jnp.int32))["params"]))
  B = s.batch_size
  pre = None
  if s.pretrain_steps:   # induction pretraining (bench/aha_repro.py's), then the task's sweep
    from bench.aha_repro import repeat_batch
    init, pc = rc.train(cfg, init, rc.train_config(steps=s.pretrain_steps, lr=1e-3, seed=seed,
                                                   schedule="constant"),
                        lambda i: repeat_batch(task, seed, i, B), name=f"pretrain s{seed}",
                        log=log, log_every=s.log_every)
    init = jax.device_get(init)
    pre = dict(steps=s.pretrain_steps, curve=rc.thin(pc["accuracy"]))

  def gate(p):
    v = evaluate(cfg, p, sel)["min_accuracy"]
    return v >= s.dense_gate, v
  disk = store.work_dir is not None
  tries = []
  for i, lr in enumerate(s.dense_lrs or (s.dense_lr,)):
    tc = rc.train_config(steps=s.dense_steps, lr=lr, seed=seed, schedule=s.dense_schedule)
    name = "dense_state" + (f"_lr{i}" if i else "")
    dense, g = rc.train_to_gate(
        cfg, init, tc, lambda i: _with_task_ids(task.batch(i * B, B), True), gate,
        check_every=s.dense_check_every or s.dense_steps,
        resume=store.get_tree(name, missing_ok=True) if disk else None,
        save=(lambda st, name=name: store.put_tree(name, st)) if disk else None,
        budget_s=store.budget_s, name=f"dense s{seed} lr={lr}", log=log,
        log_every=s.log_every)
    tries.append((lr, dense, g))
    if g["passed"]:
      break
  lr, dense, g = max(tries, key=lambda t: (t[2]["passed"], t[2]["checks"][-1][1]))
  dense_np = jax.tree.map(np.asarray, dense)
  store.put_tree("dense", dense_np)
  out: dict[str, Any] = dict(seed=seed, dense=evaluate(cfg, dense_np, ev),
                             dense_curve=rc.thin(g["curve"]),
                             dense_gate=dict(threshold=s.dense_gate, passed=g["passed"],
                                             steps=g["steps"], checks=g["checks"]))
  if s.dense_lrs:   # the sweep's record (runs without a sweep keep their old layout)
    out["dense_gate"]["lr"] = lr
    out["dense_gate"]["tries"] = [dict(lr=x, passed=t["passed"], steps=t["steps"],
                                       last=t["checks"][-1][1]) for x, _, t in tries]
  if pre:
    out["pretrain"] = pre
  acfg, ap = convert(dense_np, cfg, "elastic", **_elastic_cfg(s, cfg, "single"))
  out["all_ssa"] = evaluate(configure(acfg, "elastic", routing="sa"), ap, ev)
  log(f"[s{seed}] dense {out['dense']} gate {'PASSED' if g['passed'] else 'FAILED: NOT JUDGED'}"
      f" at step {g['steps']} (lr {lr})")
  return out


def arm_unit(s: Settings, seed: int, arm: str, dense_np, log=print) -> dict[str, Any]:
  task, cfg, ev, _ = _seed_data(s, seed)
  B = s.batch_size
  groups = {"lagrange": dict(regex=LAGRANGE_REGEX, lr=s.lambda_lr, weight_decay=0.1)}
  router_tc = rc.train_config(steps=s.router_steps, lr=s.router_lr, seed=seed, warmup_frac=0.2,
                              end_lr_frac=0.0, weight_decay=0.1, grad_clip=5.0,
                              trainable=TRAINABLE_REGEX, groups=groups)
  ecfg, ep = convert(dense_np, cfg, "elastic", **_elastic_cfg(s, cfg, arm, seed=seed))
  single = arm != "per_task"
  ep, curves = rc.train(ecfg, ep, router_tc,
                        lambda i: _with_task_ids(task.batch(i * B, B, stream=10), single),
                        metrics=("accuracy", "elastic/omega_msr"), name=f"{arm} s{seed}",
                        log=log, log_every=s.log_every)
  r = evaluate(ecfg, ep, ev)
  r["plateau"] = {k: rc.plateau(v) for k, v in curves.items()}
  r["curves"] = {k: rc.thin(v) for k, v in curves.items()}
  r["lagrange"] = np.asarray(ep["scheme"]["lagrange"]).round(4).tolist()
  log(f"[{arm} s{seed}] " + json.dumps({k: v for k, v in r.items()
                                        if k not in ("curves", "fa_freq", "fa_freq_recall",
                                                     "fa_freq_recent", "p_fa_margin")}))
  return r


def units(s: Settings, seed: int) -> list[str]:
  """The seed's units: dense (with its gate), the arms (all but 'single' on the first
  `ablation_seeds` seeds), the static control (needs 'single')."""
  arms = [a for a in s.arms if a == "single" or seed in s.seeds[:s.ablation_seeds]]
  arms.sort(key=lambda a: a != "single")   # first: the static control reads it
  return ["dense"] + arms + (["static"] if "single" in arms else []) + \
      (["need"] if s.need_counts else [])


def run_unit(s: Settings, seed: int, unit: str, store: rc.Store, log=print) -> dict[str, Any]:
  if unit == "dense":
    return dense_unit(s, seed, store, log)
  if not store.get("dense")["dense_gate"]["passed"]:
    return dict(not_judged="the dense model did not reach the gate")
  dense_np = store.get_tree("dense")
  if unit == "need":
    _, cfg, ev, _ = _seed_data(s, seed)
    r = need_curve(s, cfg, dense_np, ev, s.need_counts, s.need_sets, seed)
    log(f"[need s{seed}] " + json.dumps({n: (v["best"], v["best_heads"]) for n, v in r.items()}))
    return dict(curve=r, **need_budgets(s))
  if unit == "static":
    task, cfg, ev, sel = _seed_data(s, seed)
    return static_control(s, cfg, dense_np, store.get("single"), task, ev, sel, seed, log)
  return arm_unit(s, seed, unit, dense_np, log)


def assemble(s: Settings, seed: int, store: rc.Store) -> dict[str, Any]:
  """The seed's record {seed, dense, dense_curve, dense_gate, all_ssa, arms, static}; a seed
  whose dense model missed the gate: judged False, no arms."""
  out = dict(store.get("dense"))
  if not out["dense_gate"]["passed"]:
    return dict(out, judged=False, arms={})
  u = units(s, seed)
  out["arms"] = {a: store.get(a) for a in s.arms if a in u}
  if "static" in u:
    out["static"] = store.get("static")
  if "need" in u:
    out["need"] = store.get("need")
  return out


BENCH = rc.Bench("elastic_repro", units, run_unit, assemble)


def static_control(s, cfg, dense_np, single, task, ev, sel, seed, log) -> dict[str, Any]:
  """The best static split with at least the single arm's FA budget: candidate head sets (the
  heads single routes FA most, overall and on recall rows; every set when there are <= 8),
  chosen on selection rows, frozen and fine-tuned (every weight, lrs s.static_lrs)."""
  L, K = s.num_layers, s.num_kv_heads
  n_fa = int(np.ceil(round((1.0 - single["omega"]) * L * K, 6)))
  n_fa = min(max(n_fa, 1), L * K)
  slots = [(l, k) for l in range(L) for k in range(K)]
  cands = []
  for key in ("fa_freq", "fa_freq_recall"):
    f = np.asarray(single[key]).reshape(-1)
    cands.append(tuple(sorted(slots[i] for i in np.argsort(-f, kind="stable")[:n_fa])))
  allsets = list(itertools.combinations(slots, n_fa))
  if len(allsets) <= 8:
    cands += allsets
  cands = list(dict.fromkeys(cands))

  def fixed_cfg(heads):
    per_layer = tuple(tuple(k for (l2, k) in heads if l2 == l) for l in range(L))
    base = _elastic_cfg(s, cfg, "single", seed=seed)
    c, p = convert(dense_np, cfg, "elastic", **base)
    return configure(c, "elastic", routing="fixed", fixed_fa_kv_heads=per_layer), p

  scored = []
  for heads in cands:
    c, p = fixed_cfg(heads)
    scored.append((evaluate(c, p, sel)["recall"], heads))
  best_sel, best = max(scored, key=lambda t: t[0])
  c, p = fixed_cfg(best)
  frozen = evaluate(c, p, ev)
  out = dict(fa_heads=n_fa, omega=1.0 - n_fa / (L * K), heads=[list(h) for h in best],
             candidates=len(cands), frozen=frozen, tuned={})
  B = s.batch_size
  best_tuned = None
  for lr in s.static_lrs:
    tc = rc.train_config(steps=s.router_steps, lr=lr, seed=seed,
                         groups={"lagrange": dict(regex=LAGRANGE_REGEX, lr=0.0)})
    tp, curves = rc.train(c, p, tc, lambda i: _with_task_ids(task.batch(i * B, B, stream=20),
                                                             True),
                          name=f"static lr={lr} s{seed}", log=log, log_every=s.log_every)
    r = evaluate(c, tp, ev)
    r["select_recall"] = evaluate(c, tp, sel)["recall"]
    r["plateau"] = {"accuracy": rc.plateau(curves["accuracy"])}
    r["curve"] = rc.thin(curves["accuracy"])
    out["tuned"][str(lr)] = r
    if best_tuned is None or r["select_recall"] > out["tuned"][best_tuned]["select_recall"]:
      best_tuned = str(lr)
  out["best_tuned_lr"] = best_tuned
  tuned_recall = out["tuned"][best_tuned]["recall"] if best_tuned else -1.0
  out["best_recall"] = max(frozen["recall"], tuned_recall)
  log(f"[static s{seed}] {n_fa} FA heads {best}: frozen {frozen['recall']:.3f}, tuned "
      f"{tuned_recall:.3f}")
  return out


def fixed_split(s, cfg, dense_np, heads, seed=0):
  """The dense model converted with a static head split: routing 'fixed', FA on the (layer, KV
  head) pairs of `heads`, SSA elsewhere (frozen: the dense weights)."""
  per_layer = tuple(tuple(k for (l2, k) in heads if l2 == l) for l in range(s.num_layers))
  c, p = convert(dense_np, cfg, "elastic", **_elastic_cfg(s, cfg, "single", seed=seed))
  return configure(c, "elastic", routing="fixed", fixed_fa_kv_heads=per_layer), p


def need_budgets(s) -> dict[str, int]:
  """FA heads (of num_layers x num_kv_heads) at the per-task recall target and at the single
  arm's one target (their mean)."""
  n = s.num_layers * s.num_kv_heads
  return dict(recall_budget=int(round((1.0 - s.targets[0]) * n)),
              single_budget=int(round((1.0 - float(np.mean(s.targets))) * n)))


def need_curve(s, cfg, dense_np, rows, counts, max_sets: int = 12, seed: int = 0):
  """How recall of a FROZEN static split depends on its number of FA heads: for each n in
  `counts`, the sets of n (layer, KV head) slots: every set when there are <= `max_sets`, else
  the n heads whose loss costs the dense model most recall (each head alone SSA, the rest FA),
  that set's best head per layer spread over the layers, and a random sample (a pure function
  of (seed, n)) up to `max_sets`; each evaluated on `rows`. {str(n): best / mean / worst
  recall, the best set and its recent accuracy, every set's (recall, recent, heads)}."""
  L, K = s.num_layers, s.num_kv_heads
  slots = [(l, k) for l in range(L) for k in range(K)]

  def ev(heads):
    c, p = fixed_split(s, cfg, dense_np, heads, seed)
    r = evaluate(c, p, rows)
    return r["recall"], r["recent"]
  cost = None
  out = {}
  for n in counts:
    allsets = list(itertools.combinations(slots, n))
    sets = allsets
    if len(allsets) > max_sets:
      if cost is None:   # recall lost with one head SSA, every other head FA
        cost = {h: -ev(tuple(x for x in slots if x != h))[0] for h in slots}
      order = sorted(slots, key=lambda h: -cost[h])   # stable: most costly first
      top = tuple(sorted(order[:n]))
      spread = tuple(sorted(_spread(order, n, L)))
      sets = list(dict.fromkeys([top, spread]))
      rest = [x for x in allsets if x not in sets]
      pick = np.random.default_rng([seed, 77, n]).choice(len(rest), max_sets - len(sets),
                                                         replace=False)
      sets += [rest[i] for i in sorted(pick)]
    res = [(*ev(h), h) for h in sets]
    rec = [x[0] for x in res]
    b = max(res, key=lambda x: x[0])
    out[str(n)] = dict(sets=len(sets), of=len(allsets), best=round(b[0], 4),
                       mean=round(float(np.mean(rec)), 4), worst=round(min(rec), 4),
                       best_heads=[list(h) for h in b[2]], best_recent=round(b[1], 4),
                       per_set=[[round(x[0], 4), round(x[1], 4), [list(h) for h in x[2]]]
                                for x in res])
  if cost is not None:
    out["drop_cost"] = [[l, k, round(cost[(l, k)], 4)] for (l, k) in slots]
  return out


def _spread(order, n, L):
  """n heads taken round-robin over the layers, each layer's in `order` (most costly first)."""
  per = [[h for h in order if h[0] == l] for l in range(L)]
  layers = sorted(range(L), key=lambda l: order.index(per[l][0]))
  out, i = [], 0
  while len(out) < n:
    l = layers[i % L]
    if per[l]:
      out.append(per[l].pop(0))
    i += 1
  return tuple(out)


def summarize(s: Settings, seeds: list[dict]) -> dict[str, Any]:
  """Means / spreads over seeds (`metrics`, the criteria's inputs) and the verdicts."""
  st = rc.seed_stats
  m: dict[str, Any] = {}
  spread: dict[str, Any] = {}

  def put(key, vals):
    spread[key] = st(vals)
    m[key] = spread[key]["mean"]

  gated = any("dense_gate" in r for r in seeds)   # runs before the gate lack it
  if gated:   # a seed whose dense model missed the pre-registered gate is NOT JUDGED
    m["judged_seeds"] = float(sum(r.get("judged", True) for r in seeds))
    seeds = [r for r in seeds if r.get("judged", True)]
  for k in ("recall", "recent", "min_accuracy"):
    put(f"dense.{k}", [r["dense"][k] for r in seeds])
    put(f"all_ssa.{k}", [r["all_ssa"][k] for r in seeds])
  for arm in s.arms:
    for k in ("recall", "recent", "omega", "omega_recall", "omega_recent", "omega_gap"):
      put(f"{arm}.{k}", [r["arms"][arm][k] for r in seeds if arm in r["arms"]])
    ran = [r["arms"][arm] for r in seeds if arm in r["arms"]]
    if ran and all("p_fa_saturated" in a for a in ran):  # runs before it was recorded lack it
      put(f"{arm}.p_fa_saturated", [a["p_fa_saturated"] for a in ran])
  if "single" in s.arms:
    put("static.omega", [r["static"]["omega"] for r in seeds])
    put("static.frozen_recall", [r["static"]["frozen"]["recall"] for r in seeds])
    put("static.best_recall", [r["static"]["best_recall"] for r in seeds])
    put("single_minus_static_recall_points",
        [100 * (r["arms"]["single"]["recall"] - r["static"]["best_recall"]) for r in seeds])
  if s.need_counts:
    for key, b in (("at_single_budget", "single_budget"), ("at_recall_budget", "recall_budget")):
      put(f"need.{key}", [r["need"]["curve"][str(r["need"][b])]["best"] for r in seeds
                          if str(r["need"][b]) in r["need"]["curve"]])
  flags_ = [p["at_plateau"] for r in seeds for a in r["arms"].values()
            for p in a["plateau"].values()]
  m["plateau_fraction"] = float(np.mean(flags_)) if flags_ else 0.0
  return dict(metrics=m, spread=spread, criteria=rc.judge(criteria(s), m))


def criteria(s: Settings) -> dict:
  """The criteria a run of `s` registers: CRITERIA, and CRITERIA_NEED for the need presets."""
  return dict(CRITERIA, **CRITERIA_NEED) if s.need_counts else CRITERIA


def run(s: Settings, log=print, done: list[dict] | None = None) -> dict[str, Any]:
  """Train and judge every seed of `s`; with `done` (the seeds' results, in s.seeds' order) only
  judge them."""
  t0 = time.time()
  seeds = list(done) if done is not None else rc.run_seeds(BENCH, s, "run", log)
  summ = summarize(s, seeds)
  judged = summ["metrics"].get("judged_seeds", len(seeds))
  for name, c in summ["criteria"].items():
    verdict = "NOT JUDGED" if not judged else ("PASS" if c["passed"] else "FAIL")
    log(f"criterion {name}: {verdict} ({c['metric']} = {c['got']} {c['op']} {c['value']})")
  if judged < len(seeds):
    log(f"NOT JUDGED: {len(seeds) - int(judged)} of {len(seeds)} seeds (dense below the gate "
        f"{s.dense_gate}): " + ", ".join(str(r["seed"]) for r in seeds
                                         if not r.get("judged", True)))
  return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
              jax_version=jax.__version__, seconds=round(time.time() - t0, 1),
              settings=json.loads(json.dumps(dataclasses.asdict(s))),
              task=dict(names=TASKS, sensitive="recall", robust="recent",
                        vocab_size=InstructedRecall(s, 0).vocab_size),
              **summ, seeds=seeds)


FLAGS = common.flag_values()
rc.define_flags(FLAGS, PRESETS, "docs/schemes/elastic.md")


def main(argv=None):
  return rc.main("elastic_repro", FLAGS, PRESETS, FILES, run, argv, parts=BENCH)


if __name__ == "__main__":
  main()
