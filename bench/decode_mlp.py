"""The fused decode MLP (pallas_kernels.decode_mlp, issue 33) vs XLA's MLP, on one Hopper GPU.

    python -m bench.decode_mlp                       # Qwen2.5-1.5B and 7B shapes, M = 1, 8, 32
    python -m bench.decode_mlp --nosweep --rounds=20
    python -m bench.decode_mlp --interpret           # tiny CPU run (Pallas' GPU interpreter): tests

One call = a decode step's MLP half after its norm: out = x + down(silu(gate(xn)) * up(xn)) for
M rows (B x T tokens) of width D, MLP width F, bf16 (xn ~ N(0, 1) as a norm's output, x ~ N(0, 1),
weights ~ N(0, 0.02^2) as the Qwen initialiser). Variants, every one in this process:
  xla        XLA's MLP as the model writes it (models/layers.py MLP: flax nn.Dense in bf16, i.e.
             bf16 dots, silu * mul on bf16 arrays, the residual add), jitted: the baseline
  xla_ref    jit of pallas_kernels.decode_mlp's reference (the same math, its roundings forced
             with reduce_precision): information
  fused      decode_mlp(impl='mosaic_gpu') with the planned DecodeMLPConfig (api.plan)
  sweep:*    --sweep: a few DecodeMLPConfig variants around the plan (SWEEP), at --sweep_shapes
Per point (shapes, M): first the check (every variant's output against the reference on the
device: max |out - ref| / max |ref|, printed; a kernel variant beyond TOL stops the bench with
exit code 1 after recording the run), then --rounds interleaved rounds (each round runs every
variant's batch of --calls calls enqueued back to back and blocked once; a call is ONE program
running the MLP on each of `weight_sets` distinct (x, weights) sets in turn, as a step runs its
layers: no weights left in L2 by the MLP before, one host dispatch per `weight_sets` MLPs, so
the batch is bound by the device; time per MLP = batch / (calls x weight_sets); the order
reverses every round), us = the median round; then one jax.profiler trace per variant
(bench/common.trace_activity: device-busy us and kernels per MLP). Reported: us per call,
the bytes a call must read (the weights, x and xn: decode_mlp.bytes_read), achieved TB/s, its
fraction of the device's HBM bandwidth (H200 4.8 TB/s, H100 3.35 TB/s, by device kind), the
speedup over xla. ADOPTION_RULE (registered here before any GPU run) decides; the run (rows,
settings with the rule, `adoption`, claims) is appended to <out_dir>/decode_mlp_<device>.json
(bench/common.py's schema; --out_dir default $OUT, else bench/results) and the table printed.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402

from bench import common  # noqa: E402

# Registered before the first GPU run (the decision this bench exists for): the fused kernels go
# into the decoder's decode step iff they beat XLA's MLP by 1.15x at M = 1 and M = 8 on the
# Qwen2.5-1.5B shapes (us per call: the median of the interleaved rounds, device-bound batches),
# with every variant's output within TOL of the reference at every point timed.
ADOPTION_RULE = ("adopt the fused MLP into the decoder's decode step iff >= 1.15x XLA's MLP at "
                 "M = 1 and M = 8 on the 1.5B shapes, outputs within bf16 tolerance")
RULE = dict(shapes="qwen2.5-1.5b", M=(1, 8), min_speedup=1.15, baseline="xla", candidate="fused")
# bf16 tolerance: max |out - ref| <= TOL * max |ref| (two to four units in the last place of the
# largest output: the kernels' silu uses the GPU's approximate exp and their fp32 sums run in
# another order, so a few roundings of g, u, h or y flip, each moving an output by about a unit)
TOL = 2.0 ** -6

SHAPES = {"qwen2.5-1.5b": dict(D=1536, F=8960), "qwen2.5-7b": dict(D=3584, F=18944),
          "tiny": dict(D=128, F=192)}
HBM_TBPS = (("H200", 4.8), ("H100", 3.35))      # by device kind: HBM bandwidth, TB/s


def peak_tbps(kind: str) -> float | None:
  """The device's HBM bandwidth (TB/s) by its kind string, None if not listed."""
  return next((bw for name, bw in HBM_TBPS if name in kind), None)


