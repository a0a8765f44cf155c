r"""Segmented execution fidelity (paper Table 6): perplexity vs evaluation length of an ALIGNED
tiny model (trained with the segmented forward, TBPTT K=1) and a MISALIGNED one (the same model
trained with full attention, then run segmented), both evaluated under the same segmented
execution (S, M, R, lists below), plus the misaligned model under full attention as reference.

    python -m bench.segmented_fidelity                 # preset 'cpu': ~10 min on 2 CPU cores
    python -m bench.segmented_fidelity --preset test   # seconds (tests/bench/test_segmented_bench.py)

Task (synthetic, numpy): each row is a random period-P motif drawn from a sparse first-order
Markov chain (every token has 4 likely successors), repeated to fill the row, with a fraction of
tokens replaced by uniform noise. A model seeing P tokens back copies the motif (low CE); one
that sees less can only use the Markov statistics. P > M + the segment-local reach, so copying
across segments needs context the segmented execution does not carry: the dense-trained model
has learnt to rely on it (its attention over a re-indexed tail / retrieved prefix is out of
distribution), the aligned model has learnt to live with what the segment operator provides.
Every row starts with a BOS token (id 0), as real LM rows do: a dense-trained model can use it
as an attention sink, which segments after the first do not contain (the paper's misaligned
models lose it too). Perplexity = exp(mean CE over every predicted token of the row).

Writes bench/results/segmented_fidelity.json (preset 'cpu') with the settings, the date, the
numbers, the claims (checked here: exit 1 when one fails, after writing the file) and the
findings. Measured (2 CPU cores, ~5 min): aligned stays flat (~10-12 from 1 to 16 segments),
misaligned is worse beyond one segment and the gap grows with length (~1.3x at 16 segments),
but it does NOT explode as in the paper's Table 6 (4.7x at 2 segments, 15x at 16 on LLaMA-2-7B):
at this scale the dense-trained model falls back to local statistics rather than collapsing
(findings.explodes_like_paper_2x is recorded, not asserted).
"""
from __future__ import annotations

import datetime
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from condattn_jax.attention import configure
from condattn_jax.attention import segmented as sgm
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.decoder import Decoder

from absl import flags  # noqa: E402
from bench import common

PRESETS = {
    "cpu": dict(steps=400, batch=16, train_len=64, eval_lens=(16, 32, 64, 128, 256),
                eval_rows=32, width=64, layers=2, lr=3e-3, period=24, noise=0.1, vocab=64),
    "test": dict(steps=2, batch=2, train_len=32, eval_lens=(32,), eval_rows=2, width=32,
                 layers=2, lr=3e-3, period=24, noise=0.1, vocab=64),
}
SEG = dict(segment_len=16, tail_len=4, retrieve_len=8, tbptt=1, long_heads=(0,),
           long_layers=(1,), query_len=8, summary_window=4, summary_stride=2, summary_tail=2,
           topk=4, anchors=2, expand=(-1, 2))
# result file of the recorded preset (others: <out_dir>/segmented_fidelity_<device>.json)
FILES = {"cpu": "segmented_fidelity.json"}


def make_rows(rng, n, length, p):
  """[n, length] int32 rows of the motif task (see the module docstring)."""
  V = p["vocab"]
  succ = np.random.default_rng(1234).integers(1, V, (V, 4))  # the fixed Markov chain
  rows = np.zeros((n, length), np.int32)
  for r in range(n):
    motif = [int(rng.integers(1, V))]
    for _ in range(p["period"] - 1):
      motif.append(int(succ[motif[-1], rng.integers(0, 4)]))
    row = np.resize(np.asarray(motif), length)
    noise = rng.random(length) < p["noise"]
    row[noise] = rng.integers(1, V, int(noise.sum()))
    rows[r] = row
  rows[:, 0] = 0  # BOS: every row starts with token 0 (as real LM rows do)
  return rows


def model_configs(p):
  dense = ModelConfig(family="llama", vocab_size=p["vocab"], hidden_size=p["width"],
                      intermediate_size=2 * p["width"], num_layers=p["layers"], num_heads=4,
                      num_kv_heads=2, head_dim=p["width"] // 4, rope_theta=10000.0)
  return dense, configure(dense, "segmented", **SEG)


def ce_of(logits, toks):
  lp = jax.nn.log_softmax(logits[:, :-1], -1)
  return -jnp.mean(jnp.take_along_axis(lp, toks[:, 1:, None], -1))


def train(cfg, params, p, seed, segmented: bool):
  model = Decoder(cfg)
  fwd = ((lambda pr, t: sgm.forward(model, pr, t, train=True)[0]) if segmented
         else (lambda pr, t: model.apply({"params": pr}, t)[0]))
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, p["lr"], max(p["steps"] // 10, 1),
                                                      p["steps"], p["lr"] * 0.1), weight_decay=0.0)
  opt = tx.init(params)

  @jax.jit
  def step(pr, o, t):
    loss, g = jax.value_and_grad(lambda q: ce_of(fwd(q, t), t))(pr)
    upd, o = tx.update(g, o, pr)
    return optax.apply_updates(pr, upd), o, loss

  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(p["steps"]):
    params, opt, loss = step(params, opt, jnp.asarray(make_rows(rng, p["batch"], p["train_len"], p)))
    losses.append(float(loss))
  return params, losses


