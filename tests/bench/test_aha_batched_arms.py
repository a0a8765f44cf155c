"""Several until-plateau arms in one jitted program (bench/aha_elastic_repro_common.py:
`train_arms_to_plateau`, `plateau_arms_loop`): each arm's numbers equal its own training's
(`train_to_plateau`), an arm at plateau is masked while the others go on, and a run cut at a
check and resumed from its saved state equals the uninterrupted one."""
import dataclasses
import functools
import json

import numpy as np
import pytest

from bench import aha_elastic_repro_common as rc
from bench import aha_repro as bench


def _arms_loop(fns, recipe=1500, cap=12000, every=300):
  """plateau_arms_loop on made-up curves fns[i](step) -> {metric: value}; also the arms each
  advance was given."""
  sts = [dict(curves={k: [] for k in f(0)}, checks=[], steps=0, at_plateau=False) for f in fns]
  seen = []

  def advance(on, a, b):
    seen.append((a, tuple(on)))
    for i in on:
      for t in range(a, b):
        for k, v in fns[i](t).items():
          sts[i]["curves"][k].append(v)
  out = rc.plateau_arms_loop(sts, advance, recipe_steps=recipe, cap=cap, check_every=every,
                             log=lambda *a: None)
  return out, seen


def test_an_arm_at_plateau_is_masked_while_the_others_go_on():
  """Three made-up arms on one step counter (flat: plateau at the recipe's end; a floor: stops
  at its first check under 1%; a steady decay: runs to the cap) each end exactly as the
  one-arm rule (plateau_loop) ends it alone, and a stopped arm is no longer advanced."""
  fns = [lambda t: {"accuracy": 1.0},
         lambda t: {"mu_f": 0.004 + 0.02 * np.exp(-t / 300)},
         lambda t: {"accuracy": 1.0, "mu_f": 0.02 * np.exp(-t / 3000)}]
  out, seen = _arms_loop(fns)
  for f, o in zip(fns, out):
    alone, _ = _arms_loop([f])
    assert o == alone[0]
    st = dict(curves={k: [] for k in f(0)}, checks=[], steps=0, at_plateau=False)

    def adv(a, b, st=st, f=f):
      for t in range(a, b):
        for k, v in f(t).items():
          st["curves"][k].append(v)
    assert rc.plateau_loop(st, adv, recipe_steps=1500, cap=12000, check_every=300,
                           log=lambda *a: None) == o
  assert [o["stopped"] for o in out] == ["plateau", "plateau", "cap"]
  assert out[0]["steps"] == 1500 and 1500 < out[1]["steps"] < 12000 == out[2]["steps"]
  assert [len(o["curves"][next(iter(o["curves"]))]) for o in out] == [o["steps"] for o in out]
  assert seen[0] == (0, (0, 1, 2)) and seen[1] == (1500, (1, 2))
  assert all(on == (2,) for a, on in seen if a >= out[1]["steps"])


def _tiny_arms(s):
  """Three AHA arms of the `test` preset's task (one layer, batch 4): seeds 0 and 1 at lambda
  3e-2 (one vmapped group: RNG-free exact mode), seed 0 at lambda 1e-1 (its own group, reading
  seed 0's batches: the same data key)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from condattn_jax.attention import configure
  from condattn_jax.models.decoder import Decoder
  arms = []
  for seed, lam in ((0, 3e-2), (1, 3e-2), (0, 1e-1)):
    task = bench.RestatedRecall(s, 16, seed)
    cfg = bench.base_config(s, task)
    dense = jax.tree.map(np.asarray, nn.unbox(Decoder(cfg).init(
        jax.random.key(seed), jnp.zeros((1, s.seq_len), jnp.int32))["params"]))
    _, _, _, acfg0, ap0 = bench._window(s, seed, 16, dense)
    arms.append(rc.Arm(f"s{seed} lam{lam}", configure(acfg0, "aha", lam=lam),
                       bench._aha_tc(s, s.aha_steps, s.aha_lr, seed), ap0,
                       functools.partial(bench.task_batch, task, s.batch_size, 10),
                       metrics=("accuracy", "aha/mu_f"), data=("w16", seed),
                       at_recipe_end=lambda p: {"bias": np.asarray(
                           p["layers"]["router"]["bias"]).tolist()}))
  return arms


@pytest.mark.manual
def test_batched_arms_equal_separate_runs_and_resume_equals_uninterrupted():
  """K arms in one program == each trained alone by train_to_plateau (curves, checks, params
  and recipe-end numbers to float tolerance: vmapped matmuls); cut after its first check
  (Budget, state saved) and resumed, the program ends exactly where the uninterrupted one does
  (~80 CPU-s). Default cover: test_batched_units_store_the_one_arm_units_records (the same
  through aha_repro's units, resumed, to float tolerance)."""
  import jax
  s = dataclasses.replace(bench.PRESETS["test"], num_layers=1, batch_size=4, aha_steps=3)
  arms = _tiny_arms(s)
  assert rc.arm_groups(arms) == [[0, 1], [2]]
  kw = dict(cap=7, check_every=2, log=lambda *a: None)
  together = rc.train_arms_to_plateau(arms, **kw)
  for a, (p, curves, info) in zip(arms, together):
    p1, c1, i1 = rc.train_to_plateau(a.cfg, a.params, a.tc, a.batch_fn, metrics=a.metrics,
                                     at_recipe_end=a.at_recipe_end, **kw)
    np.testing.assert_allclose(info["recipe_end"]["bias"], i1["recipe_end"]["bias"], atol=1e-5)
    assert [c[0] for c in info["checks"]] == [c[0] for c in i1["checks"]]
    assert info["stopped"] == i1["stopped"] and info["steps"] == i1["steps"]
    for k in a.metrics:
      np.testing.assert_allclose(curves[k], c1[k], rtol=1e-4, atol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), p, p1)
  saved = {}
  with pytest.raises(rc.Budget):
    rc.train_arms_to_plateau(arms, save=lambda d: saved.update(d=d), budget_s=0, **kw)
  assert [st["steps"] for st in saved["d"]["arms"]] == [3, 3, 3]
  resumed = rc.train_arms_to_plateau(arms, resume=saved["d"], **kw)
  for (p, c, i), (q, d, j) in zip(together, resumed):
    assert c == d and i == j
    jax.tree.map(np.testing.assert_array_equal, p, q)


