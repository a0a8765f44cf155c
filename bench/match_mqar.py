r"""MATCH reproduction on MQAR (paper App. B.3.1 / Table C.3), pre-registered (CRITERIA below).

  python bench/match_mqar.py --preset=cpu          # -> bench/results/match_mqar.json (2-core CPU)
  python bench/match_mqar.py --preset=test --out_dir=/tmp/m   # seconds (tests/bench/test_match_bench.py)
  # H100s: jobs of (method, length, lrs, seeds), several a GPU, planned by gpu_plan
  python bench/match_mqar.py --preset=h100 --plan=4     # calls, jobs a GPU, estimated seconds
  # (bench/match_segmented_gpu.sh mqar runs the next call on a 4-GPU host;
  # docs/schemes/match.md#reproduction-mqar). Each job writes its progress file:
  CONDATTN_GIT_COMMIT=<sha> python bench/match_mqar.py --preset=h100 --methods=full \
      --lengths=512 --lrs=1e-3 --seeds=0 --data_dir=out/mqar_rows --deadline_s=440 \
      --progress=$OUT/mqar_full_512_0.001_s0.json --out_dir=$OUT/mqar_runs/full_512
  # then here: one run with every length, named sweep_h100, in bench/results/match_mqar_<GPU>.json
  python bench/match_mqar.py --preset=h100 --merge=<dir>/mqar_full_512_0.001_s0.json,...

Protocol (the paper's, scaled): 2-layer qwen3-style decoders (width 64, 4 heads), every length
trained SEPARATELY from scratch on fresh MQAR rows of that length (num_pairs per length as the
paper's 4..64 pairs: 64->4, 128->8, 256->16, 512->64; min_gap 0; keys from [1, V/2), values from
[V/2, V); the presets' query slots as Zoology draws them: Settings.query_power), the LM head
tied to the embedding (Settings.tie_embeddings, as Zoology's models), AdamW with 10% warmup and
cosine decay, an LR sweep per method (best LR by the mean
over seeds; the baselines' own sweep may hold more lrs: Settings.method_lrs), 2-3 seeds (init
and data), evaluated on held-out rows (stream 1): accuracy = answer tokens argmax-correct. Only
the answer positions reach the LM head (answer_logits), held-out rows are evaluated eval_chunk
at a time. The models of one (method, length) train together: lrs x seeds stacked and vmapped
(one compiled step; Settings.model_groups: g at a time under lax.map). Four methods share the
model and differ only in the attention of scheme 'match':
  full    full causal attention (window = the row length, no retrieval): the reference
  swa     sliding window w=32, no retrieval
  match   window + retrieval: chunks c=2 (one key-value pair each), exact match of the query's key
          tokens, top_k=4; trained with the paper's mask (retrieved_kv='sequence')
  random  window + top_k=4 RANDOM candidate chunks (retriever 'random'): the control
MATCH and random are evaluated under BOTH semantics on the same weights: the training mask
('sequence': the retrieved chunks' K/V from the forward) and the decode semantics ('recompute':
the retrieved chunks' raw tokens re-run through every layer as auxiliary rows, what generation
computes). Curves (training loss; held-out accuracy under the training mask every eval_every
steps) are recorded per model, with a plateau flag (last two evals within 0.02).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
from absl import flags  # noqa: E402
from bench import common  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from condattn_jax.attention import configure  # noqa: E402
from condattn_jax.attention.match.options import ATTENTION_PATHS  # noqa: E402
from condattn_jax.data.synthetic import MQAR  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402

# result file of the recorded CPU preset (others: <out_dir>/match_mqar_<device>.json)
FILES = {"cpu": "match_mqar.json"}
METHODS = {
    "full": dict(top_k=0, window=None),  # window = the row length: full attention
    "swa": dict(top_k=0),
    "match": dict(),
    "random": dict(retriever="random"),
}
RETRIEVES = ("match", "random")  # evaluated under both semantics
PAIRS = {64: 4, 128: 8, 256: 16, 512: 64}  # the paper's 4..64 recall pairs over 64..512


@dataclasses.dataclass(frozen=True)
class Settings:
  lengths: tuple = (64, 128)
  lrs: tuple = (1e-3, 3e-3, 1e-2)
  seeds: tuple = (0, 1)
  vocab: int = 128
  window: int = 32
  chunk: int = 2
  top_k: int = 4
  width: int = 32
  heads: int = 2
  steps: int = 800
  batch: int = 16
  warmup_frac: float = 0.1
  weight_decay: float = 0.1
  eval_rows: int = 128
  eval_every: int = 100
  eval_chunk: int = 128  # held-out rows per compiled evaluation call
  train_rows: int = 0  # distinct training rows per seed (epochs over them); 0 = steps x batch
  method_lrs: tuple = ()  # (method, lrs) pairs: a method's own lr sweep (else `lrs`)
  # (length, g) pairs: at that length the M models run g at a time (lax.map over groups of g
  # vmapped models: memory of g models, not M); other lengths vmap all M at once
  model_groups: tuple = ()
  # the LM head is the token embedding (Zoology's MQAR models tie them); untied, the head
  # must learn every value token's own output row, which 4096 value tokens (vocabulary 8192)
  # seen ~200 times each in 2 epochs of 100K rows do not give it
  tie_embeddings: bool = False
  # MQAR query slots: None = uniform over the query region, a = Zoology's power law (its
  # power_a, 0.01: most queries near the pairs; condattn_jax.data.synthetic.MQAR.query_power)
  query_power: float | None = None
  # how MATCH / random run "window OR retrieved chunks" (MatchOptions.attention_path): with the
  # reference impl 'auto' is the gathered path; 'block_sparse' is one masked O(T^2) reference call
  # a layer (the same values: tests/attention/test_match_kernel.py). An execution choice: runs that
  # differ only in it merge (EXECUTION_FIELDS).
  attention_path: str = "auto"


def method_lrs(s: Settings, method: str) -> tuple:
  """The learning rates swept for `method`."""
  return dict(s.method_lrs).get(method, s.lrs)


def job_lrs(s: Settings, method: str) -> tuple:
  """The lrs of `method` this process trains: its whole sweep, or (--lrs, one job of a sweep
  split over processes) the sweep's lrs among LRS, in the sweep's order."""
  sweep = method_lrs(s, method)
  if LRS is None:
    return sweep
  got = tuple(x for x in sweep if any(math.isclose(x, y) for y in LRS))
  if not got:
    raise ValueError(f"--lrs={list(LRS)} holds none of {method}'s swept lrs {list(sweep)}")
  return got


def job_seeds(s: Settings) -> tuple:
  """The seeds this process trains: all of s.seeds, or (--seeds, one job of a sweep split by
  seed) those among SEEDS, in s.seeds' order."""
  if SEEDS is None:
    return tuple(s.seeds)
  got = tuple(x for x in s.seeds if x in SEEDS)
  if not got:
    raise ValueError(f"--seeds={list(SEEDS)} holds none of the preset's seeds {list(s.seeds)}")
  return got


