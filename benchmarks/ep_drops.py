"""Drop rate of the capped expert-parallel exchange over real training steps (docs/scaling.md).

Two modes; both train the stage from initialisation for --steps steps on its own data with the
training loop's own build (`sparse_lm.train.loop.build`; Quantile Balancing updates the biases
after every step, so the first steps cover its warm-up), record the routing of every MoE layer
call (jax.debug.callback, tests/multidevice/scripts/routing_spy.py) and apply the rule of
docs/architecture.md ("Capacity drops") to it, which gives the drop rate each cap of --caps would
have on the same steps. One compile serves every cap.

Real mesh (default): train on --mesh (expert >= 2) at the receive cap --train-cap
(ModelConfig.ragged_buffer_factor); the step's own "moe/drop_rate_total" is recorded too, so
the train cap's row is measured both ways (tests/multidevice/scripts/ep_rule.py's rule).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m benchmarks.ep_drops --stage stage_8k --preset tiny --mesh fsdp=2,expert=4 \\
      --steps 20 --train-cap 1.25 --caps 1.0,1.25,1.5,2.0

Virtual mesh (--virtual-mesh LAYOUT, repeatable): train on the devices there are without
expert parallelism and without a cap (dropless), and count what each cap would drop with the
tokens grouped as the --virtual-devices devices of LAYOUT would hold them
(benchmarks/ep_virtual.py; checked device by device against real 8-device steps by
tests/multidevice/test_ep_drops.py). For presets too large for 8 CPU devices:

  python -m benchmarks.ep_drops --stage stage_8k --preset small --steps 40 \\
    --virtual-mesh fsdp=2,expert=4 --virtual-mesh expert=8 \\
    --virtual-mesh fsdp=2,expert=4,expert_shards=context \\
    --virtual-mesh expert=8,expert_shards=context --set model.gmm_backend=ragged_dot \\
    --json results.json --deadline-s 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import cli_args, ep_virtual
from experiments.base import apply_overrides
from sparse_lm import data as data_lib
from sparse_lm import sharding as shd
from sparse_lm.train import loop
from tests.multidevice.scripts.ep_rule import expected_keep
from tests.multidevice.scripts.routing_spy import RECORD, install


def _iterator(stage, tokenizer):
  return data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                      batch_size=stage.global_batch,
                                      patch_size=stage.model_config().vision_patch_size)


def measure(stage, mesh, steps: int, tokenizer, caps) -> dict:
  """Train `steps` steps on the real mesh; per step the reported total drop rate and, per
  cap, the rule's."""
  install()
  parts = loop.build(stage, mesh)
  state = parts.init()
  batch_sh = parts.batch_shardings
  it = _iterator(stage, tokenizer)
  cfg = stage.model_config()
  ep = mesh.shape["expert"]
  blocks = mesh.size // mesh.shape["tensor"]
  k, E = cfg.experts_per_token, cfg.num_experts
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
        n = ids.shape[0] // blocks
        keep = expected_keep(ids, pos, margin, num_blocks=blocks, ep=ep, num_experts=E,
                             cap=math.ceil(c * n * k))
        dropped.append(int((ids < E).sum() - keep.sum()))
        assigned.append(int((ids < E).sum()))
      out[f"cap_{c}"].append(sum(dropped) / max(sum(assigned), 1))
      out[f"worst_layer_cap_{c}"].append(max(d / max(a, 1) for d, a in zip(dropped, assigned)))
  return out


def check_virtual(stage, mesh, layouts: dict, num_devices: int) -> None:
  """Refuse, before any compile, what the virtual mode cannot count.

  Raises:
    ValueError: the training mesh has expert > 1, the model drops by itself
      (capacity_factor), or a layout does not divide the micro-batch tokens or the experts.
  """
  cfg = stage.model_config()
  if mesh.shape["expert"] > 1:
    raise ValueError(f"--virtual-mesh trains without expert parallelism: --mesh has expert="
                     f"{mesh.shape['expert']}; use a mesh without expert (e.g. fsdp=-1)")
  if cfg.capacity_factor is not None:
    raise ValueError(f"model.capacity_factor={cfg.capacity_factor} drops before the exchange; "
                     "--virtual-mesh needs it None (--set model.capacity_factor=None)")
  tokens = stage.global_batch // stage.micro_batches * stage.seq_len
  for name, shape in layouts.items():
    group, _, ep = ep_virtual.block_layout(shape)
    if tokens % group.size or cfg.num_experts % ep:
      raise ValueError(f"--virtual-mesh {name} on {num_devices} devices: {tokens} tokens per "
                       f"micro-batch over {group.size} token blocks and {cfg.num_experts} "
                       f"experts over expert={ep}: both must divide")


