"""The trainings of several ablations, each distinct configuration once, in worker processes.

`plan(names, preset, seeds)` lists the distinct stage configurations the ablations
need (`run.config_key`: equal configurations of different ablations, e.g. the default model as
the bounded gate, block AttnRes, SiTU-GLU and gated MLA, are one task) with the union of their
probes; `run_tasks(tasks, jobs, ...)` runs them in `jobs` worker processes, each pinned to one
core of this process's CPU set (the worker calls `os.sched_setaffinity` before importing jax;
worker i gets the i-th core; never more workers than cores, `worker_count`), heaviest first. A
worker (`python -m experiments.ablations.jobs TASK_JSON`) trains its configuration's seeds one
after another through `run.train_run` and exits, so its memory is returned; compiled programs
are shared through the persistent XLA cache in `<workdir>/xla_cache`. Afterwards `run.collect`
reads each ablation's record from the runs' run.json files.

SIGTERM or SIGINT to the parent stops the run: it sends SIGTERM to its workers (the training
loop saves a checkpoint and stops; not a second SIGINT, which the loop takes as "stop at once"),
waits for them up to `grace_s`, kills any left and raises `Stopped`; rerunning the same command
resumes. The workers run in their own session (a terminal's Ctrl-C reaches the parent only) and
ask the kernel for SIGTERM should the parent die without forwarding it (PR_SET_PDEATHSIG), so
no worker outlives the run holding its run directory's lock. Worker logs are appended to.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from experiments.ablations import BY_NAME

ROOT = pathlib.Path(__file__).resolve().parents[2]


def default_jobs() -> int:
  """2 worker processes when this process may use 2 or more cores, else 1."""
  return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


def worker_count(jobs: int) -> int:
  """The workers `run_tasks` starts for `jobs`: one per core this process may use, at most."""
  return max(1, min(jobs, len(os.sched_getaffinity(0))))


class Stopped(KeyboardInterrupt):
  """The run was stopped by a signal (`signum`) after its workers saved; rerun to resume."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


def _worker_command(task: dict) -> list[str]:
  return [sys.executable, "-m", "experiments.ablations.jobs", json.dumps(task)]


def _shared_tokenizer(tasks: list[dict], preset: str, workdir: pathlib.Path) -> None:
  """Train `<workdir>/tokenizer.json` once, before the workers (which copy it) start."""
  if not tasks:
    return
  from experiments.ablations.run import stage_for  # pylint: disable=g-import-not-at-top
  from sparse_lm.data import load_or_train_tokenizer  # pylint: disable=g-import-not-at-top
  ablation = BY_NAME[tasks[0]["ablation"]]
  stage = stage_for(ablation, preset, ablation.variants[tasks[0]["variant"]], 0)
  load_or_train_tokenizer(stage.data, str(workdir), stage.model_config().vocab_size)


def plan(names: list[str], preset: str, seeds) -> list[dict]:
  """The distinct configurations of the ablations `names`, heaviest first: per task its key,
  the first (ablation, variant index) that produces it, the seeds, the union of the probes,
  the users ("ablation / label") and a cost estimate (tokens trained, x2 with 32+ experts)."""
  from experiments.ablations.run import config_key, stage_for  # pylint: disable=g-import-not-at-top
  tasks: dict[str, dict[str, Any]] = {}
  for name in names:
    ablation = BY_NAME[name]
    for i, variant in enumerate(ablation.variants):
      stage = stage_for(ablation, preset, variant, seeds[0])
      task = tasks.setdefault(config_key(stage), {
          "key": config_key(stage), "ablation": name, "variant": i, "seeds": list(seeds),
          "probes": [], "users": [],
          "cost": stage.steps * stage.tokens_per_batch
                  * (2 if stage.model_config().num_experts >= 32 else 1)})
      task["probes"] += [k for k in ablation.probes if k not in task["probes"]]
      task["users"].append(f"{name} / {variant[0]}")
  return sorted(tasks.values(), key=lambda t: -t["cost"])


