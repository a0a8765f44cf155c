r"""Decode at the hardware limit (issue 33's bench): ms per decode step of the inference engine
against the bytes a step must read, per scheme, with a plain-XLA decode step as the baseline.

    python -m bench.decode                       # the GPU plan (one H100: ~9 minutes)
    python -m bench.decode --only=dense --B=1 --T=32768
    python -m bench.decode --preset=test         # CPU, tiny shapes, seconds (tests/bench)
    # continuous batching on one H100 (~4 min): 64 requests, prompts 256..4096, budgets 16..256
    CONDATTN_GIT_COMMIT=<rev> python -m bench.decode --name=serve --only=serve \
        --serve_requests=64 --serve_slots=8 --serve_prompt=256,4096 --serve_new=16,256
    # ... with one prompt per prefill (Engine.serve(admit=1)) instead of the free rows' prompts
    # admitted together: add --serve_admit=1 --name=serve_admit1
    # the serve rows alone at the serve_greedy request set (16 requests, prompts 256..1024,
    # budgets 16..128, 8 slots, 512-token chunks), each mode timed 3 times after an untimed pass
    # (one H200: ~2 min)
    CONDATTN_GIT_COMMIT=<rev> timeout 280 python -m bench.decode --name=serve_planned \
        --only=serve --prefill_T=0 --baseline=false --serve_requests=16 --serve_slots=8 \
        --serve_prompt=256,1024 --serve_new=16,128 --serve_chunk=512 --serve_repeats=3
    # the same at a smaller set, one H100 call of its own (~5 min: five programs' first
    # compiles, ~25-40 s each, then an untimed and a timed pass a mode); each mode's row is
    # saved as soon as it is done
    timeout 420 python -m bench.decode --name=serve --only=serve --prefill_T=0 \
        --serve_requests=32 --serve_slots=8 --serve_prompt=256,2048 --serve_new=16,256
    # AHA at 10% of its (layer, head) pairs full (--aha_full) with its dense row, then what time
    # leaves (segmented vs dense at 64K, MATCH 8K / 128K), saved row by row; AHA's decode
    # program took over 170 s to compile or run in a 272 s call: a call of its own (>= 8 min)
    timeout 500 python -m bench.decode --name=aha10 --aha_full=0.1 --baseline=false \
        --prefill_T=0 --rows=dense/1/32768/olmo2-1b,aha/1/32768,dense/1/65536/llama2-7b,\
segmented/1/65536,match/1/8192,match/1/131072
    # MATCH flat from 8K to 128K in ONE process, the two contexts' whole-block batches
    # interleaved (flat_rows; ~6 min on one H200: one init, two fills, four compiles)
    CONDATTN_GIT_COMMIT=<rev> timeout 560 python -m bench.decode --name=match_flat_il \
        --only=none --prefill_T=0 --flat=8192,131072 --flat_repeats=6
    # the bytes side only (no run, any device): every gpu_all row at the NOMINAL rates
    python -m bench.decode --preset=gpu_all --bytes_only
    # does LLaMA-2-7B dense prefill (4K chunks) + decode at 64K fit one 80 GB card (~3 min)
    CONDATTN_GIT_COMMIT=<rev> python -m bench.decode --name=fits --only=fits --fits
    # every scheme x B {1, 8, 32} x 8K / 32K / 128K that fits (GPU_ALL_PLAN, 56 rows), in 14
    # ten-minute commands k = 0..13 (each keeps its points' dense and scheme rows together)
    CONDATTN_GIT_COMMIT=<rev> python -m bench.decode --preset=gpu_all --part=$k/14 \
        --name=all_$k --baseline=false --prefill_T=0 --deadline_s=480

Per row (scheme, shapes, B, T): a model of the named shapes with the scheme at its recipe's
default knobs (configs/<recipe>.py; window-like knobs scaled by T / the recipe's seq_len, see
`scheme_config`), random init, bf16 weights and cache; an `Engine(cache_len=T + EXTRA,
prefill_chunk=4096)` fills the cache with a chunked prefill of B random prompts of T tokens; then
the engine's greedy decode program (`Engine._greedy_step`, what `Engine.generate` runs: one
token per row, the argmax of the last logits inside the step, every changing input donated
state, so XLA:GPU replays its command buffer without an update) is compiled ahead of time
(compile_s; its memory analysis: argument / output / temp bytes, peak_est = arguments + outputs
- aliased + temps) and run `--steps` steps back to back, one block at the end: ms = wall / steps
(median of `--repeats` such batches, after `--warmup` steps); host_ms: the median time a call
takes to return. `--step_ab`: as many steps again through the loop before it (`step_loop`:
`Engine._step`, what `Engine.decode_step` runs, its token an argmax in a dispatch of its own;
ms_step_loop, host_ms_step_loop) in the same process. tokens_per_s = B * 1000 / ms. MATCH rows (`timed_schedule`)
time whole retrieval blocks from a block start, so the once-per-block retrieval and recompute
count at their rate; they run the recipe's all-SWA variant at the recipe's window (2048) at
every T (HELD).

Bytes a step must read (`step_bytes`; bf16 = 2 bytes, kv = 2 (K and V) * head_dim * 2 bytes per
token and KV head):
  weights    every parameter once (the tied embedding once, as the LM head); an untied input
             embedding table counts B rows only;
  dense      L * B * T * K * kv                    (every row's whole K/V, every layer)
  l2a        L * B * K * kv * min(W, T) + T * K * kv * sum_{l,b} g_lb
             (the window ring always; the global cache only at the rate g_lb the decode steps
             routed global, per layer and row, from the engine's aux `global_tokens_B`)
  aha        kv * (L * B * N * min(W, T) + T * sum_{l,b,n} f_lbn)
             (one KV head per query head; f_lbn = the (token, head) full-attention rate of the
             decode steps, aux `full_BN`)
  elastic    kv * sum_{l,b,k} (a_lbk * T + (1 - a_lbk) * min(sinks + local, T))
             (a_lbk = the decode steps' FA rate per KV head, aux `fa_BK`; SSA = sinks + window)
  match      Ls * K * kv * (B * min(W, T) + chunk * sum_b r_b) + Lf * B * T * K * kv
             (the Ls SWA layers' window + retrieved chunks: r_b = the chunks row b's decode
             steps read, engine stats `retrieved_B`, <= top_k; the Lf = L - Ls full layers of
             a post-sparsified model (swa_ratio < 1) read every row's whole K/V)
  segmented  the scheme's whole decode state (`cache_bytes`: every layer's segment state is read)
limit_ms = bytes / the card's bandwidth (3.35 TB/s H100, 4.8 TB/s H200; --bandwidth_tbps
elsewhere); x_limit = ms / limit_ms. For a scheme row with a dense row of the same shapes, B and
T: bound_speedup = dense bytes / scheme bytes, speedup = dense ms / scheme ms, achieved =
speedup / bound_speedup.

Baselines (dense rows, `--baseline`): the plain-XLA decode step written below
(`baseline_step_stacked`: a lax.scan over layers carrying a DONATED stacked cache [L, B, S, K, H]
updated by dynamic_update_slice, einsum attention with a per-row length mask;
`baseline_step_layers`: the same step as a python loop over layers with one donated cache array
per layer), on the engine's own params; ms timed as the engine's; their compiled memory analysis
says whether a cache-sized temporary exists (temp_bytes / cache_bytes).
Prefill (dense, B = 1, `--prefill_T`): the engine's time to first token, one-shot
(prefill_chunk=None) and chunked (4096-token chunks), median of --prefill_reps after a warm-up.

Continuous batching (`--serve_requests=N`, `serve_rows`): N requests of mixed prompt lengths
and budgets (max_new_tokens) through `Engine.serve(slots=S)` against `Engine.generate` over
consecutive groups of S (each group runs until its largest budget), same requests, greedy;
tokens_per_s = the sum of the budgets / wall (a timed run after an untimed one).

Fits (`--fits`, `fits_rows`): the dense prefill-chunk and decode programs of --fits_shapes at
--fits_T compiled from abstract arguments; their memory analysis against the card (on CPU the
reference attention's [N, chunk, T] scores make the prefill figure meaningless: a GPU run
answers). --preset=gpu_all: GPU_ALL_PLAN (`gpu_all_plan`: every scheme on its shapes with dense
at the same points, where weights + cache <= 90% of 78 GiB), split by --part=k/n.

Targets (pre-registered: issue 33's, recorded on the run as `targets` [{name, met, detail}], met
or not, never asserted: today they are the baseline): dense B=1 <= 2x the limit at 8K and <= 1.5x
at 32K and 128K, B=8 at 32K <= 1.5x; the engine faster than both baselines at every dense point;
every scheme row >= 0.9x of its bytes-bound speedup; chunked prefill <= 1.15x one-shot; serve
faster (tokens/s) than one batch at a time; MATCH decode ms and peak at 128K within 1.2x of 8K
(same run, same B); segmented decode no slower than dense at 64K; the fits check's programs
within the card. The
run's claims (bench/claims/decode.py) are that these verdicts and the derived numbers follow
from the stored rows.
Appends one run to <out_dir>/decode_<device>.json, saved after every row (a timeout keeps the
rows done); rows that did not run are recorded with their reason; prints a table last.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from absl import flags  # noqa: E402

from bench import common  # noqa: E402

BENCH = "decode"
# ModelConfig fields of the named shapes (the models' config.json).
SHAPES = {
    "qwen2.5-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                         head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, attention_bias=True),
    "olmo2-1b": dict(family="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                     num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128,
                     rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     qk_norm="full", post_norm=True),
    "llama2-7b": dict(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # CPU preset: same families and layouts, tiny
    "tiny-qwen": dict(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True),
    "tiny-olmo": dict(family="olmo2", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=5e5,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm="full",
                      post_norm=True),
    "tiny-llama": dict(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=1e4,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
}
# scheme -> (recipe file, recipe variant, the shapes the issue names, window-like knobs scaled
# by T / the recipe's seq_len, fixed overrides)
SCHEMES = {
    "dense": (None, None, "qwen2.5-1.5b", (), {}),
    # routing: the recipe's bernoulli_q (0.2) as the global rate a trained router reaches (a
    # random-init learned router routes ~half its tokens global)
    "l2a": ("l2a_qwen.py", None, "qwen2.5-1.5b", ("window",), dict(routing="bernoulli")),
    "aha": ("aha_olmo.py", None, "olmo2-1b", ("window",), {}),
    "elastic": ("elastic_qwen.py", None, "qwen2.5-1.5b", ("local",), {}),
    # retrieval by exact match of key tokens (the MiniLM bi-encoder needs its weights and the
    # tokenizer; the decode step's reads are the same: window + top_k retrieved chunks)
    # the pre-sparsified (all-SWA) variant: "memory stays constant in context length" is the
    # paper's claim for SWA layers (a full layer's cache grows with T: --override=swa_ratio=0.5
    # gives the post-sparsified model, its full layers counted by step_bytes)
    "match": ("match_qwen.py", "qwen3-8b-allswa", "qwen2.5-1.5b", ("window",),
              dict(retriever="exact", retriever_kwargs=())),
    "segmented": ("segmented_llama.py", None, "llama2-7b", (), {}),
}
# Knobs of SCHEMES' scaled list held at the recipe's value on the issue's shapes (scaled on the
# tiny shapes only, whose T is below the recipe's window): MATCH's flat target compares ONE model
# from 8K to 128K, so its window cannot grow with T.
HELD = {"match": ("window",)}
TINY_SHAPES = {"qwen2.5-1.5b": "tiny-qwen", "olmo2-1b": "tiny-olmo", "llama2-7b": "tiny-llama"}
BANDWIDTH_TBPS = {"H100": 3.35, "H200": 4.8}
EXTRA = 128  # cache slots beyond the prompt (decode steps)
PREFILL_CHUNK = 4096
# The GPU plan, most important first: (scheme, shapes (None: the scheme's), B, T).
GPU_PLAN = [
    ("dense", None, 1, 32768), ("dense", None, 1, 8192), ("dense", None, 1, 131072),
    ("dense", None, 8, 32768), ("l2a", None, 1, 131072), ("l2a", None, 1, 32768),
    ("dense", None, 8, 8192), ("dense", None, 32, 8192),
    ("aha", None, 1, 32768), ("dense", "olmo2-1b", 1, 32768),
    ("elastic", None, 1, 32768), ("segmented", None, 1, 32768), ("dense", "llama2-7b", 1, 32768),
    ("match", None, 1, 32768), ("l2a", None, 8, 32768), ("dense", None, 32, 32768),
]
# --preset=gpu_all: every scheme on its shapes (and dense on the same shapes, for the ratios),
# B in ALL_B, T in ALL_T, the rows whose weights + cache fit FIT_FRACTION of CARD_BYTES; split
# over ten-minute device commands with --part=k/n (rows k, k + n, ...).
ALL_B, ALL_T = (1, 8, 32), (8192, 32768, 131072)
CARD_BYTES = 78 * 2**30   # what one H100 80GB gives a process (the device tool: ~78 GiB)
FIT_FRACTION = 0.9


# gpu_all_plan()'s result (tracing every model at every point takes minutes; the slow test
# tests/bench/test_decode_bench.py recomputes it)
GPU_ALL_PLAN = [
    (s, sh, B, T) for s, sh, pts in (
        ("dense", "qwen2.5-1.5b", "1/8K 1/32K 1/128K 8/8K 8/32K 8/128K 32/8K 32/32K"),
        ("l2a", "qwen2.5-1.5b", "1/8K 1/32K 1/128K 8/8K 8/32K 8/128K 32/8K 32/32K"),
        ("dense", "olmo2-1b", "1/8K"), ("aha", "olmo2-1b", "1/8K"),
        ("dense", "olmo2-1b", "1/32K"), ("aha", "olmo2-1b", "1/32K"),
        ("dense", "olmo2-1b", "1/128K"), ("aha", "olmo2-1b", "1/128K"),
        ("dense", "olmo2-1b", "8/8K"), ("aha", "olmo2-1b", "8/8K"),
        ("dense", "olmo2-1b", "8/32K"), ("aha", "olmo2-1b", "8/32K"),
        ("dense", "olmo2-1b", "32/8K"), ("aha", "olmo2-1b", "32/8K"),
        ("elastic", "qwen2.5-1.5b", "1/8K 1/32K 1/128K 8/8K 8/32K 8/128K 32/8K 32/32K"),
        ("match", "qwen2.5-1.5b", "1/8K 1/32K 1/128K 8/8K 8/32K 8/128K 32/8K 32/32K 32/128K"),
        ("dense", "llama2-7b", "1/8K"), ("segmented", "llama2-7b", "1/8K"),
        ("dense", "llama2-7b", "1/32K"), ("segmented", "llama2-7b", "1/32K 1/128K"),
        ("dense", "llama2-7b", "8/8K"), ("segmented", "llama2-7b", "8/8K 8/32K 8/128K"))
    for B, T in ((int(p.split("/")[0]), int(p.split("/")[1][:-1]) * 1024) for p in pts.split())]
# the issue's segmented target is at 64K: that point too
EXTRA_POINTS = [("dense", "llama2-7b", 1, 65536), ("segmented", "llama2-7b", 1, 65536)]
GPU_ALL_PLAN += EXTRA_POINTS


def by_point(rows):
  """Rows ordered by point (shapes, B, T), dense first at each: a --part keeps a point whole,
  so its scheme rows find their dense row in the same run (the ratios need it)."""
  order = list(SCHEMES)
  return sorted(rows, key=lambda r: (r[1], r[2], r[3], order.index(r[0])))


def part_of(rows, part: str):
  """Part k of n (--part=k/n): the k-th of n contiguous slices of the points (each point's rows
  together), as even in rows as the points allow."""
  k, n = (int(x) for x in part.split("/"))
  if not 0 <= k < n:
    raise ValueError(f"bench.decode --part={part}: k/n with 0 <= k < n.")
  points = []
  for r in rows:
    if not points or points[-1][0][1:] != r[1:]:
      points.append([])
    points[-1].append(r)
  total, out, done = len(rows), [], 0
  for pt in points:  # the point goes to the part its first row falls in
    if done * n // total == k:
      out += pt
    done += len(pt)
  return out


def gpu_all_plan() -> list[tuple[str, str, int, int]]:
  """Every scheme on its shapes (dense first at each point), B in ALL_B, T in ALL_T, where
  `resident_bytes` <= FIT_FRACTION * CARD_BYTES."""
  out = []
  for scheme in SCHEMES:
    shapes = SCHEMES[scheme][2]
    for B in ALL_B:
      for T in ALL_T:
        for s in (("dense", scheme) if scheme != "dense" else ("dense",)):
          row = (s, shapes, B, T)
          if row not in out and resident_bytes(s, shapes, B, T) <= FIT_FRACTION * CARD_BYTES:
            out.append(row)
  return out + EXTRA_POINTS


TEST_PLAN = [("dense", None, 1, 64), ("dense", None, 2, 64), ("l2a", None, 2, 64), ("match", None, 1, 64),
             ("aha", None, 1, 64), ("dense", "olmo2-1b", 1, 64), ("elastic", None, 1, 64),
             ("segmented", None, 1, 64), ("dense", "llama2-7b", 1, 64)]


def define_flags():
  fv = common.flag_values()
  flags.DEFINE_enum("preset", "gpu", ["gpu", "gpu_all", "test"], "gpu: the issue's shapes "
                    "and GPU_PLAN; gpu_all: every scheme x B x T that fits (gpu_all_plan, split "
                    "with --part); test: tiny shapes on any device (seconds)", flag_values=fv)
  flags.DEFINE_string("part", None, "k/n: run rows k, k + n, ... of the plan (0 <= k < n)",
                      flag_values=fv)
  flags.DEFINE_bool("bytes_only", False, "no run: each plan row's step bytes at the NOMINAL "
                    "routing rates and its bytes-bound speedup over dense (nominal_bytes), "
                    "recorded as kind 'bytes' rows", flag_values=fv)
  flags.DEFINE_bool("fits", False, "compile (abstract arguments, nothing allocated) the dense "
                    "prefill-chunk and decode programs at --fits_T on --fits_shapes and record "
                    "their memory analysis against the card (fits_rows)", flag_values=fv)
  flags.DEFINE_string("fits_shapes", "llama2-7b", "shapes of the fits check", flag_values=fv)
  flags.DEFINE_integer("fits_T", 65536, "context of the fits check", flag_values=fv)
  flags.DEFINE_integer("fits_chunk", 4096, "prefill chunk of the fits check", flag_values=fv)
  flags.DEFINE_float("card_gib", None, "memory of the card for the fits check (default: the "
                     "device's bytes_limit, else 78 GiB: one H100 80GB)", flag_values=fv)
  flags.DEFINE_list("only", [], "schemes to run (default: every scheme of the plan)",
                    flag_values=fv)
  flags.DEFINE_list("rows", [], "explicit rows scheme/B/T[/shapes] instead of the preset's plan",
                    flag_values=fv)
  flags.DEFINE_list("override", [], "key=value scheme options set on every scheme row (after "
                    "the recipe's; e.g. router_bias_init=-1.0 for AHA's full rate)",
                    flag_values=fv)
  flags.DEFINE_string("name", "main", "the run's tag (settings.name)", flag_values=fv)
  flags.DEFINE_list("B", [], "batch sizes to keep (default: the plan's)", flag_values=fv)
  flags.DEFINE_list("T", [], "contexts to keep (default: the plan's)", flag_values=fv)
  flags.DEFINE_integer("steps", 32, "decode steps per timed batch (ms = wall / steps)",
                       flag_values=fv)
  flags.DEFINE_integer("repeats", 2, "timed batches (the median is reported)", flag_values=fv)
  flags.DEFINE_integer("warmup", 3, "untimed decode steps first", flag_values=fv)
  flags.DEFINE_bool("baseline", True, "time the plain-XLA baselines at the dense rows",
                    flag_values=fv)
  flags.DEFINE_integer("prefill_T", None, "prefill one-shot vs chunked at this T (dense, B=1); "
                       "default 32768 (gpu), 64 (test); 0: skip", flag_values=fv)
  flags.DEFINE_integer("prefill_reps", 2, "timed prefills (median)", flag_values=fv)
  flags.DEFINE_float("bandwidth_tbps", None, "memory bandwidth of the card (default: 3.35 H100, "
                     "4.8 H200, 0.02 elsewhere: a nominal CPU figure)", flag_values=fv)
  flags.DEFINE_integer("serve_requests", 0, "continuous batching: this many requests of mixed "
                       "lengths through Engine.serve vs one batch at a time through generate "
                       "(0: skip)", flag_values=fv)
  flags.DEFINE_integer("serve_slots", 8, "rows of the serve cache (= the generate batch size)",
                       flag_values=fv)
  flags.DEFINE_list("serve_prompt", ["256", "4096"], "prompt lengths drawn uniformly in [lo, hi]",
                    flag_values=fv)
  flags.DEFINE_list("serve_new", ["16", "256"], "max_new_tokens per request drawn uniformly in "
                    "[lo, hi]", flag_values=fv)
  flags.DEFINE_string("serve_scheme", "dense", "the scheme of the serve rows (its shapes)",
                      flag_values=fv)
  flags.DEFINE_integer("serve_admit", 0, "Engine.serve(admit=): most requests admitted into one "
                       "prefill (0: slots; 1: one prompt per prefill)", flag_values=fv)
  flags.DEFINE_integer("serve_repeats", 1, "timed passes of each serve mode (after one untimed "
                       "pass): wall_s is their median, walls_s each", flag_values=fv)
  flags.DEFINE_integer("serve_chunk", 512, "prefill chunk of the serve rows (both modes)",
                       flag_values=fv)
  flags.DEFINE_float("deadline_s", 0, "start no new row after this many seconds (0: none)",
                     flag_values=fv)
  flags.DEFINE_list("flat", [], "lo,hi: MATCH's flat check in one process, its two engines' "
                    "whole-block batches interleaved (flat_rows; e.g. 8192,131072)",
                    flag_values=fv)
  flags.DEFINE_integer("flat_repeats", 6, "--flat: rounds (each engine one batch a round)",
                       flag_values=fv)
  flags.DEFINE_float("aha_full", 0.0, "AHA rows: route this fraction of the (layer, head) pairs "
                     "full for every token (`aha_static_routing`; 0: the router as initialised, "
                     "every pair full at the recipe's bias)", flag_values=fv)
  flags.DEFINE_integer("trace_steps", 0, "engine rows: after the timed batches, this many more "
                       "bench steps under jax.profiler (`trace_row`: busy_ms, kernels, span_ms "
                       "per step, the top kernels); 0: none", flag_values=fv)
  flags.DEFINE_bool("step_ab", False, "engine rows: after the timed batches, as many again "
                    "through the loop before Engine._greedy_step (`step_loop`: Engine._step, "
                    "its token an argmax in a dispatch of its own; ms_step_loop, "
                    "host_ms_step_loop)", flag_values=fv)
  return fv


FLAGS = define_flags()


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------

def _recipe(file: str):
  spec = importlib.util.spec_from_file_location(file[:-3], os.path.join(common.ROOT, "configs",
                                                                        file))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _value(v: str):
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return {"True": True, "False": False}.get(v, v)


def overrides(F) -> dict:
  """--override's key=value pairs, values parsed (_value)."""
  return {k: _value(v) for k, v in (x.split("=", 1) for x in F.override)}


