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


def test_topology_and_slices_flags_are_the_ones_the_mesh_is_checked_against(monkeypatch):
  """A multislice layout (dcn_data=2) with --num-slices 2 was refused ("multiply to 2, but
  there are 1 slices"): the stage config was validated before the flags were applied."""
  seen = {}

  class Reached(Exception):
    pass

  def fake_devices(topology, num_slices=1):
    seen.update(topology=topology, num_slices=num_slices)
    raise Reached

  monkeypatch.setattr(aot_plan, "topology_devices", fake_devices)
  with pytest.raises(Reached):
    aot_plan.main(["--stage", "stage_8k", "--preset", "full", "--topology", "v5p:8x16x8",
                   "--num-slices", "2", "--set", "mesh=dcn_data=2,fsdp=-1,expert=128,context=8",
                   "--lower-only", "--malloc-arenas", "0"])
  assert seen == {"topology": "v5p:8x16x8", "num_slices": 2}


def test_parameter_counts_print_in_a_readable_unit():
  """The tiny preset printed as '0.00B params'."""
  assert [aot_plan._params(n) for n in (2_801_000_000_000, 1_994_500_000, 451_000_000,
                                        1_940_000, 12_300, 7)] == [
      "2.80T", "1.99B", "451.0M", "1.9M", "12.3K", "7"]


@pytest.mark.parametrize("topology,chips", [("v5p-256", 128), ("v6e-256", 256)])
def test_an_accelerator_type_as_topology_is_refused_with_the_grid_form(capsys, topology, chips):
  """`--topology v5p-256` (launch.tpu's --tpu form) was refused as "unknown TPU generation
  'v5p-256'", which does not say what to write instead."""
  with pytest.raises(SystemExit) as e:
    aot_plan.main(["--stage", "stage_8k", "--preset", "tiny", "--topology", topology])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--topology {topology}: that is an accelerator type" in err
  assert f"({chips} chips), e.g. v5p:4x4x8 for v5p-256" in err
