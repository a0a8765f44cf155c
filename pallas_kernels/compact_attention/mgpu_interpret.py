"""CPU interpret mode for the Mosaic GPU kernels (tests only).

jax 0.11.2's GPU interpreter (jax._src.pallas.mosaic_gpu.interpret) runs wgmma only with both
operands in shared memory; Hopper also takes the A operand from registers (the P @ V and dS @ K
products of flash attention keep P / dS in registers). `params()` installs, once, a rule that
stages such an operand through a scratch buffer and then does what the interpreter's own rule
does. The scratch buffer is allocated in the register space: the interpreter matches shared-
memory allocations across threads by their order, which extra per-thread allocations would shift,
and keeps a separate sequence for register allocations. Nothing here runs on a GPU.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import core as mgpu_core
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
from jax._src.state import types as state_types
from jax.experimental.pallas import mosaic_gpu as plgpu

_ORIG = ji.JaxprInterpreter._interpret_wgmma_ref_p


def _wgmma_register_a(self, eqn, token, get_invals):
  if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
    return _ORIG(self, eqn, token, get_invals)
  acc, a_val, b, *leaves = get_invals()
  regs = mgpu_core.MemorySpace.REGS
  token, request = gpu_callbacks.call_make_allocation_request_array(
      token=token, compute_unit=self.thread, memory_space_id=memory.get_memory_space_idx(regs))
  token, a_key = gpu_callbacks.call_allocate_buffer(
      token=token, mesh_location=self.mesh_location, thread=self.thread,
      allocation_request_as_array=request, value=jnp.asarray(a_val),
      source_info=eqn.source_info)
  ref_aval = state_types.AbstractRef(eqn.invars[1].aval, mgpu_core.MemorySpace.SMEM)
  patched = eqn.replace(invars=[eqn.invars[0], _FakeVar(ref_aval), *eqn.invars[2:]],
                        params={**eqn.params, "a_transforms_tree": None})
  token, out = _ORIG(self, patched, token, lambda: (acc, a_key, b, *leaves))
  token = gpu_callbacks.call_deallocate_buffer(
      token=token, mesh_location=self.mesh_location, thread=self.thread,
      allocation_key_as_array=a_key, source_info=eqn.source_info)
  return token, out


class _FakeVar:
  def __init__(self, aval):
    self.aval = aval


@functools.cache
def _install():
  ji.JaxprInterpreter._interpret_wgmma_ref_p = _wgmma_register_a


def params(interpret) -> plgpu.InterpretGPUParams:
  """interpret=True or an InterpretGPUParams -> the params, with the register-operand rule."""
  _install()
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  return plgpu.InterpretGPUParams()