def scheme_config(scheme: str, shapes: str, T: int, override: dict | None = None):
  """(ModelConfig, knobs dict): the named shapes, bf16, with `scheme` at its recipe's default
  knobs; window-like knobs scaled by T / the recipe's data.seq_len (a power of two, >= 16;
  HELD's knobs only on the tiny shapes), the scheme's fixed overrides (SCHEMES) applied."""
  from condattn_jax.models.config import ModelConfig
  recipe, variant, _, scaled, fixed = SCHEMES[scheme]
  base = ModelConfig(**SHAPES[shapes], dtype="bfloat16", param_dtype="bfloat16")
  if recipe is None:
    return base, {}
  from condattn_jax.train import config as config_lib
  c = _recipe(recipe).get_config(variant)
  with c.unlocked():
    c.model.init_from = None
  mc, _ = config_lib.model_config(c)
  kw = dict(mc.scheme_kwargs)
  seq = int(c.data.seq_len)
  for k in scaled:
    if k in HELD.get(scheme, ()) and shapes not in TINY_SHAPES.values():
      continue
    v = int(kw[k] * T / seq)
    kw[k] = max(16, 1 << max(0, v.bit_length() - 1))  # the power of two <= the scaled value
  kw.update(fixed)
  for k, v in (override or {}).items():
    if k not in kw:
      raise ValueError(f"bench.decode --override: {scheme} has no option {k!r}; its options: "
                       f"{sorted(kw)}")
    kw[k] = v
  fixed = {**fixed, **(override or {})}
  for k, n in (("long_heads", base.num_kv_heads), ("long_layers", base.num_layers)):
    if k in kw and any(i >= n for i in kw[k]):  # the tiny shapes: indices that exist
      kw[k] = tuple(i for i in kw[k] if i < n) or (0,)
  if "chunk" in kw and "window" in kw and kw["chunk"] > kw["window"]:  # MATCH at tiny T
    kw["chunk"] = kw["window"]
  knobs = {k: kw[k] for k in list(scaled) + list(fixed)}
  knobs["recipe_seq_len"] = seq
  return dataclasses.replace(base, scheme=mc.scheme, scheme_kwargs=tuple(sorted(kw.items()))), knobs


