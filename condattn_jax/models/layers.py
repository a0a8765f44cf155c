"""Building blocks shared by every attention scheme: RMSNorm, RoPE, Attention, MLP, KV caches.

Parameters carry logical axis names (see `condattn_jax.train.sharding` for the rules table):
  vocab, embed, q_heads, kv_heads, head_dim, mlp, norm.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from condattn_jax import ops
from condattn_jax.models.config import ModelConfig

INIT_STD = 0.02


def _init(names, std=INIT_STD):
  return nn.with_logical_partitioning(nn.initializers.normal(std), names)


class RMSNorm(nn.Module):
  """RMSNorm in float32: x * rsqrt(mean(x^2) + eps) * scale, cast to the compute dtype."""
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def make_norm(cfg: ModelConfig, name: str) -> RMSNorm:
  return RMSNorm(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                 name=name)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
  """Inverse frequencies [head_dim/2], with llama3 scaling when configured (as Hugging Face)."""
  dim = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if cfg.rope_scaling is None:
    return inv_freq
  s = dict(cfg.rope_scaling)
  factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old_len = s["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old_len / lo, old_len / hi
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - lo) / (hi - lo)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BTNH, positions_BT, inv_freq):
  """Rotary embedding in the Hugging Face (rotate-half) convention, computed in float32."""
  freqs = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNH.dtype)


def shared_decode_fill(cfg: ModelConfig, layer0_cache, valid_BT, cache_len: int):
  """The fill after a one-token write, min(length + valid, cache_len) [B] int32, read off layer
  0's cache `layer0_cache` (its 'self_attn/cache' KVCache), for `ctx.fields['decode_fill_B']`:
  a dense model's one-token decode step hands every layer's attention this ONE fill (the kv
  length its mask / cuDNN's per-part lengths are built from), computed once a step by the
  Decoder, instead of once a layer. Exact for an Engine cache: every chunk, step and row reset
  writes every layer alike, so all layers' counters are equal. None (each layer counts its
  own) unless the model is dense without a sliding window, the chunk is one token and layer 0
  holds a full cache of cache_len slots."""
  if not (cfg.scheme == "dense" and cfg.sliding_window is None and valid_BT.shape[1] == 1):
    return None
  kv = (layer0_cache or {}).get("self_attn", {}).get("cache", {})
  if "length" not in kv or kv["key"].shape[1] != cache_len:
    return None
  return jnp.minimum(kv["length"] + valid_BT[:, 0].astype(jnp.int32), cache_len)


def shares_kv_state(cfg: ModelConfig) -> bool:
  """Whether a decode of `cfg` (Decoder unrolled) keeps ONE copy of its caches' bookkeeping: a
  dense model without a sliding window (full caches only). Layer 0's KVCache then holds
  positions / valid / length, every other layer's only key / value, written at layer 0's slots
  (`ctx.fields['kv_state']`: layer 0's positions / valid after the write). Exact: those arrays
  are equal in every layer (each chunk writes every layer alike); a step then runs 3 in-place
  updates (positions, valid, length) and the fill's inputs once, not once a layer."""
  return cfg.scheme == "dense" and cfg.sliding_window is None


class Projection(nn.Module):
  """y = x @ kernel (+ bias) contracting x's trailing dims with kernel's leading dims.

  q/k/v: kernel [D, N, H] (x [..., D] -> [..., N, H]); o: kernel [N, H, D] ([..., N, H] -> [..., D]).
  The kernel is created in its final shape, so its logical names always match its rank.
  Decode shapes (same numbers as the plain contraction): a projection of ONE row (B * T == 1)
  multiplies a 2-row operand (the row and a zero row) and keeps row 0 (XLA:GPU's algebraic
  simplifier rewrites a dot of one row whose (M + N) * K is below 10M elements into an
  elementwise multiply + reduce over the whole weight; a 2-row dot stays a GEMM); an input of
  one token a row contracting two kernel dims (o_proj) contracts 2-D views ([..., N*H] x
  [N*H, D]): one GEMM operand shape for every decode batch size.
  """
  shape: tuple[int, ...]
  names: tuple[str, ...]
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    n_in = 1 if self.names[0] == "embed" else 2  # contracted (input) dims of the kernel
    kernel = self.param("kernel", _init(self.names), self.shape, self.param_dtype)
    x = x.astype(self.dtype)
    lead = x.shape[:x.ndim - n_in]
    one_row = math.prod(lead) == 1
    if one_row:  # [1, ..., in] -> [2, in]: the row, then zeros
      x = x.reshape((1,) + x.shape[x.ndim - n_in:])
      x = jnp.concatenate([x, jnp.zeros_like(x)], axis=0)
    w, n_c = kernel.astype(self.dtype), n_in  # n_c: the dims the dot contracts
    if n_in > 1 and lead[-1:] == (1,):  # one token a row: [.., in] x [in, out]
      x = x.reshape(x.shape[:x.ndim - n_in] + (-1,))
      w, n_c = w.reshape(math.prod(self.shape[:n_in]), -1), 1
    y = lax.dot_general(x, w, ((tuple(range(x.ndim - n_c, x.ndim)), tuple(range(n_c))),
                               ((), ())))
    if one_row:
      y = y[:1].reshape(lead + y.shape[1:])
    if self.use_bias:
      out_names = self.names[n_in:]
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_names),
                        self.shape[n_in:], self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y


