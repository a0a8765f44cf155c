r"""`make demo`: conditional attention at work, on this CPU, in a few minutes.

  python scripts/demo.py [--scheme=l2a] [--workdir=/tmp/condattn_demo] [--steps=N] [--preset=ci]
  make demo [SCHEME=l2a] [DEMO_DIR=/tmp/condattn_demo]
  make demo SCHEME=all          # every section, each into DEMO_DIR/<scheme> (or SCHEME=a,b)

One section per scheme (SECTIONS): it starts from a small dense model that solves a long-range
recall task, converts it to the scheme, trains the scheme's recipe and prints, from this run,
what the conversion bought and what it cost (accuracy, the fraction of tokens that skip the
expensive attention, per layer, against baselines at the same sparsity), writes the run's
metrics (JSON) and a per-layer plot (PNG) into --workdir, prints the commands that do the same on
a real checkpoint, and exits 1 when one of the section's claims does not hold (`--preset=ci`, what
the tests run: the same claims, fewer steps where the full run's margin is large: CI_PRESET). A
new scheme adds a function `<scheme>_section(args) -> Section` and an entry in SECTIONS.

L2A (the default): bench/l2a_learning.py's `demo` preset; the dense model is
tests/fixtures/l2a/mqar_dense.npz (trained by that bench's full run).
AHA (--scheme=aha): bench/aha_window_sweep.py's `demo` preset at window 16; the dense model is
tests/fixtures/aha/fused_recall_dense.npz (the preset's 300 dense steps at seed 0).
Segmented (--scheme=segmented): bench/segmented_fidelity.py's task and 'cpu' preset (one seed):
aligned vs misaligned fine-tunes of a dense model (tests/fixtures/segmented/), served segmented,
against full attention; the serving memory (inference.Engine) at two context lengths.
Elastic (--scheme=elastic): bench/elastic_repro.py's InstructedRecall tasks and 'per_task' arm on
a dense model (tests/fixtures/elastic/); controls: every head SSA, the instruction swapped or
hidden.
MATCH (--scheme=match): bench/match_mqar.py's MQAR models at length 64 (SWA, MATCH, random
retrieval), held-out answers within / beyond the window.
The AHA, segmented and Elastic fixtures are made by `--dense_from_scratch` (written to
<workdir>/dense.npz).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import shutil
import sys
import textwrap
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

MARKER = ".condattn_demo"
METRICS = "demo_metrics.json"
DENSE_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "l2a", "mqar_dense.npz")
SEGMENTED_DENSE = os.path.join(ROOT, "tests", "fixtures", "segmented", "recall_copy_dense.npz")
ELASTIC_DENSE = os.path.join(ROOT, "tests", "fixtures", "elastic", "instructed_recall_dense.npz")
AHA_DENSE = os.path.join(ROOT, "tests", "fixtures", "aha", "fused_recall_dense.npz")
ELASTIC_TARGETS = (0.5, 1.0)  # target Omega of the recall and recent rows
# Router and multiplier lrs of the Elastic section: at the bench's (1e-2, 3e-2) the router's
# logits saturate within ~50 steps, before the multipliers grow (a run here: Omega 48% / 62%,
# gap 14 points, unchanged from step 100 to 300); at these the gap was 36 points in 300 steps.
ELASTIC_LRS = dict(router_lr=3e-3, lambda_lr=0.1)

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/condattn_demo", "Where the demo writes its "
                               "metrics and plot (re-created on every run).")
_SCHEME = flags.DEFINE_string("scheme", "l2a", "Which scheme's demo section to run: one of "
                             "SECTIONS, a comma-separated list, or 'all' (every section, each "
                             "into <workdir>/<scheme>).")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps of the scheme's phase (default: "
                              "the section's own, which its claims are made for).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data streams and training.")
_PRESET = flags.DEFINE_enum(
    "preset", "full", ["full", "ci"], "full: the run each section's claims are made for (`make "
    "demo`); ci: the CI-sized run of tests/cli/test_demo*.py, the same claims with fewer "
    "training steps where the full run's margin is large (CI_PRESET).")
_DENSE_FROM_SCRATCH = flags.DEFINE_boolean(
    "dense_from_scratch", False, "Segmented and Elastic: train the dense model in the run "
    "(minutes more) instead of loading its fixture (tests/fixtures/<scheme>/), which that "
    "training made; written to <workdir>/dense.npz.")


# --preset=ci: per section, the settings that differ from the full run. Only steps of phases
# whose measured values sit far from the claims' limits shrink; every claim is checked as in the
# full run and can still fail (see each entry).
CI_PRESET: dict[str, dict[str, Any]] = {
    # the context-free and local-only baselines: 200 steps instead of 600 (L2A keeps its 600).
    # Their accuracy is flat from step 200 on (seed 0, held out: context-free 14.5% after 200
    # steps, 13.3% after 600; local only 6.4% / 6.7%; train accuracy 14.2% at step 200, 13.7%
    # at 600) against limits of L2A - 20 points (~80%) and 20%; L2A itself passes 55% train
    # accuracy by step 200, so a baseline that could route by content would show it.
    "l2a": dict(baseline_steps=200),
    # AHA: 200 AHA steps instead of 300 (seed 0, this host). 300 steps: mu_f 2.1% (limit 25%),
    # usage at the queries 28.1% vs 0.4% elsewhere (limit 5x: 2.0%), AHA 100% vs dense 100%
    # (limit -3 points), every head local 63.0% (limit AHA - 20 = 80%); 200 steps: mu_f 3.2%,
    # 29.7% vs 1.4% (limit 7.0%), 100%, local 63.0%; tau 0.3 / 0.5 / 0.7: mu_f 50.0% / 3.2% /
    # 0.0%. At 150 steps the usage claim fails (34.4% vs 7.0%, needs 5x), so the claim can
    # still fail.
    "aha": dict(aha_steps=200),
    # Elastic: 200 router steps (the whole schedule) instead of 300. 300: Omega gap 36.6 points
    # (limit 25), swapped -38.1 (limit -18.3), hidden |-3.0| (limit 9.2), recall 77.7% vs every
    # head SSA 3.9% (limit +40 points); 200: gap 41.2 (limit 25), swapped -42.3 (limit -20.6),
    # hidden |-2.4| (limit 10.3), recall 76.6%. At 150 steps the gap claim fails (18.6 points).
    "elastic": dict(router_steps=200),
    # Not shrunk (measured, seed 0): L2A's own 600 steps (at 400: 95.3% vs dense 99.3%, a failed
    # claim); the segmented fine-tunes' 200 steps (at 100: aligned / full-attention reference 1.17
    # and 1.24 at 2 and 4 segments, a failed claim (<= 1.10)); MATCH's own 300 steps (an earlier
    # run: 0.053 at step 200, 0.389 at 300).
}


def _preset(name: str) -> dict[str, Any]:
  """The section's overrides of its full settings under --preset (empty for 'full')."""
  return CI_PRESET.get(name, {}) if _PRESET.value == "ci" else {}


@dataclasses.dataclass
class Claim:
  """One thing the demo asserts about its own run (printed; a failed one makes exit code 1)."""
  text: str
  ok: bool


