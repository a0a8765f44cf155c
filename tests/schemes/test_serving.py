"""Continuous batching (`Engine.serve`): requests of mixed lengths through fixed slots (the next
prompts admitted together ahead of free rows: prefilled as one ragged batch in its own cache,
each taking the first free row once its prompt is in) give each request what `generate` gives it alone
(greedy, or sampled with its own temperature / top_p / seed / max_new_tokens; its routing
statistics too), on the conformance suite's tiny L2A model
(a window ring and a full cache per layer), and for every scheme's tiny model greedy serving
through 2 slots equals generate (each scheme's cache rows emptied and reused);
a new prompt's prefill chunks alternate with the other rows' decode steps; `reset_rows` empties
only the rows asked. Every scheme's cache starts at zeros (`Engine.init_cache`)."""
import dataclasses

import jax
import numpy as np
import pytest

from condattn_jax.inference import Engine
from condattn_jax.inference.engine import Request
from test_conformance import NEW as NEW_CONF
from test_conformance import NAMES, PROMPTS, engine, generated  # module-cached models and runs

RNG = np.random.default_rng(1)
REQUESTS = [list(map(int, RNG.integers(1, 6, n))) for n in (9, 3, 14, 5)]
NEW = (5, 3)  # the slots free at different steps


@pytest.fixture(autouse=True)
def _greedy_runs_of_3(monkeypatch):
  """Every test's on-device greedy runs hold at most 3 steps (Engine.GREEDY_IDS_BLOCK): the
  ids buffer has one shape in the file, so generate and serve share their greedy programs."""
  monkeypatch.setattr(Engine, "GREEDY_IDS_BLOCK", 3)


def test_serve_equals_per_request_generation(monkeypatch):
  """L2A's tiny model: both cache kinds (window ring, full cache) are reset and reused; 2 slots
  (requests 0 and 1 admitted in one prefill, then 2 and 3), and 4 slots for 3 requests (one
  prefill of 3 prompts in 4 rows, one of them padding; through serve's host loop, whose
  programs the file compiles anyway: the planned loop == the host loop is checked below)."""
  eng = engine("l2a", 4)
  for new, slots, reqs in ((NEW[0], 2, REQUESTS), (NEW[1], 4, REQUESTS[:3])):
    if slots == 4:
      monkeypatch.setattr(eng, "SERVE_ON_DEVICE", False, raising=False)
    got = eng.serve(reqs, new, slots=slots)
    want = [eng.generate([p], new).tokens[0] for p in reqs]
    assert got.tokens == want, (new, got.tokens, want)
    n = min(slots, len(reqs))  # admitted together: their first chunks come first
    assert got.schedule[:n] == [("prefill", r, 0) for r in range(n)], got.schedule


def test_serve_samples_each_request_as_its_own_generation():
  """Per-request knobs: each Request == generate([prompt], its knobs, seed=its seed), tokens
  and per-request routing stats (L2A's global fraction, prompt and generated apart); requests
  without a seed draw as their row of generate(prompts, seed=serve's seed)."""
  eng = engine("l2a", 4)
  reqs = [Request(p, max_new_tokens=m, temperature=t, top_p=tp, seed=s)
          for p, m, t, tp, s in zip(REQUESTS, (5, 3, 4, 2), (1.0, 1.5, 0.0, 1.0),
                                    (0.9, 1.0, 1.0, 0.5), (7, 8, 9, 10))]
  got = eng.serve(reqs, 3, slots=2)
  for r, toks, st in zip(reqs, got.tokens, got.stats):
    want = eng.generate([r.prompt], r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                        seed=r.seed)
    assert toks == want.tokens[0], (r, toks, want.tokens)
    for part in ("prompt", "generated"):
      assert set(st[part]) == set(want.stats[0][part])
      for k, v in want.stats[0][part].items():
        np.testing.assert_allclose(st[part][k], v, atol=1e-6, err_msg=f"{part} {k}")
  assert [len(t) for t in got.tokens] == [5, 3, 4, 2] and got.finish_reason == ["length"] * 4
  assert 0 < np.mean([s["prompt"]["global_tokens_B"].mean() for s in got.stats]) < 1
  assert got.tokens != eng.serve([dataclasses.replace(r, seed=r.seed + 1) for r in reqs], 3,
                                 slots=2).tokens  # the seed matters
  kw = dict(temperature=1.0, seed=5)
  assert eng.serve(REQUESTS, 3, slots=2, **kw).tokens == eng.generate(REQUESTS, 3, **kw).tokens


