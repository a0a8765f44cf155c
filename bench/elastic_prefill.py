"""Elastic FA-SSA prefill vs dense, whole layers (issue 13's target: >= 1.5x dense at 64K with
Omega = 0.7), on one GPU.

    python -m bench.elastic_prefill                     # T = 65536, 5 Qwen3-8B-shaped layers
    python -m bench.elastic_prefill --preset=test       # tiny CPU shapes (tests)

Rows, timed in the same process (2 warm-ups, median of n, block_until_ready):
  dense        the dense decoder's forward over one row of T tokens (attention: ops 'auto',
               cuDNN causal on a GPU)
  elastic_<O>  the same weights converted to Elastic FA-SSA with routing 'fixed': a static
               split with round((1 - O) * K) FA KV heads (every query head of an SSA KV head
               sees 128 sinks + 2048 local tokens). The layer's attention is ONE block-sparse
               launch over all heads (dense_full_heads=False); the router still runs.
  elastic_<O>_split  the same with dense_full_heads=True: the FA KV heads gathered into one
               cuDNN call whose head count is picked at run time from the decisions (lax.switch
               over K + 1 variants: what a learned router drives too), the SSA heads in the
               block-sparse launch.
What is timed is the prefill's compute: the forward of every layer over the T tokens and the
final norm, returning the last position's hidden state (no KV-cache writes: both rows skip
them alike). Omega = fraction of KV heads in SSA; with 8 KV heads a layer has 0.625 or 0.75, and
Omega 0.7 over the model is 3 layers at 0.75 and 2 at 0.625 (5 layers; fa_heads()).
Per-layer shapes are Qwen3-8B's (hidden 4096, 32 q / 8 kv heads of 128, MLP 12288) and bf16;
the number of layers does not change the ratio (every layer is the same work), the embedding
and the head are left out (vocab 1024).
Appends a run to <out_dir>/elastic_prefill_<device>.json (bench/common.py's schema; device, jax
version, date, settings; the claims bench/claims/elastic_prefill.py registers recorded on it).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
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

from condattn_jax.attention import configure, convert, elastic, options  # noqa: E402
from condattn_jax.models.config import ModelConfig  # noqa: E402
from condattn_jax.models.decoder import Decoder  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Settings:
  T: int = 65536
  layers: int = 5
  hidden: int = 4096
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  mlp: int = 12288
  vocab: int = 1024
  dtype: str = "bfloat16"
  omegas: tuple = (0.625, 0.7, 0.75)
  splits: tuple = (False, True)    # dense_full_heads
  sinks: int = 128
  local: int = 2048
  block: int = 128
  n: int = 5


PRESETS = {
    "gpu": Settings(),
    "test": Settings(T=64, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, mlp=64,
                     vocab=64, dtype="float32", omegas=(0.5,), sinks=8, local=16, block=16, n=1),
}


def configs(s: Settings) -> dict:
  base = ModelConfig(family="qwen3", qk_norm="head", vocab_size=s.vocab, hidden_size=s.hidden,
                     intermediate_size=s.mlp, num_layers=s.layers, num_heads=s.heads,
                     num_kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=s.dtype,
                     param_dtype=s.dtype)
  out = {"dense": base}
  for om in s.omegas:
    for split in s.splits:
      out[f"elastic_{om}" + ("_split" if split else "")] = configure(
          base, "elastic", modes="fa_ssa", routing="fixed", fixed_fa_kv_heads=fa_heads(s, om),
          sinks=s.sinks, local=s.local, block=s.block, dense_full_heads=split)
  return out


def fa_heads(s: Settings, omega: float):
  """fixed_fa_kv_heads for an Omega (fraction of SSA KV heads) over the model: one tuple when
  omega * K is whole, else per layer, mixing floor / ceil SSA counts so that the mean is omega
  (exact when omega * K * layers is whole, e.g. 0.7 with K = 8 and 5 layers)."""
  x = omega * s.kv_heads
  lo = int(np.floor(x + 1e-9))
  if abs(x - lo) < 1e-9:
    return tuple(range(s.kv_heads - lo))
  n_hi = int(round((x - lo) * s.layers))       # layers with lo + 1 SSA heads
  return tuple(tuple(range(s.kv_heads - lo - (layer < n_hi))) for layer in range(s.layers))


def omega_of(s: Settings, heads) -> float:
  sets = elastic.fixed_fa_head_sets(heads, s.layers)
  return 1 - sum(len(h) for h in sets) / (s.kv_heads * len(sets))


def _median_ms(f, *args, n: int) -> float:
  for _ in range(2):
    jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(ts)


def _fwd_sub_tile() -> int:
  from pallas_kernels.block_sparse import api
  return api.TRITON_FWD_SUB_TILE


def run(s: Settings, log=print) -> dict:
  cfgs = configs(s)
  tok = jax.random.randint(jax.random.PRNGKey(1), (1, s.T), 1, s.vocab, jnp.int32)
  dense_p = nn.unbox(jax.jit(Decoder(cfgs["dense"]).init)(jax.random.PRNGKey(0), tok[:, :8])
                     ["params"])
  rows, lasts = [], {}
  for name, cfg in cfgs.items():
    params = dense_p if name == "dense" else convert(dense_p, cfgs["dense"], "elastic",
                                                         **dict(cfg.scheme_kwargs))[1]
    model = Decoder(cfg)
    f = jax.jit(lambda p, t, m=model: m.apply({"params": p}, t, return_hidden=True)[0][:, -1])
    t0 = time.perf_counter()
    last = jax.block_until_ready(f(params, tok))
    row = dict(row=name, compile_and_first_s=round(time.perf_counter() - t0, 2),
               finite=bool(np.isfinite(np.asarray(last, np.float32)).all()))
    if name != "dense":
      o = options(cfg)
      heads = o.fixed_fa_kv_heads
      row.update(omega=round(omega_of(s, heads), 6), dense_full_heads=o.dense_full_heads,
                 fa_kv_heads=json.loads(json.dumps(heads)))  # tuples -> lists
    last = np.asarray(last, np.float32)
    lasts[name] = last
    if name.endswith("_split"):  # same math as the fused row: record how close
      ref = lasts[name[:-len("_split")]]
      row["rel_diff_vs_fused"] = float(np.max(np.abs(last - ref)) / np.max(np.abs(ref)))
    row["ms"] = _median_ms(f, params, tok, n=s.n)
    rows.append(row)
    log(json.dumps(row))
    del params
  dense_ms = rows[0]["ms"]
  for r in rows[1:]:
    r["speedup_vs_dense"] = dense_ms / r["ms"]
  return dict(bench="elastic_prefill", settings=dataclasses.asdict(s),
              device=jax.devices()[0].device_kind, platform=jax.default_backend(),
              jax_version=jax.__version__, triton_fwd_sub_tile=_fwd_sub_tile(),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              timing=f"median of {s.n} after 2 warm-ups, same process", rows=rows)


FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "gpu", sorted(PRESETS), "settings preset (test: tiny CPU shapes)",
                  flag_values=FLAGS)
flags.DEFINE_integer("T", None, "tokens of the row (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer("layers", None, "decoder layers (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer("fwd_sub_tile", 0, "block-sparse Triton forward kv sub-tile (0: the api's "
                     "default)", flag_values=FLAGS)


def main(argv=None) -> int:
  """`python -m bench.elastic_prefill [--flags]`; argv: a list of flags (tests), None: sys.argv."""
  a = common.parse_flags(FLAGS, argv)
  s = PRESETS[a.preset]
  s = dataclasses.replace(s, **{k: v for k, v in (("T", a.T), ("layers", a.layers)) if v})
  if a.fwd_sub_tile:
    from bench.block_sparse import set_fwd_sub_tile
    set_fwd_sub_tile(a.fwd_sub_tile, s.block)
  if a.preset == "gpu" and jax.default_backend() not in ("gpu", "cuda", "rocm"):
    print("preset 'gpu' needs a GPU (use --preset test on CPU)")
    return 2
  res = run(s)
  path = common.result_path("elastic_prefill", a.out_dir, res["device"])
  common.write_result(path, "elastic_prefill", res, name=a.preset)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
