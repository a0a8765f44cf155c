"""The long-context task suite: deterministic generation keyed by length, prompts that fit the
budget, answers a rule-based reader recovers from the prompt alone, RULER's scoring rules, and
the generation-scored harness end to end (a model that answers perfectly scores 1.0 on every
task, one that answers wrongly 0)."""
import collections
import dataclasses
import os
import re

import numpy as np
import pytest

from condattn_jax.evaluation import harness, headtohead, scoring
from condattn_jax.evaluation import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen")
V = 64


# ------------------------------------------------------------------ a reader of token prompts
def _find(seq, sub, start=0):
  n = len(sub)
  return [i for i in range(start, len(seq) - n + 1) if tuple(seq[i:i + n]) == tuple(sub)]


def solve_tokens(task, p):
  """The answers of a token-level prompt, read off the prompt by the task's rules (written
  from the layout in tasks.py's docstring, not from its generators)."""
  p = list(p)
  if task == "mqar":  # keys and values interleaved first: k v k v ...; the prompt ends at a key
    return [(p[p.index(p[-1]) + 1],)]
  kv_hi = T.FIRST_KV + min(256, (V - T.FIRST_KV) // 2)
  q = len(p) - 1 - p[::-1].index(T.TQUERY)
  if task.startswith("niah"):
    query = p[q + 1:]
    keys = [tuple(query[i:i + 2]) for i in range(0, len(query), 2)]
    out = []
    for k in keys:
      for i in _find(p[:q], (T.TNEEDLE, *k)):
        out.append(tuple(p[i + 3:i + 5]))
    return out
  if task == "vt":
    names, val = [], p[q + 1]
    while True:
      hit = [i for i in range(q - 3) if p[i] == T.TNEEDLE and p[i + 2] == T.TSEP
             and p[i + 3] == val]
      if not hit:
        return [(x,) for x in names]
      val = p[hit[0] + 1]
      names.append(val)
  if task in ("cwe", "fwe"):
    c = collections.Counter(t for t in p[:q] if T.FIRST_KV <= t < kv_hi)
    ranked = [t for t, _ in c.most_common()]
    return [(t,) for t in (ranked[:4] if task == "cwe" else ranked[1:4])]
  if task == "json_kv":
    key = p[q + 1:]
    i = _find(p[:q], (*key, T.TSEP))[0]
    return [tuple(p[i + len(key) + 1:i + len(key) + 3])]
  if task == "passkey":
    i = p.index(T.TNEEDLE)
    return [tuple(p[i + 1:i + 6])]
  raise AssertionError(task)


@pytest.fixture(scope="module")
def tiny_samples():
  return T.build_samples("tiny", (128, 256), num_samples=3, vocab_size=V)


def test_token_samples_fit_and_reader_recovers_every_answer(tiny_samples):
  assert {s.task for s in tiny_samples} == set(T.TOKEN_TASKS)
  assert len(tiny_samples) == len(T.TOKEN_TASKS) * 2 * 3
  for s in tiny_samples:
    assert len(s.prompt) + s.max_new_tokens <= s.length, s.id
    if s.task != "mqar":  # MQAR's prompt ends at its last query key
      assert len(s.prompt) == s.length - s.max_new_tokens, s.id  # fills the length
    assert s.max_new_tokens == sum(len(a) for a in s.answers)
    assert all(0 <= t < V for t in s.prompt)
    got = solve_tokens(s.task, s.prompt)
    assert sorted(got) == sorted(s.answers), (s.id, got, s.answers)


def test_samples_are_deterministic_and_keyed_by_seed_and_length(tiny_samples):
  again = T.build_samples("tiny", (128, 256), num_samples=3, vocab_size=V)
  assert again == tiny_samples
  other = T.build_samples("tiny", (128,), num_samples=3, vocab_size=V, seed=1)
  same_len = [s for s in tiny_samples if s.length == 128]
  assert sum(a.prompt != b.prompt for a, b in zip(other, same_len)) >= len(other) - 1


def _count_words(text):
  return collections.Counter(re.findall(r"\b[a-z]+\b", text))


@pytest.fixture(scope="module")
def tok():
  from condattn_jax.data.tokenizer import load_tokenizer
  return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def text_samples(tok):
  return T.build_samples("long", (2048,), num_samples=2, tokenizer=tok)


def test_text_samples_fill_the_length_by_the_tokenizer(tok, text_samples):
  assert {s.task for s in text_samples} == set(T.SUITES["long"].tasks)
  for s in text_samples:
    n = len(tok.encode(s.prompt))
    assert n + s.max_new_tokens <= 2048, s.id
    assert n + s.max_new_tokens >= 0.85 * 2048, (s.id, n)  # the longest prompt that fits
  assert T.build_samples("long", (2048,), num_samples=2, tokenizer=tok) == text_samples


def test_text_answers_follow_the_task_rules(text_samples):
  for s in text_samples:
    p = s.prompt
    if s.task.startswith("niah"):
      for a in s.answers:  # each answer is a needle's value, and its key is the one asked
        m = re.search(r"One of the special magic \w+ for (\S+) is: " + re.escape(a) + r"\.", p)
        assert m and m.group(1) in p[p.rindex("What "):], (s.id, a)
    elif s.task == "vt":
      val = re.search(r"assigned the value (\d+) in the text", p).group(1)
      chain, x = [], re.search(r"VAR (\w+) = " + val, p).group(1)
      while x:
        chain.append(x)
        m = re.search(r"VAR (\w+) = VAR " + x + r"\b", p)
        x = m.group(1) if m else None
      assert chain == list(s.answers)
    elif s.task == "cwe":
      listed = p[p.rindex("Below is a numbered list"):]
      c = _count_words(re.sub(r"\d+\. ", " ", listed.split("\nQuestion")[0]))
      top = [w for w, _ in c.most_common(10)]
      assert sorted(top) == sorted(s.answers), s.id
    elif s.task == "fwe":
      c = collections.Counter(p.split("frequently appeared coded words. ")[1]
                              .split("\nQuestion")[0].split())
      assert [w for w, _ in c.most_common(4)][1:] == list(s.answers)
    elif s.task == "json_kv":
      import json
      obj = json.loads(p.split("JSON data:\n")[1].split("\n\nKey:")[0])
      key = re.search(r'Key: "([^"]+)"', p).group(1)
      assert [obj[key]] == list(s.answers)
    elif s.task == "passkey":
      assert re.search(r"The pass key is (\d+)\. Remember it", p).group(1) == s.answers[0]
    elif s.task == "mqar":
      asked = re.search(r"values of (.+)\? The values", p).group(1).replace(" and ", ", ")
      vals = [re.search(f"The value of {k} is (\\d+)\\.", p).group(1) for k in asked.split(", ")]
      assert vals == list(s.answers)


def test_scoring_rules_are_rulers():
  assert scoring.score("The numbers are 123 and 456.", ["123", "456", "789"], "all") == \
      pytest.approx(2 / 3)
  assert scoring.score("ABC", ["abc"], "all") == 1.0  # case-insensitive
  assert scoring.score("x 456", ["123", "456"], "part") == 1.0
  assert scoring.score("nothing", ["123", "456"], "part") == 0.0
  assert scoring.score([5, 7, 9, 4], [(7, 9), (9, 5)], "all") == 0.5  # contiguous runs only
  assert scoring.score([5, 7, 9], [(7, 5)], "part") == 0.0
  with pytest.raises(ValueError, match="unknown metric"):
    scoring.score("a", ["a"], "exact")


def test_user_files_essay_haystack_and_qa(tmp_path, tok):
  essay = tmp_path / "essay.txt"
  essay.write_text(" ".join(f"Sentence number {i} talks about nothing." for i in range(400)))
  qa = tmp_path / "qa.jsonl"
  qa.write_text("\n".join(
      '{"question": "Who wrote doc %d?", "answers": ["Writer%d"], "documents": '
      '["Doc %d was written by Writer%d."]}' % (i, i, i, i) for i in range(30)))
  ss = T.build_samples("ruler", (2048,), num_samples=2, tokenizer=tok, haystack_file=str(essay),
                       qa_file=str(qa), tasks=["niah_single_2", "qa"])
  assert [s.task for s in ss] == ["niah_single_2"] * 2 + ["qa"] * 2
  assert "Sentence number" in ss[0].prompt and ss[0].answers[0] in ss[0].prompt
  assert "Who wrote doc 1?" in ss[3].prompt and "written by Writer1." in ss[3].prompt
  assert ss[3].metric == "part"
  with pytest.raises(ValueError, match="needs haystack_file"):
    T.build_samples("ruler", (2048,), tokenizer=tok, tasks=["niah_single_2"])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match="row 1 needs"):
    T.load_qa_file(str(bad))