def _reference_attention(cfg):
  """`cfg` with every ops.attention call on the XLA reference: the model's attention_impl and a
  scheme's compact_impl (L2A / AHA's active-set calls) where it has one."""
  from condattn_jax.attention import options
  kw = dict(cfg.scheme_kwargs)
  if cfg.scheme != "dense" and hasattr(options(cfg), "compact_impl"):
    kw["compact_impl"] = "reference"
  return dataclasses.replace(cfg, attention_impl="reference",
                             scheme_kwargs=tuple(sorted(kw.items())))


def _init_fn(cfg):
  """key -> params of `cfg` (unboxed, cast to its dtype). The init trace (8 tokens) runs the
  XLA reference attention, named: on a GPU, auto would look for a kernel for L2A's compacted
  global call at kv length 8, find none (Mosaic GPU needs a multiple of 64) and log a fallback
  warning that is no part of any timed step; the params do not depend on the attention path."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from condattn_jax.models.decoder import Decoder
  dt = jnp.dtype(cfg.dtype)
  model = Decoder(_reference_attention(cfg))

  def init(key):
    p = nn.meta.unbox(model.init(key, jnp.zeros((1, 8), jnp.int32))["params"])
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
  return init


@functools.lru_cache(maxsize=32)
def _jitted_init(cfg):
  import jax
  return jax.jit(_init_fn(cfg))


def init_params(cfg, seed: int = 0):
  """Random-init params of `cfg`, cast to its dtype inside one jit (unboxed; one jitted init per
  config, so a second call traces nothing)."""
  import jax
  return _jitted_init(cfg)(jax.random.key(seed))


def spread_pairs(L: int, N: int, rate: float):
  """[L, N] bool: round(rate * L * N) pairs, layer l holding floor or ceil of rate * N of them
  (heads l, l + 1, ... mod N)."""
  import numpy as np
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"bench.decode --aha_full={rate}: a fraction in [0, 1].")
  n = int(round(rate * L * N))
  full_LN = np.zeros((L, N), bool)
  for l in range(L):
    k = n * (l + 1) // L - n * l // L
    full_LN[l, (l + np.arange(k)) % N] = True
  return full_LN


def aha_static_routing(params, cfg, rate: float):
  """(params, full_LN): an AHA model's routers set so that round(rate * L * N) of its (layer,
  head) pairs route every token full and the rest local: kernel 0, bias +2 (sigmoid 0.88 > tau)
  on the chosen pairs, -2 elsewhere (full / local at any tau in (0.12, 0.88)). The pairs are spread
  evenly: layer l gets floor or ceil of rate * N of them, at heads shifted by l (no layer is left
  without a full head while rate * N >= 1, so a layer's full call is never skipped). A random-init
  router scores every pair alike (bias only), so without this AHA decodes at rate 0 or 1; a trained
  router's choice depends on the token, its bytes are the same at the same rate."""
  import jax.numpy as jnp
  import numpy as np
  L, N = cfg.num_layers, cfg.num_heads
  full_LN = spread_pairs(L, N, rate)
  r = params["layers"]["router"]
  if r["bias"].shape != (L, N):
    raise ValueError(f"aha_static_routing: router bias {r['bias'].shape}, expected {(L, N)}")
  router = dict(r, kernel=jnp.zeros_like(r["kernel"]),
                bias=jnp.asarray(np.where(full_LN, 2.0, -2.0), r["bias"].dtype))
  layers = dict(params["layers"], router=router)
  return dict(params, layers=layers), full_LN


@functools.lru_cache(maxsize=32)
def _abstract_params(cfg):
  import jax
  return jax.eval_shape(_init_fn(cfg), jax.random.key(0))


def abstract_params(cfg):
  """The params of `cfg` as ShapeDtypeStructs (nothing allocated; traced once per config, a
  fresh tree each call)."""
  import jax
  return jax.tree.map(lambda x: x, _abstract_params(cfg))


def resident_bytes(scheme: str, shapes: str, B: int, T: int) -> int:
  """Weights + the engine's cache (cache_len T + EXTRA, the scheme's own cache structure) of a
  row, from abstract shapes: what a row holds before any temporary (the gpu_all plan keeps the
  rows where it is <= FIT_FRACTION of the card). Every cache leaf is batch-first
  (tests/schemes/test_serving.py), so the cache is B x one row's."""
  weights, row = _resident(scheme, shapes, T)
  return weights + B * row


@functools.lru_cache(maxsize=None)
def _resident(scheme: str, shapes: str, T: int) -> tuple[int, int]:
  from condattn_jax.inference import Engine
  cfg, _ = scheme_config(scheme, shapes, T)
  params = abstract_params(cfg)
  eng = Engine(cfg, params, cache_len=T + EXTRA)
  return nbytes(params), nbytes(eng.cache_shapes(1))


def nbytes(tree) -> int:
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------------------------
# Bytes a step must read
# ------------------------------------------------------------------------------------------------

def weight_bytes(cfg, params, B: int) -> int:
  """Every parameter once; an untied input embedding table only the B rows looked up."""
  total = nbytes(params)
  if not cfg.tie_word_embeddings:
    emb = params["embed_tokens"]["embedding"]
    total -= (emb.shape[0] - B) * emb.shape[1] * emb.dtype.itemsize
  return total


def rates(sums: dict, module_sums: dict, steps: int) -> dict:
  """The decode steps' routing rates per (layer, row[, head]) from their per-row aux summed over
  `steps` steps (every row run each step; `Engine._greedy_step`'s sums): an aux with `tokens_B`
  as counts per token (L2A `global_tokens_B`, AHA `full_BN`), else the mean over steps (Elastic
  `fa_BK`); the scheme module's per-row values [B] (MATCH) as 'scheme/<name>', means per step."""
  import numpy as np
  sums = {k: np.asarray(v, np.float64) for k, v in sums.items()}
  if not steps or not (sums or module_sums):
    return {}
  if "tokens_B" in sums:
    tok = np.maximum(sums.pop("tokens_B"), 1.0)
    out = {k: v / tok.reshape(tok.shape + (1,) * (v.ndim - 2)) for k, v in sums.items()}
  else:
    out = {k: v / steps for k, v in sums.items()}
  return {**out, **{f"scheme/{m}": np.asarray(v, np.float64) / steps
                    for m, v in module_sums.items()}}


def step_bytes(scheme: str, cfg, B: int, T: int, rate: dict, state_bytes: int) -> dict:
  """{'kv_bytes', 'formula', 'rate'} of one decode step (see the module docstring)."""
  import numpy as np
  from condattn_jax.attention import options as scheme_options
  L, K, N, H = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
  kv = 2 * H * 2  # K and V, bf16, per token and KV head
  o = None if scheme == "dense" else scheme_options(cfg)
  if scheme == "dense":
    return dict(kv_bytes=L * B * T * K * kv, formula="L*B*T*K*kv", rate=None)
  if scheme == "l2a":
    g = rate["global_tokens_B"]  # [L, B]
    W = min(o.window, T)
    return dict(kv_bytes=int(L * B * K * kv * W + T * K * kv * g.sum()),
                formula="L*B*K*kv*min(W,T) + T*K*kv*sum(g_lb)", rate=float(g.mean()))
  if scheme == "aha":
    f = rate["full_BN"]  # [L, B, N]
    W = min(o.window, T)
    return dict(kv_bytes=int(kv * (L * B * N * W + T * f.sum())),
                formula="kv*(L*B*N*min(W,T) + T*sum(f_lbn))", rate=float(f.mean()))
  if scheme == "elastic":
    a = rate["fa_BK"]  # [L, B, K]
    ssa = min(o.sinks + o.local, T)
    return dict(kv_bytes=int(kv * (a * T + (1 - a) * ssa).sum()),
                formula="kv*sum(a_lbk*T + (1-a_lbk)*min(sinks+local,T))", rate=float(a.mean()))
  if scheme == "match":  # Ls SWA (+ retrieval) layers, Lf = L - Ls full ones (swa_ratio)
    from condattn_jax.attention.match.options import layer_kinds
    Ls = layer_kinds(cfg).count("swa")
    full = (L - Ls) * B * T * K * kv
    r_B = rate.get("scheme/retrieved_B")  # chunks a decode step read, per row (engine stats)
    if r_B is None:
      return dict(kv_bytes=int(Ls * B * K * kv * (min(o.window, T) + o.top_k * o.chunk) + full),
                  formula="Ls*B*K*kv*(min(W,T) + top_k*chunk) + Lf*B*T*K*kv", rate=None)
    return dict(kv_bytes=int(Ls * K * kv * (B * min(o.window, T) + o.chunk * r_B.sum()) + full),
                formula="Ls*K*kv*(B*min(W,T) + chunk*sum(r_b)) + Lf*B*T*K*kv",
                rate=float(r_B.mean()),
                searches_per_step=float(rate["scheme/searches_B"].mean()))
  if scheme == "segmented":
    return dict(kv_bytes=int(state_bytes), formula="cache_bytes(decode state)", rate=None)
  raise ValueError(f"bench.decode: no bytes formula for scheme {scheme!r}")


def bandwidth_tbps(kind: str, flag: float | None) -> float:
  if flag:
    return float(flag)
  return next((v for k, v in BANDWIDTH_TBPS.items() if k in kind), 0.02)


# ------------------------------------------------------------------------------------------------
# The plain-XLA decode baseline (dense, pre-norm families without q/k norm)
# ------------------------------------------------------------------------------------------------

def _rms(x, scale, eps):
  import jax.numpy as jnp
  from jax import lax
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
          * scale.astype(jnp.float32)).astype(x.dtype)


