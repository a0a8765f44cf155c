r"""L2A recipes (docs/schemes/l2a.md#recipes): a dense Qwen checkpoint -> L2A, continued training at 128K.

  # the paper's Qwen2.5-7B recipe (default); Qwen2.5-1.5B and Qwen3-8B through the arg
  python train.py --config=configs/l2a_qwen.py --workdir=DIR \
      --config.model.init_from=/ckpt/Qwen2.5-7B \
      --config.data.tokenizer=/ckpt/Qwen2.5-7B \
      --config.data.paths='/data/long/*.jsonl'
  python train.py --config=configs/l2a_qwen.py:qwen2.5-1.5b ...
  python train.py --config=configs/l2a_qwen.py:qwen3-8b ...
  python train.py --config=configs/l2a_qwen.py:qwen2.5-7b,steps=100,seq=32768 ...  (arg overrides)

  # tiny CPU variant: random init, synthetic MQAR, seconds
  python train.py --config=configs/l2a_qwen.py:tiny --workdir=/tmp/l2a_tiny
  python eval.py  --config=configs/l2a_qwen.py:tiny --workdir=/tmp/l2a_tiny \
      --config.model.scheme.theta=0.7          # theta is a test-time knob
  python scripts/l2a_prune.py --config=configs/l2a_qwen.py:tiny --workdir=/tmp/l2a_tiny

The real recipes need three fields; without them the run stops at once naming every one still
missing, in the order the run needs them (a --dry_run needs only model.init_from):
  model.init_from  the dense Hugging Face checkpoint directory (converted by scheme 'l2a':
                   local and global attention both copied, zero router),
  data.tokenizer   the tokenizer directory (usually the checkpoint directory),
  data.paths       the long-document training files (jsonl with a 'text' field by default;
                   data.source='parquet' / 'array_record' for the others).

Recipe (paper F.1, E.1.3 and the authors' code; numbers are fields):
  128K-token rows (data.seq_len=131072), RoPE base raised 1e6 -> 5e6, SWA window 4096,
  AdamW lr 5e-5, 5% warmup, cosine, clip 1.0, bf16 compute (fp32 master weights),
  batch 6M tokens (48 rows; 4M = 32 rows for 1.5B), 25B tokens (16.7B for 1.5B),
  trainable = local + global attention, all norms, router (FFN and embeddings frozen),
  tau 0.1, theta 0.5, p_force 0.1, lambda_max 1.3e-3 with warmup-then-linear-ramp.

Args (comma separated after the variant name): steps, seq, batch, window, lam (lambda_max),
  lam_schedule (ramp | constant), lam_ramp_frac (fraction of the post-warmup steps the ramp takes),
  p_force, tau, theta, routing (learned | bernoulli | all | none), q (bernoulli_q), lr;
  real variants only: sequence (config.mesh.sequence: a row's tokens over that many devices,
  the paper's 8: `configs/l2a_qwen.py:sequence=8`; needs a multiple of 8 devices);
  tiny only: pairs, gap (MQAR min_gap), layers, width, freeze (freeze FFN + embeddings as the
  real recipes do; default off for a random init).
"""
import ml_collections

from condattn_jax.data import required
from condattn_jax.train.config import default_config, parse_arg, split_variant

# A regex on '/'-joined param paths (re.fullmatch): what L2A trains.
TRAINABLE_REGEX = (r"layers(_\d+_\d+)?/(self_attn|global_attn|router|input_layernorm|global_layernorm|"
                   r"post_attention_layernorm)/.*|norm/scale")

# Required fields of the real recipes are marked with `required(field, what)` (a string, so the
# command line can set them); validate_config names every one still unset before anything runs.


VARIANTS = {
    # name: family, rows per batch (128K tokens each), total training tokens, checkpoint name
    "qwen2.5-7b": dict(family="qwen2", batch=48, tokens=25e9, name="Qwen2.5-7B"),
    "qwen2.5-1.5b": dict(family="qwen2", batch=32, tokens=16.7e9, name="Qwen2.5-1.5B"),
    "qwen3-8b": dict(family="qwen3", batch=48, tokens=25e9, name="Qwen3-8B"),
    "tiny": dict(family="qwen2", batch=32, tokens=None, name=None),
}


