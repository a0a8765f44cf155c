"""`python eval.py --suite=tiny --checkpoint=...` for every scheme, in one head-to-head run.

The checkpoints are written here, untrained: configs/tiny.py with each scheme (L2A and AHA at its
2 layers, the others at 1), params-only checkpoints (`Checkpointer.save_params`, the format of a
model to evaluate or serve, with the run config) of the dense model's random init (drawn on the
host: no init program) converted to each scheme by the one dense -> scheme entry point
(`attention.convert`: the scheme's from_dense, as train.py's init_from), the tree checked
against the scheme's own init (eval_shape). The test checks that every scheme's checkpoint goes
through the engine and the report, not accuracy; the oracle tests in test_suite.py check the
scores. Two of the ten token-level tasks per model (--tasks: the engine path is the same for
every task); all ten run through the engine in tests/bench/test_eval_head_to_head.py (dense +
L2A, bench/eval_head_to_head.py's tiny_test preset)."""
import dataclasses
import json
import os

import jax
import pytest

from _cli_runner import Runner
from _train_helpers import host_init, subprocess_env, tiny
from condattn_jax import attention
from condattn_jax import checkpoint as ckpt_lib
from condattn_jax.train import loop

# Each scheme on configs/tiny.py (4 heads, 2 KV heads, 64-token rows): L2A and AHA at its 2 layers
# (their routing maps are checked per layer), the others at 1 (what the test checks of them does
# not depend on depth; the programs eval.py compiles grow with it).
SCHEMES = {"dense": {}, "l2a": {}, "aha": {}, "elastic": {}, "match": {},
           "segmented": dict(segment_len=32, tail_len=8, retrieve_len=8, query_len=8,
                             anchors=1, long_heads=(0,), long_layers=(0,))}
LAYERS = {"l2a": 2, "aha": 2}