def run_tasks(tasks: list[dict], jobs: int, preset: str, workdir: str | pathlib.Path,
              say: Callable[[str], None] = print, *,
              command: Callable[[dict], list[str]] = _worker_command,
              grace_s: float = 300.0) -> dict[str, Any]:
  """Run `tasks` (from `plan`) in `worker_count(jobs)` pinned worker processes; returns what
  the run used: seconds, the workers started ("jobs"), the largest worker's peak resident
  memory (GB, its own VmHWM), the 1-minute load average's samples (every 5 s) and the cores.
  Each worker's output is appended to `<workdir>/logs/<key>.log`. `command(task)` is the
  worker's command line (tests give a stand-in).

  Raises:
    Stopped: SIGTERM or SIGINT arrived (caught here only when called from the main thread):
      the workers were sent SIGTERM and waited for up to `grace_s` seconds (a second signal
      or the bound kills the rest); no new task was started. Rerunning resumes.
    RuntimeError: a worker failed (after the others finished; names the task and its log).
  """
  workdir = pathlib.Path(workdir).absolute()
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  _shared_tokenizer(tasks, preset, workdir)
  cores = sorted(os.sched_getaffinity(0))[:worker_count(jobs)]
  queue, running, failed, loads, peak_kb = list(tasks), {}, [], [], 0
  received: list[int] = []  # the signals that arrived, in order
  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
  stopping_since, killed, stopped = None, [], []
  t0 = last = time.time()
  try:
    while queue or running:
      if received and stopping_since is None:
        stopping_since = time.time()
        say(f"[ablations] {signal.Signals(received[0]).name}: {len(running)} worker(s) told "
            f"to save and stop (waiting up to {grace_s:.0f} s); {len(queue)} not started")
        for proc, *_ in running.values():
          _kill(proc, signal.SIGTERM)
      if stopping_since is not None and not killed and running and (
          len(received) > 1 or time.time() - stopping_since > grace_s):
        for proc, task, *_ in running.values():
          _kill(proc, signal.SIGKILL)
          killed.append(", ".join(task["users"]))
        say(f"[ablations] killed {len(killed)} worker(s) that had not stopped")
      for core in cores:
        if queue and core not in running and stopping_since is None:
          task = queue.pop(0)
          # Appended to: a rerun's worker keeps the interrupted one's log.
          log = open(workdir / "logs" / f"{task['key']}.log", "a")  # pylint: disable=consider-using-with
          log.write(f"[ablations] {time.strftime('%Y-%m-%d %H:%M:%S')}: worker started by "
                    f"pid {os.getpid()}\n")
          log.flush()
          cmd = command({**task, "preset": preset, "workdir": str(workdir), "core": core,
                         "parent": os.getpid()})
          # The worker pins itself before importing jax (no preexec_fn: forking this process,
          # which may hold jax's threads, is unsafe); its own session keeps a terminal's
          # Ctrl-C from reaching it as well as the SIGTERM sent from here.
          proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,  # pylint: disable=consider-using-with
                                  start_new_session=True)
          running[core] = (proc, task, log, time.time())
          say(f"[ablations] core {core}: {', '.join(task['users'])} (seeds {task['seeds']})")
      time.sleep(1.0 if stopping_since is None else 0.2)
      if time.time() - last >= 5:
        loads.append(round(os.getloadavg()[0], 2))
        last = time.time()
      for core, (proc, task, log, started) in list(running.items()):
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid == 0:
          continue
        proc.returncode = os.waitstatus_to_exitcode(status)
        # The worker's own high-water mark (VmHWM, written as it exits). Not wait4's ru_maxrss:
        # Linux carries the forking process's peak into the child's across exec, so a parent
        # that once held 6 GB would report every worker at >= 6 GB.
        peak_file = workdir / "logs" / f"{task['key']}.peak_rss_kb"
        if peak_file.exists():
          peak_kb = max(peak_kb, int(peak_file.read_text()))
        log.close()
        del running[core]
        if stopping_since is not None:
          stopped.append(", ".join(task["users"]))
          say(f"[ablations] core {core}: {task['users'][0]} stopped (exit {proc.returncode})")
          continue
        status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        say(f"[ablations] core {core}: {task['users'][0]} {status} in "
            f"{time.time() - started:.0f} s")
        if proc.returncode:
          failed.append(f"{', '.join(task['users'])}: see {log.name}")
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  if stopping_since is not None:
    name = signal.Signals(received[0]).name
    raise Stopped(
        f"stopped by {name}: {len(stopped) - len(killed)} worker(s) saved their runs and "
        "stopped" + (f"; {len(killed)} did not stop within {grace_s:.0f} s"
                     + (" or a second signal" if len(received) > 1 else "")
                     + f" and were killed ({'; '.join(killed)}: they resume from their last "
                     "periodic checkpoint)" if killed else "")
        + f"; {len(queue)} configuration(s) not started"
        + (f"; failed before the signal: {'; '.join(failed)}" if failed else "")
        + f". Rerun the same command to resume (finished runs are read back, interrupted "
        f"ones resume; logs in {workdir / 'logs'}).", received[0])
  if failed:
    raise RuntimeError("ablation worker(s) failed: " + "; ".join(failed))
  return {"seconds": time.time() - t0, "jobs": len(cores), "cores": cores,
          "worker_peak_rss_gb": peak_kb / 2**20, "load_samples": loads}