def _baseline_layer(cfg, lp, x_BD, k_BSKH, v_BSKH, pos, lengths_B):
  """One layer of the baseline: writes the token's K/V at slot `pos` of this layer's cache
  (dynamic_update_slice), attends over slots < lengths_B + 1; returns (x, k, v)."""
  import jax.numpy as jnp
  from jax import lax
  from condattn_jax.models.layers import apply_rope, rope_inv_freq
  a, eps, dt = lp["self_attn"], cfg.rms_norm_eps, x_BD.dtype
  h = _rms(x_BD, lp["input_layernorm"]["scale"], eps)
  proj = lambda p: jnp.einsum("bd,dnh->bnh", h, p["kernel"]) + (p["bias"] if "bias" in p else 0)
  q, k, v = proj(a["q_proj"]), proj(a["k_proj"]), proj(a["v_proj"])
  p_B1 = jnp.broadcast_to(pos, (x_BD.shape[0], 1))
  inv = rope_inv_freq(cfg)
  q, k = apply_rope(q[:, None], p_B1, inv)[:, 0], apply_rope(k[:, None], p_B1, inv)[:, 0]
  k_BSKH = lax.dynamic_update_slice(k_BSKH, k[:, None].astype(k_BSKH.dtype), (0, pos, 0, 0))
  v_BSKH = lax.dynamic_update_slice(v_BSKH, v[:, None].astype(v_BSKH.dtype), (0, pos, 0, 0))
  B, S, K, H = k_BSKH.shape
  q_BKGH = q.reshape(B, K, -1, H)
  s_BKGS = jnp.einsum("bkgh,bskh->bkgs", q_BKGH, k_BSKH,
                      preferred_element_type=jnp.float32) * H ** -0.5
  live_BS = jnp.arange(S)[None] <= lengths_B[:, None]
  s_BKGS = jnp.where(live_BS[:, None, None], s_BKGS, -jnp.inf)
  p_BKGS = jax_softmax(s_BKGS).astype(dt)
  o_BNH = jnp.einsum("bkgs,bskh->bkgh", p_BKGS, v_BSKH).reshape(B, -1, H)
  x_BD = x_BD + jnp.einsum("bnh,nhd->bd", o_BNH, a["o_proj"]["kernel"])
  m = lp["mlp"]
  h = _rms(x_BD, lp["post_attention_layernorm"]["scale"], eps)
  g = jnp.einsum("bd,df->bf", h, m["gate_proj"]["kernel"])
  u = jnp.einsum("bd,df->bf", h, m["up_proj"]["kernel"])
  act = (g.astype(jnp.float32) * jax_sigmoid(g.astype(jnp.float32))).astype(dt) * u
  return x_BD + jnp.einsum("bf,fd->bd", act, m["down_proj"]["kernel"]), k_BSKH, v_BSKH


def jax_softmax(x):
  import jax
  return jax.nn.softmax(x, axis=-1)


def jax_sigmoid(x):
  import jax
  return jax.nn.sigmoid(x)


