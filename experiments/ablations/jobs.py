"""The trainings of several ablations, each distinct configuration once, in worker processes.

`plan(names, preset, seeds)` lists the distinct stage configurations the ablations
need (`run.config_key`: equal configurations of different ablations, e.g. the default model as
the bounded gate, block AttnRes, SiTU-GLU and gated MLA, are one task) with the union of their
probes; `run_tasks(tasks, jobs, ...)` runs them in `jobs` worker processes, each pinned to one
core of this process's CPU set (the worker calls `os.sched_setaffinity` before importing jax;
worker i gets the i-th core), heaviest first. A worker (`python -m experiments.ablations.jobs TASK_JSON`) trains its configuration's
seeds one after another through `run.train_run` and exits, so its memory is returned; compiled
programs are shared through the persistent XLA cache in `<workdir>/xla_cache`. Afterwards
`run.collect` reads each ablation's record from the runs' run.json files.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable

from experiments.ablations import BY_NAME

ROOT = pathlib.Path(__file__).resolve().parents[2]


def default_jobs() -> int:
  """2 worker processes when this process may use 2 or more cores, else 1."""
  return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


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
              say: Callable[[str], None] = print) -> dict[str, Any]:
  """Run `tasks` (from `plan`) in `jobs` pinned worker processes; returns what the run used:
  seconds, the largest worker's peak resident memory (GB, its own VmHWM), the 1-minute
  load average's samples (every 5 s) and the cores. Each worker's output goes to
  `<workdir>/logs/<key>.log`.

  Raises:
    RuntimeError: a worker failed (after the others finished; names the task and its log).
  """
  workdir = pathlib.Path(workdir).absolute()
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  if tasks:  # the workers copy <workdir>/tokenizer.json; train it once, before they start
    from experiments.ablations.run import stage_for  # pylint: disable=g-import-not-at-top
    from sparse_lm.data import load_or_train_tokenizer  # pylint: disable=g-import-not-at-top
    ablation = BY_NAME[tasks[0]["ablation"]]
    stage = stage_for(ablation, preset, ablation.variants[tasks[0]["variant"]], 0)
    load_or_train_tokenizer(stage.data, str(workdir), stage.model_config().vocab_size)
  cores = sorted(os.sched_getaffinity(0))[:max(1, jobs)]
  queue, running, failed, loads, peak_kb = list(tasks), {}, [], [], 0
  t0 = last = time.time()
  while queue or running:
    for core in cores:
      if queue and core not in running:
        task = queue.pop(0)
        log = open(workdir / "logs" / f"{task['key']}.log", "w")  # pylint: disable=consider-using-with
        cmd = [sys.executable, "-m", "experiments.ablations.jobs",
               json.dumps({**task, "preset": preset, "workdir": str(workdir), "core": core})]
        # The worker pins itself before importing jax (no preexec_fn: forking this process,
        # which may hold jax's threads, is unsafe).
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # pylint: disable=consider-using-with
        running[core] = (proc, task, log, time.time())
        say(f"[ablations] core {core}: {', '.join(task['users'])} (seeds {task['seeds']})")
    time.sleep(1.0)
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
      status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
      say(f"[ablations] core {core}: {task['users'][0]} {status} in "
          f"{time.time() - started:.0f} s")
      if proc.returncode:
        failed.append(f"{', '.join(task['users'])}: see {log.name}")
  if failed:
    raise RuntimeError("ablation worker(s) failed: " + "; ".join(failed))
  return {"seconds": time.time() - t0, "jobs": len(cores), "cores": cores,
          "worker_peak_rss_gb": peak_kb / 2**20, "load_samples": loads}


def _worker(task: dict) -> None:
  os.sched_setaffinity(0, {task["core"]})
  from experiments.ablations.run import stage_for, train_run  # pylint: disable=g-import-not-at-top
  from experiments.base import enable_compilation_cache  # pylint: disable=g-import-not-at-top
  enable_compilation_cache(os.path.join(task["workdir"], "xla_cache"))
  ablation = BY_NAME[task["ablation"]]
  variant = ablation.variants[task["variant"]]
  for seed in task["seeds"]:
    t0 = time.time()
    train_run(stage_for(ablation, task["preset"], variant, seed), task["workdir"],
              tuple(task["probes"]))
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
