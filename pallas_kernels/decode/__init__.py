"""Decode attention kernels: a few query tokens per row over a KV cache (full or window ring),
GQA folded into the query rows, kv split into parts merged by log-sum-exp, per-(row, head) reads
skipped. Importable without condattn_jax. See api.py."""
from .api import (BACKENDS, DecodeBackend, DecodeConfig, decode_attention, kernel_support,
                  kv_bytes_read, num_parts, plan, tile_runs)
from .reference import (decode_mask, merge_decode_parts, merge_parts,
                        reference_decode_attention)

__all__ = ["BACKENDS", "DecodeBackend", "DecodeConfig", "decode_attention", "decode_mask",
           "kernel_support", "kv_bytes_read", "merge_decode_parts", "merge_parts",
           "num_parts", "plan",
           "reference_decode_attention", "tile_runs"]
