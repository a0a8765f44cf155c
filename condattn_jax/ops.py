"""The one attention dispatch point: `attention(q, k, v, mask, impl=...)`.

    mask = ops.MaskSpec(q_positions_BT=pos, kv_positions_BS=pos, q_segment_ids_BT=seg,
                        kv_segment_ids_BS=seg, contiguous=True)
    out_BTNH = ops.attention(q_BTNH, k_BSKH, v_BSKH, mask)                 # impl="auto"

`MaskSpec` says which (query, key) pairs are visible; `MaskSpec.dense_mask()` is the one mask
builder (pallas_kernels/compact_attention/reference.py, shared with the kernels' tests), and
impl="reference" is the one reference attention (same file).

Implementations (one vocabulary):
  reference  masked dense attention, float32 softmax, any mask. O(T*S) memory: CPU and tests.
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"): contiguous self-attention
             without segment ids, active set, sinks or block lists; bfloat16/float16.
  tokamax    tokamax flash attention (Mosaic GPU, else Triton) with a per-query k_start
             (document start, window): contiguous (packed) self-attention without active set,
             sinks or block lists. Off GPU: tokamax's XLA implementation (tests).
  pallas     pallas_kernels.compact_attention: any positions / segments / window / active set
             ([B, T] or per head [B, T, N]), e.g. caches, decode, chunked prefill, L2A, AHA;
             a mask with block lists: pallas_kernels.block_sparse (every MaskSpec field, sinks
             too; one launch for a layer's mixed full / block-sparse heads).
             Triton on GPU, Mosaic on TPU; on CPU the kernel in Pallas interpret mode, Triton-
             style by default, `pallas_backend="mosaic_tpu"` for Mosaic TPU interpret (tests).
  auto       picked for the platform the call is LOWERED for (jax.lax.platform_dependent), not
             the backend at trace time, so jax.export for GPU/TPU from a CPU host gets the GPU/TPU
             kernel:  cpu -> reference;
                      cuda -> contiguous self-attention without active/sinks: cudnn (no segment
                              ids) else tokamax (causal) or pallas (with a window: tokamax's
                              backward does not skip out-of-window tiles); anything else (active
                              set, cache layout, decode, chunked prefill): pallas (with an
                              all-true active set if none);
                      rocm -> pallas;  tpu -> pallas (Mosaic).
             Block lists go to the block-sparse kernel (cuda, rocm, tpu). A kernel that cannot
             take the call's shape falls to the next one; only masks no kernel takes yet (sinks
             without block lists) use the reference on GPU/TPU, with a warning.
An explicit impl that cannot take the call raises ValueError naming the impl and why.

Only the branch for the lowering platform is lowered, and under jax.grad the other branches'
(zero-filled) residuals are dead code after lowering (tests/kernels/test_ops.py checks both on compiled
CPU HLO). All branches are traced, but only for platforms this process can lower for: its own
backend, plus the platform of an abstract device set with
jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice(...)))
(cross-lowering, e.g. exporting for cuda or tpu from a CPU host). A branch for any other platform
is a placeholder whose lowering raises that advice (never a silently wrong kernel).

Under a mesh (jax.sharding.get_abstract_mesh()), every Pallas and tokamax call runs per shard in
jax.shard_map: batch over data/fsdp, heads over tensor (when the shapes divide).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir

IMPLS = ("auto", "reference", "cudnn", "tokamax", "pallas")
PALLAS_BACKENDS = ("triton", "mosaic_tpu")
_KERNELS = "pallas_kernels.compact_attention"
_BLOCK_SPARSE = "pallas_kernels.block_sparse"


# ------------------------------------------------------------------------------------------------
# Mask description
# ------------------------------------------------------------------------------------------------

def _static(default=None):
  return dataclasses.field(default=default, metadata=dict(static=True))


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class BlockLists:
  """Per-(batch, head, query-block) kv block lists and per-head modes (impl='pallas' and 'auto'
  on GPU/TPU run pallas_kernels.block_sparse, whose tiles are these blocks).

  kv_blocks_BNQL: int32 [B, N, ceil(T / block_q), L]: the kv blocks (key slots
    [j * block_k, (j + 1) * block_k)) that query block i (query rows [i * block_q, ...)) of query
    head n may see; entries outside [0, ceil(S / block_k)) are padding (use -1).
  head_mode_BN: None (every head uses its list) or int32 [B, N]: HEAD_FULL (0) = the head ignores
    its list (full attention under the rest of the mask), HEAD_BLOCKS (1) = the head sees only its
    listed blocks. Lists never widen the rest of the mask (causal, documents, window, active).
  dense_full_heads (static): on cuda with impl='auto', a contiguous self-attention mask cuDNN can
    take otherwise (no documents, active set, window or sinks): the KV heads whose query heads are
    all HEAD_FULL run in ONE cuDNN causal call (gathered; its head count is the batch's largest
    count of such KV heads, picked at run time among K + 1 compiled variants), the other heads
    in the block-sparse launch (split_full_heads). Same result; faster where cuDNN outruns the
    block-sparse kernel's full heads (bench/results/elastic_prefill_*.json). Else ignored.
  """
  kv_blocks_BNQL: Any
  head_mode_BN: Any = None
  block_q: int = _static(128)
  block_k: int = _static(128)
  dense_full_heads: bool = _static(False)


HEAD_FULL, HEAD_BLOCKS = 0, 1


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True, eq=False)  # array fields: no elementwise ==
class MaskSpec:
  """Which (query, key) pairs are visible; a pytree (arrays are leaves, the rest is static).

  q_positions_BT, kv_positions_BS: int32 token positions; key visible when kv_pos <= q_pos.
  q_segment_ids_BT, kv_segment_ids_BS: None or int32 document ids; 0 = padding / empty cache
    slot, never attended (a query of segment 0 sees nothing). Both: same nonzero id. kv ids
    alone (a cache's validity): the query chunk is one document and sees every valid slot.
  window (static): keys q_pos - window + 1 .. q_pos only.
  sinks (static): keys with kv_pos < sinks of the same document stay visible outside the window
    (StreamingLLM sink tokens).
  active: None, bool [B, T] (per token: L2A) or bool [B, T, N] (per query head: AHA): the
    queries to compute; the others come back as zeros.
  block_lists: None or BlockLists (per-head kv block lists; see there).
  contiguous (static): the caller promises q and kv are the same tokens laid out contiguously,
    positions restarting at 0 in each document (so T == S, and segment ids both or neither);
    only then may cudnn / tokamax run. False for caches, decode, chunked prefill.
  """
  q_positions_BT: Any
  kv_positions_BS: Any
  q_segment_ids_BT: Any = None
  kv_segment_ids_BS: Any = None
  active: Any = None
  block_lists: BlockLists | None = None
  window: int | None = _static(None)
  sinks: int = _static(0)
  contiguous: bool = _static(False)

  def dense_mask(self):
    """bool [B, T, S], or [B, N, T, S] with a per-head active set or block lists."""
    ref = _kernel_module("reference")
    m = jax.tree.map(jnp.asarray, self)
    bl = m.block_lists
    return ref.dense_mask(
        m.q_positions_BT, m.kv_positions_BS, m.q_segment_ids_BT, m.kv_segment_ids_BS,
        window=m.window, sinks=m.sinks, active=m.active,
        kv_blocks_BNQL=None if bl is None else bl.kv_blocks_BNQL,
        head_mode_BN=None if bl is None else bl.head_mode_BN,
        block_q=None if bl is None else bl.block_q, block_k=None if bl is None else bl.block_k)


def _check(q, k, v, mask: MaskSpec):
  """One-line ValueErrors for malformed calls (shapes are static)."""
  if not isinstance(mask, MaskSpec):
    raise ValueError(f"ops.attention: mask must be an ops.MaskSpec, got {type(mask).__name__}")
  _kernel_module("reference").check_qkv(q, k, v)
  B, T, N, _ = q.shape
  S = k.shape[1]
  for name, shape in (("q_positions_BT", (B, T)), ("kv_positions_BS", (B, S)),
                      ("q_segment_ids_BT", (B, T)), ("kv_segment_ids_BS", (B, S))):
    x = getattr(mask, name)
    if x is None and "positions" in name:
      raise ValueError(f"ops.attention: MaskSpec.{name} is required")
    if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
      raise ValueError(f"MaskSpec.{name} must be an int array of shape {shape}; got {x.dtype} "
                       f"{x.shape}")
  if mask.q_segment_ids_BT is not None and mask.kv_segment_ids_BS is None:
    raise ValueError("MaskSpec: q_segment_ids_BT without kv_segment_ids_BS; give kv ids too "
                     "(kv ids alone mean a cache's validity)")
  a = mask.active
  if a is not None and (a.dtype != jnp.bool_ or a.shape not in ((B, T), (B, T, N))):
    raise ValueError(f"MaskSpec.active must be bool [B, T]={(B, T)} or [B, T, N]={(B, T, N)}; "
                     f"got {a.dtype} {a.shape}")
  if mask.window is not None and (int(mask.window) != mask.window or mask.window < 1):
    raise ValueError(f"MaskSpec.window must be an int >= 1 or None, got {mask.window!r}")
  if int(mask.sinks) != mask.sinks or mask.sinks < 0:
    raise ValueError(f"MaskSpec.sinks must be an int >= 0, got {mask.sinks!r}")
  if mask.contiguous:
    if T != S:
      raise ValueError(f"MaskSpec.contiguous=True promises q and kv are the same tokens, but "
                       f"T={T} != S={S}; set contiguous=False")
    if (mask.q_segment_ids_BT is None) != (mask.kv_segment_ids_BS is None):
      raise ValueError("MaskSpec.contiguous=True needs q_segment_ids_BT and kv_segment_ids_BS "
                       "both (the same ids) or neither")
  bl = mask.block_lists
  if bl is not None:
    nq = -(-T // bl.block_q)
    kb = bl.kv_blocks_BNQL
    if kb.ndim != 4 or kb.shape[:3] != (B, N, nq) or not jnp.issubdtype(kb.dtype, jnp.integer):
      raise ValueError(f"BlockLists.kv_blocks_BNQL must be int [B, N, ceil(T/block_q), L] = "
                       f"[{B}, {N}, {nq}, L]; got {kb.dtype} {kb.shape}")
    if bl.head_mode_BN is not None and bl.head_mode_BN.shape != (B, N):
      raise ValueError(f"BlockLists.head_mode_BN must be [B, N] = {(B, N)}; got "
                       f"{bl.head_mode_BN.shape}")


# ------------------------------------------------------------------------------------------------
# The kernel package (loud import) and what each implementation can take
# ------------------------------------------------------------------------------------------------

def _kernel_module(sub: str | None = None, package: str = _KERNELS):
  """pallas_kernels.compact_attention (or `package`), or its submodule `sub`; an import failure
  is an error."""
  name = package if sub is None else f"{package}.{sub}"
  try:
    return importlib.import_module(name)
  except ImportError as e:
    raise ImportError(f"condattn_jax.ops needs {name} (the attention kernels and the reference "
                      f"live there) but importing it failed: {e!r}; fix that import (install the "
                      "repo with `pip install -e .`)") from e


def _fused_reasons(q, mask: MaskSpec) -> list[str]:
  """Why cudnn / tokamax cannot take the call (empty: they can)."""
  why = []
  if not mask.contiguous:
    why.append("the mask is not contiguous self-attention (MaskSpec.contiguous=False: cache, "
               "decode or chunked-prefill layout)")
  if mask.active is not None:
    why.append("an active set (MaskSpec.active) needs impl='pallas'")
  if mask.sinks:
    why.append("sink tokens (MaskSpec.sinks) are not supported")
  if mask.block_lists is not None:
    why.append("block lists (MaskSpec.block_lists) are not supported")
  return why


def _cudnn_reasons(q, mask: MaskSpec) -> list[str]:
  why = _fused_reasons(q, mask)
  if mask.kv_segment_ids_BS is not None:
    why.append("packed segment ids (use impl='tokamax')")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    why.append(f"dtype {q.dtype} (cuDNN needs bfloat16 or float16)")
  H = q.shape[-1]
  if H % 8 or H > 256:
    why.append(f"head_dim {H} (cuDNN needs a multiple of 8, <= 256)")
  return why


def _pallas_reasons(mask: MaskSpec) -> list[str]:
  if mask.block_lists is not None:  # the block-sparse kernel takes every MaskSpec field
    return []
  why = []
  if mask.sinks:
    why.append("sink tokens (MaskSpec.sinks): the compacted kernel has no sink mask")
  return why


def _cudnn_available() -> str | None:
  """None if cuDNN attention can be traced in this process, else why not."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    fa.check_cudnn_version()
  except (ImportError, RuntimeError) as e:
    return f"cuDNN is not available in this process ({e})"
  return None


# ------------------------------------------------------------------------------------------------
# Platforms
# ------------------------------------------------------------------------------------------------

_GPU = ("cuda", "rocm")


def _host_platforms() -> set[str]:
  """Lowering platforms whose kernels this process can trace: its default backend's, plus the
  platform of the abstract device of the current abstract mesh (cross-lowering)."""
  plats = set()
  backend = jax.default_backend()
  if backend == "gpu":
    from jax.extend import backend as jex_backend
    plats.add("rocm" if "rocm" in jex_backend.get_backend().platform_version.lower() else "cuda")
  elif backend == "tpu":
    plats.add("tpu")
  dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if dev is not None:
    if dev.platform in ("gpu", *_GPU):
      amd = dev.platform == "rocm" or "amd" in str(dev.device_kind).lower()
      plats.add("rocm" if amd else "cuda")
    else:
      plats.add(dev.platform)
  return plats


@contextlib.contextmanager
def _tracing_for(platform: str):
  """Trace kernel code for `platform` on a host of another backend (cross-lowering).

  TEMPORARY: pallas_kernels.compact_attention checks jax.default_backend() at trace time
  (`api._default_platform`); until it takes the lowering platform, swap that check for the
  branch being traced. tokamax gets its documented cross_compile switch."""
  kind = "gpu" if platform in _GPU else platform
  if jax.default_backend() == kind:
    yield
    return
  api = _kernel_module("api")
  if not hasattr(api, "_default_platform"):  # the kernel package no longer checks the host
    yield
    return
  saved = api._default_platform
  api._default_platform = lambda: kind
  try:
    cross = contextlib.nullcontext()
    if kind == "gpu":  # tokamax (GPU only) gets its documented cross-compile switch
      try:
        import tokamax.config
        cross = tokamax.config.cross_compile(True)
      except ImportError:  # no tokamax: its branch raises NotImplementedError, auto moves on
        pass
    with cross:
      yield
  finally:
    api._default_platform = saved


_unavailable_p = jex_core.Primitive("condattn_attention_unavailable")
_unavailable_p.def_abstract_eval(lambda x, *, msg, aval: aval)


def _lower_unavailable(ctx, x, *, msg, aval):
  raise ValueError(msg)


mlir.register_lowering(_unavailable_p, _lower_unavailable)


def _unavailable(msg: str):
  """A branch that traces anywhere and whose lowering raises `msg` (never a wrong kernel)."""
  def branch(q, k, v, mask):
    avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]

    @jax.custom_vjp
    def f(q, k, v):
      return _unavailable_p.bind(q, msg=msg, aval=avals[0])

    def fwd(q, k, v):
      return f(q, k, v), None

    def bwd(_, ct):
      return tuple(_unavailable_p.bind(ct, msg=msg, aval=a) for a in avals)

    f.defvjp(fwd, bwd)
    return f(q, k, v)
  return branch