def _read_one_token(buf, slot_B):
  """buf[b, slot_B[b]] [B, ...] (slot_B in [0, S)): a dynamic slice at B = 1, a gather else."""
  B = buf.shape[0]
  if B == 1:
    start = (0, slot_B[0]) + (0,) * (buf.ndim - 2)
    return lax.dynamic_slice(buf, start, (1, 1) + buf.shape[2:])[:, 0]
  idx = slot_B.astype(jnp.int32).reshape((B, 1) + (1,) * (buf.ndim - 2))
  return jnp.take_along_axis(buf, idx, axis=1)[:, 0]


def _write_one_token(buf, val_B, slot_B):
  """buf [B, S, ...] with val_B [B, ...] stored at (b, slot_B[b]) (slot_B in [0, S)): a
  one-token write into a full cache (decode), one in-place update per array instead of the
  general scatter that drops out-of-range slots.

  B = 1: one dynamic-update-slice (it clamps its start; no bounds check). B > 1: one scatter of
  B in-range, distinct, sorted slots. (An HLO scatter skips out-of-range updates whatever jax's
  mode: XLA:GPU turns a one-index scatter into a bounds predicate, a read of the old value, a
  select and the update.)"""
  B = buf.shape[0]
  val = val_B.astype(buf.dtype)[:, None]
  # (dynamic_update_slice wants both on one mesh with one spec: else the scatter below)
  if B == 1 and jax.typeof(buf).sharding == jax.typeof(val).sharding:
    return lax.dynamic_update_slice(buf, val, (0, slot_B[0]) + (0,) * (buf.ndim - 2))
  idx_B2 = jnp.stack([jnp.arange(B, dtype=jnp.int32), slot_B.astype(jnp.int32)], axis=1)
  return lax.scatter(buf, idx_B2, val[:, 0], lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(1, buf.ndim - 1)), inserted_window_dims=(0, 1),
      scatter_dims_to_operand_dims=(0, 1)), indices_are_sorted=True, unique_indices=True,
      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


