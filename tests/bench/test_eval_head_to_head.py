"""bench/eval_head_to_head.py: the GPU head-to-head's pipeline, CPU-checked.

By default: the h100 preset's sizes (what travels between 10-minute device commands), the
pre-registered verdict as a function of the rows (it can fail), the state's pack / unpack, the
report merge's refusals, and the tiny_test preset (the tiny preset at one layer) end to end for
dense + L2A in two calls (the first stopped by its time budget inside the dense pretraining, its
state packed and carried into the second, which resumes it, converts, continues, evaluates and
writes the result), then L2A's test-time sweep on that state in a third call. Every scheme
(the six-model head-to-head of the tiny preset itself) runs in the manual test."""
import gzip
import json
import os
import shutil

import pytest

from _cli_runner import Runner
from _train_helpers import subprocess_env
from bench import common
from bench import eval_head_to_head as h2h


def test_h100_preset_fits_the_device_calls():
  """The model is ~4M params: its bf16 export is < 16 MiB (one $OUT file) and its whole train
  state (fp32 params + Adam moments) packs into MAX_PARTS parts of <= 15 MiB; the count is the
  model's own (eval_shape of the run config's model)."""
  import jax
  import numpy as np

  from condattn_jax import export
  from condattn_jax.train.config import model_config
  p = h2h.PRESETS["h100"]
  cfg, _ = model_config(h2h.run_config(p, seq_len=1024, num_steps=10, lr=1e-3))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(export.abstract_params(cfg)))
  assert n == h2h.param_count(p)["total"]
  plan = h2h.plan(p)
  assert 3e6 < n < 8.4e6 and plan["bf16_export_mib"] < 16
  assert 12 * n < h2h.MAX_PARTS * h2h.PART_BYTES
  # the samples' length doubles phase by phase up to the check's 8192 (then the fine-tunes')
  assert [ph["seq_len"] // ph["pack"] for ph in plan["phases"]] == [
      128, 256, 512, 1024, 2048, 4096, 8192, 8192]
  # a packed phase trains on the tasks whose samples fit its slots, every NIAH task among them
  c = h2h.run_config(p, seq_len=1024, num_steps=10, lr=3e-4, pack=8)
  assert set(h2h.NIAH_TASKS) <= set(c.data.task.tasks)
  assert not {"cwe", "mqar"} & set(c.data.task.tasks)
  assert "mqar" in h2h.run_config(p, seq_len=1024, num_steps=10, lr=3e-4, pack=4).data.task.tasks
  assert all(ph["est_steps_per_s"] > 0 for ph in plan["phases"])
  # knobs are a small fraction of the training length
  k, L = p["knobs"], h2h.train_len(p)
  assert k["l2a"]["window"] <= L // 16 and k["aha"]["window"] <= L // 64
  assert k["match"]["window"] <= L // 16 and k["segmented"]["segment_len"] <= L // 8
  assert k["elastic"]["sinks"] + k["elastic"]["local"] <= L // 8


def test_packed_pretraining_phases():
  """A phase (T, until, k) trains on rows of T ids holding k samples of T // k (data.task.pack);
  the plan counts attention over the samples' length; a packed last phase is refused."""
  from condattn_jax.train import config as config_lib
  p = dict(h2h.PRESETS["tiny"], dense_phases=((256, 3, 4), (256, 5)))
  assert h2h.phases(p) == [(256, 3, 4), (256, 5, 1)]
  c = h2h.run_config(p, seq_len=256, num_steps=5, lr=1e-3, pack=4)
  config_lib.validate_config(c)
  assert c.data.task.pack == 4
  assert "pack" not in h2h.run_config(p, seq_len=256, num_steps=5, lr=1e-3).data.task
  plan = h2h.plan(p)
  assert [ph["pack"] for ph in plan["phases"]] == [4, 1, 1]
  assert plan["phases"][0]["gflop_per_token"] < plan["phases"][1]["gflop_per_token"]
  with pytest.raises(ValueError, match=r"the last phase \(256, 5, 2\) is packed"):
    h2h.phases(dict(p, dense_phases=((256, 3), (256, 5, 2))))


