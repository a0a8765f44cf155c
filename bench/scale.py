"""Scale-out on one host (issue 30): the train step of dense and L2A on 1 device vs n devices in
data- and sequence-parallel layouts: loss equal to one device, tokens/s per device, scaling
efficiency, peak memory per device.

    python -m bench.scale                                   # 2 GPUs, 1.5B shapes, T = 32K, 128K
    python -m bench.scale --T 131072 --schemes l2a --layouts one,sequence
    python -m bench.scale --tiny --T 64 --reps 1 --inprocess   # CPU check of the plumbing

On two H100s (the device tool's nvidia-h100-x2; DEVELOPERS.md: carry the wheels the image lacks
and name the commit that runs):
    pip install --no-deps .whl/*.whl && CONDATTN_GIT_COMMIT=<git rev-parse --short HEAD> \
      python -m bench.scale --T 32768,131072 --schemes dense,l2a --layouts one,sequence,data
    python -m bench.scale --T 262144 --schemes l2a --layouts one,sequence   # one GPU: OOM row
On four GPUs (nvidia-h100-x4), rows on disjoint GPUs at once, rows kept if the call is cut:
    python -m bench.scale --concurrent --reps=2 --row_timeout_s=300 --progress=$OUT/rows.jsonl \
      --plan=131072:l2a:one,131072:l2a:sequence:2,131072:dense:one,131072:l2a:sequence:4
    python -m bench.scale --concurrent --plan=32768:l2a:sequence:4 --halo_exchange=all_gather \
      --row_timeout_s=80     # L2A's window halo by an all-gather of chunk tails: no collective-permute
    python -m bench.scale --from_rows=<files_at>/rows.jsonl --rows_device="NVIDIA H100 80GB HBM3" \
      --rows_commit=<sha> --rows_date=<ISO date>     # here: record a cut run's rows

Model: bench/e2e.py's (Qwen2.5-1.5B shapes, all 28 layers, bf16 compute, fp32 master weights,
remat 'full', chunked CE 8192, random init from train.seed, random tokens; --tiny: its 2-layer
shapes). Schemes: dense; l2a = bench/e2e.py's l2a_q0.2 (context-free routing, q = 0.2, window
4096). Layouts of n = --devices devices (default: all):
  one       1 device, 1 row of T tokens (the baseline);
  sequence  mesh sequence = n: the same row split over n devices (condattn_jax/parallel/context.py,
            zigzag layout, --strategy all_gather | ring);
  data      mesh data = n: n rows (copies of the baseline's row), one per device: the loss is
            the baseline's for dense; L2A's context-free draws depend on the row index, so its
            copies route differently (loss within ~1e-3 relative, not equal);
  seqfsdp   mesh fsdp 2 x sequence n / 2: the rows over fsdp, each row split over sequence.
--model=7b_recipe: configs/l2a_qwen.py's Qwen2.5-7B L2A recipe (learned routing, p_force 0.1, its
trainable subset and optimizer; shapes from tests/fixtures/config_only/qwen2.5-7b), random init;
with --rows=2 --steps=10 --plan=131072:l2a:sequence:4,131072:l2a:seqfsdp:4 (4 GPUs) or
...:sequence:8,...:seqfsdp:8 (8 GPUs), the issue-32 comparison: every step's loss of a row within
--steps_rtol of the first row of its T / scheme (claim), predicted_peak_bytes (the dry run's
figure: the compiled step's memory analysis) beside the measured peak.
Per row (its own process unless --inprocess, so peak memory is the row's own): compile_s (AOT
compile of `loop.jit_train_step`), step_ms (median of --reps steps after a warm-up),
loss (the first step's, same params and row as the baseline), tokens_per_s and
tokens_per_s_per_device, peak_bytes (max over the row's devices of peak_bytes_in_use; None on
CPU). The parent adds scaling_efficiency = tokens_per_s_per_device / the baseline's and
loss_rel_diff = |loss - baseline loss| / baseline loss.
Claims (bench/common.py): every layout's loss within --loss_rtol of the baseline's (bf16 compute:
the sharded reductions round differently). Goal (recorded, not a claim: a missed goal is a
measurement): the L2A step at 128K with sequence parallelism 2 at >= 85% scaling efficiency.
Writes <out_dir>/scale_<device>.json (one run per invocation).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402

from bench import common  # noqa: E402
from bench import e2e  # noqa: E402

SCHEMES = {"dense": "dense", "l2a": "l2a_q0.2"}  # this bench's name -> bench/e2e.py's scheme
LAYOUTS = ("one", "sequence", "data", "seqfsdp")
MODELS = ("1.5b", "7b_recipe")
QWEN7B_CONFIG = os.path.join(common.ROOT, "tests", "fixtures", "config_only", "qwen2.5-7b",
                             "config.json")
GOAL = dict(scheme="l2a", T=131072, layout="sequence", devices=2, min_efficiency=0.85)

FLAGS = common.flag_values(n=None, warmup=None)
flags.DEFINE_list("T", ["32768", "131072"], "row lengths", flag_values=FLAGS)
flags.DEFINE_list("schemes", list(SCHEMES), f"schemes of {list(SCHEMES)}", flag_values=FLAGS)
flags.DEFINE_list("layouts", list(LAYOUTS), f"layouts of {list(LAYOUTS)}", flag_values=FLAGS)
flags.DEFINE_list("devices", ["0"], "device counts of the parallel layouts (0: all), e.g. 2,4",
                  flag_values=FLAGS)
flags.DEFINE_list("plan", None, "explicit rows T:scheme:layout[:n] (e.g. 131072:l2a:sequence:4) "
                  "instead of --T x --schemes x --layouts x --devices", flag_values=FLAGS)
flags.DEFINE_bool("concurrent", False, "run rows on disjoint devices at the same time (each row's "
                  "child sees only its own GPUs through CUDA_VISIBLE_DEVICES)", flag_values=FLAGS)
flags.DEFINE_integer("row_timeout_s", 0, "kill a row's child after this many seconds (0: never); "
                     "the row records error 'timeout'", flag_values=FLAGS)
flags.DEFINE_string("progress", None, "JSON-lines file: each finished row appended as it ends",
                    flag_values=FLAGS)
flags.DEFINE_enum("strategy", "all_gather", ["all_gather", "ring"],
                  "config.mesh.sequence_attention of the sequence layout", flag_values=FLAGS)
flags.DEFINE_enum("halo_exchange", "ppermute", ["ppermute", "all_gather"],
                  "how L2A's window halo moves under the sequence layout "
                  "(condattn_jax/parallel/context.halo_exchange)", flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "timed train steps per row (median)", flag_values=FLAGS)
flags.DEFINE_enum("model", "1.5b", list(MODELS), "1.5b: bench/e2e.py's Qwen2.5-1.5B shapes and "
                  "schemes; 7b_recipe: configs/l2a_qwen.py's Qwen2.5-7B L2A recipe (scheme l2a "
                  "only: learned routing, p_force 0.1, its trainable subset and optimizer), "
                  "random init", flag_values=FLAGS)
flags.DEFINE_integer("rows", 0, "rows per step (0: 1, or n for the data layout); seqfsdp needs "
                     "a multiple of 2", flag_values=FLAGS)
flags.DEFINE_integer("steps", 0, "0: one first step then --reps timed steps on the same batch; "
                     "S > 0: S training steps from step 0, a fresh random batch each, every "
                     "step's loss recorded (the rows of one (T, scheme) compared step by step)",
                     flag_values=FLAGS)
flags.DEFINE_float("steps_rtol", 2e-3, "--steps claim: every step's loss within this relative "
                   "difference of the reference row's (the first of its T / scheme)",
                   flag_values=FLAGS)
flags.DEFINE_float("loss_rtol", 2e-2, "loss claim: relative difference to one device",
                   flag_values=FLAGS)
flags.DEFINE_bool("tiny", False, "bench/e2e.py's tiny shapes (CPU check)", flag_values=FLAGS)
flags.DEFINE_bool("inprocess", False, "run every row in this process (CPU check)",
                  flag_values=FLAGS)
flags.DEFINE_list("from_rows", None, "record the rows of --progress files (a run cut by the device "
                  "tool's limit) instead of running: one run, judged like a fresh one",
                  flag_values=FLAGS)
flags.DEFINE_string("rows_device", None, "with --from_rows: the device the rows ran on",
                    flag_values=FLAGS)
flags.DEFINE_string("rows_commit", None, "with --from_rows: the git commit that ran them",
                    flag_values=FLAGS)
flags.DEFINE_string("rows_date", None, "with --from_rows: when they ran (ISO 8601)",
                    flag_values=FLAGS)
flags.DEFINE_string("row", None, "internal: run one row (JSON) and print it", flag_values=FLAGS)


def qwen7b_shapes() -> dict:
  """Qwen2.5-7B's model fields from its config.json (tests/fixtures/config_only), RoPE base as
  the L2A recipe raises it (5e6)."""
  with open(QWEN7B_CONFIG) as f:
    h = json.load(f)
  return dict(family=h["model_type"], vocab_size=h["vocab_size"], hidden_size=h["hidden_size"],
              intermediate_size=h["intermediate_size"], num_layers=h["num_hidden_layers"],
              num_heads=h["num_attention_heads"], num_kv_heads=h["num_key_value_heads"],
              head_dim=h["hidden_size"] // h["num_attention_heads"], rope_theta=5e6,
              rms_norm_eps=h["rms_norm_eps"], tie_word_embeddings=h["tie_word_embeddings"],
              attention_bias=True)


def row_rows(layout: str, n: int, rows: int = 0) -> int:
  """Rows per step: --rows, else n for the data layout and 1 otherwise."""
  return rows or (n if layout == "data" else 1)


def row_config(T: int, scheme: str, layout: str, n: int, *, tiny: bool, strategy: str,
               model: str = "1.5b", rows: int = 0, steps: int = 0):
  """The run config of one row (bench/e2e.py's, or the 7B L2A recipe's, with this layout's batch
  and mesh: seqfsdp is fsdp 2 x sequence n / 2)."""
  if model == "7b_recipe":
    if scheme != "l2a":
      raise SystemExit(f"bench.scale: --model=7b_recipe is the L2A recipe; scheme {scheme!r} "
                       "has none (use --schemes=l2a)")
    from configs import l2a_qwen
    c = l2a_qwen.get_config(f"qwen2.5-7b,seq={T},steps={max(steps, 1)}"
                            + (",window=8" if tiny else ""))  # tiny: a window the row exceeds
    c.model.init_from = None  # random init: the recipe's shapes without weights
    for k, v in (e2e.TINY if tiny else qwen7b_shapes()).items():
      c.model[k] = v
    c.train.progress_bar = False
  else:
    c = e2e.run_config(T, SCHEMES[scheme], shapes=e2e.TINY if tiny else e2e.QWEN25_1P5B)
  c.data.batch_size = row_rows(layout, n, rows)
  fsdp = 2 if layout == "seqfsdp" else 1
  if layout == "seqfsdp" and (n % 2 or n < 4):
    raise SystemExit(f"bench.scale: layout seqfsdp x{n}: fsdp 2 x sequence n / 2 needs n a "
                     "multiple of 2 and >= 4")
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = (n if layout == "data" else 1), fsdp, 1
  c.mesh.sequence = n if layout == "sequence" else n // 2 if layout == "seqfsdp" else 1
  c.mesh.sequence_attention = strategy
  return c


def run_row(T: int, scheme: str, layout: str, n: int, *, tiny: bool = False, reps: int = 3,
            strategy: str = "all_gather", halo_exchange: str = "ppermute", model: str = "1.5b",
            rows: int = 0, steps: int = 0) -> dict:
  """Measures one (T, scheme, layout) row on the first n devices (1 for 'one'); steps > 0: that
  many training steps on fresh batches, every loss kept (`losses`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax.parallel import context
  from condattn_jax.train import loop
  k = 1 if layout == "one" else n
  t_row = time.perf_counter()
  phase = lambda name: print(f"PHASE {name} {time.perf_counter() - t_row:.1f}s", file=sys.stderr,
                             flush=True)  # a row cut by its timeout names where it was
  devices = jax.devices()[:k]
  phase("devices")
  c = row_config(T, scheme, layout, k, tiny=tiny, strategy=strategy, model=model, rows=rows,
                 steps=steps)
  row: dict[str, Any] = dict(T=T, scheme=scheme, layout=layout, devices=k,
                             rows=int(c.data.batch_size), halo_exchange=halo_exchange)
  if model != "1.5b":
    row["model"] = model
  setup = loop.build(c, devices=devices)
  row["mesh"] = dict(setup.mesh.shape)
  phase("built")
  state = loop.init_state(setup)
  jax.block_until_ready(state)
  phase("initialised")
  vocab = setup.model_cfg.vocab_size

  def make_batch(i):  # steps == 0: the baseline's row copied; else step i's own rows
    ones = ([e2e.random_batch(T, vocab, seed=1)] * row["rows"] if not steps else
            [e2e.random_batch(T, vocab, seed=1000 * (i + 1) + r) for r in range(row["rows"])])
    b = {key: jnp.concatenate([o[key] for o in ones], axis=0) for key in ones[0]}
    return jax.device_put(b, setup.batch_sharding)

  batch = make_batch(0)
  with setup.mesh_context(), context.halo_exchange(halo_exchange):
    t0 = time.perf_counter()
    compiled = loop.jit_train_step(setup).lower(setup.abstract_state,
                                                setup.batch_abstract).compile()
    row["compile_s"] = time.perf_counter() - t0
    mem = loop.compiled_memory(compiled)
    if mem:  # the dry run's prediction (train.py --dry_run_device on this device kind)
      row["predicted_peak_bytes"] = mem["peak_estimate_bytes"]
    phase("compiled")
    if steps:
      ts, losses = [], []
      for i in range(steps):
        b = jax.block_until_ready(make_batch(i))
        t0 = time.perf_counter()
        state, metrics = compiled(state, b)
        jax.block_until_ready((state.params, metrics))
        ts.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(jax.device_get(metrics["loss"])))
        phase(f"step {i} {ts[-1]:.0f} ms loss {losses[-1]:.6f}")
      row.update(losses=losses, loss=losses[0], step_ms_all=ts,
                 step_ms=float(np.median(ts[1:] if steps > 1 else ts)))
      return _finish_row(row, devices, T, k)
    box = {"state": state}

    def step():
      box["state"], box["metrics"] = compiled(box["state"], batch)
      return box["state"].params, box["metrics"]

    jax.block_until_ready(step())  # the first step: its loss is the comparison's
    row["loss"] = float(jax.device_get(box["metrics"]["loss"]))
    phase("first step")
    ts = []
    for i in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(step())
      ts.append((time.perf_counter() - t0) * 1e3)
      phase(f"step {i + 1} {ts[-1]:.0f} ms")
  row["step_ms"] = float(np.median(ts))
  row["step_ms_all"] = ts
  return _finish_row(row, devices, T, k)


