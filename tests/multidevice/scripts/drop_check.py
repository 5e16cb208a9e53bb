"""Expert-parallel capacity drops in the model on 8 fake CPU devices.

1. A train step of a 3-layer model (2 LatentMoE layers) with the receive cap
   (ModelConfig.ragged_buffer_factor) reports "moe/drop_rate_total" and per-layer
   "moe/dropped" equal to an independent count: the routing of every MoE layer is recorded
   (jax.debug.callback) and the rule of docs/architecture.md (ep_rule.expected_keep) is
   applied to it. Without the cap it reports 0.
2. Causality with the cap on and a drop rate > 1/2 (so pairs before P are dropped): the
   logits at t < P are bit-for-bit the same when the tokens at t >= P change, for
   expert_shards="batch" and "context".

Run by tests/multidevice/test_ep_drops.py in a subprocess. Prints "OK <case> ..." per case;
exits 1 on failure.
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_rule import expected_keep
from routing_spy import install
from sparse_lm import sharding as shd
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer
from sparse_lm.train.state import graphdef_of, make_init_fn
from sparse_lm.train.step import make_train_step
from train_check import CFG, B, T, batch  # 8 rows of 40 tokens

RECORD = install()
FAILED = []


def report(name, ok, msg):
  print(("OK " if ok else "FAIL ") + f"{name} {msg}", flush=True)
  if not ok:
    FAILED.append(name)


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


def causal_case(layout, factor, cut):
  cfg = dataclasses.replace(CFG, ragged_buffer_factor=factor, ep_exchange="dense")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  lay = shd.MeshLayout.parse(layout)
  mesh = shd.make_mesh(lay)
  data = batch()
  seed = 1234
  other = np.asarray(data["tokens"]).copy()
  other[:, cut:] = np.random.default_rng(seed).integers(1, cfg.vocab_size, (B, T - cut))

  def fwd(params, tokens, seg):
    m = nnx.merge(graphdef, params)
    h, aux = m.forward_hidden(tokens, segment_ids=seg)
    return m.logits(h), jnp.sum(aux["dropped"]) / jnp.sum(aux["assigned"])

  with shd.use_mesh(mesh, lay.rules):
    f = jax.jit(fwd)
    outs = [f(params, jnp.asarray(t), data["segment_ids"]) for t in (data["tokens"], other)]
  (a, rate_a), (b, rate_b) = [jax.device_get(o) for o in outs]
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
