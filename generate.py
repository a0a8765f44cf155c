r"""Generate from a trained run:  python generate.py --checkpoint=DIR --prompt="..."

  --checkpoint=DIR                   a run's workdir (newest readable checkpoint), its
                                     checkpoints/ dir or one step dir; --step=N picks a step
  --prompt="text"                    one prompt, streamed to stdout as it is generated; without a
                                     tokenizer (the synthetic-task runs) the prompt is token ids
                                     ("3 17 5" or "3,17,5") and the ids generated are printed
  --prompts_file=x.jsonl             one request per line: {"prompt": "text"} or {"tokens": [ids]},
                                     optionally with its own "max_new_tokens", "temperature",
                                     "top_p", "seed", "stop_strings" (a list); prints one JSON
                                     line per request (text and/or tokens, finish_reason, with
                                     --stats the routing statistics)
  --slots=N                          serve the requests through N rows (continuous batching,
                                     Engine.serve: a finished row takes the next request); the
                                     default: all requests in one batch (Engine.generate), or
                                     one row per request through serve when a request has its
                                     own knobs
  --max_new_tokens=64  --cache_len=N (default: prompt + max_new_tokens)  --prefill_chunk=N
  --temperature=0 (greedy) --top_p=1 --seed=0  --stop_tokens=2,5  --stop_strings="\n\n"
                                     (repeatable; needs a tokenizer)  --no_eos: do not stop at the
                                     tokenizer's EOS
  --tokenizer=DIR                    instead of the run's (data.tokenizer / model.init_from)
  --config.model.scheme.theta=0.7    a test-time scheme option (any option of the run's scheme);
  --config.<field>=v                 other fields of the run config saved with the checkpoint
  --warmup                           run the generation once first, so the timings exclude
                                     compilation

After the generation it prints (stderr) the time to the first token (TTFT), decode tokens/s
and the bytes of the cache. A bad input (missing / non-run checkpoint, a token id outside the
vocabulary, a prompt longer than the cache, an unknown option, a bad prompts file) is one line
starting with ERROR: and exit code 2 (--debug shows the traceback).
"""
import json
import sys

from absl import app, flags

from condattn_jax.train import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "A workdir, its checkpoints/ dir or one step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_PROMPT = flags.DEFINE_string("prompt", None, "One prompt (text, or token ids without a tokenizer).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None,
                                    'JSON lines: {"prompt": "text"} or {"tokens": [ids]}.')
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt (>= 1).")
_CACHE_LEN = flags.DEFINE_integer("cache_len", None,
                                  "Cache slots per row (default: longest prompt + max_new_tokens).")
_CHUNK = flags.DEFINE_integer("prefill_chunk", None, "Prompt tokens per prefill call.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with temperature > 0).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STOP_TOKENS = flags.DEFINE_list("stop_tokens", [], "Token ids that end a row.")
_STOP_STRINGS = flags.DEFINE_multi_string("stop_strings", [], "Strings that end a row (repeat).")
_NO_EOS = flags.DEFINE_bool("no_eos", False, "Do not stop at the tokenizer's EOS token.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer directory (default: the run's).")
_STATS = flags.DEFINE_bool("stats", False, "Print the per-row routing statistics.")
_WARMUP = flags.DEFINE_bool("warmup", False, "Generate once before timing (compilation).")
_SLOTS = flags.DEFINE_integer("slots", None, "Serve the requests through this many rows "
                              "(continuous batching).")
KNOBS = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int,
         "stop_strings": list}

SCHEME_PREFIX = "model.scheme."


def _ids(text: str, what: str) -> list[int]:
  parts = text.replace(",", " ").split()
  try:
    return [int(p) for p in parts]
  except ValueError:
    raise ValueError(f"{what}: this run has no tokenizer, so a prompt is token ids separated by "
                     f"spaces or commas (got {text[:40]!r}); or pass --tokenizer=DIR.") from None


def read_requests(tok, prompt, prompts_file) -> tuple[list[list[int]], list[dict]]:
  """(token-id prompts, each request's own knobs) from --prompt or --prompts_file (text
  tokenized with `tok`; knobs: the KNOBS keys a line gives)."""
  if prompt is not None:
    return [tok.encode(prompt) if tok is not None else _ids(prompt, "--prompt")], [{}]
  rows, knobs = [], []
  with open(prompts_file) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"--prompts_file={prompts_file} line {n}"
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e.msg} (column {e.colno}).") from None
      if not isinstance(rec, dict) or ("prompt" in rec) == ("tokens" in rec):
        raise ValueError(f'{where}: give exactly one of "prompt" (text) or "tokens" (ids).')
      own = {k: rec[k] for k in KNOBS if k in rec}
      for k, v in own.items():
        if not isinstance(v, KNOBS[k]) or isinstance(v, bool):
          raise ValueError(f'{where}: "{k}" is {v!r}; it must be a {k.replace("_", " ")} '
                           f'({"a list of strings" if k == "stop_strings" else "a number"}).')
      knobs.append(own)
      if "tokens" in rec:
        rows.append(rec["tokens"])
      elif not isinstance(rec["prompt"], str):
        raise ValueError(f'{where}: "prompt" must be a string.')
      elif tok is None:
        rows.append(_ids(rec["prompt"], where))
      else:
        rows.append(tok.encode(rec["prompt"]))
  if not rows:
    raise ValueError(f"--prompts_file={prompts_file} holds no request.")
  return rows, knobs