def measure_virtual(stage, mesh, steps: int, tokenizer, factors, layouts: dict, *,
                    deadline_s: float | None = None, on_step=None) -> dict:
  """Train dropless on `mesh`; per step, per layout of `layouts` ({name: per-axis sizes}) and
  per cap factor, the drop rate the capped exchange would have on the recorded routing.

  The host counts step s while the device runs step s + 1. Stops early once the next step
  would end past `deadline_s` seconds from the start. `on_step(result)` after every step.
  """
  install()
  cfg = stage.model_config()
  k, E = cfg.experts_per_token, cfg.num_experts
  t_start = time.perf_counter()
  parts = loop.build(stage, mesh)
  state = parts.init()
  it = _iterator(stage, tokenizer)
  res = dict(step_seconds=[], loss=[], max_violation=[], calls=[], unique_calls=[],
             layouts={name: {"rate": {str(c): [] for c in factors},
                             "worst_call": {str(c): [] for c in factors}} for name in layouts})
  groupings = {}  # layouts with the same token blocks and groups count once
  for name, shape in layouts.items():
    key = tuple(np.concatenate(ep_virtual.block_layout(shape)[:2]).tolist())
    groupings.setdefault(key, (shape, []))[1].append(name)

  def count(calls):
    for shape, names in groupings.values():
      blocks = ep_virtual.block_layout(shape)[0].size
      per_call = []
      for ids, pos, _ in calls:
        caps = ep_virtual.caps_in_rows(factors, ids.shape[0], k, blocks)
        d, a = ep_virtual.drop_counts(ids, pos, shape=shape, num_experts=E, caps=caps)
        per_call.append((d.sum(axis=1), a.sum()))
      for i, c in enumerate(factors):
        rate = sum(d[i] for d, _ in per_call) / max(sum(a for _, a in per_call), 1)
        worst = max(d[i] / max(a, 1) for d, a in per_call)
        for name in names:
          res["layouts"][name]["rate"][str(c)].append(float(rate))
          res["layouts"][name]["worst_call"][str(c)].append(float(worst))

  pending, t_last = None, time.perf_counter()
  for step in range(steps):
    last = res["step_seconds"][-1] if res["step_seconds"] else 0.0
    if deadline_s is not None and step > 0 and (
        time.perf_counter() - t_start + last > deadline_s):
      print(f"deadline: stopping after {step} steps", flush=True)
      break
    batch = loop._put(next(it), parts.batch_shardings)  # pylint: disable=protected-access
    state, m = parts.train_step(state, batch)
    if pending is not None:  # the host's share of the previous step, beside this one
      count(pending)
      if on_step:
        on_step(res)
    m = jax.device_get(m)
    jax.effects_barrier()
    now = time.perf_counter()
    res["step_seconds"].append(now - t_last)
    t_last = now
    res["loss"].append(float(m["loss"]))
    res["max_violation"].append(float(m.get("balancer/max_violation", np.nan)))
    res["calls"].append(len(RECORD))
    pending = ep_virtual.distinct_calls(RECORD)
    res["unique_calls"].append(len(pending))
    RECORD.clear()
    print(f"step {step}: {res['step_seconds'][-1]:.1f} s, loss {res['loss'][-1]:.3f}, max/mean "
          f"load {res['max_violation'][-1]:.2f}, {len(pending)} layer calls", flush=True)
  if pending is not None:
    count(pending)
  if on_step:
    on_step(res)
  return res


def summary(rates, worst, windows) -> dict:
  """Window means, overall mean and worst of one cap's per-step series."""
  t = np.asarray(rates)
  return dict(window_means={f"{a}-{min(b, len(t)) - 1}": float(t[a:b].mean())
                            for a, b in windows if a < len(t)},
              overall=float(t.mean()), worst_call=float(np.max(worst)), per_step=t.tolist())


def parse_windows(text: str) -> list[int]:
  """--windows "5,20" -> [5, 20]: the step cuts of the window means.

  Raises:
    ValueError: an item that is not an integer, a cut below 1, or cuts not increasing.
  """
  try:
    cuts = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--windows {text!r}: expected a comma list of step numbers, e.g. "
                     "5,20") from None
  if any(c < 1 for c in cuts) or any(a >= b for a, b in zip(cuts, cuts[1:])):
    raise ValueError(f"--windows {text!r}: expected increasing step numbers >= 1, e.g. 5,20")
  return cuts


