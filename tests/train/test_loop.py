"""The training loop end to end on a small tiny-preset stage (3 layers, 64 tokens, 5 steps):
exact resume after Ctrl-C (SIGINT), fallback over a truncated checkpoint that is then replaced,
configs compared on resume, the workdir lock, plain progress lines and routing health in
metrics.jsonl, `sparse_lm.train.load`, a NaN loss stops the run."""

import dataclasses
import gc
import json
import os
import re
import signal
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import sparse_lm.train
from sparse_lm.model.loss import loss_fn
from sparse_lm.train import loop
from sparse_lm.train.checkpoint import UNREADABLE_DIR, Checkpointer, ConfigMismatchError
from sparse_lm.train.metrics import Alerts
from sparse_lm.train.workdir import WorkdirLock, WorkdirLockedError
from tests.train.conftest import small_stage


def _signal_at(step_to_signal, signum=signal.SIGINT):
  def on_step(step, scalars):
    del scalars
    if step == step_to_signal:
      os.kill(os.getpid(), signum)
  return on_step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_step0_eval_stops_before_the_first_step(workdir, monkeypatch,
                                                                    capsys, signum):
  """Ctrl-C or SIGTERM while the run compiles and evaluates step 0 (tens of seconds, minutes
  at scale): the run stops before its first step with a line saying so (it was a
  KeyboardInterrupt traceback from the compiler, or a silent death by SIGTERM); the same
  command then trains the stage."""
  evaluate = loop._StageLoop.evaluate  # pylint: disable=protected-access

  def signalled(self, state, step, *args, **kwargs):
    if step == 0:
      os.kill(os.getpid(), signum)
    return evaluate(self, state, step, *args, **kwargs)

  stage = small_stage(steps=2)
  with monkeypatch.context() as m:
    m.setattr(loop._StageLoop, "evaluate", signalled)  # pylint: disable=protected-access
    first = loop.run(stage, workdir, progress=False)
  assert first.preempted and first.end_step == 0 and first.losses == {}
  out = capsys.readouterr().out
  assert (f"[stage_8k] {signal.Signals(signum).name} before step 0 (during the compiles and "
          "the step-0 eval): stopped with nothing new to save; no checkpoint of this stage "
          "was saved; run the same command again to start the stage.") in out, out
  # the same signal during the end-of-stage held-out losses (after the final save): a line
  # saying so (it was a KeyboardInterrupt traceback, or a silent death by SIGTERM); the same
  # command then redoes them from the final checkpoint
  finish = loop._StageLoop.finish  # pylint: disable=protected-access

  def finish_signalled(self, state, end):
    os.kill(os.getpid(), signum)
    return finish(self, state, end)

  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  with monkeypatch.context() as m:
    m.setattr(loop._StageLoop, "finish", finish_signalled)  # pylint: disable=protected-access
    again = loop.run(stage, workdir, progress=False)
  assert again.preempted and again.start_step == 0 and again.end_step == 2
  assert again.final_eval == {} and len(again.losses) == 2
  out = capsys.readouterr().out
  assert (f"[stage_8k] {signal.Signals(signum).name} during the end-of-stage held-out losses "
          "and sample: stopped; the final checkpoint (step 2) is saved to ") in out, out
  assert {s: signal.getsignal(s) for s in handlers} == handlers  # the handlers are restored
  done = loop.run(stage, workdir, progress=False)
  assert not done.preempted and done.start_step == done.end_step == 2
  assert sorted(done.final_eval) == ["eval_loss@128", "eval_loss@64"], done.final_eval