def over_models(s: Settings, length: int, fn, xs, *shared):
  """fn(*x, *shared) for every model's slice x of the leading-axis trees `xs`: vmapped over all
  models, or s.model_groups' g at a time at this length (lax.map with batch_size g)."""
  g = dict(s.model_groups).get(length)
  if not g:
    return jax.vmap(lambda *x: fn(*x, *shared))(*xs)
  return jax.lax.map(lambda x: fn(*x, *shared), xs, batch_size=g)


PRESETS = {
    # 2 CPU cores: 2 lengths x 4 methods x 2 lrs x 2 seeds, width 64, 1000 steps of 64 fresh
    # rows (64K a model), Zoology's query placement; untied head (64 value tokens need no tie).
    # (The first preset, width 32 and 800 steps of 16 rows, left full attention at 0.21.)
    "cpu": Settings(lrs=(1e-3, 3e-3), width=64, heads=4, steps=1000, batch=64,
                    query_power=0.01),
    # H100 (jax 0.11.2): the paper's lengths, width 128, vocabulary 8192, 100K training rows a
    # seed (the paper's count) seen 8 times (12,800 steps of 64: at 3200 steps, 2 epochs, full
    # attention levelled at 0.57 on CPU; at 12,800 one H100 saw full 1.000 at 64 and 128 and SWA
    # 0.996 at 64: docs/schemes/match.md), 3 seeds; the baselines sweep one lower lr besides
    # (their own sweep); tied embeddings and Zoology's query placement (power 0.01), as the
    # Zoology models and data the paper's MQAR follows. Run as jobs of (method, length, lrs,
    # seeds) (--methods, --lengths, --lrs, --seeds; joined by --merge), several per GPU
    # (gpu_plan, bench/match_segmented_gpu.sh): compiled on CPU, the largest (length 512, 12
    # models run 4 at a time) needs ~11 GiB of temporaries a step and ~2 GiB an evaluation
    # call; its job of one lr (3 models) fits a quarter of a card
    # (tests/bench/test_match_bench.py::test_h100_preset_fits_a_shared_gpu).
    "h100": Settings(lengths=(64, 128, 256, 512), vocab=8192, width=128, heads=4, steps=12800,
                     batch=64, seeds=(0, 1, 2), eval_rows=1024, eval_every=400, eval_chunk=64,
                     train_rows=100_000, model_groups=((512, 4),),
                     method_lrs=(("full", (3e-4, 1e-3, 3e-3, 1e-2)),
                                 ("swa", (3e-4, 1e-3, 3e-3, 1e-2))),
                     tie_embeddings=True, query_power=0.01, attention_path="block_sparse"),
    # CI (scripts/demo.py's MATCH section, tests/cli/test_demo_sections.py): length 64, the
    # sweep's best MATCH lr, one seed, 300 steps (where the sweep's MATCH / SWA curves
    # separate); MATCH / random on the block-sparse path (one masked reference call a layer:
    # the same values as the gathered path, a third of its CPU time at this size)
    "test": Settings(lengths=(64,), lrs=(3e-3,), seeds=(0,), steps=300, batch=16,
                     eval_rows=64, eval_every=150, attention_path="block_sparse"),
}

# Pre-registered criteria (written with this script, before its first sweep ran). Numbers are
# the best-lr mean over seeds; `last` = the longest length of the run. MATCH is judged only if
# the baselines are fair (full and swa criteria hold).
CRITERIA = {
    "full_fair": "full attention >= 0.95 at every length",
    "swa_fair": "SWA >= 0.9 at length 64",
    # added before the first H100 run (fairness: the baselines trained to a plateau)
    "baselines_plateau": "full and SWA (best lr) moved <= 0.02 between their last two "
                         "held-out evaluations at every length",
    "match_sequence": "MATCH under the training mask >= 0.95 at every length",
    "match_decode": "MATCH under the decode semantics (recompute) >= 0.95 at every length",
    "match_beats_swa": "MATCH (both semantics) >= SWA + 0.1 at the longest length",
    "random_near_swa": "random retrieval (training mask) <= SWA + 0.1 at the longest length",
}
BASELINE_CRITERIA = ("full_fair", "swa_fair", "baselines_plateau")


