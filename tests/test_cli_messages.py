"""Error messages a newcomer meets with a slightly wrong path or stage (2026-12-07): they name
what to type instead. Nothing is compiled or restored."""

import types

import pytest


def test_load_of_a_missing_stage_names_that_stage_in_its_hint(tmp_path):
  from sparse_lm.train import load
  with pytest.raises(FileNotFoundError) as e:
    load(tmp_path / "w", "stage_64k")
  assert "python -m experiments.stage_64k --workdir=" in str(e.value), str(e.value)


def test_generate_checkpoint_of_the_checkpoints_dir_lists_its_steps(tmp_path):
  from sparse_lm.generate import load_checkpoint
  ckpts = tmp_path / "stage_8k" / "checkpoints"
  for step in (50, 200, 150):
    (ckpts / str(step)).mkdir(parents=True)
  with pytest.raises(FileNotFoundError) as e:
    load_checkpoint(ckpts)
  msg = str(e.value)
  assert "expected a step directory" in msg and "50, 150, 200" in msg, msg
  assert f"--checkpoint {ckpts / '200'}" in msg, msg
  with pytest.raises(FileNotFoundError) as e:  # a directory without steps: no list
    load_checkpoint(tmp_path / "stage_8k")
  assert "expected a step directory" in str(e.value) and "saved there" not in str(e.value)


def test_a_missing_init_from_stage_is_reported_without_creating_its_directory(tmp_path):
  """stage_64k in a workdir without stage_8k stopped with the right message but left an empty
  `stage_8k/checkpoints/` behind (the previous stage's Checkpointer created it)."""
  from experiments import stage_64k
  from sparse_lm.train import loop
  with pytest.raises(FileNotFoundError) as e:
    parts = types.SimpleNamespace(tx=None, state_shardings=None)  # not reached
    loop._init_from(stage_64k.TINY, tmp_path, None, None, None, parts, print)
  assert "python -m experiments.stage_8k" in str(e.value), str(e.value)
  assert not (tmp_path / "stage_8k").exists()


def test_a_resumed_stage_warns_when_its_init_from_stage_has_moved_on(tmp_path):
  """stage_64k run before stage_8k finished starts from stage_8k's newest step (with a
  warning); once stage_8k is finished, rerunning stage_64k silently resumed its own checkpoints
  from the older weights. The start is now recorded in the meta and a resume warns."""
  from sparse_lm.train import loop
  ckpts = tmp_path / "stage_8k" / "checkpoints"
  for step in (150, 175):
    (ckpts / str(step)).mkdir(parents=True)
  (ckpts / "200.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save is not a step
  record = {"stage": "stage_8k", "step": 175, "final": False}
  mine = tmp_path / "stage_64k" / "checkpoints"
  assert loop.init_from_moved_on("stage_64k", tmp_path, record, mine) is None
  (ckpts / "200").mkdir()
  msg = loop.init_from_moved_on("stage_64k", tmp_path, record, mine)
  assert msg and "stage_8k step 175" in msg and "step 200 now" in msg and str(mine) in msg, msg
  assert loop.init_from_moved_on("stage_64k", tmp_path, {**record, "final": True}, mine) is None
  assert loop.init_from_moved_on("stage_64k", tmp_path, {}, mine) is None
  assert loop.INIT_RECORD == "init_from_checkpoint"
