"""Evaluation: perplexity at context lengths, synthetic-task accuracy, reports.

  results = evaluate(config, params, model_cfg, mesh, step=...)   # perplexity.py
  write_results(results, out_dir)                                # report.py: JSON + markdown
  evaluate_checkpoint(config, path_or_workdir)                   # condattn_jax.train.loop
"""
from condattn_jax.evaluation.perplexity import context_lengths, eval_knobs, evaluate, flat_metrics
from condattn_jax.evaluation.report import markdown_table, result_name, write_results
