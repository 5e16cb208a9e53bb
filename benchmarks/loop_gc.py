"""Python's garbage collector inside the training loop: `StageConfig.gc_every` settings side by
side (docs/benchmarks.md, "The README's tiny job on one H200").

Each setting runs in a process of its own (a fresh heap, as a real run has): the stage (default
stage_8k's tiny preset) trains --steps steps from initialisation in a temporary workdir through
`sparse_lm.train.loop.run`, and a `gc.callbacks` hook times every collection between the first
and the last `on_step` call (the steps after the first, with their evals and checkpoints), by
generation. gc_every = 0 is Python's own collector (the loop before `loop._StepGC`); the
default 100 freezes the heap after the first step, turns automatic collection off and collects
every 100 steps.

  python -m benchmarks.loop_gc --steps 120                      # gc_every 100, then 0
  python -m benchmarks.loop_gc --steps 120 --gc-every 100,0,10 --json gc.json

Prints, per setting: collections and their total and longest pause per generation, the wall
time of the window, and the objects the collector tracked at its end.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import subprocess
import sys
import tempfile
import time

from benchmarks import cli_args


def measure_one(stage_module: str, preset: str, steps: int, gc_every: int,
                sets: list[str]) -> dict:
  """Train in this process with `gc_every`; the collections of the window, by generation."""
  from experiments.base import apply_overrides  # pylint: disable=g-import-not-at-top
  from sparse_lm.train import loop  # pylint: disable=g-import-not-at-top

  stage = importlib.import_module(f"experiments.{stage_module}").STAGES[preset]
  stage = apply_overrides(dataclasses.replace(stage, steps=steps, gc_every=gc_every), sets)
  gens: dict[int, list[float]] = {}
  window = {"on": False, "t0": 0.0, "t1": 0.0, "start": 0.0}

  def on_gc(phase, info):
    if not window["on"]:
      return
    if phase == "start":
      window["start"] = time.perf_counter()
    else:
      gens.setdefault(info["generation"], []).append(time.perf_counter() - window["start"])

  def on_step(step, scalars):
    del scalars
    if not window["on"]:
      window["on"], window["t0"] = True, time.perf_counter()
    window["t1"] = time.perf_counter()
    if step == steps - 1:
      window["on"] = False

  gc.callbacks.append(on_gc)
  try:
    with tempfile.TemporaryDirectory() as workdir:
      loop.run(stage, workdir, progress=False, progress_every=10**9, on_step=on_step)
  finally:
    gc.callbacks.remove(on_gc)
  return {"gc_every": gc_every, "steps": steps, "window_s": window["t1"] - window["t0"],
          "tracked_objects_at_end": len(gc.get_objects()),
          "by_generation": {str(g): {"collections": len(p), "total_ms": 1e3 * sum(p),
                                     "max_ms": 1e3 * max(p)} for g, p in sorted(gens.items())}}


def _table(results: list[dict]) -> str:
  rows = ["| gc_every | generation | collections | total (ms) | longest (ms) |",
          "|---|---|---|---|---|"]
  for r in results:
    if not r["by_generation"]:
      rows.append(f"| {r['gc_every']} | - | 0 | 0 | - |")
    for g, s in r["by_generation"].items():
      rows.append(f"| {r['gc_every']} | {g} | {s['collections']} | {s['total_ms']:.1f} | "
                  f"{s['max_ms']:.1f} |")
  for r in results:
    rows.append(f"\ngc_every {r['gc_every']}: steps 1-{r['steps'] - 1} took "
                f"{r['window_s']:.1f} s; {r['tracked_objects_at_end']:,} objects tracked at "
                "the end")
  return "\n".join(rows)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--stage", default="stage_8k", help="module of experiments/ (default stage_8k)")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--gc-every", default="100,0",
                 help="comma-separated StageConfig.gc_every values, one process each")
  p.add_argument("--set", dest="sets", action="append", default=[],
                 help="a StageConfig override key=value, as the experiment CLI's --set")
  p.add_argument("--json", help="write the results here")
  p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: one setting
  args = p.parse_args(argv)
  if args.steps < 2:
    p.error(f"--steps {args.steps}: needs at least 2 (the window starts after the first step)")
  if args.one is not None:
    print("RESULT " + json.dumps(measure_one(args.stage, args.preset, args.steps, args.one,
                                             args.sets)), flush=True)
    return 0
  try:
    settings = [int(x) for x in args.gc_every.split(",")]
  except ValueError:
    p.error(f"--gc-every {args.gc_every!r}: expected integers such as 100,0")
  if any(s < 0 for s in settings):
    p.error(f"--gc-every {args.gc_every!r}: each value must be >= 0 (0: Python's collector)")
  stage = cli_args.stage_preset(p, args.stage, args.preset)  # here, not in each child
  from experiments.base import apply_overrides  # pylint: disable=g-import-not-at-top
  for every in settings:  # the child's own stage: the --set keys and values, checked here
    try:
      apply_overrides(dataclasses.replace(stage, steps=args.steps, gc_every=every), args.sets)
    except ValueError as e:
      p.error(str(e))
  results = []
  for every in settings:
    cmd = [sys.executable, "-m", "benchmarks.loop_gc", "--one", str(every), "--stage",
           args.stage, "--preset", args.preset, "--steps", str(args.steps)]
    cmd += [f"--set={s}" for s in args.sets]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not line:
      sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
      print(f"gc_every {every}: the child failed (rc {out.returncode})", file=sys.stderr)
      return 1
    results.append(json.loads(line[0][len("RESULT "):]))
    print(f"gc_every {every}: done", flush=True)
  print(_table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
