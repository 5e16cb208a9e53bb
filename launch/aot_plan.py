"""Ahead-of-time memory plan: compile the real train step for a TPU topology, no TPU needed.

    JAX_PLATFORMS=cpu python -m launch.aot_plan --preset full --stage stage_8k \
        --topology v5p:8x16x16 [--mesh fsdp=2,expert=128,context=8] [--micro-batches 16] \
        [--remat full] [--ep-capacity-factor 1.25]   # defaults: the stage's own settings

It builds the abstract train state (`jax.eval_shape` of the model and its AdamW state, the same
`make_init_fn` the training loop uses) with the shardings of `sparse_lm.sharding`, lowers the
training loop's own train step (`sparse_lm.train.step.make_train_step`: micro-batch scan,
forward, backward, clipping, AdamW, balancer update) with those shardings and donated state,
and compiles it with the real TPU compiler (libtpu) for the devices of
`jax.experimental.topologies.get_topology_desc`. It prints the per-chip memory the compiler
reports (`compiled.memory_analysis()`: arguments, outputs, temporaries, generated code, and
their total with donated buffers counted once) against the chip's HBM.

Exit status: 0 if the step fits in HBM (total <= HBM), 2 if not, 1 on errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from typing import Any

HBM_BYTES = {  # per chip (a tpu7x chip is two JAX devices of 96 GB each)
    "v5p": 95 * 1000**3,
    "v5e": 16 * 1000**3,
    "v6e": 32 * 1000**3,
    "v4": 32 * 1000**3,
    "tpu7x": 192 * 1000**3,
}

GB = 1000**3


def chip_of(topology: str) -> str:
  return topology.split(":")[0].split("-")[0]


def _stage_config(stage: str, preset: str):
  """The experiment's StageConfig for (stage, preset), or None if experiments/ lacks it."""
  try:
    mod = importlib.import_module(f"experiments.{stage}")
  except ModuleNotFoundError:
    return None
  return getattr(mod, "STAGES", {}).get(preset)


def _loss_fn():
  """The model's training loss `loss_fn(model, batch, *, train, z_loss_coef) -> (loss, m)`."""
  for mod_name in ("sparse_lm.model.loss", "sparse_lm.train.loss"):
    try:
      mod = importlib.import_module(mod_name)
    except ModuleNotFoundError:
      continue
    if hasattr(mod, "loss_fn"):
      return mod.loss_fn
  return _fallback_loss_fn


def _fallback_loss_fn(model, batch, *, train: bool, z_loss_coef: float = 0.0):
  """Chunked next-token cross-entropy (used only until the model ships its own loss_fn):
  the [chunk, vocab] logits are recomputed in the backward pass, never stored for all T."""
  import jax
  import jax.numpy as jnp

  tokens, seg = batch["tokens"], batch["segment_ids"]
  h, _ = model.forward_hidden(tokens, segment_ids=seg, train=train)
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  same = jnp.concatenate([seg[:, 1:] == seg[:, :-1], jnp.zeros_like(seg[:, :1], bool)], 1)
  mask = (batch["loss_mask"] != 0) & same & (seg != 0)
  B, T, D = h.shape
  C = min(model.cfg.loss_chunk_size, T)
  n = -(-T // C)
  pad = n * C - T
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, C, D).swapaxes(0, 1)
  targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, C).swapaxes(0, 1)
  mask = jnp.pad(mask, ((0, 0), (0, pad))).reshape(B, n, C).swapaxes(0, 1)

  @jax.checkpoint
  def chunk(hc, tc, mc):
    logits = model.logits(hc)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
    m = mc.astype(jnp.float32)
    return jnp.sum((lse - tgt) * m) + z_loss_coef * jnp.sum(lse**2 * m), jnp.sum(m)

  def body(carry, xs):
    l, c = chunk(*xs)
    return (carry[0] + l, carry[1] + c), None

  (total, count), _ = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0)), (h, targets, mask))
  loss = total / jnp.maximum(count, 1.0)
  return loss, {"tokens": count}


def make_plan_inputs(preset: str, stage: str | None, *, seq_len: int | None,
                     global_batch: int | None, micro_batches: int | None,
                     remat: str | None, overrides: dict[str, Any]):
  """(model_cfg, seq_len, global_batch, micro_batches, optimizer cfg, z_loss_coef)."""
  from sparse_lm.config import get_preset
  from sparse_lm.train.optimizer import OptimizerConfig

  sc = _stage_config(stage, preset) if stage else None
  mo = dict(sc.model_overrides) if sc is not None else {}
  mo.update(overrides)
  mo.setdefault("scan_layers", True)
  if remat is not None:
    mo["remat_policy"] = remat
  cfg = get_preset(preset, **mo)
  T = seq_len or (sc.seq_len if sc is not None else 8192)
  if global_batch is None:
    global_batch = sc.global_batch if sc is not None else 1
  mb = micro_batches or (sc.micro_batches if sc is not None else 1)
  optim = sc.optim if sc is not None else OptimizerConfig()
  z = sc.z_loss_coef if sc is not None else 1e-4
  return cfg, T, global_batch, mb, optim, z


