"""bench/decode_program.py: what one decode step runs, per layer (issue 33's fixed per-step cost),
and the split-parameter layout of the decoder's unrolled decode mode."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import decode as bd
from bench import decode_program as dp
from condattn_jax.inference import Engine
from condattn_jax.models import stacking

HLO = """HloModule m, entry_computation_layout={()->f32[8]{0}}

%fused_copy (p0: f32[4,8]) -> f32[8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %s = f32[1,8]{1,0} slice(%p0), slice={[1:2], [0:8]}
  ROOT %b = f32[8]{0} bitcast(%s)
}

%fused_add (p0: f32[8], p1: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  ROOT %a = f32[8]{0} add(%p0, %p1)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %f = f32[8]{0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %u = f32[8]{0} dynamic-update-slice(%f, %x, %i)
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %u)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%yes (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %g = f32[8]{0} custom-call(%x), custom_call_target="__cublas$gemm"
}

%no (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%x)
}

ENTRY %main () -> f32[8] {
  %w = f32[4,8]{1,0} constant({...})
  %k = f32[8]{0} fusion(%w), kind=kLoop, calls=%fused_copy
  %m = f32[8]{0} custom-call(%k), custom_call_target="mosaic_gpu_v2"
  %d = f32[8]{0} fusion(%m, %k), kind=kCustom, calls=%fused_add, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %z = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%z, %d)
  %l = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[8]{0} get-tuple-element(%l), index=1
  %p = pred[] constant(true)
  ROOT %o = f32[8]{0} conditional(%p, %x, %x), true_computation=%yes, false_computation=%no
}
"""


def test_op_histogram_counts_each_kernel_per_execution():
  """Fusions by kind, custom calls by target, loop bodies times their trip count, both branches
  of a conditional, plumbing left out; copy_bytes = the slice fusion's and the copy's results."""
  h = dp.op_histogram(HLO)
  assert h == {"fusion:loop": 1 + 3, "fusion:__triton_gemm": 1, "custom-call:mosaic_gpu_v2": 1,
               "dynamic-update-slice": 3, "while": 1, "conditional": 1,
               "custom-call:__cublas$gemm": 1, "copy": 1, "copy_bytes": 32 + 32,
               "launches": 4 + 1 + 1 + 3 + 1 + 1}
  per, fixed = dp.split_layers({"dot": 9, "copy": 1}, 2, {"dot": 13, "copy": 1}, 3)
  assert per == {"dot": 4} and fixed == {"dot": 1, "copy": 1}
  with pytest.raises(ValueError, match="no ENTRY computation"):
    dp.op_histogram("HloModule m")


def _tiny(layers, dtype="float32"):
  cfg, _ = bd.scheme_config("dense", "tiny-qwen", 64)
  return dataclasses.replace(cfg, num_layers=layers, dtype=dtype, param_dtype=dtype)


def test_split_params_decode_the_same_and_copy_no_weights():
  """Engine decode with the params in split_groups' layout == the stacked layout (logits and
  caches bit for bit), and its compiled step (CPU, float32: no bf16 widening) copies no
  weights: the stacked layout's step moves exactly every layer's matmul weights more."""
  cfg = _tiny(2)
  params = bd.init_params(cfg)
  split = stacking.split_groups(params)
  assert isinstance(split["layers"], tuple) and len(split["layers"]) == 2
  assert stacking.split_groups(split) is not split and stacking.split_groups(split)["layers"] \
      is split["layers"]
  rng = np.random.default_rng(0)
  eng = Engine(cfg, params, cache_len=64)
  cache = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype)
                       if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype),
                       eng.cache_shapes(2))
  cache = jax.tree_util.tree_map_with_path(
      lambda p, x: (jnp.full(x.shape, 40, x.dtype) if p[-1].key == "length" else
                    jnp.broadcast_to(jnp.arange(64) < 40, x.shape).astype(x.dtype)
                    if p[-1].key == "valid" else
                    jnp.broadcast_to(jnp.arange(64), x.shape).astype(x.dtype)
                    if p[-1].key == "positions" else x), cache)
  args = (jnp.asarray([3, 7]), jnp.asarray([40, 40]), jnp.asarray([True, True]),
          jnp.zeros((2, cfg.vocab_size), jnp.float32))
  c1, l1 = eng.decode_step(jax.tree.map(jnp.copy, cache), *args)
  c2, l2 = Engine(cfg, split, cache_len=64).decode_step(cache, *args)
  np.testing.assert_array_equal(l1, l2)
  jax.tree.map(np.testing.assert_array_equal, c1, c2)
  with pytest.raises(ValueError, match="holds 2 layers"):
    Engine(_tiny(3), split, cache_len=64).decode_step(Engine(_tiny(3), params, cache_len=64)
                                                       .init_cache(2), *args)

  # the two layouts' compiled steps (2 layers): the stacked one copies each layer's matmul
  # weights (its slices of the stacked leaves) every step, the split one none of them
  h = {p: dp.op_histogram(dp.compiled_text(p, cfg, 1, 64)) for p in ("engine", "engine_split")}
  kernel_bytes = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(split["layers"])
                     if path[-1].key == "kernel")
  assert h["engine"]["copy_bytes"] - h["engine_split"]["copy_bytes"] == kernel_bytes
  assert h["engine_split"]["launches"] < h["engine"]["launches"]
  # the same matmuls (XLA:CPU runs the 2-row one-token projections as XNNPACK fusions)
  mm = lambda x: x["dot"] + x.get("fusion:__ynn_fusion", 0)
  assert mm(h["engine"]) == mm(h["engine_split"]) >= 2 * 7


def test_h100_export_runs_one_cudnn_call_per_layer():
  """The engine's decode program exported for an abstract H100 (cuDNN decode path as on the
  card): per layer exactly one cuDNN attention call, the 7 projections' dots, the one-token
  cache writes as dynamic-update-slices (no scatter: XLA:GPU expands a one-index scatter into
  a bounds check + old-value select): key and value per layer, positions and valid once (the
  bookkeeping lives in layer 0's cache), 4 reductions (2 norms, the split-KV merge's max and
  its one weighted sum); the logits' dot once; no loop or Pallas call."""
  h = {n: dp.stablehlo_histogram(dp.exported_text("engine", _tiny(n, "bfloat16"), 1, 64))
       for n in (2, 3)}
  per, fixed = dp.split_layers(h[2], 2, h[3], 3)
  assert per["custom_call:__cudnn$fmhaSoftmax"] == 1
  assert per["stablehlo.dot_general"] == 7 and fixed["stablehlo.dot_general"] == 1
  assert per["stablehlo.dynamic_update_slice"] == 2 and "stablehlo.scatter" not in h[3]
  assert fixed["stablehlo.dynamic_update_slice"] == 2
  # the fill comes from layer 0's length counter once a step: no reduction over the valid slots
  # per layer (one more when attend counted it from kv_segment_ids_BS; one more when the
  # one-token write counted the chunk's valid tokens)
  assert per["stablehlo.reduce"] == 4
  assert not any(k in h[3] for k in ("stablehlo.while", "custom_call:mosaic_gpu_v2",
                                     "custom_call:__gpu$xla.gpu.triton"))


