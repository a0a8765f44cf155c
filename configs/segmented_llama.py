r"""Segmented-execution recipes (docs/schemes/segmented.md#recipes, paper 002): a dense long-context checkpoint
-> scheme 'segmented' (the identity on weights), full fine-tuning under the SAME segmented
forward that inference runs (a scan over segments, TBPTT depth K).

  # the paper's LLaMA-2-7B-32K recipe (default) and its 80K model; Qwen variants
  python train.py --config=configs/segmented_llama.py --workdir=DIR \
      --config.model.init_from=/ckpt/LLaMA-2-7B-32K \
      --config.data.tokenizer=/ckpt/LLaMA-2-7B-32K \
      --config.data.paths='/data/slimpajama/*.jsonl'
  python train.py --config=configs/segmented_llama.py:llama2-7b-80k ...
  python train.py --config=configs/segmented_llama.py:qwen2.5-7b ...
  python train.py --config=configs/segmented_llama.py:llama2-7b-32k,tbptt=2 ...   # Table 3

  # tiny CPU variant: random-init LLaMA-shaped decoder, synthetic MQAR, seconds
  python train.py --config=configs/segmented_llama.py:tiny --workdir=/tmp/seg_tiny

The real recipes need model.init_from, data.tokenizer and data.paths (the run stops at once
naming the missing ones).

Recipe (paper Sec. 4 / App. F; numbers are fields): S = 4096, M = 512, R = 512, K = 1; long
heads {0,1,2,4,9,12,14,15,16,18,19,22,23,26,29,30} of 32, long layers {6, 8, 11, 18} (the
authors' code: 16 for 18); training rows of (K + 1) * S tokens (K = 1: 8K, "maximum training
context 8K"; K = 2: 12K); lr 2e-5 constant after 20 linear warmup steps; AdamW with HF Trainer
defaults (betas 0.9 / 0.999, weight decay 0); micro-batch 1 x gradient accumulation 8 (here:
batch 8 split into 8 microbatches: the same gradient); 1000 steps on SlimPajama; bf16 compute,
fp32 master weights, every parameter trained. The loss is normalised by the number of target
tokens (the authors average per segment: docs/schemes/segmented.md#choices notes the difference).
Qwen variants (not in the paper; head / layer lists are ours, untuned): half of the KV heads
long, long layers at the LLaMA fractions of depth.

Args (comma separated after the variant name): steps, seq, batch, accum, lr, warmup, tbptt,
segment, tail, retrieve, refresh; tiny only: pairs, gap, layers, width.
"""
from condattn_jax.attention.segmented.options import LLAMA2_LONG_HEADS, LLAMA2_LONG_LAYERS
from condattn_jax.data import required
from condattn_jax.train.config import default_config, parse_arg, split_variant

VARIANTS = {
    # name: family, checkpoint, context of the base model, long KV heads, long layers
    "llama2-7b-32k": dict(family="llama", name="LLaMA-2-7B-32K", context=32768,
                          long_heads=LLAMA2_LONG_HEADS, long_layers=LLAMA2_LONG_LAYERS),
    "llama2-7b-80k": dict(family="llama", name="llama-2-7b-80k", context=81920,
                          long_heads=LLAMA2_LONG_HEADS, long_layers=LLAMA2_LONG_LAYERS),
    "qwen2.5-7b": dict(family="qwen2", name="Qwen2.5-7B-Instruct", context=32768,
                       long_heads=(0, 2), long_layers=(5, 7, 10, 16)),  # 4 KV heads, 28 layers
    "qwen3-8b": dict(family="qwen3", name="Qwen3-8B", context=32768,
                     long_heads=(0, 2, 4, 6), long_layers=(7, 9, 12, 20)),  # 8 KV heads, 36 layers
    "tiny": dict(family="llama", name=None, context=None, long_heads=(0,), long_layers=(1,)),
}
PAPER_STEPS = 1000


def _scheme(c, a, v):
  """model.scheme: every segmented option (so `--config.model.scheme.<x>=` can set any)."""
  s = c.model.scheme
  s.name = "segmented"
  s.segment_len = a.segment
  s.tail_len = a.tail
  s.retrieve_len = a.retrieve
  s.tbptt = a.tbptt
  s.long_heads = tuple(v["long_heads"])
  s.long_layers = tuple(v["long_layers"])
  s.refresh = a.refresh
  s.remat_segments = True


def get_config(arg=None):
  variant, rest = split_variant(arg, VARIANTS, "llama2-7b-32k")
  v = VARIANTS[variant]
  if variant == "tiny":
    a = parse_arg(rest, steps=150, seq=0, batch=8, accum=1, lr=3e-3, warmup=20, tbptt=1,
                  segment=16, tail=4, retrieve=8, refresh=1, pairs=4, gap=8, layers=2,
                  width=64)
  else:
    a = parse_arg(rest, steps=PAPER_STEPS, seq=0, batch=8, accum=8, lr=2e-5, warmup=20,
                  tbptt=1, segment=4096, tail=512, retrieve=512, refresh=1)
  if not a.seq:
    a.seq = (a.tbptt + 1) * a.segment  # K transitions need K + 1 segments per row
  c = default_config()
  _scheme(c, a, v)
  m, d, t = c.model, c.data, c.train
  t.num_steps = a.steps
  t.lr = a.lr
  t.warmup_steps = a.warmup
  t.lr_schedule = "constant"
  t.grad_clip = 1.0
  t.weight_decay = 0.0
  t.b1, t.b2 = 0.9, 0.999
  t.trainable_regex = None  # full fine-tuning
  t.microbatches = a.accum
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  d.seq_len = a.seq
  d.batch_size = a.batch

  if variant == "tiny":
    vocab = 64
    c.model.scheme.query_len = 8
    c.model.scheme.summary_window = 4
    c.model.scheme.summary_stride = 2
    c.model.scheme.summary_tail = 2
    c.model.scheme.topk = 4
    c.model.scheme.anchors = 2
    c.model.scheme.expand = (-1, 2)
    m.family = "llama"
    m.vocab_size = vocab
    m.hidden_size = a.width
    m.intermediate_size = 2 * a.width
    m.num_layers = a.layers
    m.num_heads = 4
    m.num_kv_heads = 2
    m.head_dim = a.width // 4
    m.rope_theta = 10000.0
    m.dtype = "float32"
    m.param_dtype = "float32"
    d.source = "mqar"
    d.shuffle_seed = 0
    d.prefetch = 0
    d.task.vocab_size = vocab
    d.task.num_pairs = a.pairs
    d.task.min_gap = a.gap
    t.log_every = 10
    t.checkpoint_every = 100
    t.keep_checkpoints = 2
    c.eval.context_lengths = (a.seq,)
    c.eval.num_batches = 2
    return c

  m.family = v["family"]  # checked against the checkpoint's config.json model_type
  m.init_from = required("model.init_from", f"{v['name']} checkpoint directory")
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat_policy = "full"
  m.attention_impl = "auto"
  d.source = "jsonl"
  d.paths = required("data.paths", "pretraining-style jsonl files or glob (the paper: SlimPajama)")
  d.tokenizer = required("data.tokenizer", f"{v['name']} tokenizer directory")
  d.text_field = "text"
  d.packing = "one_per_row"  # a row is one document (segmented: packed_documents=False)
  d.shuffle_seed = 0
  d.read_threads = 4
  d.prefetch = 2
  t.loss_chunk_size = min(4096, a.seq)
  t.log_every = 10
  t.checkpoint_every = 250
  t.keep_checkpoints = 3
  c.eval.context_lengths = (a.seq,)
  c.eval.num_batches = 8
  return c
