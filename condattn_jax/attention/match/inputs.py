"""MATCH's per-forward retrieval state: which chunks each block retrieves, and the auxiliary input.

`block_inputs` (full forward, slots = row indices) and `MatchInputs` (decode, slots = positions;
it owns the raw-token cache: the "compact cache of original inputs") produce the same fields:

  match_chunks_BGk     int32 [B, G, k]: retrieved chunk ids of block g (-1 = empty); chunk j is
                       slots [j*c, (j+1)*c).
  match_block_BG       int32 [B, G]: slot of block g's first query (a multiple of c).
  match_block_pos_BG   int32 [B, G]: its position (what the retrieved keys' mask slot uses).
  match_base_B         int32 [B]: slot of row 0 of this call (0 in a full forward; the chunk's
                       first position in decode), so query t of row b is slot base + t.
  match_doc_BG         int32 [B, G]: the block's document id (0 = none).
  match_aux_block_BG   int32 [B, G] (engine prefill with prompt lengths only): the auxiliary
                       block of block g (-1 = none): the aux rows then hold only the blocks
                       that retrieve (at most ceil(m / c) + 1, see `block_retrieves`).
and, when the retrieved K/V are recomputed (options.retrieved_kv='recompute', and always in
decode), the auxiliary input: the retrieved chunks' raw tokens, block-major (aux row
g*k*c + s*c + i = token i of block g's s-th chunk), returned as tokens [B, A = G*k*c] next to
  match_aux_pos_BA     int32 [B, A]: their positions;   match_aux_ok_BA  int32 [B, A]: 1 = real.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from condattn_jax.attention.match import retrieval
from condattn_jax.attention import options
from condattn_jax.attention.match.options import MatchOptions
from condattn_jax.parallel import context


def _take(x_BS, idx_BN):
  """x[b, idx[b, ...]] with idx clipped into range (callers mask what is out of range)."""
  S = x_BS.shape[1]
  flat = jnp.clip(idx_BN, 0, S - 1).reshape(idx_BN.shape[0], -1)
  out = jnp.take_along_axis(x_BS, flat.reshape(flat.shape + (1,) * (x_BS.ndim - 2)), axis=1)
  return out.reshape(idx_BN.shape + x_BS.shape[2:])


def num_blocks(T: int, c: int, decode: bool) -> int:
  """Blocks a call of T queries can touch: ceil(T / c) from an aligned start (full forward),
  ceil((T + c - 1) / c) from any start (decode / chunked prefill)."""
  return -(-(T + (c - 1 if decode else 0)) // c)


def block_retrieves(o: MatchOptions, block_start_BG, prompt_len_B):
  """bool [B, G]: block g retrieves (the paper's prefill, Sec. 4.2.1: retrieval only for the last
  m = options.prefill_last prompt positions): its last slot is >= P - m, P = the row's prompt
  length, so every block of generated tokens and the blocks holding the last m prompt positions
  retrieve, and earlier prompt blocks run the window only."""
  return block_start_BG + (o.chunk - 1) >= (prompt_len_B[:, None] - o.prefill_last)


def _call_blocks(o: MatchOptions, start: int, T: int, prompt_len_B):
  """On the host (numpy): (prompt lengths [B] int64, G, the start position of each of the G
  blocks [G]) of an engine prefill call of T tokens at positions start .. start + T - 1."""
  import numpy as np
  G = num_blocks(T, o.chunk, decode=True)
  return (np.asarray(prompt_len_B, np.int64), G,
          (start // o.chunk) * o.chunk + np.arange(G) * o.chunk)


def call_retrieves(o: MatchOptions, start: int, T: int, prompt_len_B) -> bool:
  """On the host (numpy): whether an engine prefill call of T tokens at positions start ..
  start + T - 1 (every row the same, as Engine's prefill calls) holds a block that retrieves for
  some row, i.e. whether MatchInputs' aux rows can be real (the condition `block_retrieves`
  applies to its Ga aux blocks, reproduced here with the same integer arithmetic; a row of
  prompt length 0 holds no token, so no chunk: never real). False: the
  call's aux rows are all empty whatever the data, so it may run as SWA's call
  (ctx.fields['match_call_retrieves'] = False)."""
  import numpy as np
  P, G, start_G = _call_blocks(o, start, T, prompt_len_B)
  _, g_aux = aux_blocks(o, G, P, start_G[0], np)
  # (a row of no tokens, e.g. Engine.serve's padding rows, has no chunk to retrieve)
  return bool(np.any(block_retrieves(o, start_G[g_aux], P) & (P[:, None] > 0)))


def call_aux_blocks(o: MatchOptions, start: int, T: int, prompt_len_B) -> int:
  """On the host (numpy): the aux blocks an engine prefill call of T tokens at positions
  start .. start + T - 1 needs: ceil(m / c) where no row (prompt length > 0) has more blocks
  that hold one of its prompt tokens of this call and retrieve (`block_retrieves`), else the
  bound ceil(m / c) + 1 (the last m positions straddle one more block); two values, so at most
  one more program a chunk shape. `aux_blocks` with this Ga still covers each row's such blocks
  (its window starts at the row's first retrieving block, or ends at the call's last block):
  the queries read what they read with the bound; a block that holds no query of the call
  (after the prompt: the block the first generated token enters) may get no aux rows."""
  import numpy as np
  c = o.chunk
  P, _, start_G = _call_blocks(o, start, T, prompt_len_B)
  holds = (start_G[None, :] < np.minimum(start + T, P)[:, None]) & (P[:, None] > 0)
  n = int(np.sum(holds & block_retrieves(o, start_G[None, :], P), axis=1).max(initial=0))
  fewer = -(-o.prefill_last // c)
  return fewer if n <= fewer else fewer + 1


def aux_blocks(o: MatchOptions, G: int, prompt_len_B, first_start_B, xp=jnp, Ga=None):
  """(Ga, g_aux [B, Ga]): the Ga blocks of a prefill call of G blocks that may retrieve, from
  the first one holding one of the row's last m = prefill_last prompt positions (first_start_B:
  the position of the call's first block; xp: jnp traced, numpy on the host). Ga: the static
  bound min(G, ceil(m / c) + 1), or (given: the engine's `call_aux_blocks`) fewer."""
  c = o.chunk
  Ga = min(G, (o.prefill_last + c - 1) // c + 1, *(() if Ga is None else (Ga,)))
  first = -(-(prompt_len_B - o.prefill_last - (c - 1) - first_start_B) // c)
  return Ga, xp.clip(first, 0, G - Ga)[:, None] + xp.arange(Ga, dtype=first.dtype)


def pad_ids(ids_BGn, width: int):
  """Chunk ids padded with -1 to `width` slots (a single-query search among multi-query ones)."""
  n = ids_BGn.shape[-1]
  if n >= width:
    return ids_BGn
  return jnp.concatenate([ids_BGn, jnp.full(ids_BGn.shape[:-1] + (width - n,), -1, jnp.int32)],
                         axis=-1)


def multi_query_ids(o: MatchOptions, query, block_start_BG, chunk_tok_BJc, chunk_ok_BJ,
                    chunk_emb_BJE=None, cand_BGJ=None):
  """The paper's multi-query search (App. A): for each length L in options.decode_queries the
  query `query(L) -> (tokens, ok) [B, G, L]` (the L tokens ending at the block's first token)
  retrieves top_k chunks, reranked to kept_k; the results concatenated, a chunk already kept by
  an earlier query dropped (-1): ids [B, G, options.slots]."""
  outs = []
  for L in o.decode_queries:
    q_tok, q_ok = query(L)
    ids = retrieval.retrieve(o, q_tok, q_ok, block_start_BG, chunk_tok_BJc, chunk_ok_BJ,
                             chunk_emb_BJE, cand_BGJ)
    outs.append(retrieval.rerank(o, ids, q_tok, q_ok, chunk_tok_BJc, chunk_ok_BJ))
  ids = jnp.concatenate(outs, axis=-1)
  n = ids.shape[-1]
  earlier = jnp.tril(jnp.ones((n, n), bool), -1)
  dup = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier, axis=-1)
  return jnp.where(dup, -1, ids)


def aux_input(o: MatchOptions, ids_BGk, tokens_BS, positions_BS, ok_BS):
  """The retrieved chunks' raw tokens, positions and validity, block-major [B, G*k*c]."""
  B, G, k = ids_BGk.shape
  c = o.chunk
  rows = ids_BGk[..., None] * c + jnp.arange(c, dtype=jnp.int32)        # [B, G, k, c]
  ok = (ids_BGk >= 0)[..., None] & (_take(ok_BS, rows) != 0)
  rows = rows.reshape(B, -1)
  tok = jnp.where(ok.reshape(B, -1), _take(tokens_BS, rows), 0)
  pos = _take(positions_BS, rows)
  return tok, pos, ok.reshape(B, -1).astype(jnp.int32)


def block_inputs(o: MatchOptions, tokens_BT, positions_BT, segment_ids_BT=None, *,
                 recompute: bool | None = None, chunks_BGk=None, prompt_len_B=None):
  """Full forward: (aux tokens [B, A] or None, fields). Slots are row indices; a chunk or query
  is used only inside one document (segment ids). chunks_BGk: retrieval results computed
  elsewhere (e.g. MiniLM in the data pipeline: batch field 'match_chunks_BGk'), used as given.
  prompt_len_B: the serving forward (rows = prompt + generated tokens): only the blocks
  `block_retrieves` keeps retrieve; None (training): every block."""
  B, T = tokens_BT.shape
  c = o.chunk
  seg = (jnp.ones((B, T), jnp.int32) if segment_ids_BT is None
         else segment_ids_BT.astype(jnp.int32))
  G = num_blocks(T, c, decode=False)
  start_BG = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32) * c, (B, G))
  doc_BG = _take(seg, start_BG)
  q_slots = retrieval.query_slots(start_BG, c)
  q_ok = (q_slots >= 0) & (_take(seg, q_slots) == doc_BG[..., None]) & (doc_BG[..., None] != 0)
  q_tok = _take(tokens_BT, q_slots)
  J = T // c
  chunk_tok = tokens_BT[:, :J * c].reshape(B, J, c)
  chunk_seg = seg[:, :J * c].reshape(B, J, c)
  chunk_ok = jnp.all(chunk_seg == chunk_seg[..., :1], axis=-1) & (chunk_seg[..., 0] != 0)
  same_doc = chunk_seg[:, None, :, 0] == doc_BG[..., None]
  if chunks_BGk is not None:
    if chunks_BGk.shape != (B, G, o.top_k):
      raise ValueError(f"fields['match_chunks_BGk'] has shape {chunks_BGk.shape}; MATCH needs "
                       f"[B, ceil(T / chunk), top_k] = {(B, G, o.top_k)}.")
    ids = chunks_BGk.astype(jnp.int32)
  elif o.top_k and J:
    ids = retrieval.retrieve(o, q_tok, q_ok, start_BG, chunk_tok, chunk_ok, cand_BGJ=same_doc)
  else:
    ids = jnp.full((B, G, o.top_k), -1, jnp.int32)
  if prompt_len_B is not None:
    P = jnp.asarray(prompt_len_B, jnp.int32)
    if o.decode_queries and o.top_k and J and chunks_BGk is None:
      def query(L):
        qs = start_BG[..., None] - (L - 1) + jnp.arange(L, dtype=jnp.int32)
        ok = (qs >= 0) & (_take(seg, qs) == doc_BG[..., None]) & (doc_BG[..., None] != 0)
        return _take(tokens_BT, qs), ok
      multi = multi_query_ids(o, query, start_BG, chunk_tok, chunk_ok, cand_BGJ=same_doc)
      decoded = (start_BG >= P[:, None])[..., None]  # blocks decode enters (searched there)
      ids = jnp.where(decoded, multi, pad_ids(ids, o.slots))
    ids = jnp.where(block_retrieves(o, start_BG, P)[..., None], ids, -1)
  fields = dict(match_chunks_BGk=ids, match_block_BG=start_BG,
                match_block_pos_BG=_take(positions_BT.astype(jnp.int32), start_BG),
                match_base_B=jnp.zeros((B,), jnp.int32), match_doc_BG=doc_BG)
  if recompute is None:
    recompute = o.retrieved_kv == "recompute"
  if not (recompute and o.top_k):
    return None, fields
  tok, pos, ok = aux_input(o, ids, tokens_BT, positions_BT.astype(jnp.int32), seg)
  fields.update(match_aux_pos_BA=pos, match_aux_ok_BA=ok)
  return tok, fields