def test_h100_export_of_l2a_writes_its_ring_in_place():
  """`table(..., scheme='l2a', export='cuda')` (--scheme): L2A's decode step exported for an
  abstract H100 runs two cuDNN decode calls a layer (the local ring read after its write, the
  global cache) and writes both caches with one in-place update per array (the ring's one-token
  write included: no scatter, each ring array's slot read back for an inactive row)."""
  t = dp.table("engine", "tiny-qwen", 1, 256, export="cuda", full=False, scheme="l2a")
  per = t["per_layer"]
  assert t["scheme"] == "l2a" and per["custom_call:__cudnn$fmhaSoftmax"] == 2
  assert per["stablehlo.dynamic_update_slice"] == 8 and per["stablehlo.dynamic_slice"] == 4
  assert "stablehlo.scatter" not in per
  with pytest.raises(ValueError, match="dense only"):
    dp.table("xla_per_layer", "tiny-qwen", 1, 256, scheme="l2a")


def _check(scheme, T, default, refattn, mgpu, same=True):
  """A synthetic fp32_check result: rel_err against float32 per program; default vs refattn."""
  d = lambda e, s=True: dict(rel_err=e, max_abs_err=e, same_argmax=s,
                             vs_default=dict(rel_err=0.0, max_abs_err=0.0, same_argmax=True))
  return dict(scheme=scheme, T=T, status="ok", default=d(default), refattn=d(refattn),
              mgpu=d(mgpu, same), default_vs_refattn=dict(rel_err=abs(refattn - default) * 1.4,
                                                          max_abs_err=0.0, same_argmax=True))


def test_rule_check_and_the_fp32_logits_test():
  """rule_check: ADOPTION_RULE's bound is sane iff the two bf16 programs (default, refattn) differ
  by <= max_rel_err at every measured point (error rows are skipped; none measured: None);
  fp32_logits_test: a candidate within factor x the default's float32 error + slack, argmax
  kept where the default keeps it."""
  ok = _check("dense", 8192, 0.02, 0.025, 0.021)       # 0.007 apart: within 1e-2
  bad = _check("l2a", 8192, 0.02, 0.06, 0.021)         # 0.056 apart
  err = dict(scheme="l2a", T=131072, status="error", error="OOM")
  assert dp.rule_check([ok, err])["sane"] is True
  got = dp.rule_check([ok, bad, err])
  assert got["sane"] is False and [p["scheme"] for p in got["failed"]] == ["l2a"]
  assert dp.rule_check([err])["sane"] is None
  rule = dict(factor=1.1, slack=1e-3)
  assert dp.fp32_logits_test(ok, "mgpu", rule)["passed"]          # 0.021 <= 0.023
  assert not dp.fp32_logits_test(_check("d", 1, 0.02, 0.02, 0.0235), "mgpu", rule)["passed"]
  assert not dp.fp32_logits_test(_check("d", 1, 0.02, 0.02, 0.01, same=False), "mgpu",
                                 rule)["passed"]              # argmax lost where the default kept it


def test_fp32_check_alone_records_the_run(tmp_path):
  """--fp32_check without --ab (CPU, tiny shapes): every program's logits against float32, the
  table, the run recorded with rule_check's verdict; on CPU auto runs the reference, so 'mgpu'
  and 'refattn' equal the default, which is a bf16 distance from float32 (not zero, under 0.1)."""
  from bench import common
  rows = dp.main(["--fp32_check=l2a", "--fp32_variants=refattn,mgpu", "--shapes=tiny-qwen",
                  "--T=64", f"--out_dir={tmp_path}", "--name=t"])
  (c,) = rows
  assert c["status"] == "ok" and c["mgpu"]["vs_default"]["rel_err"] == 0.0
  assert 1e-4 < c["default"]["rel_err"] < 0.1 and c["default"]["same_argmax"]
  (run,) = common.load(common.result_path("decode_program", str(tmp_path)))["runs"]
  assert run["settings"]["mode"] == "fp32_check" and run["rows"][0]["T"] == 64
  assert run["rule_check"]["sane"] is True and run["mgpu_fp32_logits_test"][0]["passed"]
  assert run["claims"] == []  # the registered claims are d_fp32_check's (bench/claims)
