"""scripts/l2a_prune.py and export.py as a user runs them on one tiny L2A run (issue 27).

l2a_prune: bad inputs are one line; it saves the pruned model its docstring says to serve, and
that model loads (eval.py --checkpoint) and evaluates to the report's numbers; the KV-cache line
has readable units. export: both layouts hold the checkpoint's params bit for bit, and a run
started from the export (model.init_from) evaluates exactly like the checkpoint."""
import json
import os

import pytest

from test_cli_errors import (TINY, assert_user_error, cli, cli_process,  # noqa: F401
                             cli_runner_per_module)  # autouse: ends the runner with the module

L2A_TINY = "configs/l2a_qwen.py:tiny,steps=4"


def test_l2a_prune_bad_inputs_are_one_line(tmp_path):
  p = cli_process("scripts/l2a_prune.py", f"--workdir={tmp_path}/nope")
  assert_user_error(p, f"checkpoint path {tmp_path}/nope does not exist")
  p = cli("scripts/l2a_prune.py")
  assert_user_error(p, "give --workdir or --checkpoint")


@pytest.fixture(scope="module")
def l2a_run(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("l2a") / "w")
  p = cli("train.py", f"--config={L2A_TINY}", f"--workdir={wd}", "--config.eval.at_end=False",
          "--config.train.progress_bar=False")
  assert p.returncode == 0, p.stderr[-3000:]
  return wd


def test_l2a_prune_refuses_a_dense_run(tmp_path):
  wd = tmp_path / "dense"
  (wd / "checkpoints").mkdir(parents=True)  # refused from the config, before any checkpoint
  p = cli("scripts/l2a_prune.py", f"--workdir={wd}", f"--config={TINY}")
  assert_user_error(p, "L2A pruning needs an L2A run", "scheme is 'dense'")


@pytest.mark.slow
def test_l2a_prune_saves_a_pruned_model_that_evaluates_like_the_report(l2a_run):
  """Without --config (the run's own config), threshold 0 prunes every layer; the pruned model
  is saved as a checkpoint that eval.py loads from its own saved config (pruned_layers set),
  and evaluates to the report's "after" numbers; the KV line has readable units and says
  more / less correctly."""
  wd = l2a_run
  p = cli("scripts/l2a_prune.py", f"--workdir={wd}", "--threshold=0.0",
          "--config.eval.num_batches=1")
  assert p.returncode == 0, p.stderr[-3000:]
  rep = json.load(open(os.path.join(wd, "eval", "l2a_prune.json")))
  assert rep["pruned_layers"] == [0, 1]
  kv = [l for l in p.stdout.splitlines() if l.startswith("KV cache")][0]
  assert "0.0 MiB" not in kv and "-" not in kv.split("(")[1], kv
  assert "dense base 32.0 KiB" in kv and "(87.5% less than the dense base)" in kv, kv
  pruned = os.path.join(wd, "pruned")
  saved = json.load(open(os.path.join(pruned, "config.json")))
  assert saved["model"]["scheme"]["pruned_layers"] == [0, 1]
  e = cli("eval.py", f"--checkpoint={pruned}", "--config.eval.num_batches=1")
  assert e.returncode == 0, e.stderr[-3000:]
  res = json.load(open(os.path.join(pruned, "eval", "eval_step4.json")))
  row = res["results"]["64"]
  assert row["ppl"] == pytest.approx(rep["eval_after"]["ppl"], rel=1e-5)
  assert row["aux/l2a/sparsity"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------- export.py
def _eval_row(wd_or_dir, *args):
  p = cli("eval.py", *args, "--config.eval.num_batches=1", f"--out_dir={wd_or_dir}")
  assert p.returncode == 0, p.stderr[-3000:]
  files = [f for f in os.listdir(wd_or_dir) if f.startswith("eval_step") and f.endswith(".json")]
  return json.load(open(os.path.join(wd_or_dir, sorted(files)[-1])))["results"]["64"]


@pytest.mark.slow
def test_export_both_layouts_hold_the_checkpoint_and_import_back(l2a_run, tmp_path):
  import jax
  import numpy as np
  from _train_helpers import ROOT
  from condattn_jax import export
  from condattn_jax.train import loop
  wd = l2a_run
  p = cli_process("export.py", f"--checkpoint={tmp_path}/nope", f"--out={tmp_path}/o")
  assert_user_error(p, f"checkpoint path {tmp_path}/nope does not exist")
  cfg_run = loop.config_from_checkpoint(wd)
  _, params, _ = loop.load_params(cfg_run, wd)
  want = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
  for layout in ("condattn", "authors"):
    out = str(tmp_path / layout)
    p = cli("export.py", f"--checkpoint={wd}", f"--out={out}", f"--layout={layout}")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg, got = export.load_model(out)
    assert cfg.scheme == "l2a"
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                                 jax.tree_util.tree_flatten_with_path(got)[0]):
      assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
  c = cli("export.py", f"--check={out}")  # the authors' layout, read back by the command line
  assert c.returncode == 0 and "scheme l2a" in c.stdout, c.stderr[-2000:]
  # import: the export as model.init_from of an L2A run keeps the router and global branch
  # (no from_dense), so its step-0 eval equals the checkpoint's
  ref = _eval_row(str(tmp_path / "e_ckpt"), f"--checkpoint={wd}")
  imp = _eval_row(str(tmp_path / "e_init"), f"--config={L2A_TINY}", "--init",
                  f"--config.model.init_from={tmp_path}/condattn")
  assert imp["ce"] == ref["ce"] and imp["aux/l2a/sparsity"] == ref["aux/l2a/sparsity"], (imp, ref)
