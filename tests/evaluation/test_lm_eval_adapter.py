"""The lm-evaluation-harness adapter: log-likelihoods equal the model's own log-softmax, greedy
flags, rolling windows, left truncation, BOS rules, generate_until's stop strings, and lm-eval's
own evaluator (`simple_evaluate`) on locally defined tasks (no downloads)."""
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# No importorskip: scripts/bootstrap.sh installs lm-eval, a missing install must fail here.
from condattn_jax.data.tokenizer import load_tokenizer
from condattn_jax.evaluation.lm_eval_adapter import CondattnLM
from condattn_jax.inference import Engine
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen")
MAXLEN = 64


class _Req:
  def __init__(self, *args):
    self.args = args


@pytest.fixture(scope="module")
def lm():
  tok = load_tokenizer(TOK)
  cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=1)  # the adapter is depth-agnostic
  params = nn.unbox(Decoder(cfg).init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"])
  # larger logits than at init: greedy choices are far from ties
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)
  eng = Engine(cfg, params, cache_len=MAXLEN)
  return CondattnLM(eng, tokenizer=tok, batch_size=4)


_REF_FORWARD = {}


def _ref_forward(model):
  """The model's full forward over REF_LEN tokens, compiled once (an eager apply compiles its
  every op again for each new length)."""
  if id(model) not in _REF_FORWARD:
    _REF_FORWARD[id(model)] = jax.jit(lambda p, x: jax.nn.log_softmax(
        model.apply({"params": p}, x)[0][0].astype(jnp.float32), axis=-1))
  return _REF_FORWARD[id(model)]


REF_LEN = 2 * MAXLEN  # every reference input fits (the adapter scores at most MAXLEN inputs)


def _ref_logprobs(lm, ids):
  """log p(ids[t] | ids[:t]) for t >= 1, from one full forward (the obviously right way), with
  ids right-padded to REF_LEN: causal, so the padding after the last token changes none of the
  logits before it."""
  n = len(ids) - 1
  assert n <= REF_LEN
  x = np.zeros((1, REF_LEN), np.int32)
  x[0, :n] = ids[:-1]
  lp = np.asarray(_ref_forward(lm.engine.model)(lm.engine.stacked_params(), jnp.asarray(x)))[:n]
  return lp[np.arange(n), ids[1:]], lp.argmax(-1)


def test_loglikelihood_is_the_models_log_softmax_and_greedy_flag(lm):
  tok = lm.tokenizer
  ctx, cont = "The grass is green.", " The sky is blue."
  (ll, greedy), = lm.loglikelihood([_Req(ctx, cont)], disable_tqdm=True)
  c_ids = tok.encode(ctx)
  whole = tok.encode(ctx + cont)
  n = len(whole) - len(c_ids)
  lp, _ = _ref_logprobs(lm, whole)
  np.testing.assert_allclose(ll, lp[-n:].sum(), rtol=1e-4)
  assert not greedy
  # the model's own greedy continuation is greedy; one token off is not
  g = lm.engine.generate([c_ids], max_new_tokens=3)
  ids = list(g.tokens[0])
  off = ids[:2] + [(ids[2] + 1) % tok.vocab_size]
  got = lm._loglikelihood_tokens([((ctx, "a"), c_ids, ids), ((ctx, "b"), c_ids, off)])
  assert [x[1] for x in got] == [True, False]
  lp, _ = _ref_logprobs(lm, c_ids + ids)
  assert got[0][0] == pytest.approx(lp[-3:].sum(), rel=1e-4)
  # several requests in one batch (ragged): each equals its own
  reqs = [_Req(ctx, cont), _Req("A", " b"), _Req("Here we go", ". There and back again.")]
  got = lm.loglikelihood(reqs, disable_tqdm=True)
  assert got[0][0] == pytest.approx(ll, rel=1e-5)
  lp2, _ = _ref_logprobs(lm, tok.encode("Here we go. There and back again."))
  n2 = len(tok.encode("Here we go. There and back again.")) - len(tok.encode("Here we go"))
  assert got[2][0] == pytest.approx(lp2[-n2:].sum(), rel=1e-4)


def test_empty_context_uses_the_prefix_token_and_no_bos_for_qwen(lm):
  tok = lm.tokenizer
  assert tok.bos_id is None and lm.prefix_token_id == tok.eos_id  # Qwen: no BOS, EOS prefix
  (ll, _), = lm.loglikelihood([_Req("", "hello")], disable_tqdm=True)
  ids = [tok.eos_id] + tok.encode("hello")
  lp, _ = _ref_logprobs(lm, ids)
  assert ll == pytest.approx(lp.sum(), rel=1e-4)


