"""AHA in the vLLM-AHA router layout (the authors' inference code: OLMo-2 names, the router as N
extra q_proj rows, hard gate sigmoid > 0.5, local window 128). tests/fixtures/aha_authors/ holds a
tiny random checkpoint in that layout and the logits of a float64 torch transcription of vLLM-AHA's
forward (tests/make_aha_authors_fixture.py; read here with numpy only, 160 tokens so the 128-token
window matters). Imported with export.load_authors_aha, our AHA model gives the same logits;
exported back it writes the same tensors; a router bias the authors' gate cannot express is
refused."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import ROOT
from condattn_jax import export
from condattn_jax.models.decoder import Decoder

FIX = os.path.join(ROOT, "tests", "fixtures", "aha_authors")


def test_aha_authors_checkpoint_imports_with_logit_parity_and_exports_back(tmp_path):
  cfg, params = export.load_authors_aha(FIX)
  opts = dict(cfg.scheme_kwargs)
  assert (cfg.scheme, cfg.family, opts["window"], opts["tau"]) == ("aha", "olmo2", 128, 0.5)
  exp = np.load(os.path.join(FIX, "expected.npz"))
  assert 0.1 < exp["gates"].mean() < 0.9  # both routes taken
  ids = jnp.asarray(exp["input_ids"])
  logits, _ = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, ids, train=False))(params)
  np.testing.assert_allclose(np.asarray(logits), exp["logits"], atol=2e-4, rtol=0)
  # every head global (the window ignored) is far off: the comparison can fail
  allg = cfg.replace(scheme_kwargs=tuple(sorted({**opts, "routing": "all"}.items())))
  off = np.asarray(jax.jit(lambda p: Decoder(allg).apply({"params": p}, ids, train=False))(
      params)[0])
  assert np.abs(off - exp["logits"]).max() > 1e-2
  out = str(tmp_path / "o")
  export.export_model(params, cfg, out, layout="authors")
  from safetensors.numpy import load_file
  a, b = load_file(os.path.join(FIX, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
  assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["Olmo2AHAForCausalLM"]
  cfg2, params2 = export.load_model(out)
  assert cfg2 == cfg
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  # a trained router bias (here 0.5 on one head) has no place in the authors' gate
  flat = export._flat(export._host_per_layer(params, cfg))
  flat[("layers_1", "router", "bias")] = np.array([0.0, 0.5, 0.0, 0.0], np.float32)
  bad = export.stacking.to_model_layout(export._unflat(flat), cfg)
  with pytest.raises(export.ExportError, match="differs from logit"):
    export.export_model(bad, cfg, str(tmp_path / "bad"), layout="authors")
