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


class Projection(nn.Module):
  """y = x @ kernel (+ bias) contracting x's trailing dims with kernel's leading dims.

  q/k/v: kernel [D, N, H] (x [..., D] -> [..., N, H]); o: kernel [N, H, D] ([..., N, H] -> [..., D]).
  The kernel is created in its final shape, so its logical names always match its rank.
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
    y = lax.dot_general(x, kernel.astype(self.dtype),
                        ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
    if self.use_bias:
      out_names = self.names[n_in:]
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_names),
                        self.shape[n_in:], self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y


class KVCache(nn.Module):
  """Decode-time K/V cache in the 'cache' collection.

  kind 'full'  : `size` slots written in order (size = the longest sequence to be decoded).
  kind 'window': a ring of `size` slots holding the most recent keys (sliding-window layers).
  Each call returns the keys visible to the incoming chunk (cache contents before the write,
  then the chunk) with positions and a validity mask, and then writes the chunk.
  """
  kind: str

  @nn.compact
  def __call__(self, k_BTKH, v_BTKH, positions_BT, size: int):
    B, T, K, H = k_BTKH.shape
    ck = self.variable("cache", "key", jnp.zeros, (B, size, K, H), k_BTKH.dtype)
    cv = self.variable("cache", "value", jnp.zeros, (B, size, K, H), v_BTKH.dtype)
    cpos = self.variable("cache", "positions", jnp.zeros, (B, size), jnp.int32)
    cvalid = self.variable("cache", "valid", jnp.zeros, (B, size), jnp.int32)
    cidx = self.variable("cache", "index", jnp.zeros, (), jnp.int32)
    k_all = jnp.concatenate([ck.value, k_BTKH], axis=1)
    v_all = jnp.concatenate([cv.value, v_BTKH], axis=1)
    pos_all = jnp.concatenate([cpos.value, positions_BT.astype(jnp.int32)], axis=1)
    valid_all = jnp.concatenate([cvalid.value, jnp.ones((B, T), jnp.int32)], axis=1)
    idx = cidx.value
    ones = jnp.ones((B, T), jnp.int32)
    if self.kind == "full":
      if T > size:
        raise ValueError(f"KV cache of {size} slots cannot take a chunk of {T} tokens; "
                         "raise cache_len.")
      ck.value = lax.dynamic_update_slice(ck.value, k_BTKH, (0, idx, 0, 0))
      cv.value = lax.dynamic_update_slice(cv.value, v_BTKH, (0, idx, 0, 0))
      cpos.value = lax.dynamic_update_slice(cpos.value, positions_BT.astype(jnp.int32), (0, idx))
      cvalid.value = lax.dynamic_update_slice(cvalid.value, ones, (0, idx))
    elif self.kind == "window":
      n = min(T, size)
      slots = (idx + T - n + jnp.arange(n)) % size
      ck.value = ck.value.at[:, slots].set(k_BTKH[:, T - n:])
      cv.value = cv.value.at[:, slots].set(v_BTKH[:, T - n:])
      cpos.value = cpos.value.at[:, slots].set(positions_BT[:, T - n:].astype(jnp.int32))
      cvalid.value = cvalid.value.at[:, slots].set(1)
    else:
      raise ValueError(f"KVCache.kind={self.kind!r}: choose 'full' or 'window'.")
    cidx.value = idx + T
    return k_all, v_all, pos_all, valid_all


class Attention(nn.Module):
  """Multi-head attention with GQA (K/V never repeated), optional q/k norm, RoPE.

  `qkv` and `project_out` are exposed so schemes can run their own attention core (e.g. on a
  compacted subset of queries) with the same weights.
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
    self.cache = KVCache("full" if self.window is None else "window")

  def qkv(self, x_BTD, positions_BT):
    """q [B,T,N,H], k/v [B,T,K,H] after q/k norm and RoPE."""
    cfg = self.config
    q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
    if cfg.qk_norm == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    elif cfg.qk_norm == "full":
      B, T = x_BTD.shape[:2]
      q = self.q_norm(q.reshape(B, T, -1)).reshape(q.shape)
      k = self.k_norm(k.reshape(B, T, -1)).reshape(k.shape)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions_BT, inv_freq)
    k = apply_rope(k, positions_BT, inv_freq)
    q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
    return q, k, v

  def project_out(self, o_BTNH):
    return self.o_proj(o_BTNH)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, *, decode=False, cache_len=None):
    q, k, v = self.qkv(x_BTD, positions_BT)
    cfg = self.config
    if decode:
      if self.window is None and cache_len is None:
        raise ValueError("decode=True needs cache_len (the longest sequence to decode).")
      size = self.window if self.window is not None else cache_len
      k_all, v_all, kv_pos, kv_valid = self.cache(k, v, positions_BT, size)
      out = ops.attention(q, k_all, v_all, q_positions_BT=positions_BT, kv_positions_BS=kv_pos,
                          kv_segment_ids_BS=kv_valid, window=self.window)
    else:
      out = ops.attention(q, k, v, q_positions_BT=positions_BT, kv_positions_BS=positions_BT,
                          q_segment_ids_BT=segment_ids_BT, kv_segment_ids_BS=segment_ids_BT,
                          window=self.window, impl=cfg.attention_impl, self_attention=True)
    return self.project_out(out)


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
