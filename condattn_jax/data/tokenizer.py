"""A thin wrapper over a Hugging Face fast tokenizer (`tokenizer.json`, `tokenizers` library).

  tok = Tokenizer.from_dir("path/to/Qwen3-0.6B")     # or load_tokenizer(path)
  ids = tok.encode("Hello")                          # no BOS for Qwen; BOS for Llama 3
  tok.decode(ids); tok.eos_id; tok.bos_id; tok.document_separator_id

Special tokens come from `tokenizer_config.json` next to `tokenizer.json` when present
(`bos_token`, `eos_token`, `pad_token`, `add_bos_token`); otherwise BOS is the special token the
tokenizer's post-processor prepends (if any) and EOS a well-known name in the vocabulary. `document_separator_id` is the token appended after each document when packing:
`<|endoftext|>` (Qwen, OLMo 2), `<|end_of_text|>` (Llama 3), else the EOS token.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

_DOC_SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>")
_EOS_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>")


def _token_name(value) -> str | None:
  """tokenizer_config.json stores a token as a string or as an AddedToken dict."""
  if value is None:
    return None
  if isinstance(value, dict):
    return value.get("content")
  return str(value)


class Tokenizer:
  """Encode / decode with the special-token ids a training pipeline needs."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
               eos_token: str | None = None, pad_token: str | None = None,
               add_bos: bool | None = None, source: str = "<in memory>"):
    self._tok = tokenizer
    self.source = source
    vocab = tokenizer.get_vocab(with_added_tokens=True)

    def lookup(field, name):
      if name is None:
        return None
      if name not in vocab:
        raise ValueError(f"{source}: {field}={name!r} is not in the tokenizer's vocabulary.")
      return vocab[name]

    if eos_token is None:
      eos_token = next((t for t in _EOS_GUESSES if t in vocab), None)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    # What the tokenizer's own post-processor prepends (Llama 3: <|begin_of_text|>; Qwen: nothing).
    probe = tokenizer.encode("a", add_special_tokens=True).ids
    prepended = tokenizer.id_to_token(probe[0]) if probe else None
    if bos_token is None and prepended in specials:
      bos_token = prepended
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.bos_id = lookup("bos_token", bos_token)
    self.eos_id = lookup("eos_token", eos_token)
    self.pad_id = lookup("pad_token", pad_token)
    sep = next((t for t in _DOC_SEPARATORS if t in vocab), eos_token)
    self.document_separator = sep
    self.document_separator_id = lookup("document separator", sep)
    if add_bos is None:
      add_bos = self.bos_id is not None and prepended == bos_token
    self.add_bos = bool(add_bos) and self.bos_id is not None
    self.special_tokens: dict[str, int] = {
        t.content: i for i, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.special}

  # ------------------------------------------------------------------ construction
  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    """Loads `path/tokenizer.json` (+ `path/tokenizer_config.json` if present); `path` may also be
    the tokenizer.json file itself."""
    if os.path.isfile(path):
      tok_path, directory = path, os.path.dirname(path)
    else:
      tok_path, directory = os.path.join(path, TOKENIZER_FILE), path
    if not os.path.isfile(tok_path):
      where = (f"directory {path!r} holds {sorted(os.listdir(path))}" if os.path.isdir(path)
               else f"{path!r} does not exist")
      raise FileNotFoundError(
          f"No {TOKENIZER_FILE} at {tok_path} ({where}). A Hugging Face fast tokenizer file is needed; "
          "for a model that ships only a slow (sentencepiece) tokenizer, write one with "
          "`AutoTokenizer.from_pretrained(name).save_pretrained(dir)` in transformers.")
    tok = tokenizers.Tokenizer.from_file(tok_path)
    cfg = {}
    cfg_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if os.path.isfile(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)
    add_bos = cfg.get("add_bos_token")
    return cls(tok, bos_token=_token_name(cfg.get("bos_token")), eos_token=_token_name(cfg.get("eos_token")),
               pad_token=_token_name(cfg.get("pad_token")),
               add_bos=None if add_bos is None else bool(add_bos), source=tok_path)

  # ------------------------------------------------------------------ properties
  @property
  def vocab_size(self) -> int:
    """Number of token ids (added tokens included)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tok

  def token_to_id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise KeyError(f"{self.source}: token {token!r} is not in the vocabulary.")
    return i

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  # ------------------------------------------------------------------ encode / decode
  def _finish(self, ids: list[int], add_bos: bool | None, add_eos: bool) -> list[int]:
    if (self.add_bos if add_bos is None else add_bos):
      if self.bos_id is None:
        raise ValueError(f"{self.source}: add_bos=True but this tokenizer has no BOS token.")
      if not ids or ids[0] != self.bos_id:
        ids = [self.bos_id] + ids
    if add_eos:
      if self.eos_id is None:
        raise ValueError(f"{self.source}: add_eos=True but this tokenizer has no EOS token.")
      ids = ids + [self.eos_id]
    return ids

  def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool = False) -> list[int]:
    """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) map to their
    ids. add_bos=None follows the tokenizer (BOS for Llama 3, never for Qwen)."""
    return self._finish(self._tok.encode(text, add_special_tokens=False).ids, add_bos, add_eos)

  def encode_batch(self, texts: Sequence[str], *, add_bos: bool | None = None,
                   add_eos: bool = False) -> list[list[int]]:
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [self._finish(e.ids, add_bos, add_eos) for e in encs]

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, batch: Iterable[Iterable[int]], *, skip_special_tokens: bool = False) -> list[str]:
    return self._tok.decode_batch([[int(i) for i in ids] for ids in batch],
                                  skip_special_tokens=skip_special_tokens)

  def __len__(self) -> int:
    return self.vocab_size

  def __repr__(self) -> str:
    return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, document_separator_id={self.document_separator_id})")


def load_tokenizer(path: str) -> Tokenizer:
  """`Tokenizer.from_dir(path)`."""
  return Tokenizer.from_dir(path)
