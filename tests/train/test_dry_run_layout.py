"""The real recipes lay out on 8, 64 and 256 devices without overrides (shape-only: no compile).

sharding.derive_layout derives the mesh / microbatches / eval batch where the batch does not
divide the mesh; sharding.check_batch_layout is the check train.loop.build applies after it. The
compiled dry runs are in test_dry_run.py."""
import os

import pytest

from condattn_jax.train import cli
from condattn_jax.train import config as config_lib
from condattn_jax.train import sharding as shd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_ONLY = os.path.join(ROOT, "tests", "fixtures", "config_only")

# recipe -> the config-only checkpoint of its default variant (segmented: its Qwen2.5-7B variant;
# the default LLaMA-2-7B-32K's linear rope_scaling is not read by ModelConfig.from_hf_config)
RECIPES = {
    "l2a_qwen.py": "qwen2.5-7b",
    "aha_olmo.py": "olmo2-0425-1b",
    "elastic_qwen.py": "qwen3-4b",
    "match_qwen.py": "qwen3-8b",
    "segmented_llama.py:qwen2.5-7b": "qwen2.5-7b",
}


def recipe(name):
  c = cli.load_recipe(os.path.join(ROOT, "configs", name))
  c.model.init_from = os.path.join(CONFIG_ONLY, RECIPES[name])
  return c


def laid_out(c, n):
  mc, _ = config_lib.model_config(c)
  out, notes = shd.derive_layout(c, n, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads)
  data, fsdp, _, tensor = shd.mesh_shape(out.mesh, n)
  assert data * fsdp * tensor == n
  shd.check_batch_layout(out, data, fsdp)  # what build() raises on
  config_lib.validate_config(out, needs_data=False)
  return out, notes, (data, fsdp, tensor)


@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_real_recipes_lay_out(name, n):
  c = recipe(name)
  before = c.to_dict()
  out, notes, (data, fsdp, tensor) = laid_out(c, n)
  assert c.to_dict() == before  # the input config is not changed
  B, k = int(out.data.batch_size), int(out.train.microbatches)
  assert B == int(c.data.batch_size)  # the recipe's batch (tokens per step) is kept
  assert (B // k) % (data * fsdp) == 0
  # nothing derived where the recipe already divides; a note for every derived field
  assert bool(notes) == (out.to_dict() != before)


def test_l2a_layouts():
  """48 rows of 128K: 8 devices keep the recipe; 64 -> fsdp 16 x tensor 4 (Qwen2.5-7B's 28 / 4
  heads divide 4); 256 -> fsdp 16 x tensor 16 with a note on the replicated heads."""
  c = recipe("l2a_qwen.py")
  out, notes, mesh = laid_out(c, 8)
  assert mesh == (1, 8, 1) and notes == []
  out, notes, mesh = laid_out(c, 64)
  assert mesh == (1, 16, 4) and int(out.eval.batch_size) == 16
  assert int(out.eval.num_batches) == 4  # 8 x 8 eval rows -> 16 x 4
  assert "fsdp=16 x tensor=4" in notes[0] and "replicated" not in notes[0]
  out, notes, mesh = laid_out(c, 256)
  assert mesh == (1, 16, 16)
  assert "does not divide 28 query heads and 4 KV heads" in notes[0]


def test_match_eval_batch_and_segmented_microbatches():
  out, notes, mesh = laid_out(recipe("match_qwen.py"), 8)
  assert mesh == (1, 8, 1) and int(out.eval.batch_size) == 8 and int(out.eval.num_batches) == 4
  assert notes == ["eval.batch_size 4 -> 8 (a multiple of data*fsdp=8), eval.num_batches 8 -> 4"]
  # segmented: batch 8 x 8 microbatches of one row -> 1 microbatch of 8 rows, one per device
  out, notes, mesh = laid_out(recipe("segmented_llama.py:qwen2.5-7b"), 8)
  assert mesh == (1, 8, 1) and int(out.train.microbatches) == 1
  assert notes[0].startswith("train.microbatches 8 -> 1")
  out, notes, mesh = laid_out(recipe("segmented_llama.py:qwen2.5-7b"), 2)
  assert int(out.train.microbatches) == 4  # 2 rows per microbatch, one per device


def test_readme_pod_example_and_hand_set_mesh():
  """The README's pod command (L2A, 256 fake devices, --config.mesh.fsdp=-1) lays out; a mesh
  set by hand that does not divide the batch is refused naming the fields."""
  c = recipe("l2a_qwen.py")
  c.mesh.fsdp = -1
  laid_out(c, 256)
  c.mesh.data, c.mesh.fsdp = 64, -1
  out, notes = shd.derive_layout(c, 256)
  assert not any(n.startswith(("mesh", "train.microbatches")) for n in notes)
  assert (int(out.mesh.data), int(out.mesh.fsdp)) == (64, -1)
  with pytest.raises(ValueError, match=r"config.data.batch_size=48 .* data\*fsdp=256"):
    shd.check_batch_layout(out, *shd.mesh_shape(out.mesh, 256)[:2])


def test_tpu_compiler_out_of_memory_figure_is_read():
  """A v5p compile that does not fit is refused by the TPU compiler; the dry run reads its
  temporaries' size (GiB) from the error (the message libtpu 0.0.48.1 gives for the 7B 128K L2A
  step on 64 chips) and otherwise lets the error through."""
  from condattn_jax.train.loop import _tpu_oom_temp_bytes
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (102.13G) exceeds available HBM (95.73G). HLO module: jit_guarded.")
  assert _tpu_oom_temp_bytes(msg) == int(102.13 * 2**30)
  assert _tpu_oom_temp_bytes(msg.replace("102.13G", "512.5M")) == int(512.5 * 2**20)
  assert _tpu_oom_temp_bytes("INTERNAL: something else") is None