def test_sigint_resume_and_truncated_fallback_are_bit_exact(workdir, tmp_path_factory, capsys):
  stage = small_stage()
  other = tmp_path_factory.mktemp("uninterrupted")
  (other / "tokenizer.json").write_bytes((workdir / "tokenizer.json").read_bytes())
  full = loop.run(stage, other, progress=False, progress_every=2,
                  alerts=Alerts(max_mean_load=1.0))
  assert sorted(full.losses) == [0, 1, 2, 3, 4]
  assert not full.preempted and full.end_step == 5
  # Off a terminal: a plain line every 2 steps (and at the end) with the routing health. MFU
  # is "n/a" on a CPU (no peak rate) and a percentage on an accelerator with a known peak.
  out = capsys.readouterr().out
  mfu = r"MFU n/a" if jax.default_backend() == "cpu" else r"MFU [\d.]+%"
  lines = re.findall(r"\[stage_8k\] step (\d)/5  loss ([\d.]+)  [\d,]+ tok/s  " + mfu + r"  "
                     r"max/mean load ([\d.]+)  dead ([\d.]+)%  ETA", out)
  assert [int(l[0]) for l in lines] == [2, 4, 5], out
  assert [float(l[1]) for l in lines] == [round(full.losses[s - 1], 4) for s in (2, 4, 5)]
  # One routing warning per eval interval (eval_every=100: one) past the threshold.
  assert len(re.findall(r"warning at step \d: routing imbalance: max/mean expert load "
                        r"[\d.]+ > 1 in MoE layer \d", out)) == 1
  records = [json.loads(l) for l in (other / stage.name / "tb" / "metrics.jsonl").open()]
  train = [r for r in records if "train/loss" in r]
  assert [r["step"] for r in train] == [0, 1, 2, 3, 4]
  for r in train:
    assert r["train/moe/max_mean_load"] >= 1.0 and 0.0 <= r["train/moe/dead_frac_max"] <= 1.0
    assert r["train/moe/max_mean_load_layer"].startswith("MoE layer ")
  assert [float(l[2]) for l in lines] == [round(train[s - 1]["train/moe/max_mean_load"], 2)
                                          for s in (2, 4, 5)]

  gc.unfreeze()  # some environments freeze objects at import (375 on the H200 image)
  first = loop.run(stage, workdir, progress=False, on_step=_signal_at(1))  # Ctrl-C
  # the step loop's garbage-collector settings (loop._StepGC) are undone on the way out
  assert gc.isenabled() and gc.get_freeze_count() == 0
  assert first.preempted and 2 <= first.end_step < 5
  assert "SIGINT: saved step" in capsys.readouterr().out
  stop = first.end_step
  ckpt_dir = workdir / stage.name / "checkpoints"
  assert stop in Checkpointer(ckpt_dir).all_steps()
  second = loop.run(stage, workdir, progress=False)
  assert second.start_step == stop and second.end_step == 5
  resumed = {**first.losses, **second.losses}
  assert resumed == full.losses  # exact float equality, step by step
  assert second.final_eval == full.final_eval

  # Truncate the final checkpoint: the next run warns, falls back to the one before, replays
  # the last steps with the same losses, and saves step 5 again (the unreadable one is moved
  # aside); the following run and the next stage start from the new step 5.
  steps = Checkpointer(ckpt_dir).all_steps()
  assert steps[-1] == 5 and len(steps) >= 2
  for f in (ckpt_dir / "5" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  with pytest.warns(RuntimeWarning, match="falling back"):
    third = loop.run(stage, workdir, progress=False)
  assert third.start_step == steps[-2]
  assert third.losses == {s: full.losses[s] for s in range(steps[-2], 5)}
  assert [p.name.split("-")[0] for p in (workdir / stage.name / UNREADABLE_DIR).iterdir()] == ["5"]
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    fourth = loop.run(stage, workdir, progress=False)
  assert fourth.start_step == 5 and fourth.losses == {}
  assert fourth.final_eval == full.final_eval
  capsys.readouterr()
  nxt = dataclasses.replace(stage, name="stage_next", init_from=stage.name, steps=5)
  loop.run(nxt, workdir, progress=False, on_step=_signal_at(0))
  assert f"initialised from {stage.name} step 5 " in capsys.readouterr().out

  # The model of the stage in one call; its eval forward mutates nothing, so plain jax.jit.
  model, tokenizer, saved = sparse_lm.train.load(workdir, stage.name)
  assert saved == stage and tokenizer.to_json() == (workdir / "tokenizer.json").read_text()
  before = jax.tree.map(np.asarray, nnx.state(model))
  tokens = jnp.asarray([tokenizer.encode("def f(x):\n    return x")])
  logits = jax.jit(lambda t: model(t))(tokens)
  assert logits.shape == tokens.shape + (512,) and bool(jnp.all(jnp.isfinite(logits)))
  loss, metrics = loss_fn(model, {"tokens": tokens})  # the documented call evaluates
  assert np.isfinite(float(loss)) and float(metrics["num_tokens"]) == tokens.shape[1] - 1
  after = jax.tree.map(np.asarray, nnx.state(model))
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))


def test_resume_refuses_another_model_or_schedule_and_a_held_lock(workdir):
  stage = small_stage(steps=6)
  stopped = loop.run(stage, workdir, progress=False, on_step=_signal_at(1, signal.SIGTERM))
  assert stopped.preempted
  steps = Checkpointer(workdir / stage.name / "checkpoints").all_steps()
  with pytest.raises(ConfigMismatchError, match=r"steps: 6 \(saved\) vs 5 \(now\)"):
    loop.run(small_stage(steps=5), workdir, progress=False)
  with pytest.raises(ConfigMismatchError, match=r"num_layers: 3 \(saved\) vs 9 \(now\).*"
                     r"use a new workdir"):
    loop.run(dataclasses.replace(stage, model_overrides=()), workdir, progress=False)
  assert Checkpointer(workdir / stage.name / "checkpoints").all_steps() == steps  # untouched
  with WorkdirLock(workdir / stage.name):
    with pytest.raises(WorkdirLockedError, match=f"in use by another run: pid {os.getpid()} "):
      loop.run(stage, workdir, progress=False)
  # Another data seed: the saved data position belongs to another stream. Refused without
  # the flag (the schedule check names it); with it, the stage resumes and reads its new data
  # from the start (this used to stop on the data-iterator state, flag or not).
  reseeded = small_stage(steps=6, data=dataclasses.replace(stage.data, seed=7))
  with pytest.raises(ConfigMismatchError, match=r"seed"):
    loop.run(reseeded, workdir, progress=False)
  resumed = loop.run(reseeded, workdir, progress=False, allow_config_change=True)
  assert resumed.start_step == max(steps) and resumed.end_step == 6 and not resumed.preempted


