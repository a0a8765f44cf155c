"""Elastic Attention fidelity on a synthetic task mix: per-task sparsity (Omega_MSR) and
retrieval accuracy against the dense model (docs/schemes/elastic.md; paper Sec. 2.2 / Table 1).

    python -m bench.elastic_tasks                  # CPU preset -> bench/results/elastic_tasks.json
    python -m bench.elastic_tasks --preset=test --out_dir=/tmp/e   # /tmp/e/elastic_tasks_<device>.json

Tasks (generated here, numpy only; every row is ONE task and carries its task name, mapped to a
task id with `elastic.task_ids`, which rejects unknown names):
  retrieval (sparsity-sensitive, target 0.7): a row of T tokens holds F one-token facts
    (id = fact0 + k * V + v: key k, value v) at random positions in [sink_pad, T/2), filler
    elsewhere, and Q queries (query0 + k) in the last quarter, each followed by its answer
    (answer0 + v), the only scored targets. Every fact is >= T/4 tokens before every query, far
    beyond SSA's sinks + local window (the first sink_pad tokens are filler, so sinks hold no
    fact): an SSA head cannot answer, an FA head can.
  local (sparsity-robust, target 1.0): segments of seg_min..seg_max tokens, each a fresh random
    p-gram (p in [p_min, p_max], p <= the local window; its own token range) repeated; targets
    in the last `local_scored` positions that repeat the token p back in their own segment are
    scored: only the recent past predicts them (older segments mislead), SSA's local window
    suffices.
Experiment: (1) a small dense Qwen3-shaped decoder learns the mix; (2) it is converted
(`attention.convert(..., "elastic")`, FA-SSA, fresh router) and only the router (task MLP + router MLP)
and the per-task Lagrange multipliers train (multipliers by gradient ascent), the recipe's loss
(CE + Lagrangian) through the project's train step; (3) held-out rows: answer accuracy per task
for dense, Elastic (eval: argmax, no noise) and every head SSA (what sparsity alone costs);
Omega_MSR / Omega_ESR per task; the FA frequency per layer x head per task.
Written: settings, task, date, device, jax version, every number above.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402
from bench import aha_elastic_repro_common as rc  # noqa: E402
from bench import common  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from condattn_jax.attention import configure, convert, elastic  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("retrieval", "local")


@dataclasses.dataclass
class Settings:
  # tasks
  seq_len: int = 128
  num_keys: int = 8
  num_values: int = 8
  num_facts: int = 8
  num_queries: int = 4
  num_filler: int = 16
  sink_pad: int = 8
  local_vocab: int = 16
  p_min: int = 3
  p_max: int = 6
  seg_min: int = 16
  seg_max: int = 32
  local_scored: int = 32
  targets: tuple = (0.7, 1.0)
  # model (MHA: 8 heads over 2 layers, Omega in steps of 1/8)
  num_layers: int = 2
  hidden_size: int = 64
  num_heads: int = 4
  num_kv_heads: int = 4
  # Elastic (SSA scaled to T: 1 sink block + 2 local blocks of 8)
  block: int = 8
  sinks: int = 8
  local: int = 16
  boundary: int = 16
  # training
  batch_size: int = 32
  dense_steps: int = 600
  dense_lr: float = 3e-3
  router_steps: int = 300
  router_lr: float = 3e-3
  lambda_lr: float = 1e-3
  eval_rows: int = 512
  seed: int = 0
  log_every: int = 100


PRESETS = {
    "cpu": Settings(),
    "test": Settings(seq_len=64, num_facts=4, num_queries=2, batch_size=8, dense_steps=3,
                     router_steps=3, eval_rows=16, log_every=1, block=4, sinks=4, local=8,
                     boundary=4, p_max=4, seg_min=8, seg_max=12, local_scored=16),
}


class TaskMix:
  """Rows alternate retrieval / local; `batch(start, n, stream)` is a pure function of
  (seed, stream, start, n). Each example carries its task name ('task')."""

  def __init__(self, s: Settings):
    self.s = s
    K, V = s.num_keys, s.num_values
    self.fact0 = 1
    self.query0 = self.fact0 + K * V
    self.answer0 = self.query0 + K
    self.filler0 = self.answer0 + V
    self.local0 = self.filler0 + s.num_filler
    self.vocab_size = -(-(self.local0 + s.local_vocab) // 16) * 16
    T = s.seq_len
    if s.sink_pad + s.num_facts > T // 2 or 2 * s.num_queries > T // 4:
      raise ValueError("task does not fit: raise seq_len or lower num_facts / num_queries.")
    if T // 4 < s.local + s.block or s.sinks > s.sink_pad:
      raise ValueError("facts must lie beyond SSA's reach: seq_len / 4 >= local + block and "
                       "sinks <= sink_pad.")
    if s.p_max > s.local - s.block:
      raise ValueError("local periods must fit SSA's local window: p_max <= local - block.")

  def retrieval(self, rng):
    s, T = self.s, self.s.seq_len
    toks = self.filler0 + rng.integers(0, s.num_filler, T + 1)
    mask = np.zeros(T, np.float32)
    keys = rng.choice(s.num_keys, s.num_facts, replace=False)
    vals = rng.integers(0, s.num_values, s.num_facts)
    pos = rng.choice(np.arange(s.sink_pad, T // 2), s.num_facts, replace=False)
    toks[pos] = self.fact0 + keys * s.num_values + vals
    asked = rng.choice(s.num_facts, s.num_queries, replace=False)
    slots = rng.choice(np.arange(3 * T // 4, T, 2), s.num_queries, replace=False)
    toks[slots] = self.query0 + keys[asked]
    toks[slots + 1] = self.answer0 + vals[asked]
    mask[slots] = 1.0
    return toks, mask

  def local(self, rng):
    """Segments of seg_min..seg_max tokens, each a fresh random p-gram repeated; a target is
    scored (within the last local_scored positions) when it repeats the token p back in its
    own segment: only the recent past predicts it (older segments mislead)."""
    s, T = self.s, self.s.seq_len
    toks = np.zeros(T + 1, np.int64)
    ok = np.zeros(T + 1, bool)                              # token predictable from p back
    start = 0
    while start <= T:
      n = int(rng.integers(s.seg_min, s.seg_max + 1))
      p = int(rng.integers(s.p_min, s.p_max + 1))
      seg = np.resize(self.local0 + rng.integers(0, s.local_vocab, p), n)
      stop = min(start + n, T + 1)
      toks[start:stop] = seg[:stop - start]
      ok[start + p:stop] = True
      start = stop
    mask = np.zeros(T, np.float32)
    mask[T - s.local_scored:] = ok[1:][T - s.local_scored:]
    return toks, mask

  def example(self, rng, task: str):
    toks, mask = self.retrieval(rng) if task == "retrieval" else self.local(rng)
    T = self.s.seq_len
    return dict(inputs=toks[:T].astype(np.int32), targets=toks[1:].astype(np.int32),
                loss_mask=mask, positions=np.arange(T, dtype=np.int32),
                segment_ids=np.ones(T, np.int32), task=task)

  def batch(self, start: int, n: int, stream: int = 0) -> dict[str, np.ndarray]:
    ex = [self.example(np.random.default_rng([self.s.seed, stream, start + i]),
                       TASKS[(start + i) % 2]) for i in range(n)]
    out = {k: np.stack([e[k] for e in ex]) for k in ex[0] if k != "task"}
    out["task_ids"] = elastic.task_ids([e["task"] for e in ex], TASKS)
    return out


def base_config(s: Settings, mix: TaskMix) -> ModelConfig:
  return ModelConfig(family="qwen3", qk_norm="head", vocab_size=mix.vocab_size,
                     hidden_size=s.hidden_size, intermediate_size=2 * s.hidden_size,
                     num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                     head_dim=s.hidden_size // s.num_heads, rope_theta=10000.0,
                     attention_impl="reference")


def _recipe():
  import importlib.util
  spec = importlib.util.spec_from_file_location("_elastic_recipe",
                                                os.path.join(ROOT, "configs", "elastic_qwen.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def train(cfg, params, s: Settings, mix: TaskMix, *, steps, lr, trainable=None, groups=None,
          phase=0, name="", log=print):
  """`steps` steps of the project's train step through the AHA / Elastic benches' runner
  (`rc.train`; constant lr, clip 5, no weight decay); returns (params, history: rows {step, ce,
  accuracy[, msr/<task>, tau, lambda1, lambda2]} every `log_every` steps)."""
  tc = rc.train_config(steps=steps, lr=lr, seed=s.seed, warmup_frac=0.0, schedule="constant",
                       end_lr_frac=1.0, grad_clip=5.0, weight_decay=0.0, trainable=trainable,
                       groups=groups)
  extra = (tuple(f"elastic/msr/{t}" for t in TASKS) + ("elastic/tau", "elastic/lambda1",
                                                         "elastic/lambda2")
           if cfg.scheme == "elastic" else ())
  params, curves = rc.train(cfg, params, tc,
                            lambda i: mix.batch(phase * 10_000_000 + i * s.batch_size,
                                                s.batch_size),
                            metrics=("ce", "accuracy") + extra, name=name, log=log,
                            log_every=s.log_every)
  hist = []
  for row in rc.history(curves, s.log_every):
    out = {}
    for k, v in row.items():
      k = k.split("/", 1)[1] if k.startswith("elastic/") else k
      out[k] = np.round(v, 4).tolist() if k.startswith("lambda") else v
    hist.append(out)
  return params, hist


def accuracy(cfg, params, batches) -> dict[str, float]:
  """Scored-token accuracy per task (eval forward)."""
  m = Decoder(cfg)

  @jax.jit
  def f(params, b):
    logits, _ = m.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"])
    ok = (jnp.argmax(logits, -1) == b["targets"]).astype(jnp.float32) * b["loss_mask"]
    return ok.sum(axis=1), b["loss_mask"].sum(axis=1)

  num, den = np.zeros(len(TASKS)), np.zeros(len(TASKS))
  for b in batches:
    ok, n = jax.device_get(f(params, jax.tree.map(jnp.asarray, b)))
    for t in range(len(TASKS)):
      sel = b["task_ids"] == t
      num[t] += ok[sel].sum()
      den[t] += n[sel].sum()
  return {name: float(num[t] / max(den[t], 1)) for t, name in enumerate(TASKS)}


def run(s: Settings, log=print) -> dict[str, Any]:
  t_start = time.time()
  mix = TaskMix(s)
  cfg = base_config(s, mix)
  tok = jnp.zeros((1, s.seq_len), jnp.int32)
  params = nn.unbox(Decoder(cfg).init(jax.random.key(s.seed), tok)["params"])
  ev = [mix.batch(i, min(256, s.eval_rows), stream=1)
        for i in range(0, s.eval_rows, min(256, s.eval_rows))]
  dense, dense_hist = train(cfg, params, s, mix, steps=s.dense_steps, lr=s.dense_lr, phase=0,
                            name="dense", log=log)
  dense_acc = accuracy(cfg, dense, ev)
  log(f"dense accuracy {dense_acc}")
  ecfg, ep = convert(
      jax.tree.map(np.asarray, dense), cfg, "elastic", modes="fa_ssa", task_names=TASKS,
      targets=tuple(s.targets), block=s.block, sinks=s.sinks, local=s.local,
      boundary=s.boundary, anneal_steps=int(round(0.6 * s.router_steps)), seed=s.seed)
  sa_acc = accuracy(configure(ecfg, "elastic", routing="sa"), ep, ev)
  log(f"every head SSA: accuracy {sa_acc}")
  rec = _recipe()
  # the ascent on the multipliers is the scheme's declaration (Scheme.ascent_params)
  groups = {"lagrange": dict(regex=rec.LAGRANGE_REGEX, lr=s.lambda_lr, weight_decay=0.1)}
  ep, el_hist = train(ecfg, ep, s, mix, steps=s.router_steps, lr=s.router_lr,
                      trainable=rec.TRAINABLE_REGEX, groups=groups, phase=1, name="elastic",
                      log=log)
  el_acc = accuracy(ecfg, ep, ev)
  meas = elastic.measure(Decoder(ecfg), ep, ev)
  log(f"elastic accuracy {el_acc}; Omega_MSR "
      f"{ {k: round(v['omega_msr'], 3) for k, v in meas['tasks'].items()} }")
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
      jax_version=jax.__version__, seconds=round(time.time() - t_start, 1),
      settings=dataclasses.asdict(s),
      task=dict(names=TASKS, targets=list(s.targets), vocab_size=mix.vocab_size,
                description="retrieval: one-token facts in [sink_pad, T/2), queries in the last "
                            "quarter (beyond SSA's reach); local: repeated p-gram, p <= local "
                            "window"),
      dense_accuracy=dense_acc, all_ssa_accuracy=sa_acc, elastic_accuracy=el_acc,
      retrieval_gap_points=round(100 * (dense_acc["retrieval"] - el_acc["retrieval"]), 2),
      omega_msr={k: v["omega_msr"] for k, v in meas["tasks"].items()},
      omega_esr={k: v["omega_esr"] for k, v in meas["tasks"].items()},
      fa_freq={k: v["fa_freq"] for k, v in meas["tasks"].items()},
      lagrange=np.asarray(ep["scheme"]["lagrange"]).tolist(),
      dense_history=dense_hist, elastic_history=el_hist)


# result file of the recorded preset (others: <out_dir>/elastic_tasks_<device>.json)
FILES = {"cpu": "elastic_tasks.json"}
FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "cpu", sorted(PRESETS), "task size (test: seconds, for tests)",
                  flag_values=FLAGS)


def main(argv=None):
  a = common.parse_flags(FLAGS, argv)
  res = run(PRESETS[a.preset])
  out = common.result_path("elastic_tasks", a.out_dir, fixed=FILES.get(a.preset))
  common.write_result(out, "elastic_tasks", res, name=a.preset)
  print(f"wrote {out}")
  return res


if __name__ == "__main__":
  main()
