"""bench/context_parallel.py (context parallelism's attention alone) on fake CPU devices with tiny
heads: rows for n = 1 and 2, efficiencies against n = 1, and the collectives XLA compiled: the
gathered causal attention moves K / V by all-gather and dK / dV by reduce-scatter (no all-reduce
of gradients); L2A's layer (window halo + routed global in a scanned program) moves the halo by
collective-permute and K/V by all-gather. (The halo's numerics: tests/train/test_context_parallel.py.)"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import context_parallel as cp  # noqa: E402


def test_tiny_rows_on_two_cpu_devices(tmp_path):
  assert cp.main(["--tiny", "--T=64", "--window=8", "--devices=1,2",
                  "--cases=causal,collectives,layer", "--reps=1", "--inprocess",
                  f"--out_dir={tmp_path}"]) == 0
  (path,) = tmp_path.glob("context_parallel_*.json")
  run = json.loads(path.read_text())["runs"][-1]
  rows = {(r["case"], r["devices"]): r for r in run["rows"]}
  assert set(rows) == {("causal", 1), ("causal", 2), ("collectives", 2), ("layer", 1),
                       ("layer", 2)}
  assert rows["causal", 1]["collectives"] == {}
  causal = rows["causal", 2]
  assert causal["mesh"] == {"data": 1, "fsdp": 1, "sequence": 2, "tensor": 1}
  assert set(causal["collectives"]) == {"all-gather", "reduce-scatter"}, causal["collectives"]
  assert causal["fwd_efficiency"] > 0 and causal["fwd_bwd_efficiency"] > 0
  assert set(rows["collectives", 2]["collectives"]) == {"all-gather", "collective-permute",
                                                        "all-reduce"}
  layer = rows["layer", 2]
  assert layer["halo_exchange"] == "ppermute" and layer["window"] == 8 and layer["q"] == 0.2
  assert set(layer["collectives"]) == {"all-gather", "collective-permute", "reduce-scatter"}, \
      layer["collectives"]
