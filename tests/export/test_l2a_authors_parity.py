"""Logit parity with the L2A authors' modelling code: tests/fixtures/l2a_authors/ holds a tiny
random L2A-Qwen3 checkpoint in the authors' layout (awslabs hybrid-model-factory) and the logits
their modelling code computes on it in float64 (tests/make_l2a_authors_fixture.py, torch; read
here with numpy only). Imported with export.load_authors_l2a, our L2A model (eval mode: hard
router decisions, window from sliding_window, tau / theta from sigmoid_temp / sigmoid_threshold)
gives the same logits; exported back in the authors' layout it writes the same tensors."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from _train_helpers import ROOT
from condattn_jax import export
from condattn_jax.models.decoder import Decoder

FIX = os.path.join(ROOT, "tests", "fixtures", "l2a_authors")


def test_authors_checkpoint_imports_with_logit_parity(tmp_path):
  cfg, params = export.load_authors_l2a(FIX)
  opts = dict(cfg.scheme_kwargs)
  assert (cfg.scheme, cfg.family, opts["window"], opts["tau"], opts["theta"]) == (
      "l2a", "qwen3", 4, 0.1, 0.5)
  exp = np.load(os.path.join(FIX, "expected.npz"))
  ids = jnp.asarray(exp["input_ids"])
  logits, aux = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, ids, train=False))(params)
  want = exp["logits"]
  assert 0.1 < exp["decisions"].mean() < 0.9  # both routes are taken: the router is exercised
  np.testing.assert_allclose(np.asarray(logits), want, atol=2e-4, rtol=0)
  # a wrong window or a dropped global branch is far off: the comparison can fail
  wrong = cfg.replace(scheme_kwargs=tuple(sorted({**opts, "window": 8}.items())))
  off = np.asarray(jax.jit(lambda p: Decoder(wrong).apply({"params": p}, ids, train=False))(
      params)[0])
  assert np.abs(off - want).max() > 1e-2
  # and back out in the authors' layout: the same tensors, bit for bit
  export.export_model(params, cfg, str(tmp_path / "o"), layout="authors")
  from safetensors.numpy import load_file
  a = load_file(os.path.join(FIX, "model.safetensors"))
  b = load_file(str(tmp_path / "o" / "model.safetensors"))
  assert set(a) == set(b)
  for k in a:
    assert a[k].tobytes() == b[k].tobytes(), k
  hf = json.load(open(tmp_path / "o" / "config.json"))
  src = json.load(open(os.path.join(FIX, "config.json")))
  for k in ("model_type", "sliding_window", "sigmoid_temp", "sigmoid_threshold", "sigmoid_linear",
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "intermediate_size"):
    assert hf[k] == src[k], k
