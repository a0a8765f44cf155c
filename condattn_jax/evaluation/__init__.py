"""Evaluation: perplexity at context lengths, synthetic-task accuracy, reports; the
generation-scored long-context suite and head-to-head reports.

  results = evaluate(config, params, model_cfg, mesh, step=...)   # perplexity.py
  write_results(results, out_dir)                                # report.py: JSON + markdown
  evaluate_checkpoint(config, path_or_workdir)                   # condattn_jax.train.loop

  samples = tasks.build_samples("ruler", lengths, tokenizer=tok)  # tasks.py: the task suite
  res = harness.evaluate_model(harness.load_model(dir), samples)  # harness.py: through the engine
  report = headtohead.run_suite(models, "ruler")                  # headtohead.py: one report
  headtohead.write_report(report, out_dir)                        # JSON, markdown, plots.py PNGs
"""
from condattn_jax.evaluation.perplexity import context_lengths, eval_knobs, evaluate, flat_metrics
from condattn_jax.evaluation.report import markdown_table, result_name, write_results
