"""The backend interface of the kernel packages, read by condattn_jax.ops' one resolver.

A kernel package exposes `BACKENDS`: a tuple of backend objects in preference order (the resolver
takes the first that supports a call), each a frozen dataclass with
  name: str                  the impl name (ops.attention(impl=name) reaches it), e.g. 'triton',
                             'mosaic_gpu', 'mosaic_tpu', 'reference'
  config: <frozen dataclass> the kernel's tuning knobs (tiles, kernel variants); static, so a
                             call with another config is another compiled program. No module
                             globals: a variant is `dataclasses.replace(backend, config=...)`.
  lowers_for: tuple[str]     lowering platforms its kernel compiles for ('cpu' is never listed:
                             on CPU a kernel runs in Pallas interpret mode, by explicit name only)
  supports(q_shape, kv_shape, dtype, platform: Platform, **static) -> str | None
                             None if the backend takes the call when lowered for `platform`,
                             else the one-line reason (the platform's, then the shape's);
                             static: the package's static call arguments (block_sparse:
                             block_q, block_k; compact_attention: none)
  __call__(q, k, v, ..., interpret=False)   runs the kernel (the package's entry point with
                             impl=name and config=config)
The resolver asks each backend for the platform it is LOWERING for (lax.platform_dependent's
branches; an abstract mesh's device for cross-lowering), never for jax.default_backend() at trace
time, so a kernel package never checks the host platform itself.

pallas_kernels.compact_attention.BACKENDS, pallas_kernels.block_sparse.BACKENDS and
pallas_kernels.decode.BACKENDS (decode over a cache; no static arguments) implement this.
"""
from __future__ import annotations

import dataclasses

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
HOPPER_DEVICE_KINDS = ("NVIDIA H100", "NVIDIA H200", "NVIDIA H800", "NVIDIA GH200")


@dataclasses.dataclass(frozen=True)
class Platform:
  """What a program is lowered for: `name` one of LOWERING_PLATFORMS, `device_kind` the device's
  kind string ('NVIDIA H100 80GB HBM3', 'TPU v5 lite'; '' when unknown)."""
  name: str
  device_kind: str = ""

  def __post_init__(self):
    if self.name not in LOWERING_PLATFORMS:
      raise ValueError(f"Platform.name={self.name!r}: choose one of {LOWERING_PLATFORMS}")

  @property
  def is_hopper(self) -> bool:
    return self.name == "cuda" and self.device_kind.startswith(HOPPER_DEVICE_KINDS)


def platform_reason(name: str, lowers_for: tuple[str, ...], platform: Platform,
                    needs_hopper: bool = False) -> str | None:
  """Why backend `name` cannot lower for `platform` (None: it can)."""
  if platform.name not in lowers_for:
    return f"the {name} kernel lowers for {'/'.join(lowers_for)}, not {platform.name}"
  if needs_hopper and not platform.is_hopper:
    return (f"the {name} kernel needs a Hopper GPU ({', '.join(HOPPER_DEVICE_KINDS)}), not "
            f"{platform.device_kind or 'an unknown device kind'}")
  return None
