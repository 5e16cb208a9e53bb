"""Expert-parallel capacity drops in the model on 8 fake CPU devices.

1. A train step of a 3-layer model (2 LatentMoE layers) with the receive cap
   (ModelConfig.ragged_buffer_factor) reports "moe/drop_rate_total" and per-layer
   "moe/dropped" equal to an independent count: the routing of every MoE layer is recorded
   (jax.debug.callback) and the rule of docs/architecture.md (ep_rule.expected_keep) is
   applied to it. Without the cap it reports 0. The capped step, device by device: the pairs
   each device sent and dropped equal those of the virtual grouping of
   benchmarks/ep_virtual.py (device i of the token axes holds rows [i n, (i+1) n) of the
   layer's logical [B*T] order) under the pair-by-pair rule (ep_rule.virtual_keep) and under
   ep_virtual.drop_counts (what `benchmarks/ep_drops.py --virtual-mesh` counts).
2. Causality with the cap on and a drop rate > 1/2 (so pairs before P are dropped): the
   logits at t < P are bit-for-bit the same when the tokens at t >= P change, for
   expert_shards="batch" and "context"; the first call's drops, device by device, are again
   those of the virtual grouping (with "context" too, where the activations of device
   (fsdp f, expert e) hold a quarter of the sequence of 4 rows: that grouping is checked to
   differ).

Run by tests/multidevice/test_ep_drops.py in a subprocess. Prints "OK <case> ..." per case;
exits 1 on failure.
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.ep_virtual import drop_counts
from ep_rule import expected_keep, virtual_keep
from routing_spy import install, install_device_stats
from sparse_lm import sharding as shd
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer
from sparse_lm.train.state import graphdef_of, make_init_fn
from sparse_lm.train.step import make_train_step
from train_check import CFG, B, T, batch  # 8 rows of 40 tokens

RECORD = install()
DEVICE_STATS = install_device_stats(shd.MESH_AXES)
FAILED = []


def report(name, ok, msg):
  print(("OK " if ok else "FAIL ") + f"{name} {msg}", flush=True)
  if not ok:
    FAILED.append(name)


def device_sums(sizes):
  """[blocks, 2] pairs (dropped, sent) per device, summed over the recorded calls, indexed by
  the device's linear index over the token axes (tensor replicas left out)."""
  axes = [a for a in ("data", "fsdp", "expert", "context") if sizes[a] > 1]
  dims = [sizes[a] for a in axes]
  out = np.zeros((math.prod(dims), 2), int)
  for coords, s in DEVICE_STATS:
    c = dict(zip(shd.MESH_AXES, coords))
    if c["tensor"] == 0:
      out[np.ravel_multi_index([c[a] for a in axes], dims)] += s
  return out


def virtual_sums(records, sizes, E, cap, order=None):
  """Per token block (dropped by virtual_keep, dropped by drop_counts, sent), summed over the
  layer calls; `order` first permutes each call's rows (another placement)."""
  blocks = math.prod(sizes[a] for a in ("data", "fsdp", "expert", "context"))
  ref = fast = sent = np.zeros(blocks, int)
  for ids, pos, margin in records:
    if order is not None:
      ids, pos, margin = ids[order], pos[order], margin[order]
    real = ids < E
    keep = virtual_keep(ids, pos, margin, sizes=sizes, num_experts=E, cap=cap)
    ref = ref + (real & ~keep).reshape(blocks, -1).sum(1)
    d, a = drop_counts(ids, pos, shape=sizes, num_experts=E, caps=[cap])
    fast, sent = fast + d[0], sent + a
  return ref, fast, sent


def virtual_case(name, mesh, records, E, cap, context=False):
  """The device-by-device check of the module docstring; with `context`, also that the
  placement of the activations (device (f, e): rows [4f, 4f+4) at positions [10e, 10e+10))
  gives other counts."""
  t0 = time.perf_counter()
  sizes = dict(mesh.shape)
  real = device_sums(sizes)
  ref, fast, sent = virtual_sums(records, sizes, E, cap)
  ok = (np.array_equal(real[:, 0], ref) and np.array_equal(ref, fast)
        and np.array_equal(real[:, 1], sent) and ref.sum() > 0)
  msg = f"per-device dropped real={real[:, 0].tolist()} virtual={ref.tolist()} sent={sent.tolist()}"
  if context:
    f_, e_ = sizes["fsdp"], sizes["expert"]
    rows, span = B // f_, T // e_
    order = np.array([b * T + t for f in range(f_) for e in range(e_)
                      for b in range(f * rows, (f + 1) * rows)
                      for t in range(e * span, (e + 1) * span)])
    alt, _, _ = virtual_sums(records, sizes, E, cap, order)
    ok = ok and not np.array_equal(alt, real[:, 0])
    msg += f" (activation placement would give {alt.tolist()})"
  report(f"virtual {name} cap={cap}", ok, msg + f" [{time.perf_counter() - t0:.2f} s]")