# ------------------------------------------------------------------ harness with oracles
@dataclasses.dataclass
class _Gen:
  tokens: list
  prefill_s: float = 0.01
  decode_s: float = 0.02
  stats: list = None


class OracleEngine:
  """Answers each prompt with `answer(prompt)` (ids), plus the per-row stats a scheme reports."""

  def __init__(self, answer):
    self.answer = answer
    self.calls = []

  def generate(self, prompts, max_new_tokens, stop_tokens=()):
    self.calls.append((len(prompts), max_new_tokens))
    toks = [list(self.answer(tuple(p)))[:max_new_tokens] for p in prompts]
    stats = [{"prompt": {"tokens": [len(p)] * 2, "global_tokens_B": [0.25, 0.75]}}
             for p in prompts]
    return _Gen(toks, stats=stats)

  def cache_shapes(self, batch):
    import jax
    return {"k": jax.ShapeDtypeStruct((batch, 2, 8), np.float32)}


class _Cfg:
  vocab_size, scheme, scheme_kwargs = V, "dense", ()


def _oracle_model(name, answer, tokenizer=None, vocab=V):
  cfg = _Cfg()
  cfg.vocab_size = vocab
  return harness.EvalModel(name, cfg, tokenizer, {"scheme": {"name": "dense"}, "oracle": name},
                           lambda L, chunk: OracleEngine(answer))