def _finish_row(row: dict, devices, T: int, k: int) -> dict:
  """Throughput and the measured peak memory (max over the row's devices) of a timed row."""
  row["tokens_per_s"] = row["rows"] * T / (row["step_ms"] / 1e3)
  row["tokens_per_s_per_device"] = row["tokens_per_s"] / k
  stats = [d.memory_stats() or {} for d in devices]
  peaks = [s.get("peak_bytes_in_use") for s in stats if s.get("peak_bytes_in_use")]
  row["peak_bytes"] = max(peaks) if peaks else None
  row["device_kind"] = devices[0].device_kind
  return row


def _child(spec: dict, gpus: list[int] | None = None, timeout_s: float | None = None,
           module: str = "bench.scale") -> subprocess.Popen:
  """One row in a fresh process (its peak memory is its own), on `gpus` only when given;
  `module` is the bench whose `--row=` runs it (its main calls `print_row`)."""
  env = dict(os.environ)
  if timeout_s:  # the child dumps its Python stacks (stderr) shortly before it would be killed
    env["CONDATTN_ROW_STACKS_AT_S"] = str(max(1.0, timeout_s - 10))
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
  cmd = [sys.executable, "-m", module, f"--row={json.dumps(spec)}"]
  return subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _child_row(spec: dict, p: subprocess.Popen, timeout_s: float | None) -> dict:
  """The row a child printed; an error (the last stderr line, or 'timeout') recorded on it."""
  try:
    out, err = p.communicate(timeout=timeout_s or None)
  except subprocess.TimeoutExpired:
    p.kill()
    _, err = p.communicate()
    lines = (err or "").splitlines()
    phases = [l for l in lines if l.startswith("PHASE ")]
    return dict(spec, error=[f"timeout after {timeout_s} s",
                             f"last phase: {phases[-1][6:] if phases else 'none (before jax)'}"],
                stderr_tail=lines[-40:])
  for line in out.splitlines():
    if line.startswith("ROW "):
      return json.loads(line[4:])
  return dict(spec, error=(err or out).strip().splitlines()[-1:] or [f"rc {p.returncode}"])


