"""The scheme contract: a scheme defined OUTSIDE the library (here, a module written by the test)
registers itself, is found by name ('module:name'), sees the whole LayerContext (token ids, task
ids, extra batch fields, pre-RoPE keys, its per-layer flags, the layer index), returns per-layer
per-head aux arrays ([L, N]), gets the batch in its aux_loss, and trains through train.py's code
path (`train.loop.run`) without any edit to the library."""
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_helpers import tiny

TOY = textwrap.dedent('''
    """A toy scheme: dense attention whose output is scaled per head by a learned gate computed
    from pre-RoPE keys, plus probes of everything the context carries."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np

    from condattn_jax.attention import Scheme, register
    from condattn_jax.models.layers import Attention, make_norm, mlp_residual

    SEEN = {}


    class ToyLayer(nn.Module):
      config: object
      variant: object = None

      @nn.compact
      def __call__(self, x, ctx):
        cfg = self.config
        attn = Attention(cfg, name="self_attn")
        h = make_norm(cfg, "input_layernorm")(x)
        q, k, v = attn.project(h)                      # pre-RoPE keys
        gate_w = self.param("gate", nn.initializers.zeros, (cfg.head_dim,))
        gate_N = 1.0 + jnp.tanh(jnp.einsum("btkh,h->k", k.astype(jnp.float32), gate_w))
        gate_N = jnp.repeat(gate_N, cfg.num_heads // cfg.num_kv_heads)
        q, k = attn.rope(q, ctx.positions_BT), attn.rope(k, ctx.positions_BT)
        o = attn.attend(q, k, v, ctx) * gate_N[None, None, :, None].astype(q.dtype)
        x = x + attn.project_out(o) * ctx.layer_flags["scale"]
        SEEN.update(tokens=ctx.tokens_BT.shape, task=None if ctx.task_ids_B is None
                    else ctx.task_ids_B.shape, fields=sorted(ctx.fields), variant=self.variant)
        aux = dict(gate_N=gate_N, layer=ctx.layer_idx.astype(jnp.float32),
                   first_token=ctx.tokens_BT[0, 0].astype(jnp.float32))
        return mlp_residual(cfg, x), aux


    def aux_loss(aux, batch, step, config):
      n = jnp.sum(batch["loss_mask"]).astype(jnp.float32)
      return 1e-3 * jnp.mean(jnp.square(aux["gate_N"] - 1.0)), {
          "toy/gate": aux["gate_N"], "toy/layer": aux["layer"], "toy/scored": n}


    register(Scheme(
        name="toy", layer_cls=ToyLayer, aux_loss=aux_loss,
        layer_variants=lambda cfg: tuple("a" if i < 1 else "b" for i in range(cfg.num_layers)),
        layer_flags=lambda cfg: {"scale": np.linspace(1.0, 0.5, cfg.num_layers)},
        headline_metric="toy/scored"))
''')


@pytest.fixture()
def toy_module(tmp_path, monkeypatch):
  (tmp_path / "toy_scheme_mod.py").write_text(TOY)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "toy_scheme_mod"
  sys.modules.pop("toy_scheme_mod", None)


def test_outside_scheme_found_by_module_name(toy_module):
  from condattn_jax.attention import get_scheme
  s = get_scheme(f"{toy_module}:toy")
  assert s.name == "toy" and s.headline_metric == "toy/scored"
  with pytest.raises(ValueError, match="cannot be imported"):
    get_scheme("no_such_module_xyz:toy")
  with pytest.raises(ValueError, match="registered schemes"):
    get_scheme("toy_typo")


def test_context_reaches_every_layer_and_aux_is_per_layer_per_head(toy_module):
  from condattn_jax.models.config import ModelConfig
  from condattn_jax.models.decoder import Decoder
  cfg = ModelConfig(num_layers=3, scheme=f"{toy_module}:toy")
  m = Decoder(cfg)
  tok = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 1, 200)
  variables = jax.jit(m.init)(jax.random.PRNGKey(1), tok)
  assert {k for k in variables["params"] if k.startswith("layers")} == {"layers_0_1", "layers_1_3"}
  _, aux = jax.jit(lambda v: m.apply(v, tok, task_ids_B=jnp.array([0, 1]),
                                     fields={"doc_lengths": jnp.ones((2,))}))(variables)
  assert aux["gate_N"].shape == (3, cfg.num_heads)
  np.testing.assert_array_equal(aux["layer"], [0, 1, 2])
  np.testing.assert_array_equal(aux["first_token"], float(tok[0, 0]))
  seen = sys.modules[toy_module].SEEN
  assert seen["tokens"] == (2, 8) and seen["task"] == (2,) and seen["fields"] == ["doc_lengths"]
  assert seen["variant"] == "b"  # the last group traced


def test_outside_scheme_trains_through_the_loop(toy_module, tmp_path):
  from condattn_jax.train import loop
  c = tiny("steps=6")
  c.model.scheme.name = f"{toy_module}:toy"
  c.train.lr = 3e-3
  out = loop.run(c, str(tmp_path / "wd"), devices=jax.devices()[:1])  # not about sharding
  assert out["step"] == 6
  last = out["train"]
  assert np.shape(last["toy/gate"]) == (c.model.num_layers, c.model.num_heads)
  assert float(np.ptp(np.asarray(last["toy/gate"]))) > 0  # the gate learned something per head
  assert last["toy/scored"] > 0


def test_a_broken_builtin_scheme_module_is_loud(tmp_path, monkeypatch):
  """A built-in scheme module that fails to import raises its error when the registry loads; it
  never leaves its scheme silently unknown (or the other schemes silently fine)."""
  import condattn_jax.attention as attention
  (tmp_path / "zz_broken_scheme.py").write_text(
      "import no_such_dependency_of_the_scheme  # a missing extra, a typo, ...\n")
  monkeypatch.setattr(attention, "__path__", list(attention.__path__) + [str(tmp_path)])
  monkeypatch.setattr(attention, "_LOADED", False)
  with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_the_scheme"):
    attention.get_scheme("l2a")
  sys.modules.pop("condattn_jax.attention.zz_broken_scheme", None)


def test_every_report_has_the_one_reports_signature():
  """`Scheme.reports`: (model, params, batches, *, out_dir=None, name=<stem>, **knobs) for every
  built-in report (one caller can run any scheme's report and ask for its files)."""
  import inspect
  from condattn_jax import attention
  attention._load_builtin()
  seen = 0
  for scheme in attention.SCHEMES.values():
    for rname, fn in scheme.reports.items():
      ps = list(inspect.signature(fn).parameters.values())
      where = f"{scheme.name}.reports[{rname!r}] = {fn.__module__}.{fn.__name__}"
      assert [p.name for p in ps[:3]] == ["model", "params", "batches"], where
      assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ps[:3]), where
      rest = {p.name: p for p in ps[3:]}
      assert all(p.kind is p.KEYWORD_ONLY for p in rest.values()), where
      assert "out_dir" in rest and rest["out_dir"].default is None, where
      assert "name" in rest and isinstance(rest["name"].default, str), where
      seen += 1
  assert seen >= 6  # L2A, AHA and Elastic register two reports each
