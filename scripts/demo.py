r"""`make demo`: conditional attention at work, on this CPU, in a few minutes.

  python scripts/demo.py [--scheme=l2a] [--workdir=/tmp/condattn_demo] [--steps=N]
  make demo [SCHEME=l2a] [DEMO_DIR=/tmp/condattn_demo]

One section per scheme (SECTIONS): it starts from a small dense model that solves a long-range
recall task, converts it to the scheme, trains the scheme's recipe and prints, from this run,
what the conversion bought and what it cost (accuracy, the fraction of tokens that skip the
expensive attention, per layer, against baselines at the same sparsity), writes the run's
metrics (JSON) and a per-layer plot (PNG) into --workdir, prints the commands that do the same on
a real checkpoint, and exits 1 when one of the section's claims does not hold. A new scheme adds
a function `<scheme>_section(args) -> Section` and an entry in SECTIONS.

L2A (the default): bench/l2a_learning.py's `demo` preset; the dense model is
tests/fixtures/l2a/mqar_dense.npz (trained by that bench's full run).
AHA (--scheme=aha): bench/aha_window_sweep.py's `demo` preset at window 16; the dense model is
trained in the run (300 steps, seconds).
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

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/condattn_demo", "Where the demo writes its "
                               "metrics and plot (re-created on every run).")
_SCHEME = flags.DEFINE_string("scheme", "l2a", "Which scheme's demo section to run.")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps of the scheme's phase (default: "
                              "the section's own, which its claims are made for).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data streams and training.")


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
      "Baselines, trained the same way for as many steps: context-free routing (each token "
      "global with the probability L2A ended at, i.e. the same sparsity) and local attention "
      "only.",
      f"Devices: {jax.device_count()} x {jax.devices()[0].platform}, jax {jax.__version__}. Log "
      f"every {s.log_every} steps:", "")
  res = bench.run_experiment(s, log=lambda m: print("  " + m, flush=True),
                             dense_params=DENSE_FIXTURE)
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
  s = dataclasses.replace(sweep.PRESETS["demo"], seed=seed)
  if steps is not None:
    s = dataclasses.replace(s, aha_steps=steps)
  w = s.windows[0]
  task = sweep.FusedRecall(s)
  cfg = sweep.base_config(s, task)
  say(f"AHA demo: a {s.num_layers}-layer, {s.num_heads}-head OLMo-2-shaped decoder on fused "
      f"recall ({s.seq_len} tokens, {s.num_queries} queries a row, each fact log-uniformly "
      f"1..{s.seq_len - 2} tokens before its query: {pct(1 - np.log(w) / np.log(s.seq_len - 2))} "
      f"of them beyond a {w}-token window). Dense training, then conversion to AHA (window {w}, "
      f"tau {s.tau}, lambda {s.lam}) and {s.aha_steps} AHA steps.", "")
  log = lambda m: print("  " + m, flush=True)
  init = nn.unbox(Decoder(cfg).init(jax.random.key(s.seed),
                                    jnp.zeros((1, s.seq_len), jnp.int32))["params"])
  dense_p, _ = sweep.train(cfg, init, task, steps=s.dense_steps, lr=s.dense_lr, phase=0,
                           name="dense", log=log)
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
  metrics = dict(settings=dataclasses.asdict(s), dense=d, aha={k: v for k, v in r.items()},
                 local_only_at_conversion=local, tau_knob={str(t): k for t, k in knob.items()},
                 usage=rep["usage"], aha_history=hist, verdict=verdict, commands=commands)
  return Section(metrics=metrics, claims=claims,
                 files={"layer x head usage heatmap": rep["png"], "usage report": rep["json"]})


SECTIONS: dict[str, Callable[[str, int | None, int], Section]] = {"l2a": l2a_section,
                                                                   "aha": aha_section}


def _cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SCHEME.value not in SECTIONS:
    raise ValueError(f"--scheme={_SCHEME.value}: no demo section for it; choose one of "
                     f"{sorted(SECTIONS)} (scripts/demo.py SECTIONS).")
  t0, load0 = time.time(), os.getloadavg()[0]
  workdir = _fresh_workdir(os.path.abspath(_WORKDIR.value))
  sec = SECTIONS[_SCHEME.value](workdir, _STEPS.value, _SEED.value)
  wall, cpu, load1 = time.time() - t0, _cpu_seconds(), os.getloadavg()[0]

  print(f"\nVerdict: {sec.metrics.get('verdict', '')}")
  print("Claims of this run:")
  for c in sec.claims:
    print(f"  [{'ok' if c.ok else 'FAILED'}] {c.text}")
  import jax
  sec.metrics.update(
      scheme=_SCHEME.value,
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
  if not all(c.ok for c in sec.claims):
    print("ERROR: a claim of the demo failed (see above).", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  from condattn_jax.train import cli
  cli.run(main)  # one-line errors (exit 2), --debug for tracebacks
