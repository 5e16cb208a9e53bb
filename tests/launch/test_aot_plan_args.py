"""launch.aot_plan's command line refuses a bad --steps before anything starts (no jax, no
compile): the message names the flag and the choices."""

import pytest

from launch import aot_plan


def test_unknown_step_name_is_refused_with_the_choices(capsys):
  with pytest.raises(SystemExit) as e:
    aot_plan.main(["--stage", "stage_8k", "--preset", "tiny", "--steps", "train,decode"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--steps train,decode" in err and "train,eval,eval_2x" in err


def test_zero_slices_is_refused(capsys):
  """--num-slices 0 compiled as one slice."""
  with pytest.raises(SystemExit) as e:
    aot_plan.main(["--stage", "stage_8k", "--preset", "tiny", "--topology", "v5p:2x2x1",
                   "--num-slices", "0"])
  assert e.value.code == 2
  assert "--num-slices=0 must be >= 1" in capsys.readouterr().err
