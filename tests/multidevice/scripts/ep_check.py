"""Expert parallel vs the single-device dense reference on 8 fake CPU devices.

Run by tests/multidevice/test_expert_parallel.py in a subprocess (XLA_FLAGS set before jax).
Prints one line per case: "OK <case> fwd=<rel> grad=<rel> drop=<rate>"; exits 1 on failure.
"""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparse_lm import sharding as shd
from sparse_lm.moe import expert_parallel as ep
from ep_rule import expected_keep  # the spec rule, written independently of the code


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_inputs(key, N, L, F, E, k, *, one_expert=None, sentinel=False):
  ks = jax.random.split(key, 6)
  z = jax.random.normal(ks[0], (N, L), jnp.float32)
  scores = jax.random.uniform(ks[1], (N, E))
  if one_expert is not None:
    scores = scores.at[:, one_expert].set(2.0)
  gates, ids = jax.lax.top_k(scores, k)
  gates = gates / jnp.sum(gates, -1, keepdims=True)
  if sentinel:  # padding tokens / capacity-dropped assignments carry the id E
    ids = jnp.where(jax.random.uniform(ks[5], ids.shape) < 0.25, E, ids)
  params = dict(w_gate=0.3 * jax.random.normal(ks[2], (E, L, F)),
                w_up=0.3 * jax.random.normal(ks[3], (E, L, F)),
                w_down=0.3 * jax.random.normal(ks[4], (E, F, L)))
  return z, ids.astype(jnp.int32), gates, params


def loss_fn(fn):
  def f(z, gates, params):
    u = fn(z, gates, params)
    w = jnp.sin(jnp.arange(u.size, dtype=jnp.float32).reshape(u.shape))
    return jnp.sum(u * w), u
  return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)


FAILED = []


def check(name, layout, impl, *, N=64, L=8, F=16, E=16, k=2, one_expert=None, cap=None,
          tol=1e-5, sentinel=False, T=16):
  mesh = shd.make_mesh(shd.MeshLayout.parse(layout))
  seed = sum(map(ord, name))
  z, ids, gates, params = make_inputs(jax.random.key(seed), N, L, F, E, k,
                                      one_expert=one_expert, sentinel=sentinel)
  # rows of T tokens; the margins (the cap's priority within a position) are not the gates
  positions = jnp.arange(N, dtype=jnp.int32) % T
  margin = jax.random.uniform(jax.random.key(seed + 1), ids.shape)
  ep_size = mesh.shape["expert"]
  blocks = N // (mesh.shape["data"] * mesh.shape["fsdp"] * ep_size * mesh.shape["context"])
  ref_gates = gates
  if cap is not None:
    keep = expected_keep(ids, positions, margin, num_blocks=N // blocks, ep=ep_size,
                         num_experts=E, cap=cap)
    ref_gates = jnp.where(keep, gates, 0.0)
    real = np.asarray(ids) < E
    expect_drop = 1 - keep.sum() / real.sum()
    expect_counts = (int(real.sum() - keep.sum()), int(real.sum()))
  ref = loss_fn(lambda z, g, p: ep.reference_dispatch_and_compute(
      z, ids, g * (ref_gates > 0), p))
  out = {}

  def par(z, g, p):
    u, m = ep.ep_dispatch_and_compute(z, ids, g, p, mesh=mesh, impl=impl, recv_cap=cap,
                                      positions=positions, num_positions=T, margin=margin)
    out["metrics"] = m
    return u

  (l0, u0), g0 = jax.jit(ref)(z, gates, params)
  step = jax.jit(lambda z, g, p: (loss_fn(par)(z, g, p), out["metrics"]))
  ((l1, u1), g1), m = step(z, gates, params)
  drop = float(m["drop_rate"])
  errs = [rel(u1, u0), rel(l1, l0)] + [rel(a, b) for a, b in zip(jax.tree.leaves(g1),
                                                                 jax.tree.leaves(g0))]
  ok = max(errs) < tol
  if cap is None:
    ok = ok and drop == 0.0
  else:
    # the counts themselves, not only their ratio (a `tensor` replica must not count twice)
    ok = (ok and drop > 0 and abs(drop - expect_drop) < 1e-6
          and (int(m["dropped"]), int(m["assigned"])) == expect_counts
          and float(m["recv_rows_max"]) > cap == float(m["recv_buffer_rows"]))
  print(("OK " if ok else "FAIL ") + f"{name} impl={impl} seed={seed} "
        f"errs={[f'{e:.1e}' for e in errs]} drop={drop:.3f} dropped/assigned="
        f"{int(m['dropped'])}/{int(m['assigned'])}", flush=True)
  if not ok:
    FAILED.append(name)


def main():
  which = sys.argv[1] if len(sys.argv) > 1 else "all"
  cases = [
      ("ep2_dense", "expert=2,fsdp=4", "dense", {}),
      ("ep4_dense_tensor2_cap", "expert=4,tensor=2", "dense", dict(cap=24)),
      ("ep8_dense_sentinel", "expert=8", "dense", dict(sentinel=True)),
      ("ep8_one_expert", "expert=8", "dense", dict(one_expert=5)),
      ("ep4_allgather_k8", "expert=4,fsdp=2", "allgather", dict(k=8, sentinel=True)),
      ("ep2_allgather_ctx", "expert=2,context=2,data=2", "allgather", dict(k=4)),
      ("ep8_cap_one_expert", "expert=8", "dense", dict(one_expert=3, cap=12)),
      ("ep4_allgather_cap", "expert=4,fsdp=2", "allgather", dict(one_expert=0, cap=12, k=4)),
      # two sequences of 64 tokens, each over the 4 ranks of a group (as with
      # expert_shards=context): the position order runs across ranks
      ("ep4_cap_long_rows", "expert=4,fsdp=2", "dense", dict(N=128, T=64, cap=28, E=8)),
  ]
  # Two real devices (run with `2dev`; e.g. two GPUs, NCCL): EP 2 with every exchange,
  # including the ragged all-to-all that XLA:CPU lacks.
  two_device = [
      ("ep2_dense_2dev", "expert=2", "dense", {}),
      ("ep2_ragged_2dev", "expert=2", "ragged", dict(sentinel=True)),
      ("ep2_allgather_k4_2dev", "expert=2", "allgather", dict(k=4)),
      ("ep2_one_expert_2dev", "expert=2", "ragged", dict(one_expert=5)),
      ("ep2_cap_one_expert_2dev", "expert=2", "dense", dict(one_expert=3, cap=40)),
  ]
  if which == "2dev":
    cases, which = two_device, "all"
    if jax.default_backend() == "cpu":  # XLA:CPU has no ragged_all_to_all
      cases = [c for c in cases if c[2] != "ragged"]
  for name, layout, impl, kw in cases:
    if which == "all" or which in name:
      check(name, layout, impl, **kw)
  if FAILED:
    print("FAILED:", FAILED)
    sys.exit(1)


if __name__ == "__main__":
  main()
