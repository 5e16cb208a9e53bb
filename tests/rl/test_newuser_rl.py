"""`python -m experiments.agentic_rl` as a newcomer meets it (2026-12-07): finding the --set keys,
flags that disagree with a --set, an init_from that does not exist or holds another preset's
model, a read-only workdir and a Ctrl-C before the first step. Each ends in one line naming the
flag and the fix, with a nonzero status, before anything is compiled (no tracebacks).

Nothing is compiled: `trainer.run` and the model build are stand-ins where the CLI gets that far.
"""

import dataclasses
import errno
import re

import jax.numpy as jnp
import pytest

from experiments import agentic_rl
from sparse_lm.config import get_preset
from sparse_lm.rl import trainer
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train.state import TrainState


def _main(args, capsys):
  """(status, stderr) of the CLI; argparse's exits become their status."""
  try:
    status = agentic_rl.main(["--preset=tiny", *args])
  except SystemExit as e:
    status = e.code
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  return status, err


def test_list_keys_prints_every_set_key_with_the_preset_value(capsys):
  """--help named no --set key and there was no --list-keys (the stages have one)."""
  assert agentic_rl.main(["--preset=tiny", "--list-keys"]) == 0
  lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
  assert lines["sft_steps"] == "125" and lines["grpo_steps"] == "40"
  assert lines["grpo.temperature"] == "0.3" and lines["init_from"] == "null"
  assert lines["env_overrides"] == "[]" and "grpo" not in lines  # groups by their fields
  # every printed key=value is accepted by --set as it is printed
  cfg = agentic_rl.apply_sets(agentic_rl.PRESETS["tiny"], [f"{k}={v}" for k, v in lines.items()])
  assert cfg == agentic_rl.PRESETS["tiny"]


@pytest.mark.parametrize("key, nearest", [
    ("steps", "sft_steps, grpo_steps"), ("learning_rate", "sft_optim.peak_lr"),
    ("sft_step", "sft_steps"), ("grpo.temprature", "grpo.temperature")])
def test_unknown_set_key_suggests_the_nearest_keys(key, nearest, capsys):
  status, err = _main([f"--set={key}=1"], capsys)
  assert status == 2
  assert f"unknown --set key {key!r}" in err and f"did you mean {nearest}" in err, err
  assert "--list-keys prints every key" in err, err


@pytest.mark.parametrize("args, message", [
    (["--env=lookup", "--set", "env=code"], "--env lookup and --set env=code disagree"),
    (["--seed=1", "--set", "seed=2"], "--seed 1 and --set seed=2 disagree"),
    (["--init_from=/a", "--set", "init_from=/b"], "--init_from /a and --set init_from=/b disagree"),
])
def test_a_flag_and_a_set_of_the_same_field_that_disagree_are_refused(args, message, tmp_path,
                                                                     capsys):
  """--env lost to --set env silently, --seed won over --set seed silently."""
  status, err = _main([f"--workdir={tmp_path}/rl", *args], capsys)
  assert status == 2 and message in err and "give only one of them" in err, err
  assert not (tmp_path / "rl").exists()


def test_flag_and_set_that_agree_are_fine():
  assert agentic_rl.main(["--preset=tiny", "--seed=1", "--set", "seed=1", "--list-keys"]) == 0


def test_init_from_that_does_not_exist_says_so_and_makes_no_workdir(tmp_path, capsys):
  status, err = _main([f"--init_from={tmp_path}/nope", f"--workdir={tmp_path}/rl"], capsys)
  assert status == 2
  assert f"init_from='{tmp_path}/nope' does not exist: give the workdir of a pretraining" in err
  assert not (tmp_path / "rl").exists()