def _rounded(d):
  """Stats for JSON: arrays as lists rounded to 4 places (nested dicts kept)."""
  import numpy as np
  return {k: _rounded(v) if isinstance(v, dict) else np.round(np.asarray(v, float), 4).tolist()
          for k, v in d.items()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _CHECKPOINT.value:
    raise app.UsageError("give --checkpoint=<workdir | checkpoints dir | step dir>.")
  if (_PROMPT.value is None) == (_PROMPTS_FILE.value is None):
    raise app.UsageError("give exactly one of --prompt or --prompts_file.")
  if _MAX_NEW.value < 1:
    raise ValueError(f"--max_new_tokens={_MAX_NEW.value} must be >= 1.")
  import os
  if _PROMPTS_FILE.value is not None and not os.path.isfile(_PROMPTS_FILE.value):
    raise FileNotFoundError(f"--prompts_file={_PROMPTS_FILE.value} does not exist.")
  from condattn_jax import checkpoint as ckpt_lib
  ckpt_lib.resolve_checkpoint_path(_CHECKPOINT.value)  # one line, before jax starts
  from condattn_jax.inference import Engine, engine as engine_lib
  from condattn_jax.train import loop
  config = loop.config_from_checkpoint(_CHECKPOINT.value, _STEP.value)
  scheme_opts = {d[len(SCHEME_PREFIX):]: cli.parse_literal(v) for d, v in cli.PENDING_OVERRIDES
                 if d.startswith(SCHEME_PREFIX)}
  cli.apply_overrides(config, [(d, v) for d, v in cli.PENDING_OVERRIDES
                               if not d.startswith(SCHEME_PREFIX)])
  stop_tokens = [int(t) if t.strip().lstrip("-").isdigit() else _bad_stop(t)
                 for t in _STOP_TOKENS.value]
  # The requests before the weights: a bad prompt or file fails fast.
  tok = engine_lib.run_tokenizer(config, _TOKENIZER.value)
  if tok is None and _STOP_STRINGS.value:
    raise ValueError("--stop_strings needs a tokenizer: this run has none (data.tokenizer); "
                     "pass --tokenizer=DIR.")
  prompts, knobs = read_requests(tok, _PROMPT.value, _PROMPTS_FILE.value)
  if _SLOTS.value is not None and _SLOTS.value < 1:
    raise ValueError(f"--slots={_SLOTS.value} must be >= 1.")
  if tok is None and any("stop_strings" in k for k in knobs):
    raise ValueError("--prompts_file: a request's stop_strings need a tokenizer: this run has "
                     "none (data.tokenizer); pass --tokenizer=DIR.")
  new_of = [k.get("max_new_tokens", _MAX_NEW.value) for k in knobs]
  cache_len = _CACHE_LEN.value or max(len(p) + n for p, n in zip(prompts, new_of))
  engine = Engine.from_checkpoint(_CHECKPOINT.value, step=_STEP.value, config=config,
                                  cache_len=cache_len, prefill_chunk=_CHUNK.value, tokenizer=tok,
                                  **scheme_opts)
  if tok is not None and tok.eos_id is not None and not _NO_EOS.value:
    stop_tokens.append(tok.eos_id)
  single = _PROMPT.value is not None
  kw = dict(stop_tokens=stop_tokens, stop_strings=tuple(_STOP_STRINGS.value),
            temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value)
  slots = _SLOTS.value or (len(prompts) if any(knobs) else None)
  if slots is None:
    run = lambda **k: engine.generate(prompts, _MAX_NEW.value, **kw, **k)
  else:
    from condattn_jax.inference import Request
    reqs = [Request(p, **{k: tuple(v) if k == "stop_strings" else v for k, v in own.items()})
            for p, own in zip(prompts, knobs)]
    run = lambda **k: engine.serve(reqs, _MAX_NEW.value, slots=slots, **kw, **k)
  if _WARMUP.value:
    run()
  on_text = None
  if single and tok is not None:
    on_text = lambda b, s: (sys.stdout.write(s), sys.stdout.flush())
  gen = run(on_text=on_text)
  for b in range(len(prompts)):
    rec = {"finish_reason": gen.finish_reason[b], "tokens": gen.tokens[b]}
    if gen.text is not None:
      rec["text"] = gen.text[b]
    if _STATS.value:
      rec["stats"] = _rounded(gen.stats[b])
    if single:
      if tok is None:
        print(" ".join(map(str, gen.tokens[b])))
      else:
        print()
      if _STATS.value:
        print(json.dumps(rec["stats"]))
    else:
      print(json.dumps({"row": b, **rec}))
  n_decode = sum(max(len(t) - 1, 0) for t in gen.tokens)
  rate = f"{n_decode / gen.decode_s:.1f} tokens/s" if gen.decode_s > 0 and n_decode else "n/a"
  note = "" if _WARMUP.value else " (first call: includes compilation; --warmup excludes it)"
  print(f"TTFT {gen.prefill_s * 1e3:.1f} ms | decode {n_decode} tokens in {gen.decode_s:.3f} s, "
        f"{rate} | cache {gen.cache_bytes} bytes ({gen.cache_bytes / 2**20:.2f} MiB, "
        f"{slots or len(prompts)} rows x {cache_len} slots){note}", file=sys.stderr)


def _bad_stop(t):
  raise ValueError(f"--stop_tokens: {t!r} is not a token id (ints separated by commas).")


if __name__ == "__main__":
  cli.run(main)