@dataclasses.dataclass
class Section:
  """What a scheme's section hands back: its metrics (JSON-ready), claims and written files."""
  metrics: dict[str, Any]
  claims: list[Claim]
  files: dict[str, str]


def bar(frac: float, width: int = 30) -> str:
  """A text bar: '#' for the fraction, '.' for the rest."""
  n = int(round(max(0.0, min(1.0, frac)) * width))
  return "#" * n + "." * (width - n)


def say(*paragraphs: str) -> None:
  """Print paragraphs wrapped at 100 columns (continuation lines indented)."""
  for p in paragraphs:
    print(textwrap.fill(p, 100, subsequent_indent="  ") if p else "", flush=True)


def pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def mib(b: int) -> str:
  return f"{b / 2**20:,.2f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"


def _fresh_workdir(path: str) -> str:
  if os.path.exists(path) and os.listdir(path):
    if not os.path.exists(os.path.join(path, MARKER)):
      raise app.UsageError(f"--workdir={path} is not empty and was not made by the demo; "
                           "choose another directory.")
    shutil.rmtree(path)
  os.makedirs(path, exist_ok=True)
  open(os.path.join(path, MARKER), "w").close()
  return path


# ----------------------------------------------------------------------------------------------
# L2A
# ----------------------------------------------------------------------------------------------
def l2a_section(workdir: str, steps: int | None, seed: int) -> Section:
  from bench import l2a_learning as bench
  import jax
  s = dataclasses.replace(bench.PRESETS["demo"], seed=seed)
  baseline_steps = _preset("l2a").get("baseline_steps", s.l2a_steps)
  if steps is not None:
    s = dataclasses.replace(s, l2a_steps=steps)
  theta_lo, theta_hi = s.thetas
  sees = "each token sees only itself" if s.window == 1 else f"the last {s.window} tokens"
  say("condattn-jax demo: L2A, learned token-level conditional global attention.", "",
      f"Task: MQAR (multi-query associative recall) in {s.seq_len}-token rows: {s.num_pairs} "
      f"key-value pairs, then queries of the keys at least {s.min_gap} tokens later; the model "
      "must answer each query key with its value.",
      f"Dense model: a {s.num_layers}-layer qwen2-style decoder (width {s.hidden_size}) with full "
      f"attention that solves it ({os.path.relpath(DENSE_FIXTURE, ROOT)}).",
      f"L2A: every layer keeps local attention (window {s.window}: {sees}) and runs global "
      "attention only for the tokens whose router score p >= theta. Converted from the dense "
      "model (both branches copied, zero router: every token global), then trained for "
      f"{s.l2a_steps} steps with the L2A recipe: attention, norms and router trainable (FFN and "
      f"embeddings frozen), forced-global steps (p_force {s.p_force}), regulariser "
      f"lambda * mean p^2 at 0 for the first {s.lambda_warmup_frac:.0%} of the steps, then "
      f"ramped to {s.lambda_max}.",
      f"Baselines, trained the same way for {baseline_steps} steps: "
      "context-free routing (each token global with the probability L2A ended at, i.e. the same "
      "sparsity) and local attention only.",
      f"Devices: {jax.device_count()} x {jax.devices()[0].platform}, jax {jax.__version__}. Log "
      f"every {s.log_every} steps:", "")
  res = bench.run_experiment(s, log=lambda m: print("  " + m, flush=True),
                             dense_params=DENSE_FIXTURE, baseline_steps=baseline_steps)
  dense, acc = res["dense_accuracy"], res["l2a_accuracy"]
  sp, layers = res["l2a_sparsity"], res["l2a_layer_sparsity"]
  cf, cf_sp, local = res["context_free_accuracy"], res["context_free_sparsity"], \
      res["local_only_accuracy"]
  n = s.eval_examples * s.num_pairs
  rows = [("dense (full attention)", dense, 0.0),
          ("converted, step 0 (every token global)", res["converted_accuracy"], 0.0),
          (f"L2A, theta {theta_lo}", acc, sp),
          (f"L2A, theta {theta_hi} (test-time knob)", res["theta_sweep"][str(theta_hi)]["accuracy"],
           res["theta_sweep"][str(theta_hi)]["sparsity"]),
          ("context-free routing, same sparsity", cf, cf_sp),
          (f"local only (window {s.window})", local, res["local_only_sparsity"])]
  print(f"\nHeld-out answer accuracy ({n} answers) and sparsity (tokens skipping global "
        "attention):\n")
  print("| model | answer accuracy | sparsity |\n|---|---|---|")
  for name, a, x in rows:
    print(f"| {name} | {pct(a)} | {pct(x)} |")

  print(f"\nPer-layer sparsity of L2A at theta {theta_lo} (# = skips global attention):")
  roles = res.get("l2a_global_rate_by_role") or [{} for _ in layers]
  for i, (x, r) in enumerate(zip(layers, roles)):
    goes = ", ".join(f"{k} {pct(v)}" for k, v in r.items())
    print(f"  layer {i} |{bar(x)}| {pct(x)}   global for: {goes}")
  th = res["theta_sweep"][str(theta_hi)]
  print(f"  at theta {theta_hi}: " + ", ".join(f"layer {i} {pct(x)}" for i, x in
                                              enumerate(th["layer_sparsity"])))

  pr = res["pruning"]
  print(f"\nKV cache (K and V, batch 1; a layer keeps a {s.window}-slot window ring, plus a full "
        "cache unless pruned):")
  for ctx, kv in pr["kv_bytes"].items():
    print(f"  {int(ctx):>7} tokens: dense {mib(kv['dense'])}, L2A {mib(kv['l2a'])}, after pruning "
          f"{mib(kv['l2a_pruned'])}")
  if pr["pruned_layers"]:
    print(f"  pruned layers (sparsity >= {pr['threshold']}): {pr['pruned_layers']}, accuracy "
          f"after pruning {pct(pr['accuracy_after'])}")
  else:
    say(f"  no layer reaches sparsity {pr['threshold']}: pruning removes nothing here (every "
        "layer routes some tokens global); the saving of this run is compute: "
        f"{pct(sp)} of the tokens skip global attention.")

  loss = 100 * (dense - acc)
  verb = f"loses {loss:.1f} points" if loss > 0 else f"gains {-loss:.1f} points"
  verdict = (f"L2A skips global attention for {pct(sp)} of tokens and {verb} of answer accuracy "
             f"({pct(dense)} -> {pct(acc)}); context-free routing at the same sparsity gets "
             f"{pct(cf)}, local attention alone {pct(local)}.")
  claims = [
      Claim(f"sparsity {pct(sp)} >= 60%", sp >= 0.6),
      Claim(f"L2A accuracy {pct(acc)} within 3 points of dense {pct(dense)}", acc >= dense - 0.03),
      Claim(f"context-free routing at the same sparsity ({pct(cf_sp)}) clearly worse: "
            f"{pct(cf)} <= L2A - 20 points", abs(cf_sp - sp) < 0.05 and cf <= acc - 0.2),
      Claim(f"local attention alone cannot answer: {pct(local)} <= 20%", local <= 0.2),
  ]
  from condattn_jax.attention.l2a import report as l2a_report
  png = l2a_report.plot_layer_sparsity(
      dict(layer_sparsity=layers, pruned_layers=pr["pruned_layers"], threshold=pr["threshold"],
           theta=theta_lo), os.path.join(workdir, "l2a_layer_sparsity.png"))
  real = "configs/l2a_qwen.py:qwen2.5-1.5b"
  fields = ("--config.model.init_from=/ckpt/Qwen2.5-1.5B "
            "--config.data.tokenizer=/ckpt/Qwen2.5-1.5B --config.data.paths='/data/long/*.jsonl'")
  commands = [
      f"python train.py --config={real} --workdir=DIR {fields}",
      f"python eval.py --checkpoint=DIR --config.model.scheme.theta={theta_hi}",
      f"python train.py --config={real},routing=bernoulli,q={res['context_free_q']:.2f} "
      f"--workdir=DIR_CF {fields}",
      f"python scripts/l2a_prune.py --config={real} --checkpoint=DIR --context_len=131072 "
      f"--threshold=0.95 {fields}",
  ]
  metrics = dict(res, verdict=verdict, commands=commands)
  return Section(metrics=metrics, claims=claims, files={"per-layer sparsity plot": png})


