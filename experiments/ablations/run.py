"""Run one ablation: every variant x seed through the stage pipeline, then its numbers.

`train_run(stage, run_dir, workdir, probes)` trains one stage config and seed (stage_8k's tiny
stage with the preset's and the ablation's `--set` items) in `<workdir>/runs/<config key>/seed<s>`,
runs the probes on its saved parameters (probe.py) and records the run's entry in its run.json.
The key names the resolved config (`config_key`), so configurations that come out equal, in one
ablation or several, train once; a rerun reads a finished run's run.json back (training nothing)
and resumes an interrupted one. `run_ablation` does that for every variant and seed in this
process; `jobs.run_tasks` does it in worker processes, and `collect` gathers the record:

  {"name", "field", "preset", "seeds", "variants": {label: {"value", "runs": [per seed:
     {"seed", "loss": {step: train loss}, "max_mean_load": {step: worst layer's max/mean
      expert load}, "dead_frac": {step: ...}, "final": {"eval_loss@L": ..., "eval_loss@2L": ...},
      "window_max_mean_load", "load_noise_floor" (from the per-step loads, `load_stats`),
      "loads_missing_steps": steps whose loads were lost (a resumed run keeps its loads),
      "probe": {...}, "seconds": wall time of the run and its probes}]}}}

`summarize(record)` turns it into the rows of the report's table (mean and spread over seeds).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import statistics
import time
from typing import Any

import numpy as np

from experiments import stage_8k
from experiments.ablations import PRESETS, SEEDS, Ablation
from experiments.base import apply_overrides


def stage_for(ablation: Ablation, preset: str, variant: tuple, seed: int):
  """The StageConfig of one variant ((label, value[, extra --set items])) and seed
  (stage_8k's tiny stage + preset + the ablation's common items + the variant)."""
  extra = tuple(variant[2]) if len(variant) > 2 else ()
  sets = (PRESETS[preset] + ablation.common + (f"{ablation.field}={variant[1]}",) + extra
          + (f"seed={seed}",))
  return apply_overrides(stage_8k.TINY, sets)


def config_key(stage) -> str:
  """12 hex digits naming the resolved stage config up to its seed: the model config the
  overrides resolve to (not the override list, which names defaults too), the other fields."""
  from sparse_lm.train.checkpoint import to_json  # pylint: disable=g-import-not-at-top
  cfg = to_json(stage)
  cfg.pop("seed", None)
  cfg["model_overrides"] = to_json(stage.model_config())
  return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_dir(workdir: str | pathlib.Path, stage) -> pathlib.Path:
  """Where `stage` (config and seed) trains: `<workdir>/runs/<config key>/seed<seed>`."""
  return pathlib.Path(workdir) / "runs" / config_key(stage) / f"seed{stage.seed}"


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


def train_run(stage, workdir: str | pathlib.Path, probes: tuple[str, ...] = (),
              progress: bool = False) -> dict[str, Any]:
  """Train `stage` in `run_dir(workdir, stage)` (resuming an interrupted run), run the probes
  of `probes` it has not recorded, and return its entry (also written to the run's run.json;
  a finished run with every probe recorded is read back from there, training nothing).
  `<workdir>/tokenizer.json` is shared: copied into the run, or saved from its first run.

  Raises:
    KeyboardInterrupt: the run was stopped (SIGTERM / Ctrl-C) after saving its state; rerun.
  """
  d = run_dir(workdir, stage)
  saved = d / "run.json"
  entry = json.loads(saved.read_text()) if saved.exists() else None
  todo = tuple(k for k in probes if entry is None or k not in entry["probe"])
  if entry is not None and not todo:
    return entry
  import jax  # pylint: disable=g-import-not-at-top
  from experiments.ablations import probe  # pylint: disable=g-import-not-at-top
  from sparse_lm.train.loop import run  # pylint: disable=g-import-not-at-top
  t0 = time.time()
  if entry is None:
    d.mkdir(parents=True, exist_ok=True)
    tok = pathlib.Path(workdir) / "tokenizer.json"
    if tok.exists() and not (d / "tokenizer.json").exists():
      (d / "tokenizer.json").write_bytes(tok.read_bytes())
    # Each step's loads are appended as it completes, so a resumed run continues the file.
    with (d / LOADS).open("a") as f:
      def record_load(step, m):
        if "moe/load" in m:
          f.write(json.dumps({"step": step, "load": m["moe/load"].tolist(),
                              "dtype": str(m["moe/load"].dtype)}) + "\n")
          f.flush()
      result = run(stage, d, progress=progress, progress_every=max(stage.steps // 4, 1),
                   on_step=record_load)
    if result.preempted:
      raise KeyboardInterrupt(f"{d} stopped at step {result.end_step}; rerun to resume")
    if not tok.exists() and (d / "tokenizer.json").exists():
      tok.write_bytes((d / "tokenizer.json").read_bytes())
    entry = {"seed": stage.seed, "steps": stage.steps, "run_dir": str(d),
             "tokens_per_step": stage.tokens_per_batch, "seq_len": stage.seq_len,
             **_curves(d / stage.name / "tb" / "metrics.jsonl"),
             "final": dict(result.final_eval), "probe": {}, **load_stats(d, stage.steps),
             "seconds": 0.0}
  if todo:
    found = probe.probe_run(d, todo)
    entry["probe"].update({k: found for k in todo})
  entry["seconds"] += time.time() - t0
  saved.write_text(json.dumps(entry))
  jax.clear_caches()  # drop this run's compiled programs from memory (the disk cache keeps them)
  return entry


def collect(ablation: Ablation, preset: str, workdir: str | pathlib.Path,
            seeds=SEEDS) -> dict[str, Any]:
  """The ablation's record from its runs' run.json files (see the module docstring).

  Raises:
    FileNotFoundError: a variant or seed has not been trained (names the run).
  """
  record = {"name": ablation.name, "field": ablation.field, "claim": ablation.claim,
            "preset": preset, "seeds": list(seeds), "not_measured": ablation.not_measured,
            "variants": {}}
  for variant in ablation.variants:
    runs = []
    for seed in seeds:
      saved = run_dir(workdir, stage_for(ablation, preset, variant, seed)) / "run.json"
      if not saved.exists():
        raise FileNotFoundError(f"{ablation.name} / {variant[0]} / seed {seed}: no finished run "
                                f"at {saved.parent}; run the ablation first")
      entry = json.loads(saved.read_text())
      entry["probe"] = {k: v for k, v in entry["probe"].items() if k in ablation.probes}
      runs.append({**entry, "value": variant[1]})
    record["variants"][variant[0]] = {"value": variant[1], "runs": runs}
  return record


def run_ablation(ablation: Ablation, preset: str, workdir: str | pathlib.Path,
                 seeds=SEEDS, progress: bool = False, probes: bool = True) -> dict[str, Any]:
  """Train every variant x seed in this process (reusing finished runs, resuming interrupted
  ones), probe (unless `probes` is False), collect."""
  for variant in ablation.variants:
    for seed in seeds:
      t0 = time.time()
      stage = stage_for(ablation, preset, variant, seed)
      train_run(stage, workdir, ablation.probes if probes else (), progress)
      print(f"[ablations] {ablation.name} / {variant[0]} / seed {seed}: "
            f"{time.time() - t0:.0f} s ({run_dir(workdir, stage)})", flush=True)
  return collect(ablation, preset, workdir, seeds)


LOADS = "loads.jsonl"  # per step {"step", "load": [layers][E], "dtype"}, appended by train_run


def read_loads(d: pathlib.Path) -> dict[int, np.ndarray]:
  """The per-step expert loads ([layers, E] each) that the runs in `d` appended to LOADS, by
  step; a step recorded twice (redone after a resume from an earlier checkpoint) keeps its last
  record; a line cut short by a killed process is skipped."""
  loads = {}
  if not (d / LOADS).exists():
    return loads
  for line in (d / LOADS).open():
    try:
      r = json.loads(line)
    except json.JSONDecodeError:
      continue
    loads[int(r["step"])] = np.asarray(r["load"], dtype=r.get("dtype", "float32"))
  return loads


def load_stats(d: pathlib.Path, steps: int) -> dict[str, Any]:
  """The run's entries from its per-step loads: "window_max_mean_load" and "load_noise_floor"
  (None for a model without MoE layers, or where a step they need lost its loads) and
  "loads_missing_steps" (the steps in 0..steps-1 without loads, where any step has them:
  e.g. the first part of a run interrupted before its loads were kept). Writes loads.npy
  [steps, layers, E] when every step is there."""
  loads = read_loads(d)
  missing = [s for s in range(steps) if s not in loads] if loads else []
  out = {"window_max_mean_load": None, "load_noise_floor": None, "loads_missing_steps": missing}
  if loads and not missing:
    np.save(d / "loads.npy", np.stack([loads[s] for s in range(steps)]))
    out.update(window_max_mean_load=window_load(d / "loads.npy"),
               load_noise_floor=noise_floor(d / "loads.npy"))
  return out


def window_load(path: pathlib.Path, frac: float = 0.5) -> list[float] | None:
  """Per MoE layer, max/mean expert load of the assignments summed over the last `frac` of the
  training steps (from the run's loads.npy [steps, layers, E]); None without the file."""
  if not path.exists():
    return None
  loads = np.load(path).astype(np.float64)
  total = loads[int(len(loads) * (1 - frac)):].sum(0)  # [layers, E]
  return [float(x) for x in total.max(-1) / total.mean(-1)]


def noise_floor(path: pathlib.Path, draws: int = 200, seed: int = 0) -> float | None:
  """The per-step max/mean load (worst layer, mean over the second half) that perfectly
  balanced routing would show from sampling alone: each step's assignments of each layer drawn
  uniformly at random over the E experts (multinomial with the run's per-step counts, from
  loads.npy [steps, layers, E]); None without the file."""
  if not path.exists():
    return None
  loads = np.load(path).astype(np.float64)
  loads = loads[int(len(loads) * 0.5):]
  n = loads.sum(-1).round().astype(np.int64)  # [steps, layers]
  num_experts = loads.shape[-1]
  rng = np.random.default_rng(seed)
  draws = rng.multinomial(n[None], np.full(num_experts, 1.0 / num_experts),
                          size=(draws,) + n.shape)  # [draws, steps, layers, E]
  ratio = draws.max(-1) / np.maximum(draws.mean(-1), 1e-9)
  return float(ratio.max(-1).mean())


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


def _probe(run: dict, kind: str, key: str):
  return (run.get("probe") or {}).get(kind, {}).get(key)


def common_steps(curves: list[dict]) -> list:
  """The step keys every seed's {step: value} curve has, in step order: a run stopped and
  resumed also keeps the checkpoint it saved on the interrupt (off the checkpoint grid, in that
  seed only), so one seed's steps are not every seed's."""
  if not curves:
    return []
  return sorted(set(curves[0]).intersection(*curves[1:]), key=int)


def summarize(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the ablation's table: per variant, mean ± spread over the seeds."""
  kind = next((a.summary for a in _ablations() if a.name == record["name"]), "loss")
  fmt = lambda ms: f"{ms[0]:.4f} ± {ms[1]:.4f}"
  ms = lambda xs: fmt(_mean_spread(xs))
  rows = []
  for label, v in record["variants"].items():
    runs = v["runs"]
    loss = ms([_final_loss(r) for r in runs])
    if kind == "balance":
      last = lambda r: r["max_mean_load"][max(r["max_mean_load"], key=int)]
      held = [max(_probe(r, "load", "heldout_max_mean_load") or [float("nan")]) for r in runs]
      window = [max(r.get("window_max_mean_load") or [float("nan")]) for r in runs]
      lost = [f"seed {r['seed']}: {len(r['loads_missing_steps'])} of {r['steps']} steps"
              for r in runs if r.get("loads_missing_steps")]
      window = f"not recorded (loads lost, {'; '.join(lost)})" if lost else ms(window)
      rows.append([label, loss, ms([_tail_mean(r["max_mean_load"]) for r in runs]),
                   ms([last(r) for r in runs]), window, ms(held),
                   ms([_tail_mean(r["dead_frac"]) for r in runs])])
    elif kind == "gate":
      exps = [_probe(r, "gate", "gate_exponent") or {} for r in runs]
      final = [max(e[max(e, key=int)]) if e else None for e in exps]
      over = [max(max(x) for x in e.values()) if e else None for e in exps]
      rows.append([label, loss, ms(final), ms(over)])
    elif kind == "activation":
      acts = [max(_probe(r, "activation", "ffn_activation_max") or [float("nan")]) for r in runs]
      rows.append([label, loss, ms([_tail_mean(r["loss"], 0.1) for r in runs]), ms(acts)])
    elif kind == "length":
      pos = [_probe(r, "length", "position_losses") or {} for r in runs]
      keys = [k for k in (pos[0] if pos else {}) if k.startswith("loss@")]
      rows.append([label] + [ms([p.get(k) for p in pos]) for k in keys])
      header = ["variant"] + [f"held-out {k}" for k in keys]
    else:
      rows.append([label, loss, ms([_tail_mean(r["loss"], 0.1) for r in runs])])
  if kind == "balance":
    n = next((_probe(r, "load", "heldout_load_tokens") for v in record["variants"].values()
              for r in v["runs"]), None)
    header = ["variant", "held-out loss", "max/mean load, training (2nd half mean)",
              "max/mean load, training (last step)",
              "max/mean load, training, loads summed over the 2nd half",
              f"max/mean load, held-out ({n} tokens summed)", "dead experts (2nd half)"]
  elif kind == "gate":
    header = ["variant", "held-out loss", "dense-tile exponent, final (nats, worst layer)",
              "dense-tile exponent, max over checkpoints (nats)"]
  elif kind == "activation":
    header = ["variant", "held-out loss", "train loss (last 10%)",
              "max |GLU hidden activation| (any layer)"]
  elif kind != "length":
    header = ["variant", "held-out loss", "train loss (last 10%)"]
  return header, rows


def extra_tables(record: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
  """Further (title, header, rows) tables: per layer values, position buckets, pass keys
  (mean over seeds)."""
  out = []
  mean = lambda xs: statistics.fmean(xs) if xs else float("nan")
  for label, v in record["variants"].items():
    runs = v["runs"]
    exps = [_probe(r, "gate", "gate_exponent") for r in runs]
    steps = common_steps(exps) if all(exps) else []  # not one seed's extra checkpoint
    if steps:
      n = len(exps[0][steps[0]])
      rows = [[str(s)] + [f"{mean([e[s][i] for e in exps]):.1f}" for i in range(n)]
              for s in steps]
      out.append((f"{label}: dense-tile exponent (nats) per KDA layer, by checkpoint step",
                  ["step"] + [f"KDA layer {i}" for i in range(n)], rows))
    acts = [_probe(r, "activation", "ffn_activation_max") for r in runs]
    if all(acts):
      out.append((f"{label}: max |hidden activation| per GLU call (execution order: the dense "
                  "FFN, then per MoE layer its shared and routed experts)",
                  [f"call {i}" for i in range(len(acts[0]))],
                  [[f"{mean([a[i] for a in acts]):.2f}" for i in range(len(acts[0]))]]))
    pos = [_probe(r, "length", "position_losses") for r in runs]
    if all(pos):
      keys = [k for k in pos[0] if k.startswith("positions")]
      out.append((f"{label}: held-out loss per position bucket (rows of 8L = "
                  f"{8 * runs[0]['seq_len']} tokens of one document; L = {runs[0]['seq_len']})",
                  keys, [[f"{mean([p[k] for p in pos]):.4f}" for k in keys]]))
    pk = [_probe(r, "length", "passkey") for r in runs]
    if all(pk):
      lengths = sorted({k.split("@")[0] for k in pk[0]}, key=lambda x: int(x[:-1]))
      depths = sorted({k.split("@")[1] for k in pk[0]}, key=float)
      rows = [[f"depth {d}"] + [f"{mean([p[f'{m}@{d}'] for p in pk]):.2f}" for m in lengths]
              for d in depths]
      out.append((f"{label}: pass-key retrieval accuracy (greedy, exact 5 digits) by depth and "
                  "length", ["depth"] + lengths, rows))
  return out


def _ablations():
  from experiments.ablations import ABLATIONS  # pylint: disable=g-import-not-at-top
  return ABLATIONS
