"""MATCH retrieval: chunk geometry, retrievers (exact match, MiniLM bi-encoder), reranker plug-in.

Geometry (per row; chunks are the aligned blocks [j*c, (j+1)*c) of row slots, which are the
positions for one document per row):
  block g      queries g*c .. g*c+c-1 share one retrieval result (the retrieval interval);
  its query    the c tokens ending at the block's first token: g*c-c+1 .. g*c (causal);
  candidates   chunks wholly before the window of the block's first query:
               (j+1)*c <= g*c - w + 1 (so retrieval starts once the context exceeds the window),
               whole (every token valid, one document: the block's).
  result       the top_k candidates by score (-1 = empty slot), as chunk ids [B, G, k].

Retrievers (`make_retriever(options)`), two kinds:
  kind 'tokens'     `scores(q_tok_BGc, q_ok_BGc, c_tok_BJc, c_ok_BJc) -> f32 [B, G, J]`, jit-able.
                    ExactMatch: the number of distinct query tokens (outside `ignore_tokens`)
                    found in the chunk; chunks scoring 0 are never retrieved (synthetic tasks:
                    MQAR's query key finds the chunk holding its pair).
                    RandomChunks: the control: top_k candidates picked at random (a hash of the
                    block's query tokens and the chunk id: deterministic, content-blind).
  kind 'embedding'  `embed(tok_BNc, ok_BNc) -> f32 [B, N, E]` unit vectors (jit-able: a host
                    callback is fine), score = cosine. MiniLMRetriever: the LLM's tokens -> text
                    (its tokenizer.json) -> all-MiniLM-L6-v2 (condattn_jax.attention.match.minilm).
Reranker plug-in (decode only, `options.reranker = 'pkg.module:factory'`, factory(**kwargs) ->
  object with `scores(q_tok_Bc, q_ok_Bc, cand_tok_Bkc, cand_ok_Bkc) -> f32 [B, k]`, jit-able,
  e.g. a cross-encoder behind a host callback): the bi-encoder's top_k candidates are rescored and
  the best rerank_k kept. With a reranker, decode differs from the full forward by design.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.attention.match.options import MatchOptions

NEG = -1e30


class Retriever(Protocol):
  kind: str  # 'tokens' | 'embedding'


class ExactMatch:
  """Exact match of the query's key tokens (synthetic, non-language tasks)."""
  kind = "tokens"

  def __init__(self, ignore_tokens=(0,)):
    self.ignore_tokens = tuple(int(t) for t in ignore_tokens)

  def scores(self, q_tok_BGc, q_ok_BGc, c_tok_BJc, c_ok_BJc):
    c = q_tok_BGc.shape[-1]
    ok = q_ok_BGc.astype(bool)
    for t in self.ignore_tokens:
      ok &= q_tok_BGc != t
    # distinct query tokens only: drop a token equal to an earlier kept one of the same query
    earlier = jnp.tril(jnp.ones((c, c), bool), -1)                            # [i, i'] i' < i
    same = q_tok_BGc[..., :, None] == q_tok_BGc[..., None, :]                  # [B, G, c, c]
    dup = jnp.any(same & earlier & ok[..., None, :], axis=-1)
    ok &= ~dup
    hit = jnp.any((q_tok_BGc[:, :, :, None, None] == c_tok_BJc[:, None, None, :, :])
                  & c_ok_BJc[:, None, None, :, :].astype(bool), axis=-1)      # [B, G, c, J]
    return jnp.sum(hit & ok[..., None], axis=2).astype(jnp.float32)


class MiniLMRetriever:
  """The paper's bi-encoder: chunk text -> all-MiniLM-L6-v2 embedding (host callback).

  tokenizer: path of the LLM's tokenizer.json (its ids -> text), or a callable ids -> str."""
  kind = "embedding"
  dim = 384

  def __init__(self, tokenizer, encoder=None):
    from condattn_jax.attention.match.minilm import MiniLMEncoder
    if isinstance(tokenizer, str):
      from tokenizers import Tokenizer
      tok = Tokenizer.from_file(tokenizer)
      self.detokenize = lambda ids: tok.decode(list(ids))
    elif callable(tokenizer):
      self.detokenize = tokenizer
    else:
      raise ValueError("model.scheme.retriever_kwargs.tokenizer must be the LLM's "
                       f"tokenizer.json path (or a callable ids -> text), got {tokenizer!r}.")
    self.encoder = encoder if encoder is not None else MiniLMEncoder.load()

  def embed_host(self, tok_BNc, ok_BNc) -> np.ndarray:
    tok, ok = np.asarray(tok_BNc), np.asarray(ok_BNc).astype(bool)
    B, N, _ = tok.shape
    out = np.zeros((B, N, self.dim), np.float32)
    texts, where = [], []
    for b in range(B):
      for n in range(N):
        if ok[b, n].any():
          texts.append(self.detokenize(tok[b, n][ok[b, n]].tolist()))
          where.append((b, n))
    if texts:
      emb = self.encoder.encode(texts)
      for (b, n), e in zip(where, emb):
        out[b, n] = e
    return out

  def embed(self, tok_BNc, ok_BNc):
    shape = jax.ShapeDtypeStruct(tok_BNc.shape[:2] + (self.dim,), jnp.float32)
    return jax.pure_callback(self.embed_host, shape, tok_BNc, ok_BNc)


