"""The worker processes of `jobs.run_tasks` with a stand-in worker (a Python loop that records
the signal it gets): SIGTERM or SIGINT to the parent reaches the workers as SIGTERM, the parent
waits for them (killing one that ignores it after `grace_s`) and raises `jobs.Stopped`; a
rerun's worker appends to the interrupted one's log."""

import json
import os
import signal
import sys
import threading
import time

import pytest

from experiments.ablations import jobs

# Stands in for `python -m experiments.ablations.jobs TASK_JSON`: writes its pid to `ready`,
# then sleeps; on SIGTERM / SIGINT it records the signal's name and exits as a saved run does.
FAKE_WORKER = """
import json, os, pathlib, signal, sys, time
task = json.loads(sys.argv[1])
work = pathlib.Path(task["workdir"])
def stop(signum, frame):
  (work / "got").write_text(signal.Signals(signum).name)
  print("saved; stopping", flush=True)
  sys.exit(128 + signum)
ignore = task.get("ignore_sigterm")
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else stop)
signal.signal(signal.SIGINT, stop)
print("training", flush=True)
(work / "ready").write_text(str(os.getpid()))
while True:
  time.sleep(0.05)
"""


class _Outside(Exception):
  """What this test process does on the signal outside `run_tasks` (not pytest's own exit)."""


def _outside(signum, frame):
  raise _Outside(signum)


@pytest.mark.parametrize("signum,ignore", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                           (signal.SIGTERM, True)])
def test_a_signal_stops_the_workers_and_a_rerun_keeps_their_log(tmp_path, monkeypatch, signum,
                                                                 ignore):
  monkeypatch.setattr(jobs, "_shared_tokenizer", lambda *a: None)
  task = {"key": "k0", "ablation": "gate", "variant": 0, "seeds": [0], "probes": [],
          "users": ["gate / bounded (-5)"], "cost": 1, "ignore_sigterm": ignore}
  (tmp_path / "logs").mkdir()
  log = tmp_path / "logs" / "k0.log"
  log.write_text("the interrupted run's log\n")

  finished = threading.Event()  # the run ended (or failed) before its worker was ready

  def signal_when_ready():
    deadline = time.time() + 30
    while not (tmp_path / "ready").exists() and time.time() < deadline:
      if finished.wait(0.02):
        return
    os.kill(os.getpid(), signum)

  previous = {s: signal.signal(s, _outside) for s in (signal.SIGTERM, signal.SIGINT)}
  threading.Thread(target=signal_when_ready, daemon=True).start()
  command = lambda t: [sys.executable, "-c", FAKE_WORKER, json.dumps(t)]
  try:
    with pytest.raises(jobs.Stopped, match="Rerun the same command to resume") as stopped:
      jobs.run_tasks([task], 2, "smoke", tmp_path, say=lambda s: None, command=command,
                     grace_s=1.0)
    # Handlers put back: outside the run the test's own handlers act again.
    assert all(signal.getsignal(s) is _outside for s in previous)
  finally:
    finished.set()
    for s, handler in previous.items():
      signal.signal(s, handler)
    if (tmp_path / "ready").exists():  # the worker of a failed run
      try:
        os.kill(int((tmp_path / "ready").read_text()), signal.SIGKILL)
      except ProcessLookupError:
        pass
  assert stopped.value.signum == signum
  pid = int((tmp_path / "ready").read_text())
  with pytest.raises(ProcessLookupError):  # no worker outlives the run
    os.kill(pid, 0)
  text = log.read_text()
  assert text.startswith("the interrupted run's log\n") and "training" in text, text
  if ignore:  # killed once the grace period was over, and said so
    assert not (tmp_path / "got").exists()
    assert "did not stop within 1 s and were killed" in str(stopped.value)
  else:  # SIGTERM, never a second SIGINT (which the training loop takes as "stop at once")
    assert (tmp_path / "got").read_text() == "SIGTERM"
    assert "1 worker(s) saved their runs and stopped" in str(stopped.value)
    assert "saved; stopping" in text


def test_the_workers_are_never_more_than_the_cores(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
  assert jobs.worker_count(2) == 1 and jobs.default_jobs() == 1
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
  assert jobs.worker_count(2) == 2 and jobs.worker_count(8) == 3


def test_the_report_exits_non_zero_saying_a_rerun_resumes(tmp_path, monkeypatch, capsys):
  from experiments.ablations import report  # pylint: disable=g-import-not-at-top

  def stopped(*args):
    raise jobs.Stopped("stopped by SIGTERM: 2 worker(s) saved their runs and stopped. Rerun the "
                       "same command to resume.", signal.SIGTERM)
  monkeypatch.setattr(report, "_run", stopped)
  assert report.main([f"--docs={tmp_path}", f"--workdir={tmp_path}/w"]) == 128 + signal.SIGTERM
  assert "Rerun the same command to resume" in capsys.readouterr().err
  assert not (tmp_path / "ablations.md").exists()  # no report from a stopped run
