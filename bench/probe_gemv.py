"""Probe (not a recorded bench): how fast one decode step's MLP products stream their weights on
this GPU, XLA's dots against jax's own Mosaic GPU Hopper matmul (jax.experimental.pallas.ops.gpu
.hopper_matmul_mgpu, rows padded to its 64-row tile), 8 distinct weight matrices per call so
that L2 holds none of them. Prints one line per point: us a layer, TB/s, fraction of the card's
HBM bandwidth (bench.decode.bandwidth_tbps)."""
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp

from bench import common, decode
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

L = 8  # distinct weight matrices a call (>= 4x the 50 MB L2 at every shape)
LIMIT = decode.bandwidth_tbps(jax.devices()[0].device_kind, None) * 1e12  # the card's HBM B/s


def weights(K, N, seed):
  keys = jax.random.split(jax.random.key(seed), L)
  return [jax.random.normal(k, (K, N), jnp.bfloat16) * 0.02 for k in keys]


def run(name, f, x, ws):
  step = jax.jit(lambda x, ws: [f(x, w) for w in ws])
  t = common.time_device_bound(step, x, ws, n=20, warmup=2, repeats=5)["median_ms"]
  K, N = ws[0].shape
  us = t * 1e3 / L
  tbs = K * N * 2 / (us * 1e-6) / 1e12
  print(f"{name:60s} {us:8.2f} us/layer {tbs:5.2f} TB/s {tbs * 1e12 / LIMIT:5.2f} of limit",
        flush=True)
  return us


def main():
  print(jax.devices()[0].device_kind, jax.__version__, time.strftime("%F %T"), flush=True)
  for (K, N) in ((1536, 17920), (8960, 1536), (1536, 2048), (3584, 37888)):
    ws = weights(K, N, K + N)
    for M in (1, 8, 64):
      x = jax.random.normal(jax.random.key(M), (M, K), jnp.bfloat16)
      run(f"xla dot M={M} K={K} N={N}", lambda x, w: x @ w, x, ws)
    x64 = jax.random.normal(jax.random.key(0), (64, K), jnp.bfloat16)
    ref = x64 @ ws[0]
    # two warpgroups along N (wg_dimension M would need 128 rows): a CTA covers 2 x tile_n
    for tn, tk, st in itertools.product((64, 128), (64, 128), (4, 8)):
      if N % (2 * tn) or K % tk:
        continue
      cfg = hm.TuningConfig(tile_m=64, tile_n=tn, tile_k=tk, max_concurrent_steps=st,
                            epi_tile_n=64, epi_tile_m=64, wg_dimension=hm.MatmulDimension.N)
      f = functools.partial(hm.matmul, c=None, config=cfg)
      try:
        out = jax.jit(lambda a, b: f(a, b))(x64, ws[0])
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        run(f"mgpu M=64 K={K} N={N} tn={tn} tk={tk} st={st} err={err:.3g}",
            lambda x, w: f(x, w), x64, ws)
      except Exception as e:  # noqa: BLE001 (a probe: report and go on)
        print(f"mgpu tn={tn} tk={tk} st={st}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
  main()
  sys.exit(0)
