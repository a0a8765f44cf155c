"""Context parallelism: a row's tokens split over the `sequence` mesh axis.

The mesh axis is the one the logical-axis rules table (condattn_jax/train/sharding.py) gives
`activation_length`; every per-token op (embedding, norms, projections, RoPE, MLP, router, CE)
is sharded over it by GSPMD from the activations' logical constraints. Only attention mixes
tokens; `ops.attention` hands a contiguous self-attention call (MaskSpec.contiguous=True) made
under such a mesh to `attention` here, which runs it per shard in jax.shard_map over the
batch, sequence and head axes of the rules table.

Layout (load-balanced causal, "zigzag" / MaxText's dual chunk swap). With n sequence shards a
row is cut into 2n chunks of C = T / 2n tokens and shard i holds chunks i and 2n-1-i, so every
shard has the same causal work. `to_layout` applies the permutation once to a batch's [B, T]
arrays (inputs, positions, segment ids, targets: the train / eval steps do it in
`train.step.forward_ce`) and `from_layout` undoes it on per-token outputs (the CE). Masks are
built from the permuted positions and segment ids (global positions), so every visibility rule
(causal, documents, window, sinks, active set) holds whatever order the tokens are in. A
layer that reads its row by token index asks `layout_size()` (n inside the step's layout, else
1) and uses from_layout / to_layout itself.

Attention per shard (the local queries: [B_shard, T / n, N_shard, H]):
  all_gather (default)  K/V, kv positions and kv segment ids all-gathered over `sequence`; the
                        local queries attend to them through `ops.attention` (impl as asked:
                        the reference on CPU, the compacted Pallas kernel on GPU / TPU). An
                        active set (L2A, AHA) stays local: each shard compacts its OWN routed
                        queries; shapes are static per shard, so every shard runs the same tile
                        counts. In the zigzag layout the gathered row is put back in natural
                        order (`natural_order`): sorted kv positions, so the kernels' per-tile
                        bounds skip every future tile. Backward: the all-gather's transpose
                        (reduce-scatter of dK/dV).
  ring                  K/V (and their positions / ids) passed around the axis with ppermute,
                        n steps; each step's block attention is ops' reference attention
                        (pallas_kernels/compact_attention/reference.py, out and lse) merged by
                        online softmax. O((T / n)^2) per step, no kernel yet: for long rows use
                        all_gather on GPU / TPU.
  window (local attn)   when the zigzag layout is in force (`zigzag_layout`), window - 1 <= C and
                        no sinks: a halo exchange: each chunk gets the last window - 1 tokens of
                        the chunk before it (chunk i's from shard i-1, chunk 2n-1-i's from shard
                        i+1, shard n-1's second chunk from its own first; by ppermute, or by an
                        all-gather of the tails: `halo_exchange`), and attends over
                        [halo ; chunk] (the halo rounded up so that it plus the chunk is a
                        multiple of 128 where a chunk holds that: the kernels' tile; the extra
                        keys are outside the window). Otherwise the strategy above (correct
                        for any window).
  block lists           (MaskSpec.block_lists: per head and query block, the kv blocks it
                        may see) take the all_gather path whatever the strategy: the lists'
                        query-block axis is laid out like the tokens (`to_layout(lists, n,
                        axis=2)` of the natural row's lists; block_q must divide a chunk, so
                        each shard holds whole query blocks) and split with them; their kv
                        entries are blocks of the natural row, which the gathered K/V are in.
Queries that see no key (padding, inactive, fully masked ring steps or shards) give zeros,
never NaN.

The kernel is ops' branch for the platform this process lowers for (its GPU / TPU, or the
abstract device of a cross-lowering mesh), picked at trace time: a lowering-time switch between
the reference and the kernel keeps the reference's zero-filled residuals under jax.grad here.

`strategy(name)` sets the global-attention strategy for what is traced inside it
(`sharding.mesh_context(..., sequence_attention=config.mesh.sequence_attention)`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from condattn_jax import ops

STRATEGIES = ("all_gather", "ring")
HALO_EXCHANGES = ("ppermute", "all_gather")  # how the window's halo moves (`halo_exchange`)
LAYOUT_KEYS = ("inputs", "positions", "segment_ids", "targets")  # the [B, T] entries forward_ce reads

_strategy = contextvars.ContextVar("condattn_sequence_attention", default="all_gather")
_zigzag = contextvars.ContextVar("condattn_zigzag_layout", default=False)
_halo_exchange = contextvars.ContextVar("condattn_halo_exchange", default="ppermute")


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value):
  """`var` holds `value` for what is traced inside (the settings below)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def strategy(name: str):
  """Global attention over `sequence` runs as `name` ('all_gather' | 'ring') inside."""
  if name not in STRATEGIES:
    raise ValueError(f"config.mesh.sequence_attention={name!r}: choose one of {STRATEGIES}.")
  return _set(_strategy, name)


