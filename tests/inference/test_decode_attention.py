"""Decode attention over a full cache with per-row fill (ops.MaskSpec.kv_lengths_B): the mask
builder honours the fill, and the cuDNN decode path's GQA folding (query group -> query rows,
kv length = the row's fill, 1 slot and zeros for an inactive row) equals the reference on CPU
(through jax.nn.dot_product_attention's XLA implementation; tests/gpu/test_decode_gpu.py runs
cuDNN itself)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from condattn_jax import ops

B, S, K, G, H = 3, 40, 2, 3, 16


def _case(seed, active=None):
  """(q, k, v, mask) drawn in one jitted program (eagerly every op compiles on its own)."""
  return _case_jit(seed, None if active is None else jnp.asarray(active))


@functools.partial(jax.jit, static_argnums=0)
def _case_jit(seed, active):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, 1, K * G, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32)
  lengths = jnp.asarray([S, 17, 1], jnp.int32)
  slot = jnp.arange(S, dtype=jnp.int32)[None]
  valid = (slot < lengths[:, None]).astype(jnp.int32)
  mask = ops.MaskSpec(q_positions_BT=(lengths - 1)[:, None], kv_positions_BS=jnp.broadcast_to(
      slot, (B, S)), kv_segment_ids_BS=valid, active=active, kv_lengths_B=lengths)
  # garbage past the fill: must never be read into the result
  k = jnp.where(valid[..., None, None] == 1, k, 1e4)
  v = jnp.where(valid[..., None, None] == 1, v, 1e4)
  return q, k, v, mask


@jax.jit
def _reference(q, k, v, mask):
  return ops.attention(q, k, v, mask, impl="reference")


@functools.lru_cache(maxsize=None)
def _folded(splits):
  """ops' cuDNN decode path with jax.nn.dot_product_attention's XLA implementation, jitted."""
  return jax.jit(ops._cudnn_decode(None, implementation="xla", splits=splits))


@pytest.mark.parametrize("active", [None, [True, False, True]])
def test_folded_decode_equals_the_reference(active):
  act = None if active is None else jnp.asarray(active)[:, None]
  q, k, v, mask = _case(0, act)
  assert not ops.decode_reasons(q.astype(jnp.bfloat16), mask)
  ref = _reference(q, k, v, mask)
  out = _folded(None)(q, k, v, mask)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
  if active is not None:
    assert float(jnp.abs(out[1]).max()) == 0.0  # the inactive row: zeros


def test_fill_bounds_the_mask_and_decode_reasons_name_the_field():
  q, k, v, mask = _case(1)
  # slots past the fill are invisible even when the validity ids say otherwise
  loose = jax.tree.map(lambda x: x, mask)
  object.__setattr__(loose, "kv_segment_ids_BS", jnp.ones((B, S), jnp.int32))
  np.testing.assert_allclose(_reference(q, k, v, loose), _reference(q, k, v, mask), atol=1e-6)
  assert any("kv_lengths_B" in r for r in ops.decode_reasons(
      q, ops.MaskSpec(q_positions_BT=mask.q_positions_BT, kv_positions_BS=mask.kv_positions_BS)))
  with pytest.raises(ValueError, match="kv_lengths_B"):
    ops.attention(q, k, v, ops.MaskSpec(q_positions_BT=mask.q_positions_BT,
                                        kv_positions_BS=mask.kv_positions_BS,
                                        kv_lengths_B=jnp.zeros((B, 1), jnp.int32)))


@pytest.mark.parametrize("splits", [4, 8])
def test_split_kv_combines_like_one_pass(splits):
  """The kv length split into parts (rows 0 / 2 span several parts, row 1 ends inside one,
  later parts empty) and merged by log-sum-exp (pallas_kernels.decode.merge_decode_parts, the
  lse in cuDNN's layout) == the reference; the inactive row 2 gives zeros."""
  q, k, v, mask = _case(2, jnp.asarray([True, True, False])[:, None])
  ref = _reference(q, k, v, mask)
  out = _folded(splits)(q, k, v, mask)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
  assert float(jnp.abs(out[2]).max()) == 0.0
  assert ops.decode_splits(1, 32896, 2) == 128 and ops.decode_splits(8, 32896, 2) == 16
  assert ops.decode_splits(1, 100, 2) == 1
  # no power of two above 1 divides 32907 slots: its largest divisor within the same bounds
  assert ops.decode_splits(1, 32907, 2) == 21 and ops.decode_splits(1, 32909, 2) == 1  # prime


def test_an_engine_warns_of_a_cache_no_part_count_divides(monkeypatch):
  """On a GPU, Engine(cache_len=) that ops.decode_splits cannot split (a long prime length)
  warns in one line, naming the length and one that splits; a length that splits, or a short
  one, or a CPU backend: no warning."""
  import warnings
  from condattn_jax.inference import Engine
  from condattn_jax.inference import engine as engine_mod
  from condattn_jax.models.config import ModelConfig
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    Engine(cfg, None, cache_len=32909)             # this backend (CPU): no GPU path, no warning
    monkeypatch.setattr(engine_mod, "_on_gpu", lambda: True)
    for n in (32896, 32907, 1031):                 # splits 128 / 21 ways; short
      Engine(cfg, None, cache_len=n)
  with pytest.warns(UserWarning, match=r"cache_len=32909\).*cache_len=33024"):
    Engine(cfg, None, cache_len=32909)


_KNOBS = dict(match=dict(window=128, chunk=128, top_k=2),
              elastic=dict(block=128, sinks=128, local=256))


@pytest.mark.parametrize("scheme,platform", [
    ("match", "cuda"), ("elastic", "cuda"),
    pytest.param("match", "tpu", marks=pytest.mark.slow),
    pytest.param("elastic", "tpu", marks=pytest.mark.slow)])
def test_decode_step_runs_the_decode_kernel(scheme, platform):
  """A decode step (one token per row) exported for an (abstract) H100 runs the Mosaic GPU
  decode kernel: MATCH's window + retrieved chunks (not the prefill-shaped path, a tile of
  `chunk` query rows of which one is real), Elastic's per-head block lists over the full cache
  (FA heads full, SSA heads their sink + local blocks; not the block-sparse kernel with one
  query padded to a tile). For a TPU (slow: by default ops' TPU choice is checked on Elastic's
  decode mask in tests/kernels/test_decode_kernel.py) the Mosaic TPU decode kernel (head_dim
  128; at 64 with 2 kv heads it declines and ops takes another path)."""
  import flax.linen as nn
  from jax.sharding import AbstractDevice, AbstractMesh

  from condattn_jax import attention
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  base = ModelConfig(family="qwen3", qk_norm="head", num_layers=2, vocab_size=64, hidden_size=128,
                     num_heads=4, num_kv_heads=2, head_dim=64 if platform == "cuda" else 128,
                     dtype="bfloat16")  # Mosaic TPU: head_dim a multiple of 128 (kernel_support)
  device = (AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
            if platform == "cuda" else
            AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
  mesh = AbstractMesh((1,), ("x",), abstract_device=device)
  knobs = _KNOBS[scheme]
  B, L = 2, 1024
  i32 = lambda s: jax.ShapeDtypeStruct(s, jnp.int32)
  m = Decoder(attention.configure(base, scheme, **knobs))
  params = jax.eval_shape(lambda t: nn.unbox(m.init(jax.random.PRNGKey(0), t)),
                          jnp.zeros((1, 8), jnp.int32))["params"]
  cache = jax.eval_shape(lambda p, t: m.apply({"params": p}, t, decode=True, cache_len=L,
                                              unroll_layers=True, mutable=["cache"])[1]["cache"],
                         params, i32((B, 1)))

  def step(p, c, t, pos, valid, P):
    return m.apply({"params": p, "cache": c}, t, pos, valid, decode=True, cache_len=L,
                   fields={"prompt_len_B": P}, unroll_layers=True, mutable=["cache"])[0]
  cudnn = jax.export.DisabledSafetyCheck.custom_call("__cudnn$fmhaSoftmax")
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=[cudnn])(
        params, cache, i32((B, 1)), i32((B, 1)), i32((B, 1)), i32((B,))).mlir_module()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  kernel = "decode_attention_mgpu" if platform == "cuda" else "decode_attention_tpu"
  assert sum(kernel in c for c in calls) >= 1, [c[:120] for c in calls]
  assert not any("block_sparse" in c for c in calls), [c[:120] for c in calls]
