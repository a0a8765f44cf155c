r"""MATCH decode memory vs context length (GPU): flat in the context for the SWA layers.

  python bench/match_memory.py                        # GPU: 8K / 32K / 128K -> bench/results/
  python bench/match_memory.py --preset=test --out_dir=/tmp/mm   # CPU, seconds (tests)
  # one process per row, so peak_bytes (a process-wide high-water mark) is the row's own:
  for m in match dense; do for n in 8192 32768 131072; do python bench/match_memory.py \
      --models=$m --contexts=$n --out_dir=/tmp/mm_${m}_${n}; done; done

For each context length N and each model (dense full attention vs MATCH all-SWA, window w,
chunks c, top_k k, recomputed retrieved K/V at decode), one row: build the
inference.Engine with cache_len = N + new tokens, prefill N prompt tokens in chunks, decode
`new` tokens, and record
  cache_bytes         what the engine's cache pytree allocates (inference.cache_bytes)
  kv_bytes            its K/V arrays only (window rings + retrieved-K/V caches; full caches)
  analytic            the scheme's kv_cache_bytes at N
  peak_bytes          device peak_bytes_in_use (GPU; None on CPU) after the row
  prefill_s, decode_s wall seconds of the row's first prefill / `new` decode steps, each
                      INCLUDING its step's compile (one pass per row: memory, not speed)
MATCH's kv_bytes must not grow with N (only its raw-token buffer does: 4 bytes per token).
The model is Qwen3-8B-shaped per layer (hidden 4096, 32 q / 8 kv heads of 128, MLP 12288) with
few layers and random weights (memory, not quality), bfloat16; retrieval = exact match on random
tokens over a small vocabulary so every block retrieves k chunks.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
from absl import flags  # noqa: E402
from bench import common  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from condattn_jax.attention import configure  # noqa: E402
from condattn_jax.inference import Engine, cache_bytes  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402

# result file of the recorded preset (others: <out_dir>/match_memory_<device>.json)
FILES = {"gpu": "match_memory.json"}


@dataclasses.dataclass(frozen=True)
class Settings:
  contexts: tuple = (8192, 32768, 131072)
  layers: int = 2
  hidden: int = 4096
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  mlp: int = 12288
  vocab: int = 1024
  window: int = 2048
  chunk: int = 128
  top_k: int = 4
  prefill_chunk: int = 4096
  new: int = 256
  dtype: str = "bfloat16"
  token_vocab: int = 64  # prompt tokens drawn from [1, 64): every block finds matches


PRESETS = {
    "gpu": Settings(),
    "test": Settings(contexts=(64, 128, 256), hidden=32, heads=4, kv_heads=2, head_dim=8, mlp=64,
                     vocab=64, window=16, chunk=4, top_k=2, prefill_chunk=32, new=6,
                     dtype="float32", token_vocab=16),
}


def configs(s: Settings):
  base = ModelConfig(family="qwen3", qk_norm="head", vocab_size=s.vocab, hidden_size=s.hidden,
                     intermediate_size=s.mlp, num_layers=s.layers, num_heads=s.heads,
                     num_kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=s.dtype,
                     param_dtype=s.dtype)
  return {"dense": base,
          "match": configure(base, "match", window=s.window, chunk=s.chunk, top_k=s.top_k,
                                      retrieved_kv="recompute")}


def kv_bytes(cache) -> int:
  n = 0
  for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
    name = jax.tree_util.keystr(path)
    if name.endswith("['key']") or name.endswith("['value']"):
      n += x.size * x.dtype.itemsize
  return int(n)


peak_bytes = common.peak_bytes


def row(s: Settings, name: str, cfg: ModelConfig, params, n: int) -> dict:
  eng = Engine(cfg, params, cache_len=n + s.new, prefill_chunk=s.prefill_chunk)
  prompt = np.random.default_rng(n).integers(1, s.token_vocab, n).tolist()
  t0 = time.perf_counter()
  cache, logits, lengths = eng.prefill([prompt])
  logits.block_until_ready()
  t1 = time.perf_counter()
  tok, pos = int(np.asarray(logits)[0].argmax()), n
  for _ in range(s.new):
    cache, logits = eng.decode_step(cache, [tok], [pos], [True], logits)
    tok, pos = int(np.asarray(logits)[0].argmax()), pos + 1
  logits.block_until_ready()
  t2 = time.perf_counter()
  scheme = "match" if name == "match" else "dense"
  from condattn_jax.attention import get_scheme
  analytic = get_scheme(scheme).kv_cache_bytes(cfg, n)
  return {"model": name, "context": n, "cache_bytes": cache_bytes(cache), "kv_bytes": kv_bytes(cache),
          "analytic": analytic, "peak_bytes": peak_bytes(), "prefill_s": round(t1 - t0, 3),
          "decode_s": round(t2 - t1, 3), "decode_tokens": s.new}


def run(s: Settings, models=("match", "dense"), log=print) -> dict:
  out = {"settings": dataclasses.asdict(s), "device": jax.devices()[0].device_kind,
         "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "rows": []}
  for name in models:
    cfg = configs(s)[name]
    params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0),
                                                  jnp.zeros((1, 8), jnp.int32))["params"])
    for n in s.contexts:
      try:
        r = row(s, name, cfg, params, n)
      except Exception as e:  # e.g. dense out of memory at 128K: recorded, not hidden
        r = {"model": name, "context": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
      out["rows"].append(r)
      log(json.dumps(r))
  return out


def check_flat(result: dict) -> list[str]:
  """MATCH's K/V bytes are the same at every context length; dense grows (when it ran)."""
  bad = []
  m = [r for r in result["rows"] if r["model"] == "match" and "kv_bytes" in r]
  if len({r["kv_bytes"] for r in m}) > 1:
    bad.append(f"match kv_bytes vary with context: {[r['kv_bytes'] for r in m]}")
  d = [r for r in result["rows"] if r["model"] == "dense" and "kv_bytes" in r]
  if len(d) > 1 and not d[-1]["kv_bytes"] > d[0]["kv_bytes"]:
    bad.append("dense kv_bytes do not grow with context")
  return bad