class KVCache(nn.Module):
  """Decode-time K/V cache in the 'cache' collection, with a length per batch row.

  kind 'full'  : `size` slots; row b's tokens go to slots length_b, length_b + 1, ... (size = the
                 longest sequence to be decoded).
  kind 'window': a ring of `size` slots holding each row's `size` most recent keys.
  Variables: key/value [B, size, K, H], positions [B, size] int32, valid [B, size] int32 (1 =
  holds a key), length [B] int32 (tokens written so far). All start at zero, so a cache can be
  made with `jnp.zeros` from its abstract shape (the inference engine does).

  `__call__(k, v, positions_BT, valid_BT, kind=, size=)` writes the chunk's valid tokens (a row's valid tokens
  come first, padding after: ragged prompts are right-padded) and returns the keys the chunk's
  queries must see, as (k_BSKH, v_BSKH, kv_positions_BS, kv_valid_BS):
    full  : the cache after the write (every earlier key and the chunk itself, in slot order);
    window: the ring before the write followed by the chunk (a chunk longer than the ring still
            sees its own earlier keys); with `after_write` (for a one-token chunk: decode) the
            ring after the write, which holds the same keys of the token's window (the `size`
            most recent), filled as a prefix of min(length, size) slots.
  A full cache's slots past a row's length hold zeros (writes fill a prefix; Engine resets
  zero a row). A one-token chunk into a full cache (decode) relies on it: each array is
  stored with one in-place update at slot `length` (an inactive row stores zeros there, i.e.
  nothing changes); into a ring, at slot `length % size` (an inactive row stores the slot's
  old value back); a longer chunk goes through a scatter that drops padding. A row
  that already holds `size` tokens has no slot left: a longer chunk's extra tokens are
  dropped, while a one-token step, active or not, overwrites its last slot (callers never ask
  for either: Engine.generate / serve refuse prompt + max_new_tokens > cache_len).
  """
  @nn.compact
  def __call__(self, k_BTKH, v_BTKH, positions_BT, valid_BT, *, kind: str, size: int,
               after_write: bool = False, shared: dict | None = None):
    """shared (kind 'full'; `shares_kv_state`): another full cache's bookkeeping this chunk,
    {'length': its length before the write, 'new_length', 'positions', 'valid': after it}:
    this cache then holds only key / value, written at those slots."""
    B, T, K, H = k_BTKH.shape
    ck = self.variable("cache", "key", jnp.zeros, (B, size, K, H), k_BTKH.dtype)
    cv = self.variable("cache", "value", jnp.zeros, (B, size, K, H), v_BTKH.dtype)
    valid_BT = jnp.asarray(valid_BT, bool)
    positions_BT = positions_BT.astype(jnp.int32)
    n_B = jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
    j_BT = jnp.arange(T, dtype=jnp.int32)[None, :]
    if shared is not None:
      if kind != "full":
        raise ValueError(f"KVCache(shared=...) is for a full cache, not kind={kind!r}.")
      length_B = shared["length"]
      if T == 1:
        keep_B = valid_BT[:, 0]
        slot_B = jnp.clip(shared["new_length"] - keep_B.astype(jnp.int32), 0, size - 1)
        zero = lambda x: jnp.where(keep_B.reshape((B,) + (1,) * (x.ndim - 1)), x,
                                   jnp.zeros((), x.dtype))
        ck.value = _write_one_token(ck.value, zero(k_BTKH[:, 0]), slot_B)
        cv.value = _write_one_token(cv.value, zero(v_BTKH[:, 0]), slot_B)
      else:
        slot_BT = jnp.where(valid_BT, length_B[:, None] + j_BT, size)  # size: dropped
        rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        ck.value = ck.value.at[rows_BT, slot_BT].set(k_BTKH.astype(ck.value.dtype), mode="drop")
        cv.value = cv.value.at[rows_BT, slot_BT].set(v_BTKH.astype(cv.value.dtype), mode="drop")
      return ck.value, cv.value, shared["positions"], shared["valid"]
    cpos = self.variable("cache", "positions", jnp.zeros, (B, size), jnp.int32)
    cvalid = self.variable("cache", "valid", jnp.zeros, (B, size), jnp.int32)
    clen = self.variable("cache", "length", jnp.zeros, (B,), jnp.int32)
    length_B = clen.value
    if kind == "full":
      slot_BT = length_B[:, None] + j_BT
      keep_BT = valid_BT
    elif kind == "window":
      slot_BT = (length_B[:, None] + j_BT) % size
      keep_BT = valid_BT & (j_BT >= n_B[:, None] - size)  # only the last `size` tokens: no clashes
    else:
      raise ValueError(f"KVCache kind={kind!r}: choose 'full' or 'window'.")
    before = (ck.value, cv.value, cpos.value, cvalid.value)
    if T == 1:
      # one in-place update per array at the row's slot: a full cache's length (an inactive
      # row stores zeros there: slots past the fill hold zeros, unchanged), a ring's length %
      # size (an inactive row stores the slot's old value back: a ring's slots may all be
      # live). The slot is read off the new length behind a barrier: XLA:GPU otherwise
      # recomputes it from the old counter inside each update's fusion, and keeps the old
      # counter alive by a copy (a kernel a layer) since the add updates it in place
      keep_B = valid_BT[:, 0]
      new_len_B = lax.optimization_barrier(length_B + keep_B.astype(jnp.int32))
      old_len_B = new_len_B - keep_B.astype(jnp.int32)
      slot_B = jnp.clip(old_len_B, 0, size - 1) if kind == "full" else old_len_B % size

      def write(buf, val_B):
        other = (jnp.zeros((), buf.dtype) if kind == "full" else _read_one_token(buf, slot_B))
        val_B = jnp.where(keep_B.reshape((B,) + (1,) * (val_B.ndim - 1)),
                          val_B.astype(buf.dtype), other)
        return _write_one_token(buf, val_B, slot_B)
      ck.value = write(ck.value, k_BTKH[:, 0])
      cv.value = write(cv.value, v_BTKH[:, 0])
      cpos.value = write(cpos.value, positions_BT[:, 0])
      cvalid.value = write(cvalid.value, jnp.ones((B,), jnp.int32))
      clen.value = new_len_B
    else:
      slot_BT = jnp.where(keep_BT, slot_BT, size)  # out of range: dropped by the scatter
      rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
      put = lambda buf, val: buf.at[rows_BT, slot_BT].set(val.astype(buf.dtype), mode="drop")
      ck.value = put(ck.value, k_BTKH)
      cv.value = put(cv.value, v_BTKH)
      cpos.value = put(cpos.value, positions_BT)
      cvalid.value = put(cvalid.value, jnp.ones((B, T), jnp.int32))
      clen.value = length_B + n_B
    if kind == "full" or after_write:
      return ck.value, cv.value, cpos.value, cvalid.value
    k0, v0, p0, ok0 = before
    return (jnp.concatenate([k0, k_BTKH.astype(k0.dtype)], axis=1),
            jnp.concatenate([v0, v_BTKH.astype(v0.dtype)], axis=1),
            jnp.concatenate([p0, positions_BT], axis=1),
            jnp.concatenate([ok0, valid_BT.astype(jnp.int32)], axis=1))


