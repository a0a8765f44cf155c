"""bench/command_buffers.py: XLA's command-buffer log read per call, and the donated-logits
variant's stable addresses (what lets XLA:GPU skip re-recording a decode step's graph)."""
import gzip
import os

from bench import command_buffers as cb
from bench import common

# XLA:GPU's lines (command_buffer_thunk.cc / the command executor), as a GPU run printed them
LOG = """I1129 12:27:36 command_buffer_thunk.cc:245] Initialize command buffer on device #0 by recoding command buffer cmd sequence; num_commands=542
@@cb_mark dense.default.bare start
I1129 command_buffer_thunk.cc:340] [0] Update command buffer on device #0 by recoding command buffer cmd sequence after 1 executions since last update; num_commands=542; updated_allocs=2
I1129 command_buffer_cmd.cc:300] Skip updating command LaunchCmd
I1129 command_buffer_cmd.cc:300] Skip updating command LaunchCmd
I1129 command_buffer_thunk.cc:362] [0] Updated command buffer in 812 μs; num_commands=542
I1129 command_buffer_thunk.cc:370] [0] Execute command buffer on device #0; num_executions=1
I1129 command_buffer_thunk.cc:370] [0] Execute command buffer on device #0; num_executions=2
@@cb_mark dense.default.bare end
I1129 command_buffer_thunk.cc:340] [0] Update command buffer on device #0 by recoding command buffer cmd sequence after 1 executions since last update; num_commands=542; updated_allocs=9
"""


def test_the_log_is_read_between_the_marks():
  seg = cb.parse_log(LOG)["dense.default.bare"]
  assert (seg["executions"], seg["updates"], seg["skipped"]) == (2, 1, 2)
  assert seg["updated_allocs"] == [2] and seg["update_us"] == [812]
  s = cb._summary(seg, calls=2)
  assert s["num_commands"] == 542 and s["rerecorded_per_update"] == 540
  assert s["update_ms_per_call"] == 0.406 and s["updated_allocs"] == 2
  assert cb._summary(None, 2) == {"vlog": False}


def test_donated_logits_keep_their_address_and_the_cache_keeps_its_own():
  """On any backend: the engine's step writes new logits elsewhere every call (XLA:GPU then
  re-records the commands that use them); with the previous logits donated the new ones are
  written over them (the engine's greedy step too), and the donated cache never moves."""
  rows = {(r["variant"], r["mode"]): r for r in cb.measure(
      "dense", "tiny-qwen", 64, calls=2, warmup=1, log=lambda *_: None)}
  assert set(rows) == {(v, m) for v in ("default", "donate_logits") for m in ("bench", "bare")} | {
      ("steady", "steady"), ("steady_noaux", "steady"), ("greedy_step", "steady")}
  for (variant, _), r in rows.items():
    assert r["logits_finite"] and r["wall_ms"] > 0 and r["cache_addresses_stable"]
    assert r["logits_address_stable"] == (variant != "default")


def test_the_registered_rule_takes_the_smallest_change_that_holds_everywhere():
  """CB_RULE (registered before the bench first ran): the first variant, smallest change first,
  whose command-buffer updates and host time fall below its bounds for every scheme."""
  row = lambda s, v, m, updates, host: dict(scheme=s, variant=v, mode=m, updates=updates,
                                            host_ms=host, calls=20, vlog=True,
                                            logits_finite=True)
  rows = [row("dense", "default", "bench", 20, 2.0), row("l2a", "default", "bench", 20, 3.0),
          row("dense", "donate_logits", "bench", 0, 1.0),     # holds for dense only
          row("l2a", "donate_logits", "bench", 20, 2.9),
          row("dense", "steady", "steady", 1, 0.3), row("l2a", "steady", "steady", 2, 0.5),
          row("dense", "steady_noaux", "steady", 0, 0.2),
          row("l2a", "steady_noaux", "steady", 0, 0.2)]
  d = cb.decide(rows)
  assert d["adopt"] == "steady" and d["holds"]["donate_logits"] == {"dense": True, "l2a": False}
  rows[5]["host_ms"] = 2.5                      # steady's host time not cut enough for l2a
  assert cb.decide(rows)["adopt"] == "steady_noaux"
  assert cb.decide([dict(r, updates=20) for r in rows])["adopt"] is None


def test_the_stored_prototype_logs_hold_the_documented_updates():
  """The H200 logs behind docs/performance.md's "host-bound" section (bench/results/
  command_buffers_prototype_NVIDIA_H200/, the prototype of this bench: 20 calls a loop after 5,
  its own markers): every call updated the one command buffer, at the update times quoted."""
  d = os.path.join(common.RESULTS, "command_buffers_prototype_NVIDIA_H200")
  quoted = {"default_flags": {"dense": (0.86, 0.95), "l2a": (1.28, 1.44),
                              "elastic": (1.41, 1.64)},
            "skip_temp": {"dense": (2.27, 2.80), "l2a": (5.65, 6.12), "elastic": (1.74, 1.95)}}
  for name, want in quoted.items():
    with gzip.open(os.path.join(d, name + ".log.gz"), "rt") as f:
      segs = cb.parse_log(f.read(), mark="@@MARK")
    for scheme, (lo, hi) in want.items():
      ms = []
      for mode in ("bench", "bare"):
        seg = segs[f"{scheme} {mode}"]
        assert seg["executions"] == seg["updates"] == 20, (name, scheme, mode)
        ms.append(round(sum(seg["update_us"]) / 20 / 1e3, 2))
      assert (min(ms), max(ms)) == (lo, hi), (name, scheme, ms)
      if name == "default_flags":  # one buffer of the step's commands; 2 allocations moved
        bare = cb._summary(segs[f"{scheme} bare"], 20)
        assert bare["num_commands"] == {"dense": 542, "l2a": 969, "elastic": 746}[scheme]
        assert bare["updated_allocs"] == 2


def test_the_recorded_h200_run_adopted_the_steady_step():
  """bench/results/command_buffers_NVIDIA_H200.json's first run (cb_first, 32K, dense and L2A):
  the engine's step updated its command buffer on every call; the steady step (every changing
  input donated state) on none, at a fraction of the host time; CB_RULE's verdict recorded in the
  run is what `decide` gives on its rows today."""
  data = common.load(os.path.join(common.RESULTS, "command_buffers_NVIDIA_H200.json"))
  run = next(r for r in data["runs"] if r["settings"]["name"] == "cb_first")
  rows = {(r["scheme"], r["variant"], r["mode"]): r for r in run["rows"]}
  for s in ("dense", "l2a"):
    base, steady = rows[(s, "default", "bench")], rows[(s, "steady", "steady")]
    assert base["updates"] == base["calls"] == 20 and steady["updates"] == 0
    assert steady["host_ms"] < 0.3 * base["host_ms"] and steady["wall_ms"] < base["wall_ms"]
  assert run["decision"] == cb.decide(run["rows"]) and run["decision"]["adopt"] == "steady"