def perplexities(cfg, params, rows_by_len, segmented: bool):
  model = Decoder(cfg)
  out = {}
  for L, rows in rows_by_len.items():
    if segmented:
      logits, _ = jax.jit(lambda pr, t: sgm.forward(model, pr, t))(params, jnp.asarray(rows))
    else:
      logits, _ = jax.jit(lambda pr, t: model.apply({"params": pr}, t))(params, jnp.asarray(rows))
    out[int(L)] = float(math.exp(float(ce_of(logits, jnp.asarray(rows)))))
  return out


def claims_of(res, p):
  """(claims checked by this script and the tests, findings recorded as measured).
  res: {model: {L: ppl}} with int lengths; p: the preset."""
  lens = sorted(res["aligned_segmented"])
  a, m = res["aligned_segmented"], res["misaligned_segmented"]
  beyond = [L for L in lens if L > SEG["segment_len"]]
  claims = {
      # within one segment both models see everything: similar perplexity
      "one_segment_close": abs(math.log(m[lens[0]] / a[lens[0]])) < math.log(1.5),
      # aligned: stable across evaluation lengths (paper Table 6: 7.18 .. 7.06)
      "aligned_stable": max(a.values()) / min(a.values()) < 1.5,
      # misaligned: worse than aligned at every length beyond one segment (paper: 33 .. 111)
      "misaligned_worse_beyond_segment": all(m[L] > a[L] for L in beyond),
      # ... and the gap grows with the evaluation length
      "misaligned_gap_grows": m[beyond[-1]] / a[beyond[-1]] > m[beyond[0]] / a[beyond[0]],
      # the misaligned model's own dense execution is fine at its training length
      "misaligned_dense_ok_at_train_len": res["misaligned_dense"][p["train_len"]]
                                          < a[p["train_len"]],
  }
  ratio = m[lens[-1]] / a[lens[-1]]
  findings = {
      "misaligned_over_aligned_at_max_len": ratio,
      # the paper's explosion (15x at 16 segments) is a claim about 7B models with attention
      # sinks; recorded here as measured at tiny scale, not asserted
      "explodes_like_paper_2x": bool(ratio > 2.0),
  }
  return claims, findings


def run(preset: str):
  p = PRESETS[preset]
  t0 = time.time()
  dense_cfg, seg_cfg = model_configs(p)
  init = Decoder(dense_cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  init = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, init,
                      is_leaf=lambda x: hasattr(x, "value"))
  mis_params, mis_loss = train(dense_cfg, init, p, seed=1, segmented=False)
  ali_params, ali_loss = train(seg_cfg, sgm.from_dense(init, seg_cfg), p, seed=1, segmented=True)
  rng = np.random.default_rng(99)
  rows = {L: make_rows(rng, p["eval_rows"], L, p) for L in p["eval_lens"]}
  res = {
      "aligned_segmented": perplexities(seg_cfg, ali_params, rows, True),
      "misaligned_segmented": perplexities(seg_cfg, sgm.from_dense(mis_params, seg_cfg), rows, True),
      "misaligned_dense": perplexities(dense_cfg, mis_params, rows, False),
  }
  claims, findings = claims_of(res, p)
  return dict(
      bench="segmented_fidelity", preset=preset,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      device=jax.devices()[0].device_kind, platform=jax.default_backend(),
      task=dict(name="markov_motif_copy", bos=0, **{k: p[k] for k in ("vocab", "period", "noise")}),
      settings=dict(segmented=SEG, train={k: p[k] for k in ("steps", "batch", "train_len", "lr")},
                    model=dict(layers=p["layers"], width=p["width"], heads=4, kv_heads=2),
                    eval_lens=list(p["eval_lens"]), eval_rows=p["eval_rows"]),
      perplexity=res, final_train_ce=dict(aligned=ali_loss[-1], misaligned=mis_loss[-1]),
      claims=claims, findings=findings, wall_s=round(time.time() - t0, 1))


FLAGS = common.flag_values()
flags.DEFINE_enum("preset", "cpu", sorted(PRESETS), "task size", flag_values=FLAGS)


def main(argv=None):
  args = common.parse_flags(FLAGS, argv)
  r = run(args.preset)
  out = common.result_path("segmented_fidelity", args.out_dir, fixed=FILES.get(args.preset))
  common.write_result(out, "segmented_fidelity", r, name=r.get("preset", "main"))
  print(f"wrote {out}")
  print(json.dumps(r["perplexity"], indent=1))
  print("claims:", r["claims"])
  if args.preset != "test" and not all(r["claims"].values()):
    print("FAILED claims:", [k for k, v in r["claims"].items() if not v])
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