def test_perfect_model_scores_one_and_wrong_model_zero_on_every_token_task(tiny_samples):
  by_prompt = {s.prompt: s for s in tiny_samples}
  perfect = _oracle_model("perfect", lambda p: [t for a in solve_tokens(
      by_prompt[p].task, p) for t in a])
  wrong = _oracle_model("wrong", lambda p: [T.TQUERY] * 8)
  for m, want in ((perfect, 1.0), (wrong, 0.0)):
    r = harness.evaluate_model(m, tiny_samples, batch_size=4)
    assert set(r["accuracy"]) == set(T.TOKEN_TASKS)
    for task, by_len in r["accuracy"].items():
      assert by_len == {"128": want, "256": want}, (m.name, task)
    assert len(r["records"]) == len(tiny_samples)
    assert all(rec["score"] == want for rec in r["records"])
    assert r["routing"]["vt"]["128"] == {"global_tokens_B": [0.25, 0.75]}
    e = r["efficiency"]["128"]
    assert e["kv_cache_bytes"] == 2 * 8 * 4 and e["ttft_s"] == 0.01
    assert e["decode_tok_s"] == pytest.approx(e["decoded_tokens"] / (e["batches"] * 0.02))
    assert e["decoded_tokens"] == sum(
        max(min(len(rec["output"]), 8) - 1, 0) for rec in r["records"] if rec["length"] == 128)


def test_text_outputs_are_decoded_and_scored(tok, text_samples):
  ss = [s for s in text_samples if s.task in ("niah_multivalue", "json_kv", "passkey", "mqar")]
  by_ids = {tuple(tok.encode(s.prompt)): s for s in ss}
  perfect = _oracle_model("perfect", lambda p: tok.encode(
      "\n " + ", ".join(by_ids[p].answers) + ".") + [tok.eos_id, 7, 7], tok, tok.vocab_size)
  r = harness.evaluate_model(perfect, ss, batch_size=2)
  assert all(rec["score"] == 1.0 for rec in r["records"]), r["records"]
  assert r["records"][0]["output"].startswith(ss[0].answers[0])  # RULER's postprocess
  half = _oracle_model("half", lambda p: tok.encode(by_ids[p].answers[0]), tok, tok.vocab_size)
  r = harness.evaluate_model(half, ss, batch_size=2)
  assert r["accuracy"]["niah_multivalue"]["2048"] == 0.25  # 1 of 4 values: 'all' averages
  assert r["accuracy"]["passkey"]["2048"] == 1.0


