r"""L2A learning experiment on MQAR (multi-query associative recall), end to end.

  python bench/l2a_learning.py                       # full run -> bench/results/l2a_learning.json
  python bench/l2a_learning.py --preset=cpu --dense_params=tests/fixtures/l2a/mqar_dense.npz \
                                                     # the CPU-sized run (~4 min, 2 cores) ->
                                                     # bench/results/l2a_learning_cpu.json
  python bench/l2a_learning.py --preset=demo --dense_params=tests/fixtures/l2a/mqar_dense.npz
                                                     # what `make demo` runs (scripts/demo.py)

1. dense: a tiny qwen2-style decoder learns MQAR with full attention (all params trained);
2. convert: `attention.convert(..., "l2a")` (local window w << T, both branches copied, zero router) and train
   with the L2A recipe: trainable = attention + norms + router (FFN / embeddings frozen),
   CE + lambda * mean p^2 (warmup then linear ramp), forced-global steps p_force, STE router;
3. evaluate on held-out examples (the eval stream): answer-token accuracy and per-layer sparsity
   at theta (and a theta sweep);
4. baselines from the same dense checkpoint, same recipe and steps: the context-free router of
   the paper (each token global with Bernoulli q = the L2A model's global fraction, i.e. the same
   sparsity), local attention only (global branch off), and dense continued training;
5. post-training pruning (layers with sparsity >= 0.95) with KV-cache bytes before / after.

The MQAR settings put every query key more than L*(w-1) tokens after every key-value pair
(min_gap >= L * w), so local attention alone cannot answer: the global branch is needed exactly at
the query keys. Uses the project's train step (`condattn_jax.train.step.make_train_step`), optimizer
(the L2A recipe's trainable regex, configs/l2a_qwen.py) and the scheme registry; batches come
straight from the MQAR generator.

The phases are functions that `scripts/demo.py` reuses: `Data`, `base_config`, `dense_model`,
`convert`, `train_l2a` (conversion + recipe training, any routing), `evaluate`, `theta_sweep`,
`pruning`; `run_experiment` chains them.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
from absl import flags  # noqa: E402
from bench import common  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from condattn_jax.attention import l2a  # noqa: E402
from condattn_jax.attention import configure, options  # noqa: E402
from condattn_jax.attention import convert as convert_to_scheme  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models import stacking  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402
from condattn_jax.train import optimizer as opt_lib  # noqa: E402
from condattn_jax.train.state import TrainState  # noqa: E402
from condattn_jax.train.step import make_train_step  # noqa: E402



def _recipe_trainable_regex() -> str:
  """What the L2A recipe trains (configs/l2a_qwen.py TRAINABLE_REGEX: attention, norms, router;
  FFN and embeddings frozen), read from the recipe so that the two never diverge."""
  spec = importlib.util.spec_from_file_location("_l2a_recipe",
                                                os.path.join(ROOT, "configs", "l2a_qwen.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.TRAINABLE_REGEX


L2A_TRAINABLE = _recipe_trainable_regex()
ROUTER_REGEX = r"(.*/)?router/kernel"  # the router's own learning rate (a param group)


def _synthetic():
  """condattn_jax.data.synthetic (numpy only) without the grain pipeline when grain is absent."""
  try:
    from condattn_jax.data import synthetic
    return synthetic
  except ImportError:
    spec = importlib.util.spec_from_file_location(
        "_mqar_synthetic", os.path.join(ROOT, "condattn_jax", "data", "synthetic.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass
class Settings:
  # task: 4 pairs, queries >= min_gap + 1 = 9 tokens after every pair
  seq_len: int = 32
  vocab_size: int = 32
  num_pairs: int = 4
  min_gap: int = 8
  # model: 2 layers, window 4 (num_layers * window <= min_gap: local attention cannot answer)
  num_layers: int = 2
  hidden_size: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  window: int = 4
  # training
  batch_size: int = 64
  dense_steps: int = 16000
  dense_lr: float = 3e-3
  l2a_steps: int = 16000
  l2a_lr: float = 2e-3
  router_lr: float | None = 1e-4  # None: same as l2a_lr (a param group of the optimizer)
  warmup_frac: float = 0.05
  lambda_max: float = 0.05
  lambda_schedule: str = "ramp"
  lambda_ramp_frac: float = 0.5
  lambda_warmup_frac: float | None = None  # lambda = 0 for this fraction (None: warmup_frac)
  p_force: float = 0.1
  tau: float = 0.1
  theta: float = 0.5
  thetas: tuple = (0.3, 0.5, 0.7, 0.9)
  eval_examples: int = 1024
  seed: int = 0
  attention_impl: str = "reference"
  compact_impl: str = "auto"
  baselines: tuple = ("context_free", "local_only", "dense_continued")
  log_every: int = 250


PRESETS = {
    "full": Settings(),
    # The CPU-sized run (bench/results/l2a_learning_cpu.json): the full preset's task and model
    # (its dense model comes from a fixture made by the full run), shorter L2A / context-free
    # phases.
    "cpu": Settings(l2a_steps=1200, l2a_lr=3e-3, eval_examples=512, thetas=(0.5,),
                    baselines=("context_free",), log_every=300),
    # `make demo` (scripts/demo.py): the same task and dense model, local window 1 (each token
    # sees only itself locally: the conversion damage is undone in a few hundred steps, where
    # window 4 needs thousands), batch 32, more forced-global steps (0.3), lambda held at 0 for
    # the first 20% of the steps. About 2 minutes on 2 idle CPU cores.
    "demo": Settings(window=1, batch_size=32, l2a_steps=600, l2a_lr=3e-3, p_force=0.3,
                     lambda_warmup_frac=0.2, eval_examples=512, thetas=(0.5, 0.7),
                     baselines=("context_free", "local_only"), log_every=100),
}


class _TC(dict):
  """The `train` section the project's optimizer / step read (attribute + .get access)."""
  __getattr__ = dict.__getitem__


