"""MATCH inference through inference.Engine (greedy generation == the 'recompute' full forward,
ragged, one-shot and chunked prefill in chunks not aligned to the blocks of 3:
tests/schemes/test_conformance.py on the same geometry); the 'recompute' forward really
retrieves and differs from 'sequence'; the SWA
layers' caches are a window ring + a fixed-size retrieved-K/V cache (flat in cache_len); the
retrieved K/V are recomputed once per decoding block and reused in between."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import host_init
from condattn_jax import attention
from condattn_jax.attention import match
from condattn_jax.inference import Engine, cache_bytes
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

RNG = np.random.default_rng(0)
PROMPTS = [list(RNG.integers(1, 6, 29)), list(RNG.integers(1, 6, 17)), list(RNG.integers(1, 6, 8))]
NEW = 14
W, C, K = 6, 3, 2


def _cfg(**kw):
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=3, vocab_size=16)
  return attention.configure(base, "match", **{**dict(window=W, chunk=C, top_k=K, swa_ratio=0.7,
                                            retrieved_kv="recompute"), **kw})


@pytest.fixture(scope="module")
def model():
  cfg = _cfg()
  assert match.layer_kinds(cfg) == ("swa", "swa", "full")
  params = host_init(cfg, 0)
  return cfg, params


def _full_forward(cfg, params, seqs):
  """One jitted full forward over right-padded rows (padding = segment 0)."""
  L = max(map(len, seqs))
  tok, seg = np.zeros((len(seqs), L), np.int32), np.zeros((len(seqs), L), np.int32)
  for b, s in enumerate(seqs):
    tok[b, :len(s)], seg[b, :len(s)] = s, 1
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), tok.shape)
  return jax.jit(Decoder(cfg).apply)({"params": params}, tok, pos, seg)


def test_recompute_forward_serves_retrieval_and_differs_from_sequence(model):
  """The forward generation equals (tests/schemes/test_conformance.py: MATCH's
  serving_forward, 'recompute') really retrieves for the SWA layers here, and differs from the
  'sequence' mode (deeper layers: an approximation)."""
  cfg, params = model
  full, aux = _full_forward(cfg, params, PROMPTS)
  assert float(aux["retrieved"][0]) > 0.2  # retrieval really served the SWA layers
  exact, _ = _full_forward(_cfg(retrieved_kv="sequence"), params, PROMPTS)
  assert np.abs(np.asarray(exact) - np.asarray(full)).max() > 1e-4


def _kv_leaves(cache):
  """{path: shape} of the K/V arrays of every layer group's caches."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
    name = jax.tree_util.keystr(path)
    if name.endswith("['key']") or name.endswith("['value']"):
      out[name] = x.shape
  return out


def test_swa_cache_is_flat_in_context_length(model):
  cfg, params = model
  small, big = Engine(cfg, params, cache_len=48), Engine(cfg, params, cache_len=480)
  # one cache per layer, viewed with a leading layer axis (the scanned groups)
  cs, cb = small.stacked_cache(small.init_cache(2)), big.stacked_cache(big.init_cache(2))
  ks, kb = _kv_leaves(cs), _kv_leaves(cb)
  assert ks.keys() == kb.keys()
  for name in ks:
    if "layers_2_3" in name and "retrieved" not in name:  # the full layer: grows
      assert kb[name][2] == 10 * ks[name][2]
    else:  # SWA rings (W slots) and retrieved caches (K * C slots): flat
      assert ks[name] == kb[name], name
      assert ks[name][2] in (W, K * C)
  # the analytic count matches what the engine allocates (K/V + raw tokens)
  for eng, cache in ((small, cs), (big, cb)):
    a = match.kv_cache_bytes(cfg, eng.cache_len, batch=2)
    kv = sum(int(np.prod(s)) * 4 for s in _kv_leaves(cache).values())
    assert kv == a["window"] + a["retrieved"] + a["full"]
    raw = cache["scheme"]["tokens"]
    assert raw.size * 4 == a["raw_tokens"]
    assert cache_bytes(cache) >= a["total"]


