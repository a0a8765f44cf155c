"""pallas_kernels.decode_mlp: the reference equals the model's MLP half; the Mosaic GPU (Hopper)
kernels in Pallas' GPU interpret mode equal the reference (bit for bit where float32 sums are
exact: integer data), over several K steps, N tiles and K parts, M in {1, 5, 64}, ragged tiles;
one-line errors naming the argument; the plan keeps each grid resident in one wave (the shared
memory Mosaic GPU allocates, read from an export for an abstract H100); the kernels lower for
cuda from this CPU and impl='auto' picks them for a Hopper only; bench/decode_mlp.py's CPU preset.

The GPU run (kernel == reference on the device, timing against XLA's MLP) is bench/decode_mlp.py.
"""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import decode_mlp as dm
from pallas_kernels.decode_mlp import api, mosaic_gpu as mg
from pallas_kernels.decode_mlp.reference import reference_hidden, silu_mul

BF16 = jnp.bfloat16


def _data(M, D, F, seed=0, dtype=BF16):
  """(x, xn, w_gate, w_up, w_down): activations ~ N(0, 1), weights ~ N(0, 1 / fan_in)."""
  def make(key):
    ks = jax.random.split(key, 5)
    n = lambda k, s, std: (jax.random.normal(k, s, jnp.float32) * std).astype(dtype)
    return (n(ks[0], (M, D), 1.0), n(ks[1], (M, D), 1.0), n(ks[2], (D, F), D ** -0.5),
            n(ks[3], (D, F), D ** -0.5), n(ks[4], (F, D), F ** -0.5))
  return jax.jit(make)(jax.random.PRNGKey(seed))


def _ints(M, D, F, seed=0):
  """Integer data whose float32 sums are exact in any order: xn, weights in {-1, 0, 1} (|g|,
  |u| <= D <= 256: exact in bf16), x in {-4..4}."""
  rng = np.random.default_rng(seed)
  f = lambda lo, hi, s: jnp.asarray(rng.integers(lo, hi + 1, s), BF16)
  return f(-4, 4, (M, D)), f(-1, 1, (M, D)), f(-1, 1, (D, F)), f(-1, 1, (D, F)), f(-1, 1, (F, D))


def _mosaic(args, config):
  return jax.jit(lambda *a: dm.decode_mlp(*a, impl="mosaic_gpu", interpret=True,
                                          config=config))(*args)


# ------------------------------------------------------------------------------------------------
# The reference is the model's MLP
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_reference_is_the_models_mlp_half(dtype):
  """x + models.layers.MLP(xn) (flax nn.Dense in the compute dtype) == reference_decode_mlp on the
  MLP's own weights: within one bf16 unit in the last place of the largest output in bf16 (a
  unit of v is at most 2^-7 |v|; XLA:CPU may round the model's silu * mul between its bf16 ops,
  the reference rounds once), to float32 rounding in float32."""
  import flax.linen as nn
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.layers import MLP
  cfg = ModelConfig(hidden_size=128, intermediate_size=256, dtype=dtype, param_dtype=dtype)
  x, xn, *_ = _data(5, 128, 256, dtype=jnp.dtype(dtype))
  mlp = MLP(cfg)
  params = nn.unbox(mlp.init(jax.random.PRNGKey(3), xn)["params"])
  model = np.asarray(x + jax.jit(mlp.apply)({"params": params}, xn), np.float32)
  ref = np.asarray(dm.reference_decode_mlp(
      x, xn, params["gate_proj"]["kernel"], params["up_proj"]["kernel"],
      params["down_proj"]["kernel"]), np.float32)
  tol = 2.0 ** -7 if dtype == "bfloat16" else 1e-6
  assert np.abs(model - ref).max() <= tol * np.abs(ref).max()


# ------------------------------------------------------------------------------------------------
# The kernels (interpret mode) == the reference
# ------------------------------------------------------------------------------------------------

# (M, D, F, config): each runs both kernels in the interpreter (~3 s)
CASES = [
    # one row; gate/up: 4 K steps through 2 stages (the ring wraps twice), 6 column tiles;
    # down: 6 K steps in 3 parts of 2 (split-K), 4 column tiles
    (1, 256, 384, dm.DecodeMLPConfig(up_stages=2, down_splits=3, down_stages=2)),
    # 5 rows (TMA boxes of 8 rows: 3 read past x / h, stores drop them); ragged tiles: D = 200
    # (a last K step of 8 for gate/up, a last column tile of 8 for down), F = 328 (gate/up
    # column tiles of 128: the last 72 wide; down: a last K step of 8); down parts of 1 and 2
    # steps (floor(s * 6 / 4)) through 2 stages; gate/up's one-stage ring
    (5, 200, 328, dm.DecodeMLPConfig(up_block_n=128, up_stages=1, down_splits=4,
                                     down_stages=2)),
    # a full wgmma M tile (the stages' activation buffers without overlap); K steps of 128 (two
    # swizzle groups a wgmma): gate/up one, down two (one K part) through 2 stages; the plan's
    # gate/up tiles
    (64, 128, 256, dm.DecodeMLPConfig(block_k=128, down_splits=1, down_stages=2)),
]