def test_prefill_chunks_interleave_with_decode_steps():
  """One prompt per prefill (admit=1): the 14-token prompt (4 chunks of 4) is prefilled, ahead
  of a free row, while the rows of requests 0 and 1 decode: a decode step runs after each of
  its chunks. Admitted together (the default), requests 0 (9 tokens: 3 chunks) and 1 (3
  tokens) share their first chunk, and request 1 decodes between request 0's later chunks;
  requests 2 and 3 are prefilled next, while both rows decode, and take the rows as they free."""
  eng = engine("l2a", 4)
  reqs = [REQUESTS[0], Request(REQUESTS[1], max_new_tokens=8)] + REQUESTS[2:]
  ev = eng.serve(reqs, 5, slots=2).schedule
  assert ev[:9] == [("prefill", 0, 0), ("prefill", 1, 0), ("decode", 1), ("prefill", 0, 1),
                    ("decode", 1), ("prefill", 0, 2), ("decode", 2), ("prefill", 2, 0),
                    ("prefill", 3, 0)], ev
  got = eng.serve(reqs, 5, slots=2, admit=1)
  ev = got.schedule
  chunks = [i for i, e in enumerate(ev) if e[:2] == ("prefill", 2)]
  assert ev[:6] == [("prefill", 0, 0), ("prefill", 0, 1), ("prefill", 0, 2), ("decode", 1),
                    ("prefill", 1, 0), ("decode", 2)] and chunks == [6, 8, 10, 12], ev
  # (request 0's row frees before request 2's last chunk: it idles one step, then takes it)
  assert [ev[i + 1] for i in chunks] == [("decode", 2)] * 2 + [("decode", 1), ("decode", 2)], ev
  assert got.steps == sum(e[0] == "decode" for e in ev)
  assert all(t > 0 for t in got.ttft_s) and got.ttft_s[0] < got.ttft_s[2]
  with pytest.raises(ValueError, match=r"request 1: max_new_tokens=0 must be an int >= 1"):
    eng.serve([REQUESTS[0], Request(REQUESTS[1], max_new_tokens=0)], 2, slots=2)
  with pytest.raises(ValueError, match=r"request 0: top_p=0.0 must be in"):
    eng.serve([Request(REQUESTS[0], top_p=0.0)], 2, slots=2)
  with pytest.raises(ValueError, match=r"admit=0\) must be an int >= 1"):
    eng.serve(REQUESTS, 2, slots=2, admit=0)


def test_reset_rows_empties_only_those_rows():
  """L2A's tiny model (a window ring and a full cache per layer), 4 rows prefilled (the batch
  the 4-slot serve above prefills: its compiled program); rows 1 and 3 emptied."""
  eng = engine("l2a", 4)
  cache, _, _ = eng.prefill(REQUESTS)
  before = jax.tree.map(np.asarray, cache)
  after = jax.tree.map(np.asarray, eng.reset_rows(jax.tree.map(lambda x: x.copy(), cache),
                                                  [False, True, False, True]))
  for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a[[0, 2]], b[[0, 2]])
    assert not a[1].any() and not a[3].any()
  assert any(b[1].any() for b in jax.tree.leaves(before))
  with pytest.raises(ValueError, match="slots"):
    eng.serve(REQUESTS, 2, slots=0)