def pairs(length: int) -> int:
  return PAIRS.get(length, length // 16)


def model_config(s: Settings, method: str, length: int, retrieved_kv: str = "sequence"):
  base = ModelConfig(family="qwen3", qk_norm="head", vocab_size=s.vocab, hidden_size=s.width,
                     intermediate_size=2 * s.width, num_layers=2, num_heads=s.heads,
                     num_kv_heads=s.heads, head_dim=s.width // s.heads, rope_theta=10000.0,
                     tie_word_embeddings=s.tie_embeddings, attention_impl="reference")
  # 'reference' attention (XLA) everywhere: the models are vmapped, and rows <= 512 tokens
  kw = dict(window=s.window, chunk=s.chunk, top_k=s.top_k, impl="reference")
  kw.update(METHODS[method])
  if kw["window"] is None:
    kw["window"] = length
  if kw["top_k"]:
    kw["retrieved_kv"] = retrieved_kv
    kw["attention_path"] = s.attention_path
  return configure(base, "match", **kw)


def task(s: Settings, length: int) -> MQAR:
  return MQAR(seq_len=length, vocab_size=s.vocab, num_pairs=pairs(length),
              query_power=s.query_power)


def rows(t: MQAR, seed: int, n: int, stream: int) -> dict[str, np.ndarray]:
  """n MQAR rows (inputs, targets, loss_mask, answers) of one seed and stream; answers [n, Q]
  = the positions of the Q = num_pairs scored tokens of each row (every row has Q). With
  DATA_DIR (--data_dir) the rows are read from there when an earlier process saved them
  (--make_data; the same rows: MQAR.example is a function of seed, index and stream), else
  made and saved there."""
  path = rows_path(t, seed, n, stream)
  if path and os.path.exists(path):
    with np.load(path) as z:
      out = {k: z[k] for k in ("inputs", "targets", "loss_mask")}
  else:
    out = _make_rows([(t, seed, n, stream)])[0]
  return dict(out, answers=answer_positions(out["loss_mask"], t.queries))


def rows_path(t: MQAR, seed: int, n: int, stream: int) -> str | None:
  """Where DATA_DIR keeps these rows (the file names the task's every field), or None."""
  if not DATA_DIR:
    return None
  import hashlib
  key = hashlib.md5(repr(sorted(dataclasses.asdict(t).items())).encode()).hexdigest()[:10]
  return os.path.join(DATA_DIR, f"mqar_T{t.seq_len}_{key}_s{seed}_r{stream}_n{n}.npz")


def _make_rows(wanted: list) -> list:
  """The rows {inputs, targets, loss_mask} of each (task, seed, n, stream) in `wanted`, made in
  one pool of DATA_WORKERS processes (the same rows as one process makes) when they are many,
  and saved under DATA_DIR when it is set."""
  cuts = lambda n: np.linspace(0, n, max(1, min(DATA_WORKERS, n // 2048)) + 1).astype(int)
  parts = [[(t, seed, a, b, stream) for a, b in zip(cuts(n), cuts(n)[1:])]
           for t, seed, n, stream in wanted]
  flat = [p for ps in parts for p in ps]
  if DATA_WORKERS > 1 and len(flat) > 1:  # the same rows, made by worker processes
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
        DATA_WORKERS, mp_context=multiprocessing.get_context("spawn")) as ex:
      made = list(ex.map(_rows_part, flat))
  else:
    made = [_rows_part(p) for p in flat]
  out, k = [], 0
  for (t, seed, n, stream), ps in zip(wanted, parts):
    got = made[k:k + len(ps)]
    k += len(ps)
    r = {key: np.concatenate([g[key] for g in got]) for key in got[0]}
    path = rows_path(t, seed, n, stream)
    if path:  # written whole, then renamed: a reader never sees half a file
      os.makedirs(DATA_DIR, exist_ok=True)
      tmp = f"{path[:-4]}.{os.getpid()}.tmp.npz"
      np.savez(tmp, **r)
      os.replace(tmp, path)
    out.append(r)
  return out


def make_data(s: Settings, log=print):
  """Every row the preset's jobs at s.lengths read (each seed's training rows, the held-out
  rows), saved under DATA_DIR once, in one pool of DATA_WORKERS processes (--make_data: one
  process per call, before the jobs)."""
  t0 = time.perf_counter()
  wanted = [(task(s, n), seed, s.train_rows or s.steps * s.batch, 0)
            for n in s.lengths for seed in s.seeds] + [(task(s, n), 0, s.eval_rows, 1)
                                                       for n in s.lengths]
  wanted = [w for w in wanted if not os.path.exists(rows_path(*w))]
  _make_rows(wanted)
  log(f"  rows of lengths {list(s.lengths)}: {len(wanted)} sets made under {DATA_DIR} in "
      f"{time.perf_counter() - t0:.0f}s")


DATA_WORKERS = 1  # processes making training rows (--data_workers)
LRS = None  # --lrs: the subset of each method's swept lrs this process trains (job_lrs)
SEEDS = None  # --seeds: the subset of the preset's seeds this process trains (job_seeds)
DATA_DIR = None  # --data_dir: rows made once per call (--make_data) and loaded by every job
DEADLINE = None  # time.time() by which training stops at an evaluation (--deadline_s)


def _rows_part(args):
  t, seed, start, stop, stream = args
  ex = [t.example(seed, i, stream) for i in range(start, stop)]
  return {k: np.stack([r[k] for r in ex]) for k in ("inputs", "targets", "loss_mask")}


def answer_positions(loss_mask_NT, q: int) -> np.ndarray:
  """[N, q] int32 positions of loss_mask_NT > 0 (exactly q a row, else ValueError)."""
  got = (loss_mask_NT > 0).sum(1)
  if not (got == q).all():
    raise ValueError(f"MQAR rows hold {sorted(set(got.tolist()))} scored tokens, expected {q}")
  return np.nonzero(loss_mask_NT > 0)[1].reshape(-1, q).astype(np.int32)


def schedule(s: Settings, step):
  """lr multiplier: linear warmup over warmup_frac of the steps, then cosine to 0."""
  w = max(1, int(s.warmup_frac * s.steps))
  warm = (step + 1) / w
  cos = 0.5 * (1 + jnp.cos(jnp.pi * jnp.clip((step - w) / max(1, s.steps - w), 0.0, 1.0)))
  return jnp.where(step < w, warm, cos)


def answer_logits(model, p, inputs_BT, answers_BQ):
  """float32 logits [B, Q, V] at the scored positions only: the final hidden states gathered at
  `answers_BQ` times the output embedding (the LM head over every position would hold
  models x B x T x V floats: 6 GiB at T = 512, V = 8192, B = 64, 6 models)."""
  h_BTD, _ = model.apply({"params": p}, inputs_BT, return_hidden=True)
  h_BQD = jnp.take_along_axis(h_BTD, answers_BQ[..., None], axis=1)
  cd = model.config.compute_dtype
  return jnp.einsum("bqd,dv->bqv", h_BQD.astype(cd),
                    model.output_embedding(p).astype(cd)).astype(jnp.float32)


def _hits_fn(s: Settings, cfg, length: int):
  """jit of (params [M, ...], rows) -> answer tokens argmax-correct [M] (over_models)."""
  model = Decoder(cfg)

  def hits(p, b):
    logits_BQV = answer_logits(model, p, b["inputs"], b["answers"])
    return jnp.sum(jnp.argmax(logits_BQV, -1) == _answer_targets(b))
  return jax.jit(lambda p, b: over_models(s, length, hits, (p,), b))


def _answer_targets(b):
  return jnp.take_along_axis(b["targets"], b["answers"], axis=1)


def _accuracy_fn(s: Settings, cfg, length: int):
  """(params [M, ...], held-out rows) -> accuracy [M] (numpy), the rows evaluated
  s.eval_chunk at a time (one compiled program: the activations of eval_chunk rows x M
  models, not of every held-out row)."""
  hits = _hits_fn(s, cfg, length)

  def acc(params, held):
    n = held["inputs"].shape[0]
    total = 0
    for i in range(0, n, s.eval_chunk):
      total = total + np.asarray(hits(params, {k: v[i:i + s.eval_chunk] for k, v in held.items()}))
    return total / held["answers"].size
  acc.hits = hits
  return acc


def programs(s: Settings, method: str, length: int):
  """(step, accuracy under the training mask, accuracy under the decode semantics or None,
  model): the compiled pieces of one (method, length), M = lrs x seeds models vmapped. step
  (params, opt_state, lr_M, batch, step) -> (params, opt_state, loss_M), batch arrays
  [M, batch, ...]."""
  cfg = model_config(s, method, length)
  model = Decoder(cfg)
  tx = optimizer(s)

  def loss_fn(p, b):
    logits_BQV = answer_logits(model, p, b["inputs"], b["answers"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BQV, _answer_targets(b)))

  def one(p, st, lr, b, step):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    upd, st = tx.update(g, st, p)
    scale = -lr * schedule(s, step)
    return optax.apply_updates(p, jax.tree.map(lambda u: scale * u, upd)), st, loss

  step_fn = jax.jit(lambda p, st, lr, b, i: over_models(s, length, one, (p, st, lr, b), i),
                    donate_argnums=(0, 1))
  rc = (_accuracy_fn(s, model_config(s, method, length, retrieved_kv="recompute"), length)
        if method in RETRIEVES else None)
  return step_fn, _accuracy_fn(s, cfg, length), rc, model


def optimizer(s: Settings):
  return optax.chain(optax.scale_by_adam(b1=0.9, b2=0.98),
                     optax.add_decayed_weights(s.weight_decay))


def train_length(s: Settings, method: str, length: int, log=print) -> dict:
  """Trains the lrs x seeds models of one method at one length together (vmapped); returns
  {"final": {semantics: [M] accuracy}, "curves": ..., "seconds": ...}; model m = lr index
  m // len(seeds), seed m % len(seeds) (the job's lrs and seeds: job_lrs, job_seeds)."""
  step_fn, acc_train, acc_rc, model = programs(s, method, length)
  t = task(s, length)
  lrs, seeds = job_lrs(s, method), job_seeds(s)
  nL, nS = len(lrs), len(seeds)
  M = nL * nS
  init = [nn.unbox(model.init(jax.random.PRNGKey(seed), jnp.zeros((1, length), jnp.int32))
                   ["params"]) for seed in seeds]
  params = jax.tree.map(lambda *a: jnp.stack([a[m % nS] for m in range(M)]), *init)
  lr_M = jnp.asarray([lrs[m // nS] for m in range(M)], jnp.float32)
  opt_state = jax.vmap(optimizer(s).init)(params)
  seed_of = np.asarray([m % nS for m in range(M)])
  held = {k: jnp.asarray(v) for k, v in rows(t, 0, s.eval_rows, stream=1).items()}
  n_train = s.train_rows or s.steps * s.batch
  data = [rows(t, seed, n_train, stream=0) for seed in seeds]
  curves = {"step": [], "loss": [], "acc": []}
  stopped_at = None
  t0 = time.perf_counter()
  for i in range(s.steps):
    at = (np.arange(i * s.batch, (i + 1) * s.batch) % n_train)  # epochs over the n_train rows
    b = {k: jnp.asarray(np.stack([data[j][k][at] for j in seed_of])) for k in data[0]}
    params, opt_state, loss = step_fn(params, opt_state, lr_M, b, i)
    if (i + 1) % s.eval_every == 0 or i == s.steps - 1:
      a = acc_train(params, held)
      curves["step"].append(i + 1)
      curves["loss"].append([round(float(x), 4) for x in np.asarray(loss)])
      curves["acc"].append([round(float(x), 4) for x in a])
      log(f"  {method} L={length} step {i + 1} loss {np.round(np.asarray(loss), 3).tolist()} "
          f"acc {np.round(a, 3).tolist()} ({time.perf_counter() - t0:.0f}s)")
      # the next eval_every steps (at this pace, with a margin) would pass the deadline: stop
      # here with this evaluation as the final one (recorded: stopped_at)
      pace = (time.perf_counter() - t0) / (i + 1)
      if (DEADLINE is not None and i + 1 < s.steps
          and time.time() + 1.5 * pace * s.eval_every + 20 > DEADLINE):
        stopped_at = i + 1
        log(f"  {method} L={length}: stopped at step {i + 1} of {s.steps} (--deadline_s)")
        break
  final = {"sequence": curves["acc"][-1]}
  if acc_rc is not None:
    final["recompute"] = [round(float(x), 4) for x in acc_rc(params, held)]
  return {"final": final, "curves": curves, "lrs": list(lrs), "seeds": list(seeds),
          "stopped_at": stopped_at,
          "seconds": round(time.perf_counter() - t0, 1), "params": params}


def compiled_memory(s: Settings, method: str, length: int) -> dict:
  """Bytes XLA's memory analysis gives the compiled training step and evaluation call of one
  (method, length) on the default backend (nothing runs): {'step_temp', 'step_args',
  'eval_temp', 'eval_args', 'recompute_eval_temp' (retrieving methods)}."""
  step_fn, acc, acc_rc, model = programs(s, method, length)
  M = len(job_lrs(s, method)) * len(job_seeds(s))
  sd = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt)
  p1 = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0),
                                                  jnp.zeros((1, length), jnp.int32))["params"]))
  params = jax.tree.map(lambda a: sd((M,) + a.shape, a.dtype), p1)
  opt = jax.eval_shape(jax.vmap(optimizer(s).init), params)
  q = pairs(length)
  batch = lambda *lead: {"inputs": sd((*lead, length)), "targets": sd((*lead, length)),
                         "loss_mask": sd((*lead, length), jnp.float32), "answers": sd((*lead, q))}
  step = step_fn.lower(params, opt, sd((M,), jnp.float32), batch(M, s.batch), 0).compile()
  out = {"step_temp": step.memory_analysis().temp_size_in_bytes,
         "step_args": step.memory_analysis().argument_size_in_bytes}
  for name, fn in (("eval", acc), ("recompute_eval", acc_rc)):
    if fn is not None:
      c = fn.hits.lower(params, batch(min(s.eval_chunk, s.eval_rows))).compile()
      out[name + "_temp"] = c.memory_analysis().temp_size_in_bytes
      out[name + "_args"] = c.memory_analysis().argument_size_in_bytes
  return out


def summarize(s: Settings, per: dict) -> dict:
  """per[method][length] -> the best lr (by the mean over seeds, training mask) and its mean /
  per-seed accuracy under each semantics, and whether the curve plateaued."""
  out = {}
  for method, by_len in per.items():
    out[method] = {}
    for length, r in by_len.items():
      lrs = r.get("lrs") or method_lrs(s, method)  # a --lrs job: its own lrs
      nS = len(r.get("seeds") or s.seeds)  # a --seeds job: its own seeds
      seq = np.asarray(r["final"]["sequence"]).reshape(len(lrs), nS)
      best = int(np.argmax(seq.mean(1)))
      row = {"best_lr": lrs[best], "lr_means": [round(float(x), 4) for x in seq.mean(1)]}
      for sem, acc in r["final"].items():
        a = np.asarray(acc).reshape(len(lrs), nS)[best]
        row[sem] = round(float(a.mean()), 4)
        row[sem + "_seeds"] = [round(float(x), 4) for x in a]
      accs = np.asarray(r["curves"]["acc"]).reshape(-1, len(lrs), nS)[:, best].mean(-1)
      row["plateau"] = bool(len(accs) >= 2 and abs(accs[-1] - accs[-2]) <= 0.02)
      out[method][str(length)] = row
  return out


def check_criteria(summary: dict, names=None) -> dict:
  """{criterion: passed} of CRITERIA (or of `names`, the criteria a recorded run registered) on
  a summary (lengths as str keys)."""
  lengths = sorted(summary["full"], key=int)
  last = lengths[-1]
  g = lambda m, n, sem="sequence": summary[m][n][sem]
  out = {
      "full_fair": all(g("full", n) >= 0.95 for n in lengths),
      "swa_fair": "64" in summary["swa"] and g("swa", "64") >= 0.9,
      "baselines_plateau": all(summary[m][n]["plateau"] for m in ("full", "swa") for n in lengths),
      "match_sequence": all(g("match", n) >= 0.95 for n in lengths),
      "match_decode": all(g("match", n, "recompute") >= 0.95 for n in lengths),
      "match_beats_swa": min(g("match", last), g("match", last, "recompute"))
                         >= g("swa", last) + 0.1,
      "random_near_swa": g("random", last) <= g("swa", last) + 0.1,
  }
  assert set(out) == set(CRITERIA)
  return {k: v for k, v in out.items() if names is None or k in names}


def verdict(criteria: dict) -> str:
  base = [c for c in BASELINE_CRITERIA if c in criteria]
  if not all(criteria[c] for c in base):
    return "not judged: baselines not fair (" + ", ".join(
        c for c in base if not criteria[c]) + " failed)"
  return "pass" if all(criteria.values()) else "fail: " + ", ".join(
      c for c, ok in criteria.items() if not ok)


def run(s: Settings, methods=tuple(METHODS), log=print, progress: str | None = None) -> dict:
  """Every (length, method) in turn; `progress`: a JSON file rewritten after each one with the
  finals / curves so far (a long sweep's partial results survive an interruption)."""
  per, secs = {}, {}
  for length in s.lengths:
    for method in methods:
      r = train_length(s, method, length, log)
      r.pop("params")
      per.setdefault(method, {})[length] = r
      secs[f"{method}/{length}"] = r["seconds"]
      if progress:
        os.makedirs(os.path.dirname(os.path.abspath(progress)), exist_ok=True)
        with open(progress, "w") as f:
          json.dump({"device": jax.devices()[0].device_kind, "settings": dataclasses.asdict(s),
                     "per": {m: {str(n): x for n, x in by.items()} for m, by in per.items()}}, f)
  return assemble(s, per, secs)


def assemble(s: Settings, per: dict, secs: dict, device: str | None = None) -> dict:
  """The result layout from per[method][length] = {"final", "curves"} (a run's, or progress
  files merged: `--merge`); criteria and verdict when every method ran."""
  summary = summarize(s, per)
  out = {"settings": dataclasses.asdict(s), "criteria_text": dict(CRITERIA),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "device": device or jax.devices()[0].device_kind,
         "pairs": {str(n): pairs(n) for n in s.lengths},
         "summary": summary, "train_seconds": secs,
         "curves": {m: {str(n): r["curves"] for n, r in by.items()} for m, by in per.items()},
         "finals": {m: {str(n): r["final"] for n, r in by.items()} for m, by in per.items()},
         # (method/length: step) of trainings cut short by --deadline_s (their curves end there)
         "stopped_early": {f"{m}/{n}": r["stopped_at"] for m, by in per.items()
                           for n, r in by.items() if r.get("stopped_at")}}
  if set(per) == set(METHODS):
    out["criteria"] = check_criteria(summary)
    out["verdict"] = verdict(out["criteria"])
  return out


# Settings fields progress files of one merged run may differ in: the lengths a job ran and how
# the retrieving methods' attention was executed (same values, another XLA program).
EXECUTION_FIELDS = ("lengths", "attention_path")


def merge_progress(s: Settings, paths) -> dict:
  """One result from the progress files of runs of the same settings over different lengths,
  lrs or seeds (the GPU plan's jobs), recorded with the device(s) the files name. Results at lengths outside s.lengths (a length whose methods did
  not all finish) are kept under "partial", outside the summary and the criteria."""
  per, secs, devices, partial = {}, {}, set(), {}
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    if "per" in data:
      devices.add(data["device"])
      own = {k: v for k, v in data["settings"].items() if k not in EXECUTION_FIELDS}
      if own != {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(s))).items()
                 if k not in EXECUTION_FIELDS}:
        raise ValueError(f"--merge: {path} was run with other settings than preset's: {own}")
      data = data["per"]
    for m, by in data.items():
      for n, r in by.items():
        if int(n) in s.lengths:
          per.setdefault(m, {}).setdefault(int(n), []).append(r)
        else:  # a length the sweep did not finish: kept, not judged
          partial.setdefault(m, {})[n] = r["final"]
  # jobs of one sweep may run on H100s and H200s (the GPU plan's calls span device sessions,
  # each given either card): the run names every device (the accuracies do not depend on it;
  # train_seconds do)
  per = {m: {n: join_lr_jobs(s, m, n, superseded_dropped(parts)) for n, parts in by.items()}
         for m, by in per.items()}
  secs = {f"{m}/{n}": r["seconds"] for m, by in per.items() for n, r in by.items()}
  got = sorted({n for by in per.values() for n in by})
  if got != sorted(s.lengths) or any(sorted(by) != got for by in per.values()):
    raise ValueError(f"--merge: the progress files hold lengths {got} (per method: "
                     f"{ {m: sorted(by) for m, by in per.items()} }), not {sorted(s.lengths)}.")
  out = assemble(s, {m: dict(sorted(by.items())) for m, by in per.items()}, secs,
                 device=" + ".join(sorted(devices)) if devices else None)
  if partial:
    out["partial"] = partial  # {method: {length: finals}} of lengths outside the settings
  return out


