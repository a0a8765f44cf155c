"""The long-context task suite: generated offline (seeded, deterministic, no downloads), keyed by
context length, each sample with its prompt, answer(s) and scoring rule.

    samples = build_samples("ruler", lengths=(4096, 8192), num_samples=20, tokenizer=tok)
    samples = build_samples("tiny", lengths=(128, 256), vocab_size=64)    # token-level

A `Sample` is one prompt: `prompt` is text (str) for a model with a tokenizer, token ids (tuple)
for the token-level variant (models without a text tokenizer, e.g. the synthetic tiny models);
`answers` are strings / id tuples; `metric` is 'all' (fraction of the answers found in the
output) or 'part' (any answer found), see `scoring.py`; `max_new_tokens` is the generation
budget. A sample is a pure function of (seed, task, length, index): `np.random` / `random`
seeded with those values.

Length contract (RULER's): a text sample's prompt is the longest the task's generator makes with
tokens(prompt) + max_new_tokens <= length, tokens counted by the model's tokenizer (text in, the
tokenizer decides the tokens; its BOS counted when it adds one). A token-level prompt has exactly
length - max_new_tokens ids (MQAR: at most that many).

Text tasks (following RULER, github NVIDIA/RULER scripts/data/synthetic, its templates, answer
prefixes and tokens_to_generate):
  niah_single_1     one needle "One of the special magic numbers for <adj-noun> is: <7 digits>."
                    in the noise haystack ("The grass is green. ..." repeated) (RULER niah_single_1)
  niah_single_3     the same with a UUID value (RULER niah_single_3 uses the essay haystack)
  niah_multikey_1   4 needles with word keys, 1 asked (RULER: essay haystack; here noise)
  niah_multikey_2   the haystack is made of needles (word keys, number values)
  niah_multikey_3   the haystack is made of needles (UUID keys, UUID values)
  niah_multivalue   one key, 4 values, all asked                     (RULER: essay; here noise)
  niah_multiquery   4 keys, all asked                                (RULER: essay; here noise)
  vt                variable tracking: 1 chain of 4 hops in noise ("VAR ABCDE = 12345")
  cwe               common-word extraction: the 10 most common words of a numbered list
                    (one few-shot example; RULER's repeat counts: 30/3, or 6/1 below 4K)
  fwe               frequent-word extraction: the 3 most frequent coded words (Zipf, alpha 2)
  json_kv           HELMET's JSON key-value retrieval: a JSON object of UUID keys and values,
                    the value of one key asked (metric 'part', HELMET's substring exact match)
  passkey           passkey retrieval (Mohtashami & Jaggi 2023): a 5-digit key in noise
  mqar              MQAR at natural-language scale: 'adj-noun' keys with 4-digit values listed
                    as sentences, 4 keys asked together (metric 'all')
  niah_*_essay      the niah tasks on an essay haystack: only with a user-provided text file
                    (RULER downloads Paul Graham's essays: not done here)
  qa                question answering on a user-provided file (RULER's qa_1 / qa_2 download SQuAD /
                    HotpotQA): `load_qa_file` reads JSON / JSONL rows {question, answers,
                    documents | context}; a sample's documents plus distractors from other rows fill
                    the length (metric 'part')
Differences from RULER: no essay or QA download (loaders for user files instead), built-in word
lists (`words.py`) instead of the `wonderwords` package, the prompts are the base-model form
(template + answer prefix, no chat template).

Token-level variants (ids; vocabulary V = the model's): 0 = filler of MQAR, 1 = NEEDLE, 2 = QUERY,
3 = SEP, key / value ids from [4, 4 + kv) (kv = min(256, (V - 4) // 2)), noise haystack from
[4 + kv, V) (the layout of `data.synthetic.NIAH`, so a model trained on it reads these):
  niah_single_1 / niah_multikey_1 / niah_multivalue / niah_multiquery   NEEDLE key value ...,
                    QUERY key(s) -> the value(s) (answers: each value's ids)
  vt                NEEDLE x0 SEP val, NEEDLE x1 SEP x0, ... (in order); QUERY val -> every x
  cwe / fwe         counted tokens (most common / Zipf ranks 2-4); QUERY -> those tokens
  json_kv           key SEP value records back to back; QUERY key -> value
  passkey           a repeated 16-token noise cycle, NEEDLE + 5 digit ids; QUERY -> the digits
  mqar              `data.synthetic.MQAR` cut after its last query key -> that key's value
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import string
import uuid
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from condattn_jax.evaluation import words as W


@dataclasses.dataclass(frozen=True)
class Sample:
  task: str
  length: int
  index: int
  prompt: str | tuple[int, ...]
  answers: tuple
  metric: str
  max_new_tokens: int

  @property
  def id(self) -> str:
    return f"{self.task}/L{self.length}/{self.index}"

  @property
  def token_level(self) -> bool:
    return not isinstance(self.prompt, str)


# ------------------------------------------------------------------------------ text: RULER
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TEMPLATES = {  # RULER scripts/data/synthetic/constants.py (template + answer prefix)
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure "
             "to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
             "What are all the special magic {type_needle_v} for {query} mentioned in the "
             "provided text? The special magic {type_needle_v} for {query} mentioned in the "
             "provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text."
           "\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in "
           "the text above. Answer: According to the chain(s) of variable assignment in the text "
           "above, {num_v} variables are assigned the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the "
            "10 most common words in the above list? Answer: The top 10 words that appear most "
            "often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the "
            "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
            "explanation. Please ignore the dots '....'. What are the three most frequently "
            "appeared words in the above coded text? Answer: According to the coded text above, "
            "the three most frequently appeared words are:"),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not "
           "output any other words.\n\nThe following are given documents.\n\n{context}\n\n"
           "Answer the question based on the given documents. Only give me the answer and do not "
           "output any other words.\n\nQuestion: {query} Answer:"),
    # HELMET json_kv (github princeton-nlp/HELMET, data.py)
    "json_kv": ("Extract the value corresponding to the specified key in the JSON object below."
                "\n\nJSON data:\n{context}\n\nKey: \"{query}\"\nCorresponding value:"),
    # Mohtashami & Jaggi 2023 (landmark attention), passkey retrieval
    "passkey": ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                "memorize them. I will quiz you about the important information there.\n"
                "{context}\nWhat is the pass key? The pass key is"),
    "mqar": ("Below is a list of key-value pairs. Memorize them: I will ask for the values of "
             "several keys.\n{context}\nWhat are the values of {query}? The values are:"),
}


def _word(rng: random.Random) -> str:
  return f"{rng.choice(W.ADJECTIVES)}-{rng.choice(W.NOUNS)}"


def _rand(rng: random.Random, kind: str) -> str:
  if kind == "numbers":
    return str(rng.randint(10**6, 10**7 - 1))
  if kind == "words":
    return _word(rng)
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  raise ValueError(f"unknown needle type {kind!r}")


def _distinct(rng, kind, n):
  out: list[str] = []
  while len(out) < n:
    x = _rand(rng, kind)
    if x not in out:
      out.append(x)
  return out


def _sentences(text: str) -> list[str]:
  """Sentence split on '. ' / '? ' / '! ' (RULER uses nltk's sent_tokenize)."""
  out, cur = [], []
  for w in text.split(" "):
    cur.append(w)
    if w.endswith((".", "?", "!")):
      out.append(" ".join(cur))
      cur = []
  if cur:
    out.append(" ".join(cur))
  return out


def niah_text(rng: random.Random, n: int, *, haystack="noise", type_k="words", type_v="numbers",
              num_k=1, num_v=1, num_q=1, essay_words: Sequence[str] = ()):
  """RULER niah.generate_input_output: n haystack units (noise sentences, needles or essay
  words), the needles inserted at random places; returns (prompt, answers)."""
  num_k = max(num_k, num_q)
  keys = _distinct(rng, type_k, num_k)
  values, needles = [], []
  for k in keys:
    vs = _distinct(rng, type_v, num_v)
    values.append(vs)
    needles += [NEEDLE.format(type_needle_v=type_v, key=k, value=v) for v in vs]
  rng.shuffle(needles)
  if haystack == "essay":
    if not essay_words:
      raise ValueError("the essay haystack needs a text file (haystack_file=...).")
    reps = -(-n // len(essay_words))
    sents = _sentences(" ".join((list(essay_words) * reps)[:n]))
    depths = sorted(rng.sample(range(41), len(needles)))
    cuts = [0] + [int(len(sents) * d / 40) for d in depths] + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
      parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
      if i - 1 < len(needles):
        parts.append(needles[i - 1])
    context = " ".join(p for p in parts if p)
  else:
    if haystack == "noise":
      sents = [NOISE] * n
    elif haystack == "needle":
      sents = [NEEDLE.format(type_needle_v=type_v, key=_rand(rng, type_k), value=_rand(rng, type_v))
               for _ in range(n)]
    else:
      raise ValueError(f"unknown haystack {haystack!r}; valid: noise, needle, essay")
    for idx, needle in zip(sorted(rng.choices(range(n + 1), k=len(needles)), reverse=True), needles):
      sents.insert(idx, needle)
    context = "\n".join(sents)
  asked = rng.sample(range(num_k), num_q)
  queries = [keys[i] for i in asked]
  answers = [a for i in asked for a in values[i]]
  query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
  template, tv = TEMPLATES["niah"], type_v
  if num_q * num_v == 1:  # RULER's singular form
    template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                .replace("answers", "answer"))
    tv = type_v[:-1]
  return template.format(type_needle_v=tv, context=context, query=query), answers


def vt_text(rng: random.Random, n: int, *, num_chains=1, num_hops=4):
  """RULER variable_tracking (noise haystack): chains 'VAR X = 12345', 'VAR Y = VAR X', ...
  inserted in order; the answer is every variable of the first chain."""
  names: list[str] = []
  while len(names) < (num_hops + 1) * num_chains:
    v = "".join(rng.choices(string.ascii_uppercase, k=5))
    if v not in names:
      names.append(v)
  chains, chain_vars = [], []
  for c in range(num_chains):
    vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
    chain = [f"VAR {vs[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
    chains.append(chain)
    chain_vars.append(vs)
  sents = [NOISE] * n
  for chain in chains:
    pos = sorted(rng.choices(range(len(sents) + 1), k=len(chain)))
    for j, (p, line) in enumerate(zip(pos, chain)):
      sents.insert(p + j, line)
  context = "\n".join(sents).replace(". \n", ".\n")
  value = chains[0][0].split("=")[-1].strip()
  return TEMPLATES["vt"].format(context=context, query=value, num_v=num_hops + 1), chain_vars[0]


@functools.lru_cache(maxsize=4)
def _pseudo_words(count: int) -> tuple[str, ...]:
  """A fixed pool of `count` distinct lowercase pseudo-words (for word lists longer than the
  built-in common words; RULER uses random words there too)."""
  r = random.Random(1234)
  out, seen = [], set(W.COMMON_WORDS)
  while len(out) < count:
    w = "".join(r.choices("bcdfghjklmnprstvwz", k=3))
    w = w[0] + r.choice("aeiou") + w[1] + r.choice("aeiou") + w[2]
    if w not in seen:
      seen.add(w)
      out.append(w)
  return tuple(out)


def _cwe_example(rng, n, freq_cw, freq_ucw, num_cw):
  pool = W.COMMON_WORDS if n <= len(W.COMMON_WORDS) else _pseudo_words(max(n, 4096))
  chosen = rng.sample(pool, n)
  common, uncommon = chosen[:num_cw], chosen[num_cw:]
  wl = common * freq_cw + uncommon * freq_ucw
  rng.shuffle(wl)
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(wl)), common


def cwe_text(rng: random.Random, n: int, *, length: int, num_cw=10, freq_cw=30, freq_ucw=3):
  """RULER common_words_extraction with one few-shot example; n = distinct words."""
  n = max(n, num_cw + 1)
  if length < 4096:
    ex, ex_ans = _cwe_example(rng, 20, 3, 1, num_cw)
    ctx, ans = _cwe_example(rng, n, 6, 1, num_cw)
  else:
    ex, ex_ans = _cwe_example(rng, 40, 10, 3, num_cw)
    ctx, ans = _cwe_example(rng, n, freq_cw, freq_ucw, num_cw)
  shot = TEMPLATES["cwe"].format(context=ex) + " " + " ".join(
      f"{i + 1}. {w}" for i, w in enumerate(ex_ans))
  return shot + "\n" + TEMPLATES["cwe"].format(context=ctx), list(ans)


def fwe_text(rng: random.Random, n: int, *, length: int, alpha=2.0, coded_wordlen=6):
  """RULER freq_words_extraction: n coded words drawn Zipf(alpha) over a vocabulary of
  length // 50 words, rank 1 shown as '...' (noise); the answer is ranks 2-4."""
  vocab_size = max(length // 50, 10)
  vocab: list[str] = []
  while len(vocab) < vocab_size:
    w = "".join(rng.choices(string.ascii_lowercase, k=coded_wordlen))
    if w not in vocab:
      vocab.append(w)
  vocab[0] = "..."
  k = np.arange(1, vocab_size + 1, dtype=np.float64)
  zeta = float(np.sum(np.arange(1, 100000, dtype=np.float64) ** -alpha))
  counts = (n * k ** -alpha / zeta).astype(int)
  wl = [w for w, c in zip(vocab, counts) for _ in range(c)]
  rng.shuffle(wl)
  return TEMPLATES["fwe"].format(context=" ".join(wl)), vocab[1:4]


def json_kv_text(rng: random.Random, n: int):
  """HELMET json_kv: n UUID -> UUID pairs as one JSON object; one key asked."""
  n = max(n, 1)
  keys = _distinct(rng, "uuids", n)
  values = [_rand(rng, "uuids") for _ in keys]
  target = rng.randrange(n)
  ctx = json.dumps(dict(zip(keys, values)), ensure_ascii=False)
  return TEMPLATES["json_kv"].format(context=ctx, query=keys[target]), [values[target]]


def passkey_text(rng: random.Random, n: int):
  key = str(rng.randint(10000, 99999))
  info = f"The pass key is {key}. Remember it. {key} is the pass key."
  sents = [NOISE] * n
  sents.insert(rng.randint(0, n), info)
  return TEMPLATES["passkey"].format(context=" ".join(sents)), [key]


def mqar_text(rng: random.Random, n: int, *, num_queries=4):
  """MQAR in sentences: 'The value of <adj-noun> is <4 digits>.' for n distinct keys; the
  values of num_queries of them asked at once."""
  n = max(n, num_queries)
  keys = _distinct(rng, "words", n)
  values = [str(rng.randint(1000, 9999)) for _ in keys]
  asked = rng.sample(range(n), num_queries)
  ctx = "\n".join(f"The value of {k} is {v}." for k, v in zip(keys, values))
  q = [keys[i] for i in asked]
  query = ", ".join(q[:-1]) + " and " + q[-1] if len(q) > 1 else q[0]
  return TEMPLATES["mqar"].format(context=ctx, query=query), [values[i] for i in asked]


def json_lines(text: str, path: str) -> list:
  """The JSON value of each non-blank line of `text` (read from `path`); a bad line is one
  ValueError naming `path:line`."""
  rows = []
  for i, line in enumerate(text.splitlines()):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg}).") from None
  return rows


