"""sparse_lm.distributed.detect: which multi-host start-up applies, from the environment."""

import re

import pytest

from sparse_lm.distributed import detect


def test_libtpu_warning_text_is_not_a_host_list():
  # What libtpu leaves in the variable on a machine without TPU metadata.
  warning = ("WARNING: could not determine TPU worker hostnames or IP addresses, please set env "
             "var `TPU_WORKER_HOSTNAMES` manually, otherwise libtpu.so may not properly "
             "initialize.")
  assert detect({"TPU_WORKER_HOSTNAMES": warning}) == (None, {})


def test_multi_host_tpu_slice_and_explicit_coordinator():
  assert detect({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})[0] == "tpu"
  kind, kw = detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "2",
                     "JAX_PROCESS_ID": "1"})
  assert kind == "explicit" and kw == {"coordinator_address": "10.0.0.2:1234",
                                       "num_processes": 2, "process_id": 1}
  assert detect({}) == (None, {})


def test_a_cloud_tpu_vm_initialises_without_a_host_list_in_the_environment():
  """On GCE TPU VMs (queued resources, launch.tpu) no environment variable lists the slice's
  hosts: a single-slice multi-host pod (v5p-256: 32 hosts) ran without jax.distributed, whose
  client orbax's checkpoint barriers need. A Cloud TPU VM now initialises (JAX reads the
  hosts from the metadata server); TPU_SKIP_MDS_QUERY (set by JAX on hosts without TPU chips,
  and by the tests) opts out."""
  assert detect({}, tpu_vm=True) == ("tpu", {})
  assert detect({"TPU_SKIP_MDS_QUERY": "1"}, tpu_vm=True) == (None, {})
  assert detect({}, tpu_vm=False) == (None, {})
  assert detect({}) == (None, {})  # an explicit environment is never probed
  # precedence: an explicit coordinator beats the probe
  assert detect({"JAX_COORDINATOR_ADDRESS": "h:1"}, tpu_vm=True) == (
      "explicit", {"coordinator_address": "h:1"})


_WORKER = r"""
import os, sys, time
from sparse_lm.distributed import maybe_initialize
assert maybe_initialize()
import jax, numpy as np
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("up")
if jax.process_index() == int(os.environ["FAIL_PID"]):
  if os.environ.get("CAUGHT"):  # as experiments.base.main reports an error it caught
    from sparse_lm.distributed import failed
    try:
      raise RuntimeError("boom on process %d" % jax.process_index())
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(failed(1))
  raise RuntimeError("boom on process %d" % jax.process_index())
multihost_utils.process_allgather(np.ones(3))  # waits for the failed process
print("no failure seen", flush=True)
"""


def _start_two_processes(tmp_path, worker: str, **env_extra) -> list:
  """Two CPU processes joined by jax.distributed (explicit coordinator on a free port), each
  running `worker`, stdout and stderr piped together."""
  import os
  import pathlib
  import socket
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  script = tmp_path / "worker.py"
  script.write_text(worker)
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid), SPARSE_LM_HEARTBEAT_TIMEOUT="10",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_extra)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=root,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  return procs


def _outputs(procs, timeout: float, what: str) -> list[str]:
  """Each process's output once all have ended within `timeout` seconds in all; else they are
  killed and the test fails with `what` and the ends of their outputs."""
  import subprocess
  import time
  deadline = time.monotonic() + timeout
  try:
    return [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"{what}:\n" + "\n".join((p.communicate()[0] or "")[-2000:] for p in procs))


@pytest.mark.parametrize("fail_pid,caught", [(0, False), (1, False), (0, True)])
def test_one_process_failing_stops_the_job_instead_of_hanging(tmp_path, fail_pid, caught):
  """Two CPU processes joined by jax.distributed; one raises (or, `caught`, reports the error
  and exits 1 through `distributed.failed`, as `python -m experiments.<stage>` does for a
  held workdir lock or a missing file on one host). Before, it then waited at JAX's shutdown
  barrier (300 s) while the other waited for it in a collective: the job stood still for five
  minutes. Now the failing process leaves at once and the other one fails too."""
  procs = _start_two_processes(tmp_path, _WORKER, FAIL_PID=str(fail_pid),
                               **({"CAUGHT": "1"} if caught else {}))
  outs = _outputs(procs, 50, "a process of the job still ran 50 s after one of them failed")
  assert all(p.returncode != 0 for p in procs), [(p.returncode, o[-1500:])
                                                 for p, o in zip(procs, outs)]
  if caught:
    assert f"error: boom on process {fail_pid}" in outs[fail_pid]
    assert "this process stops (exit status 1)" in outs[fail_pid]
    assert procs[fail_pid].returncode == 1
  else:
    assert f"RuntimeError: boom on process {fail_pid}" in outs[fail_pid]
    assert "this process failed (RuntimeError)" in outs[fail_pid]
  assert not any("no failure seen" in o for o in outs)


