"""The gcloud TPU launcher's --dry-run output for a 2-slice v5p job, and multi-host detection."""

import shlex

import pytest

from launch import tpu
from sparse_lm import distributed

POD = ["--name", "lm", "--tpu", "v5p-256", "--num-slices", "2", "--zone", "us-east5-a",
       "--project", "proj"]


def dry(capsys, action, *extra, cmd=()):
  argv = [action, *POD, "--dry-run", *extra] + (["--", *cmd] if cmd else [])
  assert tpu.main(argv) == 0
  return capsys.readouterr().out.strip().splitlines()


def test_create_two_slices_spot(capsys):
  (line,) = dry(capsys, "create", "--spot")
  args = shlex.split(line)
  assert args[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "lm"]
  for a in ("--zone=us-east5-a", "--project=proj", "--accelerator-type=v5p-256",
            "--runtime-version=v2-alpha-tpuv5", "--node-count=2", "--node-prefix=lm", "--spot"):
    assert a in args, (a, args)
  assert not any(a.startswith("--node-id") for a in args)


def test_create_single_slice_reserved_and_v6e(capsys):
  argv = ["create", "--name", "one", "--tpu", "v6e-256", "--zone", "z", "--reserved",
          "--dry-run"]
  assert tpu.main(argv) == 0
  args = shlex.split(capsys.readouterr().out)
  assert "--node-id=one" in args and "--reserved" in args
  assert "--runtime-version=v2-alpha-tpuv6e" in args and "--node-count=2" not in args


def test_setup_copies_checkout_and_installs_on_every_worker_of_both_slices(capsys):
  lines = dry(capsys, "setup")
  assert shlex.split(lines[0])[:2] == ["git", "archive"]
  for node in ("lm-0", "lm-1"):
    scp = [shlex.split(l) for l in lines if " scp " in l and f"{node}:" in l]
    assert len(scp) == 1 and "--worker=all" in scp[0]
    ssh = [shlex.split(l) for l in lines if " ssh " in l and f" {node} " in l]
    assert len(ssh) == 1 and "--worker=all" in ssh[0]
    remote = [a for a in ssh[0] if a.startswith("--command=")][0]
    assert "pip install -q -r requirements.txt" in remote and "tar -xzf" in remote


def test_run_starts_on_all_workers_with_megascale_env_and_logs(capsys):
  lines = dry(capsys, "run", "--run-name", "s8k",
              cmd=("python", "-m", "experiments.stage_8k", "--preset", "full"))
  assert lines[0].startswith("COORDINATOR_IP=$(gcloud compute tpus tpu-vm describe lm-0 ")
  runs = [l for l in lines[1:]]
  assert len(runs) == 2
  for i, line in enumerate(runs):
    args = shlex.split(line.replace("$COORDINATOR_IP", "10.0.0.2"))
    assert args[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", f"lm-{i}"]
    assert "--worker=all" in args
    remote = [a for a in args if a.startswith("--command=")][0]
    for piece in ("MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8080", "MEGASCALE_NUM_SLICES=2",
                  f"MEGASCALE_SLICE_ID={i}", "nohup ~/venv/bin/python -m experiments.stage_8k "
                  "--preset full", "> logs/s8k.log 2>&1"):
      assert piece in remote, (piece, remote)


def test_tail_and_delete(capsys):
  (line,) = dry(capsys, "tail", "--run-name", "s8k")
  assert "tail -n 100 -F ~/sparse_lm/logs/s8k.log" in line and "--worker=0" in line
  (line,) = dry(capsys, "delete")
  assert shlex.split(line) == ["gcloud", "compute", "tpus", "queued-resources", "delete", "lm",
                               "--zone=us-east5-a", "--project=proj", "--force", "--quiet"]


def test_run_without_command_is_an_error(capsys):
  with pytest.raises(SystemExit):
    tpu.main(["run", *POD, "--dry-run"])


@pytest.mark.parametrize("bad", ["XLA_FLAGS", "=1"])
def test_run_env_without_key_and_value_names_the_flag(capsys, bad):
  with pytest.raises(SystemExit) as e:
    tpu.main(["run", *POD, "--dry-run", "--env", bad, "--", "python", "-m", "x"])
  assert e.value.code == 2
  assert f"--env '{bad}': expected KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("head,expected", [("python", "~/venv/bin/python -m x 'a b'"),
                                           ("python3", "~/venv/bin/python -m x 'a b'"),
                                           ("bash", "bash -m x 'a b'")])
def test_run_uses_the_setup_venvs_python(capsys, head, expected):
  out = "\n".join(dry(capsys, "run", cmd=(head, "-m", "x", "a b")))
  assert f"nohup {expected} > logs/run.log" in out


@pytest.mark.parametrize("env,kind", [
    ({}, None),
    ({"TPU_WORKER_HOSTNAMES": "h0"}, None),
    ({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}, "tpu"),
    ({"MEGASCALE_NUM_SLICES": "2"}, "tpu"),
    ({"SLURM_NTASKS": "16"}, "slurm"),
    ({"SLURM_NTASKS": "1"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
      "JAX_PROCESS_ID": "2"}, "explicit"),
])
def test_distributed_detection(env, kind):
  got, kw = distributed.detect(env)
  assert got == kind
  if kind == "explicit":
    assert kw == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
  if kind is None:  # single process: nothing is initialised
    assert distributed.maybe_initialize(env) is False


@pytest.mark.parametrize("extra,want", [
    (["--num-slices", "0"], "--num-slices=0 must be >= 1"),
    (["--type", "tpu7x", "--topology", "2x2x2"], "give --tpu (e.g. v5p-256) or --type with "
                                                 "--topology")])
def test_bad_slice_count_or_two_accelerator_forms_are_refused(capsys, extra, want):
  """--num-slices 0 printed --node-count=0; --type beside --tpu was silently dropped."""
  with pytest.raises(SystemExit) as e:
    tpu.main(["create", *POD, *extra, "--dry-run"])
  assert e.value.code == 2
  assert want in capsys.readouterr().err