class MatchInputs(nn.Module):
  """MATCH's scheme module (`Scheme.module`): `(tokens_BT, ctx) -> (aux tokens [B, A] or None,
  fields, {})`; the decoder appends the aux tokens' embeddings after the chunk's rows and hands
  `fields` to every layer in ctx.fields.

  Full forward: `block_inputs`. Decode (ctx.decode): cache variables
    tokens  [B, cache_len] int32  every token seen so far, at its position (4 bytes per token:
                                  the raw input the retrieved chunks' K/V are recomputed from)
    length  [B] int32             tokens written
    block   [B] int32             1 + the block of each row's last refresh (decode refreshes the
                                  retrieved K/V when a row enters a new block: match_fresh_B,
                                  match_g_last_B = the block, within this call, of its last token)
    ids     [B, top_k] int32          the chunks retrieved for the block of each row's last refresh
    chunk_emb [B, cache_len // c, E] float32 (embedding retrievers only): each whole chunk's
                                  embedding, computed once (in the prefill call that completes
                                  it, or in decode when the row enters the block after it)
  A prefill call (T > 1) with the prompt lengths (ctx.fields['prompt_len_B'], which the engine
  passes) retrieves, and builds auxiliary rows, only for the blocks `block_retrieves` keeps (the
  last m prompt positions: at most Ga = ceil(m / c) + 1 blocks a call, a static count, so the
  recompute costs Ga*k*c rows instead of G*k*c); without them, for every block it touches. A
  decode call (T = 1) searches (query encode, chunk encode, scores, the rerank plug-in) only when
  some row enters a new block (lax.cond) and otherwise reuses `ids`: retrieval runs once per
  block, not per token.
  """
  config: object

  @nn.compact
  def __call__(self, tokens_BT, ctx):
    o = options(self.config)
    prompt_len_B = ctx.fields.get("prompt_len_B")
    if not ctx.decode:
      n = context.layout_size()  # sequence parallel: retrieval reads the natural row
      if n > 1 and o.top_k and o.retrieved_kv != "sequence":
        raise ValueError(f"model.scheme.retrieved_kv={o.retrieved_kv!r} appends auxiliary rows "
                         "that sequence parallelism does not split; use retrieved_kv='sequence' "
                         "or config.mesh.sequence=1.")
      nat = lambda x: context.from_layout(x, n)
      return (*block_inputs(o, nat(tokens_BT), nat(ctx.positions_BT), nat(ctx.segment_ids_BT),
                            chunks_BGk=ctx.fields.get("match_chunks_BGk"),
                            prompt_len_B=prompt_len_B), {})
    if ctx.cache_len is None:
      raise ValueError("decode=True needs cache_len (the longest sequence to decode).")
    B, T = tokens_BT.shape
    c, S = o.chunk, ctx.cache_len
    raw = self.variable("cache", "tokens", jnp.zeros, (B, S), jnp.int32)
    length = self.variable("cache", "length", jnp.zeros, (B,), jnp.int32)
    r = retrieval.make_retriever(o) if o.top_k else None
    J = S // c
    emb = None
    if r is not None and r.kind == "embedding":
      emb = self.variable("cache", "chunk_emb", jnp.zeros, (B, J, r.dim), jnp.float32)
    valid = ctx.valid_BT
    pos = ctx.positions_BT.astype(jnp.int32)
    rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    raw.value = raw.value.at[rows_BT, jnp.where(valid, pos, S)].set(tokens_BT.astype(jnp.int32),
                                                                     mode="drop")
    old_len = length.value
    new_len = old_len + jnp.sum(valid, axis=1, dtype=jnp.int32)
    length.value = new_len
    G = num_blocks(T, c, decode=True)
    base = pos[:, 0]
    start_BG = (base // c)[:, None] * c + jnp.arange(G, dtype=jnp.int32) * c
    known_S = jnp.arange(S, dtype=jnp.int32)[None, :] < new_len[:, None]
    chunk_tok = raw.value[:, :J * c].reshape(B, J, c)
    chunk_ok = (jnp.arange(J, dtype=jnp.int32)[None, :] + 1) * c <= new_len[:, None]
    # the blocks that may retrieve in this call: all G, or (prefill with prompt lengths) the Ga
    # blocks from the first one holding one of the last m prompt positions
    Ga, g_aux = G, None
    # the engine's static fact (call_retrieves on the host; None: unknown): False = none of
    # this call's blocks retrieves, so no search, no aux rows (the layers run SWA's call)
    static = ctx.fields.get("match_call_retrieves") if T > 1 and prompt_len_B is not None else None
    if T > 1 and prompt_len_B is not None:
      P = jnp.asarray(prompt_len_B, jnp.int32)
      # (a retrieving call: the engine's exact count, call_aux_blocks, where it gives one)
      Ga, g_aux = aux_blocks(o, G, P, start_BG[:, 0], Ga=(
          ctx.fields.get("match_aux_blocks") if static is True else None))  # [B, Ga]
    start_q = start_BG if g_aux is None else jnp.take_along_axis(start_BG, g_aux, axis=1)
    q_slots = retrieval.query_slots(start_q, c)
    q_ok = (q_slots >= 0) & (q_slots < new_len[:, None, None])
    q_tok = _take(raw.value, q_slots)
    # refresh: a row whose last token here is in another block than at its last refresh
    # recomputes the retrieved K/V (every layer reads the same decision); retrieval (and the
    # retriever's encode) runs only then: once per block in decode, every call in prefill
    blk = self.variable("cache", "block", jnp.zeros, (B,), jnp.int32)  # block id + 1; 0 = none
    n = jnp.sum(valid, axis=1, dtype=jnp.int32)
    last = base + jnp.maximum(n - 1, 0)
    fresh = (n > 0) & ((last // c + 1 != blk.value) | (T > 1))
    blk.value = jnp.where(fresh, last // c + 1, blk.value)
    g_last = last // c - base // c
    rowsG = jnp.broadcast_to(jnp.arange(B)[:, None], (B, G))

    def search_embed(emb_BJE):
      """The chunk embeddings with the chunks completed since the last search (prefill: those
      this call completes; decode: the chunk before the block entered) embedded."""
      j_BG = start_BG // c - (0 if T > 1 else 1)
      done = (j_BG >= 0) & ((j_BG + 1) * c <= new_len[:, None])
      if T > 1:
        done &= (j_BG + 1) * c > old_len[:, None]
      new_tok = _take(raw.value, j_BG[..., None] * c + jnp.arange(c, dtype=jnp.int32))
      new_emb = r.embed(new_tok, jnp.broadcast_to(done[..., None], new_tok.shape))
      return emb_BJE.at[rowsG, jnp.where(done, j_BG, J)].set(new_emb, mode="drop")

    def search(emb_BJE):
      """(ids [B, G, k], chunk embeddings): `search_embed`, then retrieves and reranks."""
      if emb_BJE is not None:
        emb_BJE = search_embed(emb_BJE)
      if T == 1 and o.decode_queries:
        def query(L):
          qs = start_q[..., None] - (L - 1) + jnp.arange(L, dtype=jnp.int32)
          return _take(raw.value, qs), (qs >= 0) & (qs < new_len[:, None, None])
        return multi_query_ids(o, query, start_q, chunk_tok, chunk_ok, emb_BJE), emb_BJE
      ids = retrieval.retrieve(o, q_tok, q_ok, start_q, chunk_tok, chunk_ok, emb_BJE)
      ids = retrieval.rerank(o, ids, q_tok, q_ok, chunk_tok, chunk_ok)
      return pad_ids(ids, o.slots), emb_BJE

    refuse = None
    if static is False:
      # no block of the call retrieves: ids stay -1 (what the masked search would give); the
      # chunks this call completes are still embedded (later calls search them). Where the
      # data says otherwise (the host's fact wrong) the layers poison the output (NaN) instead
      # of silently skipping the retrieval (match_refuse)
      refuse = jnp.any(block_retrieves(o, start_q, P) & (P[:, None] > 0))
      ids = jnp.full((B, Ga, o.slots), -1, jnp.int32)
      if r is not None and J:
        kept = self.variable("cache", "ids", jnp.full, (B, o.slots), -1, jnp.int32)
      if emb is not None and J:
        emb.value = search_embed(emb.value)
    elif r is None or J == 0:
      ids = jnp.full((B, Ga, o.slots), -1, jnp.int32)
    else:
      kept = self.variable("cache", "ids", jnp.full, (B, o.slots), -1, jnp.int32)
      emb0 = None if emb is None else emb.value
      if T > 1:
        ids, emb1 = search(emb0)
      else:  # decode: search only when a row enters a new block, else reuse the block's ids
        reuse = lambda e: (jnp.broadcast_to(kept.value[:, None], (B, G, o.slots)), e)
        # the engine's static fact (MatchLayer.decode_fields; None: unknown, a lax.cond)
        enters = ctx.fields.get("match_step_enters")
        ids, emb1 = (search(emb0) if enters is True else reuse(emb0) if enters is False
                     else jax.lax.cond(jnp.any(fresh), search, reuse, emb0))
        ids = jnp.where(fresh[:, None, None], ids, kept.value[:, None])
      if emb is not None:
        emb.value = emb1
    aux_ids = ids                                                                 # [B, Ga, k]
    if g_aux is not None:
      aux_ids = jnp.where(block_retrieves(o, start_q, P)[..., None], ids, -1)
      ids = jnp.full((B, G, ids.shape[-1]), -1, jnp.int32).at[
          jnp.arange(B)[:, None], g_aux].set(aux_ids)
    if r is not None and J:
      pick = jnp.take_along_axis(ids, g_last[:, None, None], axis=1)[:, 0]
      kept.value = jnp.where(fresh[:, None], pick, kept.value)
    one = jnp.ones((B, G), jnp.int32)
    fields = dict(match_chunks_BGk=ids, match_block_BG=start_BG, match_block_pos_BG=start_BG,
                  match_base_B=base, match_doc_BG=one, match_fresh_B=fresh,
                  match_g_last_B=g_last)
    if g_aux is not None:
      idx = jnp.arange(G, dtype=jnp.int32)[None, :] - g_aux[:, :1]
      fields["match_aux_block_BG"] = jnp.where((idx >= 0) & (idx < Ga), idx, -1)
    if not o.top_k:
      return None, fields, {}
    tok = None
    reuse_step = T == 1 and ctx.fields.get("match_step_enters") is False
    if reuse_step:  # no aux rows: the layers read the block's stored K/V (the host's fact
      fields["match_step_refuse"] = jnp.any(fresh)  # wrong: their heads NaN, MatchLayer)
    elif refuse is not None:  # no aux rows: the layers run SWA's call (MatchLayer.__call__)
      fields["match_refuse"] = refuse
    else:
      tok, apos, aok = aux_input(o, aux_ids, raw.value, jnp.broadcast_to(
          jnp.arange(S, dtype=jnp.int32), (B, S)), known_S.astype(jnp.int32))
      fields.update(match_aux_pos_BA=apos, match_aux_ok_BA=aok)
    # per-row serving statistics (the engine's Generation.stats[...]['scheme']): searches_B =
    # 1 where this call searched and recomputed the row's retrieved K/V (decode: the row
    # entered a new block; prefill: every call), retrieved_B = the retrieved chunks its
    # queries read (summed over the call's query blocks that hold a valid query)
    q_blk = (start_BG < new_len[:, None]) & (start_BG + c > old_len[:, None])     # [B, G]
    read_B = jnp.sum(jnp.where(q_blk[..., None], ids >= 0, False), axis=(1, 2))
    stats = dict(searches_B=(fresh & (J > 0)).astype(jnp.float32),
                 retrieved_B=jnp.where(n > 0, read_B, 0).astype(jnp.float32))
    return tok, fields, stats