def print_row(run_row, row_json: str) -> int:
  """The child's side of `_child`: run_row(**spec) printed as a ROW line; with
  CONDATTN_ROW_STACKS_AT_S set, the Python stacks are dumped that many seconds in."""
  if os.environ.get("CONDATTN_ROW_STACKS_AT_S"):
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["CONDATTN_ROW_STACKS_AT_S"]))
  print("ROW " + json.dumps(run_row(**json.loads(row_json))), flush=True)
  return 0


def _row_in_child(spec: dict, timeout_s: float | None = None) -> dict:
  return _child_row(spec, _child(spec, timeout_s=timeout_s), timeout_s)


def row_devices(spec: dict) -> int:
  return 1 if spec["layout"] == "one" else spec["n"]


def run_concurrent(specs: list[dict], num_devices: int, timeout_s: float | None,
                   on_row=lambda row: None) -> list[dict]:
  """Each spec in its own child on disjoint devices, as many at a time as fit (first-fit in
  plan order); rows returned in plan order."""
  import threading
  free, lock, done = list(range(num_devices)), threading.Condition(), {}
  threads = []

  def worker(i, spec, gpus):
    try:
      row = _child_row(spec, _child(spec, gpus, timeout_s), timeout_s)
    except Exception as e:  # noqa: BLE001 -- recorded on the row; the scheduler must go on
      row = dict(spec, error=[f"{type(e).__name__}: {e}"])
    row["gpus"], row["devices"] = gpus, row_devices(spec)
    with lock:
      done[i] = row
      free.extend(gpus)
      lock.notify_all()
    on_row(row)

  pending = list(enumerate(specs))
  with lock:
    while pending:
      start = next(((i, s) for i, s in pending if row_devices(s) <= len(free)), None)
      if start is None:
        lock.wait()
        continue
      pending.remove(start)
      k = row_devices(start[1])
      free.sort()
      gpus, free[:] = free[:k], free[k:]
      t = threading.Thread(target=worker, args=(start[0], start[1], gpus))
      t.start()
      threads.append(t)
  for t in threads:
    t.join()
  return [done[i] for i in range(len(specs))]


