"""decode_mlp: the MLP half of a decoder layer for one decode step, as two Hopper kernels.

    out_MD = decode_mlp(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD, impl="auto")
           = x + (silu(xn @ Wg) * (xn @ Wu)) @ Wd

M = the rows of one decode step (B x T tokens, 1..64), D the model width, F the MLP width; xn is
the post-attention norm's output (the norm stays in XLA), x the residual stream. Rounded as the
model's MLP (reference.py: each projection summed in float32 and returned in the activation
dtype; silu * mul in float32, rounded once). impl: 'reference' (jnp), 'mosaic_gpu' (the Hopper
kernels, mosaic_gpu.py: gate/up + silu * mul writing h [M, F], then split-K down writing float32
partials that one XLA fusion sums, rounds and adds to x), 'auto' (the kernels when the call is
lowered for a Hopper GPU and `kernel_support` takes the shape, else the reference; picked with
lax.platform_dependent for the platform the program is LOWERED for, the device kind from the
default backend or the abstract mesh's device). interpret=True runs impl='mosaic_gpu' in Pallas'
GPU interpreter (CPU tests). Forward only. The tiles, stages and split come from `plan` (config:
DecodeMLPConfig; its None fields are planned for the device's SM count).

Calling it from the decoder (not wired yet: only if bench/decode_mlp.py's ADOPTION_RULE passes).
In condattn_jax/models/decoder.py `Decoder._unrolled` (the decode step with split groups,
models.stacking.split_groups) each layer's weights arrive as arrays of their own, and the layer
runs `models.layers.mlp_residual(cfg, x_BTD)`. For a pre-norm family (not olmo2's post-norm,
whose residual adds a norm of the MLP output) mlp_residual would, in a decode step (T small, a
LayerContext flag set by the engine), declare the same parameters (a module named "mlp" with
children gate_proj / up_proj / down_proj holding `kernel`, so checkpoints and the logical
partitioning are unchanged) and call

    B, T, D = x_BTD.shape
    xn = make_norm(cfg, "post_attention_layernorm")(x_BTD)
    out = decode_mlp(x_BTD.reshape(B * T, D), xn.reshape(B * T, D),
                     p["gate_proj"]["kernel"], p["up_proj"]["kernel"], p["down_proj"]["kernel"],
                     impl="auto").reshape(B, T, D)

with the kernels in the weights' dtype (bf16 decode weights: param_dtype bfloat16; other dtypes
take the reference). Under a tensor-parallel mesh the call would run per shard (shard_map over
the mlp axis, the down partials psum'd before the epilogue); a one-device decode needs none.
The XLA epilogue (sum of the partials, rounding, + x) is elementwise work that XLA can fuse
into the next layer's input RMSNorm fusion (not measured: bench/decode_mlp.py times the op
alone, where the epilogue is a small kernel of its own).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.backends import Platform, platform_reason

from . import mosaic_gpu as mg
from .reference import reference_decode_mlp, round_to

IMPLS = ("auto", "reference", "mosaic_gpu")
MAX_ROWS = mg.ROWS                   # one wgmma M tile
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HOPPER_SMS = 132                     # H100 / H200 SXM; an unknown device plans for this many
SMEM_PER_SM = 228 * 1024             # Hopper's shared memory per SM ...
SMEM_PER_PROGRAM = 227 * 1024        # ... and per block
SMEM_RESERVED = 1024 + 2048          # per resident block: CUDA's 1 KB + barriers, buffer alignment
MAX_STAGES = 8
INFLIGHT_TARGET = 48 * 1024          # weight bytes in flight per SM the gate/up plan aims for


@dataclasses.dataclass(frozen=True)
class DecodeMLPConfig:
  """Tuning knobs (static; None: `plan` picks for the shape and the SM count).

  block_k: K per pipeline step, a multiple of 64 (a bf16 wgmma's K under the 128-byte swizzle
  both operands share). up_block_n: the gate/up kernel's column tile (64 or 128: its two fp32
  accumulators take block_n registers a thread); up_stages: its weight tiles in flight + 1.
  down_block_n: the down kernel's column tile (a multiple of 64, <= 256); down_splits: its K
  parts (split-K; None: about down_programs_per_sm x SMs programs); down_stages: as up_stages.
  num_sms: the SMs the grids are sized for (None: the abstract mesh's device num_cores, the GPU's
  core_count, else 132)."""
  block_k: int = 64
  up_block_n: int | None = None
  up_stages: int | None = None
  down_block_n: int = 64
  down_splits: int | None = None
  down_stages: int | None = None
  down_programs_per_sm: int = 2
  num_sms: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A call's resolved tiles: the gate/up and down kernels' arguments."""
  up_block_n: int
  up_stages: int
  down_block_n: int
  down_stages: int
  down_splits: int
  block_k: int
  num_sms: int

  def programs(self, D: int, F: int) -> tuple[int, int]:
    """(gate/up programs, down programs)."""
    return -(-F // self.up_block_n), -(-D // self.down_block_n) * self.down_splits


def device_sms(cfg: DecodeMLPConfig = DecodeMLPConfig()) -> int:
  """The SM count the grids are sized for (DecodeMLPConfig.num_sms)."""
  if cfg.num_sms is not None:
    return cfg.num_sms
  dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if dev is not None and getattr(dev, "num_cores", None):
    return int(dev.num_cores)
  if jax.default_backend() == "gpu":
    return int(getattr(jax.devices()[0], "core_count", HOPPER_SMS) or HOPPER_SMS)
  return HOPPER_SMS


def _resident_stages(kind, M, bn, bk, per_sm, cap):
  """The most stages (<= cap) with which per_sm programs fit in one SM's shared memory (0: none)."""
  s = cap
  while s >= 1:
    smem = mg.smem_bytes(kind, M, bn, bk, s)
    if smem <= SMEM_PER_PROGRAM and per_sm * (smem + SMEM_RESERVED) <= SMEM_PER_SM:
      return s
    s -= 1
  return 0


def plan(M: int, D: int, F: int, cfg: DecodeMLPConfig = DecodeMLPConfig(),
         num_sms: int | None = None) -> Plan:
  """Tiles so that each kernel's grid is resident at once (one wave): ceil(programs / SMs)
  programs per SM, stages as deep as shared memory allows them (<= 8).

  gate/up: block_n the smallest of (64, 128) whose weight bytes in flight per SM ((stages - 1)
  tiles of both matrices per program) reach INFLIGHT_TARGET, else the one with the most.
  down: block_n = config.down_block_n, splits = floor(down_programs_per_sm x SMs / column tiles)
  (1..K steps), stages as deep as that many programs per SM allow."""
  sms = num_sms or device_sms(cfg)
  bk = cfg.block_k
  nk_up, nk_down = -(-D // bk), -(-F // bk)
  cands = (cfg.up_block_n,) if cfg.up_block_n is not None else (64, 128)
  best = None
  for bn in cands:
    nt = -(-F // bn)
    per_sm = -(-nt // sms)
    cap = min(MAX_STAGES, nk_up)
    s = cfg.up_stages if cfg.up_stages is not None else max(
        1, _resident_stages("gate_up", M, bn, bk, per_sm, cap))
    inflight = (max(s, 2) - 1) * 2 * bk * bn * 2 * min(nt, sms * per_sm) / sms
    if best is None or (best[2] < INFLIGHT_TARGET and inflight > best[2]):
      best = (bn, s, inflight)
  up_bn, up_s, _ = best
  dn = cfg.down_block_n
  nt_down = -(-D // dn)
  splits = cfg.down_splits if cfg.down_splits is not None else max(
      1, min(nk_down, (cfg.down_programs_per_sm * sms) // nt_down))
  per_sm = -(-nt_down * splits // sms)
  cap = min(MAX_STAGES, -(-nk_down // splits))
  down_s = cfg.down_stages if cfg.down_stages is not None else max(
      1, _resident_stages("down", M, dn, bk, per_sm, cap))
  return Plan(up_block_n=up_bn, up_stages=up_s, down_block_n=dn, down_stages=down_s,
              down_splits=splits, block_k=bk, num_sms=sms)


def check_shapes(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD):
  """ValueError (one line naming the argument) unless x, xn are [M, D], Wg, Wu [D, F], Wd
  [F, D] and the activations share a floating dtype."""
  names = ("x_MD", "xn_MD", "w_gate_DF", "w_up_DF", "w_down_FD")
  arrs = (x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD)
  for name, a in zip(names, arrs):
    if a.ndim != 2:
      raise ValueError(f"decode_mlp: {name} must be 2-D, got shape {tuple(a.shape)}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"decode_mlp: {name} must be floating, got {a.dtype}")
  M, D = xn_MD.shape
  F = w_gate_DF.shape[1]
  want = {"x_MD": (M, D), "w_gate_DF": (D, F), "w_up_DF": (D, F), "w_down_FD": (F, D)}
  for name, a in zip(names, arrs):
    if name in want and tuple(a.shape) != want[name]:
      raise ValueError(f"decode_mlp: {name} has shape {tuple(a.shape)}, expected {want[name]} "
                       f"(xn_MD is {(M, D)}, w_gate_DF {tuple(w_gate_DF.shape)})")
  if x_MD.dtype != xn_MD.dtype:
    raise ValueError(f"decode_mlp: x_MD dtype {x_MD.dtype} != xn_MD dtype {xn_MD.dtype}")


def kernel_support(M: int, D: int, F: int, dtype, weight_dtypes=(),
                   cfg: DecodeMLPConfig = DecodeMLPConfig(), num_sms: int | None = None
                   ) -> str | None:
  """None if the Mosaic GPU kernels take M rows of width D, MLP width F in `dtype` (and weights
  of `weight_dtypes`), else why not (one line)."""
  why = []
  if not 1 <= M <= MAX_ROWS:
    why.append(f"M={M} rows (the decode MLP kernels take 1..{MAX_ROWS} rows, one wgmma M tile; "
               "a larger batch is a prefill-sized product: use impl='reference')")
  if jnp.dtype(dtype) not in _DTYPES:
    why.append(f"dtype {jnp.dtype(dtype).name} (the kernels take bfloat16 / float16)")
  for name, wdt in weight_dtypes:
    if jnp.dtype(wdt) != jnp.dtype(dtype):
      why.append(f"{name} dtype {jnp.dtype(wdt).name} != the activations' {jnp.dtype(dtype).name}"
                 " (the kernels stream the weights as they are: cast them once, outside the step)")
  if D % 8 or F % 8:
    why.append(f"D={D}, F={F}: both must be multiples of 8 (TMA's 16-byte row strides)")
  if cfg.block_k % 64 or cfg.block_k <= 0:
    why.append(f"DecodeMLPConfig.block_k={cfg.block_k}: a multiple of 64 (a 16-bit wgmma's K "
               "under the 128-byte swizzle)")
  if cfg.up_block_n is not None and cfg.up_block_n not in (64, 128):
    why.append(f"DecodeMLPConfig.up_block_n={cfg.up_block_n}: 64 or 128 (two fp32 "
               "accumulators of block_n registers a thread)")
  if cfg.down_block_n % 64 or not 64 <= cfg.down_block_n <= 256:
    why.append(f"DecodeMLPConfig.down_block_n={cfg.down_block_n}: a multiple of 64, <= 256")
  nk_down = -(-F // cfg.block_k) if cfg.block_k > 0 else 0
  if cfg.down_splits is not None and not 1 <= cfg.down_splits <= max(nk_down, 1):
    why.append(f"DecodeMLPConfig.down_splits={cfg.down_splits}: 1..{nk_down} (the down "
               f"kernel's K steps of block_k={cfg.block_k})")
  for field in ("up_stages", "down_stages"):
    v = getattr(cfg, field)
    if v is not None and v < 1:
      why.append(f"DecodeMLPConfig.{field}={v}: at least 1")
  if why:
    return "; ".join(why)
  p = plan(M, D, F, cfg, num_sms)
  for kind, bn, s, field in (("gate_up", p.up_block_n, p.up_stages, "up_stages"),
                             ("down", p.down_block_n, p.down_stages, "down_stages")):
    smem = mg.smem_bytes(kind, M, bn, p.block_k, s)
    if smem > SMEM_PER_PROGRAM:
      why.append(f"DecodeMLPConfig.{field}={s}: the {kind} kernel's shared memory "
                 f"{smem // 1024} KiB > {SMEM_PER_PROGRAM // 1024} KiB (fewer stages)")
  return "; ".join(why) or None


def _kernels(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD, p: Plan, interpret):
  h = mg.gate_up(xn_MD, w_gate_DF, w_up_DF, block_n=p.up_block_n, block_k=p.block_k,
                 stages=p.up_stages, interpret=interpret)
  part = mg.down(h, w_down_FD, block_n=p.down_block_n, block_k=p.block_k,
                 stages=p.down_stages, splits=p.down_splits, interpret=interpret)
  y = round_to(jnp.sum(part, axis=0), xn_MD.dtype)    # the model's down_proj output
  return x_MD + y


def lowering_target() -> Platform | None:
  """The GPU platform this process can lower for (the abstract mesh's device, else a GPU default
  backend), or None."""
  dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if dev is not None:
    name = dev.platform
    if name in ("gpu", "cuda"):
      return Platform("cuda", str(dev.device_kind or ""))
    return None
  if jax.default_backend() == "gpu":
    from jax.extend import backend as jex_backend
    if "rocm" in jex_backend.get_backend().platform_version.lower():
      return None
    return Platform("cuda", jax.devices()[0].device_kind)
  return None


def decode_mlp(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD, *, impl: str = "auto",
               interpret=False, config: DecodeMLPConfig | None = None):
  """x + down(silu(gate(xn)) * up(xn)) [M, D] in x's dtype; see the module docstring. An
  explicit impl='mosaic_gpu' that cannot take the call raises ValueError naming why."""
  if impl not in IMPLS:
    raise ValueError(f"decode_mlp: unknown impl {impl!r}; choose one of {IMPLS}")
  check_shapes(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD)
  cfg = DecodeMLPConfig() if config is None else config
  args = (x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD)
  if impl == "reference":
    return reference_decode_mlp(*args)
  M, D = xn_MD.shape
  F = w_gate_DF.shape[1]
  wdt = (("w_gate_DF", w_gate_DF.dtype), ("w_up_DF", w_up_DF.dtype),
         ("w_down_FD", w_down_FD.dtype))
  why = kernel_support(M, D, F, xn_MD.dtype, wdt, cfg)
  if impl == "mosaic_gpu":
    if why:
      raise ValueError(f"decode_mlp impl='mosaic_gpu' cannot take this call: {why}")
    return _kernels(*args, plan(M, D, F, cfg), interpret)
  # auto: the kernels only where the program is lowered for a Hopper GPU (interpret unused)
  target = lowering_target()
  if why is not None or target is None or platform_reason(
      "mosaic_gpu", ("cuda",), target, needs_hopper=True) is not None:
    return reference_decode_mlp(*args)
  p = plan(M, D, F, cfg)
  return lax.platform_dependent(
      *args, cuda=lambda *a: _kernels(*a, p, False), default=reference_decode_mlp)


def bytes_read(M: int, D: int, F: int, itemsize: int = 2) -> int:
  """The bytes a call must read: the three weight matrices and the rows of x and xn (the bound
  the bench divides by; h's and the partials' round trips are extra, a few hundred KB)."""
  return 3 * D * F * itemsize + 2 * M * D * itemsize


@dataclasses.dataclass(frozen=True)
class DecodeMLPBackend:
  """The kernels as a backend (the pallas_kernels.backends interface, with the MLP's shapes:
  supports(x_shape [M, D], ff_dim F, dtype, platform))."""
  name: str
  lowers_for: tuple[str, ...] = ()
  needs_hopper: bool = False
  config: DecodeMLPConfig = DecodeMLPConfig()

  def supports(self, x_shape, ff_dim: int, dtype, platform: Platform) -> str | None:
    if self.name == "reference":
      return None
    why = platform_reason(self.name, self.lowers_for, platform, self.needs_hopper)
    return why if why is not None else kernel_support(x_shape[0], x_shape[1], ff_dim, dtype,
                                                      cfg=self.config)

  def __call__(self, x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD, interpret=False):
    return decode_mlp(x_MD, xn_MD, w_gate_DF, w_up_DF, w_down_FD, impl=self.name,
                      interpret=interpret, config=self.config)


BACKENDS = (DecodeMLPBackend("mosaic_gpu", ("cuda",), needs_hopper=True),
            DecodeMLPBackend("reference"))