def test_report_records_knobs_and_never_overwrites(tmp_path, tiny_samples):
  by_prompt = {s.prompt: s for s in tiny_samples}
  good = _oracle_model("perfect", lambda p: [t for a in solve_tokens(
      by_prompt[p].task, p) for t in a])
  bad = _oracle_model("wrong", lambda p: [T.TQUERY] * 8)
  kw = dict(lengths=(128, 256), num_samples=3, batch_size=4, progress=False)
  rep = headtohead.run_suite([good, bad], "tiny", **kw)
  k = rep["knobs"]
  assert k["suite"] == "tiny" and k["lengths"] == [128, 256] and k["seed"] == 0
  assert k["device"]["platform"] == "cpu" and "jax" in k["device"]
  assert [m["knobs"]["oracle"] for m in rep["models"]] == ["perfect", "wrong"]
  files = headtohead.write_report(rep, str(tmp_path))
  md = open(files[1]).read()
  assert "| **mean** | 256 | **1.000** | **0.000** |" in md
  assert "| passkey | 128 | 1.000 | 0.000 |" in md
  assert "| perfect global_tokens_B | vt | 0.500 | 0.500 |" in md  # mean of [0.25, 0.75]
  assert all(os.path.getsize(f) > 0 for f in files)
  assert any(f.endswith("_routing.json") for f in files)
  rep2 = headtohead.run_suite([good, bad], "tiny", **{**kw, "num_samples": 2})
  files2 = headtohead.write_report(rep2, str(tmp_path))
  assert files2[0] != files[0] and os.path.exists(files[0])  # other knobs: another file
  assert headtohead.write_report(rep, str(tmp_path))[0] == files[0]  # same knobs: same file


def test_sweep_models_form_one_curve():
  models = [dict(name=f"l2a@theta={t}", knobs={"checkpoint": "/r/l2a", "sweep": {"theta": t}})
            for t in (0.7, 0.3, 0.5)] + [dict(name="dense", knobs={"checkpoint": "/r/d"})]
  from condattn_jax.evaluation import plots
  assert plots.sweep_groups({"models": models}) == {"/r/l2a: theta": [1, 2, 0]}


def test_perplexity_by_position_equals_the_models_log_softmax():
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  cfg = ModelConfig(vocab_size=V, num_layers=1)
  params = nn.unbox(Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, V, size=n).tolist() for n in (40, 33, 20, 50)]  # 20: too short
  r = harness.perplexity_by_position(cfg, params, docs, 32, num_bins=4, batch_size=2)
  assert r["documents"] == 3 and [(b["start"], b["end"]) for b in r["bins"]] == \
      [(0, 8), (8, 16), (16, 24), (24, 32)]
  nll = []
  for d in (docs[0], docs[1], docs[3]):
    logits = Decoder(cfg).apply({"params": params}, jnp.asarray([d[:32]]))[0][0]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    nll.append(-lp[np.arange(32), d[1:33]])
  nll = np.mean(nll, axis=0)
  for b in r["bins"]:
    assert b["nll"] == pytest.approx(nll[b["start"]:b["end"]].mean(), rel=1e-4)
    assert b["ppl"] == pytest.approx(np.exp(b["nll"]), rel=1e-6)
  assert r["nll"] == pytest.approx(nll.mean(), rel=1e-4)
  with pytest.raises(ValueError, match="no document has more than 64"):
    harness.perplexity_by_position(cfg, params, docs, 64)


def test_suite_data_source_rows_train_on_the_answers():
  """data.source='suite': training rows of the token-level tasks, loss on the answers only
  (which the prompt's reader recovers), never an evaluation sample."""
  from condattn_jax.data.synthetic import make_task
  task = make_task("suite", {"vocab_size": V, "suite": "tiny"}, 127)
  assert task.tasks == T.TOKEN_TASKS
  evals = {s.prompt for s in T.build_samples("tiny", (128,), num_samples=40, vocab_size=V)}
  answer_lens = set()
  for i in range(40):
    row = task.example(0, i, stream=0)
    assert row["inputs"].shape == (127,) and (row["targets"][:-1] == row["inputs"][1:]).all()
    pos = np.nonzero(row["loss_mask"])[0]
    assert (np.diff(pos) == 1).all()  # the answers: one run right after the prompt
    prompt = tuple(int(t) for t in row["inputs"][:pos[0] + 1])
    answers = [int(t) for t in row["targets"][pos]]
    assert prompt not in evals
    assert any(_reads_as(n, prompt, answers) for n in T.TOKEN_TASKS), (i, prompt[-6:], answers)
    answer_lens.add(len(answers))
  assert len(answer_lens) >= 4  # a mixture of tasks (1 to 5 answer ids)
  with pytest.raises(ValueError, match="unknown task"):
    make_task("suite", {"vocab_size": V, "tasks": ["nope"]}, 127)