def superseded_dropped(parts: list) -> list:
  """The parts of one (method, length) less each stopped-early part whose every (lr, seed) a
  finished part holds (a job that a later call of the GPU plan ran again)."""
  cells = lambda r: {(lr, x) for lr in r.get("lrs", []) for x in r.get("seeds", [])}
  full = set().union(*(cells(r) for r in parts if not r.get("stopped_at")))
  return [r for r in parts if not (r.get("stopped_at") and cells(r) and cells(r) <= full)]


def join_lr_jobs(s: Settings, method: str, length: int, parts: list) -> dict:
  """One (method, length) result from the results of jobs that trained disjoint parts of its
  lr x seed grid (--lrs, --seeds; a single part is returned as is): finals and curves put in
  the sweep's order (model m = lr index * seeds + seed), seconds = the longest job's. The
  parts must cover every (lr, seed) of the sweep once and hold the same evaluation steps."""
  sweep, seeds = list(method_lrs(s, method)), list(s.seeds)
  cells, got = {}, []  # (lr index, seed) -> [(part, the model's index in the part)]
  for p, r in enumerate(parts):
    lrs, ss = r.get("lrs", sweep), r.get("seeds", seeds)
    for a, lr in enumerate(lrs):
      for b, seed in enumerate(ss):
        got.append((lr, seed))
        i = next((i for i, x in enumerate(sweep) if math.isclose(x, lr)), None)
        cells.setdefault((i, seed), []).append((p, a * len(ss) + b))
  if (set(cells) != {(i, x) for i in range(len(sweep)) for x in seeds}
      or any(len(at) > 1 for at in cells.values())):
    raise ValueError(f"--merge: the {method}/{length} jobs trained (lr, seed) {got}, not the "
                     f"sweep's lrs {sweep} x seeds {seeds} once each")
  if len(parts) == 1:
    return parts[0]
  steps = {tuple(r["curves"]["step"]) for r in parts}
  if len(steps) != 1:
    raise ValueError(f"--merge: the {method}/{length} jobs evaluated at different steps "
                     f"{sorted(steps)} (one stopped early: rerun it)")
  order = [cells[i, x][0] for i in range(len(sweep)) for x in seeds]
  pick = lambda rows_of: [rows_of(p)[k] for p, k in order]
  return {"final": {sem: pick(lambda p: parts[p]["final"][sem]) for sem in parts[0]["final"]},
          "curves": {"step": parts[0]["curves"]["step"],
                     **{key: [pick(lambda p: parts[p]["curves"][key][e])
                              for e in range(len(parts[0]["curves"]["step"]))]
                        for key in ("loss", "acc")}},
          "lrs": sweep, "seeds": seeds,
          "stopped_at": next((r["stopped_at"] for r in parts if r.get("stopped_at")), None),
          "seconds": max(r["seconds"] for r in parts)}


