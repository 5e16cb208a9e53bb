"""Drop rate of the capped expert-parallel exchange over real training steps (docs/scaling.md).

For each receive cap (ModelConfig.ragged_buffer_factor) the stage is trained from
initialisation for --steps steps on its own data (Quantile Balancing updates the biases after
every step, so the first steps cover its warm-up), with the training loop's own build
(`sparse_lm.train.loop.build`); the step's "moe/drop_rate_total" (dropped / all (token,
expert) assignments, every MoE layer) and the largest per-layer rate are recorded per step.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m benchmarks.ep_drops --stage stage_8k --preset tiny --mesh fsdp=2,expert=4 \\
      --steps 30 --caps 1.0,1.25,1.5,2.0

Prints one line per cap: drop rate over steps [0, 5), [5, 15), [15, steps) and the worst
layer-step, plus a JSON line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile

import jax
import numpy as np

from sparse_lm import data as data_lib
from sparse_lm import sharding as shd
from sparse_lm.train import loop


def measure(stage, mesh, steps: int, tokenizer) -> dict:
  parts = loop.build(stage, mesh)
  state = parts.init()
  batch_sh = parts.batch_shardings
  it = data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                    batch_size=stage.global_batch)
  total, worst, viol = [], [], []
  for _ in range(steps):
    state, m = parts.train_step(state, loop._put(next(it), batch_sh))  # pylint: disable=protected-access
    m = jax.device_get(m)
    total.append(float(m["moe/drop_rate_total"]))
    worst.append(float(np.max(m["moe/drop_rate"])))
    viol.append(float(m.get("balancer/max_violation", np.nan)))
  return dict(total=total, worst_layer=worst, max_violation=viol)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--stage", default="stage_8k")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--mesh", default="fsdp=2,expert=4")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--caps", default="1.0,1.25,1.5,2.0")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  base = importlib.import_module(f"experiments.{args.stage}").STAGES[args.preset]
  layout = shd.MeshLayout.parse(args.mesh)
  base = dataclasses.replace(base, mesh=layout, steps=max(args.steps, base.steps))
  mesh = shd.make_mesh(layout)
  workdir = tempfile.mkdtemp(prefix="ep_drops_")
  tokenizer = data_lib.load_or_train_tokenizer(base.data, workdir,
                                               base.model_config().vocab_size)
  rows = []
  for cap in [float(c) for c in args.caps.split(",")]:
    overrides = dict(base.model_overrides, ragged_buffer_factor=cap, ep_exchange="dense")
    stage = dataclasses.replace(base, model_overrides=tuple(sorted(overrides.items())))
    r = measure(stage, mesh, args.steps, tokenizer)
    t = np.asarray(r["total"])
    windows = [(0, 5), (5, 15), (15, args.steps)]
    rates = [float(np.mean(t[a:b])) for a, b in windows if b > a]
    row = dict(cap=cap, mesh=args.mesh, preset=args.preset, stage=args.stage,
               steps=args.steps, window_means=rates, overall=float(t.mean()),
               worst_layer_step=float(np.max(r["worst_layer"])), **r)
    rows.append(row)
    print(f"cap {cap:.2f} {args.mesh}: drop rate steps 0-4 {rates[0]:.4f}, 5-14 "
          f"{rates[1]:.4f}, 15-{args.steps - 1} {rates[-1]:.4f}; all {t.mean():.4f}; worst "
          f"layer-step {row['worst_layer_step']:.4f}; max/mean load at the end "
          f"{r['max_violation'][-1]:.2f}", flush=True)
  print(json.dumps(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
