"""Compacted-query attention kernels (L2A global branch, AHA per-head routing).

Importable without condattn_jax. See README.md beside this file.
"""
from .api import BACKENDS, CompactBackend, CompactConfig, compact_attention, kernel_support
from .common import BlockSizes, TPU_BLOCK_SIZES
from .compaction import bucket_capacities, mask_from_indices
from .reference import reference_compact_attention

__all__ = [
    "BACKENDS", "BlockSizes", "CompactBackend", "CompactConfig", "TPU_BLOCK_SIZES",
    "bucket_capacities",
    "compact_attention", "kernel_support", "mask_from_indices", "reference_compact_attention",
]
