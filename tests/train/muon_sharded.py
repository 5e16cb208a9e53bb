"""Run as a script (8 CPU devices): two Muon steps on the tiny model's parameters, sharded over
an fsdp=2 x tensor=2 x expert=2 mesh (its last layer and embedding), equal the same steps on one device; the Muon momentum is
sharded like its parameter.

  python tests/train/muon_sharded.py
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from sparse_lm import sharding as shd  # noqa: E402
from sparse_lm.config import get_preset  # noqa: E402
from sparse_lm.model.transformer import Transformer  # noqa: E402
from sparse_lm.train.optimizer import OptimizerConfig, make_optimizer  # noqa: E402


def main():
  assert jax.device_count() == 8
  seed = 3
  print("seed", seed)
  _, params, _ = nnx.split(Transformer(get_preset("tiny"), rngs=nnx.Rngs(seed)), nnx.Param, ...)
  # The last layer (MLA heads, experts, router, norms, gates) and the embedding: every kind of
  # leaf of both groups, fewer Newton-Schulz programs to compile than the whole model.
  params = {"last": params["last"], "embed": params["embed"]}
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(leaves))
  grads = [jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) * 1e-2
                                        for k, x in zip(keys[i::2], leaves)]) for i in range(2)]
  tx = make_optimizer(OptimizerConfig(name="muon", peak_lr=1e-2, warmup_steps=0,
                                      decay_fraction=0.0), total_steps=10)

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def two_steps(fn, p, s):
    for g in grads:
      p, s = fn(p, s, g)
    return p, s

  one = jax.devices()[0]
  put1 = lambda t: jax.device_put(t, one)
  p1, s1 = two_steps(jax.jit(step), put1(params), put1(tx.init(params)))

  mesh = shd.make_mesh(shd.MeshLayout(fsdp=2, tensor=2, expert=2))
  p_sh = shd.state_shardings(params, mesh)
  s_sh = shd.state_shardings(jax.eval_shape(tx.init, params), mesh)
  g_sh = p_sh
  fn8 = jax.jit(step, in_shardings=(p_sh, s_sh, g_sh), out_shardings=(p_sh, s_sh))
  grads[:] = [jax.device_put(g, g_sh) for g in grads]
  p8, s8 = two_steps(fn8, jax.device_put(params, p_sh),
                     jax.jit(tx.init, out_shardings=s_sh)(jax.device_put(params, p_sh)))

  w = p8["last"]["mixer"]["w_uq"][...]
  assert len(w.sharding.device_set) > 1, w.sharding
  mu = s8[1].inner_states["muon"].inner_state[0].mu["last"]["mixer"]["w_uq"][...]
  assert mu.sharding.is_equivalent_to(w.sharding, w.ndim), (mu.sharding, w.sharding)
  worst = 0.0
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    worst = max(worst, float(np.max(np.abs(a - b))))
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  print(f"max |8 devices - 1 device| = {worst:.3g} (largest parameter change {moved:.3g})")
  assert moved > 1e-3
  print("OK")


if __name__ == "__main__":
  main()
