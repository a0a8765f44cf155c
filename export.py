r"""Export a trained model as a Hugging Face directory (any scheme), or check an export loads.

  python export.py --checkpoint=DIR --out=OUT                      # latest checkpoint of a run
  python export.py --checkpoint=DIR/checkpoints/400 --out=OUT      # one step
  python export.py --checkpoint=DIR --out=OUT --layout=authors     # L2A / AHA: the authors' layout
  python export.py --check=OUT                                     # load OUT back and say what it is

--layout=condattn (default, every scheme): OUT/config.json + model.safetensors hold the base
family (llama / qwen2 / qwen3 / olmo2: loads in transformers and vLLM as the dense model) and
OUT/condattn_scheme.{json,safetensors} the scheme's own parameters and options; the tokenizer
files of the run's data.tokenizer are copied. --layout=authors writes the parameter names and
config of the authors' modelling code: L2A as awslabs hybrid-model-factory's L2A-Qwen3, AHA as
vLLM-AHA's OLMo-2 router layout (router rows in q_proj; window 128 and a bias-free gate only).
Both load back bit-exactly: `condattn_jax.export.load_model(OUT)`, or train / evaluate from
them with --config.model.init_from=OUT (the scheme's parameters are kept when the run's scheme
is the exported one). The layouts are described in condattn_jax/export.py.

The config is the one saved with the checkpoint. A bad input (missing checkpoint, a layout the
scheme has no place for, an unwritable OUT) is one line starting with ERROR: (exit code 2).
"""
import os

from absl import app, flags

from condattn_jax.train import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run's workdir, its checkpoints/ dir or "
                                  "one step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest readable).")
_OUT = flags.DEFINE_string("out", None, "Output directory (created).")
_LAYOUT = flags.DEFINE_enum("layout", "condattn", ["condattn", "authors"],
                            "condattn: base family + scheme sidecar (every scheme); authors: the "
                            "authors' layout (L2A, AHA).")
_CHECK = flags.DEFINE_string("check", None, "Load this export directory back and print its "
                             "scheme and parameter count.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CHECK.value:
    from condattn_jax import export
    import numpy as np
    import jax
    cfg, params = export.load_model(_CHECK.value)
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    print(f"{_CHECK.value}: scheme {cfg.scheme} ({cfg.family}, {cfg.num_layers} layers), "
          f"{n} parameters, options {dict(cfg.scheme_kwargs)}")
    return
  if not _CHECKPOINT.value or not _OUT.value:
    raise app.UsageError("give --checkpoint=<run workdir or step dir> and --out=<directory> "
                         "(or --check=<export directory>).")
  from condattn_jax import checkpoint as ckpt_lib
  ckpt_lib.resolve_checkpoint_path(_CHECKPOINT.value)  # a missing path: one line, before jax
  out = os.path.abspath(_OUT.value)
  if os.path.exists(out) and not os.path.isdir(out):
    raise NotADirectoryError(f"--out={_OUT.value}: {out} is a file; give a directory.")
  from condattn_jax import export
  from condattn_jax.train import loop
  config = loop.config_from_checkpoint(_CHECKPOINT.value, _STEP.value)
  cli.apply_overrides(config, cli.PENDING_OVERRIDES)
  setup, params, step = loop.load_params(config, _CHECKPOINT.value, step=_STEP.value)
  base_hf = None
  if config.model.get("init_from"):
    try:
      from condattn_jax import convert
      base_hf = convert.read_hf_config(config.model.init_from)
    except (OSError, ValueError):
      base_hf = None  # the source is gone: the architecture keys are enough
  files = export.export_model(params, setup.model_cfg, out, layout=_LAYOUT.value,
                              tokenizer_dir=config.data.get("tokenizer"), base_hf_config=base_hf)
  print(f"exported step {step} ({setup.model_cfg.scheme}, layout {_LAYOUT.value}) to {out}:")
  for f in files:
    print(f"  {os.path.basename(f)}")


if __name__ == "__main__":
  cli.run(main)