# The GPU plan (bench/match_segmented_gpu.sh): jobs of (method, length, lrs, seeds), packed on
# the GPUs of one host, several a GPU, in calls of `timeout 480` (--deadline_s=440).
#
# STEP_MS: estimated GPU milliseconds one model's training step adds to its GPU (width 128,
# batch 64, evaluations included), ADDITIVE over the jobs sharing a GPU (their kernels take
# turns). 64 / 128: the one-H100 check of the h100 preset (d8709b8): 6 models (2 lrs x 3 seeds)
# a job, 3 jobs on one H100, 12,800 steps in 221-249 s at either length: 249 s / 12,800 / 18
# models = 1.08 ms; MATCH / random x2.5 (the 4-H200 run at ca50048, width 64: their per-model
# pace over full's / SWA's at 64 and 128: 1.9-2.5). 512: SWA's 12-model job of that run alone on
# its H200 for its last 800 steps, 80 ms a step = 6.7 ms a model at width 64, x1.23 for width
# 128 (XLA's bytes accessed of the compiled step, width 128 / 64, compiled on CPU) = 8.2; full
# attention x1.5 (its job on the same run: 133 s for its first 400 steps against SWA's 97 s);
# MATCH / random x1.9 (that run's per-model pace against SWA's at 512). 256: 512's x the compiled
# step's bytes accessed at 256 / 512 (full and SWA 0.35, MATCH and random 0.49). Estimates,
# conservative (the 64 / 128 anchor counts a shared GPU's whole time against its jobs); a call's
# logs show the real paces: update this table, then re-plan what is left (--done).
# Call 1 of the sweep (8aff63a, 4 H200s, one MATCH and one full job a GPU at 512) measured 512:
# MATCH alone 22.5-23 ms a step once full's job had ended, 44 ms beside it, full 22 ms beside
# MATCH, so full alone ~10.6 ms (additive); the MATCH jobs stopped at step 10,000 of 12,800 at
# their deadline. 512's MATCH / random -> 24 (x1.54), full -> 12.3 kept (conservative), and 256's
# MATCH / random scaled by the same x1.54 (11.7). Linear in a job's models: a probe on one H100
# (200d654, 512, lr 1e-3, steps 400-800) ran one MATCH model at 27.5 ms a step and three vmapped
# at 75 ms (25 a model; logs: bench/results/mqar_units/pace_probe_h100_20261127.tgz): the GPU is
# busy, vmapping saves nothing.
# The h100 preset runs MATCH / random on attention_path='block_sparse' from call 3 (958225f on):
# a probe on one H100 (512, lr 1e-3, seed 0, steps 400-800, one model a GPU; logs:
# bench/results/mqar_units/pace_probe_paths_h100_20261127.tgz) took 10 s for those 400 steps on
# the gathered path (25 ms a step), 4 s on block_sparse (10 ms; loss at step 800 0.213 vs 0.212,
# accuracy 0.971 both) and 4 s for full attention: MATCH / random 512 -> 13.0 (full's 12.3 and a
# margin for the retrieval scoring), 256 -> 5.2 (full's 4.3 x 1.2); 64 / 128 kept (not probed).
# Calls 3 and 4 (afca99a, 1359620; 4 H200s, two one-model jobs a GPU at 512; logs in
# bench/results/mqar_units/mqar_jobs_20261127175450.tgz / _180424.tgz): steps 400-12,800 took
# 233-237 s for MATCH, random and full alike, 9.5 ms a model-step additive (evaluations
# included): 512 -> 11.5 for all three (x1.2 for an H100 or a slower machine).
# Call 5 (3b08907, 4 H100s; bench/results/mqar_units/mqar_jobs_20261128024229.tgz): full 512
# (two jobs a GPU beside one MATCH 256 job) ran steps 400-12,400 at 27.8 ms a GPU-step against
# 28.2 estimated (kept), but SWA 256 (three 3-seed jobs on one GPU) at 36.8 ms = 4.1 ms a model
# against 2.9 estimated: 256's SWA and full -> 4.5 (4.1 and a margin; SWA costs full's here),
# 512's SWA -> full's 11.5 (its bytes-based 8.2 scaled by the same x1.41). Every job of that call
# but MATCH's stopped at its deadline (12,400 / 8,800 of 12,800 steps): 12 jobs starting at once
# spent ~60 s before their training clocks started, so JOB_OVERHEAD_S 70 -> 110.
STEP_MS = {64: dict(full=1.1, swa=1.1, match=2.7, random=2.7),
           128: dict(full=1.1, swa=1.1, match=2.7, random=2.7),
           256: dict(full=4.5, swa=4.5, match=5.2, random=5.2),
           512: dict(full=11.5, swa=11.5, match=11.5, random=11.5)}
