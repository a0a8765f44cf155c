"""Block-sparse attention with per-head modes (issue 13): one launch for a layer's mixed heads.

Importable without condattn_jax. See README.md beside this file.
"""
from .api import (BACKENDS, HEAD_BLOCKS, HEAD_FULL, HEAD_WINDOW_BLOCKS, IMPLS,
                  BlockSparseBackend, BlockSparseConfig, BlockSparseFallbackWarning, block_sparse_attention,
                  kernel_support)

__all__ = ["BACKENDS", "BlockSparseBackend", "BlockSparseConfig", "HEAD_BLOCKS", "HEAD_FULL", "HEAD_WINDOW_BLOCKS",
           "IMPLS", "BlockSparseFallbackWarning", "block_sparse_attention", "kernel_support"]