@pytest.mark.parametrize("env,want", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS is set but JAX_PROCESS_ID is not: set"),
    ({"JAX_PROCESS_ID": "1"}, "but JAX_NUM_PROCESSES is not: set JAX_NUM_PROCESSES"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID=2 is not in 0..1"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES='two': expected a "
                                                          "whole number"),
    ({"JAX_COORDINATOR_ADDRESS": "host0", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS='host0': expected host:port"),
])
def test_a_worker_missing_or_misspelling_a_variable_is_told_which(env, want):
  """JAX said "The process id of the current process must be defined." (or "Number of
  processes must be defined.", or an IndexError for an address without a port, or int()'s
  message): none named the variable to set."""
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", **env}
  with pytest.raises(ValueError, match=re.escape(want)):
    detect(env)
  # under Slurm (or mpirun, a TPU pod) JAX fills in what is missing itself
  assert detect({"SLURM_NTASKS": "8", "JAX_COORDINATOR_ADDRESS": "h:1"})[0] == "explicit"


_PREEMPT_WORKER = r"""
import os, signal, time
from sparse_lm.distributed import maybe_initialize
assert maybe_initialize()
import jax, numpy as np
from jax.experimental import multihost_utils
from sparse_lm.train.loop import Preemption
# PHASE_STEPS: the phases' step counts (each restarts at step 1, as SFT then GRPO);
# SIG_AT "phase:step": process SIG_PID is sent SIGTERM at that step (step 0: before the phase
# starts, followed by a 1 s pause, as during the phase's compile).
phases = [int(n) for n in os.environ["PHASE_STEPS"].split(",")]
sig_phase, sig_step = (int(x) for x in os.environ["SIG_AT"].split(":"))
signalled = jax.process_index() == int(os.environ["SIG_PID"])
for phase, steps in enumerate(phases):
  if phase == sig_phase and sig_step == 0:
    if signalled:
      os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
  with Preemption() as p:
    for step in range(1, steps + 1):
      multihost_utils.process_allgather(np.ones(3))  # the step's collective
      if signalled and (phase, step) == (sig_phase, sig_step):
        os.kill(os.getpid(), signal.SIGTERM)  # one process of the job is told to stop
      time.sleep(0.02)
      stop = p.stop_after(step)
      if stop:
        print(f"phase {phase} stopped after step {step}: {stop}", flush=True)
        break
multihost_utils.sync_global_devices("end")
print("clean end", flush=True)
"""


@pytest.mark.parametrize("sig_pid", [1])
def test_sigterm_to_one_process_stops_every_process_after_the_same_step(tmp_path, sig_pid):
  """The stage loop's `Preemption.stop_after` in a two-process job: a SIGTERM to one process
  stops both after the same step (JAX's preemption sync point), so they save together. With a
  per-process flag the signalled process stopped alone and the other one was left in the next
  step's collective (gloo's "collective mismatch"; no checkpoint was written)."""
  import re as re_
  procs = _start_two_processes(tmp_path, _PREEMPT_WORKER, SIG_PID=str(sig_pid),
                               PHASE_STEPS="399", SIG_AT="0:3")
  outs = _outputs(procs, 90, "the job did not stop within 90 s of the SIGTERM")
  assert [p.returncode for p in procs] == [0, 0], [o[-1500:] for o in outs]
  steps = [re_.findall(r"stopped after step (\d+): SIGTERM", o) for o in outs]
  assert all(len(s) == 1 for s in steps), outs
  # the same step on both, not before the signal's (the sync point is one past the largest
  # step any process had reported when the notice reached them: 3 or later)
  assert steps[0] == steps[1] and int(steps[0][0]) >= 3, steps
  assert all("clean end" in o for o in outs)


def test_a_later_phase_that_restarts_its_steps_still_meets_the_sync_point(tmp_path):
  """SFT then GRPO in one process (sparse_lm/rl/trainer.py), each counting steps from 1: JAX's
  preemption sync point is one past the step each process last reported when the notice came.
  With the phases' own steps, a SIGTERM between the phases (SFT's last step 60 reported) set it
  to 61, which GRPO's 40 steps never reach: the notice was lost and nothing saved.
  `stop_after` counts its calls over every `Preemption` instead."""
  import re as re_
  # SFT 60 steps, then GRPO 40, the SIGTERM to process 1 between them
  procs = _start_two_processes(tmp_path, _PREEMPT_WORKER, SIG_PID="1", PHASE_STEPS="60,40",
                               SIG_AT="1:0")
  outs = _outputs(procs, 90, "the job did not end within 90 s")
  assert [p.returncode for p in procs] == [0, 0], [o[-1500:] for o in outs]
  steps = [re_.findall(r"phase 1 stopped after step (\d+)", o) for o in outs]  # GRPO
  assert all(len(x) == 1 for x in steps), outs
  assert steps[0] == steps[1] and 1 <= int(steps[0][0]) < 40, steps
  assert not any("phase 0 stopped" in o for o in outs)  # not during SFT
