r"""Elastic Attention recipes (docs/schemes/elastic.md#recipes, paper 003): a dense checkpoint -> Elastic,
router-only training at 64K.

  # the paper's Qwen3-4B recipe (default); Qwen3-8B and Llama-3.1-8B through the arg
  python train.py --config=configs/elastic_qwen.py --workdir=DIR \
      --config.model.init_from=/ckpt/Qwen3-4B \
      --config.data.tokenizer=/ckpt/Qwen3-4B \
      --config.data.paths='/data/elastic_mix/*.jsonl'
  python train.py --config=configs/elastic_qwen.py:qwen3-8b ...
  python train.py --config=configs/elastic_qwen.py:llama3.1-8b,modes=fa_xa ...

  # tiny CPU variant: random-init Qwen3-shaped decoder, synthetic MQAR, seconds
  python train.py --config=configs/elastic_qwen.py:tiny --workdir=/tmp/elastic_tiny

The real recipes need model.init_from, data.tokenizer and data.paths (the run names every one
still missing).

Recipe (paper Sec. 3 / App. D, authors' code; numbers are fields): frozen backbone, trainable =
the per-layer routers (task MLP + router MLP) and the per-task Lagrange multipliers
(params 'scheme/lagrange' [2, tasks]: lambda1; lambda2, init 0: lam_init=0.5 gives the paper's
U(0, 0.5), which under the signed form first pulls Omega toward dense), the latter by gradient
ASCENT (declared by the scheme; param group 'lagrange': AdamW lr 1e-3, weight decay 0.1) on the
signed Lagrangian of the paper's eq. 8 (lagrangian=abs: the authors' |Omega - t|); router AdamW
lr 5e-4, betas (0.9, 0.95), clip 5.0, weight decay 0.1, linear warmup over the first 20% of the
steps then cosine decay to 0 (paper Table 8 / App. C.1), global batch 48 rows; 300 steps of
64K-token rows, bf16 compute; Gumbel tau cosine 1.5 -> 1.0 over the first 60% of
steps; boundary pooling (100 + 100 tokens); SSA 128 sinks + 2048 local, XA stride 16, threshold
0.9, block 128; targets: sparsity-sensitive tasks (QA) 0.7, sparsity-robust (summarisation,
code, in-context learning) 1.0.

Task ids: a batch's `task_ids` [B] index model.scheme.task_names. The file pipeline reads each
record's task name from data.task_field ('task': {"text": ..., "task": "qa"}) and maps it into
data.task_names, which is a reference to model.scheme.task_names (one list:
--config.model.scheme.task_names=... moves both); an unknown task name is an error naming the
record, the task and the known ones. Records are a prompt and its answer (data.prompt_field
'prompt', data.answer_field 'answer': text or token ids): rows hold ONE document
(data.packing='one_per_row'; Elastic decides once per row, so packing that mixes documents is
refused), batches carry `prompt_lengths` (the router pools the first / last 100 PROMPT tokens,
never the answer) and CE covers the answer tokens only (data.loss_on='answer'). Batches
without task ids (the tiny variant's synthetic MQAR) count as task 0.

Args (comma separated after the variant name): steps, seq, batch, modes (fa_ssa | fa_xa |
xa_ssa), pooling (boundary | prompt_mean), lagrangian (signed | abs), lam_init, lr, lam_lr,
t_sensitive, t_robust; tiny only: layers, width, pairs, gap, target (the tiny variant keeps a constant lr and
weight decay 0: 40 steps, its test's measured numbers).
"""
from condattn_jax.data import required
from condattn_jax.train.config import default_config, parse_arg, split_variant

# re.fullmatch on '/'-joined param paths: the routers (the backbone is frozen).
TRAINABLE_REGEX = r"layers(_\d+_\d+)?/router/.*"
LAGRANGE_REGEX = r"scheme/lagrange"

VARIANTS = {
    "qwen3-4b": dict(family="qwen3", name="Qwen3-4B"),
    "qwen3-8b": dict(family="qwen3", name="Qwen3-8B"),
    "llama3.1-8b": dict(family="llama", name="Llama-3.1-8B-Instruct"),
    "tiny": dict(family="qwen3", name=None),
}
TASKS = ("qa", "summarization", "code", "in_context_learning")  # paper's categories


