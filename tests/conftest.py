"""Every test process sees 8 fake CPU devices (set before jax is imported).

Test time is mostly XLA compilation of tiny programs, so every test process (the pytest workers
and the train.py / eval.py subprocesses they start, which inherit this environment) compiles with
LLVM's optimisation level 0 and its expensive passes off (tests/_test_env.py:
TEST_COMPILE_FLAGS): the programs compute the same values up to float rounding and run slower,
which only long trainings notice (`make demo`'s test and bench/elastic_repro's CI run train
near a user's optimisation level: LLVM at -O1, its expensive passes off; tests/_test_env.py
training_env).
Within a test process, a program identical to one already compiled (same module up to debug
locations) reuses that executable (_reuse_identical_compilations). Across the processes of one
run (the xdist workers and the one-device subprocesses they start), ONE-device programs share
jax's persistent compilation cache in a directory made for the run (SHARED_CACHE_ENV) and removed
at its end. Multi-device programs always compile: with jax 0.11.2 on a CPU with fake devices, a
multi-device program loaded from that cache deadlocks in its collectives' rendezvous (`train.py
--config=configs/tiny.py` on 8 fake devices, run twice on one cache directory: the second run
aborts; one device: both runs pass).
"""
import collections
import gc
import json
import os
import resource

import shutil
import tempfile

import pytest
from _test_env import MIN_CACHED_COMPILE_S, SHARED_CACHE_ENV, TEST_COMPILE_FLAGS