def _cross_lowering_msg(platform: str, what: str) -> str:
  return (f"ops.attention: cannot lower {what} for {platform!r}: it was traced in a process whose "
          f"backend is {jax.default_backend()!r}. Trace on a {platform} host, or cross-lower under "
          "jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice("
          f"device_kind=..., num_cores=..., platform={'gpu' if platform in _GPU else platform!r})))")


def _for_platform(platform: str, branch, what: str):
  """`branch` traced as for `platform` if this process can lower for it, else a placeholder."""
  if platform not in _host_platforms():
    return _unavailable(_cross_lowering_msg(platform, what))

  def traced(*args):
    with _tracing_for(platform):
      return branch(*args)
  return traced


# ------------------------------------------------------------------------------------------------
# Per-shard execution under a mesh
# ------------------------------------------------------------------------------------------------

_BATCH_AXES = ("data", "fsdp")
_HEAD_AXIS = "tensor"


def _mesh_shards(B: int, N: int, K: int):
  """(mesh, batch axes, head axis) to run a kernel per shard on, or None (no / trivial mesh,
  axes already manual, or shapes the mesh does not divide)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size <= 1:
    return None
  usable = {a: n for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
            if t != jax.sharding.AxisType.Manual and n > 1}
  batch = tuple(a for a in _BATCH_AXES if a in usable)
  head = _HEAD_AXIS if _HEAD_AXIS in usable else None
  nb = 1
  for a in batch:
    nb *= usable[a]
  if B % nb or (head is not None and (N % usable[head] or K % usable[head])):
    return None
  if not batch and head is None:
    return None
  return mesh, (batch or None), head


def _per_shard(fn):
  """fn(q, k, v, mask) run per shard under the current mesh (batch over data/fsdp, heads over
  tensor), or as is when there is no usable mesh."""
  def run(q, k, v, mask):
    where = _mesh_shards(q.shape[0], q.shape[2], k.shape[2])
    if where is None:
      return fn(q, k, v, mask)
    mesh, batch, head = where
    P = jax.sharding.PartitionSpec
    heads, rows = P(batch, None, head, None), P(batch, None)
    act = mask.active
    bl = mask.block_lists
    mspec = dataclasses.replace(
        mask, q_positions_BT=rows, kv_positions_BS=rows,
        q_segment_ids_BT=None if mask.q_segment_ids_BT is None else rows,
        kv_segment_ids_BS=None if mask.kv_segment_ids_BS is None else rows,
        active=None if act is None else (rows if act.ndim == 2 else P(batch, None, head)),
        block_lists=None if bl is None else dataclasses.replace(
            bl, kv_blocks_BNQL=P(batch, head, None, None),
            head_mode_BN=None if bl.head_mode_BN is None else P(batch, head)))
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, mspec), out_specs=heads,
                         check_vma=False)(q, k, v, mask)
  return run


# ------------------------------------------------------------------------------------------------
# Implementations: fn(q, k, v, mask) -> out, for one lowering platform each
# ------------------------------------------------------------------------------------------------

def _reference(scale):
  ref = _kernel_module("reference")

  def fn(q, k, v, mask):
    return ref.reference_attention(q, k, v, mask.dense_mask(), scale=scale)[0]
  return fn


def _cudnn(scale):
  def fn(q, k, v, mask):
    local = None if mask.window is None else (mask.window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=local, implementation="cudnn")
  return fn


def _segment_starts(segment_ids_BT):
  """Index of the first token of each token's (contiguous) document."""
  T = segment_ids_BT.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)[None, :]
  prev = jnp.concatenate([jnp.full_like(segment_ids_BT[:, :1], -1), segment_ids_BT[:, :-1]], axis=1)
  return lax.cummax(jnp.where(segment_ids_BT != prev, idx, 0), axis=1)