def zigzag_layout(on: bool = True):
  """Declares that the rows traced inside are in the zigzag layout (`to_layout`): local window
  attention may then use the halo exchange."""
  return _set(_zigzag, bool(on))


def halo_exchange(name: str):
  """The window's halo moves by `name` for what is traced inside: 'ppermute' (default: two
  collective-permutes along the chain of shards per tensor, the halo's bytes only) or
  'all_gather' (every shard's two chunk tails all-gathered, each shard picks its neighbours':
  n x the halo's bytes, but the step then holds no collective-permute, only the all-gather /
  reduce-scatter kind the global branch already issues; bench/scale.py --halo_exchange)."""
  if name not in HALO_EXCHANGES:
    raise ValueError(f"halo_exchange={name!r}: choose one of {HALO_EXCHANGES}.")
  return _set(_halo_exchange, name)


def check_config(config, n: int) -> None:
  """A run config against n sequence shards (config.mesh.sequence, or the size the mesh gave
  it): one-line ValueErrors naming the field. n <= 1 (or -1 before the mesh is built) checks only
  the strategy."""
  name = str(config.mesh.get("sequence_attention", "all_gather"))
  if name not in STRATEGIES:
    raise ValueError(f"config.mesh.sequence_attention={name!r}: choose one of {STRATEGIES}.")
  if n <= 1:
    return
  from condattn_jax.attention import get_scheme
  scheme = get_scheme(config.model.scheme.name)
  if scheme.sequence_parallel is not True:
    why = (scheme.sequence_parallel if isinstance(scheme.sequence_parallel, str)
           else "it does not declare Scheme.sequence_parallel (its layers were not checked "
                "against the unsharded model with rows split over devices)")
    raise ValueError(f"config.mesh.sequence={n}: scheme {scheme.name!r} does not run "
                     f"sequence-parallel: {why}; set config.mesh.sequence=1.")
  lengths = [int(config.data.seq_len)] + [int(L) for L in (config.eval.context_lengths or ())]
  for what, L in zip(["data.seq_len"] + ["eval.context_lengths"] * (len(lengths) - 1), lengths):
    if L % (2 * n):
      raise ValueError(f"config.{what} has {L} tokens: with config.mesh.sequence={n} a row is cut "
                       f"into 2 x {n} chunks (zigzag layout), so it must be a multiple of {2 * n}.")


# ------------------------------------------------------------------------------------------------
# The sequence axis of the current mesh
# ------------------------------------------------------------------------------------------------

def sequence_axis() -> str | None:
  """The mesh axis the rules table gives `activation_length` (None: not sharded)."""
  from condattn_jax.train import sharding
  ax = dict(sharding.RULES).get("activation_length")
  if isinstance(ax, (tuple, list)):
    if len(ax) != 1:
      raise ValueError(f"sharding.RULES: activation_length -> {ax}: context parallelism takes one "
                       "mesh axis")
    ax = ax[0]
  return ax


