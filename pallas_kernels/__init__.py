"""Pallas kernels with pure-jnp references; importable without condattn_jax."""
