"""The `data` section of a run config: defaults, validation, and a typed view.

Every data function takes either the whole run config (with a `data` field) or the
`data` section itself (an `ml_collections.ConfigDict` or a plain dict).  Missing fields
take the defaults below; unknown fields, unknown sources and unknown task parameters are
errors that name the field and list the valid ones.

    data.source          'mqar' | 'niah' | 'suite' (synthetic, generated on the fly; 'suite':
                         the evaluation suite's token-level tasks, synthetic.SuiteMix)
                         | 'jsonl' | 'parquet' | 'array_record' (tokenized documents)
    data.paths           str (comma separated) or list of str; globs allowed; file sources only
    data.eval_paths      like `paths`, for `make_eval_batches` (None: use `paths`, i.e. the
                         evaluation reads the TRAINING files; train.py / eval.py say so in a
                         warning, `eval_reads_training_files`)
    data.text_field      record field holding raw text, tokenized with the tokenizer
    data.tokens_field    record field holding pre-tokenized ids (used when present)
    data.record_format   array_record only: 'json' (UTF-8 JSON object per record) or a numpy
                         integer dtype name ('int32', 'uint16', 'uint32', 'int64') for records
                         that are raw little-endian token id arrays
    data.append_separator  append the document separator token to every document
    data.separator_id    override for the separator id (None: tokenizer.document_separator_id)
    data.seq_len         T, tokens per row
    data.batch_size      GLOBAL batch size (rows over all processes)
    data.shuffle_seed    document shuffle seed (None: no shuffle); also the synthetic seed
    data.num_epochs      None = repeat forever; an int stops after that many epochs
    data.packing         'concat_then_split' (no padding; documents cut at row ends) |
                         'first_fit' (documents kept whole unless longer than T) |
                         'one_per_row' (first_fit with one document piece per row: the rest
                         of the row is padding; what schemes that declare
                         packed_documents=False need, e.g. segmented)
    data.pack_bins       first_fit only: rows packed together per lane
    data.read_threads    grain read threads per lane (0: read in the iterating thread)
    data.prefetch        batches prefetched in a background thread (0: off)
    data.pad_id          token id written into padding slots of `inputs` / `targets`
    data.tokenizer       tokenizer directory for condattn_jax.data.tokenizer.load_tokenizer
                         (used when no tokenizer object is passed in; None: none)
    data.task            ConfigDict of synthetic task parameters (see synthetic.py);
                         missing ones take the task's defaults
    data.on_bad_record   'error' (stop, naming the file and 1-based line / record) | 'skip'
                         (drop the record, log it with its file and line, count them)
    data.task_field      record field holding the record's task NAME (None / '': off). When
                         set, batches also carry `task_ids` int32 [B]: each row's index into
                         data.task_names (one task per row; packing never mixes tasks in a row,
                         see packing.py). File sources with JSON-like records and
                         data.packing='first_fit' | 'one_per_row' only. A record without the field is a bad
                         record (data.on_bad_record); a task name not in data.task_names is
                         always an error naming it, the record and the known names.
    data.prompt_field    record field holding the PROMPT (text, or a list of token ids); with
    data.answer_field    the record field holding the ANSWER: a document is prompt + answer
                         (answer tokenized without a BOS) and batches also carry
                         `prompt_lengths` int32 [B]: the prompt's tokens at the row's start
                         (Elastic pools them: model.scheme.prompt_field). Needs
                         data.packing='one_per_row' (one document per row, so the row's prompt
                         is the document's); a record longer than data.seq_len + 1 tokens is a
                         bad record (cut, it would lose its answer or its prompt's start).
    data.loss_on         'all' (every target scored) | 'answer' (needs data.prompt_field:
                         loss_mask is 0 on targets inside the prompt, so CE covers the answer
                         tokens only; the target after the prompt's last token is the answer's
                         first token and is scored).
    data.task_names      the task list the names map into (id = index). Recipes point it at
                         model.scheme.task_names (a FieldReference: one source of truth, so
                         --config.model.scheme.task_names=... moves both); given a whole run
                         config, parse_data_config refuses a data.task_names that differs
                         from model.scheme.task_names.

A recipe marks a field the user must set with `required(field, what)` (a string starting with
REQUIRED_PREFIX); `parse_data_config(..., needs_files=True)` refuses such a value naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import ml_collections

SYNTHETIC_SOURCES = ("mqar", "niah", "suite")  # synthetic.TASKS
FILE_SOURCES = ("jsonl", "parquet", "array_record")
SOURCES = SYNTHETIC_SOURCES + FILE_SOURCES
PACKINGS = ("concat_then_split", "first_fit", "one_per_row")
RECORD_FORMATS = ("json", "int32", "uint16", "uint32", "int64")
BAD_RECORD_POLICIES = ("error", "skip")
REQUIRED_PREFIX = "REQUIRED: "


def required(field: str, what: str) -> str:
  """The value a recipe gives a field the user must set (a str, so the command line can set it;
  never a valid path, so nothing can silently use it)."""
  return f"{REQUIRED_PREFIX}--config.{field}=<{what}>"


def is_required_marker(value) -> bool:
  return isinstance(value, str) and value.startswith(REQUIRED_PREFIX)

_DEFAULTS: dict[str, Any] = dict(
    source="mqar",
    paths=None,
    eval_paths=None,
    text_field="text",
    tokens_field="tokens",
    record_format="json",
    append_separator=True,
    separator_id=None,
    seq_len=512,
    batch_size=8,
    shuffle_seed=0,
    num_epochs=None,
    packing="concat_then_split",
    pack_bins=4,
    read_threads=0,
    prefetch=2,
    pad_id=0,
    tokenizer=None,
    task=None,
    on_bad_record="error",
    task_field=None,
    task_names=None,
    prompt_field=None,
    answer_field=None,
    loss_on="all",
)


def default_data_config() -> ml_collections.ConfigDict:
  """The `data` section with every field at its default (task params empty)."""
  d = dict(_DEFAULTS)
  d["task"] = ml_collections.ConfigDict()
  # Fields that default to None are typed loosely so callers may set str/list/int.
  cfg = ml_collections.ConfigDict(d)
  return cfg


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str
  paths: tuple[str, ...] | None
  eval_paths: tuple[str, ...] | None
  text_field: str
  tokens_field: str
  record_format: str
  append_separator: bool
  separator_id: int | None
  seq_len: int
  batch_size: int
  shuffle_seed: int | None
  num_epochs: int | None
  packing: str
  pack_bins: int
  read_threads: int
  prefetch: int
  pad_id: int
  tokenizer: Any
  task: Mapping[str, Any]
  on_bad_record: str = "error"
  task_field: str | None = None
  task_names: tuple[str, ...] | None = None
  prompt_field: str | None = None
  answer_field: str | None = None
  loss_on: str = "all"

  @property
  def with_prompts(self) -> bool:
    """Records are prompt + answer and batches carry `prompt_lengths` [B]."""
    return bool(self.prompt_field)

  @property
  def is_synthetic(self) -> bool:
    return self.source in SYNTHETIC_SOURCES

  @property
  def with_tasks(self) -> bool:
    """Batches carry `task_ids` [B] (data.task_field is set)."""
    return bool(self.task_field)


def _to_dict(x) -> dict[str, Any]:
  if x is None:
    return {}
  if isinstance(x, ml_collections.ConfigDict):
    return x.to_dict()
  if isinstance(x, Mapping):
    return dict(x)
  raise TypeError(f"expected a ConfigDict or mapping, got {type(x).__name__}")


def _paths(value, field: str) -> tuple[str, ...] | None:
  if value is None:
    return None
  if isinstance(value, str):
    parts = [p.strip() for p in value.split(",") if p.strip()]
  elif isinstance(value, (list, tuple)):
    parts = [str(p) for p in value]
  else:
    raise ValueError(f"data.{field} must be a str or a list of str, got {value!r}")
  return tuple(parts) if parts else None


def missing_required(cfg) -> list[str]:
  """'data.<field>' of every field still holding a recipe's REQUIRED marker, in field order."""
  section = cfg["data"] if isinstance(cfg, (ml_collections.ConfigDict, Mapping)) and "data" in cfg \
      and "source" not in cfg else cfg
  raw = _to_dict(section)
  return [f"data.{k}" for k in _DEFAULTS if is_required_marker(raw.get(k))]


