"""sparse_lm/moe/permute.py against plain NumPy / the obvious gather and its autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.moe import permute


def _rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed={seed}")
  return np.random.default_rng(seed)


@pytest.mark.parametrize("repeats", [1, 3])
def test_permute_rows_forward_and_gradient_equal_the_plain_gather(repeats):
  rng = _rng()
  n, d = 37, 5
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  perm = jnp.asarray(rng.permutation(n * repeats), jnp.int32)
  inv = permute.inverse_permutation(perm)
  np.testing.assert_array_equal(np.asarray(inv)[np.asarray(perm)], np.arange(n * repeats))
  w = jnp.asarray(rng.normal(size=(n * repeats, d)), jnp.float32)

  def loss_fast(x):
    return jnp.sum(jnp.sin(permute.permute_rows(x, perm, inv, repeats)) * w)

  def loss_plain(x):
    return jnp.sum(jnp.sin(x[perm // repeats]) * w)

  np.testing.assert_array_equal(permute.permute_rows(x, perm, inv, repeats),
                                np.asarray(x)[np.asarray(perm) // repeats])
  np.testing.assert_allclose(jax.grad(loss_fast)(x), jax.grad(loss_plain)(x), rtol=1e-6,
                             atol=1e-6)


def test_one_hot_counts_equal_bincount():
  rng = _rng()
  ids = rng.integers(0, 9, size=(50, 3))  # 8 = beyond num: not counted
  mask = rng.random((50, 3)) > 0.3
  got = permute.one_hot_counts(jnp.asarray(ids, jnp.int32), 8, jnp.asarray(mask))
  want = np.bincount(ids[mask], minlength=9)[:8]
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(permute.one_hot_counts(jnp.asarray(ids, jnp.int32), 8),
                                np.bincount(ids.reshape(-1), minlength=9)[:8])
