"""Shared helpers of the MoE tests: one small config shape and jitted calls, so the tests of
every file reuse the same compiled programs (XLA:CPU compiles dominate the test time)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.moe import LatentMoE

D, E, K, LATENT = 32, 8, 2, 16


def seed() -> int:
  """A fresh random seed, printed (pytest shows it on failure) so a failure can be re-run."""
  s = int(np.random.randint(1 << 30))
  print(f"seed={s}")
  return s


def key():
  """A fresh random key (tests use fresh random inputs; the seed is printed)."""
  return jax.random.key(seed())


def cfg(**kw):
  """The small MoE config shared by the tests; route_scale != 1 so the scale is exercised."""
  base = dict(d_model=D, num_experts=E, experts_per_token=K, moe_latent_dim=LATENT,
              expert_hidden=24, num_shared_experts=1, shared_expert_hidden=20, dtype="float32",
              balancer_bins=128, gmm_backend="ragged_dot", route_scale=2.5)
  base.update(kw)
  return get_preset("tiny", **base)


def make(config, seed=None):
  """LatentMoE built eagerly from an "rbg" key: its init programs compile once per shape and
  are then shared by every config of the same shapes (threefry init costs ~2x more)."""
  s = globals()["seed"]() if seed is None else seed
  return LatentMoE(config, rngs=nnx.Rngs(jax.random.key(s, impl="rbg")))


@nnx.jit(static_argnames=("train",))
def _fwd(m, x, valid, train):
  return m(x, valid=valid, train=train)


def fwd(m, x, valid=None, train=False):
  """Jitted m(x, valid=valid, train=train); valid=None is passed as all-True (same program)."""
  if valid is None:
    valid = jnp.ones(x.shape[:2], bool)
  return _fwd(m, x, valid, train)


def rel(a, b):
  """Relative RMSE ||a - b|| / ||b|| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)
