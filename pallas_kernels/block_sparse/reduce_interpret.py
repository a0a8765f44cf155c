"""CPU interpret mode of a TMA reduce-add store (`plgpu.copy_smem_to_gmem(..., reduction_op="add")`).

jax 0.11.2's Mosaic GPU lowering takes the reduce-add store (a `cp.reduce.async.bulk.tensor ...
.add` of an SMEM tile into global memory; float32 / float16 / bfloat16 / int32), but its GPU
interpreter raises NotImplementedError("reduction_op not supported"). `install()` replaces, once,
the interpreter's smem -> gmem copy callback with one that, for reduction_op "add", reads the
destination window, adds the source tile and stores the sum (under one lock, so concurrent
programs' adds do not lose updates: a TMA reduction is element-wise atomic); every other copy goes
to the interpreter's own callback unchanged. Nothing here runs on a GPU (tests / interpret mode).
"""
from __future__ import annotations

import functools
import threading

import jax
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc

_LOCK = threading.Lock()
_ORIG = gc.copy_smem_to_gmem


class _ReduceAddTask(gc.AsyncCopySmemToGmemTask):
  """An smem -> gmem copy whose store adds the tile to what the destination holds."""

  def __call__(self, tma_thread_id: int):
    shared = gc._get_shared_memory()
    self.pre_read(tma_thread_id, shared)
    src, _, _ = shared.get_buffer_content(self.src_allocation_key, self.src_access, self.thread,
                                          logging_info=self.logging_info)
    if src is None or src.shape != self.src_access.shape:
      raise IndexError(f"reduce-add from {self.src_allocation_key}: source window "
                       f"[{self.src_access}] out of bounds")
    self.post_read(tma_thread_id, shared)
    with _LOCK:
      dst, _, _ = shared.get_buffer_content(self.dst_allocation_key, self.dst_access,
                                            self.thread, logging_info=self.logging_info)
      if dst is None or dst.shape != src.shape:
        raise IndexError(f"reduce-add into {self.dst_allocation_key}: destination window "
                         f"[{self.dst_access}] out of bounds (the emulation takes in-bounds "
                         "tiles only)")
      shared.store_buffer_content(self.dst_allocation_key, self.dst_access,
                                  (dst + src).astype(dst.dtype), self.thread,
                                  logging_info=self.logging_info)
    self.post_write(tma_thread_id, shared)


@gc.fail_on_exception
def _copy_smem_to_gmem(*, token, mesh_location, thread, src_allocation_key_as_array,
                       src_transforms, dst_allocation_key_as_array, dst_transforms, predicate,
                       source_info, commit_group, reduction_op):
  if reduction_op is None:
    return _ORIG.__wrapped__(
        token=token, mesh_location=mesh_location, thread=thread,
        src_allocation_key_as_array=src_allocation_key_as_array, src_transforms=src_transforms,
        dst_allocation_key_as_array=dst_allocation_key_as_array, dst_transforms=dst_transforms,
        predicate=predicate, source_info=source_info, commit_group=commit_group,
        reduction_op=None)
  if reduction_op != "add":
    raise NotImplementedError(f"reduction_op {reduction_op!r} (the emulation takes 'add')")
  if predicate is not None:
    raise NotImplementedError("a predicated reduce-add store (the emulation takes unpredicated "
                              "stores only)")
  del commit_group
  src_key = gc.HostAllocationKey.from_array(src_allocation_key_as_array)
  dst_key = gc.HostAllocationKey.from_array(dst_allocation_key_as_array)
  src_transforms = jax.tree.map(int, gc._remove_noop_transforms(src_transforms))
  dst_transforms = jax.tree.map(int, gc._remove_noop_transforms(dst_transforms))
  shared = gc._get_shared_memory()
  clock = shared.incr_clock(thread) if shared.detect_races else None
  task = _ReduceAddTask(
      mesh_location=mesh_location, thread=thread, src_allocation_key=src_key,
      src_access=shared.access(src_key, src_transforms), dst_allocation_key=dst_key,
      dst_access=shared.access(dst_key, dst_transforms), source_info=source_info, clock=clock)
  shared.execute_async_task(task)
  return token


@functools.cache
def install() -> None:
  """Makes the GPU interpreter run reduce-add stores (idempotent)."""
  gc.copy_smem_to_gmem = _copy_smem_to_gmem
