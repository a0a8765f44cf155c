"""Issue 27's library-level fixes (no subprocess, no compilation): one metrics record per step
after a resume, the metrics plot, the config history of a resume with a changed config, the
warning for an evaluation on the training files, and list-valued eval metrics in the markdown.
The command-line halves are in tests/cli/test_first_day_cli.py."""
import json
import os

import ml_collections
import numpy as np
import pytest

from condattn_jax.train import loop
from condattn_jax.train import metrics as metrics_lib


def _write_records(wd, steps, torn=True):
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "train/loss": 4.0 - 0.1 * s, "train/lr": 1e-3 * s,
                          "train/accuracy": 0.01 * s, "train/l2a/sparsity": [0.1 * s, 0.2],
                          "train/l2a/sparsity/mean": 0.05 * s + 0.1}) + "\n")
    if torn:
      f.write('{"step": 99, "train/lo')  # a kill -9 in the middle of a write


def test_drop_records_after_keeps_one_record_per_step(tmp_path):
  wd = str(tmp_path)
  _write_records(wd, [1, 2, 3, 4, 5, 6, 7])
  assert metrics_lib.drop_records_after(wd, 4) == 4  # 5, 6, 7 and the torn line
  assert [r["step"] for r in metrics_lib.read_records(wd)] == [1, 2, 3, 4]
  # the resumed run appends 5.. again: one record per step
  w = metrics_lib.MetricWriter(wd, tensorboard=False)
  for s in (5, 6):
    w.write(s, {"loss": 1.0}, prefix="train/")
  w.close()
  steps = [r["step"] for r in metrics_lib.read_records(wd)]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert metrics_lib.drop_records_after(wd, 6) == 0  # nothing to drop: file untouched
  assert metrics_lib.drop_records_after(wd, None) == 6  # a restart from scratch drops all
  assert metrics_lib.read_records(wd) == []


def test_plot_metrics_writes_a_png_with_loss_lr_and_the_headline(tmp_path):
  wd = str(tmp_path)
  assert metrics_lib.plot_metrics(wd, headline="l2a/sparsity") is None  # no records yet
  _write_records(wd, range(1, 11))
  out = metrics_lib.plot_metrics(wd, headline="l2a/sparsity")
  assert out == os.path.join(wd, "metrics.png")
  import matplotlib.image
  img = matplotlib.image.imread(out)
  assert img.shape[:2] == (324, 1170)  # 13 x 3.6 in at 90 dpi: three panels side by side
  # the three panels are not blank: each has plotted pixels in its own third
  dark = (img[..., :3].mean(-1) < 0.8)
  thirds = np.array_split(dark[40:-40], 3, axis=1)
  assert all(t.mean() > 0.005 for t in thirds)


def test_resume_with_a_changed_config_is_said_and_keeps_the_old_config(tmp_path, caplog):
  wd = str(tmp_path)
  c = ml_collections.ConfigDict(dict(train=dict(lr=3e-3, num_steps=200, seed=0)))
  loop.record_config(wd, c, None)
  first = open(os.path.join(wd, "config.json")).read()
  loop.record_config(wd, c, 100)  # the same config: nothing said, no history file
  assert os.listdir(wd) == ["config.json"]
  c.train.lr = 1e-3
  c.train.num_steps = 400
  with caplog.at_level("WARNING"):
    loop.record_config(wd, c, 100)
  msg = caplog.text
  assert "resuming from step 100 with a changed config" in msg
  assert "train.lr: 0.003 -> 0.001" in msg and "train.num_steps: 200 -> 400" in msg
  assert open(os.path.join(wd, "config.step100.json")).read() == first
  assert json.load(open(os.path.join(wd, "config.json")))["train"]["lr"] == 1e-3


def test_eval_on_training_files_is_warned():
  from condattn_jax.data.config import eval_reads_training_files
  from condattn_jax.train.config import default_config
  c = default_config()
  c.data.source = "mqar"
  assert eval_reads_training_files(c) is None  # synthetic: a separate eval stream
  c.data.source = "jsonl"
  c.data.paths = "/data/train.jsonl"
  assert "data.eval_paths is not set" in eval_reads_training_files(c)
  c.data.eval_paths = "/data/heldout.jsonl"
  assert eval_reads_training_files(c) is None


def test_eval_markdown_keeps_per_layer_and_per_head_values():
  from condattn_jax import evaluation
  usage = [[0.125, 0.5, 1.0], [0.25, 0.75, 0.0]]  # [L=2, N=3]
  res = {"step": 3, "results": {64: dict(ce=1.0, ppl=np.e, token_acc=0.5, exact_match=0.25,
                                         tokens=10, **{"aux/aha/usage": usage,
                                                       "aux/l2a/sparsity": [0.2, 0.4]})}}
  md = evaluation.markdown_table(res, "t")
  assert "| 64 | 2.718 | 1.0000 | 0.500 | 0.250 | 10 | 0.4375 | 0.3000 |" in md  # the means
  assert "| layer | head 0 | head 1 | head 2 |" in md
  assert "| 0 | 0.1250 | 0.5000 | 1.0000 |" in md and "| 1 | 0.2500 | 0.7500 | 0.0000 |" in md
  assert "| 1 | 0.4000 |" in md  # per layer [L]