def train_case(layout, factor):
  cfg = dataclasses.replace(CFG, ragged_buffer_factor=factor, ep_exchange="dense")
  factory = lambda seed: Transformer(cfg, rngs=nnx.Rngs(seed))
  tx = optax.adamw(1e-3)
  init = make_init_fn(factory, tx, 0)
  step = make_train_step(graphdef_of(factory, 0), tx, lambda s: jnp.float32(1e-3), loss_fn)
  lay = shd.MeshLayout.parse(layout)
  mesh = shd.make_mesh(lay)
  data = batch()
  with shd.use_mesh(mesh, lay.rules):
    state_sh = shd.state_shardings(jax.eval_shape(init), mesh)
    bsh = {k: shd.batch_sharding(mesh) for k in data}
    state = jax.jit(init, out_shardings=state_sh)()
    RECORD.clear()
    DEVICE_STATS.clear()
    _, m = jax.jit(step, in_shardings=(state_sh, bsh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())))(
                       state, jax.device_put(data, bsh))
  jax.effects_barrier()
  ep = mesh.shape["expert"]
  blocks = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert", "context"))
  n, k, E = B * T // blocks, cfg.experts_per_token, cfg.num_experts
  dropped, assigned = [], []
  for ids, pos, margin in RECORD:
    real = ids < E
    if factor is None:
      keep = real
    else:
      keep = expected_keep(ids, pos, margin, num_blocks=blocks, ep=ep, num_experts=E,
                           cap=math.ceil(factor * n * k))
    dropped.append(int(real.sum() - keep.sum()))
    assigned.append(int(real.sum()))
  rate = sum(dropped) / sum(assigned)
  got = float(m["moe/drop_rate_total"])
  ok = (len(RECORD) == cfg.num_moe_layers and abs(got - rate) < 1e-6
        and sorted(np.asarray(m["moe/dropped"]).round().astype(int).tolist()) == sorted(dropped)
        and (rate > 0.05 if factor else got == 0.0))
  report(f"train {layout} cap={factor}", ok,
         f"drop_rate_total={got:.4f} independent={rate:.4f} per-layer={dropped} "
         f"recv_rows_max={np.asarray(m['moe/recv_rows_max']).tolist()} "
         f"buffer={np.asarray(m['moe/recv_buffer_rows']).tolist()}")
  if factor is not None:
    virtual_case(layout, mesh, list(RECORD), E, math.ceil(factor * n * k))


def causal_case(layout, factor, cut):
  cfg = dataclasses.replace(CFG, ragged_buffer_factor=factor, ep_exchange="dense")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  lay = shd.MeshLayout.parse(layout)
  mesh = shd.make_mesh(lay)
  data = batch()
  seed = 1234
  records = []
  other = np.asarray(data["tokens"]).copy()
  other[:, cut:] = np.random.default_rng(seed).integers(1, cfg.vocab_size, (B, T - cut))

  def fwd(params, tokens, seg):
    m = nnx.merge(graphdef, params)
    h, aux = m.forward_hidden(tokens, segment_ids=seg)
    return m.logits(h), jnp.sum(aux["dropped"]) / jnp.sum(aux["assigned"])

  with shd.use_mesh(mesh, lay.rules):
    f = jax.jit(fwd)
    outs = []
    for t in (data["tokens"], other):
      RECORD.clear()
      DEVICE_STATS.clear()
      outs.append(jax.device_get(f(params, jnp.asarray(t), data["segment_ids"])))
      jax.effects_barrier()
      if not records:
        records = list(RECORD)
        n = B * T // mesh.size  # tokens per device
        virtual_case(layout, mesh, records, cfg.num_experts,
                     math.ceil(factor * n * cfg.experts_per_token),
                     context=lay.expert_shards == "context")
  (a, rate_a), (b, rate_b) = outs
  same = bool(np.array_equal(a[:, :cut], b[:, :cut]))
  changed = not np.array_equal(a[:, cut:], b[:, cut:])
  ok = same and changed and min(float(rate_a), float(rate_b)) > 0.5
  report(f"causal {layout} cap={factor} P={cut}", ok,
         f"seed={seed} drop_rate={float(rate_a):.3f}/{float(rate_b):.3f} "
         f"prefix_bitwise_equal={same} max_prefix_diff="
         f"{float(np.max(np.abs(a[:, :cut] - b[:, :cut]))):.1e}")


def main():
  which = sys.argv[1] if len(sys.argv) > 1 else "all"
  if which in ("all", "train"):
    train_case("fsdp=2,expert=4", 0.75)
    train_case("fsdp=2,expert=4", None)
  if which in ("all", "causal"):
    causal_case("fsdp=2,expert=4", 0.4, T // 2)
    causal_case("fsdp=2,expert=4,expert_shards=context", 0.4, T // 2)
  if FAILED:
    print("FAILED:", FAILED)
    sys.exit(1)


if __name__ == "__main__":
  main()