def _cross_compiled(op):
  """A tokamax op (and its VJP op, which runs at transpose time, outside _tracing_for) without
  the check that this process has the op's device: for cross-lowering from another host."""
  vjp = getattr(op, "vjp", None)
  if vjp is not None and hasattr(vjp, "bypass_device_check"):
    op = dataclasses.replace(op, vjp=dataclasses.replace(vjp, bypass_device_check=True))
  return dataclasses.replace(op, bypass_device_check=True)


def _tokamax(scale, kernels: tuple[str, ...]):
  """tokamax attention with a per-query k_start (document start, window) and a causal mask; the
  first of `kernels` that takes the shape runs. Padding queries (segment 0) give zeros."""
  def fn(q, k, v, mask):
    try:  # lazy: heavy, only the fused path needs it
      from tokamax._src.ops.attention import api, base
    except ImportError as e:  # auto moves on to the compacted kernel; explicit impl names this
      raise NotImplementedError(f"tokamax cannot be imported ({e}); pip install tokamax==0.0.17 "
                                "(or use impl='auto' / 'pallas')") from e
    B, T = q.shape[:2]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    seg = mask.q_segment_ids_BT
    start = jnp.zeros((B, T), jnp.int32) if seg is None else _segment_starts(seg)
    if mask.window is not None:
      start = jnp.maximum(start, idx - mask.window + 1)
    tmask = base.Mask(k_start=start[:, None, :], is_causal=True)
    kw = {} if scale is None else dict(logits_scale=scale)
    errors = []
    for name in kernels:
      op = api.IMPLEMENTATIONS[name]
      if jax.default_backend() != "gpu" and name != "xla":
        op = _cross_compiled(op)
      try:
        out = op(q, k, v, mask=tmask, **kw)
      except NotImplementedError as e:  # this kernel cannot take the shape: try the next one
        errors.append(f"{name}: {e}")
        continue
      return out if seg is None else jnp.where((seg != 0)[:, :, None, None], out, 0).astype(q.dtype)
    raise NotImplementedError("no tokamax kernel took this call: " + "; ".join(errors))
  return fn


