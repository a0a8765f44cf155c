"""bench/command_buffers.py: XLA's command-buffer log read per call, and the donated-logits
variant's stable addresses (what lets XLA:GPU skip re-recording a decode step's graph)."""
from bench import command_buffers as cb

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
  written over them, and the donated cache never moves."""
  rows = {(r["variant"], r["mode"]): r for r in cb.measure(
      "dense", "tiny-qwen", 64, calls=2, warmup=1, log=lambda *_: None)}
  assert set(rows) == {(v, m) for v in ("default", "donate_logits") for m in ("bench", "bare")} | {
      ("steady", "steady"), ("steady_noaux", "steady")}
  for (variant, _), r in rows.items():
    assert r["logits_finite"] and r["wall_ms"] > 0 and r["cache_addresses_stable"]
    assert r["logits_address_stable"] == (variant != "default")
