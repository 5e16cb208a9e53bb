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


class _Reached(Exception):
  """The plan got past the argument checks (to the topology's devices)."""


def _stop_at_devices(monkeypatch):
  seen = []

  def fake_devices(topology, num_slices=1):
    seen.append(topology)
    raise _Reached

  monkeypatch.setattr(aot_plan, "topology_devices", fake_devices)
  return seen


@pytest.mark.parametrize("where,want", [
    ("missing/dir/p.json", "directory {tmp}/missing/dir does not exist"),
    ("file/p.json", "{tmp}/file is not a directory"),
    ("", "is a directory; give a file name")])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_compile(
    tmp_path, capsys, monkeypatch, where, want):
  """`--json /nonexistent/dir/p.json` lowered and compiled every step (at full scale 22-24 GB
  of host memory and many minutes), then died in FileNotFoundError writing the report."""
  (tmp_path / "file").write_text("x")
  path = str(tmp_path / where) if where else str(tmp_path)
  _stop_at_devices(monkeypatch)
  with pytest.raises(SystemExit) as e:
    aot_plan.main(["--stage", "stage_8k", "--preset", "tiny", "--topology", "v5p:2x2x2",
                   "--json", path, "--lower-only", "--malloc-arenas", "0"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--json {path}: " + want.format(tmp=tmp_path) in err, err


@pytest.mark.parametrize("stage", ["experiments/stage_8k.py", "./experiments/stage_8k.py",
                                   "experiments.stage_8k", "stage_8k.py"])
def test_stage_given_as_its_file_or_module_is_the_stage(capsys, monkeypatch, stage):
  """`--stage experiments/stage_8k.py` was refused as "no experiments/experiments/stage_8k.py.py"."""
  seen = _stop_at_devices(monkeypatch)
  with pytest.raises(_Reached):
    aot_plan.main(["--stage", stage, "--preset", "tiny", "--topology", "v5p:2x2x2",
                   "--lower-only", "--malloc-arenas", "0"])
  assert seen == ["v5p:2x2x2"]


@pytest.mark.parametrize("stage,want", [
    ("other/stage_8k.py", "give the name of a stage in experiments/ (e.g. stage_8k for "
                          "experiments/stage_8k.py)"),
    ("stage_9k", "no experiments/stage_9k.py (give the name of a stage in experiments/")])
def test_a_stage_that_is_not_in_experiments_says_to_give_the_name(capsys, monkeypatch, stage,
                                                                  want):
  _stop_at_devices(monkeypatch)
  with pytest.raises(SystemExit) as e:
    aot_plan.main(["--stage", stage, "--preset", "tiny", "--topology", "v5p:2x2x2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--stage {stage}: {want}" in err, err