def load_qa_file(path: str) -> list[dict]:
  """Rows {question: str, answers: [str], documents: [str]} from a JSON list or JSONL file
  (a 'context' string stands for one document; RULER's SQuAD / HotpotQA files converted)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"qa_file={path} does not exist.")
  with open(path) as f:
    text = f.read()
  try:
    rows = json.loads(text)
    rows = rows if isinstance(rows, list) else [rows]
  except json.JSONDecodeError:
    rows = json_lines(text, path)
  out = []
  for i, r in enumerate(rows):
    docs = r.get("documents") or ([r["context"]] if r.get("context") else None)
    ans = r.get("answers")
    if not isinstance(r.get("question"), str) or not docs or not ans:
      raise ValueError(f"{path}: row {i + 1} needs 'question' (str), 'answers' (list) and "
                       f"'documents' (list) or 'context' (str).")
    out.append(dict(question=r["question"], answers=[str(a) for a in ans], documents=list(docs)))
  if len(out) < 1:
    raise ValueError(f"{path}: no QA rows.")
  return out


def qa_text(rng: random.Random, n: int, *, rows: Sequence[dict], index: int):
  """RULER qa: the row's documents plus n distractor documents from the other rows, shuffled."""
  row = rows[index % len(rows)]
  others = [d for j, r in enumerate(rows) if j != index % len(rows) for d in r["documents"]]
  docs = list(row["documents"]) + ([others[(index + j) % len(others)] for j in range(n)]
                                   if others else [])
  rng.shuffle(docs)
  ctx = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
  return TEMPLATES["qa"].format(context=ctx, query=row["question"]), list(row["answers"])