# Seconds a job spends besides its training steps: the imports, its rows read (--make_data made
# them), the compiles, MATCH's decode-semantics evaluation at the end, and --deadline_s's margin
# (a training stops at an evaluation unless 1.5 x the next 400 steps + 20 s still fit).
JOB_OVERHEAD_S = 110.0
# XLA_PYTHON_CLIENT_MEM_FRACTION of a job (of an 80 GiB card) by length: the compiled step +
# evaluation temporaries and arguments of the largest job the plan makes at that length, compiled
# on CPU (compiled_memory): 512 one lr (3 models, 4 a group), 256 / 128 / 64 the whole 12-model
# sweep: full 11.5 / 10.1 / 3.6 / 1.5 GiB, MATCH with its recompute evaluation 10.9 / 10.5 / 5.3
# (test_h100_preset_fits_a_shared_gpu)
MEM_FRACTION = {512: 0.17, 256: 0.16, 128: 0.08, 64: 0.04}
GPU_BUDGET_S = 440.0  # --deadline_s of every job (`timeout 480`: the device tool stops at 600 s)
JOBS_PER_GPU = 4  # as many as the measured runs shared a GPU (3 on the H100 check, 4 on H200s)


def model_seconds(s: Settings, method: str, length: int) -> float:
  """Estimated GPU seconds of one model's training (s.steps steps) at this length: STEP_MS."""
  return s.steps * STEP_MS[length][method] / 1e3


