"""`gmm_lib.gmm_pair` (gate and up projections as one grouped matmul) against an independent
NumPy grouped matmul of each half, forward and gradients, and against two `gmm` calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.moe import gmm as gmm_lib


def _np_gmm(lhs, rhs, sizes):
  """out[i] = lhs[i] @ rhs[g(i)] for the rows of group g; rows past sum(sizes) are zero."""
  out = np.zeros((lhs.shape[0], rhs.shape[-1]), np.float64)
  start = 0
  for g, s in enumerate(sizes):
    out[start:start + s] = lhs[start:start + s].astype(np.float64) @ rhs[g].astype(np.float64)
    start += s
  return out


@pytest.mark.parametrize("backend", ["ragged_dot", "blocked"])
def test_gmm_pair_matches_numpy_and_two_calls(backend):
  rng = np.random.default_rng(7)
  sizes = (5, 0, 17, 3, 0, 9)  # 34 of 40 rows: the tail is padding
  m, k, na, nb = 40, 12, 7, 5
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  ra = rng.standard_normal((len(sizes), k, na)).astype(np.float32)
  rb = rng.standard_normal((len(sizes), k, nb)).astype(np.float32)
  da = rng.standard_normal((m, na)).astype(np.float32)
  db = rng.standard_normal((m, nb)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  pair = jax.jit(lambda l, a, b: gmm_lib.gmm_pair(l, a, b, gs, backend=backend))
  a, b = pair(lhs, ra, rb)
  np.testing.assert_allclose(a, _np_gmm(lhs, ra, sizes), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(b, _np_gmm(lhs, rb, sizes), rtol=1e-5, atol=1e-5)
  two = jax.jit(lambda l, a, b: (gmm_lib.gmm(l, a, gs, backend=backend),
                                 gmm_lib.gmm(l, b, gs, backend=backend)))(lhs, ra, rb)
  np.testing.assert_allclose(a, two[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(b, two[1], rtol=1e-6, atol=1e-6)

  def loss(l, x, y):
    a, b = gmm_lib.gmm_pair(l, x, y, gs, backend=backend)
    return jnp.sum(a * da) + jnp.sum(b * db)

  dl, dra, drb = jax.grad(loss, argnums=(0, 1, 2))(lhs, ra, rb)
  # from the definition: dlhs[i] = da[i] ra[g]^T + db[i] rb[g]^T; dr_g = lhs_g^T d_g
  dl_ref = np.zeros((m, k))
  dra_ref, drb_ref = np.zeros(ra.shape), np.zeros(rb.shape)
  start = 0
  for g, s in enumerate(sizes):
    rows = slice(start, start + s)
    dl_ref[rows] = da[rows].astype(np.float64) @ ra[g].T + db[rows].astype(np.float64) @ rb[g].T
    dra_ref[g] = lhs[rows].T.astype(np.float64) @ da[rows]
    drb_ref[g] = lhs[rows].T.astype(np.float64) @ db[rows]
    start += s
  for got, want in ((dl, dl_ref), (dra, dra_ref), (drb, drb_ref)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(dl)[sum(sizes):] == 0)  # padding rows get no gradient


def test_gmm_pair_rejects_mismatched_weights():
  lhs = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="must share"):
    gmm_lib.gmm_pair(lhs, jnp.ones((2, 8, 3)), jnp.ones((2, 6, 3)), jnp.array([2, 2]))