# ----------------------------------------------------------------------------------------------
# AHA
# ----------------------------------------------------------------------------------------------
def aha_section(workdir: str, steps: int | None, seed: int) -> Section:
  """bench/aha_window_sweep.py's `demo` preset at one window: a dense OLMo-2-shaped (post-norm)
  decoder learns fused recall (facts at log-uniform distances: a long tail), is converted to AHA
  (every head full at step 0) and trained with the AHA loss; each (token, head) then runs full
  attention or the local window."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from bench import aha_window_sweep as sweep
  from condattn_jax import attention
  from condattn_jax.attention.aha import report as aha_report
  from condattn_jax.models.decoder import Decoder
  s = dataclasses.replace(sweep.PRESETS["demo"], seed=seed, **_preset("aha"))
  if steps is not None:
    s = dataclasses.replace(s, aha_steps=steps)
  w = s.windows[0]
  task = sweep.FusedRecall(s)
  cfg = sweep.base_config(s, task)
  say(f"AHA demo: a {s.num_layers}-layer, {s.num_heads}-head OLMo-2-shaped decoder on fused "
      f"recall ({s.seq_len} tokens, {s.num_queries} queries a row, each fact log-uniformly "
      f"1..{s.seq_len - 2} tokens before its query: {pct(1 - np.log(w) / np.log(s.seq_len - 2))} "
      f"of them beyond a {w}-token window). A dense model that solves it ({s.dense_steps} "
      f"steps of full attention), converted to AHA (window {w}, tau {s.tau}, lambda {s.lam}) "
      f"and trained {s.aha_steps} AHA steps.", "")
  log = lambda m: print("  " + m, flush=True)

  def train_dense():
    init = nn.unbox(Decoder(cfg).init(jax.random.key(s.seed),
                                      jnp.zeros((1, s.seq_len), jnp.int32))["params"])
    return sweep.train(cfg, init, task, steps=s.dense_steps, lr=s.dense_lr, phase=0,
                       name="dense", log=log)[0]
  dense_p, source = _dense_params(workdir, AHA_DENSE, train_dense,
                                  f"{s.dense_steps} steps of full attention")
  print(f"Dense model: {source}.", flush=True)
  d = sweep.evaluate(cfg, dense_p, task, (w,))
  acfg, ap = attention.convert(dense_p, cfg, "aha", window=w, tau=s.tau, lam=s.lam,
                                    router_bias_init=s.router_bias_init)
  local = sweep.evaluate(attention.configure(acfg, "aha", routing="none"), ap, task, (w,))
  params, hist = sweep.train(acfg, ap, task, steps=s.aha_steps, lr=s.aha_lr, phase=1,
                             name=f"aha w={w}", router_lr=s.router_lr, log=log)
  r = sweep.evaluate(acfg, params, task, (w,))
  knob = {t: sweep.evaluate(attention.configure(acfg, "aha", tau=t), params, task, (w,)) for t in (0.3, 0.7)}
  ev = task.batch(0, s.eval_rows, stream=1)
  ev.pop("distance")
  batches = [{k: v[i:i + 64] for k, v in ev.items()} for i in range(0, s.eval_rows, 64)]
  rep = aha_report.usage_report(Decoder(acfg), params, batches, out_dir=workdir, name="aha_usage")

  acc, dense, mu = r["accuracy"], d["accuracy"], r["mu_f"]
  print(f"\nAnswer accuracy on {r['queries']} held-out queries:")
  print(f"  dense                      {pct(dense)}")
  print(f"  AHA                        {pct(acc)}  (facts beyond the window: "
        f"{pct(r[f'accuracy_beyond_{w}'])})")
  print(f"  same model, every head local (window {w}) at conversion: {pct(local['accuracy'])}  "
        f"(beyond the window: {pct(local[f'accuracy_beyond_{w}'])})")
  print(f"\nFull-attention usage mu_f (fraction of (token, head) pairs that pay for full "
        f"attention): {pct(mu)}; at the query tokens {pct(r['usage_at_queries'])}, elsewhere "
        f"{pct(r['usage_elsewhere'])}")
  for li, row in enumerate(rep["usage"]):
    print(f"  layer {li}: " + "  ".join(f"h{h} {bar(u, 10)} {pct(u):>6}" for h, u in enumerate(row)))
  print("\nThe threshold tau is a test-time knob (same weights):")
  for t, k in [(0.3, knob[0.3]), (s.tau, r), (0.7, knob[0.7])]:
    print(f"  tau {t}: mu_f {pct(k['mu_f'])}, accuracy {pct(k['accuracy'])}")
  ctx = 131072
  kv = aha_report.kv_cache_bytes(acfg, ctx)["total"]
  keys = mu * ctx + (1 - mu) * w
  say("", f"At {ctx} tokens of context a decode step's attention reads mu_f * {ctx} + "
      f"(1 - mu_f) * {w} keys per head on average: {pct(keys / ctx)} of what dense attention "
      f"reads. AHA keeps one shared KV cache ({mib(kv)} here, the same as dense): its saving is "
      "attention compute and memory traffic, not cache size.")
  loss = 100 * (dense - acc)
  verb = (f"loses {loss:.1f} points" if loss >= 0.05 else f"gains {-loss:.1f} points"
          if loss <= -0.05 else "keeps all")
  verdict = (f"AHA runs full attention for {pct(mu)} of (token, head) pairs (a {w}-token window "
             f"for the rest) and {verb} of answer accuracy ({pct(dense)} -> {pct(acc)}); the same "
             f"heads all local get {pct(local['accuracy'])}.")
  claims = [
      Claim(f"the dense model solves the task: {pct(dense)} >= 95%", dense >= 0.95),
      Claim(f"AHA accuracy {pct(acc)} within 3 points of dense {pct(dense)}", acc >= dense - 0.03),
      Claim(f"full attention for at most 25% of (token, head) pairs: {pct(mu)}", mu <= 0.25),
      Claim(f"local attention alone cannot answer: {pct(local['accuracy'])} <= AHA - 20 points",
            local["accuracy"] <= acc - 0.2),
      Claim(f"the router pays for full attention where recall happens: usage at queries "
            f"{pct(r['usage_at_queries'])} >= 5 x elsewhere {pct(r['usage_elsewhere'])}",
            r["usage_at_queries"] >= 5 * r["usage_elsewhere"]),
  ]
  real = "configs/aha_olmo.py"
  fields = ("--config.model.init_from=/ckpt/OLMo-2-0425-1B-SFT "
            "--config.data.tokenizer=/ckpt/OLMo-2-0425-1B-SFT "
            "--config.data.paths='/data/tulu-3-sft/*.jsonl'")
  commands = [f"python train.py --config={real} --workdir=DIR {fields}",
              "python eval.py --checkpoint=DIR --config.model.scheme.tau=0.7"]
  metrics = dict(settings=dataclasses.asdict(s), dense_source=source, dense=d,
                 aha={k: v for k, v in r.items()},
                 local_only_at_conversion=local, tau_knob={str(t): k for t, k in knob.items()},
                 usage=rep["usage"], aha_history=hist, verdict=verdict, commands=commands)
  return Section(metrics=metrics, claims=claims,
                 files={"layer x head usage heatmap": rep["png"], "usage report": rep["json"]})


# ----------------------------------------------------------------------------------------------
# Dense models of the fixtures (AHA, segmented, Elastic)
# ----------------------------------------------------------------------------------------------
def _dense_params(workdir: str, fixture: str, train: Callable[[], Any], what: str):
  """The section's trained dense model: the committed `fixture` (an npz of
  bench.l2a_learning.save_params, made by `train`), or with --dense_from_scratch `train()` here
  (minutes more), saved to <workdir>/dense.npz (copy it over the fixture to renew it)."""
  from bench import l2a_learning
  if _DENSE_FROM_SCRATCH.value or not os.path.exists(fixture):
    print(f"Training the dense model ({what}) from scratch; the fixture "
          f"{os.path.relpath(fixture, ROOT)} is this training's result.", flush=True)
    params = train()
    l2a_learning.save_params(params, os.path.join(workdir, "dense.npz"))
    return params, "trained in this run"
  return l2a_learning.load_params(fixture), os.path.relpath(fixture, ROOT)


# ----------------------------------------------------------------------------------------------
# Segmented
# ----------------------------------------------------------------------------------------------
def _prefill_memory(cfg, params, cache_len: int, chunk: int | None) -> dict[str, int]:
  """What serving a `cache_len`-token prompt holds (inference.Engine): the cache bytes and the
  compiled prefill step's temporaries (XLA memory analysis) at chunk `chunk` (None: one shot)."""
  import jax.numpy as jnp
  from condattn_jax.inference import Engine, cache_bytes
  eng = Engine(cfg, params, cache_len=cache_len, prefill_chunk=chunk)
  C = chunk or cache_len
  cache = eng.init_cache(1)
  ma = eng._step.lower(eng, params, cache, jnp.zeros((1, C), jnp.int32),
                       jnp.zeros((1, C), jnp.int32), jnp.ones((1, C), bool),
                       jnp.zeros((1, cfg.vocab_size), jnp.float32)).compile().memory_analysis()
  return dict(cache=cache_bytes(cache), step_temp=int(ma.temp_size_in_bytes))