def plan(a, n_all: int) -> list[dict]:
  """The rows to run: --plan, else --T x --schemes x (one + --layouts x --devices)."""
  base = dict(tiny=a.tiny, reps=a.reps, strategy=a.strategy, halo_exchange=a.halo_exchange,
              model=a.model, rows=a.rows, steps=a.steps)
  if a.plan:
    out = []
    for item in a.plan:
      f = item.split(":")
      if len(f) not in (3, 4) or f[1] not in SCHEMES or f[2] not in LAYOUTS:
        raise SystemExit(f"bench.scale: --plan item {item!r}: want T:scheme:layout[:n] with "
                         f"scheme in {list(SCHEMES)}, layout in {list(LAYOUTS)}")
      out.append(dict(base, T=int(f[0]), scheme=f[1], layout=f[2],
                      n=1 if f[2] == "one" else int(f[3]) if len(f) == 4 else n_all))
    return out
  counts = [int(d) or n_all for d in a.devices]
  out = []
  for T in [int(x) for x in a.T]:
    for scheme in a.schemes:
      out.append(dict(base, T=T, scheme=scheme, layout="one", n=1))
      for n in counts:
        out += [dict(base, T=T, scheme=scheme, layout=l, n=n) for l in a.layouts if l != "one"]
  return out


