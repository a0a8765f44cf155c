"""Context parallelism's attention alone (issues 30 / 32): one layer's attention calls at the
1.5B shapes with a row split over n = 1, 2, 4, ... devices (condattn_jax/parallel/context.py),
timed forward and forward + backward, with the collectives XLA compiled for each. It tells how
much of bench/scale.py's step scaling the attention loses, and, case by case in its own process
with a timeout, which collective a step that never finishes waits in.

    python -m bench.context_parallel                         # T = 128K, n = 1, 2 and 4 (all GPUs)
    python -m bench.context_parallel --tiny --T=256 --devices=1,2 --inprocess   # CPU check

Cases (q [1, T, 12, 128], k / v [1, T, 2, 128] bf16, one document, zigzag layout for n > 1):
  causal       global causal attention (dense's, L2A's forced-global step): K/V all-gathered.
  routed       L2A's global branch: a context-free 20% of the queries (the same tokens for every
               n) on the compacted kernel against the gathered K/V.
  window       local attention, window --window (L2A's local branch): the halo exchange.
  layer        L2A's two attention calls in one program, as its step holds them: window (halo)
               then routed (gathered K/V) on the window's output, in a lax.scan of LAYER_SCAN
               layers (the step's layer scan): whether the pieces that run alone hang together.
  collectives  no attention: the all-gather of K, the halo's two chained ppermutes and a psum on
               the sequence axis (n > 1 only): whether the devices' collectives run at all.
Per row: kernels (the custom-call targets of the compiled fwd + bwd: at n = 1 what
ops.attention picks for contiguous self-attention, e.g. tokamax for causal with document ids,
at n > 1 the per-shard kernel, so an efficiency holds that kernel change too), compile_s (AOT
compile of fwd + bwd), fwd_ms / fwd_bwd_ms (median of --reps calls after a warm-up,
common.time_call), collectives of the compiled fwd + bwd (op -> [count, result MiB x loop
trips]: condattn_jax/parallel/hlo.py), peak_bytes (max over the row's devices; None on CPU).
The parent adds efficiency = time at n = 1 / (n x time at n) for fwd and fwd + bwd. A row
killed by --case_timeout_s records its last phase (devices / inputs / compiled / warm / fwd /
fwd_bwd).
Writes <out_dir>/context_parallel_<device>.json (one run per invocation; no claims: measurements).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
import types
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402

from bench import common  # noqa: E402

CASES = ("causal", "routed", "window", "collectives", "layer")
LAYER_SCAN = 2  # the layer case's scanned layers
SHAPES = dict(N=12, K=2, H=128)  # Qwen2.5-1.5B's attention (bench/e2e.py QWEN25_1P5B)
TINY = dict(N=4, K=2, H=16)

FLAGS = common.flag_values(n=None, warmup=None)
flags.DEFINE_list("T", ["131072"], "row lengths", flag_values=FLAGS)
flags.DEFINE_list("devices", ["1", "2", "0"], "device counts (0: all)", flag_values=FLAGS)
flags.DEFINE_list("cases", list(CASES), f"cases of {list(CASES)}", flag_values=FLAGS)
flags.DEFINE_integer("window", 4096, "the window case's window", flag_values=FLAGS)
flags.DEFINE_float("q", 0.2, "the routed case's fraction of global queries", flag_values=FLAGS)
flags.DEFINE_enum("halo_exchange", "ppermute", ["ppermute", "all_gather"],
                  "how the window halo moves (condattn_jax/parallel/context.halo_exchange)",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 5, "timed calls per row (median)", flag_values=FLAGS)
flags.DEFINE_integer("case_timeout_s", 180, "kill a row's child after this many seconds",
                     flag_values=FLAGS)
flags.DEFINE_bool("tiny", False, "tiny head shapes (CPU check)", flag_values=FLAGS)
flags.DEFINE_bool("inprocess", False, "every row in this process (CPU check; no timeout)",
                  flag_values=FLAGS)
flags.DEFINE_string("row", None, "internal: run one row (JSON) and print it", flag_values=FLAGS)

def collectives(hlo_text: str) -> dict:
  """{op: [count, result MiB x loop trips]} of a compiled module (condattn_jax.parallel.hlo)."""
  from condattn_jax.parallel import hlo
  return {op: [v["count"], round(v["bytes"] / 2**20, 3)]
          for op, v in hlo.summary(hlo.collectives(hlo_text))["ops"].items()}


def run_row(case: str, n: int, T: int, *, tiny: bool = False, window: int = 4096,
            q: float = 0.2, reps: int = 5, halo_exchange: str = "ppermute") -> dict:
  """Measures one (case, n) row on the first n devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from condattn_jax import ops
  from condattn_jax.parallel import context
  from condattn_jax.train import sharding as shd
  t_row = time.perf_counter()
  phase = lambda name: print(f"PHASE {name} {time.perf_counter() - t_row:.1f}s", file=sys.stderr,
                             flush=True)
  devices = jax.devices()[:n]
  if len(devices) < n:
    raise SystemExit(f"bench.context_parallel: {n} devices asked, {len(devices)} here")
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, 1, n, 1), shd.MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(shd.MESH_AXES))
  phase("devices")
  s = TINY if tiny else SHAPES
  B, N, K, H = 1, s["N"], s["K"], s["H"]
  rows = NamedSharding(mesh, P(None, "sequence"))
  put = lambda x: jax.device_put(x, rows)
  layout = (lambda x: context.to_layout(x, n)) if n > 1 else (lambda x: x)
  ks = jax.random.split(jax.random.key(0), 4)
  qq, kk, vv = (put(layout(jax.random.normal(k_, (B, T, h, H), jnp.bfloat16)))
                for k_, h in zip(ks[:3], (N, K, K)))
  pos = put(layout(jnp.arange(T, dtype=jnp.int32)[None]))
  active = (put(layout(jax.random.bernoulli(ks[3], q, (B, T)))) if case in ("routed", "layer")
            else None)
  seg = put(jnp.ones((B, T), jnp.int32))  # one document, as the train step's rows carry ids
  mask = ops.MaskSpec(pos, pos, seg, seg, active=None if case == "layer" else active,
                      window=window if case in ("window", "layer") else None, contiguous=True)
  row: dict[str, Any] = dict(case=case, devices=n, T=T, mesh=dict(mesh.shape),
                             heads=dict(N=N, K=K, H=H), halo_exchange=halo_exchange)
  if case in ("routed", "layer"):
    row["q"] = q
  if case in ("window", "layer"):
    row["window"] = window
  phase("inputs")

  if case == "collectives":
    if n < 2:
      raise SystemExit("bench.context_parallel: the collectives case needs n > 1")

    def body(k):
      g = lax.all_gather(k, "sequence", axis=1, tiled=True)
      up = lax.ppermute(k, "sequence", [(j, j + 1) for j in range(n - 1)])
      down = lax.ppermute(k, "sequence", [(j + 1, j) for j in range(n - 1)])
      total = lax.psum(jnp.sum(k.astype(jnp.float32)), "sequence")
      return (g[:, :k.shape[1]] + up + down) * total.astype(k.dtype)

    fwd = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "sequence"),
                                out_specs=P(None, "sequence"), check_vma=False))
    fwd_bwd, args = fwd, (kk,)
  elif case == "layer":
    glob = dataclasses.replace(mask, active=active, window=None)

    def attn(q_, k_, v_):
      def layer(x, _):
        with context.zigzag_layout(n > 1):
          x = ops.attention(x, k_, v_, mask, impl="auto")  # the window (halo)
          return ops.attention(x, k_, v_, glob, impl="auto"), None  # routed, gathered K/V
      return lax.scan(layer, q_, None, length=LAYER_SCAN)[0]

    def grads(q_, k_, v_):
      out, vjp = jax.vjp(attn, q_, k_, v_)
      return vjp(q_)

    fwd, fwd_bwd, args = jax.jit(attn), jax.jit(grads), (qq, kk, vv)
  else:
    def attn(q_, k_, v_):
      with context.zigzag_layout(n > 1):
        return ops.attention(q_, k_, v_, mask, impl="auto")

    def grads(q_, k_, v_):
      out, vjp = jax.vjp(attn, q_, k_, v_)
      return vjp(q_)  # any cotangent of the output's shape: q's

    fwd, fwd_bwd, args = jax.jit(attn), jax.jit(grads), (qq, kk, vv)
  with shd.mesh_context(mesh), context.halo_exchange(halo_exchange):
    t0 = time.perf_counter()
    compiled = fwd_bwd.lower(*args).compile()
    row["compile_s"] = time.perf_counter() - t0
    text = compiled.as_text()
    row["collectives"] = collectives(text)
    row["kernels"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    phase("compiled")
    jax.block_until_ready(compiled(*args))
    phase("warm")
    row["fwd_ms"] = common.time_call(fwd, *args, n=reps, warmup=1)["median_ms"]
    phase("fwd")
    row["fwd_bwd_ms"] = common.time_call(compiled, *args, n=reps, warmup=1)["median_ms"]
    phase("fwd_bwd")
  peaks = [common.peak_bytes(d) for d in devices]
  row["peak_bytes"] = max(peaks) if all(p is not None for p in peaks) else None
  row["device_kind"] = devices[0].device_kind
  return row


def efficiency(rows: list[dict]) -> list[dict]:
  """Each row with n > 1 gets fwd_efficiency / fwd_bwd_efficiency against the same (case, T)
  row at n = 1."""
  base = {(r["case"], r["T"]): r for r in rows if r.get("devices") == 1 and "fwd_ms" in r}
  for r in rows:
    b = base.get((r["case"], r["T"]))
    if b is None or r.get("devices", 1) == 1 or "fwd_ms" not in r:
      continue
    for k in ("fwd", "fwd_bwd"):
      r[f"{k}_efficiency"] = b[f"{k}_ms"] / (r["devices"] * r[f"{k}_ms"])
  return rows


def _row_in_child(spec: dict, timeout_s: float) -> dict:
  from bench import scale  # the row-in-a-child conventions: ROW / PHASE lines, timeout record
  p = scale._child(spec, timeout_s=timeout_s, module="bench.context_parallel")
  return scale._child_row(spec, p, timeout_s)


def table(rows: list[dict]) -> str:
  out = [f"{'case':>11} {'T':>7} {'n':>2} {'fwd ms':>9} {'eff':>5} {'f+b ms':>9} {'eff':>5} "
         f"{'compile s':>9}  collectives (count, MiB)"]
  for r in rows:
    if "fwd_bwd_ms" not in r:
      out.append(f"{r['case']:>11} {r['T']:>7} {r['n']:>2}  error: {r.get('error')}")
      continue
    e = lambda k: f"{r[k]:.2f}" if k in r else "-"
    out.append(f"{r['case']:>11} {r['T']:>7} {r['devices']:>2} {r['fwd_ms']:>9.2f} "
               f"{e('fwd_efficiency'):>5} {r['fwd_bwd_ms']:>9.2f} {e('fwd_bwd_efficiency'):>5} "
               f"{r['compile_s']:>9.1f}  {r['collectives']}")
  return "\n".join(out)


def main(argv=None) -> int:
  fv = common.parse_flags(FLAGS, argv)
  a = types.SimpleNamespace(**{name: fv[name].value for name in fv})
  if a.row:
    from bench import scale  # the row-in-a-child conventions: ROW / PHASE lines, timeout record
    return scale.print_row(run_row, a.row)
  if bad := [c for c in a.cases if c not in CASES]:
    raise SystemExit(f"bench.context_parallel: unknown --cases {bad}: choose from {list(CASES)}")
  import jax
  n_all = jax.device_count()
  counts = sorted({int(d) or n_all for d in a.devices})
  if counts[-1] > n_all:
    raise SystemExit(f"bench.context_parallel: --devices {counts}: {n_all} device(s) here")
  specs = [dict(case=c, n=n, T=int(T), tiny=a.tiny, window=a.window, q=a.q, reps=a.reps,
                halo_exchange=a.halo_exchange)
           for T in a.T for c in a.cases for n in counts if not (c == "collectives" and n < 2)]
  rows = []
  for spec in specs:
    if a.inprocess:
      row = run_row(**spec)
    else:
      row = _row_in_child(spec, a.case_timeout_s)
    row.setdefault("devices", spec["n"])
    rows.append(row)
    print(table([dict(row, n=spec["n"])]).splitlines()[-1], flush=True)
  rows = efficiency(rows)
  result = dict(rows=rows, settings=dict(
      T=[int(T) for T in a.T], devices=counts, cases=list(a.cases), window=a.window, q=a.q,
      halo_exchange=a.halo_exchange,
      reps=a.reps, tiny=a.tiny, heads=TINY if a.tiny else SHAPES,
      model="tiny heads" if a.tiny else "Qwen2.5-1.5B attention shapes, bf16"))
  path = common.result_path("context_parallel", a.out_dir)
  common.write_result(path, "context_parallel", result, name="tiny" if a.tiny else "main")
  print(table([dict(r, n=r["devices"]) for r in rows]))
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
