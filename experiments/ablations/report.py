"""Run the ablations and write docs/ablations.md with tables and plots from the run's numbers.

  python -m experiments.ablations.report --preset=tiny [--only balancing,gate]
      [--workdir runs/ablations] [--seeds 0,1] [--jobs 2] [--from-results] [--replace]

Every run trains stage_8k's tiny model; `--preset` names the ablation budget (steps, batch,
sequence length: experiments/ablations/__init__.py, PRESETS and BUDGETS), never a larger model.

Each run's record is stored in docs/ablations/results.json (records of ablations not rerun are
kept); the report (tables: mean ± half-range over seeds; PNG plots under docs/ablations/) is
rewritten from that file every time, so every number in it comes from a recorded run.
`--from-results` only rewrites the report. Ablations without a record are listed as not run.
A run never replaces a record of another budget (e.g. a `smoke` run the published `tiny` one)
unless `--replace` is given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time
from typing import Any

from experiments.ablations import ABLATIONS, BUDGETS, BY_NAME, PRESETS, SEEDS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _mean_curve(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
  steps = sorted({int(s) for r in runs for s in r.get(key, {})})
  xs, ys = [], []
  for s in steps:
    vals = [r[key].get(str(s), r[key].get(s)) for r in runs]
    vals = [v for v in vals if v is not None]
    if vals:
      xs.append(s)
      ys.append(sum(vals) / len(vals))
  return xs, ys


def plot(record: dict[str, Any], out_dir: pathlib.Path) -> list[str]:
  """PNG plots of the record's curves (mean over seeds); returns their file names."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from experiments.ablations.run import common_steps  # pylint: disable=g-import-not-at-top
  keys = [("loss", "train loss (nats/token)")]
  if any(r["max_mean_load"] for v in record["variants"].values() for r in v["runs"]):
    keys.append(("max_mean_load", "max/mean expert load (worst layer)"))
  names = []
  out_dir.mkdir(parents=True, exist_ok=True)
  gate = {label: [r["probe"]["gate"]["gate_exponent"] for r in v["runs"]
                  if (r.get("probe") or {}).get("gate")] for label, v in record["variants"].items()}
  if any(gate.values()):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, exps in gate.items():
      if not exps:
        continue
      steps = common_steps(exps)  # not one seed's extra checkpoint (a resumed run's)
      tokens = record["variants"][label]["runs"][0]["tokens_per_step"]
      worst = [sum(max(e[s]) for e in exps) / len(exps) for s in steps]
      ax.plot([int(s) * tokens for s in steps], worst, marker="o", label=label)
    ax.axhline(75, color="gray", linestyle=":", label="75 nats")
    ax.axhline(88.7, color="red", linestyle=":", label="fp32 exp overflow (88.7)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("dense-tile exponent, worst KDA layer (nats)")
    ax.set_title(f"gate (budget {record['preset']}, mean of seeds {record['seeds']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "gate_exponent.png", dpi=90)
    plt.close(fig)
    names.append("gate_exponent.png")
  for key, ylabel in keys:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, v in record["variants"].items():
      xs, ys = _mean_curve(v["runs"], key)
      tokens = v["runs"][0]["tokens_per_step"]
      ax.plot([x * tokens for x in xs], ys, label=label)
    if key == "max_mean_load":
      ax.axhline(1.3, color="gray", linestyle=":", label="1.3")
      ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{record['name']} (budget {record['preset']}, mean of seeds "
                 f"{record['seeds']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"{record['name']}_{key}.png"
    fig.savefig(out_dir / name, dpi=90)
    plt.close(fig)
    names.append(name)
  return names


def _balancing_verdict(v: dict[str, Any]) -> str:
  from experiments.ablations.run import _mean_spread, _tail_mean  # pylint: disable=g-import-not-at-top
  tail = lambda label: _mean_spread([_tail_mean(r["max_mean_load"]) for r in v[label]["runs"]])
  # A seed without the value (its loads lost) makes the mean nan: left out, never a mean over
  # the other seeds passed off as all of them.
  over = lambda label, key: _mean_spread([max(r.get(key) or [float("nan")]) if isinstance(
      r.get(key), list) else (r.get(key) if r.get(key) is not None else float("nan"))
                                          for r in v[label]["runs"]])
  held = lambda label: _mean_spread([max((r.get("probe") or {}).get("load", {}).get(
      "heldout_max_mean_load") or [float("nan")]) for r in v[label]["runs"]])
  run = v["quantile (midpoint)"]["runs"][0]
  qb, none = tail("quantile (midpoint)"), tail("none")
  ok = qb[0] < 1.3 and none[0] > 1.3 * qb[0]
  text = (f"Measured per training step on the whole global batch ({run['tokens_per_step']:,} "
          f"tokens in rows of {run['seq_len']}), the worst MoE layer's max/mean expert "
          f"load, averaged over the second half of the {run['steps']} steps. Quantile Balancing "
          f"(midpoint cutoff): {qb[0]:.3f} ± {qb[1]:.3f}; `none`: {none[0]:.3f}. The claim (QB "
          "< 1.3 per step after warm-up with no auxiliary loss, `none` far above) is "
          + ("supported" if ok else "NOT supported") + " at this scale.")
  if "quantile (kplus1)" in v:
    text += f" The kplus1 cutoff: {tail('quantile (kplus1)')[0]:.3f}."
  floor = over("quantile (midpoint)", "load_noise_floor")
  if floor[0] == floor[0]:
    text += (f" Uniformly random routing of each step's assignments would give {floor[0]:.3f} "
             "on this measure; that assumes independent tokens, and a batch's tokens are not "
             "(its rows are runs of a few documents): how much of the per-step value any bias "
             "can remove at this batch, and how much the histogram's resolution, the one-step "
             "lag and the batch leave, was measured separately "
             "(`python -m experiments.ablations.qb_probe`, docs/ablations/SIZING.md).")
  wq, wn = over("quantile (midpoint)", "window_max_mean_load"), over("none",
                                                                     "window_max_mean_load")
  if wq[0] == wq[0] or wn[0] == wn[0]:
    text += (" With each expert's assignments summed over the whole second half of training "
             "(worst layer): " + ", ".join(
                 f"{name} {x[0]:.3f}" if x[0] == x[0] else f"{name} not recorded"
                 for name, x in (("QB", wq), ("`none`", wn))) + ".")
  lost = [f"{label} seed {r['seed']}: {len(r['loads_missing_steps'])} of {r['steps']} steps"
          for label, x in v.items() for r in x["runs"] if r.get("loads_missing_steps")]
  if lost:
    text += (" The per-step loads of some steps were lost (a run interrupted before they were "
             f"kept: {'; '.join(lost)}), so the uniform-routing floor and the loads summed over "
             "the second half are not given where they need them.")
  hq, hn = held("quantile (midpoint)"), held("none")
  if hq[0] == hq[0]:
    text += (f" On held-out tokens with the final router and bias (loads summed over all of "
             f"them): QB {hq[0]:.3f}, `none` {hn[0]:.3f}.")
  return text


def _gate_verdict(v: dict[str, Any]) -> str:
  """The dense-tile exponent: the bounded gate's max against its bound; the unbounded gate's
  max and whether it grows over training (worst layer, mean over seeds, first vs last
  checkpoint); and what the run cannot show."""
  from experiments.ablations.run import common_steps  # pylint: disable=g-import-not-at-top
  def curve(label):
    exps = [(r.get("probe") or {}).get("gate", {}).get("gate_exponent") for r in
            v[label]["runs"]]
    exps = [e for e in exps if e]
    if not exps:
      return {}, float("nan")
    steps = common_steps(exps)  # not one seed's extra checkpoint (a resumed run's)
    worst = {int(s): sum(max(e[s]) for e in exps) / len(exps) for s in steps}
    return worst, max(max(x) for e in exps for x in e.values())
  (bc, b), (uc, u) = curve("bounded (-5)"), curve("unbounded")
  text = (f"Largest dense-tile exponent over every checkpoint, KDA layer and seed: bounded "
          f"{b:.1f} nats, within its bound of 75 (15 tile steps x 5 nats, by construction): "
          + ("yes" if b <= 75 else "NO") + f"; unbounded {u:.1f} nats. ")
  if len(uc) >= 2:
    first, last = min(uc), max(uc)
    grows = uc[last] > uc[first]
    text += ("The unbounded gate's exponent (worst layer, mean over seeds) "
             + ("grows" if grows else "does not grow") + f" over training: {uc[first]:.1f} "
             f"nats at step {first}, {uc[last]:.1f} at step {last}"
             + (f" (bounded: {bc[min(bc)]:.1f} -> {bc[max(bc)]:.1f})" if bc else "") + ". ")
  text += ("Not shown at this scale: that the unbounded exponent passes 75 nats or fp32's exp "
           "overflow (88.7) " + ("(it does here). " if u > 75 else f"(its largest is {u:.1f}); "
           "a finite run cannot show it is unbounded, only whether it grows. "))
  return text


def verdict(record: dict[str, Any]) -> str:
  """What the numbers say about the claim, plainly (computed, never hand-written)."""
  from experiments.ablations.run import _final_loss, _mean_spread  # pylint: disable=g-import-not-at-top
  v = record["variants"]
  if record["name"] == "balancing":
    return _balancing_verdict(v)
  if record["name"] == "gate":
    text = _gate_verdict(v)
  elif record["name"] == "length":
    pos = [(r.get("probe") or {}).get("length", {}) for r in v[next(iter(v))]["runs"]]
    pk = [p.get("passkey", {}) for p in pos if p]
    if pk:
      best = max(max(p.values()) for p in pk)
      return (f"Held-out loss by position and pass-key accuracy: see the tables; the best "
              f"pass-key accuracy at any depth and length is {best:.2f}"
              + (" (the model retrieves no pass key at this scale)." if best == 0 else "."))
    return "No probe recorded."
  else:
    text = ""
  losses = {label: _mean_spread([_final_loss(r) for r in x["runs"]]) for label, x in v.items()}
  if len(losses) < 2:
    return text + "One variant: see the table (no comparison to resolve)."
  best = min(losses, key=lambda k: losses[k][0])
  others = [k for k in losses if k != best]
  resolved = [k for k in others
              if losses[k][0] - losses[best][0] > losses[k][1] + losses[best][1]]
  if not resolved:
    return text + (f"Lowest mean held-out loss: {best}, but every difference is within the "
                   "spread over seeds: no difference is resolved at this scale.")
  return text + (f"Lowest held-out loss: {best}; beyond the seed spread it beats "
          f"{', '.join(resolved)}" + (f" (not resolved against {', '.join(set(others) - set(resolved))})"
                                       if set(others) - set(resolved) else "") + ".")


def _num(x, spec: str, unit: str = "") -> str:
  """A recorded number as text; "not sampled" where the run recorded none (None: e.g. no load
  sample in a run shorter than the sampling interval)."""
  return "not sampled" if x is None else f"{x:{spec}}{unit}"


def budget_label(record: dict[str, Any]) -> str:
  """The record's budget as the report names it, e.g. "budget `small` (tiny model: 9 layers,
  d_model 64, 8 experts; 2,000 steps of 2,048 tokens in rows of 256)": the model as the budget
  resolves today (run.stage_for), the steps and batch as its first run recorded them."""
  from experiments.ablations.run import stage_for  # pylint: disable=g-import-not-at-top
  parts = []
  ablation = BY_NAME.get(record["name"])
  if ablation is not None and record["preset"] in PRESETS:
    m = stage_for(ablation, record["preset"], ablation.variants[0], 0).model_config()
    parts.append(f"{m.name} model: {m.num_layers} layers, d_model {m.d_model}, "
                 f"{m.num_experts} experts")
  run = next((r for v in record["variants"].values() for r in v["runs"]), {})
  if all(k in run for k in ("steps", "tokens_per_step", "seq_len")):
    parts.append(f"{run['steps']:,} steps of {run['tokens_per_step']:,} tokens in rows of "
                 f"{run['seq_len']}")
  return f"budget `{record['preset']}`" + (f" ({'; '.join(parts)})" if parts else "")


def write_report(results: dict[str, Any], docs: pathlib.Path) -> str:
  """Rewrite docs/ablations.md (and its plots) from `results` ({name: record}); returns it."""
  from experiments.ablations.run import extra_tables, summarize  # pylint: disable=g-import-not-at-top
  meta = results.get("_meta", {})
  lines = ["# Ablations of the seed's claims", "",
           "Written by `python -m experiments.ablations.report` from the recorded runs in "
           "`docs/ablations/results.json`; every number below comes from those runs. Tables: "
           "mean ± half the range over the seeds. Configurations of one claim differ in one "
           "field and share data, steps and seeds (experiments/ablations/__init__.py). Every "
           "run trains stage_8k's tiny model; a claim's budget (`--preset`) sets its steps, "
           "batch and sequence length, never a larger model.", ""]
  for whole in meta.get("_runs", []):
    par = ""
    if whole.get("jobs", 1) > 1:
      par = (f"; {whole['jobs']} worker processes, 1-minute load average "
             f"{_num(whole.get('load_mean'), '.1f')} mean and "
             f"{_num(whole.get('load_max'), '.1f')} max over the run, largest worker's peak "
             f"resident memory {_num(whole.get('worker_peak_rss_gb'), '.2f', ' GB')}")
    lines += [f"Invocation: `{whole['command']}`, ended {whole['date']}, commit "
              f"`{whole['commit']}`, {whole['seconds']:.0f} s wall inside Python, load average "
              f"{whole['load_start']:.1f} at the start and {whole['load_end']:.1f} at the end "
              f"({whole['machine']}{par}).", ""]
  ran = [a.name for a in ABLATIONS if a.name in results]
  lines += [f"Status: {len(ran)} of {len(ABLATIONS)} claims have a recorded run"
            + (f" ({', '.join(ran)})" if ran else "") + "; the others say so below.", ""]
  for a in ABLATIONS:
    lines += [f"## {a.name}", "", f"Claim: {a.claim}", "", f"Field: `{a.field}`", ""]
    rec = results.get(a.name)
    m = meta.get(a.name, {})
    if rec is None:
      lines += ["**Not run yet.** Run it with "
                f"`python -m experiments.ablations.report --preset=tiny --only {a.name}`.", ""]
      if m.get("attempt"):
        lines += [f"Attempted: {m['attempt']}", ""]
      continue
    lines += [f"Run {m.get('date', '?')}, {budget_label(rec)}, seeds {rec['seeds']}, "
              f"commit `{m.get('commit', '?')}`, {m.get('seconds', 0):.0f} s"
              + (" (its runs' wall times summed; a run shared with another claim counts in "
                 "each)" if m.get("seconds_are") == "summed over its runs" else "")
              + f" ({m.get('machine', '?')}).", ""]
    header, rows = summarize(rec)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", verdict(rec), ""]
    for title, head, body in extra_tables(rec):
      lines += [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
      lines += ["| " + " | ".join(r) + " |" for r in body] + [""]
    if rec.get("not_measured"):
      lines += [f"Not measured by this harness: {rec['not_measured']}.", ""]
    for name in plot(rec, docs / "ablations"):
      lines += [f"![{name}](ablations/{name})", ""]
  text = "\n".join(lines)
  (docs / "ablations.md").write_text(text)
  return text


def _machine(load_end: bool = True) -> str:
  return (f"{platform.machine()}, {os.cpu_count()} CPUs"
          + (f", load average {os.getloadavg()[0]:.1f} at the end" if load_end else ""))


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def other_budgets(results: dict[str, Any], names: list[str], preset: str) -> list[str]:
  """The records of `names` in `results` that a run at `preset` would replace with one of
  another budget, each as "<name> (<its budget label>)"."""
  return [f"{name} ({budget_label(results[name])})" for name in names
          if name in results and results[name].get("preset") != preset]


def _run(args, names, seeds, results, store, docs, argv) -> dict[str, Any]:
  """Train what `names` need (in `args.jobs` pinned workers, or here with one), record each
  ablation in `store` and the report, and the invocation in results["_meta"]["_runs"]."""
  from experiments.ablations import jobs as jobs_lib  # pylint: disable=g-import-not-at-top
  from experiments.ablations.run import collect, run_ablation  # pylint: disable=g-import-not-at-top
  from experiments.base import enable_compilation_cache  # pylint: disable=g-import-not-at-top
  # The workers started, not those asked for: one per core this process may use at most.
  jobs = jobs_lib.worker_count(args.jobs or jobs_lib.default_jobs())
  if args.jobs and jobs < args.jobs:
    print(f"[ablations] --jobs {args.jobs}: this process may use {jobs} core(s) "
          f"({sorted(os.sched_getaffinity(0))}); running {jobs} "
          + ("worker(s)" if jobs > 1 else "(in this process)"), flush=True)
  t_start, load_start = time.time(), os.getloadavg()[0]
  used: dict[str, Any] = {}
  if jobs > 1:
    tasks = jobs_lib.plan(names, args.preset, seeds)
    print(f"[ablations] {len(tasks)} distinct configurations x {len(seeds)} seeds for "
          f"{', '.join(names)}, {jobs} workers", flush=True)
    used = jobs_lib.run_tasks(tasks, jobs, args.preset, args.workdir)
    jobs = used.get("jobs", jobs)
  else:
    enable_compilation_cache(os.path.join(args.workdir, "xla_cache"))
  for name in names:
    t0 = time.time()
    if jobs > 1:
      rec = collect(BY_NAME[name], args.preset, args.workdir, seeds)
    else:
      rec = run_ablation(BY_NAME[name], args.preset, args.workdir, seeds)
    previous, previous_meta = results.get(name), results.get("_meta", {}).get(name)
    results[name] = rec
    runs = [r for v in rec["variants"].values() for r in v["runs"]]
    if previous_meta and json.loads(json.dumps(previous)) == json.loads(json.dumps(rec)):
      # every run read back unchanged: the record keeps the date, commit and time of the
      # invocation that trained them (a rerun credited them to its own commit and 0 s)
      print(f"[ablations] {name}: its recorded runs were reused unchanged; its date "
            f"({previous_meta.get('date')}) and commit are kept", flush=True)
    else:
      results.setdefault("_meta", {})[name] = {
          "date": _now(), "commit": _commit(),
          "seconds": sum(r["seconds"] for r in runs) if jobs > 1 else time.time() - t0,
          "seconds_are": "summed over its runs" if jobs > 1 else "wall",
          "machine": _machine()}
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(results, indent=1))
    write_report(results, docs)
    print(f"[ablations] {name} recorded", flush=True)
  loads = used.get("load_samples") or []
  if set(names) == set(BY_NAME):  # every record is from this invocation
    results["_meta"]["_runs"] = []
  results["_meta"].setdefault("_runs", []).append({
      "command": "python -m experiments.ablations.report " + " ".join(argv or sys.argv[1:]),
      "date": _now(), "commit": _commit(), "seconds": time.time() - t_start,
      "load_start": load_start, "load_end": os.getloadavg()[0],
      "load_mean": sum(loads) / len(loads) if loads else None,
      "load_max": max(loads) if loads else None, "jobs": jobs,
      **({"jobs_asked": args.jobs} if args.jobs and args.jobs != jobs else {}),
      "worker_peak_rss_gb": used.get("worker_peak_rss_gb"),
      "machine": f"{_machine(False)}, affinity {sorted(os.sched_getaffinity(0))}"
                 + (f", workers pinned to cores {used['cores']}" if used.get("cores") else "")})
  store.write_text(json.dumps(results, indent=1))
  return results


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.ablations.report",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help=(
      "the ablation budget, always on stage_8k's tiny model (never a larger one): "
      + "; ".join(f"{k} = {v}" for k, v in BUDGETS.items())
      + " (the balancing claim sets its own 3-layer model and 256 x 32-token batch)"))
  p.add_argument("--only", default="", help="comma-separated ablation names (default: all of "
                 f"{', '.join(BY_NAME)})")
  p.add_argument("--workdir", default="runs/ablations")
  p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  p.add_argument("--docs", default=str(ROOT / "docs"))
  p.add_argument("--jobs", type=int, default=None, help="worker processes, each pinned to one "
                 "core (default 2 when 2+ cores are available, else 1: in this process)")
  p.add_argument("--from-results", action="store_true", help="rewrite the report only")
  p.add_argument("--replace", action="store_true", help="replace recorded results of another "
                 "budget (--preset) with this run's (without it, such a run stops before "
                 "training)")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()]
  if args.only and not names:
    p.error(f"--only={args.only!r} names no ablation; choose from {', '.join(BY_NAME)} "
            "(or leave --only out to run them all)")
  names = names or list(BY_NAME)
  unknown = [n for n in names if n not in BY_NAME]
  if unknown:
    p.error(f"--only: unknown ablation(s) {unknown}; choose from {', '.join(BY_NAME)}")
  if args.jobs is not None and args.jobs < 1:
    p.error(f"--jobs={args.jobs}: at least 1")
  try:
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
  except ValueError:
    p.error(f"--seeds={args.seeds!r}: expected comma-separated integers, e.g. --seeds 0,1")
  if len(set(seeds)) != len(seeds):
    p.error(f"--seeds={args.seeds!r}: a seed is repeated")
  if len(seeds) < 2 and args.preset != "smoke":
    p.error(f"--seeds={args.seeds}: at least 2 seeds (the tables report a spread over seeds)")
  docs = pathlib.Path(args.docs)
  store = docs / "ablations" / "results.json"
  if args.from_results and not docs.is_dir():
    p.error(f"--docs={args.docs}: no such directory (--from-results rewrites "
            f"{docs / 'ablations.md'} from {store})")
  if args.from_results and not store.exists():
    p.error(f"--from-results: no recorded results at {store}; run the ablations first "
            "(without --from-results) or point --docs at the directory that holds them")
  results = json.loads(store.read_text()) if store.exists() else {}
  other = [] if args.from_results or args.replace else other_budgets(results, names, args.preset)
  if other:
    p.error(f"--preset {args.preset} would replace the recorded results of another budget in "
            f"{store}: {'; '.join(other)}. Pass --replace to replace them, or --docs DIR to "
            "record this run elsewhere")
  if not args.from_results:
    try:
      results = _run(args, names, seeds, results, store, docs, argv)
    except KeyboardInterrupt as e:  # jobs.Stopped, or train_run's stop in this process
      signum = getattr(e, "signum", signal.SIGINT)
      # jobs.Stopped says "Rerun the same command ...", train_run "... rerun to resume": once.
      print(f"[ablations] {e or 'interrupted'}" + ("" if "rerun" in str(e).lower() else
            " Rerun the same command to resume (finished runs are read back, interrupted "
            "ones resume)."), file=sys.stderr, flush=True)
      return 128 + signum
  write_report(results, docs)
  print(f"[ablations] wrote {docs / 'ablations.md'}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