def _logits(cfg, params, x_BD):
  import jax.numpy as jnp
  h = _rms(x_BD, params["norm"]["scale"], cfg.rms_norm_eps)
  w = (params["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings
       else params["lm_head"]["kernel"])
  return jnp.einsum("bd,dv->bv", h, w, preferred_element_type=jnp.float32)


def baseline_step_stacked(cfg, params, k_LBSKH, v_LBSKH, tokens_B, pos, lengths_B):
  """The stacked layout: lax.scan over layers carrying the donated [L, B, S, K, H] caches,
  each layer's K/V written by dynamic_update_slice at (l, :, pos). Returns (k, v, logits_BV)."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  x = params["embed_tokens"]["embedding"][tokens_B]

  def body(carry, xs):
    x, kc, vc = carry
    l, lp = xs
    k_l = lax.dynamic_index_in_dim(kc, l, keepdims=False)
    v_l = lax.dynamic_index_in_dim(vc, l, keepdims=False)
    x, k_l, v_l = _baseline_layer(cfg, lp, x, k_l, v_l, pos, lengths_B)
    kc = lax.dynamic_update_slice(kc, lax.dynamic_slice_in_dim(k_l, pos, 1, 1)[None],
                                  (l, 0, pos, 0, 0))
    vc = lax.dynamic_update_slice(vc, lax.dynamic_slice_in_dim(v_l, pos, 1, 1)[None],
                                  (l, 0, pos, 0, 0))
    return (x, kc, vc), None

  (x, k_LBSKH, v_LBSKH), _ = lax.scan(body, (x, k_LBSKH, v_LBSKH),
                                      (jnp.arange(cfg.num_layers), params["layers"]))
  return k_LBSKH, v_LBSKH, _logits(cfg, params, x)


def baseline_step_layers(cfg, params, ks, vs, tokens_B, pos, lengths_B):
  """One cache array per layer (tuples ks / vs of [B, S, K, H], donated), a python loop over
  layers. Returns (ks, vs, logits_BV)."""
  import jax
  x = params["embed_tokens"]["embedding"][tokens_B]
  ks, vs = list(ks), list(vs)
  for l in range(cfg.num_layers):
    lp = jax.tree.map(lambda a: a[l], params["layers"])
    x, ks[l], vs[l] = _baseline_layer(cfg, lp, x, ks[l], vs[l], pos, lengths_B)
  return tuple(ks), tuple(vs), _logits(cfg, params, x)


def jit_baselines(cfg):
  """(stacked, layers) jitted, caches donated, cfg static."""
  import functools
  import jax
  st = jax.jit(functools.partial(baseline_step_stacked, cfg), donate_argnums=(1, 2))
  ly = jax.jit(functools.partial(baseline_step_layers, cfg), donate_argnums=(1, 2))
  return st, ly


def engine_cache_to_stacked(cache):
  """The dense engine's cache (one per layer, `layers_{i}`) -> the baseline's (k_LBSKH,
  v_LBSKH)."""
  import jax.numpy as jnp
  L = sum(1 for name in cache if name.startswith("layers_"))
  c = [cache[f"layers_{i}"]["self_attn"]["cache"] for i in range(L)]
  return jnp.stack([x["key"] for x in c]), jnp.stack([x["value"] for x in c])


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------

def _mem(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  g = lambda k: int(getattr(m, k, 0) or 0)
  out = dict(arg_bytes=g("argument_size_in_bytes"), out_bytes=g("output_size_in_bytes"),
             alias_bytes=g("alias_size_in_bytes"), temp_bytes=g("temp_size_in_bytes"))
  out["peak_est_bytes"] = out["arg_bytes"] + out["out_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  return out


def _timed_steps(step, state, n: int, repeats: int, warmup: int, i0: int = 0,
                 host: list | None = None):
  """`state = step(state, i)` run back to back, i from i0 (`warmup` untimed steps, then
  `repeats` timed batches of n); (median ms per step, batch ms list, state). host: a list
  that gets each timed step's host ms (the call's return: dispatch, the device not waited for)."""
  import jax
  i = i0
  for _ in range(warmup):
    state = step(state, i)
    i += 1
  jax.block_until_ready(state)
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(n):
      t1 = time.perf_counter()
      state = step(state, i)
      if host is not None:
        host.append((time.perf_counter() - t1) * 1e3)
      i += 1
    jax.block_until_ready(state)
    runs.append((time.perf_counter() - t0) * 1e3 / n)
  return statistics.median(runs), runs, state


TRACE_TOP = 40  # kernels named in a traced row (where a step's time goes, with launch counts)


def trace_row(row: dict, step, state, i0: int, n: int):
  """row += the device's activity over `n` more bench steps from step i0 (the timed loop's
  argmax and position add included) under jax.profiler (bench.common.trace_activity), per step:
  trace_busy_ms, trace_kernels, trace_span_ms (first start to last end: span - busy is the
  GPU idle inside the steps), trace_top (the TRACE_TOP longest kernels: [name, ms a step]) and
  trace_launches ({name: launches a step} of those); returns the state. Beside the
  row's ms (timed untraced) it says whether the step is device-bound (busy ~ ms) or waits on
  the host (busy << ms). Under a trace XLA runs the programs op by op (its command buffers are
  off while profiling unless compiled with xla_enable_command_buffers_during_profiling): busy
  is the kernels' time, the span is not the graph's."""
  holder, i = [state], [i0]

  def one():
    holder[0] = step(holder[0], i[0])
    i[0] += 1
    return holder[0][-1]
  prof = common.trace_activity(one, n, top_n=TRACE_TOP)
  row.update(trace_busy_ms=prof["busy_ms"], trace_kernels=prof["kernels"],
             trace_span_ms=prof["span_ms"], trace_top=prof["top"],
             trace_launches=prof["launches"], trace_steps=n)
  return holder.pop()


def block_len(scheme: str, cfg) -> int:
  """Steps after which a row's decode work repeats: MATCH's chunk (a retrieval block: the step
  entering it searches and recomputes, the others reuse), 1 for the other schemes."""
  if scheme != "match":
    return 1
  from condattn_jax.attention import options
  return options(cfg).chunk


def timed_schedule(scheme: str, cfg, T: int, steps: int, repeats: int, warmup: int):
  """(steps, warmup, extra cache slots) of a row's timing. MATCH retrieves (and recomputes the
  retrieved K/V) once per block of `chunk` generated tokens, the step entering the block: its
  warm-up runs to the next block start past one whole block, and each timed batch is whole
  blocks (`steps` rounded up to a multiple of chunk) from a block start, so ms counts the
  per-block work at its rate (one block entry per chunk steps). Others: as given."""
  if scheme != "match":
    return steps, warmup, EXTRA
  c = block_len(scheme, cfg)
  warmup = c + (-T) % c
  steps = -(-steps // c) * c
  return steps, warmup, max(EXTRA, warmup + repeats * steps + c)  # + block_split's block


def block_split(step, state, i0: int, c: int) -> tuple[dict, tuple]:
  """MATCH: one more block of `c` steps from a block start (`i0`), each step timed alone
  (synchronised): {entry_ms: the step entering the block (retrieval + the retrieved chunks'
  recompute), inner_ms: the median of the block's other steps}: which of the two a change of
  ms with T comes from."""
  import jax
  ts = []
  for i in range(i0, i0 + c):
    t0 = time.perf_counter()
    state = step(state, i)
    jax.block_until_ready(state)
    ts.append((time.perf_counter() - t0) * 1e3)
  return dict(entry_ms=ts[0], inner_ms=statistics.median(ts[1:])), state


def filled_program(eng, scheme: str, cfg, B: int, T: int, log, max_steps: int):
  """The engine's cache filled by a chunked prefill of B random prompts of T tokens, and its
  greedy decode program (`Engine._greedy_step`, what `generate` runs: the token the argmax of
  the last logits inside the step, every changing input donated state) compiled ahead of time:
  ((cache, greedy state for max_steps steps), step(state, i) -> state (the i-th step after the
  prompt), {fill_s, cache_bytes, compile_s, programs, memory analysis (the max over the
  programs)}). The engine's static fields of each step come from the host positions as its
  decode loops pass them (Engine._decode_fields: MATCH's entering / reusing steps are two
  programs): one compiled program per distinct value over a block of steps."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax.inference import Engine
  from condattn_jax.inference.engine import cache_bytes, greedy_state, stop_ids
  info = {}
  rng = np.random.default_rng(T + B)
  prompts = [rng.integers(0, cfg.vocab_size, T, dtype=np.int32) for _ in range(B)]
  t0 = time.perf_counter()
  cache, logits, _, _ = eng._prefill(prompts)
  jax.block_until_ready((cache, logits))
  info["fill_s"] = time.perf_counter() - t0
  info["cache_bytes"] = cache_bytes(cache)
  log(f"  filled {scheme} B={B} T={T}: {info['fill_s']:.1f} s (compile included)")
  on_B = np.ones(B, bool)
  span = block_len(scheme, cfg)  # the fields repeat every block: looked up once, not a step
  fields = [eng._decode_fields(np.full(B, T + i, np.int32), on_B) for i in range(span)]
  stop = stop_ids(())  # no stop token: every row runs every step (generate's stop_S)
  state = greedy_state(logits, np.full(B, T), max_steps,
                       eng.step_aux_shapes(eng.params, cache, B, fields[0]))
  t0 = time.perf_counter()
  compiled = {sf: Engine._greedy_step.lower(eng, eng.params, cache, state, stop,
                                            static_fields=sf).compile()
              for sf in sorted(set(fields))}
  programs = [compiled[sf] for sf in fields]
  info["compile_s"] = time.perf_counter() - t0
  info["programs"] = len(compiled)
  log(f"  compiled its decode step ({len(compiled)} program(s)): {info['compile_s']:.1f} s")
  mems = [_mem(c) for c in compiled.values()]
  info.update({k: max(m[k] for m in mems) for k in mems[0]} if mems[0] else {})

  def step(state, i):  # the i-th step after the prompt
    return programs[i % span](eng.params, *state, stop)
  return (cache, state), step, info


def step_loop(eng, B: int, T: int, span: int):
  """The decode loop before `_greedy_step` (what `Engine.decode_step` runs, a row per host
  call): `Engine._step` with its token the argmax of the last logits in a dispatch of its own
  and the position pos0 + i, both new arrays every call, each step's aux dropped. state:
  (cache, logits); the same static fields as `filled_program`'s steps."""
  import jax.numpy as jnp
  import numpy as np
  from condattn_jax.inference import Engine
  on, on_B = jnp.ones((B, 1), bool), np.ones(B, bool)
  fields = [eng._decode_fields(np.full(B, T + i, np.int32), on_B) for i in range(span)]
  pos0 = jnp.full((B, 1), T, jnp.int32)

  def step(state, i):
    cache, logits = state
    t = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    return Engine._step(eng, eng.params, cache, t, pos0 + i, on, logits,
                        static_fields=fields[i % span])[:2]
  return step


def engine_row(scheme: str, shapes: str, B: int, T: int, F, log) -> tuple[dict, dict]:
  """One engine row; returns (row, extras for the baselines: params, cfg, cache)."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.inference import Engine
  cfg, knobs = scheme_config(scheme, shapes, T, overrides(F))
  row = dict(scheme=scheme, shapes=shapes, B=B, T=T, layers=cfg.num_layers, knobs=knobs,
             status="running")
  t0 = time.perf_counter()
  params = init_params(cfg)
  if scheme == "aha" and F.aha_full:
    params, full_LN = aha_static_routing(params, cfg, F.aha_full)
    row["knobs"]["full_pairs"] = float(full_LN.mean())
  jax.block_until_ready(params)
  row["init_s"] = time.perf_counter() - t0
  row["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  row["weight_bytes"] = weight_bytes(cfg, params, B)
  steps, warmup, extra_slots = timed_schedule(scheme, cfg, T, F.steps, F.repeats, F.warmup)
  row.update(steps=steps, warmup=warmup)
  # the traced steps (--trace_steps) after every timed one (and MATCH's block_split block)
  used = (warmup + F.repeats * steps + (warmup + F.repeats * steps if F.step_ab else 0)
          + (block_len(scheme, cfg) if scheme == "match" else 0) + F.trace_steps)
  # in whole EXTRA-slot blocks: a kv length the decode paths split evenly (ops.decode_splits)
  extra_slots = max(extra_slots, -(-used // EXTRA) * EXTRA)
  eng = Engine(cfg, params, cache_len=T + extra_slots, prefill_chunk=min(PREFILL_CHUNK, T))
  state, step, info = filled_program(eng, scheme, cfg, B, T, log, used)
  row.update(info)
  host = []
  ms, runs, state = _timed_steps(step, state, steps, F.repeats, warmup, host=host)
  row.update(ms=ms, runs_ms=runs, host_ms=statistics.median(host), tokens_per_s=B * 1e3 / ms,
             logits_finite=bool(jnp.all(jnp.isfinite(state[1]["logits"]))))
  g = jax.device_get({k: state[1][k] for k in ("sums", "module_sums", "i")})
  rate = rates(g["sums"], g["module_sums"], int(g["i"]))  # every step so far, warm-up too
  i = warmup + F.repeats * steps
  if scheme == "match":
    split, state = block_split(step, state, i, block_len(scheme, cfg))
    row.update(split)
    i += block_len(scheme, cfg)
  if F.trace_steps:
    state = trace_row(row, step, state, i, F.trace_steps)
    i += F.trace_steps
  if F.step_ab:  # as many steps again through the loop before _greedy_step
    host_ab = []
    old = step_loop(eng, B, T, block_len(scheme, cfg))
    ms_ab, runs_ab, state = _timed_steps(old, (state[0], state[1]["logits"]), steps,
                                         F.repeats, warmup, i0=i, host=host_ab)
    row.update(ms_step_loop=ms_ab, runs_ms_step_loop=runs_ab,
               host_ms_step_loop=statistics.median(host_ab))
  cache = state[0]
  row.update(step_bytes(scheme, cfg, B, T, rate, row["cache_bytes"]))
  row["bytes"] = row["weight_bytes"] + row["kv_bytes"]
  row["peak_bytes_in_use"] = common.peak_bytes()
  row["status"] = "ok"
  return row, dict(cfg=cfg, params=params, cache=cache, engine=eng)


def flat_rows(F, log, emit) -> list[dict]:
  """MATCH's flatness in ONE process (--flat=lo,hi): one model (its knobs at hi; on the issue's
  shapes the same at every T, HELD), B = 1, two engines over the same params filled with lo and
  hi tokens, both programs compiled, then --flat_repeats rounds in which each engine times a
  batch of whole blocks (timed_schedule), the order alternating every round (lo first in even
  rounds): an effect of the process order falls on both contexts alike. kind 'flat' rows per
  T: ms = the median over the rounds; the flat target reads them before the engine rows."""
  from condattn_jax.inference import Engine
  T_lo, T_hi = sorted(int(t) for t in F.flat)
  shapes = TINY_SHAPES["qwen2.5-1.5b"] if F.preset == "test" else SCHEMES["match"][2]
  cfg, knobs = scheme_config("match", shapes, T_hi, overrides(F))
  params = init_params(cfg)
  runs = {}
  for T in (T_lo, T_hi):
    steps, warmup, extra = timed_schedule("match", cfg, T, F.steps, F.flat_repeats, F.warmup)
    eng = Engine(cfg, params, cache_len=T + extra, prefill_chunk=min(PREFILL_CHUNK, T))
    state, step, info = filled_program(eng, "match", cfg, 1, T, log,
                                       warmup + F.flat_repeats * steps)
    runs[T] = dict(state=state, step=step, i=0, steps=steps, ms=[], info=info, warmup=warmup)
  for r in range(F.flat_repeats):
    for T in ((T_lo, T_hi) if r % 2 == 0 else (T_hi, T_lo)):
      x = runs[T]
      warm = x["warmup"] if r < 2 else 0  # (each engine's first batch: its warm-up first)
      ms, _, x["state"] = _timed_steps(x["step"], x["state"], x["steps"], 1, warm, i0=x["i"])
      x["i"] += warm + x["steps"]
      x["ms"].append(ms)
  rows = []
  for T in (T_lo, T_hi):
    x = runs[T]
    row = dict(scheme="match", kind="flat", shapes=shapes, B=1, T=T, knobs=knobs,
               steps=x["steps"], warmup=x["warmup"], repeats=F.flat_repeats, **x["info"],
               ms=statistics.median(x["ms"]), runs_ms=x["ms"], status="ok",
               order="lo first in even rounds")
    log(f"  flat {T}: {row['ms']:.3f} ms (runs {', '.join(f'{m:.2f}' for m in x['ms'])})")
    rows.append(row)
    emit(row)
  return rows


def baseline_rows(extra: dict, row: dict, F) -> list[dict]:
  """The two plain-XLA layouts at the dense row's point (its cache content, random tokens)."""
  import jax
  import jax.numpy as jnp
  cfg, params = extra["cfg"], extra["params"]
  B, T = row["B"], row["T"]
  k, v = engine_cache_to_stacked(extra["cache"])
  extra["cache"] = None
  st, ly = jit_baselines(cfg)
  lengths = jnp.full((B,), T, jnp.int32)
  tok = jnp.zeros((B,), jnp.int32)
  out = []
  for name, fn, caches in (("xla_stacked", st, (k, v)),
                           ("xla_per_layer", ly, (tuple(k[l] for l in range(cfg.num_layers)),
                                                  tuple(v[l] for l in range(cfg.num_layers))))):
    r = dict(scheme=name, shapes=row["shapes"], B=B, T=T, layers=cfg.num_layers, status="running")
    try:
      t0 = time.perf_counter()
      compiled = fn.lower(params, *caches, tok, jnp.int32(T), lengths).compile()
      r["compile_s"] = time.perf_counter() - t0
      r.update(_mem(compiled))
      r["cache_bytes"] = nbytes(caches)
      r["temp_over_cache"] = r.get("temp_bytes", 0) / r["cache_bytes"]

      def step(state, i):
        kc, vc, logits = state
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        return compiled(params, kc, vc, t, jnp.int32(T + i), lengths + i)

      init = (*caches, jnp.zeros((B, cfg.vocab_size), jnp.float32))
      del caches
      ms, runs, state = _timed_steps(step, init, F.steps, F.repeats, F.warmup)
      del init
      r.update(ms=ms, runs_ms=runs, tokens_per_s=B * 1e3 / ms,
               logits_finite=bool(jnp.all(jnp.isfinite(state[2]))), status="ok")
      if name == "xla_stacked":  # the per-layer variant starts from the same content
        k, v = state[0], state[1]
      del state
    except Exception as e:  # recorded, the run goes on
      r.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
    out.append(r)
  return out


