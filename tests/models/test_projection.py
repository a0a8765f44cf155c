"""models.layers.Projection's decode contraction of o_proj (issue 33): one token a row contracts
the [N, H, D] kernel batched over N (`_contract_heads`), never through a [N*H, D] view of it."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from bench import decode as bd
from bench import decode_program as dp
from condattn_jax.models import layers


def _plain(x, w):
  """The previous decode contraction: [..., N*H] x [N*H, D] (2-D views), in x's dtype."""
  return lax.dot_general(x.reshape(x.shape[:-2] + (-1,)), w.reshape(-1, w.shape[-1]),
                         (((x.ndim - 2,), (0,)), ((), ())))


@pytest.mark.parametrize("B", [1, 3])
def test_o_proj_of_one_token_a_row_equals_the_plain_contraction(B):
  """Projection(kernel [N, H, D]) on x [B, 1, N, H] (a decode step; B = 1 through the 2-row
  operand) equals the two-dim contraction over (N, H): float32 to 1e-6; bfloat16 within one
  rounding of the float32 result (both accumulate in float32). A wrong batch axis or a missing
  sum over N fails by O(1)."""
  N, H, D = 4, 16, 24
  proj = layers.Projection((N, H, D), ("q_heads", "head_dim", "embed"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
  params = proj.init(jax.random.key(0), x)
  w = params["params"]["kernel"].value if hasattr(params["params"]["kernel"], "value") else \
      params["params"]["kernel"]
  got = proj.apply(params, x)
  ref = jnp.einsum("btnh,nhd->btd", x, w, precision="highest")
  assert got.shape == (B, 1, D)
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got, _plain(x, w), rtol=1e-6, atol=1e-6)
  # bfloat16 compute: within a bf16 rounding of the float32 value of the same bf16 inputs
  pb = dataclasses.replace(proj, dtype=jnp.bfloat16)
  got16 = np.asarray(pb.apply(params, x), np.float32)
  x16, w16 = x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
  ref16 = np.asarray(jnp.einsum("btnh,nhd->btd", x16, w16, precision="highest"))
  np.testing.assert_allclose(got16, ref16, rtol=2 ** -8, atol=1e-6)
  # the training / prefill path (several tokens a row) is the plain contraction, unchanged
  x2 = jnp.asarray(rng.standard_normal((B, 3, N, H)), jnp.float32)
  np.testing.assert_allclose(proj.apply(params, x2),
                             jnp.einsum("btnh,nhd->btd", x2, w, precision="highest"),
                             rtol=1e-6, atol=1e-6)


def _o_proj_views(text, cfg):
  """Reshapes in an exported program that view an o_proj kernel [N, H, D] as [N*H, D]."""
  N, H, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
  pat = (rf"stablehlo\.reshape %\S+ : \(tensor<{N}x{H}x{D}xbf16>\) -> "
         rf"tensor<{N * H}x{D}xbf16>")
  return re.findall(pat, text)


def test_h100_decode_program_contracts_o_proj_without_a_merged_kernel_view(monkeypatch):
  """The engine's decode program exported for an abstract H100 (tiny-qwen, bf16, 3 layers on
  stacked params): o_proj's kernel slice reaches its dot as [N, H, D] (batched over N, H
  contracted): no reshape of a kernel to [N*H, D], one batched dot_general a layer. The
  previous contraction (patched back in) shows the merged view once a layer, so the check can
  fail."""
  cfg, _ = bd.scheme_config("dense", "tiny-qwen", 64)
  cfg = dataclasses.replace(cfg, num_layers=3, dtype="bfloat16", param_dtype="bfloat16")
  text = dp.exported_text("engine", cfg, 1, 64)
  assert _o_proj_views(text, cfg) == []
  batched = re.findall(r"stablehlo\.dot_general .*batching_dims = \[0\] x \[0\], "
                       r"contracting_dims = \[2\] x \[1\]", text)
  assert len(batched) == cfg.num_layers
  monkeypatch.setattr(layers, "_contract_heads", _plain)
  jax.clear_caches()
  try:
    old = dp.exported_text("engine", cfg, 1, 64)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert len(_o_proj_views(old, cfg)) == cfg.num_layers
