"""Training: config schema, mesh + logical sharding rules, optimizer, train step, the run loop.

  from condattn_jax.train import loop
  final = loop.run(config, workdir)     # see loop.py
"""