def sequence_shards():
  """(abstract mesh, sequence axis, size) when the current mesh splits rows over the sequence
  axis (present, size > 1, not already manual), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  ax = sequence_axis()
  if mesh is None or mesh.empty or ax is None or ax not in mesh.axis_names:
    return None
  i = mesh.axis_names.index(ax)
  n = mesh.axis_sizes[i]
  if n <= 1 or mesh.axis_types[i] == jax.sharding.AxisType.Manual:
    return None
  return mesh, ax, n


def sequence_size() -> int:
  """Shards of a row under the current mesh (1: none)."""
  s = sequence_shards()
  return 1 if s is None else s[2]


# ------------------------------------------------------------------------------------------------
# The zigzag layout
# ------------------------------------------------------------------------------------------------

def zigzag_order(T: int, n: int) -> np.ndarray:
  """int [T]: the natural index of each layout slot (shard i holds chunks i and 2n-1-i)."""
  if T % (2 * n):
    raise ValueError(f"sequence parallelism over {n} shards cuts a row into 2 x {n} chunks: "
                     f"the row length {T} must be a multiple of {2 * n} (data.seq_len and "
                     "eval.context_lengths).")
  C = T // (2 * n)
  chunks = np.arange(T).reshape(2 * n, C)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def to_layout(x, n: int, axis: int = 1):
  """x with its token axis in the zigzag layout for n shards (x itself for n = 1)."""
  if n == 1:
    return x
  return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], n)), axis=axis)


def from_layout(x, n: int, axis: int = 1):
  """Undoes `to_layout` (None stays None: an optional field)."""
  if n == 1 or x is None:
    return x
  inv = np.argsort(zigzag_order(x.shape[axis], n))
  return jnp.take(x, jnp.asarray(inv), axis=axis)


def layout_size() -> int:
  """n when the rows traced here are in the zigzag layout for n sequence shards (a layer inside
  the train / eval step's forward under a sequence mesh), else 1. A layer that reads its row by
  token index (pools the first / last tokens, scores the natural row's blocks) takes it back
  with `from_layout(x, layout_size())` and lays per-query-block results (block lists) out again
  with `to_layout(lists, layout_size(), axis=2)`."""
  n = sequence_size()
  return n if n > 1 and _zigzag.get() else 1


def batch_to_layout(batch: dict, n: int) -> dict:
  """The batch with its LAYOUT_KEYS in the zigzag layout (other entries untouched)."""
  return {k: (to_layout(v, n) if k in LAYOUT_KEYS and v is not None else v)
          for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------
# Attention per shard
# ------------------------------------------------------------------------------------------------

def applies(mask: ops.MaskSpec) -> bool:
  """True when `ops.attention` must run this call sequence-parallel: contiguous self-attention
  traced under a mesh whose sequence axis splits rows."""
  return bool(mask.contiguous) and sequence_shards() is not None


def _shard_axes(mesh, B: int, N: int, K: int):
  """(batch mesh axes or None, head mesh axis or None) of attention's activations (rules
  table) that are not manual here and divide the shapes. Size-1 axes are always named: an axis
  the specs leave out is one the inputs are replicated over, and shard_map's transpose sums
  their cotangents over it (an all-reduce of dQ / dK / dV per attention call, over groups of
  one device when the axis has size 1)."""
  batch_axes, head_axis = ops._activation_axes()
  sizes = {a: n for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
           if t != jax.sharding.AxisType.Manual}
  batch = tuple(a for a in batch_axes if a in sizes)
  if B % int(np.prod([sizes[a] for a in batch])):
    batch = tuple(a for a in batch if sizes[a] == 1)
  head = head_axis if head_axis in sizes else None
  if head is not None and (N % sizes[head] or K % sizes[head]):
    head = None
  return (batch or None), head


def _local_mask(mask, kv_positions, kv_segment_ids, **kw):
  return ops.MaskSpec(q_positions_BT=mask.q_positions_BT, kv_positions_BS=kv_positions,
                      q_segment_ids_BT=mask.q_segment_ids_BT, kv_segment_ids_BS=kv_segment_ids,
                      active=mask.active, window=mask.window, sinks=mask.sinks, contiguous=False,
                      block_lists=mask.block_lists, **kw)


def natural_order(x, n: int):
  """A whole row in the zigzag layout (e.g. all-gathered over n shards: shard i's chunks i and
  2n-1-i, shard after shard) in natural token order, along axis 1. Static slices, a reverse and
  a concatenation: its transpose (the backward of the gathered K/V) is one too, no scatter."""
  B, T = x.shape[:2]
  x5 = x.reshape(B, n, 2, T // (2 * n), *x.shape[2:])
  first, second = x5[:, :, 0], x5[:, ::-1, 1]  # chunks 0..n-1; n..2n-1 (shard n-1 holds n)
  return jnp.concatenate([first, second], axis=1).reshape(x.shape)


def _all_gather(ax, n, local, zigzag: bool):
  """K/V gathered over the axis. Rows in the zigzag layout are put back in natural token order
  first: the kernels skip kv tiles outside [first, last) visible tile of a query tile, and in the
  gathered zigzag order a first-half chunk's keys interleave with future chunks (masked tiles
  inside the range): the last shard would walk 4n - 1 chunks of keys for its 2n + 1 visible ones
  (tests/train/test_context_parallel.py counts the kernels' tile bounds)."""
  def fn(q, k, v, mask):
    def g(x):
      if x is None:
        return None
      x = lax.all_gather(x, ax, axis=1, tiled=True)
      return natural_order(x, n) if zigzag else x
    m = _local_mask(mask, g(mask.kv_positions_BS), g(mask.kv_segment_ids_BS))
    return local(q, g(k), g(v), m)
  return fn


def _merge(o_a, lse_a, o_b, lse_b):
  """Online-softmax merge of two partial attentions (out normalised per part, lse [B, T, N])."""
  return ops.merge_attention_parts(jnp.stack([o_a, o_b]), jnp.stack([lse_a, lse_b]), axis=0)


def _ring(ax, n, scale):
  ref = ops._kernel_module("reference")

  def fn(q, k, v, mask):
    perm = [(j, (j + 1) % n) for j in range(n)]
    kv = (k, v, mask.kv_positions_BS, mask.kv_segment_ids_BS)
    B, T, N, H = q.shape
    o = jnp.zeros((B, T, N, H), jnp.float32)
    lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
    for step in range(n):
      kk, vv, kpos, kseg = kv
      o_s, lse_s = ref.reference_attention(q, kk, vv, _local_mask(mask, kpos, kseg).dense_mask(),
                                           scale=scale)
      o, lse = _merge(o, lse, o_s.astype(jnp.float32), lse_s)
      if step < n - 1:
        kv = tuple(None if x is None else lax.ppermute(x, ax, perm) for x in kv)
    return o.astype(q.dtype)
  return fn


def _halo(ax, n, local):
  """Local window attention over [halo ; chunk] for the two zigzag chunks of each shard (the
  halo moved as `halo_exchange` says at trace time)."""
  gathered = _halo_exchange.get() == "all_gather"

  def fn(q, k, v, mask):
    B, Tl = q.shape[:2]
    C, h = Tl // 2, mask.window - 1
    if h and h + (-(h + C)) % 128 <= C:  # a longer halo (masked) keeps kv a multiple of 128
      h += (-(h + C)) % 128                # (the kernels' tile)
    i = lax.axis_index(ax)
    seg = mask.q_segment_ids_BT
    seg = jnp.ones((B, Tl), jnp.int32) if seg is None else seg  # halo filler gets id 0

    def chunks(x):
      return x[:, :C], x[:, C:]

    def with_halo(x):
      a, b = chunks(x)
      if h == 0:
        return a, b
      ta, tb = a[:, C - h:], b[:, C - h:]
      if gathered:  # every shard's (ta, tb); shard i reads i-1's ta and i+1's tb
        tails = lax.all_gather(jnp.stack([ta, tb]), ax, axis=0, tiled=False)  # [n, 2, B, h, ..]
        pick = lambda j, t: lax.dynamic_index_in_dim(tails, jnp.clip(j, 0, n - 1), 0, False)[t]
        from_prev = jnp.where(i == 0, jnp.zeros_like(ta), pick(i - 1, 0))
        from_next = pick(i + 1, 1)
      else:
        from_prev = lax.ppermute(ta, ax, [(j, j + 1) for j in range(n - 1)])  # chunk i-1's tail
        from_next = lax.ppermute(tb, ax, [(j + 1, j) for j in range(n - 1)])  # 2n-2-i's tail
      halo_b = jnp.where(i == n - 1, ta, from_next)  # shard n-1: chunk n-1 is its own first
      return jnp.concatenate([from_prev, a], axis=1), jnp.concatenate([halo_b, b], axis=1)

    rows = lambda pair: jnp.concatenate(pair, axis=0)  # the two chunks as 2B rows
    act = mask.active
    m = ops.MaskSpec(q_positions_BT=rows(chunks(mask.q_positions_BT)),
                     kv_positions_BS=rows(with_halo(mask.q_positions_BT)),
                     q_segment_ids_BT=rows(chunks(seg)), kv_segment_ids_BS=rows(with_halo(seg)),
                     active=None if act is None else rows(chunks(act)), window=mask.window,
                     contiguous=False)
    o = local(rows(chunks(q)), rows(with_halo(k)), rows(with_halo(v)), m)
    return jnp.concatenate([o[:B], o[B:]], axis=1)
  return fn


def attention(q_BTNH, k_BSKH, v_BSKH, mask: ops.MaskSpec, *, impl: str = "auto",
              scale: float | None = None):
  """ops.attention of contiguous self-attention whose rows are split over the sequence axis
  (the module docstring says how); the caller (`ops.attention`) checked the call."""
  mesh, ax, n = sequence_shards()
  B, T, N, _ = q_BTNH.shape
  K = k_BSKH.shape[2]
  if T % n:
    raise ValueError(f"sequence parallelism: a row of {T} tokens does not divide the "
                     f"{ax!r} mesh axis ({n} shards); use a multiple of {2 * n} tokens.")
  bl = mask.block_lists
  zigzag = _zigzag.get() and T % (2 * n) == 0
  if bl is not None:  # the query blocks split with the tokens: none may straddle two chunks
    piece, what = (T // (2 * n), f"a zigzag chunk (T / 2n = {T // (2 * n)} tokens)") if zigzag \
        else (T // n, f"a shard's T / n = {T // n} tokens")
    if piece % bl.block_q:
      raise ValueError(f"sequence parallelism: BlockLists.block_q={bl.block_q} must divide "
                       f"{what}: a query block would span two shards' tokens; use a row of a "
                       f"multiple of {2 * n * bl.block_q} tokens or a smaller block_q.")
  if impl in ("cudnn", "tokamax"):
    raise ValueError(f"ops.attention impl={impl!r} cannot run sequence-parallel (a shard's "
                     "queries see other shards' keys: not contiguous self-attention); use "
                     "impl='auto' or 'pallas'.")
  batch, head = _shard_axes(mesh, B, N, K)
  name = _strategy.get()
  w = mask.window
  halo = (w is not None and _zigzag.get() and not mask.sinks and T % (2 * n) == 0
          and w - 1 <= T // (2 * n) and bl is None)
  if name == "ring" and not halo and bl is None:
    return _per_shard(_ring(ax, n, scale), mesh, ax, batch, head, q_BTNH, k_BSKH, v_BSKH, mask)
  # ops' branch for a shard's (non-contiguous) mask, picked at trace time where this process
  # can lower for one accelerator platform only (its GPU / TPU, or the abstract device it
  # cross-lowers for): under jax.grad a lowering-time platform switch keeps the other branches'
  # zero-filled residuals (the reference's [T/n, T] scores) in the compiled step (measured: 575
  # GiB temp for the 7B 128K step on v5p). Several such platforms: the lowering-time switch.
  wrap = _halo if halo else (lambda ax_, n_, local: _all_gather(ax_, n_, local, zigzag))
  branches = ops._branches(impl, q_BTNH, dataclasses.replace(mask, contiguous=False), scale)
  branches = {p: functools.partial(_per_shard, wrap(ax, n, fn), mesh, ax, batch, head)
              for p, fn in branches.items()}
  default = branches.pop("default")
  live = [p for p in branches if p in ops._targets()]
  if len(live) <= 1:
    return (branches[live[0]] if live else default)(q_BTNH, k_BSKH, v_BSKH, mask)
  return lax.platform_dependent(q_BTNH, k_BSKH, v_BSKH, mask, default=default,
                                **{p: branches[p] for p in live})


def _per_shard(fn, mesh, ax, batch, head, q_BTNH, k_BSKH, v_BSKH, mask):
  """fn(q, k, v, mask) per (batch, sequence, head) shard in jax.shard_map."""
  P = jax.sharding.PartitionSpec
  heads, rows = P(batch, ax, head, None), P(batch, ax)
  act = mask.active
  bl = mask.block_lists
  mspec = dataclasses.replace(
      mask, q_positions_BT=rows, kv_positions_BS=rows,
      q_segment_ids_BT=None if mask.q_segment_ids_BT is None else rows,
      kv_segment_ids_BS=None if mask.kv_segment_ids_BS is None else rows,
      active=None if act is None else (rows if act.ndim == 2 else P(batch, ax, head)),
      block_lists=None if bl is None else dataclasses.replace(  # query blocks split as tokens
          bl, kv_blocks_BNQL=P(batch, head, ax, None),
          head_mode_BN=None if bl.head_mode_BN is None else P(batch, head)))
  return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, mspec), out_specs=heads,
                       check_vma=False)(q_BTNH, k_BSKH, v_BSKH, mask)