def _train_config(s: Settings, steps: int, lr: float, trainable: str | None, groups=None) -> _TC:
  return _TC(num_steps=steps, lr=lr, warmup_frac=s.warmup_frac, warmup_steps=None,
             lr_schedule="cosine", end_lr_frac=0.1, grad_clip=1.0, weight_decay=0.0, b1=0.9,
             b2=0.95, eps=1e-8, trainable_regex=trainable, param_groups=groups or {},
             seed=s.seed, microbatches=1, loss_chunk_size=0)


class Data:
  def __init__(self, s: Settings):
    syn = _synthetic()
    self.task = syn.MQAR(seq_len=s.seq_len, vocab_size=s.vocab_size, num_pairs=s.num_pairs,
                         min_gap=s.min_gap)
    self.s = s
    self.eval = self._batch(0, s.eval_examples, stream=1)

  def _batch(self, start, n, stream=0):
    ex = [self.task.example(self.s.seed, start + i, stream) for i in range(n)]
    return {k: np.stack([e[k] for e in ex]) for k in ex[0]}

  def train_batch(self, step, phase):
    # phase offsets keep the phases' example streams apart (no example is reused across phases)
    B = self.s.batch_size
    return self._batch((phase * 10_000_000) + step * B, B)


def base_config(s: Settings) -> ModelConfig:
  return ModelConfig(family="qwen2", vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                     intermediate_size=2 * s.hidden_size, num_layers=s.num_layers,
                     num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                     head_dim=s.hidden_size // s.num_heads, attention_bias=True,
                     rope_theta=10000.0, attention_impl=s.attention_impl)


def l2a_options(s: Settings, **kw) -> dict:
  steps = s.l2a_steps
  frac = s.warmup_frac if s.lambda_warmup_frac is None else s.lambda_warmup_frac
  warm = int(round(frac * steps))
  opts = dict(window=s.window, tau=s.tau, theta=s.theta, p_force=s.p_force,
              lambda_max=s.lambda_max, lambda_schedule=s.lambda_schedule,
              lambda_warmup_steps=warm, lambda_ramp_steps=int((steps - warm) * s.lambda_ramp_frac),
              compact_impl=s.compact_impl)
  opts.update(kw)
  return opts


def model_params(params, cfg: ModelConfig):
  """`params` (per-layer `layers_{i}` as in tests/fixtures/l2a/mqar_dense.npz, or stacked) in
  the layout the Decoder of `cfg` expects."""
  return stacking.to_model_layout(params, cfg)


