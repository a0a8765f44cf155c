"""bench/compact_attention.py: its variants (CompactConfig fields) and its CPU-sized modes (--glue,
--hostcost). The recorded GPU results (one H100, one H200) are checked by
tests/bench/test_results.py through their claims (bench/claims/compact_attention.py)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from bench import compact_attention as bench  # noqa: E402
from pallas_kernels.compact_attention import api  # noqa: E402


def test_variant_names_map_to_kernel_configs():
  """Variant suffixes are CompactConfig fields; the kernel name loses them; 'auto' is the kernel
  condattn_jax.ops' resolver picks for this device (the reference on a CPU)."""
  from pallas_kernels.compact_attention import CompactConfig
  assert bench.kernel_impl("triton_scatter") == "triton"
  assert bench.kernel_impl("mosaic_gpu_1wg") == "mosaic_gpu"
  assert bench.kernel_impl("auto_fused") == bench.kernel_impl("auto") == "reference"
  assert bench.variant_config("auto_fused_scatter") == CompactConfig(fused_triton_bwd=True,
                                                                     uncompact_by_gather=False)
  assert bench.variant_config("mosaic_gpu_1wg") == CompactConfig(mgpu_bwd_wgs=1)
  assert bench.variant_config("auto_tbwd") == CompactConfig(bwd_impl="triton")
  assert bench.variant_config("auto_xla_gather") == CompactConfig(glue_kernels=False,
                                                                  uncompact_by_gather=True)
  assert bench.variant_config("triton") == CompactConfig()


def test_glue_parts_runs_and_its_scatters_agree(monkeypatch):
  """bench --glue on small CPU shapes (the Mosaic GPU tiles auto picks on Hopper): every piece
  times, and the hinted scatter it times returns what the library's scatter returns."""
  from pallas_kernels.compact_attention import common
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.compact_attention import compaction as cp
  monkeypatch.setattr(api, "_resolve_impl", lambda *a: (
      "mosaic_gpu", common.MGPU_BLOCK_SIZES, "mosaic_gpu", common.MGPU_BLOCK_SIZES))
  monkeypatch.setattr(bench, "N", 2)
  monkeypatch.setattr(bench, "K", 1)
  row = bench.glue_parts(512, 0.9, 1)
  assert row["bucket"] == 128 and row["active"] <= 128
  # the point breakdown / --order time their kernels on: the bucket, the compacted inputs in it
  # and the loop bounds of the tiles auto resolved to (forward: per compute warpgroup)
  assert bench.auto_point(512, 0.9).C == 512  # auto on a GPU now: one full-T bucket
  pt = bench.auto_point(512, 0.9, xla_glue=True)
  x = pt.prepared()
  bs = common.MGPU_BLOCK_SIZES.for_capacity(128, 512)
  assert pt.C == 128 and x.q_c.shape == (1, 128, 2, bench.H)
  assert x.b_f.shape == (1, 1, 128 // (bs.block_q // 2), 4)
  assert x.b_dq.shape == (1, 1, 128 // bs.block_q_dq, 4)
  assert x.b_dkv.shape == (1, 1, 512 // bs.block_k_dkv, 4)
  assert all(row[k] > 0 for k in row if k.endswith("_ms"))
  idx = jnp.array([[[3, 7, 8, 512, 512]]], jnp.int32)
  x = jnp.arange(5 * 2 * 3, dtype=jnp.float32).reshape(1, 5, 2, 3)
  want = np.zeros((1, 512, 2, 3), np.float32)
  want[0, [3, 7, 8]] = np.asarray(x[0, :3])
  np.testing.assert_array_equal(np.asarray(cp.scatter_rows(x, idx, 512)), want)


def test_host_cost_runs_on_small_cpu_shapes(monkeypatch):
  """bench --hostcost on CPU (the reference for ours, XLA's attention for cuDNN): every variant is
  timed per call and device-bound, host time is their difference, and the kernel counts come from
  the compiled programs (the forward+backward launches more than the forward)."""
  import jax
  monkeypatch.setattr(bench, "N", 2)
  monkeypatch.setattr(bench, "K", 1)
  monkeypatch.setattr(bench, "cudnn_dense", lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True))
  row = bench.host_cost(256, 0.9, 2)
  assert row["T"] == 256 and 0 < row["active"] < 256
  for tag in ("fwd", "fwdbwd", "cudnn_fwd", "cudnn_fwdbwd", "empty_jit"):
    r = row[tag]
    assert r["wall_ms"] > 0 and r["stream_ms"] > 0
    assert r["host_ms"] == pytest.approx(r["wall_ms"] - r["stream_ms"])
  assert row["fwdbwd"]["fusions"] > row["fwd"]["fusions"] > 0
  assert row["speedup_fwd"] == pytest.approx(row["cudnn_fwd"]["wall_ms"] / row["fwd"]["wall_ms"])
