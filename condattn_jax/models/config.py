"""ModelConfig: one frozen description of a decoder for the llama | qwen2 | qwen3 | olmo2 families."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from condattn_jax import ops

FAMILIES = ("llama", "qwen2", "qwen3", "olmo2")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")
ATTENTION_IMPLS = ops.IMPLS  # the one vocabulary of ops.attention


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder.

  The family sets the block layout:
    llama : pre-norm, no q/k norm, optional llama3 RoPE scaling.
    qwen2 : pre-norm, q/k/v bias.
    qwen3 : pre-norm, per-head RMSNorm on q and k (over head_dim).
    olmo2 : post-norm blocks (norm after attention / MLP, before the residual add),
            RMSNorm on q and k over the whole projected width.
  `scheme` names the attention scheme (`condattn_jax.attention.SCHEMES`), `scheme_kwargs` its
  hyper-parameters (a tuple of (name, value) pairs so the config stays hashable).
  """
  family: str = "qwen2"
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 1e6
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3: factor, low/high_freq_factor, original_max_position_embeddings
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # bias on q/k/v projections (qwen2)
  qk_norm: str = "none"  # "none" | "head" (qwen3) | "full" (olmo2)
  post_norm: bool = False  # olmo2
  sliding_window: int | None = None  # dense scheme only: causal window (keys t-w+1..t)
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"  # master weights
  remat_policy: str = "none"
  attention_impl: str = "auto"
  scheme: str = "dense"
  scheme_kwargs: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"model.family={self.family!r} is not supported; choose one of {FAMILIES}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                       f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.qk_norm not in ("none", "head", "full"):
      raise ValueError(f"model.qk_norm={self.qk_norm!r}: choose 'none', 'head' or 'full'.")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"model.remat_policy={self.remat_policy!r}: choose one of {REMAT_POLICIES}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"model.attention_impl={self.attention_impl!r}: choose one of {ATTENTION_IMPLS}.")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model.{f}={getattr(self, f)!r}: choose float32, bfloat16 or float16.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def scheme_options(self) -> dict[str, Any]:
    return dict(self.scheme_kwargs)

  def replace(self, **kw) -> "ModelConfig":
    if "scheme_kwargs" in kw and isinstance(kw["scheme_kwargs"], dict):
      kw["scheme_kwargs"] = tuple(sorted(kw["scheme_kwargs"].items()))
    if "rope_scaling" in kw and isinstance(kw["rope_scaling"], dict):
      kw["rope_scaling"] = tuple(sorted(kw["rope_scaling"].items()))
    return dataclasses.replace(self, **kw)

  # ---------------------------------------------------------------- Hugging Face config.json
  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict (model_type selects the family)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
      raise ValueError(f"config.json model_type={model_type!r} is not supported; supported "
                       f"families: {FAMILIES}.")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    scaling = hf.get("rope_scaling")
    if scaling is not None:
      rope_type = scaling.get("rope_type", scaling.get("type"))
      if rope_type not in ("llama3", "default"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (llama3 or none).")
      scaling = None if rope_type == "default" else tuple(sorted(
          (k, v) for k, v in scaling.items() if k in
          ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
    kw = dict(
        family=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=(True if model_type == "qwen2" else bool(hf.get("attention_bias", False))),
        qk_norm={"qwen3": "head", "olmo2": "full"}.get(model_type, "none"),
        post_norm=(model_type == "olmo2"),
    )
    if hf.get("use_sliding_window"):
      raise ValueError("config.json has use_sliding_window=true (per-layer Qwen sliding window); "
                       "this is not supported: set it to false or convert the model without it.")
    if model_type == "llama" and hf.get("mlp_bias"):
      raise ValueError("llama checkpoints with mlp_bias=True are not supported.")
    kw.update(overrides)
    return cls(**kw)

  def to_hf_config(self) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of this architecture (dense attention)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}[self.family]
    hf = dict(
        architectures=[arch], model_type=self.family, vocab_size=self.vocab_size,
        hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
        rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        tie_word_embeddings=self.tie_word_embeddings, hidden_act="silu",
        torch_dtype={"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[self.param_dtype],
    )
    if self.family in ("llama", "qwen3", "olmo2"):
      hf["attention_bias"] = self.attention_bias
    if self.rope_scaling is not None:
      hf["rope_scaling"] = dict(self.rope_scaling, rope_type="llama3")
    return hf