def _pallas(scale, kernel_impl: str, interpret: Any = False):
  """pallas_kernels.compact_attention with an all-true active set when none is given."""
  def fn(q, k, v, mask):
    kernel = _kernel_module().compact_attention
    B, T = q.shape[:2]
    active = jnp.ones((B, T), jnp.bool_) if mask.active is None else mask.active
    qseg, kvseg = mask.q_segment_ids_BT, mask.kv_segment_ids_BS
    if qseg is None and kvseg is not None:  # a cache's validity: the chunk is one document
      kvseg = (kvseg != 0).astype(jnp.int32)
      qseg = jnp.ones((B, T), jnp.int32)
    qpos, kvpos = mask.q_positions_BT, mask.kv_positions_BS
    if mask.contiguous and kvseg is None:  # one document per row: positions are arange(T)
      qpos = kvpos = None
    return kernel(q, k, v, active, q_positions_BT=qpos, kv_positions_BS=kvpos,
                  q_segment_ids_BT=qseg, kv_segment_ids_BS=kvseg, window=mask.window, scale=scale,
                  impl=kernel_impl, interpret=interpret)
  return fn


def _block_sparse(scale, kernel_impl: str, interpret: Any = False):
  """pallas_kernels.block_sparse for a mask with block lists (its tiles are the lists' blocks)."""
  def fn(q, k, v, mask):
    bl = mask.block_lists
    return _kernel_module(package=_BLOCK_SPARSE).block_sparse_attention(
        q, k, v, bl.kv_blocks_BNQL, bl.head_mode_BN, block_q=bl.block_q, block_k=bl.block_k,
        q_positions_BT=mask.q_positions_BT, kv_positions_BS=mask.kv_positions_BS,
        q_segment_ids_BT=mask.q_segment_ids_BT, kv_segment_ids_BS=mask.kv_segment_ids_BS,
        window=mask.window, sinks=mask.sinks, active=mask.active, scale=scale,
        impl=kernel_impl, interpret=interpret)
  return fn