@pytest.mark.parametrize("name", NAMES)
def test_every_schemes_cache_can_be_reset_per_row(name):
  """Every leaf of every scheme's cache is batch-first: serve can give a row to a new request.
  The cache is read off the model by a trace at 2 rows (the engine may derive other batch sizes'
  shapes from the first it traced: its full cache shapes at 2 rows must equal that trace)."""
  eng = engine(name, 4)
  traced = eng._traced_cache(2)
  assert all(x.shape[0] == 2 for x in jax.tree.leaves(traced))
  eng._full_cache_shapes(3)  # a batch size the engine traces first (if none yet): 2 is derived
  full = eng._full_cache_shapes(2)
  assert jax.tree.structure(full) == jax.tree.structure(traced)
  assert all((a.shape, a.dtype) == (b.shape, b.dtype)
             for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(traced)))
  cache = eng.reset_rows(eng.init_cache(2), [True, False])
  assert all(x.shape[0] == 2 for x in jax.tree.leaves(cache))


@pytest.mark.parametrize("name", NAMES)
def test_serve_runs_greedy_steps_on_the_device_as_its_host_loop(name, monkeypatch):
  """Without a stop token (every request greedy), serve queues its whole schedule with no host
  wait (planned: greedy steps on one state, inserts and retirements on the device, the ids read
  a buffer at a time) and then pushes the ids as its host loop would: the same tokens, finish
  reasons, steps, schedule and per-request statistics as with the host loop (SERVE_ON_DEVICE
  off), for every scheme. With a stop token, while no row can change (nothing to admit, every
  active request greedy with its first token out) it runs greedy steps on the device
  (`Engine._serve_run`) with a stop token that ends rows inside a run: the same again (a
  scheme whose steps take host facts then keeps the host loop)."""
  eng = engine(name, 4)
  reqs = [Request(REQUESTS[0], max_new_tokens=7), REQUESTS[1],
          Request(REQUESTS[2], max_new_tokens=6), REQUESTS[3]]
  # (Engine.GREEDY_IDS_BLOCK = 3: _greedy_runs_of_3) runs of at most 3 steps
  runs, run = [], Engine._serve_run
  monkeypatch.setattr(Engine, "_serve_run", lambda self, *a: runs.append(a[-1]) or run(self, *a))

  def both(**kw):
    got = eng.serve(reqs, 5, slots=2, **kw)
    monkeypatch.setattr(eng, "SERVE_ON_DEVICE", False, raising=False)
    want = eng.serve(reqs, 5, slots=2, **kw)
    monkeypatch.delattr(eng, "SERVE_ON_DEVICE")
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, kw
    assert got.steps == want.steps and got.schedule == want.schedule, kw
    for g, w in zip(got.stats, want.stats):
      assert jax.tree.structure(g) == jax.tree.structure(w)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
        np.testing.assert_allclose(a, b, atol=1e-6, err_msg=f"{name} {kw}")
    return got, want
  got, want = both()
  assert not runs and got.counts["device_steps"] == got.steps > 6, (runs, got.counts)
  assert got.counts["host_steps"] == 0 and want.counts["host_steps"] == want.steps
  # (the ids buffer holds 3 steps: one host read a buffer and one at the end)
  assert got.counts["host_syncs"] <= -(-got.steps // 3) + 2 < want.counts["host_syncs"]
  # the per-row insert / reset of continuous batching, every scheme: the conformance prompts
  # through 2 slots (a row emptied and given the third prompt) give what the conformance
  # suite's one ragged generate gives each (its run, module-cached: test_conformance)
  assert eng.serve(PROMPTS, NEW_CONF, slots=2).tokens == generated(name, 4).tokens, name
  stop = want.tokens[0][3]   # request 0's fourth token: inside a run
  runs.clear()
  got, _ = both(stop_tokens=(stop,))
  assert "stop_token" in got.finish_reason
  host_facts = name in ("elastic", "match")
  assert bool(runs) != host_facts, (name, runs)