def _reads_as(name, prompt, answer_ids):
  """The reader of task `name` finds these answers in the prompt (in some order)."""
  try:
    got = [t for a in solve_tokens(name, prompt) for t in a]
  except (ValueError, IndexError):
    return False
  return sorted(got) == sorted(answer_ids) and len(got) > 0


def test_text_suite_through_the_real_engine(tok):
  """Text prompts are encoded with the model's tokenizer, generated by inference.Engine and
  decoded; a random model's outputs are strings scored in [0, 1]."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=1)
  params = nn.unbox(Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  m = harness.model_from_params("rand", cfg, params, tokenizer=tok)
  ss = T.build_samples("long", (1024,), num_samples=1, tokenizer=tok,
                       tasks=["passkey", "json_kv"])
  r = harness.evaluate_model(m, ss, batch_size=2)
  assert [rec["id"] for rec in r["records"]] == ["passkey/L1024/0", "json_kv/L1024/0"]
  for rec, s in zip(r["records"], ss):
    assert isinstance(rec["output"], str) and "\n" not in rec["output"]
    assert rec["prompt_tokens"] == len(tok.encode(s.prompt)) <= 1024 - s.max_new_tokens
    assert rec["score"] in (0.0, 1.0)
  assert r["efficiency"]["1024"]["prefill_chunk"] == 1024


def test_length_budget_counts_a_bos_the_tokenizer_adds(tok):
  from condattn_jax.data.tokenizer import Tokenizer
  bos_tok = Tokenizer(tok.backend, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                      add_bos=True, source="qwen+bos")
  assert bos_tok.encode("a")[0] == bos_tok.bos_id
  for s in T.build_samples("long", (1024,), num_samples=2, tokenizer=bos_tok,
                           tasks=["passkey", "niah_single_1"]):
    n = len(bos_tok.encode(s.prompt))  # what the harness feeds the engine, BOS included
    assert 1024 - 100 <= n + s.max_new_tokens <= 1024, (s.id, n)  # a noise sentence: ~70 ids


def test_suite_rows_pack_samples_as_documents():
  """data.task.pack=k: k samples of seq_len // k ids in one row as packed documents (segment ids
  1..k, positions from 0 in each), each read as a task sample with its answers scored; k must
  divide seq_len, and a scheme that runs a row as one document refuses packing."""
  from condattn_jax.data.synthetic import make_task
  from condattn_jax.train import config as config_lib
  task = make_task("suite", {"vocab_size": V, "suite": "tiny", "pack": 4}, 512)
  one = make_task("suite", {"vocab_size": V, "suite": "tiny"}, 512)
  assert (task.example(0, 3)["inputs"] != one.example(0, 3)["inputs"]).any()
  for i in range(6):
    row = task.example(0, i)
    assert row["inputs"].shape == (512,)
    assert (row["segment_ids"] == np.repeat(np.arange(1, 5), 128)).all()
    assert (row["positions"] == np.tile(np.arange(128), 4)).all()
    for j in range(4):
      seg = slice(128 * j, 128 * (j + 1))
      inp, tgt, mask = row["inputs"][seg], row["targets"][seg], row["loss_mask"][seg]
      assert (tgt[:-1] == inp[1:]).all()
      pos = np.nonzero(mask)[0]
      assert len(pos) >= 1 and (np.diff(pos) == 1).all()
      prompt = tuple(int(t) for t in inp[:pos[0] + 1])
      assert any(_reads_as(n, prompt, [int(t) for t in tgt[pos]]) for n in T.TOKEN_TASKS)
  with pytest.raises(ValueError, match=r"data.task.pack=3 must be >= 1 and divide data.seq_len"):
    make_task("suite", {"vocab_size": V, "suite": "tiny", "pack": 3}, 512)
  c = config_lib.default_config()
  c.model.vocab_size = V
  c.data.source, c.data.seq_len = "suite", 256
  c.data.task = dict(vocab_size=V, suite="tiny", pack=2)
  c.model.scheme.name = "segmented"
  with pytest.raises(ValueError, match=r"config.data.task.pack=2 .* set config.data.task.pack=1"):
    config_lib.validate_config(c)
