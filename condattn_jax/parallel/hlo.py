"""The collectives of a compiled program, read from its HLO text (`compiled.as_text()`): what a
sharded step moves between devices, per op, with the loop trips it runs (the layer scan's
known trip count) and whether it sits under a conditional (every device must then take the
same branch). The dry run prints its summary (`loop.dry_run`), bench/context_parallel.py its
rows.

Bytes are the collective's RESULT bytes (an all-gather's gathered array, an all-reduce's
reduced one, a reduce-scatter's shard), times the trips of the loops around it: a volume to
compare layouts and versions by, not the bytes on a wire. The CPU compiler widens bf16
collectives to f32 (a CPU-lowered figure overstates a bf16 step's by up to 2x).
"""
from __future__ import annotations

import math
import re

_OP = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
                 r"(?:-start)?\(")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_WHILE = re.compile(r" while\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BRANCHES = re.compile(r" conditional\(.*?(?:branch_computations=\{([^}]*)\}|"
                       r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+))")
_CALLS = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
_AXES = re.compile(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple's elements summed)."""
  return sum(_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))


def collectives(hlo_text: str) -> list[dict]:
  """One dict per collective op of the module: op, axes (the mesh axes of its replica groups,
  '' where the groups are explicit), shape, bytes (result), trips (product of the known trip
  counts of the loops around it, 1 outside loops), in_conditional."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      cur = comps.setdefault(m.group(1), [])
    elif cur is not None and line.startswith("  "):
      cur.append(line)
  parent: dict[str, tuple[str, str, int]] = {}  # computation -> (caller, kind, trips)
  for name, lines in comps.items():
    for line in lines:
      if (w := _WHILE.search(line)):
        t = _TRIPS.search(line)
        parent[w.group(2)] = (name, "while", int(t.group(1)) if t else 1)
        parent[w.group(1)] = (name, "while", 1)
      elif (c := _BRANCHES.search(line)):
        for b in (c.group(1).split(",") if c.group(1) else c.group(2, 3)):
          parent[b.strip().lstrip("%")] = (name, "cond", 1)
      else:
        for callee in _CALLS.findall(line):
          parent.setdefault(callee, (name, "call", 1))

  def context(name):
    trips, cond, seen = 1, False, set()
    while name in parent and name not in seen:
      seen.add(name)
      name, kind, t = parent[name]
      trips *= t
      cond |= kind == "cond"
    return trips, cond

  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _OP.search(line)
      if not m:
        continue
      trips, cond = context(name)
      axes = _AXES.search(line)
      out.append(dict(op=m.group(2), axes=axes.group(1).replace("'", "") if axes else "",
                      shape=m.group(1), bytes=shape_bytes(m.group(1)), trips=trips,
                      in_conditional=cond))
  return out


def summary(ops: list[dict]) -> dict:
  """{op: {count, bytes: result bytes x trips}} plus total_bytes and in_conditional (count)."""
  out: dict = {}
  for c in ops:
    s = out.setdefault(c["op"], dict(count=0, bytes=0))
    s["count"] += 1
    s["bytes"] += c["bytes"] * c["trips"]
  out = dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))
  return dict(ops=out, total_bytes=sum(s["bytes"] for s in out.values()),
              in_conditional=sum(c["in_conditional"] for c in ops))
