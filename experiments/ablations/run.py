"""Run one ablation: every variant x seed through the stage pipeline, then its numbers.

`run_ablation(ablation, preset, workdir)` trains `stage_8k`'s tiny stage with the preset's and
the ablation's `--set` items (one workdir per distinct stage config and seed,
`<workdir>/runs/<config hash>/seed<s>`, so a rerun resumes or reuses a finished run, and
configurations shared by several ablations train once), runs the ablation's probes on the saved
parameters (probe.py; cached in the run's probe.json) and returns a JSON-able record:

  {"name", "field", "preset", "seeds", "variants": {label: {"runs": [per seed:
     {"seed", "loss": {step: train loss}, "max_mean_load": {step: worst layer's max/mean
      expert load}, "dead_frac": {step: ...}, "final": {"eval_loss@L": ..., "eval_loss@2L": ...},
      "probe": {...}, "seconds": wall time of the run and its probes}]}}}

`summarize(record)` turns it into the rows of the report's table (mean and spread over seeds).
"""

from __future__ import annotations

import gc
import hashlib
import json
import pathlib
import statistics
import time
from typing import Any

import jax
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
  """12 hex digits naming the stage config up to its seed (identical configs share runs)."""
  from sparse_lm.train.checkpoint import to_json  # pylint: disable=g-import-not-at-top
  cfg = to_json(stage)
  cfg.pop("seed", None)
  return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


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
                 seeds=SEEDS, progress: bool = False, probes: bool = True) -> dict[str, Any]:
  """Train every variant x seed (resuming finished or interrupted runs), probe (unless
  `probes` is False), collect."""
  from sparse_lm.train.loop import run  # pylint: disable=g-import-not-at-top
  from experiments.ablations import probe  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(workdir)
  record = {"name": ablation.name, "field": ablation.field, "claim": ablation.claim,
            "preset": preset, "seeds": list(seeds), "not_measured": ablation.not_measured,
            "variants": {}}
  for variant in ablation.variants:
    label, value = variant[0], variant[1]
    runs = []
    for seed in seeds:
      t0 = time.time()
      stage = stage_for(ablation, preset, variant, seed)
      d = workdir / "runs" / config_key(stage) / f"seed{seed}"
      d.mkdir(parents=True, exist_ok=True)
      tok = workdir / "tokenizer.json"
      if tok.exists() and not (d / "tokenizer.json").exists():
        (d / "tokenizer.json").write_bytes(tok.read_bytes())
      loads = {}
      record_load = lambda step, m: loads.__setitem__(step, m["moe/load"]) if "moe/load" in m \
          else None
      result = run(stage, d, progress=progress, progress_every=max(stage.steps // 4, 1),
                   on_step=record_load)
      if len(loads) == stage.steps:  # a whole run seen here (not resumed): keep its loads
        np.save(d / "loads.npy", np.stack([loads[s] for s in sorted(loads)]))
      if result.preempted:  # SIGTERM / Ctrl-C: the run saved its state; rerunning resumes it
        raise KeyboardInterrupt(f"{d} stopped at step {result.end_step}; rerun to resume")
      if not tok.exists() and (d / "tokenizer.json").exists():
        tok.write_bytes((d / "tokenizer.json").read_bytes())
      cache = d / "probe.json"
      done = json.loads(cache.read_text()) if cache.exists() else {}
      todo = tuple(k for k in ablation.probes if k not in done) if probes else ()
      if todo:
        found = probe.probe_run(d, todo)
        done.update({k: found for k in todo})
        cache.write_text(json.dumps(done))
      curves = _curves(d / stage.name / "tb" / "metrics.jsonl")
      runs.append({"seed": seed, "value": value, "steps": stage.steps, "run_dir": str(d),
                   "tokens_per_step": stage.tokens_per_batch, "seq_len": stage.seq_len,
                   **curves, "final": dict(result.final_eval),
                   "probe": {k: done[k] for k in ablation.probes if k in done},
                   "window_max_mean_load": window_load(d / "loads.npy"),
                   "seconds": time.time() - t0})
      jax.clear_caches()  # drop this run's compiled programs from memory (the disk cache keeps them)
      gc.collect()
      print(f"[ablations] {ablation.name} / {label} / seed {seed}: "
            f"{time.time() - t0:.0f} s ({d})", flush=True)
    record["variants"][label] = {"value": value, "runs": runs}
  return record


def window_load(path: pathlib.Path, frac: float = 0.5) -> list[float] | None:
  """Per MoE layer, max/mean expert load of the assignments summed over the last `frac` of the
  training steps (from the run's loads.npy [steps, layers, E]); None without the file."""
  if not path.exists():
    return None
  loads = np.load(path).astype(np.float64)
  total = loads[int(len(loads) * (1 - frac)):].sum(0)  # [layers, E]
  return [float(x) for x in total.max(-1) / total.mean(-1)]


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
      rows.append([label, loss, ms([_tail_mean(r["max_mean_load"]) for r in runs]),
                   ms([last(r) for r in runs]), ms(window), ms(held),
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
    if all(exps):
      steps = sorted(exps[0], key=int)
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