@pytest.mark.parametrize("M,D,F,config", CASES, ids=[f"M{c[0]}_D{c[1]}_F{c[2]}" for c in CASES])
def test_kernels_match_the_reference_interpret(M, D, F, config):
  """bf16 tolerance: the kernels' float32 sums run in another order than XLA's dot, so a rounding
  of g, u (to bf16) may flip, moving h by one unit in its last place; h's change moves y far less
  than its unit, but y's and then out's own roundings can flip: <= 2 units in the last place of
  the largest output (a unit of v is at most 2^-7 |v|), and almost every element exact."""
  args = _data(M, D, F, seed=M)
  out = np.asarray(_mosaic(args, config), np.float32)
  ref = np.asarray(jax.jit(dm.reference_decode_mlp)(*args), np.float32)
  assert out.shape == (M, D) and np.isfinite(out).all()
  assert np.abs(out - ref).max() <= 2.0 ** -6 * np.abs(ref).max()
  assert (out == ref).mean() >= 0.99


def test_kernels_are_exact_on_integer_data():
  """Where float32 sums are exact in any order (integer data), each kernel equals its stage of
  the reference bit for bit: gate/up's h == round(silu(g) * u) from the exact g, u (the same
  float32 silu: the interpreter evaluates the kernel's jax.nn.silu as XLA does the
  reference's), down's partials sum to h @ Wd exactly. Ragged shapes (D = 200, F = 328) and
  5 rows: the zero-filled reads past the arrays add nothing."""
  M, D, F = 5, 200, 328
  x, xn, wg, wu, wd = _ints(M, D, F)
  h = jax.jit(lambda *a: mg.gate_up(*a, block_n=128, block_k=64, stages=2, interpret=True))(
      xn, wg, wu)
  np.testing.assert_array_equal(np.asarray(h, np.float32),
                                np.asarray(reference_hidden(xn, wg, wu), np.float32))
  hi = jnp.asarray(np.random.default_rng(1).integers(-4, 5, (M, F)), BF16)
  part = jax.jit(lambda *a: mg.down(*a, block_n=64, block_k=64, stages=2, splits=3,
                                    interpret=True))(hi, wd)
  assert part.shape == (3, M, D) and part.dtype == jnp.float32
  want = np.asarray(hi, np.int64) @ np.asarray(wd, np.int64)
  np.testing.assert_array_equal(np.asarray(part).sum(0), want)
  # silu_mul is the reference's one rounding of silu(g) * u
  g = jnp.asarray([[-3.0, 0.0, 2.0, 7.0]], BF16)
  np.testing.assert_array_equal(np.asarray(silu_mul(g, g, BF16), np.float32),
                                np.asarray((jax.nn.silu(g.astype(jnp.float32)) * g.astype(
                                    jnp.float32)).astype(BF16), np.float32))


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def test_bad_calls_raise_one_line_errors_naming_the_argument():
  x, xn, wg, wu, wd = _data(5, 128, 256)
  call = lambda *a, **kw: dm.decode_mlp(*a, **{"impl": "mosaic_gpu", **kw})
  cases = [
      ((x[:, :64], xn, wg, wu, wd), {}, "x_MD has shape (5, 64), expected (5, 128)"),
      ((x, xn, wg, wu[:, :128], wd), {}, "w_up_DF has shape (128, 128), expected (128, 256)"),
      ((x, xn, wg, wu, wd.T), {}, "w_down_FD has shape (128, 256), expected (256, 128)"),
      ((x[None], xn, wg, wu, wd), {}, "x_MD must be 2-D"),
      ((x.astype(jnp.float32), xn, wg, wu, wd), {}, "x_MD dtype float32 != xn_MD dtype"),
      ((x, xn, wg, wu, wd.astype(jnp.float32)), {}, "w_down_FD dtype float32 != the activations'"),
      ((x, xn, wg, wu, wd), dict(impl="triton"), "unknown impl 'triton'"),
      ((x, xn, wg, wu, wd), dict(config=dm.DecodeMLPConfig(block_k=32)),
       "DecodeMLPConfig.block_k=32"),
      ((x, xn, wg, wu, wd), dict(config=dm.DecodeMLPConfig(down_splits=9)),
       "DecodeMLPConfig.down_splits=9: 1..4"),
      ((x, xn, wg, wu, wd), dict(config=dm.DecodeMLPConfig(up_block_n=256)),
       "DecodeMLPConfig.up_block_n=256"),
      ((x, xn, wg, wu, wd), dict(config=dm.DecodeMLPConfig(up_stages=9, up_block_n=128)),
       "DecodeMLPConfig.up_stages=9"),
  ]
  for args, kw, msg in cases:
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
      call(*args, **kw)
    assert "\n" not in str(e.value)
  a = _data(65, 128, 256)
  with pytest.raises(ValueError, match=re.escape("M=65 rows")):
    call(*a)
  why = dm.kernel_support(8, 100, 256, jnp.float32)
  assert "dtype float32" in why and "D=100" in why
  # the reference takes float32, and weights of another dtype (cast as nn.Dense does)
  a32 = _data(5, 128, 256, dtype=jnp.float32)
  assert dm.decode_mlp(*a32, impl="reference").dtype == jnp.float32
  assert dm.decode_mlp(x, xn, wg.astype(jnp.float32), wu, wd, impl="reference").dtype == BF16