def test_truncation_is_from_the_left(lm):
  tok = lm.tokenizer
  long_ctx = " ".join(f"w{i}" for i in range(200))
  cont = " end."
  assert len(tok.encode(long_ctx)) > MAXLEN
  (ll, _), = lm.loglikelihood([_Req(long_ctx, cont)], disable_tqdm=True)
  whole = tok.encode(long_ctx + cont)
  kept = whole[-(MAXLEN + 1):]  # the last max_length + 1 tokens: input = max_length tokens
  n = len(whole) - len(tok.encode(long_ctx))
  lp, _ = _ref_logprobs(lm, kept)
  assert ll == pytest.approx(lp[-n:].sum(), rel=1e-4)


def test_rolling_loglikelihood_scores_every_token_once(lm):
  tok = lm.tokenizer
  short = "The sun is yellow."
  (r,) = lm.loglikelihood_rolling([_Req(short)], disable_tqdm=True)
  lp, _ = _ref_logprobs(lm, [lm.prefix_token_id] + tok.encode(short, add_bos=False))
  assert r == pytest.approx(lp.sum(), rel=1e-4)
  doc = " ".join(f"t{i}" for i in range(120))
  ids = tok.encode(doc, add_bos=False)
  assert len(ids) > 2 * MAXLEN
  (r,) = lm.loglikelihood_rolling([_Req(doc)], disable_tqdm=True)
  # reference: token t conditioned on the previous min(t, MAXLEN) tokens of [prefix] + ids,
  # windows of MAXLEN predictions (lm-eval's disjoint windows with context_len=1)
  seq = [lm.prefix_token_id] + ids
  total, t = 0.0, 1
  while t < len(seq):
    end = min(t + MAXLEN, len(seq))
    start = max(0, end - 1 - MAXLEN)
    lp, _ = _ref_logprobs(lm, seq[start:end])
    total += lp[-(end - t):].sum()
    t = end
  assert r == pytest.approx(total, rel=1e-4)


def test_generate_until_stops_at_strings_and_truncates_context(lm):
  tok = lm.tokenizer
  ctx = "There and back again."
  g = lm.engine.generate([tok.encode(ctx)], max_new_tokens=8)
  full = tok.decode(g.tokens[0], skip_special_tokens=True)
  (out,) = lm.generate_until([_Req(ctx, {"until": [], "max_gen_toks": 8})], disable_tqdm=True)
  assert out == full
  assert len(full) >= 5 and full[3:5].strip(), full  # this model's output: a stop string in it
  stop = full[3:5]
  (out,) = lm.generate_until([_Req(ctx, {"until": [stop], "max_gen_toks": 8})],
                             disable_tqdm=True)
  assert out == full[:full.index(stop)]
  long_ctx = " ".join(f"w{i}" for i in range(200))
  (out,) = lm.generate_until([_Req(long_ctx, {"until": [], "max_gen_toks": 4})],
                             disable_tqdm=True)
  g = lm.engine.generate([tok.encode(long_ctx)[-(MAXLEN - 4):]], max_new_tokens=4)
  assert out == tok.decode(g.tokens[0], skip_special_tokens=True)


def test_simple_evaluate_runs_local_tasks(lm, tmp_path, monkeypatch):
  import lm_eval
  from lm_eval.tasks import TaskManager
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
  rows = [{"question": f"Q{i}: the grass is", "choices": [" green", " blue", " yellow"],
           "label": i % 3} for i in range(6)]
  data = tmp_path / "mc.jsonl"
  data.write_text("\n".join(json.dumps(r) for r in rows))
  (tmp_path / "local_mc.yaml").write_text(f"""task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
  (tmp_path / "local_gen.yaml").write_text(f"""task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: " green"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
""")
  tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
  res = lm_eval.simple_evaluate(model=lm, tasks=["local_mc", "local_gen"], task_manager=tm,
                                log_samples=True)
  # acc = our own argmax over the choices' log-likelihoods
  want = []
  for r in rows:
    lls = [ll for ll, _ in lm.loglikelihood([_Req(r["question"], c) for c in r["choices"]],
                                            disable_tqdm=True)]
    want.append(float(np.argmax(lls) == r["label"]))
  assert res["results"]["local_mc"]["acc,none"] == pytest.approx(np.mean(want))
  gens = [s["resps"][0][0] for s in res["samples"]["local_gen"]]
  assert len(gens) == 6 and all(isinstance(g, str) for g in gens)
  em = np.mean([g.strip() == "green" for g in gens])
  assert res["results"]["local_gen"]["exact_match,none"] == pytest.approx(em)