def _rows(acc):
  return [dict(kind="accuracy", model="dense", task=t, length=8192, accuracy=a)
          for t, a in zip(h2h.NIAH_TASKS, acc)]


def test_verdict_follows_the_rows_and_can_fail():
  assert h2h.verdict_from_rows(_rows([1.0, 0.95, 0.9, 0.85]), 8192)["judged"]
  v = h2h.verdict_from_rows(_rows([1.0, 0.95, 0.9, 0.7]), 8192)
  assert not v["judged"] and v["value"] == pytest.approx(0.8875)
  assert not h2h.verdict_from_rows(_rows([1.0, 1.0, 1.0]), 8192)["judged"]  # a task missing
  assert not h2h.verdict_from_rows(_rows([1.0] * 4), 4096)["judged"]  # not the training length


def test_pack_round_trip_and_size_limit(tmp_path, monkeypatch):
  s = tmp_path / "state"
  (s / "dense" / "checkpoints" / "7").mkdir(parents=True)
  (s / "dense" / "checkpoints" / "7" / "w").write_bytes(os.urandom(3000))
  (s / "progress.json").write_text("{}")
  monkeypatch.setattr(h2h, "PART_BYTES", 8192)  # the tar: 20 KiB
  files = h2h.pack(str(s), str(tmp_path / "out"))
  assert 1 < len(files) <= h2h.MAX_PARTS
  assert [os.path.basename(f) for f in files] == [f"state.tar.part{i:02d}"
                                                   for i in range(len(files))]
  assert all(os.path.getsize(f) <= 8192 for f in files)
  t = tmp_path / "carried"
  t.mkdir()
  for f in files:
    shutil.copy(f, t)
  assert h2h.unpack(str(t)) and not h2h._parts(str(t))
  assert (t / "dense" / "checkpoints" / "7" / "w").read_bytes() == \
      (s / "dense" / "checkpoints" / "7" / "w").read_bytes()
  assert h2h._latest_step(str(t / "dense")) == 7
  (s / "big").write_bytes(os.urandom(40000))
  with pytest.raises(ValueError, match="more than 4 x .* largest: big"):
    h2h.pack(str(s), str(tmp_path / "out2"))


def test_merge_reports_refuses_other_devices_and_twice_a_name():
  from condattn_jax.evaluation import headtohead
  k = dict(suite="tiny", lengths=[256], device=dict(device_kind="NVIDIA H100 80GB HBM3"))
  a = dict(knobs=k, date="2026-11-26T10:00:00+00:00", models=[dict(name="dense")])
  b = dict(knobs=k, date="2026-11-26T11:00:00+00:00", models=[dict(name="l2a")])
  m = headtohead.merge_reports([a, b])
  assert [x["name"] for x in m["models"]] == ["dense", "l2a"] and m["date"] == b["date"]
  c = dict(b, knobs=dict(k, device=dict(device_kind="NVIDIA H200")))
  with pytest.raises(ValueError, match="other knobs than report 0: device="):
    headtohead.merge_reports([a, c])
  with pytest.raises(ValueError, match=r"\['dense'\] in more than one report"):
    headtohead.merge_reports([a, a])


# `python -m bench.eval_head_to_head ARGS` as a fork of one helper process that imported jax,
# flax and the train loop once (tests/_cli_runner.py: a new process each call, its own backend,
# compiles and exit; sys.argv as `python -m` gives it); one helper for the file's calls.
_BENCH_MAIN = ("import runpy; runpy.run_module('bench.eval_head_to_head', run_name='__main__', "
               "alter_sys=True)")


@pytest.fixture(scope="module")
def runner():
  r = Runner(subprocess_env(1, PYTHONUNBUFFERED=1))
  yield r
  r.close()