class RandomChunks:
  """Random retrieval (the paper's 'Random-k' control): every candidate chunk scores a
  pseudo-random value in [1, 1001) (far above top_chunks' tie-break) from a hash of the block's query tokens, the block's slot and the
  chunk id, so top_k picks random candidates, the same in every forward of the same tokens."""
  kind = "tokens"

  def __init__(self, seed=0):
    self.seed = int(seed)

  def scores(self, q_tok_BGc, q_ok_BGc, c_tok_BJc, c_ok_BJc):
    B, G, c = q_tok_BGc.shape
    J = c_tok_BJc.shape[1]
    mult = jnp.asarray([1000003 * (i + 1) % 2147483 for i in range(c)], jnp.uint32)
    tok = jnp.where(q_ok_BGc.astype(bool), q_tok_BGc, 0).astype(jnp.uint32)
    h_BG = jnp.sum(tok * mult, axis=-1, dtype=jnp.uint32) + jnp.uint32(self.seed * 7919)
    h_BG = h_BG + jnp.arange(G, dtype=jnp.uint32)[None, :] * jnp.uint32(2654435761)
    x = h_BG[..., None] ^ (jnp.arange(J, dtype=jnp.uint32) * jnp.uint32(40503) + jnp.uint32(1))
    for m in (0x7FEB352D, 0x846CA68B):  # integer hash (lowbias32)
      x = (x ^ (x >> 16)) * jnp.uint32(m)
    x = x ^ (x >> 16)
    return 1.0 + 1000.0 * (x >> 8).astype(jnp.float32) / float(1 << 24)


def _import(spec: str, what: str):
  if ":" not in spec:
    raise ValueError(f"model.scheme.{what}={spec!r}: give 'pkg.module:factory'.")
  mod, name = spec.split(":", 1)
  return getattr(importlib.import_module(mod), name)


_CACHE: dict = {}


def make_retriever(o: MatchOptions):
  """The options' retriever (built once per (name, kwargs): MiniLM loads 90 MB of weights)."""
  key = ("retriever", o.retriever, o.retriever_kwargs)
  if key not in _CACHE:
    kw = dict(o.retriever_kwargs)
    if o.retriever == "exact":
      _CACHE[key] = ExactMatch(**kw)
    elif o.retriever == "random":
      _CACHE[key] = RandomChunks(**kw)
    elif o.retriever == "minilm":
      tk = kw.get("tokenizer")
      if tk is None or (isinstance(tk, str) and (not tk or tk.startswith("REQUIRED"))):
        raise ValueError("model.scheme.retriever='minilm' needs retriever_kwargs "
                         "tokenizer=<the LLM's tokenizer.json> (to turn chunks into text); "
                         "set --config.model.scheme.retriever_kwargs.tokenizer.")
      _CACHE[key] = MiniLMRetriever(**kw)
    else:
      _CACHE[key] = _import(o.retriever, "retriever")(**kw)
  return _CACHE[key]


def make_reranker(o: MatchOptions):
  if not o.reranker:
    return None
  key = ("reranker", o.reranker)
  if key not in _CACHE:
    _CACHE[key] = _import(o.reranker, "reranker")()
  return _CACHE[key]


# ------------------------------------------------------------------------------------------------
# Geometry and top-k
# ------------------------------------------------------------------------------------------------

def query_slots(block_start_BG, c: int):
  """Slots of each block's query: g*c-c+1 .. g*c  -> int32 [B, G, c] (may be < 0: invalid)."""
  return block_start_BG[..., None] - (c - 1) + jnp.arange(c, dtype=jnp.int32)


