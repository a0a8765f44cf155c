"""Input pipelines: grain sources -> shuffle -> pack -> batch, and synthetic tasks.

Public API (see pipeline.py for the multi-host order contract):
  make_train_iterator(cfg, *, process_index=0, process_count=1, tokenizer=None)
  make_eval_batches(cfg, num_batches, seed, *, process_index=0, process_count=1,
                    tokenizer=None)
  make_global_batch(batch, sharding, global_batch_size=None)
  data_shard_for_sharding(sharding, global_shape) -> (shard_index, shard_count)
  batch_spec(cfg, *, global_batch=True, process_count=1)
  default_data_config(), parse_data_config(cfg), required(field, what), missing_required(cfg)
  check_vocab(data_config, vocab_size, tokenizer=None)
Bad records: errors name the file and 1-based line; data.on_bad_record='skip' drops them
(counted in SKIPPED.count, logged with their location).
Batches: dict of numpy [B_local, T]: inputs, targets, segment_ids, positions (int32),
loss_mask (float32); with data.task_field also task_ids int32 [B_local] (one task per row,
index into data.task_names). The tokenizer lives in condattn_jax.data.tokenizer (not imported here).
"""

from condattn_jax.data.config import (
    FILE_SOURCES, PACKINGS, REQUIRED_PREFIX, SOURCES, SYNTHETIC_SOURCES, DataConfig,
    default_data_config, is_required_marker, missing_required, parse_data_config, required)
from condattn_jax.data.packing import BATCH_KEYS, attention_mask
from condattn_jax.data.pipeline import (
    SKIPPED, batch_spec, check_vocab, data_shard_for_sharding, make_dataset, make_eval_batches,
    make_global_batch, make_train_iterator)
from condattn_jax.data.sources import write_array_record
from condattn_jax.data.synthetic import MQAR, NIAH, TASKS, make_task
