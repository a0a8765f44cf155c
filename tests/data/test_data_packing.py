"""Packing: attention never crosses documents; targets, positions and loss_mask exact."""

import json

import numpy as np
import pytest

from condattn_jax import data
from condattn_jax.data import packing

SEP = 999_999
T = 32


def _doc_tokens(d: int, n: int) -> list[int]:
  # Token value encodes (document, offset): d * 1000 + offset.
  return [d * 1000 + j for j in range(n)]


def _write_docs(tmp_path, lengths):
  path = tmp_path / "docs.jsonl"
  with open(path, "w") as f:
    for d, n in enumerate(lengths):
      f.write(json.dumps({"tokens": _doc_tokens(d, n)}) + "\n")
  return str(path)


def _lengths(seed=0, n=60):
  rng = np.random.default_rng(seed)
  # Mostly short documents, some longer than 3 rows, a few too short to score.
  lengths = rng.integers(2, 20, size=n)
  lengths[::7] = rng.integers(3 * T, 4 * T, size=len(lengths[::7]))
  lengths[5] = 1
  lengths[11] = 0
  return [int(x) for x in lengths]


def _cfg(path, packing_name, *, sep=None, batch_size=4):
  cfg = data.default_data_config()
  cfg.source = "jsonl"
  cfg.paths = path
  cfg.seq_len = T
  cfg.batch_size = batch_size
  cfg.packing = packing_name
  cfg.pack_bins = 3
  cfg.append_separator = sep is not None
  cfg.separator_id = sep
  cfg.prefetch = 0
  return cfg


def _all_batches(cfg):
  return data.make_eval_batches(cfg, None, seed=0)


@pytest.mark.parametrize("packing_name", ["concat_then_split", "first_fit", "one_per_row"])
@pytest.mark.parametrize("sep", [None, SEP])
def test_packing_is_exact_and_never_crosses_documents(tmp_path, packing_name, sep):
  lengths = _lengths()
  cfg = _cfg(_write_docs(tmp_path, lengths), packing_name, sep=sep)
  batches = _all_batches(cfg)
  assert batches
  seen = []  # (doc, offset) of every scored input token
  for b in batches:
    for k, dt in packing.BATCH_DTYPES.items():
      assert b[k].dtype == dt and b[k].shape == (4, T)
    mask = packing.attention_mask(b["segment_ids"], b["positions"])  # [B, T, T]
    for r in range(b["inputs"].shape[0]):
      seg, pos = b["segment_ids"][r], b["positions"][r]
      inp, tgt, lm = b["inputs"][r], b["targets"][r], b["loss_mask"][r]
      pad = seg == 0
      # Padding: never scored, never attended, and only at the end of a row.
      assert np.all(lm[pad] == 0) and np.all(inp[pad] == 0) and np.all(pos[pad] == 0)
      assert not mask[r][:, pad].any() and not mask[r][pad].any()
      if pad.any():
        assert np.all(pad[np.argmax(pad):])
      doc, off = inp // 1000, inp % 1000
      if packing_name == "one_per_row":  # one document (piece) per row, the rest padding
        assert set(np.unique(seg[~pad])) <= {1}
      # The model's mask allows q -> kv only inside one document, causally.
      q, kv = np.nonzero(mask[r])
      assert np.all(doc[q] == doc[kv]) and np.all(off[kv] <= off[q])
      # ... and exactly the earlier tokens of the same segment (contiguous segments).
      for s in np.unique(seg[~pad]):
        idx = np.flatnonzero(seg == s)
        assert np.all(np.diff(idx) == 1), "segment not contiguous"
        assert np.all(pos[idx] == np.arange(len(idx))), "positions must restart at 0"
        assert len(np.unique(doc[idx])) == 1, "one segment = one document"
        assert np.all(np.diff(off[idx]) == 1), "document tokens in order, none skipped"
        sub = mask[r][np.ix_(idx, idx)]
        assert np.array_equal(sub, np.tril(np.ones_like(sub)))
      # Different segments in a row are different (doc, piece)s and never mix.
      # Targets: the next token of the same document (or the separator after its end).
      for t in np.flatnonzero(~pad):
        d, o = int(doc[t]), int(off[t])
        expect = d * 1000 + o + 1 if o + 1 < lengths[d] else sep
        assert tgt[t] == expect, (d, o, tgt[t], expect)
        assert lm[t] == 1.0
        seen.append((d, o))
  # Every scored pair of every document appears exactly once in one epoch.
  want = [(d, o) for d, n in enumerate(lengths)
          for o in range(n if sep is not None else n - 1)]
  if sep is None:
    want = [(d, o) for d, o in want if lengths[d] >= 2]
  else:
    want = [(d, o) for d, o in want if lengths[d] + 1 >= 2]
  assert sorted(seen) == sorted(want)


def test_concat_then_split_has_no_padding_before_the_end(tmp_path):
  lengths = _lengths(1)
  cfg = _cfg(_write_docs(tmp_path, lengths), "concat_then_split", batch_size=1)
  batches = _all_batches(cfg)
  for b in batches[:-1]:
    assert np.all(b["segment_ids"] > 0)


def test_attention_mask_window():
  seg = np.array([[1, 1, 1, 1, 2, 2, 0]])
  pos = np.array([[0, 1, 2, 3, 0, 1, 0]])
  m = packing.attention_mask(seg, pos, window=2)[0]
  assert m[3].tolist() == [False, False, True, True, False, False, False]
  assert m[5].tolist() == [False, False, False, False, True, True, False]
  assert not m[6].any()


def test_document_features_drops_short_docs():
  assert packing.document_features(np.array([5])) is None
  f = packing.document_features(np.array([5, 6, 7]))
  assert f["inputs"].tolist() == [5, 6] and f["targets"].tolist() == [6, 7]
  assert f["loss_mask"].tolist() == [1.0, 1.0]
