r"""How often XLA:GPU re-records a decode step's command buffer (CUDA graph), and what it costs
the host: the engine's one-token decode program called back to back, XLA's own log of each call
read per call.

    python -m bench.command_buffers --schemes=dense,l2a,elastic --T=32768 --out_dir=bench/results
    python -m bench.command_buffers --shapes=tiny-qwen --T=64       # CPU: plumbing only

XLA:GPU runs a program's captured kernels as one command buffer; before each execution it
compares the device address of every buffer allocation the commands use with the addresses it
recorded, and when any differs it updates ("re-records") the commands that use a changed one
(command_buffer_thunk.cc: "Update command buffer ... updated_allocs=N", then "Updated command
buffer in X us"; the commands left alone are logged as "Skip updating command"). An update is
host time spent before the graph is launched: where it is long, the step is host-bound.

Per scheme (bench/decode.py's config at --T, B = 1, random init; the cache `decode_program.
filled_cache`; a scheme's engine fields as its decode loops pass a step inside a block: Elastic's
decided step, MATCH's reusing step only) and per --variants entry
('default': `Engine._step` as the engine calls it; 'donate_logits': the same function jitted with
the previous logits donated too, so the new logits are written over them), two loops of --calls
calls after --warmup: 'bench' (bench/decode.py's loop: the token is the argmax of the last logits
and the position pos0 + i, both new arrays every call) and 'bare' (the same token, position and
row mask arrays every call, the logits fed back). 'steady' (mode 'steady'): a greedy step whose
every changing input is donated state (the token the argmax of the donated logits inside the
program, the position a donated array it writes back + 1, the same row mask every call), so no
new array enters a call; 'steady_noaux' the same without the per-row aux outputs;
'greedy_step' (mode 'steady'): the engine's own such step, `Engine._greedy_step` (CB_RULE's
adopted 'steady', with the ids and routing sums kept in the donated state). Row: wall ms
a call, host ms (median time for the call to return), whether three more calls keep the
logits' and the cache leaves' device addresses (logits_address_stable, cache_addresses_stable),
and from XLA's log: executions, updates, updated allocations per update, commands per update
that were re-recorded (num_commands - skipped), update us per call.

The log needs TF_CPP_VMODULE set before jax starts: `main` sets it when jax is not yet imported
(a process that imported jax first gets rows without the log's fields: `vlog` False). On a CPU
backend there are no command buffers: every log count is 0 (a plumbing check).
Appends one run to <out_dir>/command_buffers_<device>.json when --out_dir is given.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VMODULE = "command_buffer_thunk=3,command_buffer_cmd=3,command_executor=3"
VARIANTS = ("default", "donate_logits", "steady", "steady_noaux", "greedy_step")
_MARK = "@@cb_mark"


def parse_log(text: str, mark: str = _MARK) -> dict:
  """{segment name: counts} of XLA's command-buffer log between `<mark> <name> start` and
  `<mark> <name> end` lines: executions, updates, updated_allocs (list, one per update),
  update_us (list), skipped (commands left alone, summed), num_commands (list, per update).
  mark: the marker's word (the prototype's stored logs: '@@MARK', names of two words)."""
  out, cur = {}, None
  for line in text.splitlines():
    m = re.search(re.escape(mark) + r" (.+) (start|end)$", line.rstrip())
    if m:
      cur = m.group(1) if m.group(2) == "start" else None
      if cur is not None:
        out[cur] = dict(executions=0, updates=0, updated_allocs=[], update_us=[], skipped=0,
                        num_commands=[])
      continue
    if cur is None:
      continue
    seg = out[cur]
    if "Update command buffer" in line:
      seg["updates"] += 1
      a = re.search(r"updated_allocs=(\d+)", line)
      n = re.search(r"num_commands=(\d+)", line)
      seg["updated_allocs"].append(int(a.group(1)) if a else None)
      seg["num_commands"].append(int(n.group(1)) if n else None)
    elif "Updated command buffer in" in line:
      seg["update_us"].append(int(re.search(r"in (\d+)", line).group(1)))
    elif "Execute command buffer" in line:
      seg["executions"] += 1
    elif "Skip updating command" in line:
      seg["skipped"] += 1
  return out


def _summary(seg: dict | None, calls: int) -> dict:
  if seg is None:
    return dict(vlog=False)
  ups = max(seg["updates"], 1)
  cmds = [n for n in seg["num_commands"] if n is not None]
  return dict(vlog=True, executions=seg["executions"], updates=seg["updates"],
              updated_allocs=(statistics.median([a for a in seg["updated_allocs"] if a is not None])
                              if seg["updated_allocs"] else 0),
              num_commands=max(cmds) if cmds else 0,
              rerecorded_per_update=(sum(cmds) - seg["skipped"]) / ups if cmds else 0,
              update_ms_per_call=sum(seg["update_us"]) / calls / 1e3)


class _Stderr:
  """fd 2 redirected to a file while open (XLA's C++ log writes there), with marks."""

  def __enter__(self):
    self.f = tempfile.TemporaryFile(mode="w+b")
    sys.stderr.flush()
    self.saved = os.dup(2)
    os.dup2(self.f.fileno(), 2)
    return self

  def mark(self, name, what):
    sys.stderr.flush()
    os.write(2, f"\n{_MARK} {name} {what}\n".encode())

  def __exit__(self, *exc):
    sys.stderr.flush()
    os.dup2(self.saved, 2)
    os.close(self.saved)
    self.f.seek(0)
    self.text = self.f.read().decode(errors="replace")
    self.f.close()


def _logits(state):
  """The logits of a loop's state (cache, logits[, ...]) or (cache, greedy state)."""
  return state[1]["logits"] if isinstance(state[1], dict) else state[1]


def measure(scheme: str, shapes: str, T: int, variants=VARIANTS, calls: int = 20,
            warmup: int = 5, log=print) -> list[dict]:
  """Rows for one scheme (see the module docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import decode as bd
  from bench import decode_program as dp
  from condattn_jax.inference import Engine
  cfg, knobs = bd.scheme_config(scheme, shapes, T, {})
  params = bd.init_params(cfg)
  eng = Engine(cfg, params, cache_len=T + bd.EXTRA)
  tok, pos0, on, logits0 = dp.step_inputs(eng, 1, T)
  sf = dp.block_fields(eng, 1, T)
  fn = Engine._step.__wrapped__  # the step itself, to jit with other donations

  def steady(eng, params, cache, logits, pos, on, static_fields=(), keep_aux=True):
    """One greedy step whose every changing input is donated state: the token is the argmax
    of the logits, the position the state's, written back + 1; nothing new comes in."""
    tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    cache, logits, aux = fn(eng, params, cache, tok, pos, on, logits, static_fields=static_fields)
    return (cache, logits, pos + 1) + ((aux,) if keep_aux else ())
  rows = []
  for variant in variants:
    if variant not in VARIANTS:
      raise ValueError(f"--variants: {variant!r} is not one of {VARIANTS}.")
    cache = dp.filled_cache(eng, 1, T)
    logits = jnp.array(logits0, copy=True)
    if sf:  # a scheme with engine facts first runs one step without them (Elastic decides)
      cache = Engine._step(eng, params, cache, tok, pos0, on, logits)[0]
    t0 = time.perf_counter()
    if variant == "greedy_step":
      from condattn_jax.inference.engine import greedy_state, stop_ids
      stop = stop_ids(())  # the padded stop set generate's greedy step runs with
      gs = greedy_state(logits, np.full(1, T), warmup + calls + 8,
                        eng.step_aux_shapes(params, cache, 1, sf))
      step = Engine._greedy_step.lower(eng, params, cache, gs, stop, static_fields=sf).compile()
      state = (cache, gs)
      bench = lambda s, i: step(params, s[0], s[1], stop)
      modes = (("steady", bench),)
    elif variant.startswith("steady"):
      step = jax.jit(steady, static_argnums=0, static_argnames=("static_fields", "keep_aux"),
                     donate_argnums=(2, 3, 4)).lower(
          eng, params, cache, logits, jnp.array(pos0, copy=True), on, static_fields=sf,
          keep_aux=variant == "steady").compile()
      state = (cache, logits, jnp.array(pos0, copy=True))
      bench = lambda s, i: step(params, s[0], s[1], s[2], on)[:3]
      modes = (("steady", bench),)
    else:
      jitted = Engine._step if variant == "default" else jax.jit(
          fn, static_argnums=0, static_argnames=("static_fields",), donate_argnums=(2, 6))
      step = jitted.lower(eng, params, cache, tok, pos0, on, logits, static_fields=sf).compile()
      state = (cache, logits)
      bench = lambda s, i: step(params, s[0], jnp.argmax(s[1], -1).astype(jnp.int32)[:, None],
                                pos0 + i, on, s[1])[:2]
      bare = lambda s, i: step(params, s[0], tok, pos0, on, s[1])[:2]
      modes = (("bench", bench), ("bare", bare))
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
      state = bench(state, i)
    jax.block_until_ready(state)
    for mode, call in modes:
      name = f"{scheme}.{variant}.{mode}"
      host = []
      with _Stderr() as err:
        err.mark(name, "start")
        t0 = time.perf_counter()
        for i in range(calls):
          t1 = time.perf_counter()
          state = call(state, warmup + i)
          host.append((time.perf_counter() - t1) * 1e3)
        jax.block_until_ready(state)
        wall = (time.perf_counter() - t0) * 1e3 / calls
        err.mark(name, "end")
      seg = parse_log(err.text).get(name) if _vlog_on() else None
      # after the timed calls (reading an address waits for the buffer): whether three more
      # calls keep the logits and the cache leaves at the addresses they had
      addrs = []
      for i in range(3):
        state = call(state, warmup + calls + i)
        addrs.append((_logits(state).unsafe_buffer_pointer(),
                      tuple(x.unsafe_buffer_pointer() for x in jax.tree.leaves(state[0]))))
      row = dict(scheme=scheme, shapes=shapes, B=1, T=T, knobs=knobs, variant=variant, mode=mode,
                 calls=calls, compile_s=compile_s, wall_ms=wall, host_ms=statistics.median(host),
                 logits_finite=bool(jnp.all(jnp.isfinite(_logits(state)))),
                 logits_address_stable=len({a[0] for a in addrs}) == 1,
                 cache_addresses_stable=len({a[1] for a in addrs}) == 1, **_summary(seg, calls))
      rows.append(row)
      log(f"{name}: wall {wall:.3f} ms, host {row['host_ms']:.3f} ms"
          + (f", {row['updates']} updates / {row['executions']} executions, "
             f"{row['updated_allocs']} allocations, {row['rerecorded_per_update']:.0f} of "
             f"{row['num_commands']} commands re-recorded, {row['update_ms_per_call']:.3f} ms "
             "a call" if row["vlog"] else ""))
    del state, step, cache
  return rows


# Registered before the first run of this bench (2026-11-29): what the engine changes. A
# variant HOLDS for a scheme when, in its loop ('bench' for the engine's step and donate_logits,
# 'steady' for the steady ones), XLA updated the command buffer on at most `max_update_share`
# of the calls and the host time a call is at most `max_host_share` of the engine step's
# (default, bench), its logits finite. The engine takes the FIRST variant of `order` (the
# smallest change first) that holds for every scheme measured; none: the command-buffer
# updates stay, and the next lever is fewer commands a step.
CB_RULE = dict(max_update_share=0.1, max_host_share=0.7,
               order=("donate_logits", "steady", "steady_noaux"))


def decide(rows: list[dict], rule: dict = CB_RULE) -> dict:
  """{adopt: the variant the engine takes (None: none holds), holds: {variant: {scheme:
  bool}}} from rows with XLA's log (vlog); CB_RULE's contract."""
  loop = lambda v: "steady" if v.startswith("steady") else "bench"
  row = {(r["scheme"], r["variant"], r["mode"]): r for r in rows if r.get("vlog")}
  schemes = sorted({s for s, _, _ in row})
  holds = {}
  for v in rule["order"]:
    holds[v] = {}
    for s in schemes:
      base, r = row.get((s, "default", "bench")), row.get((s, v, loop(v)))
      holds[v][s] = bool(base and r and r["logits_finite"]
                         and r["updates"] <= rule["max_update_share"] * r["calls"]
                         and r["host_ms"] <= rule["max_host_share"] * base["host_ms"])
  adopt = next((v for v in rule["order"] if schemes and all(holds[v].values())), None)
  return dict(adopt=adopt, holds=holds)


def _vlog_on() -> bool:
  return "command_buffer_thunk" in os.environ.get("TF_CPP_VMODULE", "")


def main(argv=None) -> dict:
  import argparse
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--schemes", default="dense")
  p.add_argument("--shapes", default="qwen2.5-1.5b")
  p.add_argument("--T", type=int, default=32768)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--out_dir", default=None)
  p.add_argument("--name", default="main")
  a = p.parse_args(argv)
  if "jax" not in sys.modules and not _vlog_on():  # XLA reads it once, when jax starts
    os.environ["TF_CPP_VMODULE"] = VMODULE
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  from bench import common
  rows = []
  for scheme in a.schemes.split(","):
    rows += measure(scheme, a.shapes, a.T, tuple(a.variants.split(",")), a.calls, a.warmup)
  run = common.new_run("command_buffers", dict(name=a.name, schemes=a.schemes.split(","),
                                               shapes=a.shapes, T=a.T, calls=a.calls,
                                               warmup=a.warmup, vmodule=VMODULE))
  run["rows"] = rows
  run["settings"]["rule"] = CB_RULE
  run["decision"] = decide(rows)
  print(f"decision (CB_RULE): {run['decision']}", flush=True)
  if a.out_dir:
    common.append_run(common.result_path("command_buffers", a.out_dir), run)
  return run


if __name__ == "__main__":
  main()