def topology_devices(topology: str, num_slices: int = 1):
  """Compile-only TPU devices of `topology` (e.g. "v5p:16x16x16"), optionally multislice."""
  from jax.experimental import topologies
  kw = {} if num_slices == 1 else {"num_slices": num_slices}
  return topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw).devices


def compile_train_step(cfg, *, devices, layout, seq_len: int, global_batch: int,
                       micro_batches: int, optim=None, z_loss_coef: float = 1e-4,
                       balancer_update: bool = True):
  """Lower and compile the train step; returns (compiled, info dict).

  Raises:
    ValueError: the layout does not divide the model / batch (from validate_layout).
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from sparse_lm import sharding as shd
  from sparse_lm.model.transformer import Transformer
  from sparse_lm.train.optimizer import OptimizerConfig, make_optimizer, wsd_schedule
  from sparse_lm.train.state import graphdef_of, make_init_fn
  from sparse_lm.train.step import make_train_step
  from flax import nnx

  optim = optim or OptimizerConfig()
  mesh = shd.make_mesh(layout, devices)
  shd.validate_layout(cfg, layout, mesh, global_batch=global_batch, seq_len=seq_len,
                      num_microbatches=micro_batches)
  tx = make_optimizer(optim, 1000)
  schedule = wsd_schedule(optim, 1000)
  factory = lambda seed: Transformer(cfg, rngs=nnx.Rngs(seed))
  init = make_init_fn(factory, tx, 0)
  balance_fn = None
  if balancer_update and cfg.balancer != "none":
    from sparse_lm.moe import balancing
    balance_fn = balancing.update_balancers
  info: dict[str, Any] = {}
  t0 = time.time()
  with shd.use_mesh(mesh, layout.rules):
    graphdef = graphdef_of(factory, 0)
    abstract = jax.eval_shape(init)
    state_sh = shd.state_shardings(abstract, mesh)
    state_in = shd.with_shardings(abstract, state_sh)
    keys = ("tokens", "segment_ids", "positions", "loss_mask")
    bsh = shd.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((global_batch, seq_len), jax.numpy.int32, sharding=bsh)
             for k in keys}
    batch_sh = {k: bsh for k in keys}
    step = make_train_step(graphdef, tx, schedule, _loss_fn(), micro_batches=micro_batches,
                           z_loss_coef=z_loss_coef, balance_fn=balance_fn)
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh),
                     out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
    lowered = jitted.lower(state_in, batch)
    info["lower_s"] = time.time() - t0
    t1 = time.time()
    compiled = lowered.compile()
    info["compile_s"] = time.time() - t1
  leaves = jax.tree.leaves(abstract)
  info["state_bytes_global"] = int(sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves))
  params = jax.tree.leaves(abstract.params)
  info["num_params"] = int(sum(math.prod(x.shape) for x in params))
  info["mesh"] = dict(mesh.shape)
  info["expert_shards"] = layout.expert_shards
  return compiled, info


def memory_report(compiled, hbm: int) -> dict[str, float]:
  """Per-chip bytes from the compiler's memory analysis."""
  ma = compiled.memory_analysis()
  get = lambda name: int(getattr(ma, name, 0) or 0)
  arg, out, tmp = (get("argument_size_in_bytes"), get("output_size_in_bytes"),
                   get("temp_size_in_bytes"))
  alias, code = get("alias_size_in_bytes"), get("generated_code_size_in_bytes")
  total = arg + out - alias + tmp + code
  return dict(arguments=arg, outputs=out, aliased=alias, temporaries=tmp, code=code,
              total=total, hbm=hbm, fits=total <= hbm)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="full")
  p.add_argument("--stage", default="stage_8k", help="experiments/<stage>.py supplies "
                 "seq_len, batch, micro-batches, optimizer")
  p.add_argument("--topology", default="v5p:8x16x16", help="e.g. v5p:16x16x16, v6e:16x16, "
                 "tpu7x:8x8x8")
  p.add_argument("--num-slices", type=int, default=1)
  p.add_argument("--mesh", default=None, help="e.g. fsdp=-1,expert=16,context=2 (default: "
                 "the stage's layout; its expert_shards is kept unless given here)")
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
  p.add_argument("--micro-batches", type=int, default=None)
  p.add_argument("--remat", default=None, help="remat policy (ModelConfig.remat_policy)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="ModelConfig override, e.g. --set num_layers=9")
  p.add_argument("--no-balancer-update", action="store_true")
  p.add_argument("--ep-impl", default=None, help="expert-parallel exchange: auto (ragged "
                 "on TPU when expert >= top-k), ragged, dense, allgather (default: the "
                 "stage's ModelConfig.ep_exchange)")
  p.add_argument("--ep-capacity-factor", default=None,
                 help="per-rank receive cap of the expert all-to-all, in units of n*k rows; "
                 "'none' = dropless, worst-case buffers (default: the stage's "
                 "ModelConfig.ragged_buffer_factor)")
  p.add_argument("--json", default=None, help="also write the report here")
  args = p.parse_args(argv)

  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # compile-only use of libtpu: do not take (or wait for) the single-process TPU lockfile
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from sparse_lm import sharding as shd
  from sparse_lm.config import ModelConfig

  fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
  overrides = {}
  for item in args.set:
    key, _, val = item.partition("=")
    if key not in fields:
      p.error(f"--set {key}: unknown ModelConfig field")
    cur = getattr(ModelConfig(), key)
    overrides[key] = (None if val.lower() == "none" else type(cur)(val) if cur is not None
                      and not isinstance(cur, bool) else val.lower() in ("1", "true"))
  if args.ep_impl:  # the expert-parallel exchange and receive cap are ModelConfig fields
    overrides["ep_exchange"] = args.ep_impl
  if args.ep_capacity_factor is not None:
    try:
      overrides["ragged_buffer_factor"] = (None if args.ep_capacity_factor.lower() == "none"
                                           else float(args.ep_capacity_factor))
    except ValueError:
      p.error(f"--ep-capacity-factor={args.ep_capacity_factor!r}: a number or 'none'")
  cfg, T, gb, mb, optim, z = make_plan_inputs(
      args.preset, args.stage, seq_len=args.seq_len, global_batch=args.global_batch,
      micro_batches=args.micro_batches, remat=args.remat, overrides=overrides)
  sc = _stage_config(args.stage, args.preset) if args.stage else None
  layout = sc.mesh if sc is not None else shd.MeshLayout()
  if args.mesh is not None:  # the stage's expert_shards unless --mesh sets it
    given = shd.MeshLayout.parse(args.mesh)
    if "expert_shards" not in args.mesh:
      given = dataclasses.replace(given, expert_shards=layout.expert_shards)
    layout = given
  ep_impl, ep_cap = cfg.ep_exchange, cfg.ragged_buffer_factor
  chip = chip_of(args.topology)
  hbm = HBM_BYTES.get(chip)
  if hbm is None:
    p.error(f"unknown chip {chip!r}; known: {sorted(HBM_BYTES)}")
  devices = topology_devices(args.topology, args.num_slices)
  # memory_analysis() is per JAX device; a tpu7x chip is two devices (one per TensorCore
  # die), each with half of the chip's HBM.
  per_chip = max(1, len({getattr(d, "core_on_chip", 0) for d in devices}))
  hbm //= per_chip
  print(f"[aot_plan] preset={args.preset} stage={args.stage} topology={args.topology} "
        f"x{args.num_slices} ({len(devices)} devices, {per_chip} per chip) mesh={layout} "
        f"seq_len={T:,} "
        f"global_batch={gb} micro_batches={mb} remat={cfg.remat_policy} "
        f"scan_layers={cfg.scan_layers}", flush=True)
  print(f"[aot_plan] kda_backend={cfg.kda_backend} gmm_backend={cfg.gmm_backend} "
        f"attention_backend={cfg.attention_backend} ep_impl={ep_impl} "
        f"ep_capacity_factor={ep_cap}", flush=True)
  try:
    compiled, info = compile_train_step(cfg, devices=devices, layout=layout, seq_len=T,
                                        global_batch=gb, micro_batches=mb, optim=optim,
                                        z_loss_coef=z,
                                        balancer_update=not args.no_balancer_update)
  except ValueError as e:
    print(f"[aot_plan] failed: {e}", file=sys.stderr)
    return 1
  rep = memory_report(compiled, hbm)
  print(f"[aot_plan] mesh {info['mesh']}; {info['num_params'] / 1e9:.2f}B params; train state "
        f"{info['state_bytes_global'] / GB:.1f} GB global = "
        f"{info['state_bytes_global'] / len(devices) / GB:.2f} GB/device if evenly sharded; "
        f"lower {info['lower_s']:.1f}s, compile {info['compile_s']:.1f}s")
  print(f"[aot_plan] per device: arguments {rep['arguments'] / GB:.2f} GB, outputs "
        f"{rep['outputs'] / GB:.2f} GB (aliased {rep['aliased'] / GB:.2f}), temporaries "
        f"{rep['temporaries'] / GB:.2f} GB, code {rep['code'] / GB:.3f} GB; total "
        f"{rep['total'] / GB:.2f} GB of {hbm / GB:.0f} GB HBM per device ({chip}) -> "
        f"{'FITS' if rep['fits'] else 'DOES NOT FIT'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), layout=str(layout), seq_len=T, global_batch=gb,
                     micro_batches=mb, remat=cfg.remat_policy, kda_backend=cfg.kda_backend,
                     ep_impl=ep_impl, ep_capacity_factor=ep_cap,
                     gmm_backend=cfg.gmm_backend, attention_backend=cfg.attention_backend,
                     **info, **rep), f, indent=1)
  return 0 if rep["fits"] else 2


if __name__ == "__main__":
  sys.exit(main())