# DecodeMLPConfig variants around the plan: name -> fn(plan) -> DecodeMLPConfig fields
SWEEP = {
    "up_bn128": lambda p: dict(up_block_n=128),
    "up_stages+2": lambda p: dict(up_block_n=p.up_block_n, up_stages=p.up_stages + 2),
    "down_splits/2": lambda p: dict(down_splits=max(1, p.down_splits // 2)),
    "down_3_per_sm": lambda p: dict(down_programs_per_sm=3),
    "down_bn128": lambda p: dict(down_block_n=128),
    "stages-1": lambda p: dict(up_block_n=p.up_block_n, up_stages=max(1, p.up_stages - 1),
                               down_stages=max(1, p.down_stages - 1)),
}


@dataclasses.dataclass(frozen=True)
class Settings:
  name: str = "mlp_ab"
  shapes: tuple = ("qwen2.5-1.5b", "qwen2.5-7b")
  Ms: tuple = (1, 8, 32)
  sweep: bool = True
  sweep_shapes: tuple = ("qwen2.5-1.5b",)
  sweep_names: tuple | None = None     # None: every SWEEP entry
  rounds: int = 15
  calls: int = 50
  warmup: int = 3
  trace: tuple = ("xla", "fused")      # the variants traced (device-busy us, kernels)
  interpret: bool = False
  seed: int = 0
  weight_sets: int = 8                  # distinct (x, weights) sets the timed calls cycle through:
  # a decode step's layers each read their own weights (8 x 82 MB at the 1.5B shapes, >> the
  # H200's 50 MB L2); one set timed alone would leave the down weights (27.5 MB) in L2


# the CPU run of tests/kernels/test_decode_mlp.py: every code path once, at a tiny shape (M = 5:
# rows past M in the TMA boxes; F = 192: the plan's gate/up block_n 128 ends in a ragged tile),
# one sweep entry
INTERPRET = Settings(name="interpret", shapes=("tiny",), Ms=(5,), sweep=True,
                     sweep_shapes=("tiny",), sweep_names=("down_splits/2",), rounds=1, calls=1,
                     warmup=0, trace=(), interpret=True, weight_sets=2)


def model_mlp(x, xn, wg, wu, wd):
  """XLA's MLP as models/layers.py writes it: nn.Dense(dtype=bf16) = a bf16 dot (float32 sums
  inside XLA, a bf16 result), silu * mul on bf16 arrays, the residual add."""
  import jax
  import jax.numpy as jnp
  return x + jnp.dot(jax.nn.silu(jnp.dot(xn, wg)) * jnp.dot(xn, wu), wd)


def inputs(M: int, D: int, F: int, seed: int = 0):
  """(x, xn, w_gate, w_up, w_down) bf16 on the default device."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def make(key):
    ks = jax.random.split(key, 5)
    n = lambda k, s, std: (jax.random.normal(k, s, jnp.float32) * std).astype(jnp.bfloat16)
    return (n(ks[0], (M, D), 1.0), n(ks[1], (M, D), 1.0), n(ks[2], (D, F), 0.02),
            n(ks[3], (D, F), 0.02), n(ks[4], (F, D), 0.02))
  return make(jax.random.PRNGKey(seed))


def variants(s: Settings, shapes: str, M: int, D: int, F: int) -> dict:
  """{name: (jitted fn(x, xn, wg, wu, wd), config dict or None)}."""
  import jax
  from pallas_kernels import decode_mlp as dm
  out = {"xla": (jax.jit(model_mlp), None), "xla_ref": (jax.jit(dm.reference_decode_mlp), None)}

  def fused(cfg):
    return jax.jit(lambda *a: dm.decode_mlp(*a, impl="mosaic_gpu", interpret=s.interpret,
                                            config=cfg))
  base = dm.DecodeMLPConfig()
  p = dm.plan(M, D, F, base)
  out["fused"] = (fused(base), dataclasses.asdict(p))
  if s.sweep and shapes in s.sweep_shapes:
    seen = {p}
    for name, fn in SWEEP.items():
      if s.sweep_names is not None and name not in s.sweep_names:
        continue
      cfg = dataclasses.replace(base, **fn(p))
      if dm.kernel_support(M, D, F, "bfloat16", cfg=cfg) is not None:
        continue
      q = dm.plan(M, D, F, cfg)
      if q in seen:
        continue
      seen.add(q)
      out[f"sweep:{name}"] = (fused(cfg), dataclasses.asdict(q))
  return out


def max_rel(out, ref) -> float:
  """max |out - ref| / max |ref| (float64)."""
  import numpy as np
  a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  den = float(np.abs(b).max())
  return float(np.abs(a - b).max()) / (den or 1.0)


def interleaved_batches(fns: dict, args, *, rounds: int, calls: int, warmup: int) -> dict:
  """{name: [ms per call, one per round]}: each round runs every fn's batch of `calls` calls
  enqueued back to back and blocked once (the host's dispatch hides under the device's work, as
  in a model's step), in an order that reverses every round."""
  import jax
  names = list(fns)
  for k in names:
    for _ in range(warmup):
      jax.block_until_ready(fns[k](*args))
  runs = {k: [] for k in names}
  for r in range(rounds):
    for k in (names if r % 2 == 0 else names[::-1]):
      t0 = time.perf_counter()
      outs = [fns[k](*args) for _ in range(calls)]
      jax.block_until_ready(outs)
      runs[k].append((time.perf_counter() - t0) * 1e3 / calls)
  return runs


def measure_point(s: Settings, shapes: str, M: int, kind: str, log=print) -> list[dict]:
  """The rows of one (shapes, M): check, then interleaved timing and traces of every variant."""
  import jax
  from pallas_kernels import decode_mlp as dm
  D, F = SHAPES[shapes]["D"], SHAPES[shapes]["F"]
  arg_sets = [inputs(M, D, F, s.seed + c) for c in range(s.weight_sets)]
  args = arg_sets[0]
  vs = variants(s, shapes, M, D, F)
  ref = jax.jit(dm.reference_decode_mlp)(*args)
  rows = {}
  for name, (fn, cfg) in vs.items():
    t0 = time.perf_counter()
    out = fn(*args)
    err = max_rel(out, ref)
    rows[name] = dict(shapes=shapes, M=M, D=D, F=F, variant=name, config=cfg,
                      compile_s=round(time.perf_counter() - t0, 2), max_rel_err=err,
                      rel_err=common.rel_err(out, ref), within_tol=bool(err <= TOL))
    log(f"  check {shapes} M={M} {name:22s} max_rel_err {err:.2e}  (first call "
        f"{rows[name]['compile_s']:.1f} s)"
        + ("" if err <= TOL else f"   <-- MISMATCH (tolerance {TOL:.2e})"))
  # one program a variant runs the MLP on every set in turn (as a step runs its layers): one
  # dispatch per len(arg_sets) MLPs, so the timed calls are bound by the device, not the host
  groups = {k: jax.jit(lambda sets, f=v[0]: [f(*a) for a in sets]) for k, v in vs.items()}
  n_sets = len(arg_sets)
  runs = interleaved_batches(groups, (arg_sets,), rounds=s.rounds,
                             calls=s.calls, warmup=s.warmup)
  nbytes = dm.bytes_read(M, D, F)
  peak = peak_tbps(kind)
  for name, r in rows.items():
    us = statistics.median(runs[name]) * 1e3 / n_sets
    r.update(us=us, runs_us=[x * 1e3 / n_sets for x in runs[name]], bytes=nbytes,
             tbps=nbytes / us / 1e6, of_peak=None if peak is None else nbytes / us / 1e6 / peak)
    if name in s.trace:
      try:
        a = common.trace_activity(lambda g=groups[name]: g(arg_sets), n=s.calls)
        r.update(busy_us=a["busy_ms"] * 1e3 / n_sets, kernels=a["kernels"] / n_sets,
                 top=[[k[:60], v * 1e3 / n_sets] for k, v in a["top"][:4]])
      except Exception as e:  # noqa: BLE001 (a profiler problem must not lose the timings)
        r["trace_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        log(f"  trace {name}: {r['trace_error']}")
  base = rows["xla"]["us"]
  for r in rows.values():
    r["speedup"] = base / r["us"]
  return list(rows.values())


def adoption(rows: list[dict], rule: dict = RULE) -> dict:
  """ADOPTION_RULE on the rows: {adopt, failed: [reasons], speedup: {M: fused / xla}}."""
  failed = []
  bad = [f"{r['shapes']} M={r['M']} {r['variant']}" for r in rows
         if r["variant"] not in ("xla", "xla_ref") and not r["within_tol"]]
  if bad:
    failed.append(f"outside tolerance: {bad}")
  speed = {}
  for M in rule["M"]:
    got = {r["variant"]: r for r in rows if r["shapes"] == rule["shapes"] and r["M"] == M}
    if rule["baseline"] not in got or rule["candidate"] not in got:
      failed.append(f"{rule['shapes']} M={M}: not measured")
      continue
    sp = got[rule["baseline"]]["us"] / got[rule["candidate"]]["us"]
    speed[M] = sp
    if sp < rule["min_speedup"]:
      failed.append(f"{rule['shapes']} M={M}: {sp:.3f}x < {rule['min_speedup']}x")
  return dict(adopt=not failed, failed=failed, speedup=speed)


def table(rows: list[dict]) -> str:
  head = (f"{'shapes':14s} {'M':>3s} {'variant':22s} {'us':>8s} {'busy us':>8s} {'kern':>5s} "
          f"{'MB':>7s} {'TB/s':>6s} {'of peak':>7s} {'x xla':>6s} {'rel err':>8s}")
  out = [head, "-" * len(head)]
  for r in rows:
    busy = f"{r['busy_us']:8.1f}" if "busy_us" in r else f"{'-':>8s}"
    kern = f"{r['kernels']:5.1f}" if "kernels" in r else f"{'-':>5s}"
    peak = f"{r['of_peak']:7.2f}" if r.get("of_peak") is not None else f"{'-':>7s}"
    out.append(f"{r['shapes']:14s} {r['M']:3d} {r['variant']:22s} {r['us']:8.1f} {busy} {kern} "
               f"{r['bytes'] / 1e6:7.1f} {r['tbps']:6.2f} {peak} {r['speedup']:6.2f} "
               f"{r['max_rel_err']:8.1e}")
  return "\n".join(out)


def run_bench(s: Settings, out_dir: str | None, log=print) -> dict:
  """Every point of `s`; returns the run record (appended to <out_dir>/decode_mlp_<device>.json
  when out_dir is given)."""
  import jax
  kind = common.device_kind()
  if not s.interpret and jax.default_backend() != "gpu":
    raise SystemExit("bench.decode_mlp: needs a GPU (or --interpret for the tiny CPU run)")
  run = common.new_run("decode_mlp", dict(dataclasses.asdict(s), rule=ADOPTION_RULE,
                                          rule_fields=RULE, tol=TOL))
  rows = []
  for shapes in s.shapes:
    for M in s.Ms:
      log(f"{shapes} M={M}")
      rows += measure_point(s, shapes, M, kind, log=log)
  run["rows"] = rows
  run["adoption"] = adoption(rows)
  # the claims (tolerance, the rule re-applied to the stored rows): bench/claims/decode_mlp.py,
  # recorded by append_run for a run named there
  ok = all(r["within_tol"] for r in rows if r["variant"] not in ("xla", "xla_ref"))
  log(table(rows))
  a = run["adoption"]
  log(f"ADOPTION_RULE ({ADOPTION_RULE}): "
      + ("PASS: adopt" if a["adopt"] else "FAIL: do not adopt: " + "; ".join(a["failed"]))
      + f"   speedup at {RULE['shapes']}: "
      + ", ".join(f"M={m}: {v:.3f}x" for m, v in a["speedup"].items()))
  if out_dir:
    path = common.result_path("decode_mlp", out_dir, run["device"])
    common.append_run(path, run)
    log(f"appended to {path}")
  if not ok:
    log("bench.decode_mlp: a kernel variant is outside the tolerance (see the check lines)")
    raise SystemExit(1)
  return run


def main(argv=None) -> dict:
  fv = common.flag_values()
  flags.DEFINE_bool("interpret", False, "the tiny CPU run (Pallas' GPU interpreter)",
                    flag_values=fv)
  flags.DEFINE_list("shapes", None, f"some of {sorted(SHAPES)}", flag_values=fv)
  flags.DEFINE_list("M", None, "rows per call", flag_values=fv)
  flags.DEFINE_bool("sweep", None, "also the SWEEP configs at --sweep_shapes", flag_values=fv)
  flags.DEFINE_list("sweep_shapes", None, "shapes the sweep runs at", flag_values=fv)
  flags.DEFINE_integer("rounds", None, "interleaved rounds", flag_values=fv)
  flags.DEFINE_integer("calls", None, "calls per batch", flag_values=fv)
  flags.DEFINE_list("trace", None, "variants traced (device-busy us, kernels; default xla, "
                    "fused)", flag_values=fv)
  flags.DEFINE_string("name", None, "the run's name", flag_values=fv)
  common.parse_flags(fv, argv)
  s = INTERPRET if fv.interpret else Settings()
  over = {}
  for f in ("shapes", "sweep_shapes", "trace"):
    if fv[f].value is not None:
      over[f] = tuple(fv[f].value)
  if fv.M is not None:
    over["Ms"] = tuple(int(m) for m in fv.M)
  for f in ("sweep", "rounds", "calls", "name"):
    if fv[f].value is not None:
      over[f] = fv[f].value
  for sh in over.get("shapes", ()) + over.get("sweep_shapes", ()):
    if sh not in SHAPES:
      raise SystemExit(f"--shapes: {sh!r} is not one of {sorted(SHAPES)}")
  s = dataclasses.replace(s, **over)
  return run_bench(s, fv.out_dir)


if __name__ == "__main__":
  main()
