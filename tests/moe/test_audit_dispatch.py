"""Audit tests of the expert-parallel receiver's local compute and the exchange choice, against
NumPy written from the definitions (ARCHITECTURE §5), on one device.

- `expert_ffn_local`: rows with local expert ids (id >= G marks an empty row) through the
  SiTU-GLU experts, results back in the rows' own order (kills unsorting with the forward
  permutation instead of its inverse, which only the slow multi-device script saw before).
- `resolve_impl("auto")`: all-gather exactly when the EP degree is below top-k, else ragged on
  GPU/TPU and dense on CPU (no test pinned the boundary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.moe import expert_parallel as ep


def _np_situ_ffn(x, wg, wu, wd, b1=4.0, b2=25.0):
  """SiTU-GLU(x) = W_d [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], g = x W_g, u = x W_u."""
  g = x @ wg
  u = x @ wu
  h = (b1 * np.tanh(g / b1) / (1.0 + np.exp(-g))) * (b2 * np.tanh(u / b2))
  return h @ wd


@pytest.mark.parametrize("backend", ["ragged_dot", "blocked"])
def test_expert_ffn_local_rows_come_back_in_their_own_order(backend):
  rng = np.random.default_rng(20261207)
  R, L, F, G = 29, 6, 10, 5
  x = rng.normal(size=(R, L))
  ids = rng.integers(0, G + 2, size=R)  # G and G + 1: empty rows
  ids[ids == 3] = 1  # expert 3 receives nothing
  ids[:3] = [4, G, 0]  # unsorted from the first rows on
  wg = rng.normal(size=(G, L, F)) * 0.5
  wu = rng.normal(size=(G, L, F)) * 0.5
  wd = rng.normal(size=(G, F, L)) * 0.5
  got = jax.jit(lambda x: ep.expert_ffn_local(
      x, jnp.asarray(ids, jnp.int32), jnp.asarray(wg, jnp.float32),
      jnp.asarray(wu, jnp.float32), jnp.asarray(wd, jnp.float32), beta1=4.0, beta2=25.0,
      gmm_backend=backend, platform="cpu"))(jnp.asarray(x, jnp.float32))
  want = np.zeros((R, L))
  for r in range(R):
    if ids[r] < G:
      want[r] = _np_situ_ffn(x[r], wg[ids[r]], wu[ids[r]], wd[ids[r]])
  assert np.abs(want).max() > 0.5
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got)[ids >= G], 0.0)


def test_expert_ffn_local_gradient_reaches_each_row_from_its_own_expert():
  """d/dx of sum(w * y): row r's gradient comes from expert ids[r] only (finite-difference
  free: the expert is linear in W_d, so d/dW_d[e] = sum over e's rows of h_r^T w_r)."""
  rng = np.random.default_rng(7)
  R, L, F, G = 17, 4, 6, 3
  x = rng.normal(size=(R, L))
  ids = rng.integers(0, G + 1, size=R)
  wg, wu = rng.normal(size=(G, L, F)) * 0.5, rng.normal(size=(G, L, F)) * 0.5
  wd = rng.normal(size=(G, F, L)) * 0.5
  w = rng.normal(size=(R, L))
  f = lambda wd_: jnp.sum(jnp.asarray(w, jnp.float32) * ep.expert_ffn_local(
      jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32), jnp.asarray(wg, jnp.float32),
      jnp.asarray(wu, jnp.float32), wd_, beta1=4.0, beta2=25.0, gmm_backend="ragged_dot",
      platform="cpu"))
  got = jax.jit(jax.grad(f))(jnp.asarray(wd, jnp.float32))
  want = np.zeros_like(wd)
  for r in range(R):
    if ids[r] < G:
      e = ids[r]
      g, u = x[r] @ wg[e], x[r] @ wu[e]
      h = (4.0 * np.tanh(g / 4.0) / (1.0 + np.exp(-g))) * (25.0 * np.tanh(u / 25.0))
      want[e] += np.outer(h, w[r])
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ep_size,top_k,platform,want", [
    (2, 4, "cpu", "allgather"), (3, 4, "gpu", "allgather"),
    (4, 4, "cpu", "dense"), (4, 4, "gpu", "ragged"), (4, 4, "tpu", "ragged"),
    (8, 2, "cpu", "dense"), (8, 2, "gpu", "ragged")])
def test_auto_exchange_is_allgather_only_below_top_k(ep_size, top_k, platform, want):
  assert ep.resolve_impl("auto", ep_size, top_k, platform) == want
  assert ep.resolve_impl("dense", ep_size, top_k, platform) == "dense"
  with pytest.raises(ValueError):
    ep.resolve_impl("ragged_dot", ep_size, top_k, platform)
