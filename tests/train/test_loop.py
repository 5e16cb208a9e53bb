"""The training loop end to end on a small tiny-preset stage (5 layers, 64 tokens, 5 steps):
exact resume after SIGTERM, fallback over a truncated checkpoint, a NaN loss stops the run."""

import os
import signal

import pytest

from sparse_lm.train import loop
from sparse_lm.train.checkpoint import Checkpointer
from tests.train.conftest import small_stage


def _sigterm_at(step_to_signal):
  def on_step(step, scalars):
    del scalars
    if step == step_to_signal:
      os.kill(os.getpid(), signal.SIGTERM)
  return on_step


def test_sigterm_resume_and_truncated_fallback_are_bit_exact(workdir, tmp_path_factory):
  stage = small_stage()
  other = tmp_path_factory.mktemp("uninterrupted")
  (other / "tokenizer.json").write_bytes((workdir / "tokenizer.json").read_bytes())
  full = loop.run(stage, other, progress=False)
  assert sorted(full.losses) == [0, 1, 2, 3, 4]
  assert not full.preempted and full.end_step == 5

  first = loop.run(stage, workdir, progress=False, on_step=_sigterm_at(1))
  assert first.preempted and 2 <= first.end_step < 5
  stop = first.end_step
  ckpt_dir = workdir / stage.name / "checkpoints"
  assert stop in Checkpointer(ckpt_dir).all_steps()
  second = loop.run(stage, workdir, progress=False)
  assert second.start_step == stop and second.end_step == 5
  resumed = {**first.losses, **second.losses}
  assert resumed == full.losses  # exact float equality, step by step
  assert second.final_eval == full.final_eval

  # Truncate the final checkpoint: the next run warns, falls back to the one before and
  # replays the last steps with the same losses.
  steps = Checkpointer(ckpt_dir).all_steps()
  assert steps[-1] == 5 and len(steps) >= 2
  for f in (ckpt_dir / "5" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  with pytest.warns(RuntimeWarning, match="falling back"):
    third = loop.run(stage, workdir, progress=False)
  assert third.start_step == steps[-2]
  assert third.losses == {s: full.losses[s] for s in range(steps[-2], 5)}


def test_nan_loss_stops_and_keeps_last_good_checkpoint(workdir):
  stage = small_stage(nan_at_step=3)
  with pytest.raises(loop.NonFiniteLossError, match=r"at step 3 .*last good checkpoint is step 2"):
    loop.run(stage, workdir, progress=False)
  assert Checkpointer(workdir / stage.name / "checkpoints").all_steps() == [2]