# ------------------------------------------------------------------------------------------------
# The plan: one wave, measured on the kernels Mosaic GPU builds
# ------------------------------------------------------------------------------------------------

QWEN = {"1.5b": (1536, 8960), "7b": (3584, 18944)}


def _kernel_smem(fn, *shapes):
  """The shared memory (bytes) Mosaic GPU allocates for the one kernel of `fn`, lowered for cuda
  from this CPU: its bound set to 1 byte (jax.experimental.mosaic.gpu.core._SMEM_SIZE_BOUND, a
  private hook), the lowering's error names the size."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  sds = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
  old = mgpu_core._SMEM_SIZE_BOUND
  mgpu_core._SMEM_SIZE_BOUND = 1
  try:
    with pytest.raises(ValueError, match="exceeds available shared memory") as e:
      jax.export.export(jax.jit(fn), platforms=["cuda"])(*sds)
  finally:
    mgpu_core._SMEM_SIZE_BOUND = old
  return int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))


@pytest.mark.parametrize("model", sorted(QWEN))
@pytest.mark.parametrize("M", [1, 64])
def test_plan_is_one_resident_wave_at_qwen_shapes(model, M):
  """On 132 SMs each kernel's grid is resident at once: ceil(programs / 132) programs per SM fit
  in an SM's 228 KiB with the shared memory Mosaic GPU allocates for them (CUDA reserves 1 KiB a
  block), with 2 stages or more, and the grid covers every SM. At the 1.5B shapes, M = 1:
  gate/up 140 programs of 64 columns, 6 stages, two per SM; down 24 column tiles x 11 K parts =
  264 programs, two per SM."""
  D, F = QWEN[model]
  p = dm.plan(M, D, F, num_sms=132)
  n_up, n_down = p.programs(D, F)
  up = _kernel_smem(lambda x, g, u: mg.gate_up(x, g, u, block_n=p.up_block_n,
                                               block_k=p.block_k, stages=p.up_stages),
                    (M, D), (D, F), (D, F))
  down = _kernel_smem(lambda h, w: mg.down(h, w, block_n=p.down_block_n, block_k=p.block_k,
                                           stages=p.down_stages, splits=p.down_splits),
                      (M, F), (F, D))
  for n, smem, stages in ((n_up, up, p.up_stages), (n_down, down, p.down_stages)):
    per_sm = -(-n // 132)
    assert n >= 132 and stages >= 2, (n, stages)
    assert per_sm * (smem + 1024) <= api.SMEM_PER_SM, (n, smem, per_sm)
  if (model, M) == ("1.5b", 1):
    assert (p.up_block_n, p.up_stages, n_up) == (64, 6, 140)
    assert (p.down_block_n, p.down_splits, n_down) == (64, 11, 264)


# ------------------------------------------------------------------------------------------------
# Lowering for Hopper from this CPU; impl='auto'
# ------------------------------------------------------------------------------------------------

def _mosaic_calls(impl, mesh=None, M=1, model="1.5b"):
  D, F = QWEN[model]
  sds = [jax.ShapeDtypeStruct(s, BF16) for s in ((M, D), (M, D), (D, F), (D, F), (F, D))]
  f = jax.jit(lambda *a: dm.decode_mlp(*a, impl=impl))
  if mesh is None:
    text = jax.export.export(f, platforms=["cuda"])(*sds).mlir_module()
  else:
    with jax.sharding.use_abstract_mesh(mesh):
      text = jax.export.export(f, platforms=["cuda"])(*sds).mlir_module()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  names = [n for n in ("decode_mlp_gate_up_mgpu", "decode_mlp_down_mgpu") if n in text]
  return calls, names


def _mesh(kind):
  return AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind=kind, num_cores=132 if "H100" in kind else 108, platform="gpu"))


def test_kernels_lower_for_hopper_and_auto_picks_them_only_there():
  """impl='mosaic_gpu' lowers for cuda at the Qwen2.5-1.5B (M = 1) and 7B (M = 64) shapes: two
  Mosaic GPU calls, the gate/up and the down kernel (Mosaic GPU's own checks, e.g. wgmma's
  operand layouts, run at this lowering). impl='auto' runs them lowered for an (abstract) H100,
  the reference (no kernel) for an A100 and on this CPU."""
  kernels = (["mosaic_gpu_v2"] * 2, ["decode_mlp_gate_up_mgpu", "decode_mlp_down_mgpu"])
  assert _mosaic_calls("mosaic_gpu") == kernels
  assert _mosaic_calls("mosaic_gpu", M=64, model="7b") == kernels
  assert _mosaic_calls("auto", _mesh("NVIDIA H100 80GB HBM3")) == kernels
  assert _mosaic_calls("auto", _mesh("NVIDIA A100-SXM4-80GB")) == ([], [])
  args = _data(3, 128, 256)
  np.testing.assert_array_equal(np.asarray(dm.decode_mlp(*args), np.float32),
                                np.asarray(dm.reference_decode_mlp(*args), np.float32))
  h100 = api.Platform("cuda", "NVIDIA H100 80GB HBM3")
  assert dm.BACKENDS[0].supports((1, 1536), 8960, BF16, h100) is None
  assert "Hopper" in dm.BACKENDS[0].supports((1, 1536), 8960, BF16,
                                             api.Platform("cuda", "NVIDIA A100-SXM4-80GB"))
  assert "M=80" in dm.BACKENDS[0].supports((80, 1536), 8960, BF16, h100)


# ------------------------------------------------------------------------------------------------
# The bench's CPU preset
# ------------------------------------------------------------------------------------------------

def test_bench_interpret_preset_writes_a_run(tmp_path, capsys):
  """bench/decode_mlp.py --interpret: every variant (XLA's MLP, the jitted reference, the fused
  kernels, one sweep config) checked against the reference and timed, the table printed, the
  run appended (ADOPTION_RULE's verdict recorded: the tiny shapes are not the rule's points, so
  it does not adopt) and the recorded-run claims of bench/claims/decode_mlp.py hold on it; the
  rule claim fails when the stored verdict is changed."""
  import os
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if root not in sys.path:   # as tests/bench/test_results.py: bench/ is imported from the root
    sys.path.insert(0, root)
  from bench import decode_mlp as bench
  run = bench.main(["--interpret", f"--out_dir={tmp_path}"])
  (path,) = tmp_path.glob("decode_mlp_*.json")
  data = json.loads(path.read_text())
  assert data["runs"][-1]["settings"]["name"] == "interpret"
  rows = data["runs"][-1]["rows"]
  assert [r["variant"] for r in rows] == ["xla", "xla_ref", "fused", "sweep:down_splits/2"]
  assert all(r["within_tol"] and r["us"] > 0 and r["bytes"] == dm.bytes_read(5, 128, 192)
             for r in rows)
  from bench.claims import ClaimFailed
  from bench.claims import decode_mlp as mlp_claims
  stored = data["runs"][-1]
  mlp_claims.every_kernel_variant_within_bf16_tolerance(None, stored)
  mlp_claims.adoption_is_the_registered_rule_on_the_stored_rows(None, stored)
  stored["adoption"]["adopt"] = True
  with pytest.raises(ClaimFailed):
    mlp_claims.adoption_is_the_registered_rule_on_the_stored_rows(None, stored)
  assert run["adoption"]["adopt"] is False and "not measured" in run["adoption"]["failed"][0]
  out = capsys.readouterr().out
  assert "ADOPTION_RULE" in out and "sweep:down_splits/2" in out
  # the rule on made-up rows: 1.2x at M = 1, 1.1x at M = 8 fails; both >= 1.15x adopts
  mk = lambda M, v, us: dict(shapes="qwen2.5-1.5b", M=M, variant=v, us=us, within_tol=True)
  rows = [mk(1, "xla", 12.0), mk(1, "fused", 10.0), mk(8, "xla", 11.0), mk(8, "fused", 10.0)]
  got = bench.adoption(rows)
  assert not got["adopt"] and "M=8: 1.100x < 1.15x" in got["failed"][0]
  rows[2]["us"] = 11.5
  assert bench.adoption(rows)["adopt"]