def _scheme(c, a):
  """model.scheme: every L2A option (so `--config.model.scheme.<x>=` can set any of them)."""
  s = c.model.scheme
  s.name = "l2a"
  s.window = a.window
  s.tau = a.tau
  s.theta = a.theta
  s.p_force = a.p_force
  s.lambda_max = a.lam
  s.lambda_schedule = a.lam_schedule
  # lambda is 0 during the lr warmup, then ramps linearly over lam_ramp_frac of the rest; the
  # references follow --config.train.num_steps / warmup_frac overrides.
  steps = c.train.get_ref("num_steps")
  warm = (steps * c.train.get_ref("warmup_frac")).to_int()
  s.lambda_warmup_steps = warm
  s.lambda_ramp_steps = ((steps - warm) * a.lam_ramp_frac).to_int()
  s.routing = a.routing
  s.bernoulli_q = a.q
  s.bernoulli_seed = 0
  s.pruned_layers = ()
  s.decode_skip = False
  s.compact_impl = "auto"


def get_config(arg=None):
  variant, rest = split_variant(arg, VARIANTS, "qwen2.5-7b")
  v = VARIANTS[variant]
  if variant == "tiny":
    a = parse_arg(rest, steps=300, seq=64, batch=32, window=8, lam=1e-2, lam_schedule="ramp",
                  lam_ramp_frac=0.5, p_force=0.1, tau=0.1, theta=0.5, routing="learned", q=0.2,
                  lr=3e-3, pairs=8, gap=16, layers=2, width=64, freeze=False)
  else:
    a = parse_arg(rest, steps=0, seq=131072, batch=v["batch"], window=4096, lam=1.3e-3,
                  lam_schedule="ramp", lam_ramp_frac=1.0, p_force=0.1, tau=0.1, theta=0.5,
                  routing="learned", q=0.2, lr=5e-5, sequence=1)
  c = default_config()
  c.train.num_steps = a.steps or max(1, round(v["tokens"] / (a.batch * a.seq)))
  _scheme(c, a)
  m, d, t = c.model, c.data, c.train

  t.lr = a.lr
  t.warmup_frac = 0.05
  t.lr_schedule = "cosine"
  t.end_lr_frac = 0.0
  t.grad_clip = 1.0
  t.weight_decay = 0.0  # the paper gives none (HF Trainer default)
  t.b1, t.b2 = 0.9, 0.95

  if variant == "tiny":
    vocab = 64
    m.family = v["family"]
    m.vocab_size = vocab
    m.hidden_size = a.width
    m.intermediate_size = 2 * a.width
    m.num_layers = a.layers
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = a.width // 4
    m.attention_bias = True
    m.rope_theta = 10000.0
    m.dtype = "float32"
    m.param_dtype = "float32"
    d.source = "mqar"
    d.seq_len = a.seq
    d.batch_size = a.batch
    d.shuffle_seed = 0
    d.prefetch = 0
    d.task.vocab_size = vocab
    d.task.num_pairs = a.pairs
    d.task.min_gap = a.gap
    t.trainable_regex = TRAINABLE_REGEX if a.freeze else None
    t.log_every = 10
    t.checkpoint_every = 100
    t.keep_checkpoints = 2
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.eval.context_lengths = (a.seq,)
    c.eval.num_batches = 4
    return c

  m.family = v["family"]  # checked against the checkpoint's config.json model_type
  m.init_from = required("model.init_from", f"{v['name']} checkpoint directory")
  m.rope_theta = 5e6
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat_policy = "full"
  m.attention_impl = "auto"
  d.source = "jsonl"
  d.paths = required("data.paths", "long-document jsonl files or glob")
  d.tokenizer = required("data.tokenizer", f"{v['name']} tokenizer directory")
  d.text_field = "text"
  d.seq_len = a.seq
  d.batch_size = a.batch
  d.packing = "concat_then_split"
  d.shuffle_seed = 0
  d.read_threads = 4
  d.prefetch = 2
  t.trainable_regex = TRAINABLE_REGEX
  t.loss_chunk_size = min(8192, a.seq)
  t.log_every = 10
  t.checkpoint_every = 200
  t.keep_checkpoints = 3
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  c.mesh.sequence = a.sequence  # the paper: 8 (a 128K row over 8 devices)
  c.eval.context_lengths = tuple(L for L in (32768, 65536, 131072) if L <= a.seq) or (a.seq,)
  c.eval.num_batches = 8
  c.eval.batch_size = 8
  return c