def plan_jobs(s: Settings, done=frozenset(), job_s: float | None = None) -> list:
  """The sweep as jobs: per (method, length), its (lr, seed) models not in `done` grouped so a
  job's estimated GPU seconds stay near a third of a GPU's budget (packing room): whole lrs (all
  seeds) while 3 or more models fit, else the seeds of one lr in groups (job_s: another
  target, e.g. 0.001 for one model a job). Each job: dict(method, length, lrs, seeds, models,
  work_s = its GPU seconds, cap = its memory fraction)."""
  target = job_s or (GPU_BUDGET_S - JOB_OVERHEAD_S) / 3
  jobs = []
  for length in s.lengths:
    for method in METHODS:
      w = model_seconds(s, method, length)
      m = max(1, int(target // w))
      left = [(lr, tuple(x for x in s.seeds if (method, length, lr, x) not in done))
              for lr in method_lrs(s, method)]
      whole = [lr for lr, xs in left if len(xs) == len(s.seeds)]
      per_job = m // len(s.seeds)
      groups = ([(tuple(whole[i:i + per_job]), tuple(s.seeds))
                 for i in range(0, len(whole), per_job)] if per_job else [])
      for lr, xs in left:
        if xs and not (per_job and lr in whole):
          groups += [((lr,), xs[i:i + m]) for i in range(0, len(xs), m)]
      for lrs, seeds in groups:
        jobs.append(dict(method=method, length=length, lrs=list(lrs), seeds=list(seeds),
                         models=len(lrs) * len(seeds), work_s=round(len(lrs) * len(seeds) * w, 1),
                         cap=MEM_FRACTION[length]))
  return jobs


def gpu_plan(s: Settings, gpus: int, done=frozenset(), job_s: float | None = None) -> list:
  """Device calls, each a list of jobs with their GPU (job["gpu"]): first fit decreasing (the
  longest jobs first, each into the first call and GPU where the GPU's summed work stays within
  GPU_BUDGET_S - JOB_OVERHEAD_S, its jobs within JOBS_PER_GPU and its memory fractions within
  0.9), so the short jobs fill the long ones' GPUs. job["est_s"]: the estimated seconds until
  the job's GPU finishes all its jobs (its own end, when its GPU's jobs are similar)."""
  room = GPU_BUDGET_S - JOB_OVERHEAD_S
  calls = []  # [call][gpu] -> jobs
  jobs = plan_jobs(s, done, job_s)
  for job in sorted(jobs, key=lambda j: -j["work_s"]):  # stable: the sweep's order within ties
    if job["work_s"] > room:
      raise ValueError(f"a job of one model passes a call's budget: {job}")
    for c in calls + [None]:
      if c is None:
        c = [[] for _ in range(gpus)]
        calls.append(c)
      g = next((g for g, on in enumerate(c)
                if sum(j["work_s"] for j in on) + job["work_s"] <= room
                and len(on) < JOBS_PER_GPU
                and sum(j["cap"] for j in on) + job["cap"] <= 0.9), None)
      if g is not None:
        c[g].append(dict(job, gpu=g))
        break
  out = []
  for c in calls:
    for on in c:
      for j in on:
        j["est_s"] = round(JOB_OVERHEAD_S + sum(x["work_s"] for x in on))
    out.append([j for on in c for j in on])
  return out


def job_name(j: dict) -> str:
  """The job's file stem: mqar_<method>_<length>_<lrs>_<seeds> (lrs and seeds joined by '-')."""
  return (f"mqar_{j['method']}_{j['length']}_{'-'.join(map(str, j['lrs']))}"
          f"_s{'-'.join(map(str, j['seeds']))}")


def done_models(paths) -> set:
  """(method, length, lr, seed) of the models the progress files hold a finished training of
  (not stopped early): what a re-plan (--done) leaves out."""
  out = set()
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    for m, by in data.get("per", {}).items():
      for n, r in by.items():
        if not r.get("stopped_at"):
          out |= {(m, int(n), lr, x) for lr in r["lrs"] for x in r.get("seeds", data[
              "settings"]["seeds"])}
  return out


def format_plan(s: Settings, calls: list) -> str:
  """The plan as text: per call, per GPU, its jobs and estimated seconds; the totals."""
  lines = []
  for k, c in enumerate(calls, 1):
    gpus = sorted({j["gpu"] for j in c})
    lines.append(f"call {k}: {len(c)} jobs, GPU finishes (est.) "
                 + ", ".join(f"{g}: {max(j['est_s'] for j in c if j['gpu'] == g)} s" for g in gpus))
    for g in gpus:
      lines.append(f"  GPU {g}: " + "; ".join(
          f"{j['method']} {j['length']} lr {','.join(map(str, j['lrs']))} seeds "
          f"{','.join(map(str, j['seeds']))} ({j['work_s']:.0f} s)" for j in c if j["gpu"] == g))
  work = sum(j["work_s"] for c in calls for j in c)
  lines.append(f"{len(calls)} calls, {sum(map(len, calls))} jobs, {work:.0f} GPU-s of training "
               f"(STEP_MS) at {s.steps} steps; every job under timeout 480, --deadline_s=440")
  return "\n".join(lines)


START = time.time()  # the process's start (as `timeout` counts it, up to the imports)
FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "cpu", sorted(PRESETS), "sweep size", flag_values=FLAGS)
flags.DEFINE_integer("steps", None, "training steps (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_list("lengths", None, "row lengths (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_string("progress", None, "JSON file of the partial results, rewritten as they come",
                    flag_values=FLAGS)
flags.DEFINE_list("methods", None, f"methods to train (default: all of {list(METHODS)})",
                  flag_values=FLAGS)
flags.DEFINE_integer("data_workers", 1, "processes making the training rows", flag_values=FLAGS)
flags.DEFINE_float("deadline_s", None, "seconds after the start by which a training stops at "
                   "an evaluation (recorded as stopped_early), so that a time-limited job still "
                   "writes its progress", flag_values=FLAGS)
flags.DEFINE_list("lrs", None, "train only these of each method's swept lrs (one job of a sweep "
                  "split over processes; --merge joins the jobs)", flag_values=FLAGS)
flags.DEFINE_list("seeds", None, "train only these of the preset's seeds (one job of a sweep "
                  "split by seed; --merge joins the jobs)", flag_values=FLAGS)
flags.DEFINE_string("data_dir", None, "directory of the MQAR rows: read when saved there "
                    "(--make_data), else made and saved", flag_values=FLAGS)
flags.DEFINE_boolean("make_data", False, "make the rows of the preset's (or --lengths') jobs "
                     "under --data_dir, then stop (one process a device call, before its jobs)",
                     flag_values=FLAGS)
flags.DEFINE_integer("plan", None, "print the preset's GPU plan for this many GPUs (calls, jobs "
                     "a GPU, estimated seconds: gpu_plan), then stop", flag_values=FLAGS)
flags.DEFINE_integer("plan_jobs", None, "with --plan: print call N's jobs, one a line: "
                     "gpu method length lrs seeds memory-fraction estimated-s (for "
                     "bench/match_segmented_gpu.sh)", flag_values=FLAGS)
flags.DEFINE_float("plan_job_s", None, "with --plan: the GPU seconds a job aims at (default a "
                   "third of a GPU's budget; 0.001: one model a job)", flag_values=FLAGS)
flags.DEFINE_list("done", None, "with --plan: progress files of finished jobs (earlier calls); "
                  "their models are left out of the plan", flag_values=FLAGS)
flags.DEFINE_enum("attention_path", None, list(ATTENTION_PATHS), "MATCH / random: "
                  "how 'window OR retrieved chunks' runs (default: the preset's; Settings)",
                  flag_values=FLAGS)
flags.DEFINE_list("merge", None, "progress files to merge into one result (no training): runs "
                  "of this preset over disjoint lengths", flag_values=FLAGS)


def main(argv=None):
  a = common.parse_flags(FLAGS, argv)
  s = PRESETS[a.preset]
  if a.steps:
    s = dataclasses.replace(s, steps=a.steps)
  if a.lengths:
    s = dataclasses.replace(s, lengths=tuple(int(x) for x in a.lengths))
  if a.attention_path:
    s = dataclasses.replace(s, attention_path=a.attention_path)
  if a.plan:
    calls = gpu_plan(s, a.plan, done_models(a.done or ()), a.plan_job_s)
    if a.plan_jobs is None:
      print(format_plan(s, calls))
    else:
      for j in (calls[a.plan_jobs - 1] if a.plan_jobs <= len(calls) else []):
        print(j["gpu"], j["method"], j["length"], ",".join(map(str, j["lrs"])),
              ",".join(map(str, j["seeds"])), j["cap"], job_name(j), j["est_s"])
    return
  global DATA_WORKERS, DATA_DIR, DEADLINE, LRS, SEEDS
  DATA_WORKERS = a.data_workers
  DATA_DIR = a.data_dir
  if a.make_data:
    if not DATA_DIR:
      raise SystemExit("--make_data needs --data_dir")
    make_data(s)
    return
  LRS = None if a.lrs is None else tuple(float(x) for x in a.lrs)
  SEEDS = None if a.seeds is None else tuple(int(x) for x in a.seeds)
  DEADLINE = None if a.deadline_s is None else START + a.deadline_s
  methods = tuple(a.methods or METHODS)
  if set(methods) - set(METHODS):
    raise SystemExit(f"--methods={a.methods}: choose from {list(METHODS)}")
  result = (merge_progress(s, a.merge) if a.merge
            else run(s, methods=methods, progress=a.progress))
  result["preset"] = a.preset
  out = common.result_path("match_mqar", a.out_dir, device=result["device"],
                           fixed=FILES.get(a.preset))
  common.write_result(out, "match_mqar", result, name=f"sweep_{a.preset}")
  print(json.dumps(result["summary"]), "criteria:", result.get("criteria"),
        "verdict:", result.get("verdict"))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
