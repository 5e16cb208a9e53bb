"""`gmm_lib.blocked_gmm` against an independent NumPy grouped matmul (forward and gradients)."""

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


@pytest.mark.parametrize("sizes,block", [((5, 0, 17, 3, 0, 9), None), ((0, 0, 40), 8),
                                         ((1, 2, 3, 4, 5, 6), 4)])
def test_blocked_gmm_matches_numpy(sizes, block):
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print("seed", seed)
  rng = np.random.default_rng(seed)
  m = 48  # sum(sizes) <= m: trailing rows are padding
  lhs = rng.standard_normal((m, 12)).astype(np.float32)
  rhs = rng.standard_normal((len(sizes), 12, 7)).astype(np.float32)
  dout = rng.standard_normal((m, 7)).astype(np.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  out = jax.jit(lambda l, r: gmm_lib.blocked_gmm(l, r, gs, block))(lhs, rhs)
  np.testing.assert_allclose(out, _np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  dl, dr = jax.grad(lambda l, r: jnp.sum(gmm_lib.blocked_gmm(l, r, gs, block) * dout),
                    argnums=(0, 1))(lhs, rhs)
  # d/dlhs[i] = dout[i] @ rhs[g]^T; d/drhs[g] = lhs_g^T dout_g (NumPy, from the definition)
  dl_ref = np.zeros_like(lhs, np.float64)
  dr_ref = np.zeros_like(rhs, np.float64)
  start = 0
  for g, s in enumerate(sizes):
    dl_ref[start:start + s] = dout[start:start + s] @ rhs[g].T
    dr_ref[g] = lhs[start:start + s].T.astype(np.float64) @ dout[start:start + s]
    start += s
  np.testing.assert_allclose(dl, dl_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dr, dr_ref, rtol=1e-5, atol=1e-5)
  assert gmm_lib.gmm(lhs, rhs, gs, backend="blocked").shape == (m, 7)
