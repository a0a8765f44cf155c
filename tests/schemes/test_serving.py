"""Continuous batching (`Engine.serve`): requests of mixed lengths through 2 fixed slots (a
finished row is reset and takes the next prompt) give each request the tokens greedy
generation gives it alone, on the conformance suite's tiny L2A model (a window ring and a full
cache per layer); `reset_rows` empties only the rows asked. Every scheme's cache starts at zeros
(`Engine.init_cache`), so a reset row is a fresh one for each of them."""
import jax
import numpy as np
import pytest

from test_conformance import NAMES, engine  # the suite's shared tiny models (module-cached)

RNG = np.random.default_rng(1)
REQUESTS = [list(map(int, RNG.integers(1, 6, n))) for n in (9, 3, 14, 5)]
NEW = (5, 3)  # the slots free at different steps


def test_serve_equals_per_request_generation():
  """L2A's tiny model: both cache kinds (window ring, full cache) are reset and reused."""
  eng = engine("l2a", 4)
  for new in NEW:
    got = eng.serve(REQUESTS, new, slots=2)
    want = [eng.generate([p], new).tokens[0] for p in REQUESTS]
    assert got == want, (new, got, want)


def test_reset_rows_empties_only_those_rows():
  eng = engine("dense", 4)
  cache, _, _ = eng.prefill(REQUESTS[:3])
  before = jax.tree.map(np.asarray, cache)
  after = jax.tree.map(np.asarray, eng.reset_rows(jax.tree.map(lambda x: x.copy(), cache),
                                                  [False, True, False]))
  for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a[[0, 2]], b[[0, 2]])
    assert not a[1].any()
  assert any(b[1].any() for b in jax.tree.leaves(before))
  with pytest.raises(ValueError, match="slots"):
    eng.serve(REQUESTS, 2, slots=0)


@pytest.mark.parametrize("name", NAMES)
def test_every_schemes_cache_can_be_reset_per_row(name):
  """Every leaf of every scheme's cache is batch-first: serve can give a row to a new request."""
  eng = engine(name, 4)
  cache = eng.reset_rows(eng.init_cache(2), [True, False])
  assert all(x.shape[0] == 2 for x in jax.tree.leaves(cache))