# ------------------------------------------------------------------------------ tokens
FILLER, TNEEDLE, TQUERY, TSEP, FIRST_KV = 0, 1, 2, 3, 4


def _kv(V: int) -> int:
  kv = min(256, (V - FIRST_KV) // 2)
  if kv < 8:
    raise ValueError(f"token-level tasks need a vocabulary of >= 20 ids, the model has {V}.")
  return kv


def _noise(rng, n, V):
  return rng.integers(FIRST_KV + _kv(V), V, size=n).astype(np.int64).tolist()


def _insert(rng, hay: list, pieces: list[list[int]], ordered=False) -> list:
  """Inserts pieces (lists of ids) at random places of hay, keeping the total length: each piece
  replaces that many haystack ids."""
  n = len(hay) - sum(len(p) for p in pieces)
  if n < 0:
    raise ValueError("the context length is too short for this token-level task.")
  order = list(range(len(pieces))) if ordered else rng.permutation(len(pieces)).tolist()
  cuts = np.sort(rng.integers(0, n + 1, size=len(pieces)))
  # hay[:c_0] + pieces[order[0]] + hay[c_0:c_1] + ... + hay[c_last:n], in one np.insert (the
  # ids of a piece all go in before haystack position c, in order)
  placed = [pieces[j] for j in order]
  lens = np.asarray([len(p) for p in placed], np.int64)
  ids = np.asarray([t for p in placed for t in p], np.int64)
  return np.insert(np.asarray(hay[:n], np.int64), np.repeat(cuts, lens), ids).tolist()


def _draws(rng, count, size, kv) -> list[tuple]:
  """`count` draws of `size` ids from [FIRST_KV, FIRST_KV + kv): the ids of `count` calls
  rng.integers(0, kv, size=size) in one call (numpy's generator gives the same stream)."""
  a = rng.integers(0, kv, size=count * size) + FIRST_KV
  return [tuple(r) for r in a.reshape(count, size).tolist()]


def _keys(rng, count, key_len, kv):
  """`count` distinct keys of key_len ids: draws of one key each, a repeat drawn again."""
  seen: list[tuple] = []
  have: set[tuple] = set()
  while len(seen) < count:
    for k in _draws(rng, count - len(seen), key_len, kv):  # never more draws than one by one
      if k not in have:
        have.add(k)
        seen.append(k)
  return seen


def niah_tokens(rng, budget, V, *, num_k=1, num_v=1, num_q=1, key_len=2, value_len=2):
  kv = _kv(V)
  num_k = max(num_k, num_q)
  keys = _keys(rng, num_k, key_len, kv)
  values = [[tuple((rng.integers(0, kv, size=value_len) + FIRST_KV).tolist())
             for _ in range(num_v)] for _ in keys]
  needles = [[TNEEDLE, *k, *v] for k, vs in zip(keys, values) for v in vs]
  asked = rng.choice(num_k, size=num_q, replace=False).tolist()
  query = [TQUERY] + [t for i in asked for t in keys[i]]
  hay = _insert(rng, _noise(rng, budget - len(query), V), needles)
  return hay + query, [v for i in asked for v in values[i]]


def vt_tokens(rng, budget, V, *, num_hops=4):
  kv = _kv(V)
  ids = (rng.choice(kv, size=num_hops + 2, replace=False) + FIRST_KV).tolist()
  value, names = ids[0], ids[1:]
  chain = [[TNEEDLE, names[0], TSEP, value]]
  chain += [[TNEEDLE, names[j + 1], TSEP, names[j]] for j in range(num_hops)]
  query = [TQUERY, value]
  hay = _insert(rng, _noise(rng, budget - len(query), V), chain, ordered=True)
  return hay + query, [(x,) for x in names]


def cwe_tokens(rng, budget, V, *, num_cw=4):
  kv = _kv(V)
  n = budget - 1
  types = (rng.permutation(kv)[:kv] + FIRST_KV).tolist()
  common, uncommon = types[:num_cw], types[num_cw:]
  f_u = max(1, n // (len(uncommon) + 3 * num_cw))
  f_c = (n - len(uncommon) * f_u) // num_cw
  if f_c <= f_u:
    raise ValueError(f"cwe: context of {budget} ids too short to make {num_cw} common tokens.")
  seq = [t for t in common for _ in range(f_c)] + [t for t in uncommon for _ in range(f_u)]
  seq = rng.permutation(np.asarray(seq)).tolist()
  seq = _insert(rng, _noise(rng, n, V), [[t] for t in seq], ordered=True)
  return seq + [TQUERY], [(t,) for t in common]


def fwe_tokens(rng, budget, V, *, alpha=2.0, num_answers=3):
  kv = _kv(V)
  n = budget - 1
  vocab = (rng.permutation(kv) + FIRST_KV).tolist()
  k = np.arange(1, kv + 1, dtype=np.float64)
  counts = (n * k ** -alpha / float(np.sum(k ** -alpha)) * 0.9).astype(int)
  if not np.all(np.diff(counts[:num_answers + 2]) < 0):
    raise ValueError(f"fwe: context of {budget} ids too short for distinct top frequencies.")
  seq = [t for t, c in zip(vocab, counts) for _ in range(c)]
  seq = rng.permutation(np.asarray(seq)).tolist()
  seq = _insert(rng, _noise(rng, n, V), [[t] for t in seq], ordered=True)
  return seq + [TQUERY], [(t,) for t in vocab[1:1 + num_answers]]


def json_kv_tokens(rng, budget, V, *, value_len=2):
  kv = _kv(V)
  key_len = 1
  while True:
    count = max(1, (budget - 1 - key_len) // (2 * key_len + value_len + 1))
    if kv ** key_len >= 2 * count:
      break
    key_len += 1
  keys = _keys(rng, count, key_len, kv)
  values = _draws(rng, len(keys), value_len, kv)
  body = [t for k, v in zip(keys, values) for t in (*k, TSEP, *v)]
  target = int(rng.integers(0, count))
  query = [TQUERY, *keys[target]]
  pad = budget - len(body) - len(query)
  return _noise(rng, pad, V) + body + query, [values[target]]


def passkey_tokens(rng, budget, V, *, digits=5):
  kv = _kv(V)
  cycle = _noise(rng, 16, V)
  key = tuple((rng.integers(0, min(10, kv), size=digits) + FIRST_KV).tolist())
  hay = (cycle * (budget // 16 + 1))[:budget - 1]
  return _insert(rng, hay, [[TNEEDLE, *key]]) + [TQUERY], [key]


def mqar_tokens(rng, budget, V, *, num_pairs=8):
  from condattn_jax.data.synthetic import MQAR
  seed = int(rng.integers(0, 2**31))
  task = MQAR(seq_len=budget, vocab_size=V, num_pairs=num_pairs)
  row = task.example(seed, 0, stream=2)
  q = int(np.nonzero(row["loss_mask"])[0].max())
  return row["inputs"][:q + 1].tolist(), [(int(row["targets"][q]),)]


# ------------------------------------------------------------------------------ registry
@dataclasses.dataclass(frozen=True)
class Task:
  """One task: `text(rng, n, **kw) -> (prompt, answers)` (n = haystack units; None: token-level
  only), `tokens(np_rng, budget, V, **kw) -> (ids, answers)`, its metric and its generation
  budget for text (`max_new_tokens`; token-level: the answers' total length)."""
  name: str
  metric: str
  max_new_tokens: int
  text: Callable | None
  tokens: Callable | None
  text_kw: dict = dataclasses.field(default_factory=dict)
  token_kw: dict = dataclasses.field(default_factory=dict)
  needs: str | None = None  # 'haystack_file' | 'qa_file': only with that user file
  source: str = ""


def _t(name, metric, max_new, text, tokens, text_kw=None, token_kw=None, needs=None, source=""):
  return Task(name, metric, max_new, text, tokens, dict(text_kw or {}), dict(token_kw or {}),
              needs, source)


TASKS: dict[str, Task] = {t.name: t for t in (
    _t("niah_single_1", "all", 128, niah_text, niah_tokens, source="RULER niah_single_1"),
    _t("niah_single_3", "all", 128, niah_text, None, dict(type_v="uuids"),
       source="RULER niah_single_3 (noise haystack)"),
    _t("niah_multikey_1", "all", 128, niah_text, niah_tokens, dict(num_k=4), dict(num_k=4),
       source="RULER niah_multikey_1 (noise haystack)"),
    _t("niah_multikey_2", "all", 128, niah_text, None, dict(haystack="needle"),
       source="RULER niah_multikey_2"),
    _t("niah_multikey_3", "all", 128, niah_text, None,
       dict(haystack="needle", type_k="uuids", type_v="uuids"), source="RULER niah_multikey_3"),
    _t("niah_multivalue", "all", 128, niah_text, niah_tokens, dict(num_v=4), dict(num_v=2),
       source="RULER niah_multivalue (noise haystack)"),
    _t("niah_multiquery", "all", 128, niah_text, niah_tokens, dict(num_q=4), dict(num_q=2),
       source="RULER niah_multiquery (noise haystack)"),
    _t("vt", "all", 30, vt_text, vt_tokens, source="RULER vt"),
    _t("cwe", "all", 120, cwe_text, cwe_tokens, source="RULER cwe"),
    _t("fwe", "all", 50, fwe_text, fwe_tokens, source="RULER fwe"),
    _t("json_kv", "part", 100, json_kv_text, json_kv_tokens, source="HELMET json_kv"),
    _t("passkey", "part", 10, passkey_text, passkey_tokens, source="passkey (landmark attention)"),
    _t("mqar", "all", 64, mqar_text, mqar_tokens, source="MQAR (Zoology), in sentences"),
    _t("niah_single_2", "all", 128, niah_text, None, dict(haystack="essay"),
       needs="haystack_file", source="RULER niah_single_2 (essay: user file)"),
    _t("niah_multikey_1_essay", "all", 128, niah_text, None, dict(haystack="essay", num_k=4),
       needs="haystack_file", source="RULER niah_multikey_1 (essay: user file)"),
    _t("niah_multivalue_essay", "all", 128, niah_text, None, dict(haystack="essay", num_v=4),
       needs="haystack_file", source="RULER niah_multivalue (essay: user file)"),
    _t("niah_multiquery_essay", "all", 128, niah_text, None, dict(haystack="essay", num_q=4),
       needs="haystack_file", source="RULER niah_multiquery (essay: user file)"),
    _t("qa", "part", 32, qa_text, None, needs="qa_file", source="RULER qa_1 / qa_2 (user file)"),
)}

RULER_TASKS = ("niah_single_1", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
TOKEN_TASKS = tuple(n for n, t in TASKS.items() if t.tokens is not None)


@dataclasses.dataclass(frozen=True)
class Suite:
  """tasks; default lengths and samples per (task, length); token_level: always the token-level
  variants (else: text with a tokenizer, token-level without one); token_kw: per-task overrides
  of the token-level parameters."""
  tasks: tuple
  lengths: tuple
  num_samples: int
  token_level: bool = False
  token_kw: dict = dataclasses.field(default_factory=dict)


SUITES: dict[str, Suite] = {
    # CI: token-level tasks at a few hundred ids (the tiny models' vocabularies).
    "tiny": Suite(TOKEN_TASKS, (128, 256), 4, token_level=True,
                  token_kw={"mqar": dict(num_pairs=8)}),
    "ruler": Suite(RULER_TASKS, (4096, 8192, 16384), 20),
    "long": Suite(RULER_TASKS + ("json_kv", "passkey", "mqar"), (4096, 8192, 16384), 20),
    "synthetic": Suite(TOKEN_TASKS, (4096, 8192, 16384), 20, token_level=True,
                       token_kw={"mqar": dict(num_pairs=64)}),
}


def _seed(*parts) -> int:
  return zlib.crc32("/".join(map(str, parts)).encode())


def _fit_units(gen, count_tokens, budget: int) -> int:
  """Largest n >= 1 with count_tokens(gen(n)) <= budget (gen(n) deterministic); doubling then
  binary search. Raises if even n=1 does not fit."""
  if count_tokens(gen(1)) > budget:
    raise ValueError(f"context length too short: the task's prompt with one haystack unit "
                     f"does not fit {budget} tokens.")
  lo, hi = 1, 2
  while count_tokens(gen(hi)) <= budget:
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if count_tokens(gen(mid)) <= budget else (lo, mid)
  return lo


def _text_sample(task: Task, length, index, seed, tokenizer, files, n0_cache):
  budget = length - task.max_new_tokens
  kw = dict(task.text_kw)
  if task.text in (cwe_text, fwe_text):
    kw["length"] = length
  if task.needs == "haystack_file":
    kw["essay_words"] = files["haystack_words"]
  if task.needs == "qa_file":
    kw.update(rows=files["qa_rows"], index=index)

  def gen(i, n):
    return task.text(random.Random(_seed(seed, task.name, length, i, n)), n, **kw)

  def count(pa):  # as the harness encodes the prompt: BOS when the tokenizer adds one
    return len(tokenizer.encode(pa[0]))
  key = (task.name, length)
  if key not in n0_cache:  # RULER: search the haystack size on one sample, shrink per sample
    try:
      n0_cache[key] = _fit_units(lambda n: gen(0, n), count, budget)
    except ValueError as e:
      raise ValueError(f"task {task.name} at length {length}: {e} Use a longer length or "
                       f"drop the task (tasks=...).") from None
  n = n0_cache[key]
  step = max(1, n // 20)
  prompt, answers = gen(index, n)
  while count((prompt, answers)) > budget:
    if n == 1:
      raise ValueError(f"{task.name} at length {length}: no prompt fits.")
    n = max(1, n - step)
    prompt, answers = gen(index, n)
  return Sample(task.name, int(length), int(index), prompt, tuple(answers), task.metric,
                task.max_new_tokens)


_ANSWER_LEN: dict = {}  # (task, length, vocab_size, params) -> the answers' total length


def _token_sample(task: Task, length, index, seed, vocab_size, overrides):
  kw = {**task.token_kw, **overrides}
  # The answers' total length is fixed by the task's parameters: one draw learns it (once per
  # task, length, vocabulary and parameters), the sample is then drawn with the prompt budget
  # length - max_new_tokens.
  key = (task.name, int(length), int(vocab_size), tuple(sorted(kw.items())))
  if key not in _ANSWER_LEN:
    _, answers = task.tokens(np.random.default_rng(0), length, vocab_size, **kw)
    _ANSWER_LEN[key] = sum(len(a) for a in answers)
  max_new = _ANSWER_LEN[key]
  rng = np.random.default_rng(_seed(seed, task.name, length, index))
  ids, answers = task.tokens(rng, length - max_new, vocab_size, **kw)
  return Sample(task.name, int(length), int(index), tuple(int(t) for t in ids),
                tuple(tuple(int(t) for t in a) for a in answers), task.metric, max_new)


def token_sample(task: str, length: int, index: int, *, seed=0, vocab_size: int,
                 suite: str = "synthetic") -> Sample:
  """One token-level sample of `task` with `suite`'s parameters (what build_samples makes)."""
  if task not in TASKS or TASKS[task].tokens is None:
    raise ValueError(f"{task!r} is not a token-level task; valid: {list(TOKEN_TASKS)}")
  return _token_sample(TASKS[task], int(length), int(index), seed, int(vocab_size),
                       SUITES[suite].token_kw.get(task, {}))


def suite_tasks(suite: str, *, tasks: Sequence[str] | None = None, token_level: bool = False,
                haystack_file: str | None = None, qa_file: str | None = None) -> list[str]:
  """The task names a suite runs (tasks needing a user file are added when it is given)."""
  if suite not in SUITES:
    raise ValueError(f"unknown suite {suite!r}; valid: {sorted(SUITES)}")
  names = list(tasks) if tasks else list(SUITES[suite].tasks)
  if not tasks:
    if haystack_file:
      names += [n for n, t in TASKS.items() if t.needs == "haystack_file"]
    if qa_file:
      names.append("qa")
  bad = [n for n in names if n not in TASKS]
  if bad:
    raise ValueError(f"unknown task(s) {bad}; valid: {sorted(TASKS)}")
  token_level = token_level or SUITES[suite].token_level
  if token_level:
    names = [n for n in names if TASKS[n].tokens is not None]
  return names


def build_samples(suite: str, lengths: Sequence[int] | None = None, *, num_samples=None,
                  seed: int = 0, tokenizer=None, vocab_size: int | None = None,
                  tasks: Sequence[str] | None = None, haystack_file: str | None = None,
                  qa_file: str | None = None) -> list[Sample]:
  """Every sample of the suite, ordered by (length, task, index). Text variants need
  `tokenizer` (encode(text, add_bos=False) -> ids); without one (or for a token-level suite)
  the token-level variants are built for `vocab_size` ids. The tokenizer's `encode(text)` (BOS by
  its own rule) counts a prompt's tokens."""
  spec = SUITES.get(suite)
  names = suite_tasks(suite, tasks=tasks, token_level=tokenizer is None,
                      haystack_file=haystack_file, qa_file=qa_file)
  token_level = tokenizer is None or spec.token_level
  if token_level and vocab_size is None:
    raise ValueError("token-level tasks need vocab_size (the model's).")
  lengths = tuple(int(x) for x in (lengths or spec.lengths))
  num_samples = int(num_samples or spec.num_samples)
  files: dict[str, Any] = {}
  if haystack_file:
    if not os.path.isfile(haystack_file):
      raise FileNotFoundError(f"haystack_file={haystack_file} does not exist.")
    with open(haystack_file) as f:
      files["haystack_words"] = f.read().split()
    if not files["haystack_words"]:
      raise ValueError(f"haystack_file={haystack_file} is empty.")
  if qa_file:
    files["qa_rows"] = load_qa_file(qa_file)
  for n in names:
    if TASKS[n].needs and TASKS[n].needs not in ("haystack_file" if haystack_file else "",
                                                  "qa_file" if qa_file else ""):
      raise ValueError(f"task {n} needs {TASKS[n].needs}=<path> (a user-provided file).")
  out, n0_cache = [], {}
  for L in lengths:
    for n in names:
      t = TASKS[n]
      for i in range(num_samples):
        if token_level:
          out.append(_token_sample(t, L, i, seed, int(vocab_size), spec.token_kw.get(n, {})))
        else:
          out.append(_text_sample(t, L, i, seed, tokenizer, files, n0_cache))
  return out


def training_example(sample: Sample) -> tuple[list[int], list[float]]:
  """A token-level sample as a training row: prompt + answers' ids, loss mask on the answers
  (for training a model on a mixture of the suite's generators)."""
  if not sample.token_level:
    raise ValueError("training_example takes a token-level sample.")
  ans = [t for a in sample.answers for t in a]
  ids = list(sample.prompt) + ans
  return ids, [0.0] * len(sample.prompt) + [1.0] * len(ans)