def test_nan_loss_stops_and_keeps_last_good_checkpoint(workdir):
  stage = small_stage(nan_at_step=3)
  with pytest.raises(loop.NonFiniteLossError, match=r"at step 3 .*last good checkpoint is step 2"):
    loop.run(stage, workdir, progress=False)
  assert Checkpointer(workdir / stage.name / "checkpoints").all_steps() == [2]



class _StallingIterator:
  """The real training iterator until `stall_at` batches were read, then a stalled pipeline:
  the next `next()` blocks, sends SIGTERM to this process `kill_after` s into the block, and
  raises if released (the guard, after `guard_s`), so that a loop that cannot act on the
  signal fails the test instead of hanging it."""

  def __init__(self, real, stall_at: int, kill_after: float = 0.3, guard_s: float = 60.0):
    self.real, self.stall_at, self.kill_after, self.guard_s = real, stall_at, kill_after, guard_s
    self.n = 0
    self.release = threading.Event()
    self.killed_at: float | None = None

  def __next__(self):
    if self.n == self.stall_at:
      def kill():
        self.killed_at = time.perf_counter()
        os.kill(os.getpid(), signal.SIGTERM)
      threading.Timer(self.kill_after, kill).start()
      if self.release.wait(self.guard_s):
        raise RuntimeError("the stalled data iterator was released at the test's end")
      raise RuntimeError(
          f"the stalled data iterator was released by the test's guard after {self.guard_s} "
          "s: the loop did not act on SIGTERM while it waited for a batch (SIGTERM sent: "
          f"{self.killed_at is not None}; handler now: {signal.getsignal(signal.SIGTERM)})")
    self.n += 1
    return next(self.real)

  def get_state(self):
    return self.real.get_state()

  def set_state(self, state):
    self.real.set_state(state)

  def close(self):
    self.release.set()


def test_sigterm_while_the_data_pipeline_stalls_saves_and_stops(workdir, monkeypatch, capsys):
  """A data iterator that blocks forever before step 3's batch, and SIGTERM during the block:
  the run stops within seconds (it used to wait for the batch forever), saves step 3 with the
  data position before the batch it waited for (a resumed run reads exactly that batch), and
  returns preempted (the CLI exits 0). A stall before a run's first step stops without a save."""
  stage = small_stage()
  real_make = loop.data_lib.make_train_iterator
  made = []

  def stalling(stall_at):
    def make(*args, **kwargs):
      made.append(_StallingIterator(real_make(*args, **kwargs), stall_at))
      return made[-1]
    return make

  previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a stray SIGTERM spares pytest
  try:
    monkeypatch.setattr(loop.data_lib, "make_train_iterator", stalling(3))
    first = loop.run(stage, workdir, progress=False)
    returned = time.perf_counter()
    assert made[-1].killed_at is not None and returned - made[-1].killed_at < 10.0
    assert first.preempted and first.end_step == 3 and sorted(first.losses) == [0, 1, 2]
    out = capsys.readouterr().out
    assert re.search(r"\[stage_8k\] SIGTERM while waiting [\d.]+ s for the batch of step 3 "
                     r"\(the data pipeline is stalled or slow\): saved step 3 to ", out), out
    ckpt = Checkpointer(workdir / stage.name / "checkpoints")
    assert ckpt.all_steps() == [2, 3]
    # The saved position is the one before the batch the loop waited for: the 4th batch.
    data = ckpt._mgr.restore(  # pylint: disable=protected-access
        3, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
    ckpt.close()
    tokenizer = loop.data_lib.load_or_train_tokenizer(stage.data, str(workdir), 512)
    kwargs = dict(seq_len=stage.seq_len, batch_size=stage.global_batch)
    resumed_it = real_make(stage.data, tokenizer, **kwargs)
    resumed_it.set_state(data["shards"]["0"])
    fresh = real_make(stage.data, tokenizer, **kwargs)
    for _ in range(3):
      next(fresh)
    want, got = next(fresh), next(resumed_it)
    assert all(np.array_equal(want[k], got[k]) for k in want)

    # Stalled before the resumed run's first step: nothing new to save; it says so and stops.
    monkeypatch.setattr(loop.data_lib, "make_train_iterator", stalling(0))
    second = loop.run(stage, workdir, progress=False)
    assert second.preempted and second.start_step == second.end_step == 3
    assert re.search(r"SIGTERM while waiting [\d.]+ s for the batch of step 3 .*: stopped "
                     r"without saving \(no step was trained since the start\); the last "
                     r"checkpoint is step 3 in ", capsys.readouterr().out)
  finally:
    for it in made:
      it.release.set()  # the abandoned fetches' threads end
    signal.signal(signal.SIGTERM, previous)
  monkeypatch.undo()
  third = loop.run(stage, workdir, progress=False)
  assert third.start_step == 3 and third.end_step == 5 and not third.preempted
