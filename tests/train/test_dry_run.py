"""Compiled dry runs (train.loop.dry_run / train.py --dry_run) of the real recipes on 8 fake CPU
devices, with a config-only checkpoint (config.json, no weights) and a reduced layer count /
length: the model it describes, the per-device breakdown, the memory label and the verdict."""
import importlib.util
import os
import subprocess

import pytest

from condattn_jax.train import cli, loop
from tests._train_helpers import PY, ROOT, subprocess_env, tiny

CONFIG_ONLY = os.path.join(ROOT, "tests", "fixtures", "config_only")
CPU_LABEL = "CPU-lowering estimate (reference attention)"


def test_l2a_real_recipe_dry_run_describes_the_checkpoint_model():
  """The 7B L2A recipe from a config-only directory, 1 layer at 2K: the model line names the
  checkpoint's architecture (not a fixture's), per-device state bytes follow fsdp=8, and the
  memory figure and the H100 verdict carry the CPU label."""
  c = cli.load_recipe(os.path.join(ROOT, "configs", "l2a_qwen.py:seq=2048"))
  c.model.init_from = os.path.join(CONFIG_ONLY, "qwen2.5-7b")
  c.model.num_layers = 1
  c.train.dry_run_device = "h100"
  lines = []
  r = loop.dry_run(c, print_fn=lines.append)
  text = "\n".join(lines)
  assert "model: qwen2, 1 layers, width 3584, 28 heads, 4 kv heads (head_dim 128)" in text
  assert "qwen2.5-7b/config.json" in text
  assert r["mesh"] == {"data": 1, "fsdp": 8, "sequence": 1, "tensor": 1} and r["layout_notes"] == []
  m = r["memory_per_device"]
  # fp32 params, embed dim sharded 8 ways: per-device bytes = total bytes / 8 (every 2-D+ param
  # has a D axis; the 1-D norms / biases are a rounding error)
  total_bytes = 4 * r["params"]["total"]
  assert total_bytes / 8 <= m["params_bytes"] < total_bytes / 8 * 1.01
  # AdamW state (mu, nu) for the trainable params only, sharded the same way
  assert m["optimizer_bytes"] == pytest.approx(2 * 4 * r["params"]["trainable"] / 8, rel=0.05)
  assert m["peak_estimate_bytes"] >= m["params_bytes"] + m["optimizer_bytes"]
  assert f"memory per device [{CPU_LABEL}]" in text
  assert f"verdict on NVIDIA H100 (80 GiB) [{CPU_LABEL}]" in text
  assert r["verdict"]["fits"] == (m["peak_estimate_bytes"] <= 80 * 10**9)


def test_too_big_config_is_short_with_knobs():
  """A config whose step cannot fit (tiny model, 8 rows of 64K tokens per device through the
  reference attention's [T, T] scores) is 'short by X GiB, try ...' naming the knobs."""
  c = tiny("seq=65536")
  c.data.batch_size = 64
  c.train.dry_run_device = "h200"
  lines = []
  r = loop.dry_run(c, print_fn=lines.append)
  v = r["verdict"]
  assert not v["fits"] and v["spare_bytes"] < 0
  line = next(l for l in lines[0].splitlines() if "verdict" in l)
  assert f"short by {-v['spare_bytes'] / 2**30:.2f} GiB, try" in line
  assert "--config.train.microbatches=8" in line and "--config.data.seq_len=32768" in line
  assert CPU_LABEL in line


def test_cli_match_recipe_lays_out_and_v5p_is_honest():
  """train.py --dry_run_device=v5p on the MATCH recipe (eval batch 4 on 8 devices is derived to
  8): with libtpu the step is compiled for a v5p topology; without it the memory line says what
  the figure is and why it is not a TPU one."""
  p = subprocess.run(
      [PY, "train.py", "--config=configs/match_qwen.py:seq=4096", "--dry_run_device=v5p",
       f"--config.model.init_from={os.path.join(CONFIG_ONLY, 'qwen3-8b')}",
       "--config.model.num_layers=1",
       "--config.model.scheme.retriever_kwargs.tokenizer=tests/fixtures/tokenizer/qwen/tokenizer.json"],
      cwd=ROOT, env=subprocess_env(8), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  out = p.stdout
  assert "layout: eval.batch_size 4 -> 8 (a multiple of data*fsdp=8)" in out
  assert "model: qwen3, 1 layers, width 4096, 32 heads, 8 kv heads" in out
  if importlib.util.find_spec("libtpu") is None:
    # MATCH's retriever (a host callback) cannot be lowered for TPU without devices: the CPU
    # figure is printed instead, labelled, with the reason
    assert f"memory per device [{CPU_LABEL}]" in out
    assert "(not a TPU figure: libtpu is not installed" in out and "jax.export cannot lower" in out
    assert f"verdict on TPU v5p (95 GiB) [{CPU_LABEL}]" in out
  else:
    assert "verdict on TPU v5p (95 GiB) [compiled for TPU v5p:2x2x2 ahead of time" in out


def test_v5p_without_libtpu_lowers_for_tpu_and_gives_no_figure(monkeypatch):
  """Without libtpu the v5p dry run exports the step for TPU (the Mosaic kernels' lowering is
  checked) and says that there is no memory figure and no verdict, rather than printing the CPU
  one as if it were the TPU's."""
  monkeypatch.setattr(loop, "_tpu_topology_devices",
                      lambda n: (None, "libtpu is not installed (test)"))
  c = cli.load_recipe(os.path.join(ROOT, "configs", "l2a_qwen.py:tiny"))
  c.train.dry_run_device = "v5p"
  lines = []
  r = loop.dry_run(c, print_fn=lines.append)
  assert "peak_estimate_bytes" not in r["memory_per_device"] and "verdict" not in r
  assert ("memory per device: lowered for TPU with jax.export only: no memory figure (libtpu is "
          "not installed (test))") in lines[0]
  assert "verdict on v5p: none (no memory figure)" in lines[0]


@pytest.mark.parametrize("spec,ckpt,family,notes", [
    ("aha_olmo.py", "olmo2-0425-1b", "olmo2, 1 layers, width 2048, 16 heads, 16 kv heads", []),
    ("elastic_qwen.py:seq=8192", "qwen3-4b", "qwen3, 1 layers, width 2560, 32 heads, 8 kv heads",
     []),
    ("segmented_llama.py:qwen2.5-7b", "qwen2.5-7b", "qwen2, 1 layers, width 3584, 28 heads",
     ["train.microbatches 8 -> 1"]),
])
def test_other_real_recipes_dry_run_on_8_devices(spec, ckpt, family, notes):
  """AHA, Elastic and segmented (1 layer of the real model) compile on 8 fake devices without
  layout overrides; segmented's 8 one-row microbatches become one microbatch of 8 rows."""
  c = cli.load_recipe(os.path.join(ROOT, "configs", spec))
  c.model.init_from = os.path.join(CONFIG_ONLY, ckpt)
  c.model.num_layers = 1
  if c.model.scheme.name == "segmented":
    c.model.scheme.long_layers = (0,)
  c.train.dry_run_device = "h100"
  lines = []
  r = loop.dry_run(c, print_fn=lines.append)
  assert f"model: {family}" in lines[0]
  assert [n.split(":")[0] for n in r["layout_notes"]] == notes
  assert r["memory_per_device"]["peak_estimate_bytes"] > 0 and "fits" in r["verdict"]