def parse_data_config(cfg, *, needs_files: bool = True) -> DataConfig:
  """Validates the data section (or a run config holding one) and returns a typed view.

  needs_files=False (shapes only, e.g. a dry run) skips the checks that only matter when data
  is read: data.paths set, no REQUIRED markers left."""
  if isinstance(cfg, DataConfig):
    return cfg
  section = cfg
  if isinstance(cfg, (ml_collections.ConfigDict, Mapping)) and "data" in cfg and (
      "source" not in cfg):
    section = cfg["data"]
  raw = _to_dict(section)
  unknown = sorted(set(raw) - set(_DEFAULTS))
  if unknown:
    raise ValueError(
        f"unknown data config field(s) {unknown}; valid fields: {sorted(_DEFAULTS)} "
        "(a new field belongs in condattn_jax/data/config.py)")
  d = {**_DEFAULTS, **raw}

  if d["source"] not in SOURCES:
    raise ValueError(f"data.source={d['source']!r} is not a known source; valid sources: "
                     f"{list(SOURCES)}")
  if d["packing"] not in PACKINGS:
    raise ValueError(f"data.packing={d['packing']!r} is unknown; valid: {list(PACKINGS)}")
  if d["on_bad_record"] not in BAD_RECORD_POLICIES:
    raise ValueError(f"data.on_bad_record={d['on_bad_record']!r} is unknown; valid: "
                     f"{list(BAD_RECORD_POLICIES)}")
  if d["record_format"] not in RECORD_FORMATS:
    raise ValueError(f"data.record_format={d['record_format']!r} is unknown; valid: "
                     f"{list(RECORD_FORMATS)}")
  for name in ("seq_len", "batch_size", "pack_bins"):
    if not isinstance(d[name], int) or d[name] < 1:
      raise ValueError(f"data.{name} must be a positive int, got {d[name]!r}")
  for name in ("read_threads", "prefetch"):
    if not isinstance(d[name], int) or d[name] < 0:
      raise ValueError(f"data.{name} must be a non-negative int, got {d[name]!r}")
  if d["num_epochs"] is not None and (not isinstance(d["num_epochs"], int)
                                      or d["num_epochs"] < 1):
    raise ValueError(f"data.num_epochs must be None (repeat) or a positive int, "
                     f"got {d['num_epochs']!r}")
  if d["shuffle_seed"] is not None and not isinstance(d["shuffle_seed"], int):
    raise ValueError(f"data.shuffle_seed must be an int or None, got {d['shuffle_seed']!r}")
  if needs_files:
    marked = [k for k in _DEFAULTS if is_required_marker(d[k])]
    if marked:
      raise ValueError("required field(s) not set: " + ", ".join(d[k][len(REQUIRED_PREFIX):]
                                                                 for k in marked))
  task_field, task_names = _task_fields(d, cfg if section is not cfg else None)
  prompt_field, answer_field = _prompt_fields(d)
  paths = _paths(d["paths"], "paths")
  eval_paths = _paths(d["eval_paths"], "eval_paths")
  if needs_files and d["source"] in FILE_SOURCES and not paths:
    raise ValueError(f"data.source={d['source']!r} reads files: set data.paths "
                     "(a path, a glob, or a list of them)")
  return DataConfig(
      source=d["source"], paths=paths, eval_paths=eval_paths,
      text_field=d["text_field"], tokens_field=d["tokens_field"],
      record_format=d["record_format"], append_separator=bool(d["append_separator"]),
      separator_id=d["separator_id"], seq_len=d["seq_len"], batch_size=d["batch_size"],
      shuffle_seed=d["shuffle_seed"], num_epochs=d["num_epochs"], packing=d["packing"],
      pack_bins=d["pack_bins"], read_threads=d["read_threads"], prefetch=d["prefetch"],
      pad_id=d["pad_id"], tokenizer=d["tokenizer"], task=_to_dict(d["task"]),
      on_bad_record=d["on_bad_record"], task_field=task_field, task_names=task_names,
      prompt_field=prompt_field, answer_field=answer_field, loss_on=d["loss_on"])


