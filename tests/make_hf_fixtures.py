"""Writes tiny random Hugging Face checkpoints + reference logits into tests/fixtures/hf/.

Runs in a Python 3.11 venv with the CPU build of torch and transformers (NOT the project venv):

  python3 -m venv .venv311
  .venv311/bin/pip install torch==2.13.0        # the CPU wheel on disk
  .venv311/bin/pip install transformers safetensors tokenizers
  .venv311/bin/python tests/make_hf_fixtures.py  # rewrites tests/fixtures/hf/

Made with transformers 5.23.0 / torch 2.13.0+cpu. The tests read the outputs with numpy only.

For each family (llama | qwen2 | qwen3 | olmo2) `tests/fixtures/hf/<family>/` holds
  config.json, model.safetensors (float32, every weight random: norm scales and biases too),
  expected.npz:
    input_ids          int32 [2, 48]  random tokens
    logits             f32  [2, 48, V] forward at length 48 (positions 0..47), computed by HF in
                                       float64 from the float32 weights (the float32 truth; HF's own
                                       float32 forward is within ~2e-5 of it)
    packed_input_ids   int32 [1, 48]  three documents packed + padding
    packed_segment_ids int32 [1, 48]  1, 2, 3, ... ; 0 = padding
    packed_positions   int32 [1, 48]  restart at 0 in each document (0 on padding)
    packed_logits      f32  [1, 48, V] each document run on its own through HF, concatenated
                                       (0 on padding: not compared)
Extra fixtures:
  llama_sharded/  the llama weights saved with a small max_shard_size (model.safetensors.index.json)
  qwen3_bf16/     the qwen3 weights saved in bfloat16 (compare against qwen3/ cast to bf16)
  tokenizer/qwen/ a tiny byte-level BPE tokenizer.json with Qwen's special tokens + tokenizer_config.json

config.json files of llama and qwen2 are rewritten to the pre-v5 layout (`rope_theta` +
`rope_scaling`, as on most published checkpoints); qwen3 and olmo2 keep transformers 5's
`rope_parameters` layout, so the loader sees both.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "hf")

SEQ = 48
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=None, eos_token_id=1, pad_token_id=None,
)


def make_configs():
  return {
      # rope theta 10000 with head_dim 16 and original_max_position_embeddings 32 puts the
      # frequencies in all three llama3 regimes (kept, smoothed, divided by factor).
      "llama": (LlamaForCausalLM, LlamaConfig(
          **COMMON, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
          rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=32))),
      "qwen2": (Qwen2ForCausalLM, Qwen2Config(
          **COMMON, tie_word_embeddings=True, use_sliding_window=False,
          rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
      "qwen3": (Qwen3ForCausalLM, Qwen3Config(
          **COMMON, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
          rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
      "olmo2": (Olmo2ForCausalLM, Olmo2Config(
          **COMMON, tie_word_embeddings=False, attention_bias=False,
          rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
  }


def randomize_(model, gen):
  """Every parameter random, so that a wrong transpose / missing bias / wrong norm shows up."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
      elif name.endswith(".bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
      elif "embed_tokens" in name or "lm_head" in name:
        p.copy_(1.0 * torch.randn(p.shape, generator=gen))
      else:  # Linear [out, in]: std ~ 1/sqrt(in), a bit larger for q/k so attention is peaked
        scale = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
        p.copy_(scale * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))


def forward(model, ids, positions=None):
  with torch.no_grad():
    ids_t = torch.tensor(ids, dtype=torch.long)
    kw = {}
    if positions is not None:
      kw["position_ids"] = torch.tensor(positions, dtype=torch.long)
    return model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), **kw).logits.double().numpy()


def packed_case(model, rng):
  """Three documents + padding in one row; reference = each document on its own."""
  lengths = [20, 11, 13]  # + 4 padding
  ids = np.zeros((1, SEQ), np.int32)
  seg = np.zeros((1, SEQ), np.int32)
  pos = np.zeros((1, SEQ), np.int32)
  logits = np.zeros((1, SEQ, VOCAB), np.float32)
  start = 0
  for d, n in enumerate(lengths):
    doc = rng.integers(0, VOCAB, size=(1, n)).astype(np.int32)
    ids[0, start:start + n] = doc[0]
    seg[0, start:start + n] = d + 1
    pos[0, start:start + n] = np.arange(n)
    logits[0, start:start + n] = forward(model, doc)[0].astype(np.float32)
    start += n
  ids[0, start:] = rng.integers(0, VOCAB, size=SEQ - start)  # padding tokens: arbitrary
  return ids, seg, pos, logits