def _scheme(c, a, *, task_names, targets, small: bool):
  """model.scheme: every Elastic option (so `--config.model.scheme.<x>=` can set any of them)."""
  s = c.model.scheme
  s.name = "elastic"
  s.modes = a.modes
  s.pooling = a.pooling
  s.boundary = 8 if small else 100
  s.sinks = 4 if small else 128
  s.local = 16 if small else 2048
  s.block = 4 if small else 128
  s.xa_stride = 2 if small else 16
  s.xa_threshold = 0.9
  s.xa_chunk = 16  # XA scoring memory: query blocks scored at a time (not a paper number)
  s.tau_start = 1.5
  s.tau_end = 1.0
  s.anneal_steps = int(round(0.6 * a.steps))
  s.tau_schedule = "cosine"
  s.tau_exp_rate = 0.6
  s.task_names = tuple(task_names)
  s.targets = tuple(targets)
  s.lambda_init_max = a.lam_init
  s.lagrangian = a.lagrangian
  s.seed = 0
  s.routing = "learned"
  s.prompt_field = "prompt_lengths"


def get_config(arg=None):
  variant, rest = split_variant(arg, VARIANTS, "qwen3-4b")
  v = VARIANTS[variant]
  common = dict(modes="fa_ssa", pooling="boundary", lagrangian="signed", lam_init=0.0,
                lam_lr=1e-3, t_sensitive=0.7, t_robust=1.0)
  tiny = variant == "tiny"
  if tiny:
    a = parse_arg(rest, **common, steps=40, seq=64, batch=8, lr=3e-3, layers=2, width=64,
                  pairs=4, gap=8, target=0.7)
  else:
    a = parse_arg(rest, **common, steps=300, seq=65536, batch=48, lr=5e-4)
  c = default_config()
  c.train.num_steps = a.steps
  if tiny:  # the synthetic data carries no task ids: one task
    _scheme(c, a, task_names=("mqar",), targets=(a.target,), small=True)
  else:
    _scheme(c, a, task_names=TASKS, targets=(a.t_sensitive,) + (a.t_robust,) * 3, small=False)
  m, d, t = c.model, c.data, c.train

  t.lr = a.lr
  # paper Table 8: warmup ratio 0.2, cosine, weight decay 0.1 (tiny: constant lr, no decay)
  t.warmup_frac = 0.0 if tiny else 0.2
  t.lr_schedule = "constant" if tiny else "cosine"
  t.end_lr_frac = 1.0 if tiny else 0.0
  t.grad_clip = 5.0
  t.weight_decay = 0.0 if tiny else 0.1
  t.b1, t.b2 = 0.9, 0.95
  t.trainable_regex = TRAINABLE_REGEX
  # lr / weight decay of the Lagrange multipliers; the ASCENT is the scheme's declaration
  # (Scheme.ascent_params: the train step flips their gradient), not a recipe setting
  t.param_groups.lagrange = dict(regex=LAGRANGE_REGEX, lr=a.lam_lr, weight_decay=0.1)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1

  if tiny:
    vocab = 64
    m.family = "qwen3"
    m.qk_norm = "head"
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
    d.seq_len = a.seq
    d.batch_size = a.batch
    d.shuffle_seed = 0
    d.prefetch = 0
    d.task.vocab_size = vocab
    d.task.num_pairs = a.pairs
    d.task.min_gap = a.gap
    t.log_every = 5
    t.checkpoint_every = 1000
    t.keep_checkpoints = 1
    c.eval.context_lengths = (a.seq,)
    c.eval.num_batches = 1
    return c

  m.family = v["family"]  # checked against the checkpoint's config.json model_type
  m.init_from = required("model.init_from", f"{v['name']} checkpoint directory")
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat_policy = "full"
  m.attention_impl = "auto"
  d.source = "jsonl"
  d.paths = required("data.paths", "long-context task-mix jsonl files or glob")
  d.tokenizer = required("data.tokenizer", f"{v['name']} tokenizer directory")
  d.prompt_field = "prompt"
  d.answer_field = "answer"
  d.loss_on = "answer"
  d.task_field = "task"
  d.task_names = c.model.scheme.get_ref("task_names")  # one source of truth
  d.seq_len = a.seq
  d.batch_size = a.batch
  d.packing = "one_per_row"
  d.shuffle_seed = 0
  d.read_threads = 4
  d.prefetch = 2
  t.loss_chunk_size = min(4096, a.seq)
  t.log_every = 5
  t.checkpoint_every = 100
  t.keep_checkpoints = 2
  c.eval.context_lengths = (a.seq,)
  c.eval.num_batches = 4
  c.eval.batch_size = 8
  return c
