"""condattn_jax.data.tokenizer on the tiny Qwen-style fixture and an in-memory Llama-3-style one."""
import json
import os
import shutil

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

from condattn_jax.data.tokenizer import Tokenizer, load_tokenizer

QWEN_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tokenizer", "qwen")


@pytest.fixture(scope="module")
def qwen():
  return load_tokenizer(QWEN_DIR)


def test_qwen_special_tokens(qwen):
  assert qwen.bos_id is None and not qwen.add_bos  # Qwen has no BOS
  eot = qwen.token_to_id("<|endoftext|>")
  assert qwen.eos_id == eot == qwen.document_separator_id == qwen.pad_id
  assert set(qwen.special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
  assert qwen.vocab_size == len(qwen) > max(qwen.special_tokens.values())


def test_encode_decode_round_trip(qwen):
  for text in ["Hello world, the fox!", "héllo 世界 \n\t x", "", "def f(x):\n    return x * 2\n"]:
    ids = qwen.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert qwen.decode(ids) == text
  assert qwen.encode("") == []


def test_special_tokens_in_text_and_eos(qwen):
  ids = qwen.encode("<|im_start|>Hello<|im_end|>", add_eos=True)
  assert ids[0] == qwen.special_tokens["<|im_start|>"]
  assert ids[-2] == qwen.special_tokens["<|im_end|>"]
  assert ids[-1] == qwen.eos_id
  assert qwen.decode(ids) == "<|im_start|>Hello<|im_end|><|endoftext|>"
  assert qwen.decode(ids, skip_special_tokens=True) == "Hello"
  with pytest.raises(ValueError, match="no BOS"):
    qwen.encode("x", add_bos=True)


def test_batch_matches_single(qwen):
  texts = ["The quick brown fox", "jumps over", "the lazy dog."]
  batch = qwen.encode_batch(texts, add_eos=True)
  assert batch == [qwen.encode(t, add_eos=True) for t in texts]
  assert qwen.decode_batch([b[:-1] for b in batch]) == texts


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"No tokenizer\.json at .*" + str(tmp_path.name)):
    load_tokenizer(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_tokenizer(str(tmp_path / "nope"))


def test_loads_file_path_and_without_config(tmp_path, qwen):
  shutil.copy(os.path.join(QWEN_DIR, "tokenizer.json"), tmp_path / "tokenizer.json")
  tok = Tokenizer.from_dir(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: guesses
  assert tok.bos_id is None
  assert tok.eos_id == tok.document_separator_id == qwen.eos_id
  assert tok.encode("fox") == qwen.encode("fox")


def test_unknown_configured_token_is_a_clear_error(tmp_path):
  shutil.copy(os.path.join(QWEN_DIR, "tokenizer.json"), tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match=r"eos_token='<\|nope\|>' is not in the tokenizer's vocabulary"):
    load_tokenizer(str(tmp_path))


def _llama3_style(tmp_path, with_config):
  """Word-level tokenizer whose post-processor prepends <|begin_of_text|> (as Llama 3's does)."""
  vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|eot_id|>": 2, "[UNK]": 3, "hello": 4,
           "world": 5}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
  tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
  tok.save(str(tmp_path / "tokenizer.json"))
  if with_config:  # instruct model: eos is <|eot_id|>, documents still end with <|end_of_text|>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"}))
  return load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("with_config", [False, True])
def test_bos_added_when_the_tokenizer_adds_it(tmp_path, with_config):
  tok = _llama3_style(tmp_path, with_config)
  assert tok.document_separator_id == 1
  assert tok.eos_id == (2 if with_config else 1)
  if with_config:
    assert tok.bos_id == 0 and tok.add_bos
    assert tok.encode("hello world") == [0, 4, 5]
    assert tok.encode("hello world", add_bos=False) == [4, 5]
    assert tok.encode_batch(["hello", "world"], add_eos=True) == [[0, 4, 2], [0, 5, 2]]
  else:  # no config: BOS is guessed from the vocabulary and found in the post-processor's output
    assert tok.bos_id == 0 and tok.add_bos
    assert tok.encode("hello") == [0, 4]
