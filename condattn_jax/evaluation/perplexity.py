"""Perplexity at several context lengths + synthetic-task accuracy, on a fixed eval set.

For each length L in `config.eval.context_lengths` (default: data.seq_len) the data section is
re-instantiated with seq_len=L and `config.eval.num_batches` batches are drawn with
`condattn_jax.data.make_eval_batches` (eval stream, `config.eval.seed`). Scored tokens are the
`loss_mask` ones, so on MQAR / NIAH only the answer tokens count:

  ce            mean token cross-entropy over scored tokens;  ppl = exp(ce)
  token_acc     fraction of scored tokens whose argmax is the target
  exact_match   fraction of rows (with >= 1 scored token) whose scored tokens are ALL right
  aux/<m>       the scheme's metrics (e.g. per-layer sparsity), averaged over batches

The model runs with train=False; the scheme's test-time knobs come from the config
(`--config.model.scheme.<knob>=...`), its RNG from `config.eval.seed`. The results record those
knobs (`eval_knobs`: model.scheme.* and eval.*) under 'knobs'.
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.data import data_shard_for_sharding, make_eval_batches, make_global_batch
from condattn_jax.train import sharding as shd
from condattn_jax.train.step import make_eval_step


def eval_knobs(config) -> dict[str, Any]:
  """What an evaluation's numbers depend on besides the weights: the scheme's (test-time)
  hyper-parameters and the eval section. Recorded in the results as 'knobs'."""
  scheme = config.model.scheme
  scheme = scheme.to_dict() if hasattr(scheme, "to_dict") else dict(scheme)
  ev = {k: config.eval.get(k) for k in ("context_lengths", "num_batches", "batch_size", "seed")}
  ev["context_lengths"] = context_lengths(config)
  # JSON-normal form (tuples -> lists) so knobs compare equal to the ones read back from a file.
  return json.loads(json.dumps({"model.scheme": scheme, "eval": ev}, sort_keys=True))


def context_lengths(config) -> list[int]:
  lengths = list(config.eval.context_lengths or ()) or [int(config.data.seq_len)]
  return [int(x) for x in lengths]


def eval_data_config(config, seq_len: int):
  """config.data with seq_len=L (and eval.batch_size), no prefetch thread."""
  d = copy.deepcopy(config.data)
  d.seq_len = int(seq_len)
  if config.eval.get("batch_size"):
    d.batch_size = int(config.eval.batch_size)
  d.prefetch = 0
  return d


_CACHE: dict = {}


def _jitted_eval_step(model_cfg, chunk, seed, mesh, param_shardings):
  """One jitted eval step per (model, chunk, seed, mesh, shardings): periodic evals during a run
  reuse its compilations (one per context length)."""
  key = (model_cfg, chunk, seed, mesh, jax.tree_util.tree_structure(param_shardings),
         tuple(jax.tree.leaves(param_shardings)))
  if key not in _CACHE:
    if len(_CACHE) > 8:
      _CACHE.clear()
    _CACHE[key] = jax.jit(make_eval_step(model_cfg, loss_chunk_size=chunk, seed=seed),
                          in_shardings=(param_shardings, shd.batch_sharding(mesh), None),
                          out_shardings=shd.replicated(mesh))
  return _CACHE[key]


def evaluate(config, params, model_cfg, mesh, *, step: int = 0, param_shardings=None,
             lengths: list[int] | None = None) -> dict[str, Any]:
  """{'step': step, 'results': {L: {ce, ppl, token_acc, exact_match, tokens, seqs, aux/...}}}."""
  chunk = int(config.train.get("loss_chunk_size", 0) or 0)
  lengths = context_lengths(config) if lengths is None else lengths
  bsh = shd.batch_sharding(mesh)
  if param_shardings is None:
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
  out: dict[str, Any] = {"step": int(step), "knobs": eval_knobs(config), "results": {}}
  fn = _jitted_eval_step(model_cfg, chunk, int(config.eval.seed), mesh, param_shardings)
  step_arr = jnp.asarray(step, jnp.int32)
  with shd.mesh_context(mesh):
    for L in lengths:
      if chunk and L % chunk:
        raise ValueError(f"eval.context_lengths has {L}, not divisible by "
                         f"train.loss_chunk_size={chunk}.")
      dcfg = eval_data_config(config, L)
      B = int(dcfg.batch_size)
      if B % shd.batch_shards(mesh):
        raise ValueError(f"eval batch size {B} (eval.batch_size or data.batch_size) must be "
                         f"divisible by mesh data*fsdp={shd.batch_shards(mesh)}.")
      shard_index, shard_count = data_shard_for_sharding(bsh, (B, L))
      batches = make_eval_batches(dcfg, int(config.eval.num_batches), int(config.eval.seed),
                                  process_index=shard_index, process_count=shard_count,
                                  vocab_size=model_cfg.vocab_size)
      sums: dict[str, Any] = {}
      n = 0
      for b in batches:
        r = jax.device_get(fn(params, make_global_batch(b, bsh, B), step_arr))
        n += 1
        for k, v in r.items():
          sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
      if not n:
        raise ValueError(f"no evaluation batches at context length {L}.")
      tok = max(float(sums["tokens"]), 1.0)
      ce = float(sums["ce_sum"]) / tok
      res = dict(ce=ce, ppl=math.exp(min(ce, 700.0)), token_acc=float(sums["correct"]) / tok,
                 exact_match=float(sums["seq_correct"]) / max(float(sums["seqs"]), 1.0),
                 tokens=int(sums["tokens"]), seqs=int(sums["seqs"]), batches=n)
      for k, v in sums.items():
        if k.startswith("aux/"):
          v = v / n
          res[k] = float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
      out["results"][int(L)] = res
  return out


def flat_metrics(results: dict) -> dict[str, Any]:
  """{'eval/L{L}/ppl': ..., ...} for a metric writer."""
  flat = {}
  for L, r in results["results"].items():
    for k, v in r.items():
      if k in ("tokens", "seqs", "batches"):
        continue
      flat[f"L{L}/{k}"] = v
  return flat
