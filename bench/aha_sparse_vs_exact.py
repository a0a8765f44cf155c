"""AHA training cost: `sparse` vs `exact` mode vs the dense base model, same process, one device.

    python -m bench.aha_sparse_vs_exact                      # GPU: T = 32768, usage 0.05 / 0.12 / 0.5
    python -m bench.aha_sparse_vs_exact --preset=tiny --out_dir=/tmp/aha_bench   # CPU smoke test

Model (preset 'olmo2-1b'): the OLMo-2-0425-1B shape (hidden 2048, 16 heads = 16 kv heads,
head_dim 128, intermediate 8192, vocab 100352, post-norm, q/k norm over the projected width),
`--layers` of its 16 layers (default 4: the rows differ per layer only), random init, bf16 compute,
fp32 master weights, remat 'full', batch 1 row of T tokens, chunked CE (8192), AdamW.
Rows (median of --reps jitted steps after a warm-up, block_until_ready):
  dense            the base model (full attention everywhere: cuDNN / tokamax on GPU);
  exact            AHA mode 'exact': Full and Local (window w) both dense for every head;
  sparse_u{p}      AHA mode 'sparse', a non-forced step: Local dense (window kernel), Full only
                   for the routed (token, head) pairs (ops.attention with a per-head active set:
                   the compacted Pallas kernel), at mean usage p;
  expected with forced-global steps: (1 - p_force) * sparse + p_force * exact (`*_pforce`).
Routing pattern: a random router kernel; per (layer, head) the bias is calibrated on the
benchmark batch so that head n of layer l goes full for a fraction u[l, n] of the tokens, u
long-tailed over heads with mean p (the paper's Fig. 4: a few heavy heads, most rarely full).
The measured usage (the step's aha/mu_f) is recorded. Sanity: the first step's CE of exact and
sparse (same params, same batch) must agree (bf16 tolerance) before anything is timed.
Appends a run to <out_dir>/aha_sparse_vs_exact_<device>.json (bench/common.py's schema).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402
from bench import common  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from condattn_jax.attention import configure, convert  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402
from condattn_jax.train import optimizer as opt_lib  # noqa: E402
from condattn_jax.train.state import TrainState  # noqa: E402
from condattn_jax.train.step import make_train_step  # noqa: E402

OLMO2_1B = dict(family="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                num_heads=16, num_kv_heads=16, head_dim=128, rope_theta=500000.0,
                rms_norm_eps=1e-6, qk_norm="full", post_norm=True, dtype="bfloat16",
                param_dtype="float32", remat_policy="full")
TINY = dict(family="olmo2", vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=10000.0, qk_norm="full", post_norm=True,
            dtype="float32", attention_impl="reference")


@dataclasses.dataclass
class Settings:
  preset: str = "olmo2-1b"
  T: int = 32768
  layers: int = 4
  window: int = 128
  usages: tuple = (0.05, 0.12, 0.5)
  p_force: float = 0.05
  reps: int = 5
  loss_chunk: int = 8192
  seed: int = 0


class _TC(dict):
  """The `train` section the project's optimizer / step read."""
  __getattr__ = dict.__getitem__


def _tc(s: Settings) -> _TC:
  return _TC(num_steps=1000, lr=3e-5, warmup_frac=0.0, warmup_steps=None, lr_schedule="constant",
             end_lr_frac=1.0, grad_clip=1.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8,
             trainable_regex=None, param_groups={}, seed=s.seed, microbatches=1,
             loss_chunk_size=min(s.loss_chunk, s.T))


def model_config(s: Settings) -> ModelConfig:
  shape = OLMO2_1B if s.preset == "olmo2-1b" else TINY
  return ModelConfig(num_layers=s.layers, **shape)


def head_usages(p: float, L: int, N: int, seed: int = 0) -> np.ndarray:
  """[L, N] per-head usage with mean p, long-tailed over heads (weights 0.5^(k/2) by rank k,
  ranks permuted per layer), each in [0, 1]."""
  rng = np.random.default_rng(seed)
  w = 0.5 ** (np.arange(N) / 2.0)
  out = np.zeros((L, N))
  for l in range(L):
    u = p * N * w / w.sum()
    for _ in range(N):  # clip at 1 and hand the excess to the unclipped heads
      over = u > 1
      if not over.any():
        break
      excess = (u[over] - 1).sum()
      u[over] = 1
      free = u < 1
      u[free] += excess * w[free] / w[free].sum()
    out[l] = rng.permutation(u)
  return out


def batch(s: Settings, cfg: ModelConfig) -> dict:
  rng = np.random.default_rng(s.seed)
  tok = rng.integers(1, cfg.vocab_size, (1, s.T + 1)).astype(np.int32)
  pos = np.arange(s.T, dtype=np.int32)[None]
  return jax.tree.map(jnp.asarray, dict(inputs=tok[:, :-1], targets=tok[:, 1:], positions=pos,
                                        segment_ids=np.ones((1, s.T), np.int32),
                                        loss_mask=np.ones((1, s.T), np.float32)))


@functools.cache
def _scores_fn(acfg: ModelConfig):
  m = Decoder(acfg)

  @jax.jit
  def scores(params, b):
    _, st = m.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"],
                    mutable=["intermediates"])
    return st["intermediates"]["layers"]["score"][0]                    # [L, B, T, N]
  return scores


