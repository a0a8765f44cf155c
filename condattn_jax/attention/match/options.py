"""MATCH options (`model.scheme` of scheme 'match') and the SWA / full layer pattern."""
from __future__ import annotations

import dataclasses

from condattn_jax import ops
from condattn_jax.attention import options

RETRIEVED_KV = ("sequence", "recompute")
ATTENTION_PATHS = ("auto", "block_sparse", "gathered")


@dataclasses.dataclass(frozen=True)
class MatchOptions:
  """The options (`model.scheme.<name>`) of scheme 'match' (defaults: docs/schemes/match.md#options).

  window        local window w of the SWA layers (keys t-w+1..t).
  chunk         c: retrieval chunks are the aligned blocks [j*c, (j+1)*c) of a row; queries are
                grouped in the same blocks (the retrieval interval): block g's query is the c
                tokens ending at its first token (rows g*c-c+1 .. g*c), and its result is shared by
                the block's c queries. Needs chunk <= window.
  top_k         k chunks retrieved per block (0 = no retrieval: a plain SWA / sink+window model).
  swa_ratio     fraction of layers that are SWA (+ retrieval); the others are full attention
                (post-sparsified models: 0.5 / 0.8; pre-sparsified: 1.0). See `layer_kinds`.
  retriever     'exact' (exact match of query key tokens: synthetic tasks), 'minilm' (the
                all-MiniLM-L6-v2 bi-encoder over the chunks' text), 'random' (the control:
                random candidates, content-blind), or 'pkg.module:factory'.
  retriever_kwargs (name, value) pairs for the retriever factory (exact: ignore_tokens;
                minilm: tokenizer = the LLM's tokenizer.json, to turn chunks back into text).
  reranker      '' (none) or 'pkg.module:factory' -> a Reranker (decode only, see retrieval.py).
  rerank_k      with a reranker: the bi-encoder retrieves top_k, the reranker keeps rerank_k.
  retrieved_kv  what the retrieved chunks' K/V are:
                'sequence'  their K/V in this forward (the paper's training / prefill mask:
                            causal AND (window OR retrieved chunks));
                'recompute' the "auxiliary input": the chunks' raw tokens run through every layer
                            again, attending causally among the block's retrieved chunks only
                            (what decode with a window-only cache computes; a full forward in
                            this mode equals generation).
                Decode always recomputes (the window cache has no old K/V).
  prefill_last  m: serving (the engine's prefill with the prompt lengths, and the declared
                serving forward) retrieves only for the blocks holding the last m prompt
                positions (and every generated token's block); earlier prompt positions run the
                window only (the paper's prefill, Sec. 4.2.1, m = 1000). Training ignores it.
  decode_queries the query lengths of the multi-query search (the paper's App. A, e.g. (64,
                128)): a block entered at decode searches once per length L with the L tokens
                ending at its first token, keeps top_k (rerank_k with a reranker) chunks per
                query, duplicates dropped: `slots` = kept_k * len(decode_queries) chunks a
                block. () = one query of c tokens. Prompt blocks (prefill) search with one
                query of c tokens (their results padded to `slots`).
  sinks         StreamingLLM sink tokens kept visible in the SWA layers (full forward only).
  impl          ops.attention impl of the SWA layers' attention ('auto': per lowering platform).
  attention_path how an SWA layer runs "window OR retrieved chunks" in a call of more than one
                token (training, full forwards, the engine's prefill calls; layer.py):
                'block_sparse'  one ops.attention call over the whole row with block lists
                                (pallas_kernels.block_sparse, head mode HEAD_WINDOW_BLOCKS: no
                                gathered keys; recomputed retrieved K/V appended after the keys;
                                on CPU the reference, O(T^2) mask);
                'gathered'      per block, its window and retrieved keys gathered into
                                [B*G, w+c-1+k*c] (the compacted kernel; (w+c+k*c)/c times K/V);
                'auto'          block_sparse where the lowering platform's resolver has a block-
                                sparse kernel that runs the mode at these shapes (Hopper, chunk
                                128, head_dim 64/128, bf16/f16, impl auto/pallas/mosaic_gpu),
                                else gathered (CPU, TPU, other GPUs).
                Both compute the same attention (retrieved chunks lie before every block query's
                window, never overlap it). One-token decode steps always gather.
  """
  window: int = 1024
  chunk: int = 128
  top_k: int = 4
  swa_ratio: float = 1.0
  retriever: str = "exact"
  retriever_kwargs: tuple = ()
  reranker: str = ""
  rerank_k: int = 0
  retrieved_kv: str = "sequence"
  prefill_last: int = 1000
  decode_queries: tuple = ()
  sinks: int = 0
  impl: str = "auto"
  attention_path: str = "auto"

  def __post_init__(self):
    for f in ("window", "chunk"):
      v = getattr(self, f)
      if int(v) != v or v < 1:
        raise ValueError(f"model.scheme.{f}={v!r} must be an int >= 1.")
    if self.chunk > self.window:
      raise ValueError(f"model.scheme.chunk={self.chunk} must be <= window={self.window} "
                       "(a block's queries share the window's retrieved-key slot).")
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"model.scheme.top_k={self.top_k!r} must be an int >= 0.")
    if not 0.0 <= self.swa_ratio <= 1.0:
      raise ValueError(f"model.scheme.swa_ratio={self.swa_ratio} must be in [0, 1].")
    if self.retrieved_kv not in RETRIEVED_KV:
      raise ValueError(f"model.scheme.retrieved_kv={self.retrieved_kv!r}: choose one of "
                       f"{RETRIEVED_KV}.")
    if self.reranker and not 0 < self.rerank_k <= self.top_k:
      raise ValueError(f"model.scheme.rerank_k={self.rerank_k} must be in [1, top_k="
                       f"{self.top_k}] with a reranker.")
    if int(self.prefill_last) != self.prefill_last or self.prefill_last < 0:
      raise ValueError(f"model.scheme.prefill_last={self.prefill_last!r} must be an int >= 0 "
                       "(retrieval for the last m prompt positions).")
    if any(int(L) != L or L < 1 for L in self.decode_queries) or \
        len(set(self.decode_queries)) != len(self.decode_queries):
      raise ValueError(f"model.scheme.decode_queries={self.decode_queries!r} must be distinct "
                       "query lengths >= 1 (e.g. (64, 128)), or () for one query of chunk tokens.")
    if self.sinks < 0:
      raise ValueError(f"model.scheme.sinks={self.sinks} must be >= 0.")
    if self.sinks and self.top_k:
      raise ValueError(f"model.scheme.sinks={self.sinks} is the StreamingLLM baseline "
                       f"(sink + window, no retrieval): set top_k=0 (got {self.top_k}).")
    if self.attention_path not in ATTENTION_PATHS:
      raise ValueError(f"model.scheme.attention_path={self.attention_path!r}: choose one of "
                       f"{ATTENTION_PATHS}.")
    if self.impl not in ops.IMPLS:
      raise ValueError(f"model.scheme.impl={self.impl!r}: choose one of {ops.IMPLS}.")

  @property
  def kept_k(self) -> int:
    """Chunks each decode query keeps (after the optional rerank)."""
    return self.rerank_k if self.reranker else self.top_k

  @property
  def slots(self) -> int:
    """Retrieved-chunk slots per block at serving: kept_k per decode query."""
    return self.kept_k * max(1, len(self.decode_queries))


def layer_kinds(config) -> tuple[str, ...]:
  """'swa' | 'full' per layer: round(L * (1 - swa_ratio)) full layers spread evenly, each at the
  end of its span (L=28, ratio 0.5: layers 1, 3, ..., 27 are full)."""
  L = config.num_layers
  n_full = int(round(L * (1.0 - options(config).swa_ratio)))
  full = {int((i + 1) * L / n_full) - 1 for i in range(n_full)} if n_full else set()
  return tuple("full" if i in full else "swa" for i in range(L))
