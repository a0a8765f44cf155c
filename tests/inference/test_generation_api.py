"""Engine.generate's API: bad input is a one-line ValueError (never NaN logits or token 0);
sampling (temperature, top-p, seed) draws only from the nucleus, reproducibly, with greedy the
default; stop strings cut the text and end the row (checked against the free-running text);
streamed text equals the final text (routing statistics: tests/schemes/test_conformance.py,
Elastic's tests/attention/test_elastic_inference.py); segmented's engine picks a valid prefill
chunk itself."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax import attention
from condattn_jax.data.tokenizer import load_tokenizer
from condattn_jax.inference import Engine, sampling
from condattn_jax.inference.text import TextStream
from tests._train_helpers import ROOT, decoder_shapes, random_params
from tests.inference.test_inference import PROMPTS, _dense

TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen")  # 393 ids, byte-level


@pytest.fixture(scope="module")
def dense():
  """The test model with the test tokenizer's vocabulary (400 >= its 393 ids); text_engine is
  the same model and cache_len (one jit cache: the two share their compiled steps)."""
  cfg, params = _dense(vocab_size=400)
  return Engine(cfg, params, cache_len=32)


TEXT_PROMPTS = [[288, 384, 11], [271, 220, 66, 64]]  # 3 and 4 ids: one prefill chunk of 4


@pytest.mark.parametrize("prompts, match", [
    ([[1, 2], [400]], r"prompt 1 holds token id 400, outside the model's vocabulary \[0, 400\)"),
    ([[1, -1]], r"prompt 0 holds token id -1"),
    ([[1, 2.5]], r"prompt 0 holds a non-integer token id \(2.5\)"),
    ([[1.0, 2.0]], r"non-integer token id \(1.0\)"),
    ([[True, 3]], r"non-integer token id \(True\)"),
    ([], r"request list is empty"),
    ([[1], []], r"prompt 1 is an empty prompt"),
    (["hello"], r"prompt 0 is text; tokenize it first"),
    ([[[1, 2]]], r"prompt 0 must be a flat list"),
    ([list(range(33))], r"prompt \(33\) \+ max_new_tokens \(2\) exceeds cache_len=32"),
])
def test_bad_prompts_are_one_line_errors(dense, prompts, match):
  with pytest.raises(ValueError, match=match) as e:
    dense.generate(prompts, 2)
  assert "\n" not in str(e.value)


def test_bad_knobs_are_one_line_errors(dense):
  for kw, match in [(dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
                    (dict(max_new_tokens=2.0), "max_new_tokens=2.0 must be an int"),
                    (dict(stop_tokens=(400,)), r"stop_tokens holds 400"),
                    (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
                    (dict(temperature=1.0, top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
                    (dict(stop_strings=("x",)), "stop_strings / on_text need a tokenizer")]:
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
      dense.generate(PROMPTS, **kw)
  with pytest.raises(ValueError, match=r"prompt 0 has 40 tokens, more than cache_len=32"):
    dense.prefill([list(range(40))])
  with pytest.raises(ValueError, match="400"):
    dense.prefill([[400]])
  with pytest.raises(ValueError, match=r"non-integer token id \(1.0\)"):
    dense.prefill([jnp.asarray([1.0, 2.0])])
  from condattn_jax.inference import check_prompts  # arrays of ints are prompts too
  got = check_prompts([np.asarray([3, 4], np.int64), jnp.asarray([5]), (6, np.int32(7))], 400)
  assert [g.tolist() for g in got] == [[3, 4], [5], [6, 7]]


def test_nucleus_probs_against_a_hand_computed_case():
  logits = np.log([0.5, 0.3, 0.15, 0.05])
  np.testing.assert_allclose(sampling.nucleus_probs(logits, 1.0, 1.0), [0.5, 0.3, 0.15, 0.05])
  np.testing.assert_allclose(sampling.nucleus_probs(logits, 1.0, 0.7), [0.625, 0.375, 0, 0])
  np.testing.assert_allclose(sampling.nucleus_probs(logits, 1.0, 0.79), [0.625, 0.375, 0, 0])
  np.testing.assert_allclose(sampling.nucleus_probs(logits, 1.0, 0.81),
                             np.array([0.5, 0.3, 0.15, 0]) / 0.95)
  p2 = np.array([0.5, 0.3, 0.15, 0.05]) ** 2  # temperature 0.5 squares the probabilities
  np.testing.assert_allclose(sampling.nucleus_probs(logits, 0.5, 1.0), p2 / p2.sum())
  assert sampling.choose(logits) == 0
  rng = np.random.default_rng(0)
  draws = [sampling.choose(logits, temperature=1.0, top_p=0.7, rng=rng) for _ in range(400)]
  assert set(draws) == {0, 1} and 0.5 < np.mean(np.asarray(draws) == 0) < 0.75


def test_sampling_draws_from_the_nucleus_reproducibly(dense):
  """Two identical rows (the shapes text_engine's tests compile: sampling runs on the host)."""
  rows = [TEXT_PROMPTS[1]] * 2
  greedy = dense.generate(rows, 3, return_logits=True)
  assert greedy.tokens == dense.generate(rows, 3, temperature=0.0).tokens
  assert all(t == list(lg.argmax(-1)) for t, lg in zip(greedy.tokens, greedy.logits))
  kw = dict(temperature=1.5, top_p=0.5, return_logits=True)
  a = dense.generate(rows, 3, seed=1, **kw)
  assert a.tokens == dense.generate(rows, 3, seed=1, **kw).tokens
  assert a.tokens != dense.generate(rows, 3, seed=2, **kw).tokens
  for toks, lg in zip(a.tokens, a.logits):  # every draw lies in its step's nucleus
    for t, l in zip(toks, lg):
      assert sampling.nucleus_probs(l, 1.5, 0.5)[t] > 0
  assert a.tokens[0] != a.tokens[1]  # identical rows draw independently
  # a row's draws depend on its own logits, the seed and its index only
  alone = dense.generate(rows[:1], 3, seed=1, **kw)
  assert alone.tokens[0] == a.tokens[0]


@pytest.fixture(scope="module")
def text_engine(dense):
  eng = Engine(dense.config, dense.params, cache_len=dense.cache_len)
  eng.tokenizer = load_tokenizer(TOKENIZER)
  return eng


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
  tok = load_tokenizer(TOKENIZER)
  ids = tok.encode("héllo 日本 the cat")
  s = TextStream(tok)
  deltas = [s.push(i) for i in ids] + [s.flush()]
  assert "".join(deltas) == "héllo 日本 the cat" and all("\ufffd" not in d for d in deltas)
  s = TextStream(tok, stop_strings=("日本 t", "zz"))
  out = ""
  for i in ids:
    out += s.push(i)
    if s.stopped:
      break
  assert s.stopped and s.text == "héllo " and out + s.flush() == "héllo "


def test_stop_strings_cut_the_text_and_end_the_row(text_engine):
  prompts = TEXT_PROMPTS
  free = text_engine.generate(prompts, 12)
  assert free.finish_reason == ["length"] * 2
  tok = text_engine.tokenizer
  assert free.text == [tok.decode(t) for t in free.tokens]
  text0 = free.text[0]
  # a stop string that first appears in the middle of row 0's text, not at its start
  start = next(i for i in range(2, len(text0) - 2) if "\ufffd" not in text0[i:i + 2])
  stop = text0[start:start + 2]
  cut = text0.index(stop)
  streamed = ["", ""]
  gen = text_engine.generate(prompts, 12, stop_strings=(stop,),
                             on_text=lambda b, s: streamed.__setitem__(b, streamed[b] + s))
  assert gen.text[0] == text0[:cut] and gen.finish_reason[0] == "stop_string"
  n = next(k for k in range(1, 13) if stop in tok.decode(free.tokens[0][:k]))
  assert gen.tokens[0] == free.tokens[0][:n]  # up to the token that completed it
  if stop not in free.text[1]:
    assert gen.tokens[1] == free.tokens[1] and gen.text[1] == free.text[1]
  assert streamed == gen.text
  # serve: a request's own stop string ends only that request, text cut the same way
  from condattn_jax.inference.engine import Request
  served = text_engine.serve([Request(prompts[0], stop_strings=(stop,)), prompts[1]], 12,
                             slots=1)
  assert served.tokens == [gen.tokens[0], free.tokens[1]]
  assert served.text == [gen.text[0], free.text[1]]
  assert served.finish_reason == ["stop_string", "length"]
  st = free.tokens[0][3]  # a stop token ends the row; its own text is not output
  gen = text_engine.generate(prompts, 12, stop_tokens=(st,))
  k = free.tokens[0].index(st)
  assert gen.tokens[0] == free.tokens[0][:k + 1] and gen.finish_reason[0] == "stop_token"
  assert gen.text[0] == tok.decode(free.tokens[0][:k])


# L2A's / AHA's routing stats == the full forward's counts and MATCH's one search per block
# entered: tests/schemes/test_conformance.py::test_routing_stats_equal_the_full_forwards_counts
# and ::test_match_stats_count_one_search_per_block_entered (the schemes' tiny models, on the
# chunk-4 generation the harness checks against the declared forward); Elastic's per-row
# stats: tests/attention/test_elastic_inference.py::test_elastic_stats_hold_each_rows_cached_
# per_head_mode (Elastic's tiny model, on the one-shot engine whose prefill that file checks).


def test_dense_has_no_routing_stats(dense):
  assert dense.generate(TEXT_PROMPTS, 2).stats == [{"prompt": {}, "generated": {}}] * 2


def _host_params(cfg, seed=0):
  """Host random params of cfg's init shapes (eval_shape: no init program compiled; norm scales
  1 + N(0, 0.1), other leaves N(0, 0.1))."""
  return random_params(decoder_shapes(cfg), seed=seed)


def test_segmented_engine_picks_a_valid_prefill_chunk():
  """Without prefill_chunk the engine prefills segmented in chunks dividing segment_len = 8
  (before: one chunk of the padded prompt, refused), on the scheme's tiny model (2 layers,
  segments of 8; host random params: no init program). Generation over chunks dividing
  segment_len == the segmented forward: tests/schemes/test_conformance.py (chunk 4, this model)."""
  cfg, _ = attention.get_scheme("segmented").tiny()
  assert attention.options(cfg).segment_len == 8
  params = _host_params(cfg)
  eng = Engine(cfg, params, cache_len=32)
  assert [eng.chunk_for(n) for n in (19, 3, 5, 8)] == [8, 4, 8, 8]
  rows = [list(range(3, 22)), [9, 1, 4]]  # 19 tokens: 3 chunks of 8
  _, logits, lengths = eng.prefill(rows)
  assert np.isfinite(np.asarray(logits)).all() and list(lengths) == [19, 3]
  with pytest.raises(ValueError, match="prefill_chunk=6"):
    Engine(cfg, params, cache_len=32, prefill_chunk=6).prefill(rows)


def test_row_stats_of_per_row_values_average_the_steps_that_ran_the_row():
  """Aux without a token count (Elastic's fa_BK: a per-row decision) is averaged over the steps
  in which the row had tokens; a count aux (with tokens_B) is divided by the tokens."""
  from condattn_jax.inference.engine import _RowStats
  st = _RowStats()
  st.add({"fa_BK": np.array([[[1.0, 0.0], [0.0, 1.0]]])}, np.array([3, 0]))  # row 1 idle
  st.add({"fa_BK": np.array([[[0.0, 0.0], [1.0, 1.0]]])}, np.array([1, 2]))
  np.testing.assert_allclose(st.row(0)["fa_BK"], [[0.5, 0.0]])
  np.testing.assert_allclose(st.row(1)["fa_BK"], [[1.0, 1.0]])
  st = _RowStats()
  st.add({"global_tokens_B": np.array([[2.0, 0.0]]), "tokens_B": np.array([[4.0, 0.0]])},
         np.array([4, 0]))
  st.add({"global_tokens_B": np.array([[1.0, 1.0]]), "tokens_B": np.array([[1.0, 2.0]])},
         np.array([1, 2]))
  np.testing.assert_allclose(st.row(0)["global_tokens_B"], [3 / 5])
  np.testing.assert_allclose(st.row(1)["tokens"], [2.0])
  np.testing.assert_allclose(st.row(1)["global_tokens_B"], [0.5])


def test_run_tokenizer_follows_the_run_config(tmp_path):
  """data.tokenizer, else a model.init_from directory holding tokenizer.json, else none; an
  explicit tokenizer wins."""
  import shutil
  from condattn_jax.inference.engine import run_tokenizer
  from condattn_jax.train.config import default_config
  c = default_config()
  assert run_tokenizer(c) is None
  c.data.tokenizer = TOKENIZER
  assert run_tokenizer(c).vocab_size == 393
  c.data.tokenizer = None
  hf = tmp_path / "hf"
  shutil.copytree(TOKENIZER, hf)
  c.model.init_from = str(hf)
  assert run_tokenizer(c).source.startswith(str(hf))
  assert run_tokenizer(c, tokenizer=TOKENIZER).source.startswith(TOKENIZER)