LOSS_ON = ("all", "answer")


def _prompt_fields(d: Mapping[str, Any]) -> tuple[str | None, str | None]:
  """(prompt_field, answer_field), both set or both None, validated with loss_on."""
  prompt, answer = d["prompt_field"] or None, d["answer_field"] or None
  if d["loss_on"] not in LOSS_ON:
    raise ValueError(f"data.loss_on={d['loss_on']!r} is unknown; valid: {list(LOSS_ON)}")
  if (prompt is None) != (answer is None):
    raise ValueError(f"data.prompt_field={prompt!r} and data.answer_field={answer!r}: set both "
                     "(records of prompt + answer) or neither")
  if prompt is None:
    if d["loss_on"] == "answer":
      raise ValueError("data.loss_on='answer' needs data.prompt_field / data.answer_field (the "
                       "records' prompt and answer): without them no token is an answer")
    return None, None
  for name, v in (("prompt_field", prompt), ("answer_field", answer)):
    if not isinstance(v, str):
      raise ValueError(f"data.{name} must be a record field name (str), got {v!r}")
  if d["source"] not in FILE_SOURCES or (d["source"] == "array_record"
                                         and d["record_format"] != "json"):
    raise ValueError(f"data.prompt_field={prompt!r} reads record fields: file sources with "
                     f"JSON-like records only, not data.source={d['source']!r}")
  if d["packing"] != "one_per_row":
    raise ValueError(f"data.prompt_field={prompt!r} needs data.packing='one_per_row' (a row's "
                     f"prompt_lengths is its one document's prompt); {d['packing']!r} packs "
                     "several documents in a row")
  return prompt, answer


