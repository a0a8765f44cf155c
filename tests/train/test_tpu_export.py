"""The sharded L2A train step exports for TPU from this CPU host (jax.export.export(jax.jit(step),
platforms=["tpu"])) with the L2A global branch on the Mosaic TPU compacted-query kernel, not the
O(T*S) reference: `ops` picks the kernel for the platform being lowered to.

Cross-lowering (loop.export_train_step): the step's shardings live on an AbstractMesh with a TPU
abstract device (same (data, fsdp, tensor) = (2, 2, 2) axes as the loop's mesh), so ops traces the
TPU branch here.
Shapes the Mosaic kernel takes: head_dim 64 (width 256, 4 heads), sequence a multiple of 128."""
import collections
import re

import jax
import pytest
from jax.sharding import AbstractDevice

from _train_helpers import ROOT
from condattn_jax.train import loop
from condattn_jax.train.cli import load_recipe

ARG = "tiny,steps=4,batch=8,seq=128,width=256,window=64"
TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
GLOBAL_KERNELS = ("compact_attention_fwd_tpu", "compact_attention_dq_tpu",
                  "compact_attention_dkv_tpu")


def _export(compact_impl, attention_impl):
  c = load_recipe(f"{ROOT}/configs/l2a_qwen.py:{ARG}")
  c.model.scheme.compact_impl = compact_impl
  c.model.attention_impl = attention_impl
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  setup = loop.build(c)
  exp = loop.export_train_step(setup, "tpu", device_kind=TPU.device_kind)
  assert setup.model_cfg.scheme == "l2a" and exp.platforms == ("tpu",) and exp.nr_devices == 8
  return exp.mlir_module()


def _mosaic_kernels(text):
  """Counts of the Mosaic TPU kernels (tpu_custom_call kernel names) in the module text."""
  return collections.Counter(re.findall(r'kernel_name = "([^"]+)"', text))


@pytest.mark.parametrize("compact_impl", ["auto", "pallas"])
def test_global_branch_exports_the_mosaic_compacted_kernel(compact_impl):
  """Local and forced-dense attention on the reference: every Mosaic kernel in the module is the
  global branch's active-query call (forward, and dq / dkv of the backward pass)."""
  text = _export(compact_impl, attention_impl="reference")
  found = _mosaic_kernels(text)
  assert all(found[k] >= 1 for k in GLOBAL_KERNELS), found
  assert text.count("tpu_custom_call") >= len(GLOBAL_KERNELS)
  # per shard: the kernel call sits in a shard_map (manual sharding over the mesh axes)
  assert "manual" in text.lower()


def test_with_the_global_branch_on_the_reference_there_is_no_mosaic_kernel():
  """The control of the test above: the same step with compact_impl='reference'."""
  text = _export("reference", attention_impl="reference")
  assert "tpu_custom_call" not in text and not _mosaic_kernels(text)


def test_recipe_settings_export_with_every_attention_on_mosaic():
  """The recipes' settings (attention_impl and compact_impl 'auto'): local, forced-dense and
  global attention all lower to the Mosaic kernel."""
  found = _mosaic_kernels(_export("auto", attention_impl="auto"))
  assert all(found[k] >= 2 for k in GLOBAL_KERNELS), found  # local + global kernels at least
