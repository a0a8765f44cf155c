"""A decode step's MLP half (x + down(silu(gate(xn)) * up(xn)), M <= 64 rows) as two Hopper
kernels streaming the weights once. Importable without condattn_jax. See api.py and
README.md beside this file."""
from .api import (BACKENDS, IMPLS, MAX_ROWS, DecodeMLPBackend, DecodeMLPConfig, Plan, bytes_read,
                  decode_mlp, kernel_support, plan)
from .reference import reference_decode_mlp, reference_hidden, silu_mul

__all__ = ["BACKENDS", "IMPLS", "MAX_ROWS", "DecodeMLPBackend", "DecodeMLPConfig", "Plan",
           "bytes_read", "decode_mlp", "kernel_support", "plan", "reference_decode_mlp",
           "reference_hidden", "silu_mul"]
