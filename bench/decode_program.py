r"""What one decode step runs: the op histogram of a compiled program, per layer (issue 33).

    # on the GPU: compile (abstract arguments, nothing allocated) the engine's decode program and
    # the plain-XLA per-layer baseline of bench/decode.py for this device; print the table
    python -m bench.decode_program --shapes=qwen2.5-1.5b --B=1 --T=8192
    # on any host: the StableHLO exported for an abstract H100 (what reaches XLA:GPU: custom
    # calls, dots, scatters, conditionals; XLA:GPU's fusions happen after this)
    python -m bench.decode_program --export=cuda --shapes=qwen2.5-1.5b --B=1 --T=8192

    # on the GPU: the engine's step timed in one process for the stacked and the split params
    # layout (same weights), with each compiled program's launches / copy_bytes beside the ms;
    # --option passes XLA options to the compiles (the same-process A/B of a compiler switch)
    python -m bench.decode_program --time --B=1 --T=8192,32768,131072
    python -m bench.decode_program --time --T=8192 --option=xla_gpu_dot_merger_threshold_mb=0

    # on the GPU: where a step's time goes, per variant in one process (profile_step): wall,
    # bare program, host dispatch, device-busy ms and kernels per token from a jax.profiler
    # trace, for both params layouts, XLA command buffers off / default / extended (CB_MODES),
    # dot merging, the decode attention path (TRACE_SETS: cuDNN split-KV / XLA reference) and
    # bench/decode.py's plain-XLA per-layer step; prints a table
    python -m bench.decode_program --time --profile --T=8192,131072 --out_dir=bench/results

    # on the GPU: the pre-registered A/B of a decode path (ADOPTION_RULE): the default (first
    # --variants entry) and candidates of --scheme, with dense, interleaved in one process
    python -m bench.decode_program --ab --scheme=l2a --T=8192,131072 --repeats=7 \
        --variants=stacked,stacked:noskip --dense_variants=stacked --out_dir=bench/results

    # on the GPU: how far bf16 decode logits are from float32 on the same weights and cache
    # (fp32_check: the default, the XLA reference attention, the Mosaic GPU decode kernel), a
    # table per (scheme, T), the run recorded with rule_check's verdict
    python -m bench.decode_program --fp32_check=dense,l2a --fp32_variants=refattn,mgpu \
        --T=8192 --out=fp32.json --out_dir=bench/results --name=d_fp32_check

    # on the GPU: CB_UPDATE_RULE (XLA's command-buffer update mode, a process setting): run A
    # without XLA_FLAGS, then run B with the flag, compared to A's --out
    python -m bench.decode_program --ab --scheme=l2a --T=8192,131072 --repeats=5 \
        --variants=stacked --dense_variants=stacked --out=a.json --name=cbupd_a --out_dir=...
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP python -m bench.decode_program \
        --ab --scheme=l2a --T=8192,131072 --repeats=5 --variants=stacked:alwaysupdate,stacked \
        --dense_variants=stacked:alwaysupdate,stacked --compare_to=a.json --name=cbupd_b ...

A step at fixed T is bounded by its bytes (weights + K/V), but a small step is bounded by what
the GPU launches per layer: every fusion, library call (cuBLAS / cuDNN), Pallas kernel, copy and
in-place update is one kernel. `op_histogram(compiled.as_text())` reads a compiled program's HLO
and counts them (the instructions XLA turns into thunks: those of the entry computation and of
the computations it runs through while / conditional / call, never a fusion's body); `per_layer`
compiles the program at two layer counts and splits the histogram into a per-layer part and a
fixed part (embedding, logits, ...), exactly: the layers are unrolled, each one the same ops.

Histogram keys (counts; `launches` sums every kernel-like key):
  fusion:<kind>      a fusion: kind 'loop' / 'input' (a reduction) / 'output', or for a custom
                     fusion its backend kind (e.g. '__triton_gemm', '__cudnn$fusion')
  custom-call:<target>  a library or Pallas call ('__cublas$gemm', '__cudnn$fmhaSoftmax',
                     'mosaic_gpu_v2', ...)
  <opcode>           any other op that runs on its own: copy, dynamic-update-slice, scatter,
                     dot, while, conditional, all-reduce, ... (plumbing is not counted:
                     parameter, constant, tuple, get-tuple-element, bitcast, ...)
  copy_bytes         result bytes of pure data movement: copies and loop fusions made only of
                     copy / slice / concatenate / transpose / pad / broadcast / convert / ...
                     (a weight sliced, concatenated or widened into a new buffer every step
                     shows here; the CPU compiler widens bf16 dot operands to f32, so a CPU
                     figure holds every weight once: compare layouts, not backends)
A StableHLO module (jax.export's `mlir_module()`) gets `stablehlo_histogram` instead: every op
name and custom-call target, before XLA fuses anything.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import sys

from condattn_jax.parallel.hlo import shape_bytes

# Ops that are plumbing, not work: no thunk of their own (or a no-op one).
PLUMBING = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "iota"})
CONTROL = frozenset({"while", "conditional", "call"})
# A fusion made of these only moves (or widens) data: a copy kernel.
MOVE_OPS = frozenset({"copy", "concatenate", "slice", "transpose", "pad", "dynamic-slice",
                      "broadcast", "reshape", "bitcast", "convert", "parameter", "constant",
                      "tuple", "get-tuple-element"})
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r"kind=k(\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  comps: dict[str, list[str]] = {}
  entry, cur = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      cur = comps.setdefault(m.group(1), [])
      if line.startswith("ENTRY"):
        entry = m.group(1)
    elif cur is not None and line.startswith("  "):
      cur.append(line)
  return comps, entry


def _ops(lines: list[str]) -> set[str]:
  return {m.group(2) for m in map(_INSTR.match, lines) if m}


def op_histogram(hlo_text: str) -> dict[str, int]:
  """The kernel-like ops of a compiled program's HLO text (`compiled.as_text()`), counted once
  per execution: an op inside a while body counts its loop's known trip count times (1 when
  unknown). Keys as in the module docstring, plus 'launches' and 'copy_bytes'."""
  comps, entry = _computations(hlo_text)
  if entry is None:
    raise ValueError("op_histogram: no ENTRY computation in the text (pass the compiled "
                     "program's HLO: jax.jit(f).lower(...).compile().as_text()).")
  hist: collections.Counter = collections.Counter()
  seen: set[tuple[str, int]] = set()

  def walk(name: str, trips: int):
    if (name, trips) in seen or name not in comps:
      return
    seen.add((name, trips))
    for line in comps[name]:
      m = _INSTR.match(line)
      if not m:
        continue
      shape, op = m.group(1), m.group(2)
      if op in PLUMBING:
        continue
      if op == "fusion":
        callee = _CALLS.search(line)
        body = comps.get(callee.group(1), []) if callee else []
        kind = (_KIND.search(line) or [None, "?"])[1].lower()
        if kind == "custom":
          bk = _BACKEND_KIND.search(line)
          kind = bk.group(1) if bk else "custom"
        hist[f"fusion:{kind}"] += trips
        if kind == "loop" and body and _ops(body) <= MOVE_OPS:
          hist["copy_bytes"] += shape_bytes(shape) * trips
        continue
      if op == "custom-call":
        t = _TARGET.search(line)
        hist[f"custom-call:{t.group(1) if t else '?'}"] += trips
        continue
      if op == "copy":
        hist["copy_bytes"] += shape_bytes(shape) * trips
      hist[op] += trips
      if op == "while":
        t = _TRIPS.search(line)
        n = int(t.group(1)) if t else 1
        body = re.search(r"body=%?([\w.\-]+)", line)
        cond = re.search(r"condition=%?([\w.\-]+)", line)
        if body:
          walk(body.group(1), trips * n)
        if cond:
          walk(cond.group(1), trips * (n + 1))
      elif op == "conditional":
        b = _BRANCHES.search(line)
        names = ([x.strip().lstrip("%") for x in b.group(1).split(",")] if b else
                 re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
        for n in names:
          walk(n, trips)  # every branch counted: an upper bound on what one step runs
      elif op == "call":
        for n in _CALLS.findall(line):
          walk(n, trips)
  walk(entry, 1)
  out = dict(sorted(hist.items()))
  out["launches"] = sum(v for k, v in out.items()
                        if k not in ("copy_bytes",) and k not in CONTROL)
  out.setdefault("copy_bytes", 0)
  return out


def stablehlo_histogram(mlir_text: str) -> dict[str, int]:
  """Every op of a StableHLO module (jax.export's `mlir_module()`) by name, and its custom
  calls by target ('custom_call:<target>'), nothing fused yet; a private function's ops count
  once per `func.call` of it (jax lowers a repeated jitted / custom-vjp body as one function
  called from every layer), from the public `main`."""
  funcs: dict[str, list[str]] = {}
  cur = None
  for line in mlir_text.splitlines():
    m = re.match(r"\s*func\.func (?:public |private )?@([\w$.\-]+)\(", line)
    if m:
      cur = funcs.setdefault(m.group(1), [])
    if cur is not None:
      cur.append(line)

  @functools.cache
  def count(name: str) -> tuple:
    hist: collections.Counter = collections.Counter()
    for line in funcs.get(name, []):
      for op in re.findall(r'= "?((?:stablehlo|chlo|mhlo)\.[\w.]+)', line):
        hist[op] += 1
      for t in re.findall(r"custom_call @([\w$.:\-]+)", line):
        hist[f"custom_call:{t}"] += 1
      for callee in re.findall(r"(?:= |^\s*)(?:func\.)?call @([\w$.\-]+)", line):
        hist.update(dict(count(callee)))
    return tuple(hist.items())

  if "main" not in funcs:
    raise ValueError("stablehlo_histogram: no public main function in the module (pass "
                     "jax.export.export(...)(...).mlir_module()).")
  return dict(sorted(count("main")))


def split_layers(h_a: dict, n_a: int, h_b: dict, n_b: int) -> tuple[dict, dict]:
  """(per layer, fixed) from the histograms of one program at n_a < n_b unrolled layers:
  per layer = (h_b - h_a) / (n_b - n_a), fixed = h_a - n_a * per layer (keys present in either;
  a fractional per-layer count means the layers are not all alike)."""
  keys = sorted(set(h_a) | set(h_b))
  per = {k: (h_b.get(k, 0) - h_a.get(k, 0)) / (n_b - n_a) for k in keys}
  per = {k: int(v) if float(v).is_integer() else v for k, v in per.items()}
  fixed = {k: h_a.get(k, 0) - n_a * per[k] for k in keys}
  return ({k: v for k, v in per.items() if v}, {k: v for k, v in fixed.items() if v})


# ------------------------------------------------------------------------------------------------
# The programs
# ------------------------------------------------------------------------------------------------

def h100_mesh():
  """An abstract one-device H100 (ops.attention then lowers its cuda branch from any host)."""
  from jax.sharding import AbstractDevice, AbstractMesh
  return AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


def model_config(shapes: str, layers: int | None = None, scheme: str = "dense", T: int = 8192):
  """bench/decode.py's model config of `scheme` on `shapes` (bf16), with `layers` layers."""
  from bench import decode as bd
  cfg, _ = bd.scheme_config(scheme, shapes, T)
  return cfg if layers is None else dataclasses.replace(cfg, num_layers=layers)


def block_fields(eng, B: int, T: int) -> tuple:
  """The engine's static fields of a one-token step inside a block after a prefill of T tokens
  (every row active, past its first token: Elastic's decided step, MATCH's reusing step), as
  its decode loops pass them (`Engine._decode_fields`); () for a scheme without such facts."""
  import numpy as np
  return eng._decode_fields(np.full(B, T + 1, np.int32), np.ones(B, bool))


def engine_program(cfg, B: int, T: int, split: bool = False):
  """(fn, abstract args, donated argnums) of the engine's decode program: `Engine._step` with
  one token per row over a cache of T + bench.decode.EXTRA slots (what `Engine.decode_step`
  runs), with the static fields the engine's decode loops pass a step inside a block (every
  row past its first token: Elastic's decided step, MATCH's reusing step); `split`: the params
  in `models.stacking.split_groups`' layout."""
  import jax
  import jax.numpy as jnp
  from bench import decode as bd
  from condattn_jax.inference import Engine
  from condattn_jax.models import stacking
  params = bd.abstract_params(cfg)
  if split:
    params = jax.eval_shape(stacking.split_groups, params)
  eng = Engine(cfg, params, cache_len=T + bd.EXTRA)
  cache = eng.cache_shapes(B)
  sds = jax.ShapeDtypeStruct
  args = (params, cache, sds((B, 1), jnp.int32), sds((B, 1), jnp.int32), sds((B, 1), jnp.bool_),
          sds((B, cfg.vocab_size), jnp.float32))
  sf = block_fields(eng, B, T)
  return (lambda *a: Engine._step(eng, *a, static_fields=sf)), args, (1,)


def baseline_program(cfg, B: int, T: int):
  """(fn, abstract args, donated argnums) of bench/decode.py's plain-XLA per-layer step
  (`baseline_step_layers`: one donated cache array per layer, a python loop over layers)."""
  import jax
  import jax.numpy as jnp
  from bench import decode as bd
  params = bd.abstract_params(cfg)
  kv = jax.ShapeDtypeStruct((B, T + bd.EXTRA, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
  caches = tuple(kv for _ in range(cfg.num_layers))
  fn = functools.partial(bd.baseline_step_layers, cfg)
  args = (params, caches, caches, jax.ShapeDtypeStruct((B,), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
  return fn, args, (1, 2)


PROGRAMS = {"engine": engine_program, "xla_per_layer": baseline_program,
            "engine_split": functools.partial(engine_program, split=True)}


def compiled_text(program: str, cfg, B: int, T: int) -> str:
  """The HLO text of `program` compiled for this process's default backend."""
  import jax
  fn, args, donate = PROGRAMS[program](cfg, B, T)
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def cudnn_exportable():
  """A context in which cuDNN attention lowers without a GPU (ops' cuDNN decode path is taken as
  on an H100 with cuDNN 9.10: what `auto` picks there), for `exported_text`."""
  import contextlib
  from unittest import mock
  from jax._src import dispatch
  from jax._src.cudnn import fused_attention_stablehlo as fa
  from condattn_jax import ops
  stack = contextlib.ExitStack()
  # cuDNN's primitive asks for devices at lowering (its custom partitioning): one device here
  # and its custom partitioning's lowering then wants a device assignment; on one device it
  # lowers the wrapped call, which is what this does
  from jax._src import core, custom_partitioning as cp
  from jax._src.interpreters import mlir
  stack.enter_context(mock.patch.object(dispatch, "jaxpr_has_prim_requiring_devices",
                                        lambda jaxpr: False))

  def one_device(ctx, *values, call, **_):
    return mlir.lower_fun(core.jaxpr_as_fun(call), multiple_results=True)(ctx, *values)
  stack.enter_context(mock.patch.dict(mlir._lowerings, {
      cp.custom_partitioning_p: mlir.LoweringRuleEntry(one_device, False)}))
  stack.enter_context(mock.patch.object(ops, "cudnn_available", lambda: None))
  stack.enter_context(mock.patch.object(fa, "check_cudnn_version", lambda: 91000))
  stack.enter_context(mock.patch.object(fa, "check_compute_capability", lambda c: c <= "9.0"))
  stack.enter_context(mock.patch.object(fa, "is_cuda_compute_capability_equal",
                                        lambda c: c == "9.0"))
  return stack


def exported_text(program: str, cfg, B: int, T: int, platform: str = "cuda") -> str:
  """The StableHLO of `program` exported for `platform` ('cuda': an abstract H100, cuDNN on)."""
  import jax
  fn, args, donate = PROGRAMS[program](cfg, B, T)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (
      "__cudnn$fmhaSoftmax", "__gpu$xla.gpu.triton")]
  import contextlib
  mesh = (jax.sharding.use_abstract_mesh(h100_mesh()) if program.startswith("engine")
          else contextlib.nullcontext())  # the baseline calls no ops.attention
  if program.startswith("engine"):  # the arguments on the mesh the step's values live on
    rep = jax.sharding.NamedSharding(h100_mesh(), jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
  with cudnn_exportable(), mesh:
    return jax.export.export(jax.jit(fn, donate_argnums=donate), platforms=[platform], disabled_checks=checks)(
        *args).mlir_module()


def table(program: str, shapes: str, B: int, T: int, *, layers=(2, 3), export: str | None = None,
          full: bool = True, scheme: str = "dense") -> dict:
  """{per_layer, fixed, total (at the shapes' own layer count, when `full`)} histograms of
  `program` (compiled here, or exported for `export`); `scheme` (engine programs): bench/decode's
  config of that scheme at context T."""
  if scheme != "dense" and not program.startswith("engine"):
    raise ValueError(f"--scheme={scheme}: program {program!r} is dense only; use engine / "
                     "engine_split.")
  hist = ((lambda c: stablehlo_histogram(exported_text(program, c, B, T, export))) if export
          else (lambda c: op_histogram(compiled_text(program, c, B, T))))
  a, b = layers
  ha, hb = (hist(model_config(shapes, n, scheme, T)) for n in (a, b))
  per, fixed = split_layers(ha, a, hb, b)
  out = dict(program=program, scheme=scheme, shapes=shapes, B=B, T=T, layers=layers,
             backend=f"export:{export}" if export else _backend(), per_layer=per, fixed=fixed)
  if full:
    cfg = model_config(shapes, None, scheme, T)
    out["num_layers"] = cfg.num_layers
    out["total"] = hist(cfg)
  return out


def step_inputs(eng, B: int, T: int):
  """The engine's decode-step inputs after a prefill of T tokens, on its devices: (token ids 0
  [B, 1], positions T [B, 1], every row on [B, 1], previous logits 0 [B, vocab] float32), in
  Engine._step's argument order after the cache."""
  import jax.numpy as jnp
  z = lambda shape, dtype, v=0: eng._commit(jnp.full(shape, v, dtype))
  return (z((B, 1), jnp.int32), z((B, 1), jnp.int32, T), z((B, 1), bool, True),
          z((B, eng.config.vocab_size), jnp.float32))


def filled_cache(eng, B: int, T: int, seed: int = 0):
  """The engine's cache for B rows holding T tokens each (random K/V, positions 0..T-1, slots
  < T valid, length T), made on the device: what a prefill of T tokens leaves, for timing."""
  import jax
  import jax.numpy as jnp
  shapes = eng.cache_shapes(B)
  base = jax.random.key(seed)
  import zlib
  leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
  # each leaf's key from its path: two engines whose caches hold the same leaf (one keeping
  # bookkeeping a layer that the other keeps once) hold the same K/V in it
  return eng._commit(jax.tree_util.tree_unflatten(tree, [
      _filled_leaf(path[-1].key, s.shape, jnp.dtype(s.dtype), T, jax.random.fold_in(
          base, zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF))
      for path, s in leaves]))


def _filled_leaf(name, shape, dtype, T, key):
  """One leaf of filled_cache, jitted once for the module (static leaf kind, shape, dtype and T:
  a later cache of the same shapes traces nothing)."""
  return _filled_leaf_jit()(name, shape, dtype, T, key)


@functools.cache
def _filled_leaf_jit():
  import jax   # imported on first use, as everywhere in this module
  return jax.jit(_make_filled_leaf, static_argnums=(0, 1, 2, 3))


def _make_filled_leaf(name, shape, dtype, T, key):
  """Random K/V, positions 0..T-1 and valid slots < T, length T, zeros elsewhere (a scheme's
  per-row state at its init: Elastic's first decode step then decides, from its own token)."""
  import jax
  import jax.numpy as jnp
  if name in ("key", "value"):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
  if name == "length":
    return jnp.full(shape, T, dtype)
  if name in ("positions", "valid"):  # [B, S]
    slot = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return (jnp.where(slot < T, slot, 0) if name == "positions" else slot < T).astype(dtype)
  return jnp.zeros(shape, dtype)  # a scheme's own state (e.g. Elastic's undecided rows)


def time_step(shapes: str, B: int, T: int, *, variants=("stacked", "split"), steps: int = 32,
              repeats: int = 3, warmup: int = 3, compiler_options: dict | None = None,
              log=print) -> list[dict]:
  """The engine's decode step timed in ONE process for each params layout in `variants`
  ('stacked': the model's own; 'split': models.stacking.split_groups), same weights, each over
  a fresh `filled_cache` of T tokens: ms per step (`bench.decode._timed_steps`: `steps` back to
  back, median of `repeats`), compile_s, memory analysis and the compiled program's
  op_histogram (launches, copy_bytes, custom calls). compiler_options: passed to
  `.compile(compiler_options=...)` (XLA debug options by name, e.g.
  {'xla_gpu_dot_merger_threshold_mb': 0}) for every variant."""
  import time
  import jax
  import jax.numpy as jnp
  from bench import decode as bd
  from condattn_jax.inference import Engine
  from condattn_jax.models import stacking
  cfg = model_config(shapes)
  params = bd.init_params(cfg)
  eng = Engine(cfg, params, cache_len=T + 512)
  rows = []
  for variant in variants:
    p = params if variant == "stacked" else jax.jit(stacking.split_groups)(params)
    cache = filled_cache(eng, B, T)
    logits = eng._commit(jnp.zeros((B, cfg.vocab_size), jnp.float32))
    tok = jnp.zeros((B, 1), jnp.int32)
    pos0 = eng._commit(jnp.full((B, 1), T, jnp.int32))
    on = eng._commit(jnp.ones((B, 1), bool))
    t0 = time.perf_counter()
    compiled = Engine._step.lower(eng, p, cache, tok, pos0, on, logits).compile(
        compiler_options=compiler_options or None)
    row = dict(program="engine", params=variant, shapes=shapes, B=B, T=T,
               compile_s=time.perf_counter() - t0, compiler_options=compiler_options or {},
               backend=_backend())
    row.update(bd._mem(compiled))
    hist = op_histogram(compiled.as_text())
    row["launches"], row["copy_bytes"] = hist["launches"], hist["copy_bytes"]
    row["histogram"] = hist

    def step(state, i):
      cache, logits = state
      t = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
      cache, logits, _ = compiled(p, cache, t, pos0 + i, on, logits)
      return cache, logits

    ms, runs, (cache, logits) = bd._timed_steps(step, (cache, logits), steps, repeats, warmup)
    row.update(ms=ms, runs_ms=runs, logits_finite=bool(jnp.all(jnp.isfinite(logits))))
    log(f"{variant}: {ms:.3f} ms/step, {hist['launches']} launches, "
        f"copy {hist['copy_bytes'] / 2**20:.1f} MiB, compile {row['compile_s']:.1f} s")
    rows.append(row)
    del cache, logits, compiled
    if variant != "stacked":
      del p
  return rows


# XLA command buffers (CUDA graphs) per compile, by name: XLA's default set, none (every thunk
# launched on its own), and every kernel kind including library / Pallas custom calls in one
# graph however small (jax 0.11.2's DebugOptions: a comma list of CommandBufferCmdType names; ''
# turns them off); 'cond': XLA's default kinds plus CONDITIONAL and WHILE, so a lax.cond (L2A's
# decode_skip, one a layer) runs inside the graph as a conditional node whose predicate the GPU
# reads, instead of a ConditionalThunk that copies its predicate to the host and waits for it
# (by default each such cond ends the graph before it and drains the stream: a host-bound step).
CB_MODES = {
    "default": {},
    "off": {"xla_gpu_enable_command_buffer": ""},
    "extended": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
                 "xla_gpu_graph_min_graph_size": 1},
    "cond": {"xla_gpu_enable_command_buffer":
             "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"},
}
# Other XLA:GPU switches a variant can name (after its command-buffer mode, same syntax):
# merge dots that share an operand however large (q/k/v, gate/up: XLA's default merges only
# below 32 MB), GEMMs through cuBLAS instead of Triton (Triton GEMM fusions can take elementwise
# prologues, cuBLAS cannot), every Triton GEMM tiling autotuned instead of XLA's short list of
# candidates (a one-token step's products are 2-row GEMVs whose best tiles the short list may
# miss: the gate/up GEMM of a dense Qwen2.5-1.5B layer reads its 55 MB at ~3.1 TB/s on an H200).
OPTION_SETS = {**CB_MODES,
               "dotmerge": {"xla_gpu_dot_merger_threshold_mb": 1024},
               "notriton": {"xla_gpu_enable_triton_gemm": False},
               "exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
               # programmatic dependent launch (Hopper): a kernel's prologue starts while the
               # kernel before it drains, instead of every launch waiting for the last CTA
               "pdl": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True},
               "nopdl": {"xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False},
               **{k.lower().replace("_", ""): {"xla_gpu_command_buffer_update_mode": k}
                  for k in ("ALWAYS_UPDATE", "SKIP_TEMP")}}
# 'alwaysupdate' / 'skiptemp' above: XLA:GPU's command-buffer update mode for one executable
# (jax 0.11.2 DebugOptions.xla_gpu_command_buffer_update_mode). A command buffer (CUDA graph)
# records its kernels' buffer addresses; whenever an address it references changes between two
# calls, XLA re-records ("updates") the nodes that use it before the launch, on the host, a few
# us a node. ALWAYS_UPDATE (the default) leaves the temporaries to the client's allocator, whose
# addresses may move from call to call (then nearly every node of the step is updated: the
# decode step's host time grows with its kernel count, ~5-7 us a kernel on an H100); SKIP_TEMP
# gives the temporaries stable virtual addresses (one VMM reservation per executable), so only
# nodes that read a moved argument or write a new output are updated. SKIP_TEMP needs XLA's VMM
# allocator, which the GPU client only selects when the mode is in XLA_FLAGS at start-up
# (`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`): otherwise the executable falls back to
# ALWAYS_UPDATE silently. CB_UPDATE_RULE settles it.
# What a variant can change in the engine's traced program (engine layouts only): the decode
# attention through the XLA reference ('refattn': model attention_impl='reference': einsum over
# the cache with a length mask, like the plain-XLA baseline); 'noskip': the scheme's decode_skip
# off (L2A, AHA: the global call runs every step, branch-free, its inactive rows reading one kv
# tile per split part and weighted 0: no lax.cond, so no host round trip per layer; same logits
# and caches). The decode kernel in place of cuDNN's split-KV path ('mgpu': ops impl
# 'decode_kernel') lost ADOPTION_RULE's A/B (run d_split_mgpu_ab) and is gone.
# Bench-only trace sets of run d_oproj_minsplit_ab, both rejected by ADOPTION_RULE there and
# deleted: 'oldoproj' (the previous o_proj contraction patched in while tracing, against the
# batched one, models.layers._contract_heads, since reverted: it removed the per-step copy of
# the stacked o_proj slice but its wall time was slower) and 'minsplit' (ops.decode_splits with
# no split of a kv length below 512 slots: logits rel_err 5.5e-2 against the split ring).
# 'stepskip' (AHA): the previous one-token step, its two attention calls each under
# decode_skip's lax.cond (the option decode_skip_steps=True; the default step runs both calls
# branch-free). 'evensplit': the Mosaic GPU decode kernel with the previous
# split, num_parts equal parts per (row, kv head) (DecodeConfig(balance=False) patched into
# pallas_kernels.decode.BACKENDS while tracing), instead of part_count's parts in proportion to
# each (row, kv head)'s reads. 'stages3': the decode backends with DecodeConfig(num_stages=3)
# (three K/V tiles in flight a program instead of two).
# 'cacheparts': a windowed decode call's parts sized by the cache's tiles
# (DecodeConfig(window_parts=False), the default again since run aha11_windowparts_8k);
# 'windowparts': sized by the tiles its window spans (pallas_kernels.decode.tiles_bound,
# DecodeConfig(window_parts=True), the default from dbb5900 until that run rejected it).
TRACE_SETS = ("refattn", "noskip", "stepskip", "evensplit", "stages3", "cacheparts",
              "windowparts")
DECODE_CONFIG_SETS = {"evensplit": dict(balance=False), "stages3": dict(num_stages=3),
                      "cacheparts": dict(window_parts=False),
                      "windowparts": dict(window_parts=True)}


def trace_context(sets):
  """The context a variant's engine step is traced in: TRACE_SETS' 'evensplit' / 'stages3' /
  'cacheparts' give the decode backends their DECODE_CONFIG_SETS fields, with jax's trace
  caches cleared on entry and exit (the engine's jitted step is cached per (config,
  cache_len), which the backends' config is not part of). Otherwise nothing."""
  import contextlib
  fields = {k: v for x in sets for k, v in DECODE_CONFIG_SETS.get(x, {}).items()}
  if not fields:
    return contextlib.nullcontext()
  import jax
  from unittest import mock
  from pallas_kernels import decode as dk
  from pallas_kernels.decode import api as dk_api

  @contextlib.contextmanager
  def switched():
    jax.clear_caches()
    backends = tuple(dataclasses.replace(b, config=dataclasses.replace(b.config, **fields))
                     for b in dk_api.BACKENDS)
    with mock.patch.object(dk_api, "BACKENDS", backends), \
         mock.patch.object(dk, "BACKENDS", backends):
      try:
        yield
      finally:
        jax.clear_caches()
  return switched()


def scheme_params(cfg, scheme: str, aha_full: float = 0.0):
  """bench.decode.init_params(cfg); for scheme 'aha' with aha_full > 0 its routers set by
  bench.decode.aha_static_routing (that fraction of the (layer, head) pairs full for every
  token, as bench.decode's --aha_full: a random-init router routes every pair alike)."""
  from bench import decode as bd
  params = bd.init_params(cfg)
  if scheme == "aha" and aha_full:
    params, _ = bd.aha_static_routing(params, cfg, aha_full)
  return params


def variant_config(cfg, sets):
  """The engine's model config of a variant: TRACE_SETS' 'refattn' (attention_impl='reference',
  and a scheme's compact_impl too: every attention call through the reference), 'noskip'
  (decode_skip=False) and 'stepskip' (AHA's decode_skip and decode_skip_steps on); a scheme
  without the option raises."""
  if "refattn" in sets:
    cfg = _reference_attention(cfg)
  if "noskip" in sets:
    kw = dict(cfg.scheme_kwargs)
    if "decode_skip" not in kw:
      raise ValueError(f"variant set 'noskip': scheme {cfg.scheme!r} has no decode_skip option.")
    kw["decode_skip"] = False
    cfg = dataclasses.replace(cfg, scheme_kwargs=tuple(sorted(kw.items())))
  if "stepskip" in sets:
    if cfg.scheme != "aha":
      raise ValueError(f"variant set 'stepskip': scheme {cfg.scheme!r} is not 'aha'.")
    kw = dict(cfg.scheme_kwargs, decode_skip=True, decode_skip_steps=True)
    cfg = dataclasses.replace(cfg, scheme_kwargs=tuple(sorted(kw.items())))
  return cfg


# Every profiled compile keeps its command buffers under the tracer (by default XLA runs a
# program op by op while a profile is active, which would time a different program).
PROFILE_OPTIONS = {"xla_enable_command_buffers_during_profiling": True}
LAYOUTS = ("stacked", "split", "xla_per_layer")
PROFILE_VARIANTS = ("stacked", "split", "split:off", "split:extended", "split:dotmerge",
                    "split:refattn", "xla_per_layer")


def parse_variant(v: str) -> tuple[str, tuple[str, ...]]:
  """'<layout>[:<set>]...' -> (layout, sets): layout one of LAYOUTS (the engine's step on its
  stacked params or split_groups' layout, or bench/decode's plain-XLA per-layer step), sets
  from OPTION_SETS (XLA options; at most one command-buffer mode of CB_MODES; none = XLA's
  defaults) and TRACE_SETS (the engine's attention path)."""
  layout, *rest = v.split(":")
  if layout not in LAYOUTS:
    raise ValueError(f"--variants: {v!r}: layout {layout!r} is not one of {LAYOUTS}.")
  for x in rest:
    if x not in OPTION_SETS and x not in TRACE_SETS:
      raise ValueError(f"--variants: {v!r}: {x!r} is not an option set "
                       f"{tuple(OPTION_SETS) + TRACE_SETS}.")
  if sum(x in CB_MODES for x in rest) > 1:
    raise ValueError(f"--variants: {v!r}: name at most one command-buffer mode {tuple(CB_MODES)}.")
  if layout == "xla_per_layer" and any(x in TRACE_SETS for x in rest):
    raise ValueError(f"--variants: {v!r}: {TRACE_SETS} change the engine only (stacked / split).")
  return layout, tuple(rest)


def profile_step(shapes: str, B: int, T: int, *, variants=PROFILE_VARIANTS, steps: int = 32,
                 repeats: int = 3, warmup: int = 3, traced: int = 8,
                 compiler_options: dict | None = None, hlo_dir: str | None = None,
                 hlo_variants=(), scheme: str = "dense", aha_full: float = 0.0,
                 log=print) -> list[dict]:
  """Where one decode step's time goes, every variant (`parse_variant`) in ONE process, same
  weights, each over a fresh `filled_cache` of T tokens (per token):

    ms          the bench's loop (bench.decode._timed_steps: argmax of the last logits and
                pos0 + i dispatched beside every step)
    bare_ms     the compiled program alone, called back to back on its own outputs (same
                token and position every call): ms - bare_ms = the bench's extra dispatches
    host_ms     median time for the host to enqueue one call (the call returns before the
                device has run it): host-bound when close to bare_ms
    busy_ms     device-busy time from a jax.profiler trace of `traced` bare calls (the union of
                kernel / memcpy intervals on the GPU's streams), kernels = events per token,
                span_ms first start to last end (span - busy: the GPU idles inside the calls:
                launch gaps), top = the longest kernels
    launches / copy_bytes  the compiled program's op_histogram (per token)
    compile_s, memory analysis, compiler_options (the variant's OPTION_SETS entries +
                PROFILE_OPTIONS + `compiler_options`)

  hlo_dir: the compiled HLO text of each of `hlo_variants` goes to
  `<hlo_dir>/<variant>_B<B>_T<T>.hlo.txt.gz` (':' -> '_'), for reading its fusions offline.

  scheme: the engine's model is bench/decode.py's config of that scheme at context T;
  aha_full: `scheme_params`' AHA routing.

  On a CPU backend every field is measured the same way (a plumbing check: its 'kernels' are
  the XLA CPU client's host-thread events)."""
  import statistics
  import time
  import jax
  import jax.numpy as jnp
  from bench import decode as bd
  from condattn_jax.models import stacking
  parsed = [(v, *parse_variant(v)) for v in variants]
  if scheme != "dense" and any(lay == "xla_per_layer" for _, lay, _ in parsed):
    raise ValueError(f"--scheme={scheme}: the xla_per_layer variant is dense only.")
  cfg = model_config(shapes, scheme=scheme, T=T)
  params = scheme_params(cfg, scheme, aha_full)
  split = (jax.jit(stacking.split_groups)(params)
           if any(lay == "split" for _, lay, _ in parsed) else None)
  rows = []
  for name, layout, sets in parsed:
    built = _build_variant(name, layout, sets, cfg, params, split, B, T, compiler_options,
                           scheme, shapes, hlo_dir if name in hlo_variants else None)
    row = built["row"]
    if row["status"] == "error":
      log(f"{name}: error {row['error']}")
      rows.append(row)
      continue
    try:
      bench, bare, state = built["bench"], built["bare"], built["state"]
      ms, runs, state = bd._timed_steps(bench, state, steps, repeats, warmup)
      row.update(ms=ms, runs_ms=runs)
      host, bare_runs = [], []
      for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
          t1 = time.perf_counter()
          state = bare(state)
          host.append(time.perf_counter() - t1)
        jax.block_until_ready(state)
        bare_runs.append((time.perf_counter() - t0) * 1e3 / steps)
      row.update(bare_ms=statistics.median(bare_runs),
                 host_ms=statistics.median(host) * 1e3)
      state = _trace_row(row, bare, state, traced)
      row["logits_finite"] = bool(jnp.all(jnp.isfinite(_logits(state))))
      row["status"] = "ok"
      log(f"{name}: {row['ms']:.3f} ms/token (bare {row['bare_ms']:.3f}, host "
          f"{row['host_ms']:.3f}, busy {row['busy_ms']:.3f}, {row['kernels']:.0f} kernels, "
          f"{row['launches']:.0f} launches), compile {row['compile_s']:.1f} s")
      del state, built
    except Exception as e:  # recorded; the other variants still run
      row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
      log(f"{name}: error {row['error']}")
    rows.append(row)
  return rows


def _logits(state):
  """The last logits of a variant's state: (cache, greedy state) or (..., logits). An engine
  variant's greedy steps advance its positions every call: one past the cache's STEP_SLOTS is
  an error (its steps wrote past the cache), not a timing."""
  if not isinstance(state[-1], dict):
    return state[-1]
  if int(state[-1]["i"]) > STEP_SLOTS:
    raise ValueError(f"{int(state[-1]['i'])} greedy steps ran past the cache's {STEP_SLOTS} "
                     "slots after T: fewer steps / repeats, or raise STEP_SLOTS.")
  return state[-1]["logits"]


# Cache slots past T of a variant's engine (profile_step / ab_step) and of its float32
# reference: the engine's greedy step advances the position every call (bench and bare alike).
STEP_SLOTS = 1024


def _trace_row(row: dict, bare, state, traced: int):
  """row += a jax.profiler trace of `traced` bare calls (bench.common.trace_activity): busy_ms,
  kernels, span_ms per token, the top kernels, the trace's lines; returns the state."""
  from bench import common
  holder = [state]

  def call():
    holder[0] = bare(holder[0])
    return holder[0][-1]
  prof = common.trace_activity(call, traced)
  row.update(busy_ms=prof["busy_ms"], kernels=prof["kernels"], span_ms=prof["span_ms"],
             top=[[n, t] for n, t in prof["top"]], trace_lines=prof["lines"])
  return holder.pop()


def _build_variant(name, layout, sets, cfg, params, split, B, T, compiler_options, scheme,
                   shapes, hlo_dir=None, defer: bool = False) -> dict:
  """One variant (`parse_variant`) compiled over a fresh `filled_cache` of T tokens:
  {row (its settings, compile_s, memory analysis, op_histogram; status 'built' or 'error'),
  bench (state, i) -> state and bare state -> state: an engine variant's greedy step
  (`Engine._greedy_step` on (cache, greedy state): its token the argmax of the last logits, its
  position advancing, both calls alike); xla_per_layer's bench step (argmax of the last logits,
  T + i) and bare program (same token and position every call), state}.
  defer: the dict holds `compile` instead,
  a function that compiles (thread-safe: nothing traced) and fills the dict as above."""
  import time
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import decode as bd
  from condattn_jax.inference import Engine
  from condattn_jax.inference.engine import greedy_state, stop_ids
  opts = {k_: v_ for x in sets if x in OPTION_SETS for k_, v_ in OPTION_SETS[x].items()}
  opts = {**opts, **PROFILE_OPTIONS, **(compiler_options or {})}
  row = dict(program="xla_per_layer" if layout == "xla_per_layer" else "engine", variant=name,
             params=layout, option_sets=list(sets),
             command_buffers=next((x for x in sets if x in CB_MODES), "default"),
             scheme=scheme, shapes=shapes, B=B, T=T,
             compiler_options=opts, backend=_backend())
  try:
    p = split if layout == "split" else params
    # a fresh engine per variant: jit caches a trace per (engine, shapes), and a variant's
    # model config (attention impl, scheme options) must reach its own trace
    eng = Engine(variant_config(cfg, sets), params, cache_len=T + STEP_SLOTS)
    tok, pos0, on, logits = step_inputs(eng, B, T)
    if layout == "xla_per_layer":
      kv = filled_cache(eng, B, T)
      ks, vs = bd.engine_cache_to_stacked(kv)
      del kv
      caches = (tuple(ks[l] for l in range(cfg.num_layers)),
                tuple(vs[l] for l in range(cfg.num_layers)))
      del ks, vs
      lengths = eng._commit(jnp.full((B,), T, jnp.int32))
      fn = jax.jit(functools.partial(bd.baseline_step_layers, cfg), donate_argnums=(1, 2))
      t0 = time.perf_counter()
      lowered = fn.lower(p, *caches, tok[:, 0], jnp.int32(T), lengths)
      state = (*caches, logits)
      del caches
      call = lambda c: (
          lambda s, i: c(p, s[0], s[1], jnp.argmax(s[2], -1).astype(jnp.int32),
                         jnp.int32(T + i), lengths + i),
          lambda s: c(p, s[0], s[1], tok[:, 0], jnp.int32(T), lengths))
    else:
      state = (filled_cache(eng, B, T), logits)
      # the engine's static fields of a step inside a block (MATCH: the reusing program;
      # Elastic: every row decided), as its decode loops pass them; a scheme with such facts
      # first runs one step without them (Elastic's rows decide in it, as after a prefill)
      sf = block_fields(eng, B, T)
      if sf:
        with trace_context(sets):
          state = Engine._step(eng, p, state[0], tok, pos0, on, logits)[:2]
      row["static_fields"] = [list(x) for x in sf]
      t0 = time.perf_counter()
      # the engine's greedy step (what generate runs: every changing input donated state, no
      # command-buffer update a call); bench and bare are the same calls
      stop = stop_ids(())  # no stop token (generate's stop_S)
      with trace_context(sets):
        gs = greedy_state(jnp.array(state[1], copy=True), np.full(B, T),
                          STEP_SLOTS, eng.step_aux_shapes(p, state[0], B, sf))
        lowered = Engine._greedy_step.lower(eng, p, state[0], gs, stop, static_fields=sf)
      state = (state[0], gs)
      call = lambda c: (lambda s, i: c(p, *s, stop), lambda s: c(p, *s, stop))
    row["lower_s"] = time.perf_counter() - t0
  except Exception as e:  # recorded; the other variants still run
    row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
    return dict(row=row)
  out = dict(row=row, state=state)

  def finish():
    try:
      t0 = time.perf_counter()
      compiled = lowered.compile(compiler_options=opts)
      row["compile_s"] = time.perf_counter() - t0
      row.update(bd._mem(compiled))
      text = compiled.as_text()
      hist = op_histogram(text)
      if hlo_dir:
        import gzip
        os.makedirs(hlo_dir, exist_ok=True)
        path = os.path.join(hlo_dir, f"{name.replace(':', '_')}_B{B}_T{T}.hlo.txt.gz")
        with gzip.open(path, "wt") as f:
          f.write(text)
        row["hlo_file"] = path
      del text
      row.update(launches=hist["launches"], copy_bytes=hist["copy_bytes"], histogram=hist,
                 status="built")
      out["bench"], out["bare"] = call(compiled)
    except Exception as e:  # recorded; the other variants still run
      row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
      out.pop("state", None)
    return out
  if defer:
    out["compile"] = finish
    return out
  return finish()


# The rule that settles a decode-step A/B (issue 33 / issue 26: L2A's exact decode switches),
# registered before the GPU run that applies it (docs/performance.md, "L2A's decode step at
# B = 1"): `ab_step` runs the default and every candidate in ONE process over the same weights
# and the same K/V, compiled first, then >= min_repeats timed repeats of >= min_steps steps each
# (after warm-up), the variants alternating, their order rotated every repeat; at every context T
# of the rule, a candidate must have
#   median wall ms (over its repeats) <= the default's median,
#   median busy ms (device-busy time of jax.profiler traces, interleaved likewise) <= the
#     default's * (1 + busy_slack),
#   its first step's logits (from the same filled cache) within max_rel_err of the default's
#     (rel_err = ||a - b|| / ||b||; bf16 model: a different program may round differently; the
#     switches' exactness itself is tested on CPU to 1e-6).
# A candidate that holds at every T is adopted (the one code path), any other is deleted; where
# two hold, the one with the lower median wall ms at the longest T.
# Extension for candidates that change what dense runs too (registered 2026-11-27 before run
# d_split_mgpu_ab of the params layout `split` and the decode kernel `mgpu`; `settle`): when
# --dense_variants names a variant of the same name as a scheme candidate (the first dense
# variant is dense's default), that candidate must also pass the rule above as a dense
# candidate against dense's default (same T, same thresholds); adopted = the candidates passing
# both (or the scheme's alone where dense has no variant of that name), and where several pass,
# the one with the lower median wall ms of the scheme at the longest T.
# Verdict of d_split_mgpu_ab (bench/results/decode_program_NVIDIA_H100_80GB_HBM3.json, one H100,
# tree 2616c6a; T = 8192 only: the call's timeout stopped it compiling T = 131072): no candidate
# adopted, each failing at 8K: `split` (Engine(split_layers=True), since deleted: fewer kernels,
# no per-step weight copy, but a slower wall), `mgpu` (ops impl 'decode_kernel', deleted:
# logits rel_err 5e-2 against cuDNN's path, L2A's wall slower) and their combination.
# Verdict of d_oproj_minsplit_ab (same file, tree a7b05fa, T = 8192 only: the call's limit
# stopped the 128K compiles; settle_pairs): none adopted. The batched o_proj removed the per-step
# copy of the stacked o_proj slice (copy_bytes 264 / 132 MB -> < 1 KB, busy -5.7% / -5.1%, logits
# bit-identical) but its wall was slower (L2A 5.35 vs 5.21 ms, dense 3.24 vs 3.01): reverted;
# the unsplit window ring failed on logits (rel_err 5.5e-2): deleted.
# Candidate registered 2026-11-29 before its GPU run (issue 33's dense B = 1 targets):
# `notriton` (OPTION_SETS: xla_gpu_enable_triton_gemm=False), every dot of the decode step
# through cuBLAS instead of XLA's Triton GEMM fusions. At B = 1 each projection is a matrix-
# vector product that XLA emits as Triton gemm fusions (gemm_fusion_dot_*); outside attention,
# OLMo-2-1B's dense step at 32K spent 1.21 ms of its 2.29 ms busy against a 0.53 ms weight bound
# (aha10_profile). Settled by ADOPTION_RULE with the dense extension: `--ab --scheme=l2a
# --T=8192,131072 --variants=stacked,stacked:notriton --dense_variants=stacked,stacked:notriton`
# (Qwen2.5-1.5B shapes). Adopted: the engine compiles its one-token decode step with that option;
# rejected: the option set stays, for the record.
# Candidate registered 2026-11-29 before its GPU run (issue 33's dense B = 1 targets; a one-token
# step runs ~550 kernels, each waiting for the last CTA of the one before): programmatic
# dependent launch, OPTION_SETS `pdl` / `nopdl` (xla_gpu_enable_pdl + xla_gpu_enable_pdl_launch
# on / off). Whether jax 0.11.2's XLA turns it on by default is read first in the same call (the
# PTX of a small jit, default flags, holds griddepcontrol or not): if not, the candidate is
# `split:pdl`, else `split:nopdl` (then a rejection says PDL already pays; an adoption would turn
# it off). Settled by ADOPTION_RULE with the dense extension: `--ab --scheme=l2a --T=8192,131072
# --variants=split,split:<candidate> --dense_variants=split,split:<candidate>`. Adopted: the
# engine compiles its decode step with that option set; rejected: the option set stays.
# The rule as registered before l2a_ab_b1 and applied through d_oproj_minsplit_ab (stored on
# those runs as settings.rule: their claims re-apply it).
ADOPTION_RULE_1E2 = dict(T=(8192, 131072), min_repeats=5, min_steps=32, busy_slack=0.02,
                         max_rel_err=1e-2)
# Its logits test, replaced 2026-11-28 after run d_fp32_check (one H100, tree 0474650: the
# XLA reference attention in bf16, a correct program, differs from the default's cuDNN path by
# rel_err 5.6e-2 at dense 8K, while the two are 4.0e-2 / 5.1e-2 from float32; rule_check failed;
# docs/performance.md "The logits bound against a float32 reference"), before any A/B applies
# it: ab_step also runs the scheme's model in float32 (`_lower_fp32`: the same bf16 weights and
# cache, every attention call through the reference, matmuls at 'highest') on the first step,
# and a candidate's logits pass at a T iff rel_err(candidate, float32) <= fp32_factor *
# rel_err(default, float32) + fp32_slack and its argmax equals float32's wherever the default's
# does (FP32_RULE's test, `fp32_pass`). Wall / busy / repeats as before.
FP32_RULE = dict(factor=1.1, slack=1e-3)
ADOPTION_RULE = dict(T=(8192, 131072), min_repeats=5, min_steps=32, busy_slack=0.02,
                     fp32_factor=FP32_RULE["factor"], fp32_slack=FP32_RULE["slack"])


def ab_step(shapes: str, B: int, T: int, *, variants, scheme: str = "l2a",
            dense_variants=("stacked",), steps: int = 32, repeats: int = 7, warmup: int = 3,
            traced: int = 8, busy_repeats: int = 3, compiler_options: dict | None = None,
            compile_workers: int = 1, fp32: bool = False, aha_full: float = 0.0,
            log=print) -> list[dict]:
  """The decode-step A/B of ADOPTION_RULE at context T: `variants` (parse_variant names; the
  first is the default, the others candidates) of `scheme`, and `dense_variants` of dense (the
  x_dense denominator), all built first (`_build_variant`: one process, the same weights per
  scheme, each over its own `filled_cache`, whose K/V depend on the leaf's path only), then:

    rel_err / max_abs_err / same_argmax  the first call's logits against the scheme's first
                variant's (the same cache and token: an exactness check on the device)
    runs_ms     `repeats` timed repeats of `steps` steps each (bench.decode._timed_steps, after
                `warmup` steps), every variant once a repeat, the order rotated by one each
                repeat; ms = their median
    host_ms     median time for the host to enqueue one bare call (`steps` calls)
    busy_runs_ms  `busy_repeats` traces of `traced` bare calls each (bench.common.trace_activity),
                interleaved the same way; busy_ms = their median, kernels / span_ms / top of the
                last
    fp32        (with `fp32`) the first call's logits against the scheme's model in float32 on the
                same weights and cache (`_lower_fp32`, run once per scheme after the compiles):
                ADOPTION_RULE's logits test (FP32_RULE)
  and dense_ratios' x_dense / bound_x / of_bound. Rows keep profile_step's fields otherwise.
  compile_workers > 1: every variant is traced first (in order), then the first is compiled
  alone and the others in that many threads (a timing of the programs, not of their compiles:
  compile_s then overlaps). aha_full: `scheme_params`' AHA routing."""
  import statistics
  import time
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import decode as bd
  from condattn_jax.inference import Engine
  from condattn_jax.models import stacking
  groups = [(scheme, tuple(variants))]
  if scheme != "dense" and dense_variants:
    groups.append(("dense", tuple(dense_variants)))
  for sch, names in groups:
    for v in names:
      if parse_variant(v)[0] == "xla_per_layer" and sch != "dense":
        raise ValueError(f"--scheme={sch}: the xla_per_layer variant is dense only.")
  built, todo, models = [], [], []
  for sch, names in groups:
    parsed = [(v, *parse_variant(v)) for v in names]
    cfg = model_config(shapes, scheme=sch, T=T)
    params = scheme_params(cfg, sch, aha_full)
    models.append((sch, cfg, params))
    split = (jax.jit(stacking.split_groups)(params)
             if any(lay == "split" for _, lay, _ in parsed) else None)
    for name, layout, sets in parsed:
      b = _build_variant(name, layout, sets, cfg, params, split, B, T, compiler_options, sch,
                         shapes, defer=True)
      b["row"].update(steps=steps, repeats=repeats)
      built.append(b)
      if "compile" in b:
        todo.append(b)
  if todo and compile_workers > 1:
    import concurrent.futures as cf
    todo[0]["compile"]()
    with cf.ThreadPoolExecutor(compile_workers) as ex:
      list(ex.map(lambda b: b["compile"](), todo[1:]))
  else:
    for b in todo:
      b["compile"]()
  fp32_refs = {}
  for sch, cfg, params in models if fp32 else ():
    try:
      t1 = time.perf_counter()
      eng = Engine(cfg, params, cache_len=T + STEP_SLOTS)
      args = step_inputs(eng, B, T)
      cache16 = filled_cache(eng, B, T)
      lowered, cache32 = _lower_fp32(cfg, params, B, T, cache16, *args, slots=STEP_SLOTS)
      del cache16
      out = lowered.compile()(params, cache32, *args)
      fp32_refs[sch] = np.asarray(out[1], np.float64)
      del out, cache32
      log(f"{sch} float32 reference: {time.perf_counter() - t1:.1f} s")
    except Exception as e:  # the rows then lack 'fp32': the rule's logits test fails them
      log(f"{sch} float32 reference: error {type(e).__name__}: {str(e)[:400]}")
  refs = {}
  for b in built:
    row = b["row"]
    sch, name = row["scheme"], row["variant"]
    if row["status"] == "error":
      log(f"{sch} {name}: error {row['error']}")
      continue
    ref = refs.get(sch)
    try:
      b["state"] = b["bare"](b["state"])
      first = np.asarray(_logits(b["state"]), np.float64)
      if ref is None:
        ref = refs[sch] = (name, first)
      row.update(reference_variant=ref[0], **logits_diff(first, ref[1]))
      if sch in fp32_refs:
        row["fp32"] = logits_diff(first, fp32_refs[sch])
      _, _, b["state"] = bd._timed_steps(b["bench"], b["state"], 1, 1, warmup)
      row.update(runs_ms=[], busy_runs_ms=[])
      log(f"{sch} {name}: compiled in {row['compile_s']:.1f} s, {row['launches']} launches, "
          f"rel_err {row['rel_err']:.2e} against {ref[0]}"
          + (f", {row['fp32']['rel_err']:.2e} against float32" if 'fp32' in row else ""))
    except Exception as e:
      row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
      log(f"{sch} {name}: error {row['error']}")
  live = [b for b in built if b["row"]["status"] == "built"]

  def rotated(r):
    k = r % max(len(live), 1)
    return live[k:] + live[:k]
  for r in range(repeats):
    for b in rotated(r):
      ms, _, b["state"] = bd._timed_steps(b["bench"], b["state"], steps, 1, 0)
      b["row"]["runs_ms"].append(ms)
  for b in live:
    host, bare, state = [], b["bare"], b["state"]
    for _ in range(steps):
      t1 = time.perf_counter()
      state = bare(state)
      host.append(time.perf_counter() - t1)
    jax.block_until_ready(state)
    b["state"] = state
    b["row"]["host_ms"] = statistics.median(host) * 1e3
  for r in range(busy_repeats):
    for b in rotated(r):
      b["state"] = _trace_row(b["row"], b["bare"], b["state"], traced)
      b["row"]["busy_runs_ms"].append(b["row"]["busy_ms"])
  for b in live:
    row = b["row"]
    row.update(ms=statistics.median(row["runs_ms"]),
               busy_ms=statistics.median(row["busy_runs_ms"]),
               logits_finite=bool(jnp.all(jnp.isfinite(_logits(b["state"])))), status="ok")
    log(f"{row['scheme']} {row['variant']} T={T}: {row['ms']:.3f} ms/token (runs "
        f"{', '.join(f'{x:.2f}' for x in row['runs_ms'])}), host {row['host_ms']:.3f}, busy "
        f"{row['busy_ms']:.3f}, {row['kernels']:.0f} kernels, {row['launches']} launches")
  rows = [b["row"] for b in built]
  del built, live
  dense_ratios(rows)
  return rows


def adoption(rows: list[dict], scheme: str, default: str, rule: dict = ADOPTION_RULE) -> dict:
  """ADOPTION_RULE applied to ab_step rows: {candidate: {adopt, failed: [reasons], per_T: {T:
  {ms, default_ms, wall_ratio, busy_ms, default_busy_ms, busy_ratio, rel_err[, fp32]}}}} for
  every variant of `scheme` other than `default`. The logits test is the rule's: FP32_RULE's
  (fp32_pass on the rows' 'fp32' diffs) where the rule has fp32_factor, else max_rel_err
  against the default (ADOPTION_RULE_1E2, the stored rule of the runs before 2026-11-28)."""
  by = {(r["variant"], r["T"]): r for r in rows if r.get("scheme") == scheme}
  cands = list(dict.fromkeys(v for v, _ in by if v != default))
  out = {}
  for c in cands:
    per, failed = {}, []
    for T in rule["T"]:
      d, x = by.get((default, T)), by.get((c, T))
      if not d or not x or d.get("status") != "ok" or x.get("status") != "ok":
        failed.append(f"T={T}: no ok row of both")
        continue
      per[T] = dict(ms=x["ms"], default_ms=d["ms"], wall_ratio=x["ms"] / d["ms"],
                    busy_ms=x["busy_ms"], default_busy_ms=d["busy_ms"],
                    busy_ratio=x["busy_ms"] / d["busy_ms"], rel_err=x["rel_err"])
      fp32 = None
      if "fp32_factor" in rule and "fp32" in x and "fp32" in d:
        fp32 = per[T]["fp32"] = fp32_pass(d["fp32"], x["fp32"], rule["fp32_factor"],
                                          rule["fp32_slack"])
      if min(len(x["runs_ms"]), len(d["runs_ms"])) < rule["min_repeats"] or (
          min(x["steps"], d["steps"]) < rule["min_steps"]):
        failed.append(f"T={T}: fewer than {rule['min_repeats']} repeats of "
                      f"{rule['min_steps']} steps")
      if x["ms"] > d["ms"]:
        failed.append(f"T={T}: wall {x['ms']:.3f} > {d['ms']:.3f} ms")
      if x["busy_ms"] > d["busy_ms"] * (1 + rule["busy_slack"]):
        failed.append(f"T={T}: busy {x['busy_ms']:.3f} > {d['busy_ms']:.3f} ms "
                      f"* {1 + rule['busy_slack']}")
      if "fp32_factor" in rule:  # FP32_RULE's logits test (registered 2026-11-28)
        if fp32 is None:
          failed.append(f"T={T}: no float32 reference logits on both rows")
        elif not fp32["passed"]:
          failed.append(f"T={T}: logits rel_err against float32 {fp32['rel_err']:.2e} > "
                        f"{fp32['bound']:.2e} or argmax lost ({fp32['same_argmax']})")
      elif not x["rel_err"] <= rule["max_rel_err"]:
        failed.append(f"T={T}: logits rel_err {x['rel_err']:.2e} > {rule['max_rel_err']}")
    out[c] = dict(adopt=not failed, failed=failed, per_T=per)
  return out


def settle(rows: list[dict], scheme: str, default: str, dense_default: str | None,
           rule: dict = ADOPTION_RULE) -> dict:
  """ADOPTION_RULE with its dense extension applied to ab_step rows: {adopt: the adopted
  candidate or None, scheme: adoption(rows, scheme, default), dense: adoption(rows, 'dense',
  dense_default) (empty without a dense default), passed: {candidate: bool}} where a candidate
  passes iff it passes for `scheme` and, when dense holds a variant of its name, for dense."""
  own = adoption(rows, scheme, default, rule)
  dense = adoption(rows, "dense", dense_default, rule) if dense_default else {}
  passed = {c: bool(r["adopt"] and (c not in dense or dense[c]["adopt"]))
            for c, r in own.items()}
  longest = max(rule["T"])
  winners = sorted((own[c]["per_T"][longest]["ms"], c) for c, ok in passed.items() if ok)
  return dict(adopt=winners[0][1] if winners else None, passed=passed, scheme=own, dense=dense)


# Paired form of ADOPTION_RULE (registered 2026-11-27 before run d_oproj_minsplit_ab): where a
# run's candidates are not alternatives to one default but each a change to its own baseline
# (`--pairs=candidate=default,...`; that run: o_proj's batched contraction `stacked` against the
# previous program `stacked:oldoproj`, the splits candidate `stacked:minsplit` against
# `stacked`; both rejected at 8K, see the trace sets above), each
# candidate is settled by the rule against its own default, for the scheme and, where dense ran
# both names, for dense too (the dense extension); every passing candidate is adopted (they
# stack). A rejected candidate whose library change is exact and removes work without being
# slower is not a behaviour change: the rule's verdict is recorded all the same.
def settle_pairs(rows: list[dict], scheme: str, pairs: dict, rule: dict = ADOPTION_RULE) -> dict:
  """ADOPTION_RULE per (candidate, default) pair of `pairs`: {pairs, passed: {candidate: bool},
  adopt: [passing candidates], scheme: {candidate: adoption verdict}, dense: {candidate:
  verdict} (where dense holds rows of both names)}."""
  own, dense = {}, {}
  for c, d in pairs.items():
    pick = lambda sch: [r for r in rows if r.get("scheme") == sch and r["variant"] in (c, d)]
    own[c] = adoption(pick(scheme), scheme, d, rule).get(c, dict(
        adopt=False, failed=["no row of the candidate"], per_T={}))
    both = {r["variant"] for r in pick("dense")}
    if scheme != "dense" and both == {c, d}:
      dense[c] = adoption(pick("dense"), "dense", d, rule)[c]
  passed = {c: bool(own[c]["adopt"] and (c not in dense or dense[c]["adopt"])) for c in pairs}
  return dict(pairs=dict(pairs), passed=passed, adopt=[c for c in pairs if passed[c]],
              scheme=own, dense=dense)


def parse_pairs(text: str) -> dict:
  """'--pairs' 'c1=d1,c2=d2' -> {c1: d1, c2: d2} (each name a parse_variant name)."""
  out = {}
  for item in (x for x in text.split(",") if x):
    c, sep, d = item.partition("=")
    if not sep or not c or not d:
      raise ValueError(f"--pairs: {item!r} is not candidate=default.")
    parse_variant(c), parse_variant(d)
    out[c] = d
  return out


def logits_diff(a, b) -> dict:
  """{rel_err, max_abs_err, same_argmax} of logits `a` against `b` (float64 arrays)."""
  import numpy as np
  from bench import common
  return dict(rel_err=common.rel_err(a, b), max_abs_err=float(np.max(np.abs(a - b))),
              same_argmax=bool(np.array_equal(a.argmax(-1), b.argmax(-1))))


def _reference_attention(cfg):
  """`cfg` with every attention call through ops' reference: attention_impl='reference' and,
  for a scheme with one (L2A's global branch), compact_impl='reference'."""
  from condattn_jax.attention import options
  cfg = dataclasses.replace(cfg, attention_impl="reference")
  if cfg.scheme != "dense" and hasattr(options(cfg), "compact_impl"):
    kw = dict(cfg.scheme_kwargs, compact_impl="reference")
    cfg = dataclasses.replace(cfg, scheme_kwargs=tuple(sorted(kw.items())))
  return cfg


def _over_cudnn():
  """Bench-only trace context of fp32_check's 'mgpu' variant: pallas_kernels.decode's backends
  with DecodeConfig(over_cudnn=True), so ops' auto sends the decode calls cuDNN's decode path
  takes (dense's full cache, L2A's global cache and window ring) to the decode kernel (Mosaic GPU
  on an H100; on CPU auto runs the reference either way). A measurement of the kernel's logits,
  not an engine option (the candidate lost run d_split_mgpu_ab and is deleted)."""
  from unittest import mock
  from pallas_kernels import decode as pd
  new = tuple(dataclasses.replace(b, config=dataclasses.replace(b.config, over_cudnn=True))
              for b in pd.BACKENDS)
  return mock.patch.object(pd, "BACKENDS", new)


FP32_VARIANTS = ("refattn", "mgpu")


def _lower_fp32(cfg, params, B: int, T: int, cache16, tok, pos0, on, prev, slots=None):
  """(lowered, cache32): the engine's decode step of `cfg`'s model in float32 arithmetic on the
  same numbers, the reference of fp32_check and of ADOPTION_RULE's logits test: compute dtype
  float32, every attention call through ops' reference (`_reference_attention`), every matmul
  at 'highest' precision, the bf16 `params` (upcast exactly in the model) and `cache16` upcast
  (cache32, a new buffer: cache16 stays the caller's). slots: the cache's slots past T
  (default bench.decode.EXTRA)."""
  import jax
  from bench import decode as bd
  from condattn_jax.inference import Engine
  cfg32 = dataclasses.replace(_reference_attention(cfg), dtype="float32")
  e = Engine(cfg32, params, cache_len=T + (bd.EXTRA if slots is None else slots))
  cache32 = jax.tree.map(lambda a, s: a.astype(s.dtype), cache16, e.cache_shapes(B))
  with jax.default_matmul_precision("highest"):
    jax.clear_caches()  # the engine's jit cache is keyed by config: the context must trace
    lowered = Engine._step.lower(e, params, cache32, tok, pos0, on, prev)
  jax.clear_caches()
  return lowered, cache32


def fp32_check(shapes: str, B: int, T: int, scheme: str = "dense", log=print,
               variants: tuple[str, ...] = ("refattn",)) -> dict:
  """How far the engine's bfloat16 decode logits are from float32 arithmetic on the same
  numbers: one decode step (bench.decode's params of `scheme` at context T, `filled_cache`'s
  K/V) through the engine's default program (cuDNN on a GPU), through each of `variants`
  (FP32_VARIANTS: 'refattn', every attention call through the XLA einsum reference in bfloat16;
  'mgpu', the decode calls through pallas_kernels.decode's kernel instead of cuDNN, `_over_cudnn`)
  and through a float32 reference: the model at compute dtype float32 with every attention call
  through the reference (`_reference_attention`), the same bfloat16 weights (upcast exactly),
  the same cache upcast, every matmul at 'highest' precision. Returns {variant: {rel_err,
  max_abs_err, same_argmax} against the float32 logits, 'vs_default': the same against the
  default's bfloat16 logits}, plus 'default_vs_refattn' (two bfloat16 programs against each
  other: the noise between bf16 kernels ADOPTION_RULE's max_rel_err sees; with 'refattn'), each
  compiled program's custom calls ({program: {target: count}}: which kernels ran), the logits'
  norm and the seconds."""
  import contextlib
  import time
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import decode as bd
  from condattn_jax.inference import Engine
  for v in variants:
    if v not in FP32_VARIANTS:
      raise ValueError(f"fp32_check: variant {v!r} is not one of {FP32_VARIANTS}.")
  cfg = model_config(shapes, scheme=scheme, T=T)
  params = bd.init_params(cfg)
  t0 = time.perf_counter()
  eng = Engine(cfg, params, cache_len=T + bd.EXTRA)
  cache16 = filled_cache(eng, B, T)
  tok, pos0, on, prev = step_inputs(eng, B, T)

  def lower(c, cache, context=None):
    e = Engine(c, params, cache_len=T + bd.EXTRA)
    with context or contextlib.nullcontext():
      jax.clear_caches()  # the engine's jit cache is keyed by config: the context must trace
      return Engine._step.lower(e, params, cache, tok, pos0, on, prev)
  lowered = {"default": (lower(cfg, cache16), cache16)}
  if "refattn" in variants:
    lowered["refattn"] = (lower(variant_config(cfg, ("refattn",)), cache16), cache16)
  if "mgpu" in variants:
    lowered["mgpu"] = (lower(cfg, cache16, context=_over_cudnn()), cache16)
  lowered["float32"] = _lower_fp32(cfg, params, B, T, cache16, tok, pos0, on, prev)
  jax.clear_caches()
  import concurrent.futures as cf
  names = list(lowered)
  compiled = {names[0]: lowered[names[0]][0].compile()}  # alone: its autotuning serves the rest
  with cf.ThreadPoolExecutor(len(names) - 1) as ex:
    compiled.update(zip(names[1:], ex.map(lambda n: lowered[n][0].compile(), names[1:])))
  compile_s = time.perf_counter() - t0
  calls = {n: {k.split(":", 1)[1]: v for k, v in op_histogram(c.as_text()).items()
               if k.startswith("custom-call:")} for n, c in compiled.items()}
  logits = {n: np.asarray(compiled[n](params, jax.tree.map(jnp.copy, lowered[n][1]), tok, pos0,
                                      on, prev)[1], np.float64) for n in names}
  ref = logits.pop("float32")
  out = dict(scheme=scheme, shapes=shapes, B=B, T=T, reference="float32", status="ok",
             **{k: dict(logits_diff(v, ref), vs_default=logits_diff(v, logits["default"]))
                for k, v in logits.items()},
             custom_calls=calls, logits_norm=float(np.linalg.norm(ref)), compile_s=compile_s,
             seconds=time.perf_counter() - t0)
  if "refattn" in logits:
    out["default_vs_refattn"] = logits_diff(logits["default"], logits["refattn"])
  log("fp32_check: " + json.dumps(out))
  return out


# Registered 2026-11-28 before run d_fp32_check (issue 33; tree of this commit): whether
# ADOPTION_RULE's logits bound (max_rel_err = 1e-2 of a candidate's first-step logits against
# the default's) can pass for a correct bfloat16 program. The XLA einsum reference attention in
# bfloat16 ('refattn') is correct by construction and rounds differently from cuDNN; the bound is
# sane iff at every (scheme, T) fp32_check measured, rel_err(refattn, default) <= max_rel_err.
# If not, a future A/B's logits test is FP32_RULE instead (written into docs/performance.md
# with these numbers before any A/B uses it): a candidate passes iff, at every T of the A/B,
# rel_err(candidate, float32) <= factor * rel_err(default, float32) + slack, and its argmax
# equals the float32 reference's wherever the default's does (fp32_logits_test). Candidates
# rejected by the old bound are not re-decided from these numbers: their timing half must run
# again under the rule in force. (FP32_RULE is defined beside ADOPTION_RULE, which now uses it.)


def rule_check(checks: list[dict], rule: dict = ADOPTION_RULE_1E2) -> dict:
  """The registered test of ADOPTION_RULE_1E2's logits bound on fp32_check results: {sane, bound,
  points: [{scheme, T, default_vs_refattn, default_vs_fp32, refattn_vs_fp32}], failed: the
  points where the two bf16 programs differ by more than the bound}. No point measured: sane
  None."""
  pts = [dict(scheme=c["scheme"], T=c["T"], default_vs_refattn=c["default_vs_refattn"]["rel_err"],
              default_vs_fp32=c["default"]["rel_err"], refattn_vs_fp32=c["refattn"]["rel_err"])
         for c in checks if c.get("status") == "ok" and "default_vs_refattn" in c]
  failed = [p for p in pts if p["default_vs_refattn"] > rule["max_rel_err"]]
  return dict(sane=(not failed) if pts else None, bound=rule["max_rel_err"], points=pts,
              failed=failed)


def fp32_pass(default: dict, cand: dict, factor: float, slack: float) -> dict:
  """FP32_RULE's logits test: `default` / `cand` are logits_diff's against the float32
  reference; {passed, rel_err, bound, same_argmax}, passed iff cand's rel_err <= factor *
  default's + slack and cand keeps float32's argmax wherever the default does."""
  bound = factor * default["rel_err"] + slack
  argmax_ok = cand["same_argmax"] or not default["same_argmax"]
  return dict(passed=bool(cand["rel_err"] <= bound and argmax_ok), rel_err=cand["rel_err"],
              bound=bound, same_argmax=cand["same_argmax"])


def fp32_logits_test(check: dict, candidate: str, rule: dict = FP32_RULE) -> dict:
  """FP32_RULE's logits test (fp32_pass) of `candidate` at one fp32_check point."""
  return fp32_pass(check["default"], check[candidate], rule["factor"], rule["slack"])


def fp32_table(checks: list[dict]) -> str:
  """fp32_check results as a markdown table: per (scheme, T, program) the logits' rel_err and
  max abs error against float32, argmax agreement, and rel_err against the default's."""
  out = ["| scheme | T | program | rel_err vs fp32 | max abs | same argmax | rel_err vs default |",
         "|---|---|---|---|---|---|---|"]
  for c in checks:
    if c.get("status") != "ok":
      out.append(f"| {c['scheme']} | {c['T']} | error: {c.get('error', '')[:80]} | | | | |")
      continue
    for n in ("default",) + FP32_VARIANTS:
      if n in c:
        r = c[n]
        out.append(f"| {c['scheme']} | {c['T']} | {n} | {r['rel_err']:.3e} | "
                   f"{r['max_abs_err']:.3e} | {r['same_argmax']} | "
                   f"{r['vs_default']['rel_err']:.3e} |")
  return "\n".join(out)


def oproj_probe(L: int = 28, N: int = 12, H: int = 128, D: int = 1536, calls: int = 20,
                log=print) -> list[dict]:
  """What XLA makes of o_proj's one-token contraction over a stacked kernel [L, N, H, D]
  (bfloat16; Qwen2.5-1.5B's shapes by default), each form summed over the L layer slices in
  one program (the 2-row operand of models.layers.Projection, a fresh input a layer): 'plain2d'
  the engine's form (2-D views [2, N*H] x [N*H, D]), 'dot3d' one dot_general contracting
  (N, H) of the 3-D slice, 'batched' a dot batched over N (H contracted) with a float32 sum
  over N (run d_oproj_minsplit_ab's rejected candidate: in the engine it removed the slice's
  per-step copy). Per form: the compiled program's op_histogram copy_bytes /
  launches and the median ms of `calls` calls (3 repeats); max_abs_err against 'plain2d'."""
  import statistics
  import time
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  kw, kx = jax.random.split(jax.random.key(0))
  w = jax.random.normal(kw, (L, N, H, D), jnp.float32).astype(jnp.bfloat16) * 0.02
  x = jax.random.normal(kx, (L, 1, N, H), jnp.float32).astype(jnp.bfloat16)
  def batched(x2, w_):
    y = lax.dot_general(x2.transpose(1, 0, 2), w_, (((2,), (1,)), ((0,), (0,))),
                        preferred_element_type=jnp.float32)
    return jnp.sum(y, axis=0).astype(x2.dtype)
  forms = {"plain2d": lambda x2, w_: lax.dot_general(x2.reshape(x2.shape[0], -1),
                                                     w_.reshape(-1, w_.shape[-1]),
                                                     (((1,), (0,)), ((), ()))),
           "dot3d": lambda x2, w_: lax.dot_general(x2, w_, (((1, 2), (0, 1)), ((), ()))),
           "batched": batched}
  rows, ref = [], None
  for name, f in forms.items():
    def prog(w, x, f=f):
      acc = jnp.zeros((1, D), jnp.float32)
      for l in range(L):
        x2 = jnp.concatenate([x[l], jnp.zeros_like(x[l])], axis=0)  # [2, N, H]
        acc = acc + f(x2, w[l])[:1].astype(jnp.float32)
      return acc
    try:
      compiled = jax.jit(prog).lower(w, x).compile()
      hist = op_histogram(compiled.as_text())
      y = np.asarray(compiled(w, x), np.float64)
      ref = y if ref is None else ref
      runs = []
      for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
          out = compiled(w, x)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) * 1e3 / calls)
      rows.append(dict(form=name, copy_bytes=hist["copy_bytes"], launches=hist["launches"],
                       ms=statistics.median(runs), max_abs_err=float(np.max(np.abs(y - ref))),
                       kernel_bytes=N * H * D * 2))
    except Exception as e:
      rows.append(dict(form=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
    log(f"oproj_probe: {json.dumps(rows[-1])}")
  return rows


# The rule that settles XLA's command-buffer update mode for decoding (issue 33), registered before
# its GPU run (2026-11-27, tree of this commit). The mode is a process setting (XLA_FLAGS at
# start-up picks the allocator), so the A/B is two --ab processes in ONE device call, the same
# weights and K/V (bench seeds), B = 1, Qwen2.5-1.5B shapes, T = 8K and 128K, >= 5 interleaved
# repeats of >= 32 steps:
#   A (default): no XLA_FLAGS; variants l2a `stacked`, dense `stacked`.
#   B (candidate): XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP (VMM allocator);
#      variants l2a `stacked:alwaysupdate` (B's same-process reference: the default update mode
#      on B's allocator) and `stacked` (SKIP_TEMP), dense the same two.
# SKIP_TEMP is adopted for decoding iff at BOTH T:
#   L2A's median wall ms in B (`stacked`) <= its median in A (`stacked`) and <= B's
#     `stacked:alwaysupdate` median;
#   dense's median wall ms in B (`stacked`) <= 1.05 x its median in A (the flag is
#     process-wide: it must not cost dense more than run-to-run noise);
#   the first step's logits of B's `stacked` within max_rel_err of B's `stacked:alwaysupdate`
#     (L2A and dense; the same weights and cache).
# Adopted, the decode entry points start their processes with the flag (bench/decode.py,
# bench/decode_program.py; generate.py and the serving docs: the lead's); rejected, the option
# sets stay as a measurement only and the verdict is recorded.
# Verdict (runs cbupd_a / cbupd_b in bench/results/decode_program_NVIDIA_H100_80GB_HBM3.json,
# one H100, tree d53737d, one device call): REJECTED. With the flag XLA switches the process to
# its VMM allocator, and L2A's step got slower, not faster: 4.53 / 9.13 ms at 8K / 128K against
# 3.39 / 4.82 without the flag (run A) and 4.88 / 8.87 with the flag's allocator but
# ALWAYS_UPDATE (B's reference); dense 2.45 / 4.16 against 2.43 / 3.69. Logits identical (rel_err
# 0). The option sets stay, as a measurement only.
CB_UPDATE_RULE = dict(T=(8192, 131072), min_repeats=5, min_steps=32, max_rel_err=1e-2,
                      dense_slack=0.05, scheme="l2a",
                      flag="--xla_gpu_command_buffer_update_mode=SKIP_TEMP")


def cb_update_adoption(rows_a: list[dict], rows_b: list[dict],
                       rule: dict = CB_UPDATE_RULE) -> dict:
  """CB_UPDATE_RULE applied to the rows of run A (no flag) and run B (the flag):
  {adopt, failed: [reasons], per_T: {T: {l2a_a, l2a_b_ref, l2a_b, dense_a, dense_b, rel_err}}}."""
  def pick(rows, scheme, variant, T):
    return next((r for r in rows if r.get("scheme") == scheme and r.get("variant") == variant
                 and r.get("T") == T and r.get("status") == "ok"), None)
  failed, per = [], {}
  for T in rule["T"]:
    got = dict(l2a_a=pick(rows_a, rule["scheme"], "stacked", T),
               l2a_b_ref=pick(rows_b, rule["scheme"], "stacked:alwaysupdate", T),
               l2a_b=pick(rows_b, rule["scheme"], "stacked", T),
               dense_a=pick(rows_a, "dense", "stacked", T),
               dense_b_ref=pick(rows_b, "dense", "stacked:alwaysupdate", T),
               dense_b=pick(rows_b, "dense", "stacked", T))
    missing = [k for k, r in got.items() if r is None]
    if missing:
      failed.append(f"T={T}: no ok row for {', '.join(missing)}")
      continue
    per[T] = {k: r["ms"] for k, r in got.items()}
    per[T]["rel_err"] = max(got["l2a_b"]["rel_err"], got["dense_b"]["rel_err"])
    for r in got.values():
      if len(r["runs_ms"]) < rule["min_repeats"] or r["steps"] < rule["min_steps"]:
        failed.append(f"T={T}: {r['scheme']} {r['variant']}: fewer than {rule['min_repeats']} "
                      f"repeats of {rule['min_steps']} steps")
        break
    if got["l2a_b"]["ms"] > got["l2a_a"]["ms"]:
      failed.append(f"T={T}: L2A wall {got['l2a_b']['ms']:.3f} > default {got['l2a_a']['ms']:.3f}")
    if got["l2a_b"]["ms"] > got["l2a_b_ref"]["ms"]:
      failed.append(f"T={T}: L2A wall {got['l2a_b']['ms']:.3f} > same-process ALWAYS_UPDATE "
                    f"{got['l2a_b_ref']['ms']:.3f}")
    if got["dense_b"]["ms"] > got["dense_a"]["ms"] * (1 + rule["dense_slack"]):
      failed.append(f"T={T}: dense wall {got['dense_b']['ms']:.3f} > {1 + rule['dense_slack']} x "
                    f"default {got['dense_a']['ms']:.3f}")
    for k in ("l2a_b", "dense_b"):
      if not got[k]["rel_err"] <= rule["max_rel_err"]:
        failed.append(f"T={T}: {k} logits rel_err {got[k]['rel_err']:.2e} > {rule['max_rel_err']}")
  return dict(adopt=not failed, failed=failed, per_T=per)


def buffers_probe(counts=(64, 256, 1024), calls: int = 64, repeats: int = 3,
                  log=print) -> list[dict]:
  """The host's cost of a call's buffers, apart from its kernels: a compiled program of N
  donated int32[1] arguments, each + 1 (XLA fuses them into one kernel), called back to back
  on its own outputs; host_us = median time for the host to enqueue one call, us_per_buffer =
  its slope over N (each buffer is one argument and one output). The L2A step takes ~306
  arguments (280 cache leaves, 10 a layer) where dense takes ~85: this says what that costs."""
  import statistics
  import time
  import jax
  import jax.numpy as jnp
  rows = []
  for n in counts:
    xs = [jnp.zeros((1,), jnp.int32) + i for i in range(n)]
    f = jax.jit(lambda *a: tuple(x + 1 for x in a), donate_argnums=tuple(range(n)))
    compiled = f.lower(*xs).compile()
    xs = compiled(*xs)
    host = []
    for _ in range(repeats):
      for _ in range(calls):
        t0 = time.perf_counter()
        xs = compiled(*xs)
        host.append(time.perf_counter() - t0)
      jax.block_until_ready(xs)
    rows.append(dict(buffers=n, host_us=statistics.median(host) * 1e6,
                     check=int(xs[0][0]) == 1 + repeats * calls))
    del xs, compiled
  if len(rows) > 1:
    a, b = rows[0], rows[-1]
    slope = (b["host_us"] - a["host_us"]) / (b["buffers"] - a["buffers"])
    for r in rows:
      r["us_per_buffer"] = slope
  for r in rows:
    log(f"buffers_probe: {r['buffers']} donated buffers: host {r['host_us']:.1f} us/call "
        f"({r.get('us_per_buffer', 0):.2f} us per buffer)")
  return rows


PROFILE_COLUMNS = (("scheme", "{}"), ("variant", "{}"), ("T", "{}"), ("ms", "{:.3f}"),
                   ("bare_ms", "{:.3f}"), ("host_ms", "{:.3f}"), ("busy_ms", "{:.3f}"),
                   ("span_ms", "{:.3f}"), ("kernels", "{:.0f}"), ("launches", "{:.0f}"),
                   ("compile_s", "{:.1f}"), ("x_dense", "{:.2f}"), ("x_dense_busy", "{:.2f}"),
                   ("bound_x", "{:.2f}"), ("of_bound", "{:.2f}"))


def dense_ratios(rows: list[dict]) -> None:
  """Adds to every ok row of a scheme other than dense, where an ok dense row of the same T is
  in `rows` (the first such: the denominator, same process): x_dense = dense ms / its ms,
  x_dense_busy the same in device-busy ms, bound_x = the bytes-bound speedup over dense
  (bench.decode.nominal_bytes: weights + K/V at the scheme's nominal routing rate), of_bound =
  x_dense / bound_x (issue 33's target: >= 0.9)."""
  from bench import decode as bd
  for r in rows:
    if r.get("status") != "ok" or r.get("scheme", "dense") == "dense":
      continue
    d = next((x for x in rows if x.get("scheme") == "dense" and x.get("status") == "ok"
              and x["T"] == r["T"] and x["B"] == r["B"]), None)
    if d is None:
      continue
    bound = (bd.nominal_bytes("dense", d["shapes"], d["B"], d["T"])["bytes"]
             / bd.nominal_bytes(r["scheme"], r["shapes"], r["B"], r["T"])["bytes"])
    r.update(x_dense=d["ms"] / r["ms"], x_dense_busy=d["busy_ms"] / r["busy_ms"], bound_x=bound,
             of_bound=d["ms"] / r["ms"] / bound, dense_variant=d["variant"])


def profile_table(rows: list[dict]) -> str:
  """A markdown table of profile_step rows (per token; '-' where a row has no value)."""
  head = "| " + " | ".join(c for c, _ in PROFILE_COLUMNS) + " | top kernel (ms) |"
  out = [head, "|" + "---|" * (len(PROFILE_COLUMNS) + 1)]
  for r in rows:
    cells = [f.format(r[c]) if r.get(c) is not None else "-" for c, f in PROFILE_COLUMNS]
    top = r.get("top") or [[r.get("error", "-")[:60], None]]
    cells.append(f"{top[0][0][:50]} ({top[0][1]:.3f})" if top[0][1] is not None else top[0][0])
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def _backend() -> str:
  import jax
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', '')}"


def main(argv=None) -> list[dict]:
  import argparse
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="qwen2.5-1.5b")
  p.add_argument("--scheme", default="dense", help="the tables' engine programs and --profile: "
                 "the scheme (bench/decode.py's config of it at --T)")
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--T", default="8192", help="context (--time: a comma list)")
  p.add_argument("--programs", default="engine,engine_split,xla_per_layer",
                 help=f"some of {sorted(PROGRAMS)}")
  p.add_argument("--export", default=None, help="export for this platform (cuda) instead of "
                 "compiling for this backend")
  p.add_argument("--layers", default="2,3", help="the two layer counts of the per-layer split")
  p.add_argument("--no_full", action="store_true", help="skip the full-depth total")
  p.add_argument("--out", default=None, help="write the tables here as JSON")
  p.add_argument("--out_dir", default=None, help="--profile: also append the run (device, jax "
                 "version, date, commit, settings, rows) to <out_dir>/decode_program_<device>.json "
                 "in bench/common.py's result schema")
  p.add_argument("--name", default="profile", help="--profile --out_dir: the run's name")
  p.add_argument("--time", action="store_true", help="time the engine's step in this process "
                 "for each --variants params layout (time_step) instead of the tables")
  p.add_argument("--variants", default="stacked,split", help="--time: params layouts; with "
                 "--profile: <layout>[:<option set>]... names (parse_variant;"
                 f" default {','.join(PROFILE_VARIANTS)})")
  p.add_argument("--profile", action="store_true", help="--time: every variant's wall, bare, "
                 "host-dispatch and device-busy ms, kernels per token (profile_step)")
  p.add_argument("--traced", type=int, default=8, help="--profile: calls in the trace")
  p.add_argument("--dense_variants", default="", help="--profile with a --scheme other than "
                 "dense: these dense variants too, in the same process, at the --dense_T "
                 "contexts (the denominator of x_dense / of_bound; comma list, '' = none)")
  p.add_argument("--buffers_probe", default="", help="--profile: first time the host's cost "
                 "of a call's donated buffers at these counts (buffers_probe; comma list)")
  p.add_argument("--dense_T", default="", help="--dense_variants' contexts (default: every --T)")
  p.add_argument("--hlo_dir", default=None, help="--profile: write the compiled HLO (gzip) of "
                 "--hlo_variants here, at the first --T only")
  p.add_argument("--hlo_variants", default="stacked,split,xla_per_layer")
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--ab", action="store_true", help="the decode-step A/B of ADOPTION_RULE "
                 "(ab_step): --variants of --scheme (the first the default) and --dense_variants "
                 "of dense, interleaved in one process at every --T; prints the table and the "
                 "rule's decision; --out_dir: records the run (its 'adoption' beside the rows)")
  p.add_argument("--busy_repeats", type=int, default=3, help="--ab: interleaved traces per variant")
  p.add_argument("--pairs", default="", help="--ab: settle each candidate against its own "
                 "default (settle_pairs): 'candidate=default,...' (default: settle against the "
                 "first --variants entry)")
  p.add_argument("--compile_workers", type=int, default=1, help="--ab: compile threads (ab_step)")
  p.add_argument("--fp32_check", default="", help="fp32_check for these schemes (comma list): "
                 "with --ab after the A/B at the first --T, recorded on the A/B's run; alone "
                 "(no --ab / --time) at every --T, the table printed, its run recorded under "
                 "--out_dir (rule_check's claim on it)")
  p.add_argument("--fp32_variants", default="refattn", help="fp32_check's bf16 programs beside "
                 f"the default (comma list of {FP32_VARIANTS})")
  p.add_argument("--oproj_probe", action="store_true", help="--ab: after the A/B, oproj_probe; "
                 "recorded on the run")
  p.add_argument("--note", default=None, help="--out_dir: the recorded run's note")
  p.add_argument("--compare_to", default=None, help="--ab: CB_UPDATE_RULE's run B; the --out "
                 "JSON of run A (no XLA_FLAGS): the rule's verdict is printed and recorded")
  p.add_argument("--option", action="append", default=[], help="name=value: an XLA option "
                 "for the timed compiles (e.g. xla_gpu_dot_merger_threshold_mb=0); repeatable")
  p.add_argument("--aha_full", type=float, default=0.0, help="--scheme=aha, --profile / --ab: "
                 "route this fraction of the (layer, head) pairs full for every token "
                 "(bench.decode's --aha_full; 0: the router as initialised, every pair full)")
  a = p.parse_args(argv)
  if a.ab:
    return _main_ab(a)
  if a.fp32_check and not a.time:
    return _main_fp32(a)
  if a.time:
    opts = {}
    for kv in a.option:
      k, _, v = kv.partition("=")
      opts[k] = (int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v))
    rows = []
    probe = (buffers_probe(tuple(int(n) for n in a.buffers_probe.split(",")))
             if a.profile and a.buffers_probe else None)
    for T in (int(t) for t in str(a.T).split(",")):
      if a.profile:
        variants = (PROFILE_VARIANTS if a.variants == "stacked,split"
                    else tuple(a.variants.split(",")))
        for v in variants + tuple(x for x in a.dense_variants.split(",") if x):
          parse_variant(v)  # a bad name fails before anything compiles
        first = str(a.T).split(",")[0] == str(T)
        rows += profile_step(a.shapes, a.B, T, variants=variants, steps=a.steps,
                             repeats=a.repeats, traced=a.traced, compiler_options=opts,
                             hlo_dir=a.hlo_dir if first else None,
                             hlo_variants=tuple(a.hlo_variants.split(",")), scheme=a.scheme,
                             aha_full=a.aha_full)
        dense_T = [int(t) for t in (a.dense_T or a.T).split(",")]
        if a.dense_variants and a.scheme != "dense" and T in dense_T:
          rows += profile_step(a.shapes, a.B, T, variants=tuple(a.dense_variants.split(",")),
                               steps=a.steps, repeats=a.repeats, traced=a.traced,
                               compiler_options=opts, scheme="dense")
          dense_ratios(rows)
        print(profile_table(rows), flush=True)
        if a.out:  # after every context: a timeout still leaves the contexts done
          with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
        continue
      rows += time_step(a.shapes, a.B, T, variants=tuple(a.variants.split(",")), steps=a.steps,
                        repeats=a.repeats, compiler_options=opts)
    if a.profile:
      if a.out_dir:
        from bench import common
        run = common.new_run("decode_program", dict(
            name=a.name, scheme=a.scheme, shapes=a.shapes, B=a.B,
            T=[int(t) for t in str(a.T).split(",")],
            variants=[r["variant"] for r in rows], steps=a.steps, repeats=a.repeats,
            traced=a.traced, options=opts, dense_variants=a.dense_variants,
            dense_T=a.dense_T, **({"aha_full": a.aha_full} if a.aha_full else {})))
        run["rows"] = [{k: v for k, v in r.items() if k != "trace_lines"} for r in rows]
        if probe:
          run["buffers_probe"] = probe
        common.append_run(common.result_path("decode_program", a.out_dir), run)
      return rows
    print(json.dumps([{k: v for k, v in r.items() if k != "histogram"} for r in rows]))
    if a.out:
      with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    return rows
  layers = tuple(int(x) for x in a.layers.split(","))
  rows = []
  for prog in a.programs.split(","):
    r = table(prog, a.shapes, a.B, int(a.T), layers=layers, export=a.export, full=not a.no_full,
              scheme=a.scheme)
    rows.append(r)
    print(json.dumps(r, indent=1), flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


def _main_ab(a) -> list[dict]:
  """--ab: ab_step at every --T, the table and the rule's decision after each; the run recorded
  under --out_dir (and the rows written to --out after every T: a timeout keeps what ran)."""
  variants = tuple(a.variants.split(","))
  dense = tuple(x for x in a.dense_variants.split(",") if x)
  for v in variants + dense:
    parse_variant(v)  # a bad name fails before anything compiles
  Ts = [int(t) for t in str(a.T).split(",")]
  pairs = parse_pairs(a.pairs)
  for c, d in pairs.items():
    if c not in variants + dense or d not in variants + dense:
      raise ValueError(f"--pairs: {c}={d}: both must be --variants / --dense_variants names.")
  decide = (lambda rows: settle_pairs(rows, a.scheme, pairs)) if pairs else (
      lambda rows: settle(rows, a.scheme, variants[0], dense[0] if len(dense) > 1 else None))
  rows, cb = [], None
  for T in Ts:
    rows += ab_step(a.shapes, a.B, T, variants=variants, scheme=a.scheme, dense_variants=dense,
                    steps=a.steps, repeats=a.repeats, traced=a.traced,
                    busy_repeats=a.busy_repeats, compile_workers=a.compile_workers,
                    fp32="fp32_factor" in ADOPTION_RULE, aha_full=a.aha_full)
    print(profile_table(rows), flush=True)
    decision = decide(rows)
    print(json.dumps(decision, indent=1), flush=True)
    if a.compare_to:  # CB_UPDATE_RULE: this run is B, --compare_to holds run A's rows
      with open(a.compare_to) as f:
        cb = cb_update_adoption(json.load(f)["rows"], rows)
      print("CB_UPDATE_RULE:", json.dumps(cb, indent=1), flush=True)
    if a.out:
      with open(a.out, "w") as f:
        json.dump(dict(rows=[{k: v for k, v in r.items() if k != "trace_lines"} for r in rows],
                       adoption=decision, cb_update_adoption=cb), f, indent=1)
  from bench import common
  run = common.new_run("decode_program", dict(
      name=a.name, mode="ab", scheme=a.scheme, shapes=a.shapes, B=a.B, T=Ts,
      variants=list(variants), dense_variants=list(dense), steps=a.steps, repeats=a.repeats,
      traced=a.traced, busy_repeats=a.busy_repeats, rule=ADOPTION_RULE,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      **({"aha_full": a.aha_full} if a.aha_full else {}),
      **({"pairs": pairs, "compile_workers": a.compile_workers} if pairs else {})))
  run["rows"] = [{k: v for k, v in r.items() if k != "trace_lines"} for r in rows]
  run["adoption"] = decision   # the last T's: decided on every T's rows
  if cb is not None:
    run["cb_update_adoption"] = cb
  if a.note:
    run["note"] = a.note
  # after the A/B, so that a timeout in them keeps it (--out's '.run.json': the run without
  # them): the o_proj probe, then the fp32 check
  if a.out:
    with open(a.out + ".run.json", "w") as f:
      json.dump(run, f, indent=1)
  if a.oproj_probe:
    run["oproj_probe"] = oproj_probe()
  if a.fp32_check:
    run["fp32_check"] = [fp32_check(a.shapes, a.B, Ts[0], sch,
                                    variants=tuple(a.fp32_variants.split(",")))
                         for sch in a.fp32_check.split(",")]
  if a.out_dir:
    common.append_run(common.result_path("decode_program", a.out_dir), run)
  return rows


def fp32_record(checks: list[dict], out_dir: str | None, settings: dict, note: str | None = None,
                **new_run_kw) -> dict:
  """The run of fp32_check results (rows = the checks; settings + the rule rule_check tests,
  ADOPTION_RULE_1E2, and FP32_RULE), with rule_check's verdict ('rule_check') and, per 'mgpu'
  check, FP32_RULE's logits test ('mgpu_fp32_logits_test': information, no adoption: no timing
  ran); printed, and appended to
  <out_dir>/decode_program_<device>.json when out_dir is given (the registered claims of its
  name recorded by the writer). new_run_kw: common.new_run's device / date / commit, for checks
  recorded from another process's --out (a call whose limit stopped it before it wrote the run)."""
  from bench import common
  run = common.new_run("decode_program",
                       dict(settings, rule=ADOPTION_RULE_1E2, fp32_rule=FP32_RULE), **new_run_kw)
  run["rows"] = checks
  run["rule_check"] = rule_check(checks)
  print("rule_check:", json.dumps(run["rule_check"], indent=1), flush=True)
  run["mgpu_fp32_logits_test"] = [dict(scheme=c["scheme"], T=c["T"], **fp32_logits_test(c, "mgpu"))
                                  for c in checks if c.get("status") == "ok" and "mgpu" in c]
  print("mgpu under FP32_RULE's logits test (information):",
        json.dumps(run["mgpu_fp32_logits_test"]), flush=True)
  if note:
    run["note"] = note
  if out_dir:
    common.append_run(common.result_path("decode_program", out_dir, run["device"]), run)
  return run


def _main_fp32(a) -> list[dict]:
  """--fp32_check alone: fp32_check of every scheme at every --T (T outer: the short contexts
  first), the table after each (and the checks written to --out: a timeout keeps what ran); a
  check that raises is recorded as an error row; then fp32_record."""
  import traceback
  Ts = [int(t) for t in str(a.T).split(",")]
  schemes = a.fp32_check.split(",")
  variants = tuple(x for x in a.fp32_variants.split(",") if x)
  for v in variants:
    if v not in FP32_VARIANTS:
      raise ValueError(f"--fp32_variants: {v!r} is not one of {FP32_VARIANTS}.")
  checks = []
  for T in Ts:
    for sch in schemes:
      try:
        checks.append(fp32_check(a.shapes, a.B, T, sch, variants=variants))
      except Exception as e:  # recorded; the other points still run
        traceback.print_exc()
        checks.append(dict(scheme=sch, shapes=a.shapes, B=a.B, T=T, status="error",
                           error=f"{type(e).__name__}: {str(e)[:400]}"))
      print(fp32_table(checks), flush=True)
      if a.out:
        with open(a.out, "w") as f:
          json.dump(checks, f, indent=1)
  fp32_record(checks, a.out_dir, dict(
      name=a.name, mode="fp32_check", shapes=a.shapes, B=a.B, T=Ts, schemes=schemes,
      variants=list(variants)), note=a.note)
  return checks


if __name__ == "__main__":
  main(sys.argv[1:])
