r"""MATCH recipes (docs/schemes/match.md#recipes, paper 004): a sparse-attention Qwen3 + retrieval,
continual training with the MATCH mask.

  # post-sparsified Qwen3-8B-Base, half of the layers SWA (+ retrieval): the paper's LongBench model
  python train.py --config=configs/match_qwen.py --workdir=DIR \
      --config.model.init_from=/ckpt/Qwen3-8B-Base --config.data.tokenizer=/ckpt/Qwen3-8B-Base \
      --config.model.scheme.retriever_kwargs.tokenizer=/ckpt/Qwen3-8B-Base/tokenizer.json \
      --config.data.paths='/data/cont_pretrain/*.jsonl'
  python train.py --config=configs/match_qwen.py:qwen3-8b-swa0.8 ...   # 80% SWA layers
  python train.py --config=configs/match_qwen.py:qwen3-8b-allswa ...   # pre-sparsified: all SWA
  # tiny CPU variant: 2-layer MQAR model (window 32, chunks of 2, exact-match retrieval)
  python train.py --config=configs/match_qwen.py:tiny --workdir=/tmp/match_tiny

Variants: 'qwen3-8b-swa0.5' (default; swa_ratio 0.5: layers 1, 3, ..., 35 keep full attention),
'qwen3-8b-swa0.8' (swa_ratio 0.8), 'qwen3-8b-allswa' (swa_ratio 1.0: the pre-sparsified,
all-SWA setting; the paper's pre-sparsified model is Phi-3-mini, a family this repo does not
load, so the all-SWA variant runs on Qwen3), 'tiny'.

Pinned by docs/schemes/match.md#choices: chunks c = 128, top_k = 4, retrieval every c tokens once the context
exceeds the window, candidates wholly before the window, the all-MiniLM-L6-v2 bi-encoder (its
weights: the 'match' extra). Not pinned by the paper text (our choices, fields to override):
window 2048 (the paper's StreamingLLM baseline keeps a 2048-token local window), lr 1e-5 cosine
with 1% warmup, rows of 32768 tokens, batch 32, 'sequence' retrieved K/V (training mask), AdamW
(0.9, 0.95), weight decay 0.1, every parameter trained. Decode recomputes the retrieved chunks'
K/V (see condattn_jax/attention/match/layer.py); an optional reranker is a scheme field
(reranker='pkg.module:factory', rerank_k).

Args (comma separated after the variant): steps, seq, batch, window, chunk, top_k, lr;
tiny only: pairs, layers, width.
"""
from condattn_jax.data import required
from condattn_jax.train.config import default_config, parse_arg, split_variant

VARIANTS = {
    "qwen3-8b-swa0.5": dict(swa_ratio=0.5),
    "qwen3-8b-swa0.8": dict(swa_ratio=0.8),
    "qwen3-8b-allswa": dict(swa_ratio=1.0),
    "tiny": dict(swa_ratio=1.0),
}
CHECKPOINT = "Qwen3-8B-Base"


def get_config(arg=None):
  variant, rest = split_variant(arg, VARIANTS, "qwen3-8b-swa0.5")
  tiny = variant == "tiny"
  if tiny:
    a = parse_arg(rest, steps=300, seq=128, batch=32, window=32, chunk=2, top_k=4, lr=1e-2,
                  pairs=8, layers=2, width=64)
  else:
    a = parse_arg(rest, steps=5000, seq=32768, batch=32, window=2048, chunk=128, top_k=4,
                  lr=1e-5)
  c = default_config()
  m, d, t, s = c.model, c.data, c.train, c.model.scheme
  s.name = "match"
  s.window = a.window
  s.chunk = a.chunk
  s.top_k = a.top_k
  s.swa_ratio = VARIANTS[variant]["swa_ratio"]
  s.retrieved_kv = "sequence"
  s.impl = "auto"
  s.sinks = 0
  s.reranker = ""
  s.rerank_k = 0
  t.num_steps = a.steps
  t.lr = a.lr
  t.lr_schedule = "cosine"
  t.grad_clip = 1.0
  t.b1, t.b2 = 0.9, 0.95
  t.trainable_regex = None
  d.seq_len = a.seq
  d.batch_size = a.batch
  d.shuffle_seed = 0
  if tiny:
    s.retriever = "exact"
    s.retriever_kwargs = {"ignore_tokens": (0,)}
    vocab = 128
    m.family = "qwen3"
    m.qk_norm = "head"
    m.vocab_size = vocab
    m.hidden_size = a.width
    m.intermediate_size = 2 * a.width
    m.num_layers = a.layers
    m.num_heads = 4
    m.num_kv_heads = 4
    m.head_dim = a.width // 4
    m.rope_theta = 10000.0
    m.dtype = "float32"
    m.param_dtype = "float32"
    t.warmup_frac = 0.2  # MQAR's recall plateau wants a slow warmup
    t.weight_decay = 0.01
    t.log_every = 10
    t.checkpoint_every = 100
    t.keep_checkpoints = 2
    d.source = "mqar"
    d.prefetch = 0
    d.task.vocab_size = vocab
    d.task.num_pairs = a.pairs
    d.task.min_gap = 0
    c.eval.context_lengths = (a.seq,)
    c.eval.num_batches = 4
    return c
  s.retriever = "minilm"
  s.retriever_kwargs = {"tokenizer": required("model.scheme.retriever_kwargs.tokenizer",
                                              f"{CHECKPOINT}/tokenizer.json")}
  m.family = "qwen3"
  m.init_from = required("model.init_from", f"{CHECKPOINT} checkpoint directory")
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat_policy = "full"
  m.attention_impl = "auto"
  t.warmup_frac = 0.01
  t.weight_decay = 0.1
  t.log_every = 10
  t.checkpoint_every = 500
  t.keep_checkpoints = 3
  t.loss_chunk_size = 4096
  d.source = "jsonl"
  d.paths = required("data.paths", "continual-pretraining jsonl files or glob")
  d.tokenizer = required("data.tokenizer", f"{CHECKPOINT} tokenizer directory")
  d.text_field = "text"
  d.packing = "concat_then_split"
  d.read_threads = 4
  d.prefetch = 2
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  c.eval.context_lengths = (8192, 32768)
  c.eval.num_batches = 8
  c.eval.batch_size = 4
  return c