def summarize(rows: list[dict], loss_rtol: float,
              steps_rtol: float = 2e-3) -> tuple[list[dict], dict, dict]:
  """(rows with scaling_efficiency / loss_rel_diff, claims {name: passed}, goal). Rows with
  per-step `losses` (--steps) are also compared step by step with the first such row of their
  (T, scheme, model): steps_rel_diff = the largest relative difference over the steps."""
  for r in rows:  # a row whose child failed carries its spec: name its device count
    r.setdefault("devices", 1 if r["layout"] == "one" else r.get("n"))
  base = {(r["T"], r["scheme"]): r for r in rows if r["layout"] == "one" and "loss" in r}
  claims = {}
  for r in rows:
    b = base.get((r["T"], r["scheme"]))
    if r["layout"] == "one" or b is None or "loss" not in r:
      continue
    r["scaling_efficiency"] = r["tokens_per_s_per_device"] / b["tokens_per_s_per_device"]
    r["loss_rel_diff"] = abs(r["loss"] - b["loss"]) / abs(b["loss"])
    claims[f"{r['scheme']} {r['T']} {r['layout']} x{r['devices']}: loss within {loss_rtol} of "
           "one device"] = r["loss_rel_diff"] <= loss_rtol
  ref: dict = {}
  for r in rows:
    if "losses" not in r:
      continue
    key = (r["T"], r["scheme"], r.get("model", "1.5b"))
    b = ref.setdefault(key, r)
    if b is r:
      continue
    if len(b["losses"]) != len(r["losses"]):
      raise ValueError(f"bench.scale: rows {b['layout']} x{b['devices']} and {r['layout']} "
                       f"x{r['devices']} ran {len(b['losses'])} / {len(r['losses'])} steps")
    r["steps_reference"] = f"{b['layout']} x{b['devices']}"
    r["steps_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], b["losses"]))
    claims[f"{r.get('model', '1.5b')} {r['scheme']} {r['T']} {r['layout']} x{r['devices']}: "
           f"{len(r['losses'])} step losses within {steps_rtol} of {r['steps_reference']}"] = (
               r["steps_rel_diff"] <= steps_rtol)
  hit = [r for r in rows if r["scheme"] == GOAL["scheme"] and r["T"] == GOAL["T"]
         and r["layout"] == GOAL["layout"] and r["devices"] == GOAL["devices"]
         and "scaling_efficiency" in r]
  goal = dict(GOAL, efficiency=hit[0]["scaling_efficiency"] if hit else None,
              met=bool(hit) and hit[0]["scaling_efficiency"] >= GOAL["min_efficiency"])
  return rows, claims, goal


def table(rows: list[dict]) -> str:
  head = f"{'T':>7} {'scheme':>6} {'layout':>8} {'dev':>3} {'step ms':>9} {'tok/s/dev':>10} " \
         f"{'eff':>5} {'loss':>8} {'peak GiB':>8}"
  out = [head]
  for r in rows:
    if "step_ms" not in r:
      out.append(f"{r['T']:>7} {r['scheme']:>6} {r['layout']:>8}  error: {r.get('error')}")
      continue
    eff = r.get("scaling_efficiency")
    peak = r.get("peak_bytes")
    out.append(f"{r['T']:>7} {r['scheme']:>6} {r['layout']:>8} {r['devices']:>3} "
               f"{r['step_ms']:>9.1f} {r['tokens_per_s_per_device']:>10.0f} "
               f"{'-' if eff is None else f'{eff:.2f}':>5} {r['loss']:>8.4f} "
               f"{'-' if peak is None else f'{peak / 2**30:.2f}':>8}")
  return "\n".join(out)


def model_name(a) -> str:
  shapes = "bench/e2e.py TINY shapes" if a.tiny else None
  if a.model == "7b_recipe":
    return (f"configs/l2a_qwen.py qwen2.5-7b recipe, {shapes or 'Qwen2.5-7B shapes'}, random init, "
            "bf16 compute, fp32 master weights")
  return shapes or "Qwen2.5-1.5B shapes (bench/e2e.py)"


def record_rows(a) -> int:
  """--from_rows: the rows of progress files judged and appended as one run, with the device,
  commit and date they ran on (flags; a row's own device_kind must agree)."""
  rows = []
  for path in a.from_rows:
    with open(path) as f:
      rows += [json.loads(line) for line in f if line.strip()]
  if not rows:
    raise SystemExit(f"bench.scale: --from_rows {a.from_rows}: no rows")
  kinds = {r["device_kind"] for r in rows if "device_kind" in r} | (
      {a.rows_device} if a.rows_device else set())
  if len(kinds) != 1 or not a.rows_commit or not a.rows_date:
    raise SystemExit("bench.scale: --from_rows needs one device (rows' device_kind or "
                     f"--rows_device; got {sorted(kinds)}), --rows_commit and --rows_date")
  (device,) = kinds
  rows, claims, goal = summarize(rows, a.loss_rtol, a.steps_rtol)
  result = dict(rows=rows, goal=goal, settings=dict(
      plan=[f"{r['T']}:{r['scheme']}:{r['layout']}:{r['devices']}" for r in rows],
      from_rows=[os.path.basename(p) for p in a.from_rows], loss_rtol=a.loss_rtol,
      reps=a.reps, strategy=a.strategy, model=model_name(a)))
  run = common.make_run("scale", result, name="main", claims=claims)
  run.update(device=device, git_commit=a.rows_commit, date=a.rows_date)
  path = common.result_path("scale", a.out_dir, device=device)
  common.append_run(path, run)
  print(table(rows))
  print(f"goal {goal}\nwrote {path}")
  return 0


def main(argv=None) -> int:
  fv = common.parse_flags(FLAGS, argv)
  a = types.SimpleNamespace(**{name: fv[name].value for name in fv})
  if a.row:
    return print_row(run_row, a.row)
  if bad := [s for s in a.schemes if s not in SCHEMES] + [l for l in a.layouts if l not in LAYOUTS]:
    raise SystemExit(f"bench.scale: unknown --schemes / --layouts {bad}: choose from "
                     f"{list(SCHEMES)} / {list(LAYOUTS)}")
  if a.from_rows:
    return record_rows(a)
  import jax
  n_all = jax.device_count()
  specs = plan(a, n_all)
  if bad := [s for s in specs if row_devices(s) > n_all or (s["layout"] != "one" and s["n"] < 2)]:
    raise SystemExit(f"bench.scale: {n_all} device(s) here: rows {bad[0]['layout']} x{bad[0]['n']}"
                     " need 2..n devices (--devices / --plan)")

  if a.progress:
    os.makedirs(os.path.dirname(os.path.abspath(a.progress)), exist_ok=True)

  def on_row(row):
    print(table([row]).splitlines()[-1], flush=True)
    if a.progress:
      with open(a.progress, "a") as f:
        f.write(json.dumps(row) + "\n")

  if a.concurrent and not a.inprocess:
    rows = run_concurrent(specs, n_all, a.row_timeout_s, on_row)
  else:
    rows = []
    for spec in specs:
      rows.append(run_row(**spec) if a.inprocess else _row_in_child(spec, a.row_timeout_s))
      on_row(rows[-1])
  rows, claims, goal = summarize(rows, a.loss_rtol, a.steps_rtol)
  result = dict(rows=rows, goal=goal, settings=dict(
      T=sorted({s["T"] for s in specs}), schemes=sorted({s["scheme"] for s in specs}),
      layouts=sorted({s["layout"] for s in specs}), devices=sorted({row_devices(s) for s in specs}),
      plan=[f"{s['T']}:{s['scheme']}:{s['layout']}:{row_devices(s)}" for s in specs],
      concurrent=bool(a.concurrent), strategy=a.strategy, halo_exchange=a.halo_exchange,
      reps=a.reps, tiny=a.tiny, loss_rtol=a.loss_rtol, rows=a.rows, steps=a.steps,
      steps_rtol=a.steps_rtol, model=model_name(a)))
  path = common.result_path("scale", a.out_dir)
  common.write_result(path, "scale", result, name="tiny" if a.tiny else "main", claims=claims)
  print(table(rows))
  print(f"goal {goal}\nwrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