def _bench(runner, *args, timeout=900):
  p = runner.run("-c", _BENCH_MAIN, *args, timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stdout


def _run_tiny(tmp_path, runner, schemes, preset="tiny_test"):
  state, out, packed = tmp_path / "state", tmp_path / "out", tmp_path / "packed"
  args = [f"--preset={preset}", f"--state_dir={state}", f"--out_dir={out}",
          f"--schemes={schemes}"]
  # call 1: the budget runs out in the first dense phase: a checkpoint, the state packed
  log = _bench(runner, *args, "--time_budget_s=1", f"--pack_dir={packed}")
  assert "stopped (dense pretraining at step 1 of 5)" in log and not out.exists()
  parts = sorted(os.listdir(packed))
  assert parts and all(p.startswith("state.tar.part") for p in parts)
  shutil.rmtree(state)  # the next call sees only what travelled
  state.mkdir()
  for f in parts:
    shutil.copy(packed / f, state)
  # call 2: unpacks, resumes at step 1, finishes every stage (packing after each: a call killed
  # at its limit keeps its last finished stage), and leaves no parts once finished
  log = _bench(runner, *args, f"--pack_dir={packed}")
  assert "unpacked the carried state" in log and "dense phase 128: steps 1 -> 3 of 3" in log
  assert "packed the state into 1 file(s)" in log and not os.listdir(packed)
  path = out / "eval_head_to_head_cpu.json"
  data = common.load(str(path))
  assert len(data["runs"]) == 1
  return data["runs"][0], out


def test_tiny_pipeline_resumes_and_records(tmp_path, runner):
  run, out = _run_tiny(tmp_path, runner, "dense,l2a")
  r = common.recorded_of(run)
  assert run["settings"]["name"] == "tiny_test" and r["training_length"] == 256
  tiny = {k: v for k, v in h2h.PRESETS["tiny"].items() if k != "knobs"}
  assert r["settings"] == json.loads(json.dumps(dict(tiny, layers=1)))  # tiny's but the depth
  tr = r["training"]
  assert tr["calls"] == 2
  assert [(ph["seq_len"], ph["steps"]) for ph in tr["dense"]["phases"]] == [
      (128, [0, 1]), (128, [1, 3]), (256, [3, 5])]
  assert tr["dense"]["export"]["step"] == 5
  assert tr["models"]["l2a"]["ft_steps"] == 2 == tr["models"]["dense"]["ft_steps"]
  acc = [x for x in run["rows"] if x["kind"] == "accuracy"]
  assert {(x["model"], x["length"]) for x in acc} == {("dense", 256), ("l2a", 256)}
  assert len(acc) == 2 * 10 and all(0.0 <= x["accuracy"] <= 1.0 for x in acc)
  eff = [x for x in run["rows"] if x["kind"] == "efficiency"]
  assert len(eff) == 2 and all(x["ttft_s"] > 0 and x["decode_tok_s"] > 0 for x in eff)
  # the verdict is the rows' (an untrained tiny base: not judged), and says so
  assert r["verdict"] == h2h.verdict_from_rows(run["rows"], 256) and r["judged"] is False
  assert "NOT JUDGED" in (out / "eval_head_to_head_cpu.md").read_text()
  assert r["knobs"]["l2a"]["window"] == 16 and set(r["versus_dense"]) == {"l2a"}
  assert os.path.getsize(out / "eval_head_to_head_cpu.png") > 0
  # --record_partial: what a stopped run's state holds so far, as its own run (same rows and
  # verdict as the finished run's for the same models)
  with pytest.raises(SystemExit, match="--commit is required"):
    h2h.main(["--preset=tiny_test", f"--state_dir={tmp_path / 'state'}", "--record_partial",
              "--device=cpu"])
  part = h2h.record_partial("tiny_test", str(tmp_path / "state"), device="cpu", commit="abc1234",
                            date="2026-11-29T00:00:00+00:00", out_dir=str(tmp_path / "part"))
  assert part["settings"]["name"] == "tiny_test_partial" and part["git_commit"] == "abc1234"
  assert part["rows"] == run["rows"] and part["recorded"]["verdict"] == r["verdict"]
  assert os.path.getsize(out / "eval_head_to_head_cpu_report.tar") > 0
  assert os.path.getsize(out / "eval_head_to_head_cpu_ttft.png") > 0
  with gzip.open(out / "eval_head_to_head_cpu_report.json.gz", "rt") as f:
    full = json.load(f)  # the whole report: every sample's record, per model
  assert [m["name"] for m in full["models"]] == ["dense", "l2a"]
  assert sum(len(m["records"]) for m in full["models"]) == 2 * 10 * 2  # models x tasks x samples
  # --sweep: L2A's theta at test time on the same state (its fine-tune again: run() removed its
  # export), the dense export as the TTFT reference in the same report; a third call (one
  # device, as the head-to-head's calls: h2h.sweep, then h2h.write_sweep into --out_dir)
  with pytest.raises(SystemExit, match="write scheme:knob=v1,v2"):
    h2h.main(["--preset=tiny_test", f"--state_dir={tmp_path / 'state'}", "--sweep=l2a:theta"])
  log = _bench(runner, "--preset=tiny_test", f"--state_dir={tmp_path / 'state'}",
               f"--out_dir={out}", "--sweep=l2a:theta=0.3,0.7").splitlines()
  swept = common.runs(str(out / "eval_head_to_head_cpu.json"), "tiny_test_sweep_l2a_theta")
  assert len(swept) == 1
  sw = common.recorded_of(swept[0])  # h2h.sweep's result as write_sweep recorded it
  assert sw["training"]["ft_steps"] == 2 and "l2a: fine-tuned 2 steps" in log[0]
  (wrote,) = [x for x in log if x.startswith("wrote ")]
  files = wrote[len("wrote "):].split(", ")  # write_sweep's files: result, PNG, report
  assert files[0] == str(out / "eval_head_to_head_cpu.json") and len(files) == 3
  with gzip.open(files[2], "rt") as f:
    report = json.load(f)  # sweep's report
  assert [m["name"] for m in report["models"]] == ["dense_export", "l2a theta=0.3",
                                                   "l2a theta=0.7"]
  assert [m["knobs"]["scheme"]["theta"] for m in report["models"][1:]] == [0.3, 0.7]
  assert {x["model"] for x in swept[0]["rows"]} == {
      "dense_export", "l2a theta=0.3", "l2a theta=0.7"}
  assert all(os.path.getsize(f) > 0 for f in files[1:])
  with pytest.raises(ValueError, match="thetta"):  # a misspelt option: the scheme names it
    h2h.sweep("tiny_test", str(tmp_path / "state"), "l2a", "thetta", [0.3])


@pytest.mark.manual
def test_tiny_pipeline_every_scheme(tmp_path, runner):
  """All six models through the tiny pipeline (~6 CPU-minutes on a loaded 2-core host; left out
  of `make test`: test_tiny_pipeline_resumes_and_records runs the pipeline with dense + L2A on
  tiny_test, tiny at one layer, and tests/evaluation/test_eval_suite_cli.py runs the tiny suite
  for every scheme)."""
  run, _ = _run_tiny(tmp_path, runner, ",".join(h2h.SCHEMES), preset="tiny")
  names = sorted({x["model"] for x in run["rows"]})
  assert names == sorted(h2h.SCHEMES)


def test_routing_maps_are_the_per_layer_statistics():
  """The head-to-head's routing maps keep [L] / [L, N] numeric statistics and leave out a
  scheme's other per-row entries (a nested dict, a scalar) instead of failing the evaluation."""
  from condattn_jax.evaluation import harness
  rows = [{"prompt": {"tokens": [3, 3], "g": [0.5, 1.0], "h": [[1.0, 0.0]], "x": {"a": 1},
                      "s": 2.0}},
          {"prompt": {"tokens": [3, 3], "g": [1.0, 1.0], "h": [[0.0, 0.0]], "x": {"a": 2}}}]
  assert harness._mean_stats(rows) == {"g": [0.75, 1.0], "h": [[0.5, 0.0]]}
