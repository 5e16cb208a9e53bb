"""Run one ablation: every variant x seed through the stage pipeline, then its numbers.

`run_ablation(ablation, preset, workdir)` trains `stage_8k`'s tiny stage with the preset's and
the ablation's `--set` items (one workdir per variant and seed, so a rerun resumes or reuses a
finished run) and returns a JSON-able record:

  {"name", "field", "preset", "seeds", "variants": {label: {"runs": [per seed:
     {"seed", "loss": {step: train loss}, "max_mean_load": {step: worst layer's max/mean
      expert load}, "dead_frac": {step: ...}, "final": {"eval_loss@L": ..., "eval_loss@2L": ...}}]}}}

`summarize(record)` turns it into the rows of the report's table (mean and spread over seeds).
"""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from experiments import stage_8k
from experiments.ablations import PRESETS, SEEDS, Ablation
from experiments.base import apply_overrides


def stage_for(ablation: Ablation, preset: str, value: str, seed: int):
  """The StageConfig of one variant and seed (stage_8k's tiny stage + preset + ablation)."""
  sets = PRESETS[preset] + ablation.common + (f"{ablation.field}={value}", f"seed={seed}")
  return apply_overrides(stage_8k.TINY, sets)


def _curves(metrics_jsonl: pathlib.Path) -> dict[str, dict[int, float]]:
  out: dict[str, dict[int, float]] = {"loss": {}, "max_mean_load": {}, "dead_frac": {}}
  names = {"train/loss": "loss", "train/moe/max_mean_load": "max_mean_load",
           "train/moe/dead_frac_max": "dead_frac"}
  for line in metrics_jsonl.open():
    r = json.loads(line)
    for key, name in names.items():
      if isinstance(r.get(key), float):
        out[name][int(r["step"])] = r[key]
  return out


def run_ablation(ablation: Ablation, preset: str, workdir: str | pathlib.Path,
                 seeds=SEEDS, progress: bool = False) -> dict[str, Any]:
  """Train every variant x seed (resuming finished or interrupted runs) and collect curves."""
  from sparse_lm.train.loop import run  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(workdir)
  record = {"name": ablation.name, "field": ablation.field, "claim": ablation.claim,
            "preset": preset, "seeds": list(seeds), "not_measured": ablation.not_measured,
            "variants": {}}
  for label, value in ablation.variants:
    runs = []
    for seed in seeds:
      stage = stage_for(ablation, preset, value, seed)
      d = workdir / ablation.name / f"{ablation.field}={value}" / f"seed{seed}"
      d.mkdir(parents=True, exist_ok=True)
      tok = workdir / "tokenizer.json"
      if tok.exists() and not (d / "tokenizer.json").exists():
        (d / "tokenizer.json").write_bytes(tok.read_bytes())
      result = run(stage, d, progress=progress, progress_every=max(stage.steps // 4, 1))
      if result.preempted:  # SIGTERM / Ctrl-C: the run saved its state; rerunning resumes it
        raise KeyboardInterrupt(f"{d} stopped at step {result.end_step}; rerun to resume")
      if not tok.exists() and (d / "tokenizer.json").exists():
        tok.write_bytes((d / "tokenizer.json").read_bytes())
      curves = _curves(d / stage.name / "tb" / "metrics.jsonl")
      runs.append({"seed": seed, "value": value, "steps": stage.steps,
                   "tokens_per_step": stage.tokens_per_batch, "seq_len": stage.seq_len,
                   **curves, "final": dict(result.final_eval)})
    record["variants"][label] = {"value": value, "runs": runs}
  return record


def _mean_spread(xs: list[float]) -> tuple[float, float]:
  """(mean, half the range) over seeds; spread 0 for one seed."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return float("nan"), float("nan")
  return statistics.fmean(xs), (max(xs) - min(xs)) / 2


def _tail_mean(curve: dict, frac: float = 0.5) -> float | None:
  """Mean of a per-step curve over its last `frac` of steps (after warm-up)."""
  if not curve:
    return None
  steps = sorted(int(s) for s in curve)
  cut = steps[int(len(steps) * (1 - frac))]
  vals = [curve[s] if s in curve else curve[str(s)] for s in steps if s >= cut]
  return statistics.fmean(vals)


def _final_loss(run: dict) -> float | None:
  final = run.get("final") or {}
  return final.get(f"eval_loss@{run['seq_len']}")


def summarize(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the ablation's table: per variant, mean ± spread over the seeds."""
  kind = next((a.summary for a in _ablations() if a.name == record["name"]), "loss")
  fmt = lambda ms: f"{ms[0]:.4f} ± {ms[1]:.4f}"
  rows = []
  if kind == "balance":
    header = ["variant", "held-out loss", "max/mean load (2nd half)", "max/mean load (last)",
              "dead experts (2nd half)"]
    for label, v in record["variants"].items():
      runs = v["runs"]
      last = lambda r: r["max_mean_load"][max(r["max_mean_load"], key=int)]
      rows.append([label, fmt(_mean_spread([_final_loss(r) for r in runs])),
                   fmt(_mean_spread([_tail_mean(r["max_mean_load"]) for r in runs])),
                   fmt(_mean_spread([last(r) for r in runs])),
                   fmt(_mean_spread([_tail_mean(r["dead_frac"]) for r in runs]))])
  elif kind == "length":
    header = ["variant", "held-out loss @L", "held-out loss @2L", "2L - L"]
    for label, v in record["variants"].items():
      runs = v["runs"]
      at = lambda r, m: (r.get("final") or {}).get(f"eval_loss@{m * r['seq_len']}")
      rows.append([label, fmt(_mean_spread([at(r, 1) for r in runs])),
                   fmt(_mean_spread([at(r, 2) for r in runs])),
                   fmt(_mean_spread([at(r, 2) - at(r, 1) for r in runs
                                     if at(r, 2) is not None and at(r, 1) is not None]))])
  else:
    header = ["variant", "held-out loss", "train loss (last 10%)"]
    for label, v in record["variants"].items():
      runs = v["runs"]
      rows.append([label, fmt(_mean_spread([_final_loss(r) for r in runs])),
                   fmt(_mean_spread([_tail_mean(r["loss"], 0.1) for r in runs]))])
  return header, rows


def _ablations():
  from experiments.ablations import ABLATIONS  # pylint: disable=g-import-not-at-top
  return ABLATIONS