_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags] + [f for f in TEST_COMPILE_FLAGS if f.split("=")[0] not in _flags] +
    ["--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The run's shared compilation cache: made by the first process (pytest itself, before xdist
# starts its workers, which inherit the variable), removed by it at the end (pytest_unconfigure).
_OWNS_SHARED_CACHE = not os.environ.get(SHARED_CACHE_ENV)
if _OWNS_SHARED_CACHE:
  os.environ[SHARED_CACHE_ENV] = tempfile.mkdtemp(prefix="condattn_test_jit_cache_")
# glibc's malloc backs its large (mmap) chunks with transparent huge pages in the processes
# started from here (make test's xdist workers, spawned after this file is imported, and every
# subprocess: the demo's trainings, train.py / eval.py runs): XLA's compiler and CPU runtime
# allocate multi-MiB buffers afresh, and with 4 KiB pages every first touch is a page fault (the
# demo's AHA section: ~23k faults a step, 15 of its 61 CPU-s in the kernel). Allocation only:
# the same numbers. A process started without it (pytest -n 0 itself) runs as before.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")

import jax  # noqa: E402

# Pallas' interpret mode, imported before any test traces (the first interpret-mode lowering of
# a process imports it otherwise): it registers a jax config option that is part of every jit
# cache key, so every program a worker traced before its first kernel test would be traced, and
# compiled, again after it.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # noqa: E402,F401

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ[SHARED_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The train loop turns that cache off on several CPU devices (the same deadlock); a test process
# keeps its multi-device programs out of it itself (_reuse_identical_compilations), so its
# one-device programs keep the cache (tests/train/test_cpu_cache_guard.py runs the loop's guard
# in train.py processes).
from condattn_jax.train import loop as _train_loop  # noqa: E402

_train_loop._no_persistent_cache_for_cpu_collectives = lambda devices=None: None


def _reuse_identical_compilations(max_entries=256):
  """A test process compiles the same program again and again: every loop.run / jit of a fresh
  closure traces a new function, and the lowered module differs from the last one only in its
  debug locations (the caller's file:line), so jax's own caches miss. This keys XLA's compile
  (jax._src.compiler.compile_or_get_cached) on what the executable depends on: the module text
  without debug info (large constants printed in full), the device ids, the serialized compile
  options and the backend; an identical program reuses the executable compiled for it (an LRU
  of `max_entries`). Modules with host callbacks (io_callback, pure_callback, Pallas interpret
  mode) or resource blobs always compile. Test-only: the library never shares executables."""
  import collections
  import hashlib

  import functools

  from jax._src import compiler
  compile_or_get_cached = compiler.compile_or_get_cached
  cache = collections.OrderedDict()

  def _compile_uncached(backend, computation, devices, compile_options, host_callbacks, *_,
                        executable_devices, **__):
    return compiler.backend_compile_and_load(backend, computation, executable_devices,
                                             compile_options, host_callbacks)

  def compile_or_reuse(backend, computation, devices, compile_options, host_callbacks, *args,
                       **kwargs):
    if devices.size > 1 or host_callbacks:  # never through the persistent cache: the module
      # docstring says why for several devices; a host callback is this process's Python object
      compile_ = functools.partial(_compile_uncached, executable_devices=args[0])
    else:
      compile_ = compile_or_get_cached
    if host_callbacks:
      return compile_(backend, computation, devices, compile_options, host_callbacks, *args,
                      **kwargs)
    text = computation.operation.get_asm(enable_debug_info=False, large_elements_limit=None)
    if "dense_resource" in text:
      return compile_(backend, computation, devices, compile_options, host_callbacks, *args,
                      **kwargs)
    key = (hashlib.sha256(text.encode()).digest(), tuple(d.id for d in devices.flat),
           compile_options.SerializeAsString(), id(backend))
    if key in cache:
      cache.move_to_end(key)
      if _REUSE_HOOK:  # CONDATTN_TRACE_COUNTS: a program traced and lowered again
        _REUSE_HOOK[0](str(computation.operation.attributes["sym_name"]).strip('"'))
      return cache[key]
    out = cache[key] = compile_(backend, computation, devices, compile_options, host_callbacks,
                                *args, **kwargs)
    if len(cache) > max_entries:
      cache.popitem(last=False)
    return out

  compiler.compile_or_get_cached = compile_or_reuse


_REUSE_HOOK = []  # CONDATTN_TRACE_COUNTS sets it: called with a reused program's name
_reuse_identical_compilations()

# Python's cyclic garbage collector: tracing and lowering allocate millions of short-lived
# objects, and with the default thresholds (2000, 10, 10) a test process runs a young collection
# every 2000 net allocations and rescans its old generation (every jaxpr and executable it
# keeps) often. Young collections 25x less often; a full one still every 10M allocations, so
# memory stays bounded. Collection timing only: the same results.
gc.set_threshold(50_000, 20, 10)


# ------------------------------------------------------------------ file order and durations
# `make test` hands whole files to its 2 workers in collection order (--dist loadfile
# --no-loadscope-reorder): longest first, so both workers end together (a long file handed out
# last would end the run alone on one worker). tests/durations.json holds each file's CPU seconds
# (the pytest process and the subprocesses it waited for: a measure the host's load barely moves)
# from the last `make durations` run.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
RECORD_ENV = "CONDATTN_RECORD_DURATIONS"  # set (to 1) -> this run's files' CPU s merged into it


def _recorded_durations() -> dict:
  try:
    with open(DURATIONS) as f:
      return json.load(f)["cpu_s"]
  except (OSError, ValueError, KeyError):
    return {}


def _file_key(path) -> str:
  return os.path.relpath(str(path), os.path.dirname(os.path.dirname(DURATIONS)))


UNLISTED_S = 20.0  # a file tests/durations.json does not list (yet): about the mean file


def pytest_collection_modifyitems(config, items):
  """Files longest first by tests/durations.json; a file it does not list (a new one) first if it
  holds a slow test, else as if it took UNLISTED_S. Tests keep their order within a file."""
  recorded = _recorded_durations()
  slow = {item.path for item in items if item.get_closest_marker("slow")}

  def seconds(path):
    key = _file_key(path)
    return recorded[key] if key in recorded else float("inf") if path in slow else UNLISTED_S
  items.sort(key=lambda item: -seconds(item.path))


# A test file that imports another file's module-cached programs runs in that file's scope under
# `--dist loadfile` (make test): on the same worker, so the programs are compiled once (else the
# importing file's worker traces, lowers and compiles them again).
SHARED_SCOPE = {"tests/schemes/test_serving.py": "tests/schemes/test_conformance.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadfile":
    return None  # xdist's own scheduler
  from xdist.scheduler import LoadFileScheduling

  class SharedScopeScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
      file = nodeid.split("::", 1)[0]
      return SHARED_SCOPE.get(file, file)
  return SharedScopeScheduling(config, log)


def _cpu_seconds() -> float:
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


_measured = collections.defaultdict(float)  # file -> CPU s in this process


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Under CONDATTN_RECORD_DURATIONS: each test's CPU seconds (setup, call and teardown: a
  module fixture counts in its file's first test), summed per file."""
  if not os.environ.get(RECORD_ENV):
    yield
    return
  t0 = _cpu_seconds()
  yield
  _measured[_file_key(item.path)] += _cpu_seconds() - t0


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist: a worker's per-file seconds reach the controller
  for f, s in json.loads(getattr(node, "workeroutput", {}).get("condattn_cpu_s", "{}")).items():
    _measured[f] += s


def pytest_sessionfinish(session, exitstatus):
  if not os.environ.get(RECORD_ENV):
    return
  if hasattr(session.config, "workerinput"):  # an xdist worker: hand the numbers over
    session.config.workeroutput["condattn_cpu_s"] = json.dumps(_measured)
    return
  recorded = _recorded_durations()
  recorded.update({f: round(s, 1) for f, s in _measured.items()})
  with open(DURATIONS, "w") as f:
    json.dump({"about": "CPU seconds per test file (tests/conftest.py orders files by them); "
                        "refresh: make durations",
               "cpu_s": dict(sorted(recorded.items(), key=lambda kv: -kv[1]))}, f, indent=1)
    f.write("\n")


# ------------------------------------------------------------------ where tracing repeats
TRACES_ENV = "CONDATTN_TRACE_COUNTS"  # set to a path -> per file: jit traces / lowerings / compiles
_TRACE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                 "/jax/core/compile/backend_compile_duration": "compile"}
_traces = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
_current_file = [None]


if os.environ.get(TRACES_ENV):
  def _count_trace(event, seconds, fun_name=None, **_):
    if event in _TRACE_EVENTS and _current_file[0]:
      entry = _traces[_current_file[0]][f"{_TRACE_EVENTS[event]} {fun_name}"]
      entry[0] += 1
      entry[1] += seconds
  jax.monitoring.register_event_duration_secs_listener(_count_trace)

  def _count_reuse(name):  # an identical program compiled before: its trace + lower repeated
    if _current_file[0]:
      _traces[_current_file[0]][f"reused {name}"][0] += 1
  _REUSE_HOOK.append(_count_reuse)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  _current_file[0] = _file_key(item.path)
  yield


def pytest_unconfigure(config):
  """The run's shared compilation cache removed by the process that made it. Under
  CONDATTN_TRACE_COUNTS=<path>: per test file, each jit-traced / lowered / compiled
  function's count and seconds in this process (tests of one process; subprocesses not
  counted), and 'reused <module>': how often a program identical to one compiled before was
  traced and lowered again (its compile skipped by _reuse_identical_compilations), most seconds
  first, appended to <path> as one JSON line per process."""
  if _OWNS_SHARED_CACHE:
    shutil.rmtree(os.environ[SHARED_CACHE_ENV], ignore_errors=True)
  path = os.environ.get(TRACES_ENV)
  if not path or not _traces:
    return
  with open(path, "a") as f:
    for file, entries in _traces.items():
      rows = sorted(((k, n, round(s, 2)) for k, (n, s) in entries.items()), key=lambda r: -r[2])
      f.write(json.dumps({"file": file, "pid": os.getpid(), "functions": rows}) + "\n")