def prefill_rows(T: int, shapes: str, F, log) -> list[dict]:
  """Dense, B = 1: the engine's prefill of T tokens one-shot and in 4096-token chunks."""
  import jax
  import numpy as np
  from condattn_jax.inference import Engine
  cfg, _ = scheme_config("dense", shapes, T)
  params = init_params(cfg)
  prompt = [np.random.default_rng(1).integers(0, cfg.vocab_size, T, dtype=np.int32)]
  rows = []
  chunk = PREFILL_CHUNK if T > PREFILL_CHUNK else max(T // 4, 1)
  for mode, chunk in (("one_shot", None), ("chunked", chunk)):
    r = dict(scheme="dense", kind="prefill", mode=mode, chunk=chunk, shapes=shapes, B=1, T=T)
    try:
      eng = Engine(cfg, params, cache_len=T + EXTRA, prefill_chunk=chunk)
      t0 = time.perf_counter()
      jax.block_until_ready(eng._prefill(prompt)[:2])
      r["first_s"] = time.perf_counter() - t0
      ts = []
      for _ in range(F.prefill_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(eng._prefill(prompt)[:2])
        ts.append((time.perf_counter() - t0) * 1e3)
      r.update(ms=statistics.median(ts), runs_ms=ts, status="ok")
    except Exception as e:
      r.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
    log(f"  prefill {mode} T={T}: {r.get('ms')} ms")
    rows.append(r)
  return rows


def serve_requests(n: int, prompt_range, new_range, vocab: int, seed: int = 0):
  """n requests: (prompt ids, max_new_tokens), lengths uniform in the two inclusive ranges."""
  import numpy as np
  rng = np.random.default_rng(seed)
  lo, hi = (int(x) for x in prompt_range)
  nlo, nhi = (int(x) for x in new_range)
  return [(rng.integers(0, vocab, int(rng.integers(lo, hi + 1)), dtype=np.int32),
           int(rng.integers(nlo, nhi + 1))) for _ in range(n)]


SERVE_SLOT_MULTIPLE = 256


def serve_rows(F, log, emit=None) -> list[dict]:
  """Continuous batching vs one batch at a time, same requests (greedy, bf16 shapes of the
  scheme, prefill chunk --serve_chunk in both): `Engine.serve(slots=S)` (a finished row takes
  the next request) and `Engine.generate` over consecutive groups of S requests (a group runs
  until its largest max_new_tokens: each request keeps its own budget's tokens, the rest is
  the waste continuous batching removes; its greedy steps on the device, Engine.
  _greedy_on_device), and the same groups through generate's host loop (batched_generate_host:
  Engine.GREEDY_ON_DEVICE off, a host round trip a step); serve_host: serve with
  Engine.SERVE_ON_DEVICE off (a host round trip every decode step). Each mode runs once untimed
  (compiles) and --serve_repeats times timed (wall_s: the median); tokens = the sum of the
  requests' max_new_tokens (no stop tokens: every request runs its budget, so serve runs its
  planned schedule); tokens_per_s = tokens / wall. What each ran: steps (decode steps),
  prefill_calls and prefill_row_tokens (rows x chunk tokens the prefill calls computed, padding
  rows and tokens included; generate's: its groups' chunks); serve's rows add Engine.serve's
  counts (host_syncs: host waits on the device; device_steps / host_steps; inserts;
  caches_made; idle_row_steps: free rows' steps while a request waited or was prefilled).
  same_tokens: the fraction of requests whose tokens agree between serve and generate (bf16:
  batch composition may flip a near tie); same_tokens_as_host: between generate's two loops
  (on the generate row) and between serve's (on the serve row); over_host_loop likewise.
  emit(row): called with each mode's row as soon as it is done (main records it at once: a
  timeout keeps it); the ratios are added to the serve and generate rows afterwards."""
  import jax
  from condattn_jax.inference import Engine, Request
  scheme = F.serve_scheme
  shapes = SCHEMES[scheme][2]
  if F.preset == "test":
    shapes = TINY_SHAPES.get(shapes, shapes)
  reqs = serve_requests(F.serve_requests, F.serve_prompt, F.serve_new,
                        SHAPES[shapes]["vocab_size"])
  # the cache's slots rounded up to a multiple of SERVE_SLOT_MULTIPLE, as in the recorded serve
  # runs (kept so later runs stay comparable: since the compacted kernels' supports() judges the
  # padded kv length, any cache length runs the kernels; before, an odd one fell back to the
  # O(T*S) reference)
  need = max(len(p) for p, _ in reqs) + max(m for _, m in reqs)
  longest = -(-need // SERVE_SLOT_MULTIPLE) * SERVE_SLOT_MULTIPLE
  cfg, knobs = scheme_config(scheme, shapes, longest)
  params = init_params(cfg)
  S = F.serve_slots
  eng = Engine(cfg, params, cache_len=longest, prefill_chunk=min(F.serve_chunk, longest))
  base = dict(scheme=scheme, kind="serve", shapes=shapes, B=S, T=longest, knobs=knobs,
              requests=len(reqs), prompt_range=[int(x) for x in F.serve_prompt],
              new_range=[int(x) for x in F.serve_new], chunk=eng.prefill_chunk,
              admit=F.serve_admit or S,
              tokens=sum(m for _, m in reqs), prompt_tokens=int(sum(len(p) for p, _ in reqs)))

  def served():
    g = eng.serve([Request(p, max_new_tokens=m) for p, m in reqs], 1, slots=S,
                  admit=F.serve_admit or None)
    return g.tokens, dict(steps=g.steps, ttft_s_median=statistics.median(g.ttft_s), **g.counts)

  def batched():
    out, steps, rows_tokens, calls = [], 0, 0, 0
    for i in range(0, len(reqs), S):
      group = reqs[i:i + S]
      g = eng.generate([p for p, _ in group], max(m for _, m in group))
      out += [t[:m] for t, (_, m) in zip(g.tokens, group)]
      steps += g.steps
      longest = max(len(p) for p, _ in group)
      C = eng.chunk_for(longest)   # generate's chunk for this group; every row in each chunk
      n = -(-longest // C)
      calls, rows_tokens = calls + n, rows_tokens + n * C * len(group)
    return out, dict(steps=steps, prefill_calls=calls, prefill_row_tokens=rows_tokens)

  def served_host():  # serve with a host round trip every decode step
    eng.SERVE_ON_DEVICE = False   # this engine only
    try:
      return served()
    finally:
      del eng.SERVE_ON_DEVICE

  def batched_host():  # the same groups through generate's host loop (one round trip a step)
    eng.GREEDY_ON_DEVICE = False   # this engine only
    try:
      return batched()
    finally:
      del eng.GREEDY_ON_DEVICE

  rows, got = [], {}
  for mode, fn in (("serve", served), ("batched_generate", batched),
                   ("batched_generate_host", batched_host), ("serve_host", served_host)):
    r = dict(base, mode=mode, status="running")
    try:
      t0 = time.perf_counter()
      fn()
      r["first_s"] = time.perf_counter() - t0  # compiles included
      log(f"  {mode}: untimed pass (compiles) {r['first_s']:.1f} s")
      walls = []
      for _ in range(F.serve_repeats):
        t0 = time.perf_counter()
        got[mode], extra = fn()
        jax.effects_barrier()
        walls.append(time.perf_counter() - t0)
      r["wall_s"] = statistics.median(walls)
      if F.serve_repeats > 1:
        r["walls_s"] = walls
      r.update(extra, tokens_per_s=r["tokens"] / r["wall_s"], status="ok")
    except Exception as e:
      r.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
      traceback.print_exc()
    log(f"  {mode}: {r.get('wall_s')} s, {r.get('tokens_per_s')} tok/s")
    rows.append(r)
    if emit is not None:
      emit(r)
  if all(r["status"] == "ok" for r in rows):
    rows[0]["same_tokens"] = sum(a == b for a, b in zip(got["serve"], got["batched_generate"])
                                 ) / len(reqs)
    rows[0]["over_batched"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    rows[1]["same_tokens_as_host"] = sum(a == b for a, b in zip(
        got["batched_generate"], got["batched_generate_host"])) / len(reqs)
    rows[1]["over_host_loop"] = rows[1]["tokens_per_s"] / rows[2]["tokens_per_s"]
    rows[0]["same_tokens_as_host"] = sum(a == b for a, b in zip(
        got["serve"], got["serve_host"])) / len(reqs)
    rows[0]["over_host_loop"] = rows[0]["tokens_per_s"] / rows[3]["tokens_per_s"]
  return rows


# Nominal routing rates for `nominal_bytes` (no run: the rates a trained router is expected to
# reach): L2A the recipe's bernoulli_q, AHA the issue's 10% of (token, head) pairs full, Elastic
# the FA share of KV heads at the recipe's first target (0.7 of heads sparse -> 0.3 FA).
NOMINAL = {"l2a": 0.2, "aha": 0.1, "elastic": 0.3, "match": None, "segmented": None}


def nominal_bytes(scheme: str, shapes: str, B: int, T: int, rate: float | None = None) -> dict:
  """{weight_bytes, kv_bytes, bytes, limit_ms_h100} of one decode step at a nominal routing
  rate (NOMINAL[scheme] unless given; MATCH: top_k chunks retrieved; segmented: its cache), from
  abstract shapes (nothing allocated, no run): the bytes-bound side of the table before any GPU
  time. The same `step_bytes` formulas as a measured row, with every (layer, row, head) at the
  rate."""
  import numpy as np
  from condattn_jax.inference import Engine
  cfg, _ = scheme_config(scheme, shapes, T)
  params = abstract_params(cfg)
  L, K, N = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads
  q = NOMINAL.get(scheme) if rate is None else rate
  r = {"l2a": {"global_tokens_B": np.full((L, B), q if q is not None else 0.0)},
       "aha": {"full_BN": np.full((L, B, N), q if q is not None else 0.0)},
       "elastic": {"fa_BK": np.full((L, B, K), q if q is not None else 0.0)}}.get(scheme, {})
  state = 0
  if scheme == "segmented":
    state = nbytes(Engine(cfg, params, cache_len=T + EXTRA).cache_shapes(B))
  out = step_bytes(scheme, cfg, B, T, r, state)
  out["weight_bytes"] = weight_bytes(cfg, params, B)
  out["bytes"] = out["weight_bytes"] + out["kv_bytes"]
  out["limit_ms_h100"] = out["bytes"] / (BANDWIDTH_TBPS["H100"] * 1e12) * 1e3
  return out


def fits_rows(F, log) -> list[dict]:
  """Dense at --fits_T on --fits_shapes, B = 1 (issue 33: LLaMA-2-7B, 4K-chunk prefill + decode
  at 64K on one 80 GB card): the engine's prefill-chunk program ([1, fits_chunk] with the
  prompt lengths) and decode program ([1, 1]) compiled from abstract arguments (weights and
  cache never allocated) on this backend; per program its memory analysis (argument / output /
  alias / temp bytes, peak_est) and fits = peak_est <= the card's bytes. A run of the prompt
  then its decode holds at most the larger peak (the cache is donated: aliased, held once).
  Only a GPU run answers the GPU question (the CPU reference attention materialises the chunk's
  [N, chunk, T] scores, which cuDNN never does): the test preset checks the mechanism."""
  import jax
  import jax.numpy as jnp
  from condattn_jax.inference import Engine
  shapes = F.fits_shapes if F.preset != "test" else TINY_SHAPES.get(F.fits_shapes, F.fits_shapes)
  T, chunk = F.fits_T, F.fits_chunk
  cfg, _ = scheme_config("dense", shapes, T)
  params = abstract_params(cfg)
  eng = Engine(cfg, params, cache_len=T + EXTRA, prefill_chunk=chunk)
  cache = eng.cache_shapes(1)
  if F.card_gib:
    card = int(F.card_gib * 2**30)
  else:
    stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    card = int((stats or {}).get("bytes_limit", CARD_BYTES))
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  rows = []
  for mode, C in (("prefill_chunk", chunk), ("decode", 1)):
    r = dict(scheme="dense", kind="fits", mode=mode, shapes=shapes, B=1, T=T, chunk=C,
             platform=jax.default_backend(), weight_bytes=nbytes(params),
             cache_bytes=nbytes(cache), card_bytes=card, status="running")
    try:
      args = (params, cache, sds((1, C), jnp.int32), sds((1, C), jnp.int32), sds((1, C), bool),
              sds((1, cfg.vocab_size), jnp.float32))
      if mode == "prefill_chunk":
        args += (sds((1,), jnp.int32),)
      t0 = time.perf_counter()
      compiled = Engine._step.lower(eng, *args).compile()
      r["compile_s"] = time.perf_counter() - t0
      r.update(_mem(compiled))
      r["over_resident_bytes"] = r["peak_est_bytes"] - r["weight_bytes"] - r["cache_bytes"]
      r.update(fits=r["peak_est_bytes"] <= card, status="ok")
    except Exception as e:
      r.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
      traceback.print_exc()
    log(f"  fits {mode} {shapes} T={T}: peak {r.get('peak_est_bytes', 0) / 2**30:.2f} GiB of "
        f"{card / 2**30:.2f} (weights {r['weight_bytes'] / 2**30:.2f} + cache "
        f"{r['cache_bytes'] / 2**30:.2f}) fits={r.get('fits')}")
    rows.append(r)
  return rows


# ------------------------------------------------------------------------------------------------
# Derived numbers and claims
# ------------------------------------------------------------------------------------------------

def derive(rows: list[dict], bw_tbps: float) -> None:
  """limit_ms / x_limit on engine rows; bound_speedup / speedup / achieved on scheme rows with a
  dense row of the same shapes, B and T; baselines' speed relative to the engine."""
  eng = {(r["scheme"], r["shapes"], r["B"], r["T"]): r for r in rows
         if r.get("status") == "ok" and "bytes" in r and "kind" not in r}
  for r in eng.values():
    r["limit_ms"] = r["bytes"] / (bw_tbps * 1e12) * 1e3
    r["x_limit"] = r["ms"] / r["limit_ms"]
  for (s, sh, B, T), r in eng.items():
    d = eng.get(("dense", sh, B, T))
    if s != "dense" and d is not None:
      r["bound_speedup"] = d["bytes"] / r["bytes"]
      r["speedup"] = d["ms"] / r["ms"]
      r["achieved"] = r["speedup"] / r["bound_speedup"]
  for r in rows:
    d = eng.get(("dense", r.get("shapes"), r.get("B"), r.get("T")))
    if r["scheme"].startswith("xla_") and r.get("status") == "ok" and d is not None:
      r["engine_over_baseline"] = d["ms"] / r["ms"]
      r["limit_ms"] = d["limit_ms"]
      r["x_limit"] = r["ms"] / d["limit_ms"]


DENSE_TARGETS = ((1, 8192, 2.0), (1, 32768, 1.5), (1, 131072, 1.5), (8, 32768, 1.5))
MATCH_FLAT = 1.2  # "MATCH decode time and memory flat from 8K to 128K": 128K within 1.2x of 8K


def targets_of(rows: list[dict], dense_shapes: str) -> list[dict]:
  """Issue 33's targets evaluated on the rows: [{name, met, detail}] (recorded on the run as
  `targets`, met or not: today's numbers are the baseline the decode kernels are judged by;
  bench/claims/decode.py re-evaluates them from the stored rows)."""
  ok = [r for r in rows if r.get("status") == "ok"]
  find = lambda **kw: next((r for r in ok if all(r.get(k) == v for k, v in kw.items())), None)
  out = []
  add = lambda name, met, **detail: out.append(dict(name=name, met=bool(met), detail=detail))
  for B, T, lim in DENSE_TARGETS:
    r = find(scheme="dense", shapes=dense_shapes, B=B, T=T, kind=None)
    if r is not None:
      add(f"dense B={B} T={T // 1024}K <= {lim}x the bandwidth limit", r["x_limit"] <= lim,
          ms=r["ms"], limit_ms=r["limit_ms"], x_limit=r["x_limit"])
  for d in (r for r in ok if r["scheme"] == "dense" and "bytes" in r and "kind" not in r):
    for name in ("xla_stacked", "xla_per_layer"):
      b = find(scheme=name, shapes=d["shapes"], B=d["B"], T=d["T"])
      if b is not None:
        add(f"engine faster than {name} ({d['shapes']} B={d['B']} T={d['T']})",
            d["ms"] < b["ms"], engine_ms=d["ms"], baseline_ms=b["ms"])
  for r in (r for r in ok if "bound_speedup" in r and "kind" not in r):
    add(f"{r['scheme']} ({r['shapes']} B={r['B']} T={r['T']}) >= 0.9x its bytes-bound speedup",
        r["achieved"] >= 0.9, bound=r["bound_speedup"], speedup=r["speedup"],
        achieved=r["achieved"])
  engine_rows = [r for r in ok if "bytes" in r and "kind" not in r]
  flat = [r for r in ok if r.get("kind") == "flat"]  # interleaved in one process (flat_rows)
  for B in sorted({r["B"] for r in engine_rows + flat if r["scheme"] == "match"}):
    fl = {r["T"]: r for r in flat if r["B"] == B}
    m = fl if 8192 in fl and 131072 in fl else {
        r["T"]: r for r in engine_rows if r["scheme"] == "match" and r["B"] == B}
    if 8192 in m and 131072 in m:  # flat: 128K within MATCH_FLAT of 8K, time and peak memory
      lo, hi = m[8192], m[131072]
      same = lo.get("knobs") == hi.get("knobs")  # one model at both contexts (HELD)
      add(f"match decode flat from 8K to 128K (B={B}): ms and peak within {MATCH_FLAT}x",
          same and hi["ms"] <= MATCH_FLAT * lo["ms"] and hi.get("peak_est_bytes", 0)
          <= MATCH_FLAT * lo.get("peak_est_bytes", 0), ms_8k=lo["ms"], ms_128k=hi["ms"],
          peak_8k=lo.get("peak_est_bytes"), peak_128k=hi.get("peak_est_bytes"),
          same_knobs=same, interleaved=lo.get("kind") == "flat" == hi.get("kind"))
  for r in (r for r in engine_rows if r["scheme"] == "segmented" and r["T"] == 65536):
    d = find(scheme="dense", shapes=r["shapes"], B=r["B"], T=r["T"], kind=None)
    if d is not None:
      add(f"segmented decode no slower than dense at 64K (B={r['B']})", r["ms"] <= d["ms"],
          segmented_ms=r["ms"], dense_ms=d["ms"])
  fits = [r for r in ok if r.get("kind") == "fits"]
  if len(fits) == 2:
    add(f"dense {fits[0]['shapes']} prefill ({fits[0]['chunk']}-token chunks) + decode at "
        f"T={fits[0]['T']} fits the card ({fits[0]['platform']})",
        all(r["fits"] for r in fits), peak_bytes=max(r["peak_est_bytes"] for r in fits),
        card_bytes=fits[0]["card_bytes"])
  sv, bt = find(kind="serve", mode="serve"), find(kind="serve", mode="batched_generate")
  if sv is not None and bt is not None:
    add(f"continuous batching ({sv['requests']} requests, {sv['B']} slots) faster than one "
        "batch at a time", sv["tokens_per_s"] > bt["tokens_per_s"],
        serve_tokens_per_s=sv["tokens_per_s"], batched_tokens_per_s=bt["tokens_per_s"])
  # registered before its first GPU run (2026-11-30, serve's planned schedule: rows that record
  # serve's counts): the same, with serve's tokens those of its host loop (bf16: serve and
  # generate differ in batch composition, so its host loop is the exact reference)
  hs = sv and find(kind="serve", mode="serve_host")
  if sv is not None and bt is not None and hs is not None and "host_syncs" in sv:
    add(f"continuous batching ({sv['requests']} requests, {sv['B']} slots) faster than one "
        "batch at a time, the same tokens as serve's host loop",
        sv["tokens_per_s"] > bt["tokens_per_s"] and sv.get("same_tokens_as_host") == 1.0,
        serve_tokens_per_s=sv["tokens_per_s"], batched_tokens_per_s=bt["tokens_per_s"],
        same_tokens=sv.get("same_tokens_as_host"), serve_steps=sv.get("steps"),
        batched_steps=bt.get("steps"), serve_host_syncs=sv["host_syncs"])
  # registered before their first GPU runs (2026-11-29): Engine.GREEDY_ON_DEVICE /
  # SERVE_ON_DEVICE stay the default where this holds on a GPU; where it fails, the default
  # becomes the host loop
  for dev, what in ((bt, "generate's greedy loop"), (sv, "serve's decode runs")):
    host = dev and find(kind="serve", mode=dev["mode"] + "_host")
    if dev is not None and host is not None:
      add(f"{what} on the device no slower than its host loop, the same tokens "
          f"({dev['requests']} requests)", dev["tokens_per_s"] >= host["tokens_per_s"]
          and dev.get("same_tokens_as_host") == 1.0, device_tokens_per_s=dev["tokens_per_s"],
          host_tokens_per_s=host["tokens_per_s"], same_tokens=dev.get("same_tokens_as_host"))
  one = find(kind="prefill", mode="one_shot")
  ch = find(kind="prefill", mode="chunked")
  if one is not None and ch is not None:
    add(f"chunked prefill ({ch['chunk']}) <= 1.15x one-shot at T={ch['T']}",
        ch["ms"] <= 1.15 * one["ms"], one_shot_ms=one["ms"], chunked_ms=ch["ms"])
  return out


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def plan(F) -> list[tuple[str, str, int, int]]:
  tiny = F.preset == "test"
  out = []
  explicit = [(p[0], p[3] if len(p) > 3 else None, int(p[1]), int(p[2]))
              for p in (r.split("/") for r in F.rows)]
  base = explicit or (TEST_PLAN if tiny else GPU_ALL_PLAN if F.preset == "gpu_all"
                      else GPU_PLAN)
  if F.part:
    base = part_of(by_point(base), F.part)
  for scheme, shapes, B, T in base:
    shapes = shapes or SCHEMES[scheme][2]
    if tiny:
      shapes = TINY_SHAPES.get(shapes, shapes)
    if F.only and scheme not in F.only:
      continue
    if F.B and str(B) not in F.B or F.T and str(T) not in F.T:
      continue
    out.append((scheme, shapes, B, T))
  return out


def table(rows: list[dict]) -> str:
  head = (f"{'scheme':14s} {'shapes':13s} {'B':>3s} {'T':>7s} {'ms':>8s} {'tok/s':>9s} "
          f"{'limit':>7s} {'xlim':>6s} {'bound':>6s} {'achv':>5s} {'comp_s':>6s} {'peakGB':>7s}")
  out = [head]
  f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"
  for r in rows:
    if r.get("kind") == "fits":
      out.append(f"fits {r['mode']:14s} {r['shapes']} T={r['T']} chunk={r['chunk']}: peak "
                 f"{f(r.get('peak_est_bytes', 0) / 2**30, '.2f')} GiB, card "
                 f"{r['card_bytes'] / 2**30:.2f} GiB, fits={r.get('fits')} {r.get('error', '')}")
      continue
    if r.get("kind") == "serve":
      out.append(f"serve {r['mode']:16s} {r['scheme']} {r['shapes']} slots={r['B']} "
                 f"requests={r['requests']}: {f(r.get('wall_s'), '.2f')} s "
                 f"{f(r.get('tokens_per_s'), '.1f')} tok/s {r.get('error', '')}")
      continue
    if r.get("kind") == "prefill":
      out.append(f"prefill {r['mode']:8s} T={r['T']} chunk={r['chunk']}: {f(r.get('ms'), '.1f')} ms"
                 f" {r.get('error', '')}")
      continue
    pk = r.get("peak_est_bytes")
    out.append(f"{r['scheme']:14s} {r['shapes']:13s} {r['B']:3d} {r['T']:7d} "
               f"{f(r.get('ms'), '8.2f')} {f(r.get('tokens_per_s'), '9.1f')} "
               f"{f(r.get('limit_ms'), '7.2f')} {f(r.get('x_limit'), '6.2f')} "
               f"{f(r.get('bound_speedup'), '6.2f')} {f(r.get('achieved'), '5.2f')} "
               f"{f(r.get('compile_s'), '6.1f')} {f(pk / 2**30 if pk else None, '7.2f')} "
               f"{r.get('status')} {r.get('error', r.get('reason', ''))[:80]}")
  return "\n".join(out)


def main(argv=None) -> dict:
  import jax
  F = common.parse_flags(FLAGS, argv)
  t_start = time.perf_counter()
  log = lambda s: print(s, flush=True)
  tiny = F.preset == "test"
  if jax.default_backend() == "gpu":
    from bench.e2e import _ensure_tokamax_importable
    _ensure_tokamax_importable()
  kind = common.device_kind()
  bw = bandwidth_tbps(kind, F.bandwidth_tbps)
  prefill_T = F.prefill_T if F.prefill_T is not None else (64 if tiny else 32768)
  dense_shapes = "tiny-qwen" if tiny else "qwen2.5-1.5b"
  todo = plan(F)
  run = common.new_run(BENCH, dict(
      name=F.name, preset=F.preset, override=list(F.override),
      steps=F.steps, repeats=F.repeats, warmup=F.warmup,
      bandwidth_tbps=bw, prefill_T=prefill_T, serve=dict(
          requests=F.serve_requests, slots=F.serve_slots, prompt=list(F.serve_prompt),
          new=list(F.serve_new), scheme=F.serve_scheme, chunk=F.serve_chunk,
          repeats=F.serve_repeats), extra_slots=EXTRA, prefill_chunk=PREFILL_CHUNK,
      plan=[list(p) for p in todo], dense_shapes=dense_shapes,
      aha_full=F.aha_full, flat=list(F.flat), flat_repeats=F.flat_repeats,
      note="issue 33's targets recorded on the run, met or not"))
  path = common.result_path(BENCH, F.out_dir, kind)
  run["targets"] = []
  common.append_run(path, run)

  def save():
    derive(run["rows"], bw)
    run["targets"] = targets_of(run["rows"], dense_shapes)
    common.replace_last_run(path, run)

  if F.bytes_only:
    for scheme, shapes, B, T in todo:
      r = dict(scheme=scheme, kind="bytes", shapes=shapes, B=B, T=T, rate_nominal=NOMINAL.get(
          scheme), **nominal_bytes(scheme, shapes, B, T), status="ok")
      d = next((x for x in run["rows"] if (x["scheme"], x["shapes"], x["B"], x["T"]) ==
                ("dense", shapes, B, T)), None)
      if d is not None and scheme != "dense":
        r["bound_speedup"] = d["bytes"] / r["bytes"]
      run["rows"].append(r)
      log(f"bytes {scheme:10s} {shapes:13s} B={B:3d} T={T:7d}: {r['bytes'] / 1e9:7.3f} GB "
          f"(weights {r['weight_bytes'] / 1e9:.3f}), H100 limit {r['limit_ms_h100']:.2f} ms"
          + (f", bound speedup {r['bound_speedup']:.2f}x" if "bound_speedup" in r else ""))
    todo = []
  for scheme, shapes, B, T in todo:
    if F.deadline_s and time.perf_counter() - t_start > F.deadline_s:
      run["rows"].append(dict(scheme=scheme, shapes=shapes, B=B, T=T, status="skipped",
                              reason=f"past --deadline_s={F.deadline_s}"))
      continue
    log(f"row {scheme} {shapes} B={B} T={T} ({time.perf_counter() - t_start:.0f} s)")
    extra = None
    try:
      row, extra = engine_row(scheme, shapes, B, T, F, log)
    except Exception as e:
      row = dict(scheme=scheme, shapes=shapes, B=B, T=T, status="error",
                 error=f"{type(e).__name__}: {str(e)[:400]}")
      traceback.print_exc()
    run["rows"].append(row)
    save()
    log(table([row]).splitlines()[1])
    if (extra is not None and scheme == "dense" and F.baseline
        and not SHAPES[shapes]["family"] == "olmo2"):
      extra.pop("engine")
      for r in baseline_rows(extra, row, F):
        run["rows"].append(r)
        log(table([r]).splitlines()[1])
      save()
    if (extra is not None and scheme == "dense" and shapes == dense_shapes and B == 1
        and T == prefill_T):
      del extra
      run["rows"].extend(prefill_rows(prefill_T, dense_shapes, F, log))
      save()
    extra = None
  if prefill_T and not F.bytes_only and not any(
      r.get("kind") == "prefill" for r in run["rows"]) and (
      not F.only or "dense" in F.only) and not (
      F.deadline_s and time.perf_counter() - t_start > F.deadline_s):
    run["rows"].extend(prefill_rows(prefill_T, dense_shapes, F, log))
  if F.fits:
    run["rows"].extend(fits_rows(F, log))
    save()

  def emit(r):  # a row saved as soon as it is measured
    run["rows"].append(r)
    save()
  if F.flat:
    log(f"flat: match at {F.flat}, interleaved")
    flat_rows(F, log, emit)
  if F.serve_requests > 0 and not (F.deadline_s and time.perf_counter() - t_start > F.deadline_s):
    log(f"serve {F.serve_requests} requests through {F.serve_slots} slots")
    serve_rows(F, log, emit)
  save()
  log(table(run["rows"]))
  for t in run["targets"]:
    log(f"target {'MET' if t['met'] else 'MISSED'}: {t['name']}")
  for c in run["claims"]:
    log(f"claim {'PASS' if c['passed'] else 'FAIL'}: {c['name']}")
  log(f"wrote {path}")
  return run


if __name__ == "__main__":
  main()