def attend(q_BTNH, k_BSKH, v_BSKH, *, q_positions_BT, kv_positions_BS, q_segment_ids_BT=None,
           kv_segment_ids_BS=None, window=None, active=None, impl="auto", contiguous=False,
           full_cache=False, kv_lengths_B=None):
  """The model's one call into `ops.attention` (builds the mask spec). full_cache: k/v are a
  KVCache of kind 'full' after its write (valid slots = kv_segment_ids_BS, a prefix of each
  row): the mask then carries the fill (MaskSpec.kv_lengths_B) that decode kernels read;
  kv_lengths_B: that fill when the caller knows it (the cache's own counter: no reduction
  over the slots), else it is counted from kv_segment_ids_BS."""
  lengths_B = None
  if full_cache:
    lengths_B = (jnp.sum(kv_segment_ids_BS != 0, axis=1, dtype=jnp.int32)
                 if kv_lengths_B is None else kv_lengths_B.astype(jnp.int32))
  mask = ops.MaskSpec(q_positions_BT=q_positions_BT, kv_positions_BS=kv_positions_BS,
                      q_segment_ids_BT=q_segment_ids_BT, kv_segment_ids_BS=kv_segment_ids_BS,
                      window=window, active=active, contiguous=contiguous, kv_lengths_B=lengths_B)
  return ops.attention(q_BTNH, k_BSKH, v_BSKH, mask, impl=impl)