def merge(docs: list[dict]) -> dict:
  """One result from per-row runs (one process per row, see the module docstring): same
  settings and device required; rows sorted by (model, context); claims re-checked."""
  same = lambda d: json.dumps({k: v for k, v in d["settings"].items() if k != "contexts"},
                              sort_keys=True)
  keys = {(same(d), d["device"], d.get("preset")) for d in docs}
  if len(keys) != 1:
    raise ValueError(f"match_memory merge: the runs differ in settings / device / preset: {keys}")
  out = dict(docs[0], date=max(d["date"] for d in docs),
             rows=sorted((r for d in docs for r in d["rows"]),
                         key=lambda r: (r["model"], r["context"])))
  out["settings"] = dict(out["settings"], contexts=sorted({r["context"] for r in out["rows"]}))
  out["failed_claims"] = check_flat(out)
  return out


FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "gpu", sorted(PRESETS), "sizes", flag_values=FLAGS)
flags.DEFINE_string("models", "match,dense", "models to measure", flag_values=FLAGS)
flags.DEFINE_string("contexts", None, "comma-separated context lengths", flag_values=FLAGS)
flags.DEFINE_multi_string("merge", None, "merge these per-row result files into the preset's "
                          "result file in --out_dir (no run)",
                          flag_values=FLAGS)


def main(argv=None):
  a = common.parse_flags(FLAGS, argv)
  if a.merge:
    result = merge([common.read_result(f) for f in a.merge])
    preset = result.get("preset", "main")
    out = common.result_path("match_memory", a.out_dir, fixed=FILES.get(preset))
    common.write_result(out, "match_memory", result, name=preset,
                        claims={"no failed claims": not result["failed_claims"]})
    print("failed claims:", result["failed_claims"], f"\nwrote {out}")
    return
  s = PRESETS[a.preset]
  if a.contexts:
    s = dataclasses.replace(s, contexts=tuple(int(x) for x in a.contexts.split(",")))
  result = run(s, tuple(a.models.split(",")))
  result["preset"] = a.preset
  result["failed_claims"] = check_flat(result)
  out = common.result_path("match_memory", a.out_dir, fixed=FILES.get(a.preset))
  common.write_result(out, "match_memory", result, name=a.preset,
                      claims={"no failed claims": not result["failed_claims"]})
  print("failed claims:", result["failed_claims"])
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
