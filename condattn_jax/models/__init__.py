"""Decoder models: `condattn_jax.models.config.ModelConfig`, `condattn_jax.models.decoder.Decoder`."""