class Attention(nn.Module):
  """Multi-head attention with GQA (K/V never repeated), optional q/k norm, RoPE.

  The steps are exposed so schemes can run their own attention core with the same weights:
  `project` (q/k/v after q/k norm, BEFORE RoPE: Elastic's router and retrieval pools read these),
  `rope`, `qkv` (= rope(project)), `project_out`, `write_cache` (this attention's KVCache: a
  ring of `window` slots for sliding-window attention, else cache_len slots) and `attend`.
  """
  config: ModelConfig
  window: int | None = None  # sliding window (keys t-w+1..t); None = global

  def setup(self):
    cfg = self.config
    N, K, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    proj = lambda shape, names, bias, name: Projection(shape, names, bias, cfg.compute_dtype,
                                                      cfg.weight_dtype, name=name)
    self.q_proj = proj((D, N, H), ("embed", "q_heads", "head_dim"), cfg.attention_bias, "q_proj")
    self.k_proj = proj((D, K, H), ("embed", "kv_heads", "head_dim"), cfg.attention_bias, "k_proj")
    self.v_proj = proj((D, K, H), ("embed", "kv_heads", "head_dim"), cfg.attention_bias, "v_proj")
    self.o_proj = proj((N, H, D), ("q_heads", "head_dim", "embed"), False, "o_proj")
    if cfg.qk_norm != "none":
      self.q_norm = make_norm(cfg, "q_norm")
      self.k_norm = make_norm(cfg, "k_norm")
    self.kv_cache = KVCache(name="cache")

  def project(self, x_BTD):
    """q [B,T,N,H], k/v [B,T,K,H] after q/k norm, before RoPE."""
    cfg = self.config
    q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
    if cfg.qk_norm == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    elif cfg.qk_norm == "full":
      B, T = x_BTD.shape[:2]
      q = self.q_norm(q.reshape(B, T, -1)).reshape(q.shape)
      k = self.k_norm(k.reshape(B, T, -1)).reshape(k.shape)
    return q, k, v

  def rope(self, x_BTNH, positions_BT):
    return apply_rope(x_BTNH, positions_BT, rope_inv_freq(self.config))

  def qkv(self, x_BTD, positions_BT):
    """q [B,T,N,H], k/v [B,T,K,H] after q/k norm and RoPE."""
    q, k, v = self.project(x_BTD)
    q, k = self.rope(q, positions_BT), self.rope(k, positions_BT)
    q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
    return q, k, v

  def project_out(self, o_BTNH):
    return self.o_proj(o_BTNH)

  def write_cache(self, k_BTKH, v_BTKH, ctx, *, after_write: bool = False):
    """Writes the chunk into this attention's KVCache; returns the keys its queries see (a
    window ring: before the write + the chunk, or after the write with `after_write`; see
    KVCache)."""
    if ctx.cache_len is None:
      raise ValueError("decode=True needs cache_len (the longest sequence to decode).")
    size = ctx.cache_len if self.window is None else min(self.window, ctx.cache_len)
    kind = self.cache_kind(ctx)
    shared = ctx.fields.get("kv_state") if kind == "full" and self.window is None else None
    return self.kv_cache(k_BTKH, v_BTKH, ctx.positions_BT, ctx.valid_BT,
                         kind=kind, size=size, after_write=after_write, shared=shared)

  def cache_kind(self, ctx) -> str:
    """'full' (cache_len slots) or 'window' (a ring of `window` slots) for this attention."""
    return "full" if self.window is None or self.window >= ctx.cache_len else "window"

  def fill_after_write(self, ctx, size: int, *, shared: bool = True):
    """The valid prefix [B] of this layer's cache after the write: a full cache's length
    counter (the shared kv_state's where the cache keeps none), a ring's min(length, size);
    with `shared` (a one-token step) and no window, the fill the Decoder computed once for every
    layer (ctx.fields['decode_fill_B']: shared_decode_fill) where it did."""
    fill_B = ctx.fields.get("decode_fill_B") if shared and self.window is None else None
    if fill_B is None:
      length_B = (ctx.fields["kv_state"]["new_length"]
                  if not self.kv_cache.has_variable("cache", "length")
                  else self.kv_cache.get_variable("cache", "length"))
      fill_B = jnp.minimum(length_B, size)
    return fill_B

  def attend(self, q_BTNH, k_BTKH, v_BTKH, ctx, *, active=None, impl=None):
    """Attention of the chunk's queries (only the `active` ones, when given): over the cache
    when ctx.decode, else self-attention. impl: ops.attention's (default model.attention_impl)."""
    impl = self.config.attention_impl if impl is None else impl
    if ctx.decode:
      # one token over a ring of `window` slots after its write: every key held is in its
      # window, so the ring reads like a full cache (no window mask, its fill = valid slots)
      ring_step = self.cache_kind(ctx) == "window" and q_BTNH.shape[1] == 1
      k_all, v_all, kv_pos, kv_valid = self.write_cache(k_BTKH, v_BTKH, ctx,
                                                        after_write=ring_step)
      fill_B = self.fill_after_write(ctx, k_all.shape[1],
                                     shared=not ring_step and q_BTNH.shape[1] == 1)
      return attend(q_BTNH, k_all, v_all, q_positions_BT=ctx.positions_BT, kv_positions_BS=kv_pos,
                    kv_segment_ids_BS=kv_valid, window=None if ring_step else self.window,
                    active=active, impl=impl,
                    full_cache=ring_step or self.cache_kind(ctx) == "full", kv_lengths_B=fill_B)
    return attend(q_BTNH, k_BTKH, v_BTKH, q_positions_BT=ctx.positions_BT,
                  kv_positions_BS=ctx.positions_BT, q_segment_ids_BT=ctx.segment_ids_BT,
                  kv_segment_ids_BS=ctx.segment_ids_BT, window=self.window, active=active,
                  impl=impl, contiguous=True)

  def __call__(self, x_BTD, ctx):
    q, k, v = self.qkv(x_BTD, ctx.positions_BT)
    return self.project_out(self.attend(q, k, v, ctx))


class MLP(nn.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD):
    cfg = self.config
    dense = lambda feats, names, name: nn.Dense(
        feats, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
        kernel_init=_init(names), name=name)
    gate = dense(cfg.intermediate_size, ("embed", "mlp"), "gate_proj")(x_BTD)
    up = dense(cfg.intermediate_size, ("embed", "mlp"), "up_proj")(x_BTD)
    h = nn.with_logical_constraint(nn.silu(gate) * up,
                                   ("activation_batch", "activation_length", "activation_mlp"))
    return dense(cfg.hidden_size, ("mlp", "embed"), "down_proj")(h)


def mlp_residual(cfg: ModelConfig, x_BTD):
  """The MLP half of a decoder layer (call inside a layer's compact __call__).

  pre-norm : x + MLP(post_attention_layernorm(x))
  post-norm: x + post_feedforward_layernorm(MLP(x))   (olmo2)
  """
  if cfg.post_norm:
    return x_BTD + make_norm(cfg, "post_feedforward_layernorm")(MLP(cfg, name="mlp")(x_BTD))
  return x_BTD + MLP(cfg, name="mlp")(make_norm(cfg, "post_attention_layernorm")(x_BTD))