def _windows(cuts: list[int], steps: int) -> list[tuple[int, int]]:
  cuts = [0] + list(cuts) + [steps]
  return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--stage", default="stage_8k")
  p.add_argument("--preset", default="tiny")
  p.add_argument("--mesh", default=None,
                 help="training mesh (default fsdp=2,expert=4; with --virtual-mesh the stage's)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--caps", default="1.0,1.25,1.5,2.0")
  p.add_argument("--train-cap", type=float, default=1.25)
  p.add_argument("--virtual-mesh", action="append", default=[],
                 help="a layout to count for, e.g. fsdp=2,expert=4 (repeatable)")
  p.add_argument("--virtual-devices", type=int, default=8)
  p.add_argument("--set", dest="sets", action="append", default=[],
                 help="a StageConfig override, as experiments' --set KEY=VALUE")
  p.add_argument("--windows", default="5", help="step cuts of the window means, e.g. 5,20")
  p.add_argument("--deadline-s", type=float, default=None)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  # Every argument is checked here, before a tokenizer is trained or a step compiled.
  if args.steps < 1:
    p.error(f"--steps {args.steps}: expected a positive integer")
  if not (math.isfinite(args.train_cap) and args.train_cap > 0):
    p.error(f"--train-cap {args.train_cap}: expected a number > 0 (the receive buffer as a "
            "multiple of the tokens per block, e.g. 1.25)")
  if args.virtual_devices < 1:
    p.error(f"--virtual-devices {args.virtual_devices}: expected an integer >= 1")
  if args.deadline_s is not None and not args.deadline_s > 0:
    p.error(f"--deadline-s {args.deadline_s}: expected a number of seconds > 0")
  try:
    windows = parse_windows(args.windows)
  except ValueError as e:
    p.error(str(e))
  preset_stage = cli_args.stage_preset(p, args.stage, args.preset)
  try:
    base = apply_overrides(preset_stage, args.sets)
  except ValueError as e:
    p.error(str(e))
  try:
    caps = [float(c) for c in args.caps.split(",")]
  except ValueError:
    p.error(f"--caps {args.caps!r}: expected a comma list of numbers, e.g. 1.0,1.25,1.5")
  if not all(math.isfinite(c) and c > 0 for c in caps):
    p.error(f"--caps {args.caps!r}: each cap must be a number > 0 (a multiple of the tokens "
            "per block), e.g. 1.0,1.25,1.5")
  virtual = bool(args.virtual_mesh)
  try:
    layout = (shd.MeshLayout.parse(args.mesh) if args.mesh is not None
              else base.mesh if virtual else shd.MeshLayout.parse("fsdp=2,expert=4"))
  except ValueError as e:
    p.error(f"--mesh {args.mesh!r}: {e}")
  base = dataclasses.replace(base, mesh=layout, steps=max(args.steps, base.steps))
  try:
    mesh = shd.make_mesh(layout)
  except ValueError as e:
    p.error(f"--mesh {layout} does not fit the {jax.device_count()} device(s) here ({e}); on a "
            "CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8, or count a layout "
            "without its devices with --virtual-mesh")
  if virtual:
    try:
      layouts = {s: ep_virtual.mesh_shape(shd.MeshLayout.parse(s), args.virtual_devices)
                 for s in args.virtual_mesh}
    except ValueError as e:
      p.error(f"--virtual-mesh / --virtual-devices {args.virtual_devices}: {e}")
    check_virtual(base, mesh, layouts, args.virtual_devices)
  workdir = tempfile.mkdtemp(prefix="ep_drops_")
  tokenizer = data_lib.load_or_train_tokenizer(base.data, workdir,
                                               base.model_config().vocab_size)
  if virtual:
    return _main_virtual(args, base, mesh, tokenizer, caps, layouts, windows)
  overrides = dict(base.model_overrides, ragged_buffer_factor=args.train_cap,
                   ep_exchange="dense")
  stage = dataclasses.replace(base, model_overrides=tuple(sorted(overrides.items())))
  r = measure(stage, mesh, args.steps, tokenizer, caps)
  windows = _windows(windows, args.steps)
  rows = []
  for c in caps:
    row = summary(r[f"cap_{c}"], r[f"worst_layer_cap_{c}"], windows)
    rows.append(dict(cap=c, mesh=str(layout), preset=args.preset, stage=args.stage,
                     steps=args.steps, train_cap=args.train_cap, **row))
    print(f"cap {c:.2f} {layout}: drop rate {row['window_means']}; all {row['overall']:.4f}; "
          f"worst layer-step {row['worst_call']:.4f}", flush=True)
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


def _main_virtual(args, stage, mesh, tokenizer, caps, layouts, cuts) -> int:
  cfg = stage.model_config()
  head = dict(stage=args.stage, preset=args.preset, command=" ".join(sys.argv),
              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              device=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
              training_mesh=str(stage.mesh), seq_len=stage.seq_len,
              global_batch=stage.global_batch, micro_batches=stage.micro_batches,
              moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts,
              experts_per_token=cfg.experts_per_token, virtual_devices=args.virtual_devices,
              virtual_meshes={s: {a: v for a, v in sh.items() if v > 1}
                              for s, sh in layouts.items()}, caps=caps)

  def write(res):
    n = len(res["step_seconds"])
    windows = _windows(cuts, n)
    table = {name: {str(c): summary(r["rate"][str(c)], r["worst_call"][str(c)], windows)
                    for c in caps if r["rate"][str(c)]}
             for name, r in res["layouts"].items()}
    out = dict(head, steps_done=n, **{k: v for k, v in res.items() if k != "layouts"},
               table=table)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return out

  res = measure_virtual(stage, mesh, args.steps, tokenizer, caps, layouts,
                        deadline_s=args.deadline_s, on_step=write)
  out = write(res)
  for name, t in out["table"].items():
    for c, row in t.items():
      print(f"{name} cap {c}: {row['window_means']}; all {row['overall']:.5f}; worst layer "
            f"call {row['worst_call']:.4f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