def segmented_section(workdir: str, steps: int | None, seed: int) -> Section:
  """bench/segmented_fidelity.py's task and models (its 'cpu' preset, one seed): a dense model
  (full attention) that learned task 'recall_copy' is fine-tuned for the same steps on the same
  batches ALIGNED (under the segmented execution it will serve with) and MISALIGNED (full
  attention); both are then served segmented, and the misaligned weights under full attention
  are the full-attention reference. Memory: inference.Engine's cache and compiled prefill step
  at two context lengths, segmented (chunk = one segment) against dense (one shot)."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from bench import segmented_fidelity as sf
  from condattn_jax.attention import segmented as sgm
  from condattn_jax.models.decoder import Decoder
  p = dict(sf.PRESETS["cpu"], seeds=1, ablations=False, eval_rows=16, eval_segs=(2, 4, 16))
  if steps is not None:
    p["ft_steps"] = steps
  g = p["seg"]
  S, M, R = g["segment_len"], g["tail_len"], g["retrieve_len"]
  cfgs = sf.model_configs(p)
  data = sf.Data(p)
  say(f"Segmented demo: a {p['layers']}-layer decoder (width {p['width']}) on "
      f"bench/segmented_fidelity.py's task 'recall_copy' in segments of S = {S} tokens: every "
      f"segment recalls keys announced in the last M = {M} tokens of the previous one (the "
      f"carried tail serves them), copies a motif inside the segment, and announces the next "
      f"segment's keys. Segmented execution: each segment attends to [tail of M = {M} ; the "
      f"segment] (local heads) or [R = {R} retrieved keys ; the segment] (the long head of "
      f"layer {list(g['long_layers'])}), never to the whole context.",
      f"The dense model (full attention, trained on rows of {p['train_segs']} segments) is "
      f"fine-tuned for {p['ft_steps']} steps twice on the same batches: ALIGNED (the segmented "
      "execution it will be served with) and MISALIGNED (full attention, then served "
      "segmented).", "")
  log = lambda m: print("  " + m, flush=True)

  def train_dense():
    init = nn.unbox(jax.vmap(lambda k: Decoder(cfgs["dense"]).init(
        k, jnp.zeros((1, 8), jnp.int32))["params"])(jax.random.split(jax.random.PRNGKey(seed), 1)))
    dense, _ = sf.train(cfgs["dense"], init, data, p, p["dense_steps"], p["lr"], 1, False)
    return jax.tree.map(lambda x: x[0], dense)
  dense1, source = _dense_params(workdir, SEGMENTED_DENSE, train_dense,
                                 f"{p['dense_steps']} steps of full attention")
  dense = jax.tree.map(lambda x: jnp.asarray(x)[None], dense1)   # the bench's seed axis
  conv = lambda q: jax.vmap(lambda x: sgm.from_dense(x, cfgs["segmented"]))(q)
  print(f"Dense model: {source}.", flush=True)
  aligned, al_loss = sf.train(cfgs["segmented"], conv(dense), data, p, p["ft_steps"], p["ft_lr"],
                              2 + seed, True)
  log(f"aligned fine-tune: final CE {float(np.mean(al_loss[-1])):.3f}")
  mis, mis_loss = sf.train(cfgs["dense"], dense, data, p, p["ft_steps"], p["ft_lr"], 2 + seed,
                           False)
  log(f"misaligned fine-tune: final CE {float(np.mean(mis_loss[-1])):.3f}")
  rows = {}
  for k in p["eval_segs"]:
    t, c = data.eval(np.random.default_rng([99, seed, k]), p["eval_rows"], k)
    rows[k] = (t[None], c[None])
  res = {"aligned/segmented": sf.evaluate(cfgs["segmented"], aligned, rows, True),
         "misaligned/segmented": sf.evaluate(cfgs["segmented"], conv(mis), rows, True),
         "misaligned/full": sf.evaluate(cfgs["dense"], mis, rows, False)}
  crit = sf.verdicts(res, p)
  ppl = {k: {n: v["ppl"][0] for n, v in d.items()} for k, d in res.items()}
  key_acc = {k: {n: v["acc"]["recall_key"][0] for n, v in d.items()} for k, d in res.items()}

  lens = [S * n for n in (2, 16)]
  one = lambda q: jax.tree.map(lambda x: x[0], q)
  mem = {T: dict(segmented=_prefill_memory(cfgs["segmented"], one(aligned), T, S),
                 dense=_prefill_memory(cfgs["dense"], one(mis), T, None),
                 segmented_parts=sgm.kv_cache_bytes(cfgs["segmented"], T))
         for T in lens}
  vis = sgm.visible_kv_length(cfgs["segmented"])

  names = {"aligned/segmented": "aligned, served segmented",
           "misaligned/segmented": "misaligned, served segmented",
           "misaligned/full": "full-attention reference (misaligned weights, full attention)"}
  segs = list(p["eval_segs"])
  print(f"\nHeld-out perplexity ({p['eval_rows']} rows a length; lower is better) and accuracy "
        "on the recall keys (copies across the segment boundary):\n")
  print("| model | " + " | ".join(f"{n} seg ({n * S} tok)" for n in segs) + " |")
  print("|---|" + "---|" * len(segs))
  for k, name in names.items():
    print(f"| {name} | " + " | ".join(f"{ppl[k][n]:.2f} ({pct(key_acc[k][n])})" for n in segs)
          + " |")
  a, f = crit["aligned_within_10pct_of_full"], crit["misaligned_2x_worse"]
  print("\nRatios at every length of >= 2 segments (the bench's pre-registered criteria):")
  print("  aligned / full-attention reference: " + ", ".join(
      f"{n} seg {v:.2f}" for n, v in a["values"].items()) + "  (<= 1.10)")
  print("  misaligned / aligned, both segmented: " + ", ".join(
      f"{n} seg {v:.2f}" for n, v in f["values"].items()) + "  (>= 2)")

  print(f"\nMemory of serving a prompt (inference.Engine, batch 1, float32): segmented prefill "
        f"runs one segment ({S} tokens) a step; dense prefills the prompt in one step.\n")
  print("| context | dense: KV cache | dense: prefill temporaries | segmented: cache | "
        "of it the pool | segmented: step temporaries |\n|---|---|---|---|---|---|")
  for T in lens:
    m = mem[T]
    print(f"| {T} tokens | {mib(m['dense']['cache'])} | {mib(m['dense']['step_temp'])} | "
          f"{mib(m['segmented']['cache'])} | {mib(m['segmented_parts']['pool'])} | "
          f"{mib(m['segmented']['step_temp'])} |")
  lo, hi = mem[lens[0]], mem[lens[1]]
  grow = lambda k, x: hi[k][x] / max(lo[k][x], 1)
  say("", f"Every attention call of the segmented model sees at most {vis:.0f} keys per head "
      f"on average (S + alpha*M + beta*(1 - alpha)*R), at any context length; dense attention "
      f"sees all of them. Only the pool (every finished segment's K/V of the long head, which "
      "retrieval searches) grows with the context.")

  L, n_tr = max(segs), p["train_segs"]
  verdict = (f"Served segmented, the aligned fine-tune has perplexity "
             f"{ppl['aligned/segmented'][n_tr]:.2f} at the training length ({n_tr * S} tokens; "
             f"full attention {ppl['misaligned/full'][n_tr]:.2f}) and "
             f"{ppl['aligned/segmented'][L]:.2f} at {L * S} tokens (full attention "
             f"{ppl['misaligned/full'][L]:.2f}); the misaligned fine-tune, served segmented, "
             f"{ppl['misaligned/segmented'][n_tr]:.2f} / {ppl['misaligned/segmented'][L]:.2f}. "
             f"The segmented prefill step's temporaries grow x{grow('segmented', 'step_temp'):.2f}"
             f" for x{lens[1] // lens[0]} the context (dense one-shot: "
             f"x{grow('dense', 'step_temp'):.1f}).")
  claims = [
      Claim("aligned within 10% of the full-attention reference at every length of >= 2 "
            "segments: " + ", ".join(f"{v:.2f}" for v in a["values"].values()), a["passed"]),
      Claim("misaligned (served segmented) >= 2x the aligned perplexity at every length of >= 2 "
            "segments: " + ", ".join(f"{v:.2f}" for v in f["values"].values()), f["passed"]),
      Claim(f"the carried tail is learned: aligned recall-key accuracy at {L} segments "
            f"{pct(key_acc['aligned/segmented'][L])} >= misaligned's "
            f"{pct(key_acc['misaligned/segmented'][L])} + 20 points",
            key_acc["aligned/segmented"][L] >= key_acc["misaligned/segmented"][L] + 0.2),
      Claim(f"the segmented prefill step's temporaries do not follow the context: "
            f"x{grow('segmented', 'step_temp'):.2f} for x{lens[1] // lens[0]} tokens (<= x1.5: "
            f"only retrieval's scores over the pool grow), dense one-shot prefill "
            f"x{grow('dense', 'step_temp'):.1f} (>= x8)",
            grow("segmented", "step_temp") <= 1.5 and grow("dense", "step_temp") >= 8),
      Claim(f"the segmented cache grows only by its pool: "
            f"{mib(hi['segmented']['cache'] - lo['segmented']['cache'])} more at {lens[1]} tokens "
            f"== the pool's {mib(hi['segmented_parts']['pool'] - lo['segmented_parts']['pool'])};"
            f" and it is at most half of dense's KV cache ({mib(hi['segmented']['cache'])} vs "
            f"{mib(hi['dense']['cache'])})",
            hi["segmented"]["cache"] - lo["segmented"]["cache"]
            == hi["segmented_parts"]["pool"] - lo["segmented_parts"]["pool"]
            and hi["segmented"]["cache"] <= hi["dense"]["cache"] / 2),
  ]
  png = _plot_lines(os.path.join(workdir, "segmented_perplexity.png"),
                    "recall_copy: held-out perplexity vs context", [n * S for n in segs],
                    {names[k]: [ppl[k][n] for n in segs] for k in names},
                    xlabel="context (tokens)", ylabel="perplexity", log=True)
  commands = [
      "python train.py --config=configs/segmented_llama.py --workdir=DIR "
      "--config.model.init_from=/ckpt/LLaMA-2-7B-32K --config.data.tokenizer=/ckpt/LLaMA-2-7B-32K "
      "--config.data.paths='/data/slimpajama/*.jsonl'",
      "python bench/segmented_fidelity.py --preset=cpu   # the pre-registered run (3 seeds, "
      "ablations)",
      "python bench/segmented_memory.py --preset=gpu     # LLaMA-2-7B shapes, one GPU"]
  metrics = dict(settings=json.loads(json.dumps(p)), dense=source, perplexity=ppl,
                 recall_key_accuracy=key_acc, evals={k: {str(n): v for n, v in d.items()}
                                                     for k, d in res.items()},
                 criteria=crit, memory={str(T): v for T, v in mem.items()},
                 visible_kv_per_head=vis,
                 final_train_ce=dict(aligned=float(np.mean(al_loss[-1])),
                                     misaligned=float(np.mean(mis_loss[-1]))),
                 verdict=verdict, commands=commands)
  return Section(metrics=metrics, claims=claims, files={"perplexity plot": png})


def _plot_lines(path: str, title: str, xs: list, series: dict[str, list[float]], *, xlabel: str,
                ylabel: str, log: bool = False) -> str:
  """A line chart (PNG), one line per series."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  for name, ys in series.items():
    ax.plot(xs, ys, marker="o", label=name)
  if log:
    ax.set_yscale("log")
  ax.set_xscale("log", base=2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------------------------
# Elastic
# ----------------------------------------------------------------------------------------------
def _instruction_rows(task, rows: dict, shown) -> dict:
  """`rows` (bench/elastic_repro.py's InstructedRecall batch) with the instruction token
  (position 0) and the question marker replaced: shown = 'swapped' (each row shows the OTHER
  task's) or 'hidden' (both a filler token). Bodies, targets and task labels are unchanged."""
  out = {k: np.array(v) for k, v in rows.items()}
  inp, t = out["inputs"], out["task"]
  e = task.s.seq_len - task.end + 1                       # the marker's position
  if shown == "swapped":
    inp[:, 0], inp[:, e] = task.instr0 + 1 - t, task.marker0 + 1 - t
  else:
    inp[:, 0] = inp[:, e] = task.filler0
  return out


def elastic_section(workdir: str, steps: int | None, seed: int) -> Section:
  """bench/elastic_repro.py's two tasks (recall: the FIRST value of a fact, far back; recent: the
  value restated inside the local window) in one vocabulary, differing only in the instruction
  token and the question marker; its 'per_task' arm (here with ELASTIC_TARGETS and
  ELASTIC_LRS): a dense model that answers both is converted to Elastic (FA-SSA), and only the
  router (which sees nothing but the pooled keys of the prompt's first and last tokens) and the
  Lagrange multipliers train, with each task's target sparsity on its own rows. Controls on the same weights: every head SSA; the
  instruction swapped between the tasks; the instruction hidden."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from bench import aha_elastic_repro_common as rc
  from bench import elastic_repro as er
  from condattn_jax.attention import configure, convert
  from condattn_jax.models.decoder import Decoder
  router_steps = steps or _preset("elastic").get("router_steps", 300)
  s = dataclasses.replace(er.PRESETS["cpu"], seeds=(seed,), arms=("per_task",),
                          targets=ELASTIC_TARGETS, router_steps=router_steps, eval_rows=256,
                          log_every=50, **ELASTIC_LRS)
  task = er.InstructedRecall(s, seed)
  cfg = er.base_config(s, task)
  L, K = s.num_layers, s.num_kv_heads
  say(f"Elastic demo: two tasks in one vocabulary, {s.seq_len}-token rows: {s.num_facts} "
      f"one-token facts (key, value) far back, each restated with ANOTHER value right before its "
      f"query. 'recall' asks for the first value (beyond the streaming heads' {s.sinks} sink + "
      f"{s.local} local tokens: needs full-attention heads); 'recent' for the restated one (the "
      "local window suffices). The two differ only in the instruction token (position 0) and "
      "the question marker before the queries.",
      f"Elastic (FA-SSA): for each row, layer and KV head ({L} x {K} decisions) a router picks "
      "full attention (FA) or streaming attention (SSA), from the mean key of the prompt's first "
      f"and last {s.boundary} tokens only. Omega = the row's fraction of SSA heads. The dense "
      f"model is converted and only the routers and the Lagrange multipliers train "
      f"({s.router_steps} steps), with target Omega {s.targets[0]} on recall rows and "
      f"{s.targets[1]} on recent rows: the router must read the instruction to tell them "
      "apart.", "")
  log = lambda m: print("  " + m, flush=True)
  B = s.batch_size

  def train_dense():
    init = nn.unbox(Decoder(cfg).init(jax.random.key(seed),
                                      jnp.zeros((1, s.seq_len), jnp.int32))["params"])
    dense, _ = rc.train(cfg, init, rc.train_config(steps=s.dense_steps, lr=s.dense_lr, seed=seed),
                        lambda i: er._with_task_ids(task.batch(i * B, B), True), name="dense",
                        log=log, log_every=100)
    return dense
  dense, source = _dense_params(workdir, ELASTIC_DENSE, train_dense,
                                f"{s.dense_steps} steps on both tasks")
  print(f"Dense model: {source}.", flush=True)
  ev = task.batch(0, s.eval_rows, stream=1)
  d = er.evaluate(cfg, dense, ev)
  ecfg, ep = convert(dense, cfg, "elastic", **er._elastic_cfg(s, cfg, "per_task", seed=seed))
  ssa = er.evaluate(configure(ecfg, "elastic", routing="sa"), ep, ev)
  groups = {"lagrange": dict(regex=er.LAGRANGE_REGEX, lr=s.lambda_lr, weight_decay=0.1)}
  tc = rc.train_config(steps=s.router_steps, lr=s.router_lr, seed=seed, warmup_frac=0.2,
                       end_lr_frac=0.0, weight_decay=0.1, grad_clip=5.0,
                       trainable=er.TRAINABLE_REGEX, groups=groups)
  ep, curves = rc.train(ecfg, ep, tc,
                        lambda i: er._with_task_ids(task.batch(i * B, B, stream=10), False),
                        metrics=("accuracy", "elastic/omega_msr"), name="router", log=log,
                        log_every=s.log_every)
  r = er.evaluate(ecfg, ep, ev)
  swapped = er.evaluate(ecfg, ep, _instruction_rows(task, ev, "swapped"))
  hidden = er.evaluate(ecfg, ep, _instruction_rows(task, ev, "hidden"))

  n = s.eval_rows // 2
  print(f"\nHeld-out rows ({n} a task): answer accuracy and Omega (fraction of the {L * K} "
        "(layer, KV head) decisions that are SSA):\n")
  print("| model | recall: accuracy | recall: Omega | recent: accuracy | recent: Omega |\n"
        "|---|---|---|---|---|")
  print(f"| dense (every head full) | {pct(d['recall'])} | 0.0% | {pct(d['recent'])} | 0.0% |")
  print(f"| every head SSA | {pct(ssa['recall'])} | 100.0% | {pct(ssa['recent'])} | 100.0% |")
  print(f"| Elastic (learned router) | {pct(r['recall'])} | {pct(r['omega_recall'])} | "
        f"{pct(r['recent'])} | {pct(r['omega_recent'])} |")
  print("\nFA heads per row, by layer (# = fraction of rows whose KV head k runs full attention):")
  for name in er.TASKS:
    f = np.asarray(r[f"fa_freq_{name}"])
    print(f"  {name:6s} " + "   ".join(
        f"layer {l}: " + " ".join(f"|{bar(x, 5)}|" for x in f[l]) for l in range(L)))
  gap, gs, gh = r["omega_gap"], swapped["omega_gap"], hidden["omega_gap"]
  print("\nThe router reads the instruction (same weights, same bodies and answers; Omega by the "
        "row's true task):")
  print(f"  instruction as trained: recall {pct(r['omega_recall'])}, recent "
        f"{pct(r['omega_recent'])}  (gap recent - recall {100 * gap:+.1f} points)")
  print(f"  instruction swapped:    recall {pct(swapped['omega_recall'])}, recent "
        f"{pct(swapped['omega_recent'])}  (gap {100 * gs:+.1f} points)")
  print(f"  instruction hidden:     recall {pct(hidden['omega_recall'])}, recent "
        f"{pct(hidden['omega_recent'])}  (gap {100 * gh:+.1f} points)")
  lam = np.asarray(ep["scheme"]["lagrange"]).round(3).tolist()
  verdict = (f"The router gives recall rows Omega {pct(r['omega_recall'])} and recent rows "
             f"{pct(r['omega_recent'])} (gap {100 * gap:+.1f} points); with the instruction "
             f"swapped the gap is {100 * gs:+.1f}, hidden {100 * gh:+.1f}. Recall "
             f"{pct(r['recall'])} (dense {pct(d['recall'])}, every head SSA {pct(ssa['recall'])}).")
  claims = [
      Claim(f"the dense model answers both tasks: {pct(d['min_accuracy'])} >= 85%",
            d["min_accuracy"] >= 0.85),
      Claim(f"recall needs full attention: every head SSA gets {pct(ssa['recall'])} <= 50%",
            ssa["recall"] <= 0.5),
      Claim(f"per-task sparsity: Omega recent - recall = {100 * gap:.1f} points >= 25 (two of "
            f"the {L * K} decisions)", gap >= 0.25),
      Claim(f"recall kept where the router spends its FA heads: {pct(r['recall'])} >= every head "
            f"SSA + 40 points ({pct(ssa['recall'])})", r["recall"] >= ssa["recall"] + 0.4),
      Claim(f"the split is read from the instruction: swapped, the gap reverses "
            f"({100 * gs:+.1f} <= -{50 * gap:.1f} points)", gs <= -0.5 * gap),
      Claim(f"and hidden, it vanishes: |{100 * gh:+.1f}| <= {25 * gap:.1f} points (a quarter of "
            "the gap)", abs(gh) <= 0.25 * gap),
  ]
  files = {}
  png = _plot_bars(os.path.join(workdir, "elastic_omega.png"),
                   "Omega (fraction of SSA heads) by the row's task",
                   ["instruction as trained", "swapped", "hidden"],
                   {f"{name} rows": [x[f"omega_{name}"] for x in (r, swapped, hidden)]
                    for name in er.TASKS})
  files["Omega plot"] = png
  real = "configs/elastic_qwen.py"
  fields = ("--config.model.init_from=/ckpt/Qwen3-4B --config.data.tokenizer=/ckpt/Qwen3-4B "
            "--config.data.paths='/data/elastic_mix/*.jsonl'")
  commands = [f"python train.py --config={real} --workdir=DIR {fields}",
              "python bench/elastic_repro.py --preset=cpu   # the pre-registered reproduction "
              "(one task-agnostic constraint, static split control)"]
  metrics = dict(settings=json.loads(json.dumps(dataclasses.asdict(s))), dense_source=source,
                 dense=d, all_ssa=ssa, elastic=r, instruction_swapped=swapped,
                 instruction_hidden=hidden, lagrange=lam,
                 curves={k: rc.thin(v) for k, v in curves.items()},
                 plateau={k: rc.plateau(v) for k, v in curves.items()}, verdict=verdict,
                 commands=commands)
  return Section(metrics=metrics, claims=claims, files=files)


# ----------------------------------------------------------------------------------------------
# MATCH
# ----------------------------------------------------------------------------------------------
def _answer_distances(inputs_BT, mask_BT) -> np.ndarray:
  """[B, T] int: for each scored MQAR answer (the query key at t predicts its value), how far
  back the value is: t - (position of the key's first occurrence + 1); 0 elsewhere."""
  d = np.zeros(inputs_BT.shape, np.int64)
  for b, t in zip(*np.nonzero(mask_BT)):
    first = int(np.nonzero(inputs_BT[b, :t] == inputs_BT[b, t])[0][0])
    d[b, t] = t - (first + 1)
  return d


def match_section(workdir: str, steps: int | None, seed: int) -> Section:
  """bench/match_mqar.py's models at length 64 (its 'test' preset, one lr, one seed): SWA
  (window 32), MATCH (window 32 + top-4 retrieval of 2-token chunks by exact key match) and the
  random-retrieval control (window 32 + 4 random chunks), each trained from scratch on MQAR;
  held-out answers split by whether the value lies within the window or beyond it."""
  import jax
  import jax.numpy as jnp
  from bench import match_mqar as mq
  from condattn_jax.models.decoder import Decoder
  s = dataclasses.replace(mq.PRESETS["test"], seeds=(seed,), eval_rows=128)
  if steps is not None:
    s = dataclasses.replace(s, steps=steps)
  s = dataclasses.replace(s, eval_every=s.steps)
  L, w = s.lengths[0], s.window
  t = mq.task(s, L)
  held = mq.rows(t, 0, s.eval_rows, stream=1)
  mask = held["loss_mask"] > 0
  dist = _answer_distances(held["inputs"], mask)
  beyond = mask & (dist >= w)
  say(f"MATCH demo: MQAR in {L}-token rows ({mq.pairs(L)} key-value pairs at the start, then "
      f"queries of the keys; {pct(beyond.sum() / mask.sum())} of the held-out answers lie "
      f"{w} or more tokens back, beyond the window). Three 2-layer decoders (width {s.width}) "
      f"train from scratch for {s.steps} steps each (lr {s.lrs[0]}), the same model and data, "
      "differing only in attention:",
      f"  SWA: sliding window of {w} tokens, nothing else.",
      f"  MATCH: the same window plus, every {s.chunk}-token block, the top-{s.top_k} "
      f"{s.chunk}-token chunks of the row retrieved by exact match of the query's key tokens.",
      f"  random retrieval (the control): the same window plus {s.top_k} random chunks.", "")
  log = lambda m: print(m, flush=True)
  names = {"swa": f"SWA (window {w})", "match": "MATCH (window + retrieval)",
           "random": "random retrieval (control)"}
  res, example = {}, None
  for method in ("swa", "match", "random"):
    r = mq.train_length(s, method, L, log)
    cfg = mq.model_config(s, method, L)
    p = jax.tree.map(lambda x: x[0], r.pop("params"))
    model = Decoder(cfg)
    logits, _ = jax.jit(lambda p, x: model.apply({"params": p}, x))(p, jnp.asarray(held["inputs"]))
    pred = np.asarray(jnp.argmax(logits, -1))
    hit = pred == held["targets"]
    res[method] = dict(accuracy=float(hit[mask].mean()), within=float(hit[mask & ~beyond].mean()),
                       beyond=float(hit[beyond].mean()), seconds=r["seconds"],
                       decode_semantics=(r["final"]["recompute"][0] if "recompute" in r["final"]
                                         else None), curve=r["curves"])
    if example is None:  # the first held-out answer beyond the window
      b, q = (int(x[0]) for x in np.nonzero(beyond))
      example = dict(row=b, query_pos=q, key=int(held["inputs"][b, q]),
                     value=int(held["targets"][b, q]), distance=int(dist[b, q]), said={})
    example["said"][method] = int(pred[example["row"], example["query_pos"]])

  n_b, n_w = int(beyond.sum()), int((mask & ~beyond).sum())
  print(f"\nHeld-out answer accuracy ({n_w} answers within the window, {n_b} beyond it):\n")
  print("| model | all answers | within the window | beyond the window |\n|---|---|---|---|")
  for m, name in names.items():
    r = res[m]
    print(f"| {name} | {pct(r['accuracy'])} | {pct(r['within'])} | {pct(r['beyond'])} |")
  sw, ma, ra = res["swa"], res["match"], res["random"]
  print(f"\nMATCH under the decode semantics (retrieved chunks recomputed from their tokens, what "
        f"generation computes; same weights): {pct(ma['decode_semantics'])} of all answers "
        f"(training mask: {pct(ma['accuracy'])}).")
  e = example
  said = ", ".join(f"{names[m].split(' (')[0]} {v}" + (" (right)" if v == e["value"] else "")
                   for m, v in e["said"].items())
  say("", f"One held-out answer beyond the window: row {e['row']}, the query key {e['key']} at "
      f"position {e['query_pos']}; its value {e['value']} is {e['distance']} tokens back. "
      f"Answers: {said}.")
  if ma["within"] < 0.5:
    say(f"At this budget ({s.steps} steps) the attention-only recall inside the window is not "
        f"learned yet (MATCH within the window {pct(ma['within'])}; bench/match_mqar.py's "
        "800-step sweep: full attention itself only 21%): what retrieval buys shows beyond the "
        "window.")
  verdict = (f"Beyond its {w}-token window MATCH answers {pct(ma['beyond'])} of the queries, SWA "
             f"{pct(sw['beyond'])} and random retrieval {pct(ra['beyond'])}.")
  claims = [
      Claim(f"SWA cannot recall beyond its window: {pct(sw['beyond'])} <= 15%", sw["beyond"] <= 0.15),
      Claim(f"MATCH recalls beyond the window: {pct(ma['beyond'])} >= 40% and >= SWA + 30 "
            "points", ma["beyond"] >= 0.4 and ma["beyond"] >= sw["beyond"] + 0.3),
      Claim(f"random retrieval (same window, same number of chunks) does not: "
            f"{pct(ra['beyond'])} <= MATCH - 30 points", ra["beyond"] <= ma["beyond"] - 0.3),
      Claim(f"MATCH's decode semantics agree with its training mask: {pct(ma['decode_semantics'])}"
            f" within 5 points of {pct(ma['accuracy'])}",
            abs(ma["decode_semantics"] - ma["accuracy"]) <= 0.05),
  ]
  png = _plot_bars(os.path.join(workdir, "match_recall.png"),
                   f"MQAR, length {L}: held-out answer accuracy",
                   ["within the window", "beyond the window"],
                   {names[m]: [res[m]["within"], res[m]["beyond"]] for m in names})
  commands = [
      "python train.py --config=configs/match_qwen.py --workdir=DIR "
      "--config.model.init_from=/ckpt/Qwen3-8B-Base --config.data.tokenizer=/ckpt/Qwen3-8B-Base "
      "--config.model.scheme.retriever_kwargs.tokenizer=/ckpt/Qwen3-8B-Base/tokenizer.json "
      "--config.data.paths='/data/cont_pretrain/*.jsonl'",
      "python bench/match_mqar.py --preset=cpu   # the pre-registered sweep (all methods, lrs, "
      "seeds)"]
  metrics = dict(settings=dataclasses.asdict(s), answers=dict(within=n_w, beyond=n_b),
                 results=res, example=example, verdict=verdict, commands=commands)
  return Section(metrics=metrics, claims=claims, files={"recall plot": png})


def _plot_bars(path: str, title: str, groups: list[str], series: dict[str, list[float]]) -> str:
  """A grouped bar chart (PNG): one bar per series in each group, values in [0, 1]."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  width = 0.8 / max(len(series), 1)
  for i, (name, vals) in enumerate(series.items()):
    ax.bar([g + i * width for g in range(len(groups))], vals, width, label=name)
  ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
  ax.set_ylim(0, 1)
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


SECTIONS: dict[str, Callable[[str, int | None, int], Section]] = {
    "l2a": l2a_section, "aha": aha_section, "elastic": elastic_section,
    "segmented": segmented_section, "match": match_section}
ALL = "all"


def _cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def run_section(name: str, workdir: str) -> bool:
  """One section into `workdir`: its output, verdict, claims, metrics file, files and commands;
  True when every claim held."""
  t0, cpu0, load0 = time.time(), _cpu_seconds(), os.getloadavg()[0]
  sec = SECTIONS[name](workdir, _STEPS.value, _SEED.value)
  wall, cpu, load1 = time.time() - t0, _cpu_seconds() - cpu0, os.getloadavg()[0]

  print(f"\nVerdict: {sec.metrics.get('verdict', '')}")
  print("Claims of this run:")
  for c in sec.claims:
    print(f"  [{'ok' if c.ok else 'FAILED'}] {c.text}")
  import jax
  sec.metrics.update(
      scheme=name,
      claims=[dataclasses.asdict(c) for c in sec.claims],
      run=dict(wall_seconds=wall, cpu_seconds=cpu, loadavg_start=load0, loadavg_end=load1,
               cpu_count=os.cpu_count(), backend=jax.default_backend(), jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(["python", "scripts/demo.py"] + sys.argv[1:])))
  path = os.path.join(workdir, METRICS)
  with open(path, "w") as f:
    json.dump(sec.metrics, f, indent=2)
  print("\nFiles:")
  print(f"  metrics of this run: {path}")
  for what, p in sec.files.items():
    print(f"  {what}: {p}")
  if sec.metrics.get("commands"):
    print("\nThe same on a real checkpoint:")
    for c in sec.metrics["commands"]:
      print(f"  {c}")
  print(f"\nTotal {wall:.0f} s wall, {cpu:.0f} s CPU, on {os.cpu_count()} cores with load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end.")
  return all(c.ok for c in sec.claims)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  names = [s.strip() for s in _SCHEME.value.split(",") if s.strip()]
  names = list(SECTIONS) if names == [ALL] else names
  bad = [n for n in names if n not in SECTIONS]
  if bad or not names:
    raise ValueError(f"--scheme={_SCHEME.value}: no demo section for {bad or 'it'}; choose one "
                     f"of {sorted(SECTIONS)}, a comma-separated list of them, or '{ALL}' "
                     "(scripts/demo.py SECTIONS).")
  workdir = _fresh_workdir(os.path.abspath(_WORKDIR.value))
  if len(names) == 1:
    ok = {names[0]: run_section(names[0], workdir)}
  else:  # each section into its own subdirectory, one after the other
    t0, ok = time.time(), {}
    for i, name in enumerate(names):
      print(f"\n{'=' * 100}\n[{i + 1}/{len(names)}] make demo SCHEME={name}\n{'=' * 100}",
            flush=True)
      sub = os.path.join(workdir, name)
      os.makedirs(sub)
      ok[name] = run_section(name, sub)
    print(f"\n{'=' * 100}\nEvery section ({time.time() - t0:.0f} s):")
    for name, good in ok.items():
      print(f"  {name:10s} {'all claims held' if good else 'a claim FAILED'}  "
            f"({os.path.join(workdir, name, METRICS)})")
  if not all(ok.values()):
    print(f"ERROR: a claim of the demo failed ({', '.join(n for n, g in ok.items() if not g)}; "
          "see above).", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  from condattn_jax.train import cli
  cli.run(main)  # one-line errors (exit 2), --debug for tracebacks