def to_legacy_rope(config_path):
  """transformers 5 writes `rope_parameters`; most published checkpoints have rope_theta + rope_scaling."""
  with open(config_path) as f:
    cfg = json.load(f)
  rp = cfg.pop("rope_parameters")
  cfg["rope_theta"] = rp.pop("rope_theta")
  cfg["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
  with open(config_path, "w") as f:
    json.dump(cfg, f, indent=2, sort_keys=True)


def make_tokenizer(out_dir):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  os.makedirs(out_dir, exist_ok=True)
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  corpus = [
      "The quick brown fox jumps over the lazy dog.",
      "Conditional attention routes some tokens to global attention and the rest to local attention.",
      "Hello world! Hello there, how are you today?",
      "def f(x):\n    return x * 2\n",
      "Long contexts need sparse attention: needles in haystacks.",
  ] * 4
  trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
  tok.train_from_iterator(corpus, trainer=trainer)
  tok.add_special_tokens(specials)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  added = {str(tok.token_to_id(s)): dict(content=s, lstrip=False, normalized=False, rstrip=False,
                                         single_word=False, special=True) for s in specials}
  tcfg = dict(
      add_bos_token=False, add_prefix_space=False, added_tokens_decoder=added,
      additional_special_tokens=["<|im_start|>", "<|im_end|>"], bos_token=None,
      clean_up_tokenization_spaces=False, eos_token="<|endoftext|>", errors="replace",
      model_max_length=32768, pad_token="<|endoftext|>", split_special_tokens=False,
      tokenizer_class="Qwen2Tokenizer", unk_token=None,
  )
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tcfg, f, indent=2, sort_keys=True)


def main():
  print("transformers", transformers.__version__, "torch", torch.__version__)
  torch.manual_seed(0)
  if os.path.isdir(OUT):
    shutil.rmtree(OUT)
  os.makedirs(OUT)
  for i, (family, (cls, config)) in enumerate(make_configs().items()):
    gen = torch.Generator().manual_seed(1000 + i)
    rng = np.random.default_rng(2000 + i)
    config._attn_implementation = "eager"
    model = cls(config).eval().float()
    randomize_(model, gen)
    if config.tie_word_embeddings:
      assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = rng.integers(0, VOCAB, size=(2, SEQ)).astype(np.int32)
    ref = copy.deepcopy(model).double()
    logits = forward(ref, ids)
    p_ids, p_seg, p_pos, p_logits = packed_case(ref, rng)
    f32_err = np.abs(forward(model, ids) - logits).max()
    assert f32_err < 5e-5, f32_err
    d = os.path.join(OUT, family)
    model.save_pretrained(d, safe_serialization=True)
    for extra in ("generation_config.json",):
      if os.path.exists(os.path.join(d, extra)):
        os.remove(os.path.join(d, extra))
    if family in ("llama", "qwen2"):
      to_legacy_rope(os.path.join(d, "config.json"))
    np.savez(os.path.join(d, "expected.npz"), input_ids=ids, logits=logits.astype(np.float32),
             packed_input_ids=p_ids, packed_segment_ids=p_seg, packed_positions=p_pos,
             packed_logits=p_logits)
    # The saved checkpoint reloads in transformers to the same logits (legacy config layout too).
    re = cls.from_pretrained(d, attn_implementation="eager").eval().double()
    np.testing.assert_array_equal(forward(re, ids), logits)
    print(family, "logits std", float(logits.std()), "packed std", float(p_logits.std()),
          "HF float32 vs float64", float(f32_err))

    if family == "llama":
      ds = os.path.join(OUT, "llama_sharded")
      model.save_pretrained(ds, safe_serialization=True, max_shard_size="40KB")
      if os.path.exists(os.path.join(ds, "generation_config.json")):
        os.remove(os.path.join(ds, "generation_config.json"))
      to_legacy_rope(os.path.join(ds, "config.json"))
      assert os.path.exists(os.path.join(ds, "model.safetensors.index.json")), os.listdir(ds)
      re = cls.from_pretrained(ds, attn_implementation="eager").eval().double()
      np.testing.assert_array_equal(forward(re, ids), logits)
    if family == "qwen3":
      db = os.path.join(OUT, "qwen3_bf16")
      copy.deepcopy(model).to(torch.bfloat16).save_pretrained(db, safe_serialization=True)
      if os.path.exists(os.path.join(db, "generation_config.json")):
        os.remove(os.path.join(db, "generation_config.json"))
  make_tokenizer(os.path.join(HERE, "fixtures", "tokenizer", "qwen"))
  total = 0
  for root, _, files in os.walk(os.path.join(HERE, "fixtures")):
    for f in files:
      total += os.path.getsize(os.path.join(root, f))
  print("fixtures total bytes", total)


if __name__ == "__main__":
  main()