def _kill(proc: subprocess.Popen, signum: int) -> None:
  """`signum` to a worker not reaped yet (os.kill, not Popen.send_signal, whose poll() could
  reap it behind the os.wait4 above)."""
  try:
    os.kill(proc.pid, signum)
  except ProcessLookupError:
    pass


def _die_with_parent(parent: int | None) -> None:
  """Ask Linux for SIGTERM when the parent exits (it may be killed before it can forward a
  signal), so no worker is left holding its run directory's lock; SIGTERM now if it is gone."""
  if not sys.platform.startswith("linux") or parent is None:
    return
  import ctypes  # pylint: disable=g-import-not-at-top
  pr_set_pdeathsig = 1
  ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
  if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGTERM)


def _worker(task: dict) -> None:
  _die_with_parent(task.get("parent"))
  os.sched_setaffinity(0, {task["core"]})
  from experiments.ablations.run import stage_for, train_run  # pylint: disable=g-import-not-at-top
  from experiments.base import enable_compilation_cache  # pylint: disable=g-import-not-at-top
  enable_compilation_cache(os.path.join(task["workdir"], "xla_cache"))
  ablation = BY_NAME[task["ablation"]]
  variant = ablation.variants[task["variant"]]
  for seed in task["seeds"]:
    t0 = time.time()
    try:
      train_run(stage_for(ablation, task["preset"], variant, seed), task["workdir"],
                tuple(task["probes"]))
    except KeyboardInterrupt as e:  # SIGTERM: the run saved its state
      print(f"[ablations] {', '.join(task['users'])} / seed {seed}: {e}", flush=True)
      raise SystemExit(128 + signal.SIGTERM) from None
    print(f"[ablations] {', '.join(task['users'])} / seed {seed}: {time.time() - t0:.0f} s "
          f"(affinity {sorted(os.sched_getaffinity(0))})", flush=True)
  try:
    with open("/proc/self/status") as f:
      hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
  except (OSError, StopIteration):  # not Linux: the peak is not reported
    return
  pathlib.Path(task["workdir"], "logs", f"{task['key']}.peak_rss_kb").write_text(str(hwm_kb))


if __name__ == "__main__":
  _worker(json.loads(sys.argv[1]))
