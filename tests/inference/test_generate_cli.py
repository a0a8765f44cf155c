"""generate.py as a user runs it (subprocesses) on one tiny trained run (conftest's
tiny_l2a_run): token ids in / out without a tokenizer, streamed text with one, a JSON line per
request of a prompts file (served through --slots rows with per-request knobs), the TTFT / tokens/s / cache-bytes line; the outputs equal the
engine's generation in process. Every bad input is ONE line starting with ERROR:, exit code 2,
no traceback. The first generation starts generate.py as a new interpreter (a user's shell's
start); the others and the bad-input cases run it as `python generate.py ...` in a fork of one
process that imported its modules once (tests/_cli_runner.py), each with its own backend and
exit code."""
import json
import os
import subprocess

import pytest

from _cli_runner import Runner
from condattn_jax.inference import Engine
from tests._train_helpers import PY, ROOT, subprocess_env
from tests.cli.test_cli_errors import assert_user_error

TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "qwen")


def gen(*args):
  """`python generate.py *args`: a new interpreter, as a user's shell starts it."""
  return subprocess.run([PY, "generate.py", *args], cwd=ROOT, env=subprocess_env(1),
                        capture_output=True, text=True, timeout=300)


RUNNER = Runner(subprocess_env(1))


def gen_fork(*args):
  """The same command in a fork of RUNNER's process (its modules imported once: the commands
  after the first pay no interpreter start and jax import each)."""
  return RUNNER.run("generate.py", *args)


@pytest.fixture(scope="module", autouse=True)
def cli_runner_per_module():
  """RUNNER's process ends with the module (its CPU time counts in the module)."""
  yield
  RUNNER.close()


@pytest.fixture(scope="module")
def run(tiny_l2a_run):
  return tiny_l2a_run


def _summary(p):
  line = [l for l in p.stderr.splitlines() if l.startswith("TTFT")]
  assert len(line) == 1, p.stderr[-2000:]
  return line[0]


@pytest.fixture(scope="module")
def engine(run):
  """The run's engine in process, at the cache the CLI sizes for a 4-token prompt + 5 tokens
  (prompt + max_new_tokens): every reference below shares its one compiled step."""
  return Engine.from_checkpoint(run, cache_len=9, tokenizer=TOKENIZER)


def test_token_ids_in_and_out_equal_the_engine(run, engine, tmp_path):
  want = [engine.generate([p], 5) for p in ([3, 9, 17, 4], [5, 6, 7, 8])]
  p = gen(f"--checkpoint={run}", "--prompt=3 9 17 4", "--max_new_tokens=5", "--stats")
  assert p.returncode == 0, p.stderr[-2000:]
  out = p.stdout.splitlines()
  assert out[0].split() == [str(t) for t in want[0].tokens[0]]
  stats = json.loads(out[1])  # L2A: fraction of tokens routed global per layer, prompt part
  assert stats["prompt"]["tokens"] == [4.0, 4.0]
  assert stats["prompt"]["global_tokens_B"] == [
      round(x, 4) for x in want[0].stats[0]["prompt"]["global_tokens_B"]]
  line = _summary(p)
  assert "TTFT" in line and "tokens/s" in line and f"cache {want[0].cache_bytes} bytes" in line
  f = tmp_path / "requests.jsonl"
  # continuous batching through one row, the second request with its own budget
  f.write_text('{"tokens": [3, 9, 17, 4]}\n\n{"prompt": "5, 6 7 8", "max_new_tokens": 3}\n')
  p = gen_fork(f"--checkpoint={run}", f"--prompts_file={f}", "--max_new_tokens=5",
               "--slots=1", "--config.model.scheme.theta=0.5")  # the run's own theta: the same
  assert p.returncode == 0, p.stderr[-2000:]
  rows = [json.loads(l) for l in p.stdout.splitlines()]
  assert [r["tokens"] for r in rows] == [want[0].tokens[0], want[1].tokens[0][:3]]
  assert [r["row"] for r in rows] == [0, 1]
  assert all(r["finish_reason"] == "length" for r in rows)
  assert "1 rows x 9 slots)" in _summary(p)


def test_text_with_a_tokenizer_streams_what_the_engine_generates(run, engine):
  tok = engine.tokenizer
  text = "abcd"
  assert len(tok.encode(text)) == 4  # the engine fixture's compiled shapes
  want = engine.generate([tok.encode(text)], 5, stop_tokens=(tok.eos_id,))
  p = gen_fork(f"--checkpoint={run}", f"--tokenizer={TOKENIZER}", f"--prompt={text}",
               "--max_new_tokens=5")
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout == want.text[0] + "\n"
  assert f"cache {want.cache_bytes} bytes" in _summary(p)


@pytest.mark.parametrize("args, needles", [
    (["--checkpoint=/nonexistent/run", "--prompt=1"], ["/nonexistent/run does not exist"]),
    (["--checkpoint={tmp}", "--prompt=1"], ["is neither a workdir"]),
    (["--checkpoint={run}", "--prompt=1 2 400"], ["token id 400", "[0, 400)"]),
    (["--checkpoint={run}", "--prompt=1", "--max_new_tokens=0"], ["--max_new_tokens=0"]),
    (["--checkpoint={run}", "--prompt=hello"], ["no tokenizer", "token ids"]),
    (["--checkpoint={run}", "--prompt=1", "--stop_strings=x"], ["--stop_strings needs a tokenizer"]),
    (["--checkpoint={run}", "--prompt=1", "--config.model.scheme.thetaa=0.7"], ["thetaa"]),
    (["--checkpoint={run}", "--prompt=1", "--config.model.bogus=1"], ["config.model.bogus"]),
    (["--checkpoint={run}", "--prompts_file={tmp}/bad.jsonl"], ["line 2 is not valid JSON"]),
    (["--checkpoint={run}", "--prompts_file={tmp}/knob.jsonl"],
     ['line 1: "top_p" is \'high\'', "a number"]),
    (["--checkpoint={run}", "--prompts_file={tmp}/none.jsonl"], ["none.jsonl does not exist"]),
    (["--checkpoint={run}"], ["exactly one of --prompt or --prompts_file"]),
])
def test_bad_input_is_one_line(run, tmp_path, args, needles):
  (tmp_path / "bad.jsonl").write_text('{"tokens": [1]}\n{"tokens": [1\n')
  (tmp_path / "knob.jsonl").write_text('{"tokens": [1], "top_p": "high"}\n')
  p = gen_fork(*[a.format(run=run, tmp=tmp_path) for a in args])
  assert_user_error(p, *needles)