def train(cfg: ModelConfig, params, s: Settings, data: Data, *, steps: int, lr: float,
          trainable: str | None, phase: int, name: str, groups=None, log=print):
  """`steps` steps of the project's train step on MQAR batches of `phase`'s stream.
  Returns (params on the host, history rows every s.log_every steps, seconds)."""
  params = model_params(params, cfg)
  tc = _train_config(s, steps, lr, trainable, groups)
  tx, labels, schedule = opt_lib.make_optimizer(tc, params)
  step_fn = jax.jit(make_train_step(cfg, tc, tx, labels, schedule), donate_argnums=(0,))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  t0 = time.time()
  history = []
  acc = []
  for i in range(steps):
    state, m = step_fn(state, jax.tree.map(jnp.asarray, data.train_batch(i, phase)))
    acc.append(m["accuracy"])
    if (i + 1) % s.log_every == 0 or i + 1 == steps:
      m = jax.device_get(m)
      row = dict(step=i + 1, train_accuracy=float(np.mean(jax.device_get(acc))),
                 loss=float(m["loss"]), ce=float(m["ce"]))
      for k in ("l2a/sparsity", "l2a/router_p", "l2a/lambda", "l2a/forced_frac"):
        if k in m:
          row[k.split("/")[1]] = float(m[k])
      acc = []
      history.append(row)
      log(f"[{name}] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in row.items()) + f" ({time.time() - t0:.0f}s)")
  return jax.device_get(state.params), history, time.time() - t0


_EVAL_STEPS: dict[ModelConfig, Any] = {}


def _eval_step(cfg: ModelConfig):
  """The jitted held-out step of `evaluate`, one per config: an experiment evaluates the same
  config several times (the converted and the trained L2A model, theta = the trained one's),
  which then compiles once."""
  if cfg not in _EVAL_STEPS:
    model = Decoder(cfg)

    @jax.jit
    def f(params, b):
      logits, aux = model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"])
      ok = (jnp.argmax(logits, -1) == b["targets"]).astype(jnp.float32) * b["loss_mask"]
      out = dict(correct=ok.sum(), scored=b["loss_mask"].sum())
      if aux:
        out["glob"] = aux["global_tokens_B"].sum(axis=1)
        out["tok"] = aux["tokens_B"].sum(axis=1)
      return out
    _EVAL_STEPS[cfg] = f
  return _EVAL_STEPS[cfg]


def evaluate(cfg: ModelConfig, params, data: Data, batch: int = 256) -> dict[str, Any]:
  """Answer-token accuracy and per-layer sparsity on the held-out examples (train=False)."""
  params = model_params(params, cfg)
  f = _eval_step(cfg)
  sums: dict[str, Any] = {}
  n = data.eval["inputs"].shape[0]
  for i in range(0, n, batch):
    b = jax.tree.map(lambda x: jnp.asarray(x[i:i + batch]), data.eval)
    for k, v in jax.device_get(f(params, b)).items():
      sums[k] = sums.get(k, 0) + np.asarray(v, np.float64)
  res = {"accuracy": float(sums["correct"] / sums["scored"])}
  if "glob" in sums:
    layer = 1.0 - sums["glob"] / np.maximum(sums["tok"], 1)
    opts = options(cfg)
    live = [i for i in range(cfg.num_layers) if i not in opts.pruned_layers]
    res["layer_sparsity"] = [float(x) for x in layer]
    res["sparsity"] = float(np.mean(layer[live])) if live else 1.0
    # the fraction of (token, layer) decisions that run global attention, all layers counted
    res["global_fraction"] = float(np.mean(1.0 - layer))
  return res


ROLES = ("pair key", "pair value", "query key", "query value", "filler")


def token_roles(task, inputs_BT) -> np.ndarray:
  """Role index (into ROLES) of every MQAR input token: keys come from [1, V/2), values from
  [V/2, V), filler is 0; pairs sit before `task.query_start`, queries from there on."""
  inputs_BT = np.asarray(inputs_BT)
  query = np.arange(inputs_BT.shape[1])[None, :] >= task.query_start
  key = (inputs_BT >= 1) & (inputs_BT < task.vocab_size // 2)
  value = inputs_BT >= task.vocab_size // 2
  roles = np.full(inputs_BT.shape, ROLES.index("filler"), np.int32)
  roles[key & ~query] = ROLES.index("pair key")
  roles[value & ~query] = ROLES.index("pair value")
  roles[key & query] = ROLES.index("query key")
  roles[value & query] = ROLES.index("query value")
  return roles


def global_rate_by_role(cfg: ModelConfig, params, data: Data, batch: int = 256
                        ) -> list[dict[str, float]]:
  """What the router learned: per layer, the fraction of held-out tokens of each role (ROLES)
  that run global attention (the layers' sown `decision`s, stacked on the layer axis)."""
  model = Decoder(cfg)
  params = model_params(params, cfg)

  @jax.jit
  def decisions(params, b):
    _, state = model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"],
                           mutable=["intermediates"])
    found = [x for p, x in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
             if "decision" in jax.tree_util.keystr(p)]
    if not found:
      raise ValueError("the L2A layers sowed no 'decision' intermediates.")
    return jnp.concatenate([d.reshape((-1,) + d.shape[-2:]) for d in found])  # [L, B, T]

  L = cfg.num_layers
  hits, counts = np.zeros((L, len(ROLES))), np.zeros((L, len(ROLES)))
  n = data.eval["inputs"].shape[0]
  for i in range(0, n, batch):
    b = jax.tree.map(lambda x: jnp.asarray(x[i:i + batch]), data.eval)
    d_LBT = np.asarray(jax.device_get(decisions(params, b)), bool)
    roles = token_roles(data.task, data.eval["inputs"][i:i + batch])
    for r in range(len(ROLES)):
      sel = roles == r
      counts[:, r] += sel.sum()
      hits[:, r] += (d_LBT & sel[None]).sum(axis=(1, 2))
  return [{role: float(hits[l, r] / counts[l, r]) for r, role in enumerate(ROLES)
           if counts[l, r]} for l in range(L)]


def save_params(params, path: str) -> None:
  """Flat npz: '/'-joined param paths -> arrays."""
  flat = {opt_lib.path_str(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  np.savez_compressed(path, **flat)


def load_params(path: str) -> dict:
  out: dict = {}
  with np.load(path) as f:
    for k in f.files:
      node = out
      parts = k.split("/")
      for part in parts[:-1]:
        node = node.setdefault(part, {})
      node[parts[-1]] = f[k]
  return out


def dense_model(s: Settings, data: Data, cfg: ModelConfig, dense_params: str | None = None,
                log=print):
  """(dense params, history, seconds): loaded from `dense_params` (an npz of `save_params`) or
  trained with full attention (all params) for s.dense_steps."""
  if dense_params:
    if not os.path.exists(dense_params):
      raise FileNotFoundError(f"dense_params={dense_params}: no such file (the dense MQAR model "
                              "is tests/fixtures/l2a/mqar_dense.npz).")
    return model_params(load_params(dense_params), cfg), [], 0.0
  init = nn.unbox(Decoder(cfg).init(jax.random.key(s.seed),
                                    jnp.zeros((1, s.seq_len), jnp.int32))["params"])
  return train(cfg, init, s, data, steps=s.dense_steps, lr=s.dense_lr, trainable=None, phase=0,
               name="dense", log=log)


def router_groups(s: Settings, routing: str = "learned"):
  """The optimizer's param groups: the router's own lr (learned routing only)."""
  if s.router_lr is None or routing != "learned":
    return None
  return {"router": {"regex": ROUTER_REGEX, "lr": s.router_lr}}


def convert(s: Settings, cfg: ModelConfig, dense, **options):
  """(L2A config, L2A params): `attention.convert(..., "l2a")` with the settings' options (+ overrides)."""
  return convert_to_scheme(dense, cfg, "l2a", **l2a_options(s, **options))


def train_l2a(s: Settings, data: Data, cfg: ModelConfig, dense, *, name: str = "l2a", log=print,
              **options):
  """Convert the dense model and train it with the L2A recipe for s.l2a_steps (attention, norms
  and router trainable; FFN and embeddings frozen; forced-global steps; lambda warmup + ramp).
  `options` override L2A options, e.g. routing='bernoulli', bernoulli_q=q (context-free) or
  routing='none' (local only). Returns (L2A config, params, history, seconds)."""
  lcfg, lp = convert(s, cfg, dense, **options)
  params, hist, secs = train(lcfg, lp, s, data, steps=s.l2a_steps, lr=s.l2a_lr,
                             trainable=L2A_TRAINABLE, phase=1, name=name,
                             groups=router_groups(s, options.get("routing", "learned")), log=log)
  return lcfg, params, hist, secs


def theta_sweep(lcfg: ModelConfig, params, data: Data, thetas) -> dict[str, dict]:
  """{str(theta): accuracy, sparsity, layer_sparsity} of the trained model at each threshold."""
  out = {}
  for th in thetas:
    r = evaluate(configure(lcfg, "l2a", theta=th), params, data)
    out[str(th)] = dict(accuracy=r["accuracy"], sparsity=r["sparsity"],
                        layer_sparsity=r["layer_sparsity"])
  return out


def pruning(lcfg: ModelConfig, params, data: Data, layer_sparsity, threshold: float = 0.95,
            contexts=(131072,)) -> dict[str, Any]:
  """Post-training pruning: layers with sparsity >= threshold lose the global branch and its
  KV cache (`l2a.prune`); accuracy after, and KV-cache bytes (batch 1) of the dense base model,
  the L2A model and the pruned one at each context length (`l2a.kv_bytes_report`)."""
  pcfg, pparams, pruned = l2a.prune(model_params(params, lcfg), lcfg, layer_sparsity, threshold)
  kv = {}
  for ctx in contexts:
    r = l2a.kv_bytes_report(lcfg, pcfg, ctx)
    kv[str(ctx)] = dict(dense=r["kv_bytes_dense_base"], l2a=r["kv_bytes_before"],
                        l2a_pruned=r["kv_bytes_after"])
  return dict(threshold=threshold, pruned_layers=list(pruned),
              accuracy_after=evaluate(pcfg, pparams, data)["accuracy"], kv_bytes=kv)


def run_experiment(s: Settings, log=print, *, dense_params: str | None = None,
                   save_dense: str | None = None, baseline_steps: int | None = None
                   ) -> dict[str, Any]:
  """The whole experiment; `dense_params` (npz from `save_dense`) skips the dense training;
  `baseline_steps` trains each baseline that many steps instead of s.l2a_steps (recorded as
  result['baseline_steps'])."""
  t_start = time.time()
  data = Data(s)
  cfg = base_config(s)
  timings = {}
  dense, dense_hist, timings["dense"] = dense_model(s, data, cfg, dense_params, log)
  if save_dense:
    save_params(dense, save_dense)
  dense_eval = evaluate(cfg, dense, data)
  log(f"dense accuracy {dense_eval['accuracy']:.4f}")
  converted_eval = evaluate(*convert(s, cfg, dense), data)
  log(f"converted (step 0, every token global) accuracy {converted_eval['accuracy']:.4f}")

  lcfg, lparams, l2a_hist, timings["l2a"] = train_l2a(s, data, cfg, dense, name="l2a", log=log)
  l2a_eval = evaluate(lcfg, lparams, data)
  log(f"l2a accuracy {l2a_eval['accuracy']:.4f} sparsity {l2a_eval['sparsity']:.4f} "
      f"layers {l2a_eval['layer_sparsity']}")

  result: dict[str, Any] = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "task": dict(name="mqar", seq_len=s.seq_len, vocab_size=s.vocab_size,
                   num_pairs=s.num_pairs, num_queries=s.num_pairs, min_gap=s.min_gap,
                   eval_examples=s.eval_examples, eval_stream=1,
                   note="every query key is > num_layers*(window-1) tokens after every pair: "
                        "local attention alone cannot answer"),
      "settings": dataclasses.asdict(s),
      "backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind,
      "jax_version": jax.__version__,
      "dense_accuracy": dense_eval["accuracy"],
      "converted_accuracy": converted_eval["accuracy"],
      "l2a_accuracy": l2a_eval["accuracy"],
      "l2a_sparsity": l2a_eval["sparsity"],
      "l2a_layer_sparsity": l2a_eval["layer_sparsity"],
      "l2a_global_fraction": l2a_eval["global_fraction"],
      "l2a_global_rate_by_role": global_rate_by_role(lcfg, lparams, data),
      "theta_sweep": theta_sweep(lcfg, lparams, data, s.thetas),
      "pruning": pruning(lcfg, lparams, data, l2a_eval["layer_sparsity"], 0.95,
                         (s.seq_len, 131072)),
      "history": {"dense": dense_hist, "l2a": l2a_hist},
  }
  q = float(np.clip(l2a_eval["global_fraction"], 0.0, 1.0))
  b = s if baseline_steps is None else dataclasses.replace(s, l2a_steps=baseline_steps)
  result["baseline_steps"] = b.l2a_steps
  if "context_free" in s.baselines:
    ccfg, cparams, chist, timings["context_free"] = train_l2a(
        b, data, cfg, dense, name="context_free", log=log, routing="bernoulli", bernoulli_q=q)
    ce = evaluate(ccfg, cparams, data)
    result.update(context_free_accuracy=ce["accuracy"], context_free_sparsity=ce["sparsity"],
                  context_free_q=q, context_free_layer_sparsity=ce["layer_sparsity"])
    result["history"]["context_free"] = chist
    log(f"context-free accuracy {ce['accuracy']:.4f} sparsity {ce['sparsity']:.4f} (q={q:.4f})")
  if "local_only" in s.baselines:
    ocfg, oparams, ohist, timings["local_only"] = train_l2a(
        b, data, cfg, dense, name="local_only", log=log, routing="none")
    oe = evaluate(ocfg, oparams, data)
    result.update(local_only_accuracy=oe["accuracy"], local_only_sparsity=oe["sparsity"])
    result["history"]["local_only"] = ohist
    log(f"local-only accuracy {oe['accuracy']:.4f}")
  if "dense_continued" in s.baselines:
    dparams, dhist, timings["dense_continued"] = train(
        cfg, dense, b, data, steps=b.l2a_steps, lr=s.l2a_lr, trainable=L2A_TRAINABLE, phase=1,
        name="dense_continued", log=log)
    result.update(dense_continued_accuracy=evaluate(cfg, dparams, data)["accuracy"])
    result["history"]["dense_continued"] = dhist
  result["seconds"] = dict(timings, total=time.time() - t_start)
  return result


# result files of the recorded presets (others: <out_dir>/l2a_learning_<device>.json)
FILES = {"full": "l2a_learning.json", "cpu": "l2a_learning_cpu.json"}
FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "full", sorted(PRESETS), "experiment size", flag_values=FLAGS)
flags.DEFINE_multi_string("set", [], "override a setting: --set l2a_steps=2000 (repeatable)",
                          flag_values=FLAGS)
flags.DEFINE_string("dense_params", None, "npz of a trained dense model (skips the dense phase; "
                    "its settings must match)", flag_values=FLAGS)
flags.DEFINE_string("save_dense", None, "write the dense model's params (npz)", flag_values=FLAGS)


def main(argv=None):
  a = common.parse_flags(FLAGS, argv)
  s = dataclasses.replace(PRESETS[a.preset])
  for kv in a.set:
    k, v = kv.split("=", 1)
    cur = getattr(s, k)
    if isinstance(cur, tuple):
      val = tuple(type(cur[0])(x) if cur else x for x in v.split(":")) if v else ()
    elif cur is None:
      val = float(v)
    else:
      val = type(cur)(v) if not isinstance(cur, bool) else v.lower() in ("1", "true")
    setattr(s, k, val)
  res = run_experiment(s, log=lambda m: print(m, flush=True), dense_params=a.dense_params,
                       save_dense=a.save_dense)
  res["command"] = " ".join(["python", "bench/l2a_learning.py"] + list(
      sys.argv[1:] if argv is None else argv))
  out = common.result_path("l2a_learning", a.out_dir, fixed=FILES.get(a.preset))
  keys = ("dense_accuracy", "l2a_accuracy", "l2a_sparsity", "context_free_accuracy",
          "local_only_accuracy", "dense_continued_accuracy")
  print(json.dumps({k: res[k] for k in keys if k in res}, indent=2))
  common.write_result(out, "l2a_learning", res, name=a.preset)
  print("written", out)


if __name__ == "__main__":
  main()