def test_batch_pool_gives_the_batches_of_the_function():
  """BatchPool with worker processes returns fns[key](i) for every key and step (asked in the
  trainer's order: steps increasing, keys interleaved), as without workers."""
  fns = {"a": functools.partial(np.full, (2, 3)), ("w16", 1): functools.partial(np.arange)}
  want = [(k, i, fns[k](i)) for i in range(6) for k in fns]
  with rc.BatchPool(fns, workers=2, ahead=3) as pool:
    for k, i, x in want:
      np.testing.assert_array_equal(pool.get(k, i), x)
  with rc.BatchPool(fns) as pool:
    assert pool.get("a", 4).tolist() == [[4] * 3] * 2


def _close(a, b, path=""):
  """a == b, floats to rtol 1e-3 (the batched arms' vmapped matmuls)."""
  if isinstance(a, dict):
    assert set(a) == set(b), path
    for k in a:
      _close(a[k], b[k], f"{path}.{k}")
  elif isinstance(a, list):
    assert len(a) == len(b), path
    for i, (x, y) in enumerate(zip(a, b)):
      _close(x, y, f"{path}[{i}]")
  elif isinstance(a, float) and not isinstance(a, bool):
    assert abs(a - b) <= 1e-3 * abs(b) + 1e-5, (path, a, b)
  else:
    assert a == b, (path, a, b)


def test_batched_units_store_the_one_arm_units_records(tmp_path):
  """aha_repro --arms (run_batched): two seeds' window, lambda-sweep and static units trained
  as batched programs under the until-plateau rule (the first cut at its budget after one
  check and resumed) store the records the one-arm --part runs store (every number to float
  tolerance, every plateau decision and step count equal); the static control needs its
  seed's window unit from an earlier batch."""
  import shutil
  s = dataclasses.replace(bench.PRESETS["test"], num_layers=1, batch_size=4, aha_steps=3,
                          aha_cap=7, plateau_check_every=2, lams=(1e-2, 3e-2), seeds=(0, 1),
                          static_lrs=(1e-3, 3e-3), generated_rows=0)
  bench.PRESETS["test_batched"] = s
  try:
    one, many = tmp_path / "one", tmp_path / "many"
    argv = ["--preset=test_batched", "--seeds=0,1"]
    for seed in (0, 1):
      bench.main(["--preset=test_batched", f"--seeds={seed}", f"--work_dir={one}",
                  "--part=" + ",".join(bench.units(s, seed))])
    many.mkdir()
    for f in one.glob("*_dense.*"):
      shutil.copy(f, many)
    with pytest.raises(ValueError, match="static reads w16"):
      bench.main(argv + ["--arms=w16,static", f"--work_dir={many}"])
    with pytest.raises(SystemExit) as e:   # cut after its first check, state saved
      bench.main(argv + ["--arms=w16,w16_lam0.01", f"--work_dir={many}", "--dense_budget_s=0"])
    assert e.value.code == 3 and list(many.glob("*_arms_*_state.pkl"))
    out = bench.main(argv + ["--arms=w16,w16_lam0.01", f"--work_dir={many}"])   # goes on
    assert out["arms"] == 3 and sorted(out["units"]) == [(0, "w16"), (0, "w16_lam0.01"),
                                                        (1, "w16")]
    assert bench.main(argv + ["--arms=static", f"--work_dir={many}"])["arms"] == 4
    for seed in (0, 1):
      for u in bench.units(s, seed)[1:]:
        a = rc.Store("aha_repro", "test_batched", s, seed, str(many)).get(u)
        b = rc.Store("aha_repro", "test_batched", s, seed, str(one)).get(u)
        _close(json.loads(json.dumps(a)), json.loads(json.dumps(b)), f"s{seed}.{u}")
  finally:
    del bench.PRESETS["test_batched"]


@pytest.mark.manual
def test_batched_program_batches_the_cuda_kernels():
  """The h100 preset's batched program lowered for CUDA from this host (~40 CPU-s): the same
  attention kernel launches for 3 arms as for 1 (vmap batches them over the arms, no loop of
  copies). Default cover: none (no GPU here; the GPU's own step times are the check)."""
  one, three = (bench.cross_lowered_kernels("h100", k) for k in (1, 3))
  assert one and one == three