def _setup(name, opts, layers=None):
  c = tiny(f"steps=1,layers={layers or LAYERS.get(name, 1)}")
  with c.unlocked():
    c.model.scheme.name = name
    for k, v in opts.items():
      c.model.scheme[k] = v
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  return c, loop.build(c, devices=jax.local_devices()[:1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("suite_runs")
  # one init: the 2-layer dense model, drawn on the host from the init's distributions (no init
  # program compiled: _train_helpers.host_init); its first layer is the 1-layer one (the layer
  # params are stacked [L, ...]); each scheme converted from the dense model of its depth
  _, s2 = _setup("dense", {}, layers=2)
  d2 = jax.device_get(host_init(s2.model_cfg, 0))
  dense = {2: (d2, s2.model_cfg),
           1: (dict(d2, layers=jax.tree.map(lambda x: x[:1], d2["layers"])),
               s2.model_cfg.replace(num_layers=1))}
  out = {}
  for name, opts in SCHEMES.items():
    c, setup = _setup(name, opts)
    base, base_cfg = dense[LAYERS.get(name, 1)]
    cfg, params = (base_cfg, base) if name == "dense" else attention.convert(
        base, base_cfg, name, **dict(setup.model_cfg.scheme_kwargs))
    assert cfg == setup.model_cfg
    want = jax.eval_shape(lambda: loop.init_params(setup))  # the scheme's own init: its tree
    assert jax.tree.structure(params) == jax.tree.structure(want)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(params)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(want)]
    ck = ckpt_lib.Checkpointer(str(root / name / "checkpoints"), keep=1)
    try:
      ck.save_params(0, params, dict(config=json.loads(c.to_json_best_effort()),
                                     model_config=dataclasses.asdict(setup.model_cfg),
                                     process_count=1))
    finally:
      ck.close()
    out[name] = str(root / name)
  return out


@pytest.fixture(scope="module")
def runner():
  """eval.py in forks of one helper process that imported its modules once (tests/_cli_runner.py:
  the script as __main__, its argv, output and exit code), for the suite run and the error cases;
  eval.py as a new interpreter: tests/evaluation/test_eval.py's CLI test."""
  r = Runner(subprocess_env(1))
  yield r
  r.close()


@pytest.mark.slow
def test_tiny_suite_head_to_head_every_scheme(runs, runner, tmp_path):
  """Every scheme in one report, L2A swept over theta (the others have no theta: evaluated
  once), perplexity by position on token documents, two tasks (--tasks)."""
  docs = tmp_path / "docs.jsonl"
  docs.write_text("\n".join(json.dumps({"tokens": [(7 * i + j) % 64 for j in range(140)]})
                            for i in range(3)))
  out = tmp_path / "out"
  args = [f"--checkpoint={runs[s]}" for s in SCHEMES]
  p = runner.run("eval.py", "--suite=tiny", "--lengths=128", "--num_samples=1", "--batch_size=2",
                 "--tasks=niah_multivalue,mqar", f"--out_dir={out}", "--sweep=theta=0.3,0.6",
                 f"--ppl_docs={docs}", *args, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stderr.count("has no option 'theta': evaluated once") == len(SCHEMES) - 1
  js = [f for f in os.listdir(out) if f.startswith("h2h_tiny_") and f.endswith(".json")
        and not f.endswith("_routing.json")]
  assert len(js) == 1
  rep = json.load(open(out / js[0]))
  names = [m["name"] for m in rep["models"]]
  assert names == ["dense", "l2a@theta=0.3", "l2a@theta=0.6", "aha", "elastic", "match",
                   "segmented"]
  assert rep["knobs"]["lengths"] == [128] and rep["knobs"]["num_samples"] == 1
  assert rep["knobs"]["tasks"] == ["mqar", "niah_multivalue"]
  for m in rep["models"]:
    assert m["knobs"]["step"] == 0 and m["knobs"]["checkpoint"] in runs.values()
    assert len(m["records"]) == 2  # 2 token-level tasks x 1 sample at length 128
    assert sorted(m["accuracy"]) == ["mqar", "niah_multivalue"]
    assert all(0.0 <= r["score"] <= 1.0 and len(r["output"]) <= 5 for r in m["records"])
    e = m["efficiency"]["128"]
    assert e["ttft_s"] > 0 and e["decode_tok_s"] > 0 and e["kv_cache_bytes"] > 0
    ppl = m["perplexity"]["128"]
    assert ppl["documents"] == 3 and len(ppl["bins"]) == 8 and ppl["ppl"] > 1.0
  by = {m["name"]: m for m in rep["models"]}
  assert [by[n]["knobs"].get("sweep") for n in names[:3]] == [None, {"theta": 0.3},
                                                              {"theta": 0.6}]
  assert by["l2a@theta=0.3"]["knobs"]["scheme"]["theta"] == 0.3
  # routing maps: L2A per layer, AHA per layer x head; dense has none
  assert len(by["l2a@theta=0.3"]["routing"]["mqar"]["128"]["global_tokens_B"]) == 2
  assert len(by["aha"]["routing"]["mqar"]["128"]["full_BN"][0]) == 4
  assert not by["dense"]["routing"]
  md = open(out / js[0].replace(".json", ".md")).read()
  assert ("| task | length | dense | l2a@theta=0.3 | l2a@theta=0.6 | aha | elastic | match | "
          "segmented |") in md
  assert "| ppl by position, length 128 | 0-16 |" in md
  for png in ("_accuracy_vs_ttft.png", "_accuracy_vs_length.png", "_routing_1.png"):
    assert os.path.getsize(out / js[0].replace(".json", png)) > 0
  assert "step 14/14" in p.stderr  # progress bar over tasks x lengths x models


def test_suite_cli_errors(runs, runner, tmp_path):
  run = lambda *a: runner.run("eval.py", *a)
  p = run("--suite=nope", f"--checkpoint={runs['dense']}", f"--out_dir={tmp_path}")
  assert p.returncode == 2 and "unknown suite 'nope'" in p.stderr
  p = run("--suite=tiny", f"--checkpoint={runs['dense']}@theta", f"--out_dir={tmp_path}")
  assert p.returncode == 2 and "knob=value pairs" in p.stderr
  p = run("--suite=tiny", f"--checkpoint={tmp_path}/missing")
  assert p.returncode == 2 and "does not exist" in p.stderr
  p = run(f"--checkpoint={runs['dense']}", f"--checkpoint={runs['l2a']}")
  assert p.returncode != 0 and "need --suite" in p.stderr