def split_full_heads(q, k, v, mask: MaskSpec, dense_fn, sparse_fn):
  """Attention under `mask` (block lists with head modes) as two kernels: the KV heads whose G
  query heads are all HEAD_FULL through dense_fn(q_BTMH, k_BSCH, v_BSCH, mask without block
  lists) over C gathered KV heads (M = C * G query heads), the rest through sparse_fn(q, k, v,
  mask) with those heads' lists emptied (no work). C = the batch's largest count of such KV
  heads, a run-time value: lax.switch over the K + 1 static head counts (rows with fewer take
  other KV heads into the spare slots, computed and discarded)."""
  bl = mask.block_lists
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  full_BK = jnp.all(bl.head_mode_BN.reshape(B, K, G) == HEAD_FULL, axis=-1)
  full_BN = jnp.repeat(full_BK, G, axis=1)
  order_BK = jnp.argsort(1 - full_BK.astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
  slot_BK = jnp.argsort(order_BK, axis=1).astype(jnp.int32)     # kv head -> its dense slot
  g_N = jnp.tile(jnp.arange(G, dtype=jnp.int32), K)
  out_idx_BN = jnp.repeat(slot_BK, G, axis=1) * G + g_N[None, :]
  lists_off = dataclasses.replace(mask, block_lists=None)

  def dense_with(C):
    def branch(q, k, v):
      if C == 0:
        return jnp.zeros(q.shape, q.dtype)
      pick_BC = order_BK[:, :C]
      q_idx = (pick_BC[:, :, None] * G + jnp.arange(G, dtype=jnp.int32)).reshape(B, C * G)
      qd = jnp.take_along_axis(q, q_idx[:, None, :, None], axis=2)
      kd = jnp.take_along_axis(k, pick_BC[:, None, :, None], axis=2)
      vd = jnp.take_along_axis(v, pick_BC[:, None, :, None], axis=2)
      od = dense_fn(qd, kd, vd, lists_off)                       # [B, T, C * G, H]
      idx = jnp.minimum(out_idx_BN, C * G - 1)
      return jnp.take_along_axis(od, idx[:, None, :, None], axis=2)
    return branch

  C_run = jnp.max(jnp.sum(full_BK, axis=1)).astype(jnp.int32)
  out_dense = lax.switch(C_run, [dense_with(C) for C in range(K + 1)], q, k, v)
  sparse_lists = jnp.where(full_BN[:, :, None, None], -1, bl.kv_blocks_BNQL)
  sparse_mode = jnp.where(full_BN, HEAD_BLOCKS, bl.head_mode_BN).astype(jnp.int32)
  sparse_mask = dataclasses.replace(mask, block_lists=dataclasses.replace(
      bl, kv_blocks_BNQL=sparse_lists, head_mode_BN=sparse_mode))
  out_sparse = sparse_fn(q, k, v, sparse_mask)
  return jnp.where(full_BN[:, None, :, None], out_dense, out_sparse)


def _splits_full_heads(q, mask: MaskSpec) -> bool:
  """Whether auto on cuda runs `mask` through split_full_heads with cuDNN (see BlockLists)."""
  bl = mask.block_lists
  if bl is None or not bl.dense_full_heads or bl.head_mode_BN is None:
    return False
  dense = dataclasses.replace(mask, block_lists=None)
  return (not _cudnn_reasons(q, dense) and dense.window is None
          and _cudnn_available() is None)


@functools.cache
def _warn_once(msg):
  logging.warning(msg)


def _no_kernel(scale, platform):
  """The reference where no kernel takes the mask yet (warned once)."""
  ref = _reference(scale)

  def fn(q, k, v, mask):
    _warn_once(f"ops.attention(impl='auto') on {platform}: no kernel takes "
               f"{'; '.join(_pallas_reasons(mask))}; using the O(T*S) reference.")
    return ref(q, k, v, mask)
  return fn


def _auto_gpu(scale, platform):
  """cuda/rocm: cudnn (unpacked) or tokamax (packed) for contiguous self-attention, else the
  compacted Pallas kernel (its own 'auto' picks the GPU kernel; a shape it cannot take falls to
  its reference with a warning)."""
  pallas = _per_shard(_pallas(scale, "auto"))
  block_sparse = _per_shard(_block_sparse(scale, "auto"))
  cudnn, tok = _cudnn(scale), _per_shard(_tokamax(scale, ("mosaic_gpu", "triton")))
  split = _per_shard(functools.partial(split_full_heads, dense_fn=cudnn,
                                       sparse_fn=_block_sparse(scale, "auto")))

  def fn(q, k, v, mask):
    if platform == "cuda" and _splits_full_heads(q, mask):
      return split(q, k, v, mask)
    if platform == "cuda" and not _fused_reasons(q, mask):
      if not _cudnn_reasons(q, mask) and _cudnn_available() is None:
        try:
          return cudnn(q, k, v, mask)
        except NotImplementedError:  # this GPU / cuDNN cannot take the shape
          pass
      # Packed documents with a window: tokamax turns the window into a per-query k_start that
      # its backward masks but does not skip (every causal tile is visited: 317 vs 23 ms per
      # layer at 128K, bench/results/e2e_NVIDIA_H200.json), while the compacted kernel's tile
      # bounds stop at the window. tokamax stays for causal packed documents.
      if mask.window is None or _pallas_reasons(mask):
        try:
          return tok(q, k, v, mask)
        except NotImplementedError:
          pass
    if mask.block_lists is not None:
      return block_sparse(q, k, v, mask)
    if _pallas_reasons(mask):
      return _no_kernel(scale, platform)(q, k, v, mask)
    return pallas(q, k, v, mask)
  return fn


def _auto_tpu(scale):
  pallas = _per_shard(_pallas(scale, "auto"))
  block_sparse = _per_shard(_block_sparse(scale, "auto"))

  def fn(q, k, v, mask):
    if mask.block_lists is not None:
      return block_sparse(q, k, v, mask)
    if _pallas_reasons(mask):
      return _no_kernel(scale, "tpu")(q, k, v, mask)
    return pallas(q, k, v, mask)
  return fn


def _explicit_error(impl, why):
  return ValueError(f"ops.attention impl={impl!r} cannot take this call: {'; '.join(why)}. "
                    "Use impl='auto' (or 'reference').")


def _branches(impl: str, q, mask: MaskSpec, scale, pallas_backend):
  """{lowering platform or 'default': fn(q, k, v, mask)} for `impl`; raises for calls it cannot
  take."""
  if impl == "auto":
    return dict(default=_reference(scale),
                cuda=_for_platform("cuda", _auto_gpu(scale, "cuda"), "ops.attention"),
                rocm=_for_platform("rocm", _auto_gpu(scale, "rocm"), "ops.attention"),
                tpu=_for_platform("tpu", _auto_tpu(scale), "ops.attention"))
  if impl == "reference":
    return dict(default=_reference(scale))
  if impl == "cudnn":
    why = _cudnn_reasons(q, mask)
    if not why and (unavailable := _cudnn_available()) is not None:
      why = [unavailable + "; trace on a CUDA GPU host"]
    if why:
      raise _explicit_error(impl, why)
    return dict(default=_cudnn(scale))
  if impl == "tokamax":
    if why := _fused_reasons(q, mask):
      raise _explicit_error(impl, why)
    gpu = _per_shard(_tokamax(scale, ("mosaic_gpu", "triton")))

    def on_gpu(*args):
      try:
        return gpu(*args)
      except NotImplementedError as e:
        raise _explicit_error(impl, [str(e)]) from e
    return dict(default=_per_shard(_tokamax(scale, ("xla",))),
                cuda=_for_platform("cuda", on_gpu, "impl='tokamax'"))
  if impl == "pallas":
    if why := _pallas_reasons(mask):
      raise _explicit_error(impl, why)
    if pallas_backend not in (None, *PALLAS_BACKENDS):
      raise ValueError(f"ops.attention: pallas_backend={pallas_backend!r}; choose one of "
                       f"{PALLAS_BACKENDS} (or None)")
    if pallas_backend == "mosaic_tpu":
      from jax.experimental.pallas import tpu as pltpu
      interpret = pltpu.InterpretParams()
    else:
      interpret = True

    make = _pallas if mask.block_lists is None else _block_sparse

    def kernel(kernel_impl, interpret=False):
      fn = _per_shard(make(scale, kernel_impl, interpret))

      def named(*args):  # the kernel's own ValueError (e.g. a head_dim it cannot take)
        try:
          return fn(*args)
        except ValueError as e:
          raise _explicit_error(impl, [str(e)]) from e
      return named
    return dict(default=kernel(pallas_backend or "triton", interpret),
                cuda=_for_platform("cuda", kernel("triton"), "impl='pallas'"),
                rocm=_for_platform("rocm", kernel("triton"), "impl='pallas'"),
                tpu=_for_platform("tpu", kernel("mosaic_tpu"), "impl='pallas'"))
  raise ValueError(f"ops.attention: unknown impl {impl!r}; choose one of {IMPLS}")


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------

def attention(q_BTNH, k_BSKH, v_BSKH, mask: MaskSpec, *, impl: str = "auto",
              scale: float | None = None, pallas_backend: str | None = None):
  """Attention out[B, T, N, H] (q's dtype) under `mask` (an ops.MaskSpec).

  q_BTNH: queries; k_BSKH, v_BSKH: keys / values with K kv heads (N % K == 0; grouped-query
  attention without repeating K/V). Queries that see no key (padding, inactive, empty window)
  give zeros. impl: see the module docstring. scale: logits scale (default H ** -0.5).
  pallas_backend: for impl='pallas' off GPU/TPU, the kernel run in Pallas interpret mode:
  'triton' (default) or 'mosaic_tpu'.
  """
  if not isinstance(mask, MaskSpec):
    raise TypeError(f"ops.attention: mask must be an ops.MaskSpec, got {type(mask).__name__}")
  q, k, v = map(jnp.asarray, (q_BTNH, k_BSKH, v_BSKH))
  mask = jax.tree.map(jnp.asarray, mask)
  _check(q, k, v, mask)
  branches = _branches(impl, q, mask, scale, pallas_backend)
  default = branches.pop("default")
  if not branches:
    return default(q, k, v, mask)
  return lax.platform_dependent(q, k, v, mask, default=default, **branches)
