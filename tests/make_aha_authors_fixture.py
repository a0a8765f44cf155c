"""Writes tests/fixtures/aha_authors/: a tiny random OLMo-2 AHA checkpoint in the router layout
of the vLLM-AHA modelling code, and its logits (AHA import / export parity).

The authors' AHA inference code is vLLM's olmo2_aha.py ("Adapted from OLMo2 for All-or-Here
Attention (AHA)", Olmo2AHAForCausalLM, loading https://huggingface.co/xuan-luo/AHA-OLMO2). vLLM
cannot run on a CPU, so `forward` below is a line-by-line float64 transcription of its
Olmo2AHAAttention / Olmo2AHADecoderLayer / Olmo2AHAModel forward in plain torch (nothing of
this library): q_proj yields [q (N*H) | gate (N)]; q_norm over the whole q (N*H), k_norm over
K*H; neox-style RoPE; full causal attention and a causal window of LOCAL_WINDOW_SIZE = 128 on the
same q/k/v; per (token, head) sigmoid(gate) > 0.5 takes the full output, else the window's;
o_proj; OLMo-2 post-norms (post_attention_layernorm / post_feedforward_layernorm on the branch
outputs); final norm; lm_head. Runs in the Python 3.11 torch venv (tests/make_hf_fixtures.py):

  .venv311/bin/python tests/make_aha_authors_fixture.py

Outputs (read by tests/export/test_aha_authors_parity.py with numpy only):
  config.json        the OLMo-2 config, architectures ['Olmo2AHAForCausalLM']
  model.safetensors  float32 weights under the OLMo-2 names, q_proj.weight [N*H + N, D]
  expected.npz       input_ids int32 [2, 160] (longer than the 128-token window);
                     logits f32 [2, 160, V] (float64 forward); gates int32 [L, 2, 160, N]
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "aha_authors")
LOCAL_WINDOW_SIZE = 128
CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
           max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
           model_type="olmo2", architectures=["Olmo2AHAForCausalLM"], hidden_act="silu",
           torch_dtype="float32")


def rms(x, w, eps):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # x [B, T, n, H], neox style (rotate halves)
  H = x.shape[-1]
  inv = 1.0 / (theta ** (torch.arange(0, H, 2, dtype=torch.float64) / H))
  ang = pos[:, :, None].double() * inv  # [B, T, H/2]
  cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]
  x1, x2 = x[..., :H // 2], x[..., H // 2:]
  return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(q, k, v, window=None):  # q [B, T, N, H], k / v [B, T, K, H]
  B, T, N, H = q.shape
  g = N // k.shape[2]
  k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
  s = torch.einsum("btnh,bsnh->bnts", q, k) / H ** 0.5
  i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
  ok = j <= i
  if window is not None:
    ok &= j > i - window
  p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
  return torch.einsum("bnts,bsnh->btnh", p, v)


def forward(w, ids):
  c = CFG
  D, N, K = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
  H, eps = D // N, c["rms_norm_eps"]
  B, T = ids.shape
  pos = torch.arange(T)[None].expand(B, T)
  x = w["model.embed_tokens.weight"][ids]
  gates = []
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    qg = x @ w[p + "self_attn.q_proj.weight"].T
    q, gate = qg[..., :N * H], qg[..., N * H:]
    k = x @ w[p + "self_attn.k_proj.weight"].T
    v = x @ w[p + "self_attn.v_proj.weight"].T
    q = rms(q, w[p + "self_attn.q_norm.weight"], eps).view(B, T, N, H)
    k = rms(k, w[p + "self_attn.k_norm.weight"], eps).view(B, T, K, H)
    v = v.view(B, T, K, H)
    q, k = rope(q, pos, c["rope_theta"]), rope(k, pos, c["rope_theta"])
    glob, loc = attention(q, k, v), attention(q, k, v, LOCAL_WINDOW_SIZE)
    hard = (torch.sigmoid(gate) > 0.5).double()[..., None]  # [B, T, N, 1]
    gates.append(hard[..., 0].int().numpy())
    o = (glob * hard + loc * (1.0 - hard)).reshape(B, T, N * H) @ w[p + "self_attn.o_proj.weight"].T
    x = x + rms(o, w[p + "post_attention_layernorm.weight"], eps)
    m = x @ w[p + "mlp.gate_proj.weight"].T
    u = x @ w[p + "mlp.up_proj.weight"].T
    m = (torch.nn.functional.silu(m) * u) @ w[p + "mlp.down_proj.weight"].T
    x = x + rms(m, w[p + "post_feedforward_layernorm.weight"], eps)
  x = rms(x, w["model.norm.weight"], eps)
  return x @ w["lm_head.weight"].T, np.stack(gates)


def main():
  c = CFG
  rng = np.random.default_rng(0)
  D, N, K, F, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                   c["intermediate_size"], c["vocab_size"])
  H = D // N
  shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({p + "self_attn.q_proj.weight": (N * H + N, D), p + "self_attn.k_proj.weight": (K * H, D),
                   p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                   p + "self_attn.q_norm.weight": (N * H,), p + "self_attn.k_norm.weight": (K * H,),
                   p + "post_attention_layernorm.weight": (D,),
                   p + "post_feedforward_layernorm.weight": (D,),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                   p + "mlp.down_proj.weight": (D, F)})
  w32 = {}
  for name, shape in shapes.items():
    if "norm" in name:
      a = 1.0 + 0.2 * rng.standard_normal(shape)
    elif name == "model.embed_tokens.weight":
      a = rng.standard_normal(shape)
    else:
      a = 0.2 * rng.standard_normal(shape)
    if name.endswith("q_proj.weight"):
      a[N * H:] = 0.5 * rng.standard_normal((N, D))  # gate rows: both routes, far from 0
    w32[name] = torch.tensor(a, dtype=torch.float32)
  os.makedirs(OUT, exist_ok=True)
  from safetensors.torch import save_file
  save_file(w32, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(OUT, "config.json"), "w") as f:
    json.dump(c, f, indent=2, sort_keys=True)
  ids = torch.tensor(rng.integers(0, V, size=(2, 160)), dtype=torch.long)
  with torch.no_grad():
    logits, gates = forward({k: v.double() for k, v in w32.items()}, ids)
  print("full-attention fraction per layer:", gates.reshape(gates.shape[0], -1).mean(-1))
  assert 0.1 < gates.mean() < 0.9
  np.savez(os.path.join(OUT, "expected.npz"), input_ids=ids.numpy().astype(np.int32),
           logits=logits.float().numpy(), gates=gates.astype(np.int32))
  print("wrote", OUT)


if __name__ == "__main__":
  main()