def _save_meta_only_checkpoint(directory, model_cfg):
  """A checkpoint whose meta records `model_cfg` (its arrays are a stand-in: only the meta is
  read before the model is built)."""
  state = TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.zeros(2)}, model_vars={},
                     opt_state={"m": jnp.zeros(2)}, rng=jnp.zeros(2, jnp.uint32))
  ck = ckpt_lib.Checkpointer(directory, async_save=False)
  ck.save(state, data_state=None, meta={"model": ckpt_lib.to_json(model_cfg),
                                        "stage": {"preset": model_cfg.name}})
  ck.close()


def test_init_from_another_preset_is_refused_before_the_model_is_built(tmp_path, monkeypatch,
                                                                      capsys):
  """--preset=small --init_from a tiny run built the 1.6B-parameter model and its optimizer
  state (7.8 GB resident when a 10 GB limit stopped it) before the restore refused it."""
  _save_meta_only_checkpoint(tmp_path / "pt" / "stage_8k" / "checkpoints", get_preset("tiny"))
  monkeypatch.setattr("experiments.base.enable_compilation_cache", lambda directory: None)
  def never(*args, **kwargs):
    raise AssertionError("the tokenizer was built before the model check")
  monkeypatch.setattr(trainer, "_tokenizer", never)
  status, err = _main(["--preset=small", f"--init_from={tmp_path}/pt",
                       f"--workdir={tmp_path}/rl"], capsys)
  assert status == 2, err
  assert "the checkpoint holds a 'tiny' model and this run builds 'small'" in err, err
  assert "d_model: 64 (saved) vs 1024 (now)" in err and "model_overrides" in err, err
  # the same model passes the check
  trainer.check_init_from_model(dataclasses.replace(agentic_rl.PRESETS["tiny"],
                                                    init_from=str(tmp_path / "pt")))


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_a_read_only_or_full_workdir_is_one_line_with_status_1(code, tmp_path, monkeypatch,
                                                              capsys):
  """A read-only workdir raised an OSError traceback from the run lock (`WorkdirLock`)."""
  monkeypatch.setattr("experiments.base.enable_compilation_cache", lambda directory: None)
  def fail(*args, **kwargs):
    raise OSError(code, "simulated", str(tmp_path / "run.lock"))
  monkeypatch.setattr(trainer, "run", fail)
  status, err = _main([f"--workdir={tmp_path}"], capsys)
  assert status == 1, err
  assert re.search(rf"error: cannot (write|access) {tmp_path}/run.lock: simulated \(errno "
                   rf"{errno.errorcode[code]}\)", err), err


def test_other_os_errors_still_raise(tmp_path, monkeypatch):
  monkeypatch.setattr("experiments.base.enable_compilation_cache", lambda directory: None)
  def fail(*args, **kwargs):
    raise OSError(errno.EIO, "simulated")
  monkeypatch.setattr(trainer, "run", fail)
  with pytest.raises(OSError):
    agentic_rl.main(["--preset=tiny", f"--workdir={tmp_path}"])


def test_ctrl_c_before_the_first_step_is_one_line_with_status_130(tmp_path, monkeypatch, capsys):
  """Ctrl-C during the tokenizer or the first compile printed a KeyboardInterrupt traceback of
  about 70 frames from inside jax."""
  monkeypatch.setattr("experiments.base.enable_compilation_cache", lambda directory: None)
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(trainer, "run", interrupted)
  status, err = _main([f"--workdir={tmp_path}"], capsys)
  assert status == 130, err
  assert "interrupted (SIGINT)" in err and "run the same command again" in err, err


def test_init_from_removed_after_the_cli_checked_it_is_one_line(tmp_path, monkeypatch, capsys):
  """A FileNotFoundError that run() raises with its own message (no errno) is printed, status 2."""
  monkeypatch.setattr("experiments.base.enable_compilation_cache", lambda directory: None)
  def gone(*args, **kwargs):
    raise FileNotFoundError("init_from='x' holds no <stage>/checkpoints: give ...")
  monkeypatch.setattr(trainer, "run", gone)
  status, err = _main([f"--workdir={tmp_path}"], capsys)
  assert status == 2 and "error: init_from='x' holds no" in err, err
