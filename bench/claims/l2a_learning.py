"""Claims of bench/l2a_learning.py's recorded runs: the CPU-sized run (l2a_learning_cpu.json)
and the full run (l2a_learning.json); see bench/claims/__init__.py.

The dense model (tests/fixtures/l2a/mqar_dense.npz) is the tiny decoder that
`python bench/l2a_learning.py --preset=full --save_dense=...` trains with full attention on MQAR
(T=32, 4 pairs, every query > 8 tokens after every pair). The CPU preset converts it to L2A with
window 4 (local attention alone cannot answer), trains the L2A recipe for 1200 steps (attention +
norms + router; FFN and embeddings frozen) and the paper's context-free baseline (Bernoulli routing
at the L2A model's global fraction) for as many: high sparsity, and far better accuracy than
context-free routing at that sparsity. Conversion at w >= 1 damages this tiny model (local + global
add up: ~8% accuracy at step 0), so L2A first re-learns the recall circuit, which takes ~4000
steps; within 1200 steps it is still below the dense accuracy. The full run (16000 L2A steps) is
where it meets the dense accuracy.

Both runs are long (the CPU one about 4 minutes on 2 cores), so they live in bench/ with their
results recorded (bench/results/l2a_learning_cpu.json, l2a_learning.json). L2A learning to route
is also run inside the suite: tests/cli/test_demo.py runs `make demo` (the same dense model, window 1,
600 steps, conversion to learned routing in the test) and asserts the same claims with wider
margins.
"""
from bench.claims import claim, expect


def expect_l2a_pruning_kv_bytes(settings, layer_sparsity, pruning, ctx=131072):
  """bench/l2a_learning.py's pruning section, recomputed from the settings (a dict of its
  Settings): layers at sparsity >= 0.95 lose their full cache (K, V x kv heads x head_dim x
  float32 per token and layer); every layer keeps its window ring."""
  pruned = [i for i, x in enumerate(layer_sparsity) if x >= 0.95]
  expect(pruning["pruned_layers"] == pruned, ("pruned layers", pruning["pruned_layers"], pruned))
  per_tok = 2 * settings["num_kv_heads"] * (settings["hidden_size"] // settings["num_heads"]) * 4
  L, w = settings["num_layers"], settings["window"]
  kv = pruning["kv_bytes"][str(ctx)]
  expect(kv["dense"] == L * ctx * per_tok, ("dense kv bytes", kv["dense"]))
  expect(kv["l2a"] == L * (ctx + w) * per_tok, ("l2a kv bytes", kv["l2a"]))
  expect(kv["l2a_pruned"] == (L * w + (L - len(pruning["pruned_layers"])) * ctx) * per_tok,
         ("pruned kv bytes", kv["l2a_pruned"]))


@claim("l2a_learning", run=("main", "cpu"), file="l2a_learning_cpu.json")
def cpu_run(res, run):
  """bench/results/l2a_learning_cpu.json: `python bench/l2a_learning.py --preset=cpu
  --dense_params=tests/fixtures/l2a/mqar_dense.npz`, run with the preset as it is now."""
  import dataclasses
  import json
  from bench import l2a_learning as bench
  s = bench.PRESETS["cpu"]
  want = json.loads(json.dumps(dataclasses.asdict(s)))
  expect(res["settings"] == want, "the CPU preset changed: re-run it (command in the file)")
  expect("--dense_params=tests/fixtures/l2a/mqar_dense.npz" in res["command"])
  expect(res["date"] and res["backend"] == "cpu" and res["device"])
  expect(res["jax_version"] == "0.11.2")
  summary = {k: res[k] for k in ("dense_accuracy", "converted_accuracy", "l2a_accuracy",
                                  "l2a_sparsity", "l2a_layer_sparsity", "context_free_accuracy",
                                  "context_free_sparsity")}
  expect(res["dense_accuracy"] > 0.95, summary)
  # right after the conversion (window 4, both branches copied, zero router: every token global)
  # the local + global sum has broken the recall circuit: what L2A reaches is learned in the run
  expect(res["converted_accuracy"] < 0.2, summary)
  # the router learned to skip global attention for most tokens ...
  expect(res["l2a_sparsity"] >= 0.65, summary)
  # ... where it is not needed: well above the context-free router at the same sparsity
  # (H200, 3 seeds of the same preset: L2A 0.453 / 0.456 / 0.455 vs 0.328 / 0.332 / 0.311)
  expect(abs(res["context_free_sparsity"] - res["l2a_sparsity"]) < 0.05, summary)
  expect(res["l2a_accuracy"] >= res["context_free_accuracy"] + 0.05, summary)
  expect(res["l2a_accuracy"] >= 0.35, summary)
  # the pruning section (2 kv heads x head_dim 16, window ring of 4 slots)
  expect_l2a_pruning_kv_bytes(res["settings"], res["l2a_layer_sparsity"], res["pruning"])


@claim("l2a_learning", run=("main", "full"), file="l2a_learning.json")
def full_run(r, run):
  """bench/results/l2a_learning.json (the full run) holds the issue's evidence."""
  for k in ("dense_accuracy", "l2a_accuracy", "l2a_sparsity", "context_free_accuracy",
            "l2a_layer_sparsity", "task", "date", "settings"):
    expect(k in r, k)
  expect(r["task"]["seq_len"] >= 4 * r["settings"]["window"])  # window much shorter than T
  expect(r["l2a_accuracy"] >= r["dense_accuracy"] - 0.02)
  expect(r["l2a_sparsity"] >= 0.70)
  expect(r["l2a_accuracy"] >= r["context_free_accuracy"] + 0.1)
  expect(abs(r["context_free_sparsity"] - r["l2a_sparsity"]) < 0.05)
