"""condattn-jax: conditional attention for long-context LLMs in JAX."""
