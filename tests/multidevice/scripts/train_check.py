"""Sharded loss / gradients / one train step of a small model vs one device (fp32).

Usage: train_check.py LAYOUT [LAYOUT ...]   e.g. "fsdp=4,tensor=2" "fsdp=2,expert=2,context=2"
Run by tests/multidevice/test_sharded_train.py in a subprocess with 8 fake CPU devices.
Prints "OK <layout> ..." per layout; exits 1 on failure.
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import sharding as shd
from sparse_lm.config import get_preset
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer
from sparse_lm.train.state import graphdef_of, make_init_fn
from sparse_lm.train.step import make_train_step

# A 5-layer model (KDA, KDA, KDA, MLA, MLA) with 8 experts top-2: every code path of the
# full model (dense layer 0, LatentMoE, both mixers, AttnRes blocks) at CPU-test size.
CFG = get_preset("tiny", num_layers=5, attnres_block_layers=4, d_model=32, vocab_size=128,
                 kda_num_heads=2, kda_head_dim=16, kda_value_dim=16, mla_num_heads=2,
                 q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, dense_hidden=64, moe_latent_dim=16, expert_hidden=32,
                 shared_expert_hidden=32, balancer_bins=64, loss_chunk_size=64,
                 attention_chunk_size=16, remat_policy="none", scan_layers=True)
B, T = 4, 40  # T over context 2 = 20 tokens per shard: not a multiple of the KDA chunk (16)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[0, 13:] = 2          # a document crossing the context-shard boundary at 20
  seg[1, 20:] = 2          # one starting exactly on it
  seg[2, 30:] = 0          # padding
  seg[3, 5:] = 2
  seg[3, 26:] = 3
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg),
          "positions": jnp.asarray(np.tile(np.arange(T, dtype=np.int32), (B, 1))),
          "loss_mask": jnp.asarray((seg != 0).astype(np.int32))}


def main():
  layouts = sys.argv[1:] or ["fsdp=4,tensor=2"]
  factory = lambda seed: Transformer(CFG, rngs=nnx.Rngs(seed))
  # SGD with learning rate 1 and no clipping: new params = params - grads, so one train step
  # checks the loss, the gradients (old - new) and the update together, with one compile.
  tx = optax.sgd(1.0)
  sched = lambda step: jnp.float32(1.0)
  init = make_init_fn(factory, tx, 0)
  graphdef = graphdef_of(factory, 0)
  data = batch()
  step = make_train_step(graphdef, tx, sched, loss_fn, micro_batches=1)
  state0 = jax.jit(init)()
  s1_ref, m_ref = jax.jit(step)(state0, data)
  grads = lambda s1: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(
      b, np.float64), jax.tree.leaves(state0.params), jax.tree.leaves(s1.params))
  g0 = grads(s1_ref)
  names = [jax.tree_util.keystr(k) for k, _ in
           jax.tree_util.tree_flatten_with_path(state0.params)[0]]
  gnorm = float(np.sqrt(sum(np.sum(g ** 2) for g in g0)))
  failed = []
  for layout in layouts:
    lay = shd.MeshLayout.parse(layout)
    mesh = shd.make_mesh(lay)
    shd.validate_layout(CFG, lay, mesh, global_batch=B, seq_len=T)
    with shd.use_mesh(mesh, lay.rules):
      abstract = jax.eval_shape(init)
      state_sh = shd.state_shardings(abstract, mesh)
      bsh = {k: shd.batch_sharding(mesh) for k in data}
      state = jax.device_put(state0, state_sh)
      b = jax.device_put(data, bsh)
      s1, m = jax.jit(step, in_shardings=(state_sh, bsh),
                      out_shardings=(state_sh, NamedSharding(mesh, P())))(state, b)
    sharded = sum(1 for s in jax.tree.leaves(state_sh) if any(x is not None for x in s.spec))
    g1 = grads(jax.device_get(s1))
    # per-leaf relative error, floored at 1e-4 of the global gradient norm: some gradients are
    # exactly zero in exact arithmetic (the first AttnRes query sees a single source) and are
    # rounding noise (~1e-10) in both runs.
    per = sorted(((np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-4 * gnorm), n)
                  for a, b, n in zip(g1, g0, names)), reverse=True)
    errs = [rel(m["loss"], m_ref["loss"]), rel(m["grad_norm"], m_ref["grad_norm"]), per[0][0]]
    ok = max(errs) < 1e-4 and sharded > 0 and bool(np.isfinite(float(m["loss"])))
    print(("OK " if ok else "FAIL ") + f"{layout} loss={float(m['loss']):.5f} "
          f"sharded_leaves={sharded} errs(loss, grad norm, worst grad leaf {per[0][1]})="
          f"{[f'{e:.1e}' for e in errs]}", flush=True)
    if not ok:
      failed.append(layout)
  if failed:
    print("FAILED:", failed)
    sys.exit(1)


if __name__ == "__main__":
  main()