def eval_reads_training_files(cfg) -> str | None:
  """A one-line warning when the evaluation of this config would read the training files (a
  file source without data.eval_paths), else None. Synthetic sources draw a separate eval
  stream and never warn."""
  d = cfg["data"] if "data" in cfg else cfg
  source = d.get("source") if hasattr(d, "get") else None
  if source not in FILE_SOURCES or d.get("eval_paths"):
    return None
  return ("data.eval_paths is not set: the evaluation reads the training files (data.paths), so "
          "its numbers are on training data; set --config.data.eval_paths=<held-out files> for a "
          "held-out evaluation.")


def _task_fields(d: Mapping[str, Any], run_cfg) -> tuple[str | None, tuple[str, ...] | None]:
  """(task_field or None, task_names) validated; `run_cfg` (the whole run config, when given)
  must agree with data.task_names in model.scheme.task_names."""
  field = d["task_field"] or None
  names = d["task_names"]
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  names = tuple(str(n) for n in names) if names else None
  if field is None:
    return None, names
  if not isinstance(field, str):
    raise ValueError(f"data.task_field must be a record field name (str), got {field!r}")
  if d["source"] not in FILE_SOURCES:
    raise ValueError(f"data.task_field={field!r} reads a record field: file sources only "
                     f"({list(FILE_SOURCES)}), not data.source={d['source']!r}")
  if d["source"] == "array_record" and d["record_format"] != "json":
    raise ValueError(f"data.task_field={field!r} needs records with fields: "
                     f"data.record_format='json', not {d['record_format']!r}")
  if d["packing"] not in ("first_fit", "one_per_row"):
    raise ValueError(f"data.task_field={field!r} needs data.packing='first_fit' (one task per "
                     f"row) or 'one_per_row'; {d['packing']!r} would join documents of different tasks in a row")
  if not names:
    raise ValueError(f"data.task_field={field!r} needs data.task_names (the task list the "
                     "records' names map into; recipes set it to model.scheme.task_names)")
  if len(set(names)) != len(names):
    raise ValueError(f"data.task_names {list(names)} has duplicates")
  scheme = None
  if run_cfg is not None and "model" in run_cfg:
    model = run_cfg["model"]
    scheme = model.get("scheme") if hasattr(model, "get") else None
  scheme_names = scheme.get("task_names") if hasattr(scheme, "get") else None
  if scheme_names and tuple(str(n) for n in scheme_names) != names:
    raise ValueError(f"data.task_names {list(names)} differs from model.scheme.task_names "
                     f"{list(scheme_names)}: task ids would index the wrong tasks (point "
                     "data.task_names at model.scheme.task_names)")
  return field, names