def test_retrieved_kv_recomputed_once_per_block(model):
  """Decode token by token: the retrieved-K/V cache changes only when a row enters a new block,
  and a corrupted stored copy is used (not silently recomputed) inside a block."""
  cfg, params = model
  eng = Engine(cfg, params, cache_len=48)
  prompt = PROMPTS[0][:20]
  cache, logits, lengths = eng.prefill([prompt])
  key = lambda c: np.asarray(eng.stacked_cache(c)["layers_0_2"]["retrieved_cache"]["key"][0])
  pos, tok = 20, int(np.asarray(logits)[0].argmax())
  changed = []
  for _ in range(8):
    before = key(cache)
    cache, logits = eng.decode_step(cache, [tok], [pos], [True], logits)
    assert int(cache["scheme"]["block"][0]) == pos // C + 1
    if not np.array_equal(before, key(cache)):
      changed.append(pos)
    pos, tok = pos + 1, int(np.asarray(logits)[0].argmax())
  # only at block starts (a new block may retrieve the same chunks: then nothing changes)
  assert len(changed) >= 2 and all(p % C == 0 for p in changed), changed
  # inside a block (pos 28 is in block 9, entered at 27): the stored K/V are read, not redone
  good, lg = eng.decode_step(jax.tree.map(jnp.copy, cache), [tok], [pos], [True], logits)
  bad_cache = eng.stacked_cache(jax.tree.map(jnp.copy, cache))
  rc = bad_cache["layers_0_2"]["retrieved_cache"]
  rc["key"] = rc["key"] + 1.0
  rc["ok"] = jnp.ones_like(rc["ok"])  # (the block may have retrieved nothing: expose the slots)
  _, lb = eng.decode_step(eng.per_layer_cache(bad_cache), [tok], [pos], [True], logits)
  assert pos % C != 0 and np.abs(np.asarray(lg) - np.asarray(lb)).max() > 1e-4


# ----------------------------------------------------------- retrieval once per block, bytes
class CountingEmbedder:
  """An embedding retriever (E = 8: unit histogram of token ids mod 8) whose host encode logs
  how many chunks / queries each call encodes (test double of the MiniLM bi-encoder)."""
  kind = "embedding"
  dim = 8
  log: list = []

  def embed(self, tok_BNc, ok_BNc):
    def host(tok, ok):
      tok, ok = np.asarray(tok), np.asarray(ok).astype(bool)
      CountingEmbedder.log.append(int(ok.any(-1).sum()))
      h = np.zeros(tok.shape[:2] + (self.dim,), np.float32)
      b, n, _ = np.nonzero(ok)
      np.add.at(h, (b, n, tok[ok] % self.dim), 1.0)
      return h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-6)
    shape = jax.ShapeDtypeStruct(tok_BNc.shape[:2] + (self.dim,), jnp.float32)
    return jax.pure_callback(host, shape, tok_BNc, ok_BNc)


def test_decode_searches_once_per_block_and_cache_bytes_count_embeddings(model, monkeypatch):
  """Decode token by token with an embedding retriever: the encoder (and so the search) runs
  only on the steps that enter a new block, never inside one; the engine's cache (chunk
  embeddings and the block's ids included) is what kv_cache_bytes counts."""
  import sys
  monkeypatch.setitem(sys.modules, "match_embed_double", sys.modules[__name__])
  _, params = model
  cfg = _cfg(retriever="match_embed_double:CountingEmbedder")
  eng = Engine(cfg, params, cache_len=48)
  cache = eng.init_cache(1)
  a = match.kv_cache_bytes(cfg, eng.cache_len, batch=1)
  assert cache["scheme"]["chunk_emb"].shape == (1, 48 // C, 8)
  assert a["chunk_embeddings"] == 48 // C * 8 * 4
  bookkeeping = sum(x.size * x.dtype.itemsize
                    for p, x in jax.tree_util.tree_flatten_with_path(cache)[0]
                    if [getattr(k, "key", None) for k in p][-2:-1] == ["cache"]
                    and getattr(p[-1], "key", None) in ("length", "positions", "valid"))
  assert cache_bytes(cache) - bookkeeping == a["total"]
  prompt = PROMPTS[0][:20]
  cache, logits, _ = eng.prefill([prompt])
  pos, tok = 20, int(np.asarray(logits)[0].argmax())
  encoded = {}
  for _ in range(9):
    CountingEmbedder.log.clear()
    cache, logits = eng.decode_step(cache, [tok], [pos], [True], logits)
    jax.block_until_ready(logits)
    encoded[pos] = len(CountingEmbedder.log)
    pos, tok = pos + 1, int(np.asarray(logits)[0].argmax())
  assert all((n > 0) == (p % C == 0) for p, n in encoded.items()), encoded
