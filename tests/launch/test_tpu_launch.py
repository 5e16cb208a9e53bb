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
    # re-running setup to ship a fix deleted ~/sparse_lm/logs/*.log and runs/ (`rm -rf
    # ~/sparse_lm`): only the code is replaced now (test_setup_keeps_logs_and_runs)
    assert "rm -rf ~/sparse_lm " not in remote and "rm -rf ~/sparse_lm/logs" not in remote
    assert remote.startswith(f"--command={tpu.unpack_command()} && cd ~/sparse_lm && ")


@pytest.mark.parametrize("earlier", [True, False])
def test_setup_keeps_logs_and_runs(tmp_path, earlier):
  """The worker's unpack step, run with HOME in tmp_path: over an earlier setup it removes the
  old code (files the new commit no longer has included) and keeps logs/ and runs/; on a fresh
  worker it creates the checkout with logs/."""
  import os
  import subprocess
  import tarfile
  home = tmp_path / "home"
  remote = home / "sparse_lm"
  src = tmp_path / "src"
  for f, text in (("new.py", "new"), ("pkg/b.py", "b"), (".gitignore", "x")):
    (src / f).parent.mkdir(parents=True, exist_ok=True)
    (src / f).write_text(text)
  home.mkdir()
  with tarfile.open(home / "sparse_lm_checkout.tar.gz", "w:gz") as t:
    for f in ("new.py", "pkg", ".gitignore"):
      t.add(src / f, arcname=f)
  if earlier:
    for f in ("logs/s8k.log", "runs/tiny/checkpoints/4/x", "old.py", "pkg/a.py", ".old"):
      (remote / f).parent.mkdir(parents=True, exist_ok=True)
      (remote / f).write_text("kept" if f.startswith(("logs", "runs")) else "old")
  env = dict(os.environ, HOME=str(home))
  proc = subprocess.run(["bash", "-euo", "pipefail", "-c", tpu.unpack_command()], env=env,
                        capture_output=True, text=True, timeout=30)
  assert proc.returncode == 0, proc.stderr
  files = sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file())
  kept = ["logs/s8k.log", "runs/tiny/checkpoints/4/x"] if earlier else []
  assert files == sorted([".gitignore", "new.py", "pkg/b.py", *kept]), files
  assert (remote / "logs").is_dir()
  assert all((remote / f).read_text() == "kept" for f in kept)


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
  lines = dry(capsys, "run", cmd=(head, "-m", "x", "a b"))
  out = "\n".join(a for l in lines for a in shlex.split(l.replace("$COORDINATOR_IP", "h")))
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


def _run_rendered(tmp_path, text):
  """Run the dry-run text as `main` would (bash -euo pipefail) with a fake gcloud that prints
  its arguments one per line (the coordinator lookup answers 10.0.0.2)."""
  import os
  import subprocess
  fake = tmp_path / "gcloud"
  fake.write_text('#!/bin/bash\nif [ "$4" = describe ]; then echo 10.0.0.2; exit 0; fi\n'
                  'for a in "$@"; do printf "%s\\n" "$a"; done\n')
  fake.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k != "USER"}
  env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
  proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], env=env, capture_output=True,
                        text=True, timeout=30)
  assert proc.returncode == 0, proc.stderr
  return [l for l in proc.stdout.splitlines() if l.startswith("--command=")]


@pytest.mark.parametrize("slices", ["1", "2"])
def test_run_passes_dollar_and_backtick_of_the_command_to_the_worker_verbatim(
    capsys, tmp_path, slices):
  """Multislice double-quoted the remote command to expand $COORDINATOR_IP, so `$USER` in a
  --set value was expanded on the launching machine (unbound under `bash -u`: the launch
  failed), and a backtick ran there."""
  argv = ["run", "--name", "lm", "--num-slices", slices, "--zone", "z", "--dry-run",
          "--env", "A=x`id -u`", "--env", "TAG=$weird value;echo pwned", "--",
          "python", "-m", "experiments.stage_8k",
          "--set", "data.source=text:/gcs/$USER/*.txt"]
  assert tpu.main(argv) == 0
  remotes = _run_rendered(tmp_path, capsys.readouterr().out)
  assert len(remotes) == int(slices)
  for i, remote in enumerate(remotes):
    assert "--set 'data.source=text:/gcs/$USER/*.txt'" in remote, remote
    assert "A='x`id -u`'" in remote, remote
    # a value starting with $ was left unquoted (kept for $COORDINATOR_IP): the worker's shell
    # expanded it, split it at the space and ran `echo pwned`
    assert "TAG='$weird value;echo pwned'" in remote, remote
    if slices == "2":
      assert "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8080" in remote
      assert f"MEGASCALE_SLICE_ID={i}" in remote


@pytest.mark.parametrize("name", ["my run", "s8k;reboot", "../x", "$(id)"])
def test_run_name_that_the_workers_shell_would_split_is_refused(capsys, name):
  """The run name went unquoted into `> logs/<run-name>.log`: `--run-name "my run"` logged to
  logs/my and passed `run.log` to the experiment as an argument; `;` ran a second command."""
  for action in ("run", "tail"):
    with pytest.raises(SystemExit) as e:
      tpu.main([action, *POD, "--dry-run", "--run-name", name, "--", "python", "-m", "x"])
    assert e.value.code == 2
    assert f"--run-name {name!r}: use letters, digits" in capsys.readouterr().err


def test_tail_reaches_a_worker_of_any_slice(capsys):
  """tail always followed slice 0 (lm-0): a failure on slice 1's workers could not be read."""
  (line,) = dry(capsys, "tail", "--run-name", "s8k", "--slice", "1", "--worker", "3")
  args = shlex.split(line)
  assert args[5] == "lm-1" and "--worker=3" in args
  with pytest.raises(SystemExit) as e:
    tpu.main(["tail", *POD, "--dry-run", "--slice", "2"])
  assert e.value.code == 2 and "--slice 2: the pod has slices 0..1" in capsys.readouterr().err


def test_run_stops_when_the_coordinator_lookup_answers_nothing(capsys, tmp_path):
  """An empty describe answer (node not ACTIVE yet) started every worker with
  MEGASCALE_COORDINATOR_ADDRESS=:8080."""
  import os
  import subprocess
  assert tpu.main(["run", *POD, "--dry-run", "--", "python", "-m", "x"]) == 0
  text = capsys.readouterr().out
  fake = tmp_path / "gcloud"
  fake.write_text('#!/bin/bash\nif [ "$4" = describe ]; then exit 0; fi\necho STARTED\n')
  fake.chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], env=env, capture_output=True,
                        text=True, timeout=30)
  assert proc.returncode != 0 and "STARTED" not in proc.stdout
  assert "no internal IP for lm-0" in proc.stderr
