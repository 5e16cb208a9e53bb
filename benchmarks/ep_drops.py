"""Drop rate of the capped expert-parallel exchange over real training steps (docs/scaling.md).

The stage is trained from initialisation for --steps steps on its own data with the receive
cap --train-cap (ModelConfig.ragged_buffer_factor; Quantile Balancing updates the biases after
every step, so the first steps cover its warm-up), with the training loop's own build
(`sparse_lm.train.loop.build`). Each step records the step's own "moe/drop_rate_total"
(dropped / all (token, expert) assignments, every MoE layer) and the routing of every MoE layer
(jax.debug.callback); the rule of docs/architecture.md ("Capacity drops",
tests/multidevice/scripts/ep_rule.py) applied to that routing gives the drop rate each cap of
--caps would have on the same steps. One compile serves every cap (on a 2-core CPU shared by
several people a compile per cap did not fit); the train cap's row is measured both ways.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m benchmarks.ep_drops --stage stage_8k --preset tiny --mesh fsdp=2,expert=4 \\
      --steps 20 --train-cap 1.25 --caps 1.0,1.25,1.5,2.0
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
import tempfile

import jax
import numpy as np

from sparse_lm import data as data_lib
from sparse_lm import sharding as shd
from sparse_lm.train import loop
from tests.multidevice.scripts.ep_rule import expected_keep
from tests.multidevice.scripts.routing_spy import RECORD, install


def measure(stage, mesh, steps: int, tokenizer, caps) -> dict:
  """Train `steps` steps; per step the reported total drop rate and, per cap, the rule's."""
  install()
  parts = loop.build(stage, mesh)
  state = parts.init()
  batch_sh = parts.batch_shardings
  it = data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                    batch_size=stage.global_batch)
  cfg = stage.model_config()
  ep = mesh.shape["expert"]
  blocks = mesh.size // mesh.shape["tensor"]
  n, k, E = stage.global_batch * stage.seq_len // blocks, cfg.experts_per_token, cfg.num_experts
  out = dict(reported=[], max_violation=[], **{f"cap_{c}": [] for c in caps},
             **{f"worst_layer_cap_{c}": [] for c in caps})
  for _ in range(steps):
    RECORD.clear()
    state, m = parts.train_step(state, loop._put(next(it), batch_sh))  # pylint: disable=protected-access
    m = jax.device_get(m)
    jax.effects_barrier()
    out["reported"].append(float(m["moe/drop_rate_total"]))
    out["max_violation"].append(float(m.get("balancer/max_violation", np.nan)))
    for c in caps:
      dropped, assigned = [], []
      for ids, pos, margin in RECORD:
        keep = expected_keep(ids, pos, margin, num_blocks=blocks, ep=ep, num_experts=E,
                             cap=math.ceil(c * n * k))
        dropped.append(int((ids < E).sum() - keep.sum()))
        assigned.append(int((ids < E).sum()))
      out[f"cap_{c}"].append(sum(dropped) / max(sum(assigned), 1))
      out[f"worst_layer_cap_{c}"].append(max(d / max(a, 1) for d, a in zip(dropped, assigned)))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--stage", default="stage_8k")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--mesh", default="fsdp=2,expert=4")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--caps", default="1.0,1.25,1.5,2.0")
  p.add_argument("--train-cap", type=float, default=1.25)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  base = importlib.import_module(f"experiments.{args.stage}").STAGES[args.preset]
  layout = shd.MeshLayout.parse(args.mesh)
  base = dataclasses.replace(base, mesh=layout, steps=max(args.steps, base.steps))
  mesh = shd.make_mesh(layout)
  workdir = tempfile.mkdtemp(prefix="ep_drops_")
  tokenizer = data_lib.load_or_train_tokenizer(base.data, workdir,
                                               base.model_config().vocab_size)
  caps = [float(c) for c in args.caps.split(",")]
  overrides = dict(base.model_overrides, ragged_buffer_factor=args.train_cap,
                   ep_exchange="dense")
  stage = dataclasses.replace(base, model_overrides=tuple(sorted(overrides.items())))
  r = measure(stage, mesh, args.steps, tokenizer, caps)
  windows = [(0, 5), (5, args.steps)]
  rows = []
  for c in caps:
    t = np.asarray(r[f"cap_{c}"])
    rows.append(dict(cap=c, mesh=args.mesh, preset=args.preset, stage=args.stage,
                     steps=args.steps, train_cap=args.train_cap,
                     window_means=[float(t[a:b].mean()) for a, b in windows],
                     overall=float(t.mean()),
                     worst_layer_step=float(np.max(r[f"worst_layer_cap_{c}"])),
                     per_step=t.tolist()))
    print(f"cap {c:.2f} {args.mesh}: drop rate steps 0-4 {t[:5].mean():.4f}, 5-"
          f"{args.steps - 1} {t[5:].mean():.4f}; all {t.mean():.4f}; worst layer-step "
          f"{rows[-1]['worst_layer_step']:.4f}", flush=True)
  rep = np.asarray(r["reported"])
  print(f"reported by the step at the train cap {args.train_cap}: all {rep.mean():.4f} "
        f"(per step {np.round(rep, 4).tolist()}); max/mean load at the end "
        f"{r['max_violation'][-1]:.2f}", flush=True)
  rows.append(dict(reported=rep.tolist(), max_violation=r["max_violation"]))
  print(json.dumps(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
