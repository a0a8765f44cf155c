"""Sharding rules that need no compilation: a mesh that fills the devices, dims a mesh axis cannot
divide replicated. (The compiled run on a (data=2, fsdp=2, tensor=2) mesh of 8 host CPU devices
against one device -- same loss, gradients, updated params; params, batches and Adam moments
sharded by the rules table -- is tests/train/test_l2a_sharded.py's.)"""
import jax

from _train_helpers import tiny
from condattn_jax.train import loop


def test_mesh_fill_and_indivisible_dims_fall_back_to_replicated():
  c = tiny()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 8
  c.data.batch_size = 16
  s = loop.build(c)
  assert dict(s.mesh.shape) == {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 8}
  # 2 kv heads / 4 q heads cannot split 8 ways: replicated on 'tensor' instead of failing.
  for proj in ("q_proj", "k_proj"):
    spec = s.param_shardings["layers"]["self_attn"][proj]["kernel"].spec
    assert "tensor" not in jax.tree.leaves(tuple(spec)), spec
  # mlp (128) and vocab (64) do split 8 ways.
  assert "tensor" in s.param_shardings["layers"]["mlp"]["up_proj"]["kernel"].spec