def candidates(block_start_BG, chunk_ok_BJ, *, c: int, window: int):
  """bool [B, G, J]: chunk j is wholly before the window of block g's first query, and whole."""
  J = chunk_ok_BJ.shape[1]
  end_J = (jnp.arange(J, dtype=jnp.int32) + 1) * c
  return (end_J[None, None, :] <= block_start_BG[..., None] - window + 1) & chunk_ok_BJ[:, None, :]


def top_chunks(scores_BGJ, cand_BGJ, k: int, *, positive_only: bool):
  """Top-k candidate chunk ids [B, G, k] (-1 = empty); ties go to the later chunk."""
  J = scores_BGJ.shape[-1]
  if k == 0 or J == 0:
    return jnp.full(scores_BGJ.shape[:2] + (k,), -1, jnp.int32)
  ok = cand_BGJ & (scores_BGJ > 0) if positive_only else cand_BGJ
  tie = jnp.arange(J, dtype=jnp.float32) / (2.0 * (J + 1))  # < 0.5: never beats a score step
  s = jnp.where(ok, scores_BGJ.astype(jnp.float32) * 1.0 + (tie if positive_only else tie * 1e-6),
                NEG)
  kk = min(k, J)
  top_s, top_j = jax.lax.top_k(s, kk)
  ids = jnp.where(top_s > NEG / 2, top_j, -1).astype(jnp.int32)
  if kk < k:
    ids = jnp.concatenate([ids, jnp.full(ids.shape[:2] + (k - kk,), -1, jnp.int32)], axis=-1)
  return ids


def retrieve(o: MatchOptions, q_tok_BGc, q_ok_BGc, block_start_BG, chunk_tok_BJc, chunk_ok_BJ,
             chunk_emb_BJE=None, cand_BGJ=None):
  """Chunk ids [B, G, top_k] for each block (see the module docstring). chunk_emb_BJE: the
  chunks' embeddings when the retriever is an embedding one (else computed here); cand_BGJ: an
  extra candidate condition (the block's document)."""
  r = make_retriever(o)
  cand = candidates(block_start_BG, chunk_ok_BJ, c=o.chunk, window=o.window)
  if cand_BGJ is not None:
    cand &= cand_BGJ
  if r.kind == "tokens":
    s = r.scores(q_tok_BGc, q_ok_BGc, chunk_tok_BJc,
                 jnp.broadcast_to(chunk_ok_BJ[..., None], chunk_tok_BJc.shape))
    return top_chunks(s, cand, o.top_k, positive_only=True)
  if chunk_emb_BJE is None:
    chunk_emb_BJE = r.embed(chunk_tok_BJc, jnp.broadcast_to(chunk_ok_BJ[..., None],
                                                            chunk_tok_BJc.shape))
  q_emb = r.embed(q_tok_BGc, q_ok_BGc)
  s = jnp.einsum("bge,bje->bgj", q_emb, chunk_emb_BJE, precision=jax.lax.Precision.HIGHEST)
  return top_chunks(s, cand, o.top_k, positive_only=False)


def rerank(o: MatchOptions, ids_BGk, q_tok_BGc, q_ok_BGc, chunk_tok_BJc, chunk_ok_BJ):
  """Keeps the reranker's best rerank_k of the retrieved ids (ids_BGk unchanged without one)."""
  rr = make_reranker(o)
  if rr is None:
    return ids_BGk
  B, G, k = ids_BGk.shape
  safe = jnp.maximum(ids_BGk, 0)
  cand_tok = jnp.take_along_axis(chunk_tok_BJc[:, None], safe[..., None], axis=2)  # [B,G,k,c]
  cand_ok = (ids_BGk >= 0)[..., None] & jnp.take_along_axis(
      jnp.broadcast_to(chunk_ok_BJ[:, None, :, None], (B, 1) + chunk_tok_BJc.shape[1:]),
      safe[..., None], axis=2)
  flat = lambda x: x.reshape((B * G,) + x.shape[2:])
  s = rr.scores(flat(q_tok_BGc), flat(q_ok_BGc), flat(cand_tok), flat(cand_ok)).reshape(B, G, k)
  s = jnp.where(ids_BGk >= 0, s, NEG)
  top_s, pos = jax.lax.top_k(s, o.rerank_k)
  kept = jnp.take_along_axis(ids_BGk, pos, axis=-1)
  return jnp.where(top_s > NEG / 2, kept, -1)