def calibrate(acfg: ModelConfig, params, b, target_LN, passes: int = 2):
  """Router bias per (layer, head) so that usage[l, n] ~ target on this batch (the scores of
  layer l depend on earlier layers' routing: a few passes)."""
  scores = _scores_fn(acfg)
  for _ in range(passes):
    s = np.asarray(jax.device_get(scores(params, b)), np.float64)
    s = np.clip(s, 1e-7, 1 - 1e-7)
    bias = np.asarray(params["layers"]["router"]["bias"], np.float64)
    r = np.log(s / (1 - s)) - bias[:, None, None, :]                     # logits without bias
    L, _, _, N = r.shape
    new = np.zeros((L, N))
    for l in range(L):
      for n in range(N):
        # full iff r + bias > 0 (s > 0.5 = tau): bias = -quantile(r, 1 - u)
        new[l, n] = -np.quantile(r[l, :, :, n], 1.0 - target_LN[l, n])
    params = jax.tree.map(lambda x: x, params)
    params["layers"]["router"]["bias"] = jnp.asarray(new, jnp.float32)
  return params


_COMPILED: dict = {}


def _timed_steps(cfg: ModelConfig, params, b, s: Settings):
  """(first step's metrics, median step seconds, compile seconds) of the project's train step
  (compiled once per config: routing patterns are values, not shapes)."""
  tc = _tc(s)
  params = jax.tree.map(jnp.copy, params)  # the step donates its state; keep the caller's params
  tx, labels, sched = opt_lib.make_optimizer(tc, params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  t0 = time.perf_counter()
  key = (cfg, s.T, s.loss_chunk)
  if key not in _COMPILED:
    step = jax.jit(make_train_step(cfg, tc, tx, labels, sched), donate_argnums=(0,))
    _COMPILED[key] = step.lower(state, b).compile()
  compiled = _COMPILED[key]
  compile_s = time.perf_counter() - t0
  state, first = compiled(state, b)
  first = jax.device_get(first)
  times = []
  for _ in range(s.reps):
    t0 = time.perf_counter()
    state, m = compiled(state, b)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  del state
  return first, statistics.median(times), compile_s


def run(s: Settings, log=print) -> dict:
  cfg = model_config(s)
  b = batch(s, cfg)
  dense = nn.unbox(jax.jit(lambda: Decoder(cfg).init(jax.random.key(s.seed),
                                                     b["inputs"][:, :8]))()["params"])
  rows = []

  def row(name, c, params, **extra):
    first, sec, comp = _timed_steps(c, params, b, s)
    r = dict(name=name, train_ms=1e3 * sec, compile_s=comp, ce_first=float(first["ce"]), **extra)
    if "aha/mu_f" in first:
      r["mu_f"] = float(first["aha/mu_f"])
    rows.append(r)
    log(json.dumps(r))
    return r

  base = row("dense", cfg, dense)
  ecfg, ep = convert(dense, cfg, "aha", window=s.window, mode="exact")
  kernel = ep["layers"]["router"]["kernel"]
  ep["layers"]["router"]["kernel"] = (jax.random.normal(jax.random.key(s.seed + 1), kernel.shape)
                                      / np.sqrt(cfg.hidden_size)).astype(kernel.dtype)
  scfg = configure(ecfg, "aha", mode="sparse", p_force=0.0)  # a non-forced sparse step
  for p in s.usages:
    target = head_usages(p, cfg.num_layers, cfg.num_heads, s.seed)
    params = calibrate(ecfg, ep, b, target)
    ex = row(f"exact_u{p}", ecfg, params, target_mu_f=p)
    sp = row(f"sparse_u{p}", scfg, params, target_mu_f=p)
    if abs(ex["ce_first"] - sp["ce_first"]) > 2e-2 * max(1.0, abs(ex["ce_first"])):
      raise AssertionError(f"sanity: exact and sparse CE differ at usage {p}: {ex['ce_first']} vs "
                           f"{sp['ce_first']} (the two modes must compute the same forward)")
    sp["train_ms_pforce"] = (1 - s.p_force) * sp["train_ms"] + s.p_force * ex["train_ms"]
    sp["speedup_vs_exact"] = ex["train_ms"] / sp["train_ms"]
    sp["speedup_pforce_vs_exact"] = ex["train_ms"] / sp["train_ms_pforce"]
    sp["speedup_vs_dense"] = base["train_ms"] / sp["train_ms"]
    ex["slowdown_vs_dense"] = ex["train_ms"] / base["train_ms"]
  dev = jax.devices()[0]
  return dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform,
              jax_version=jax.__version__, date=datetime.date.today().isoformat(),
              settings=dataclasses.asdict(s), model=dataclasses.asdict(cfg), rows=rows)


FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "olmo2-1b", ["olmo2-1b", "tiny"], "shapes (tiny: a CPU smoke test)",
                  flag_values=FLAGS)
flags.DEFINE_integer("T", None, "context length (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer("layers", None, "layers (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer("window", 128, "AHA local window", flag_values=FLAGS)
flags.DEFINE_string("usages", "0.05,0.12,0.5", "global-head usages to time", flag_values=FLAGS)
flags.DEFINE_integer("reps", 5, "timed repeats (median)", flag_values=FLAGS)


def main(argv=None):
  a = common.parse_flags(FLAGS, argv)
  tiny = a.preset == "tiny"
  s = Settings(preset=a.preset, T=a.T or (64 if tiny else 32768),
               layers=a.layers or (2 if tiny else 4), window=a.window if not tiny else 8,
               usages=tuple(float(x) for x in a.usages.split(",")), reps=a.reps,
               loss_chunk=32 if tiny else 8192)
  res = run(s)
  path = common.result_path("aha_sparse_vs_exact", a.out_dir, res["device"])
  common.write_result(path, "aha_sparse_vs_exact", res)
  print(path)
  return res


if __name__ == "__main__":
  main()
