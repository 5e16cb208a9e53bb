"""Audit tests for the router, the capacity cap and SiTU-GLU (ARCHITECTURE.md §5, §6).

Expected values are written from the equations in NumPy (float64), never taken from the code
under test; inputs are fixed-seed random (deterministic, non-zero).

Mutations these tests kill (each survived tests/moe):
  router.route with k == E: alpha_i = min_j z_ij instead of min_j z_ij − 1/2 (the expert with
    the smallest z gets margin 0 and r_ij = b_j, so "b_j > r_ij iff selected" breaks for it);
  latent_moe.expert_capacity with floor instead of ceil (the cap is 7 instead of 8 for 7.5);
  situ_glu._situ's unclipped limit (beta1 = beta2 = None, cfg.ffn_activation="swiglu") as
    sigmoid(g) * u instead of silu(g) * u.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from sparse_lm.moe import router, situ_activation, situ_glu


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_route_with_every_expert_selected():
  """k == E: every expert is selected, so the cutoff must lie strictly below every z_ij and
  each (i, j) must satisfy the QB selection rule b_j > r_ij = alpha_i − s_ij (§6 step 3)."""
  rng = np.random.default_rng(31)
  n, e = 24, 6
  s = _np_sigmoid(rng.normal(size=(n, e)) * 2.0)
  b = rng.normal(size=e) * 0.3
  rt = router.route(jnp.asarray(s, jnp.float32), jnp.asarray(b, jnp.float32), e, 1.7)
  z = s + b[None, :]
  # Every expert, in decreasing order of the biased score z = s + b.
  np.testing.assert_array_equal(np.asarray(rt.expert_ids), np.argsort(-z, axis=1, kind="stable"))
  # Gates: the unbiased scores of the selection, normalised over the k selected, times scale.
  ids = np.asarray(rt.expert_ids)
  s_sel = np.take_along_axis(s, ids, axis=1)
  np.testing.assert_allclose(rt.gates, 1.7 * s_sel / s_sel.sum(1, keepdims=True), rtol=1e-6)
  # The documented cutoff with no (k+1)-th expert: min_j z_ij − 1/2.
  alpha = z.min(axis=1) - 0.5
  np.testing.assert_allclose(rt.cutoff, alpha, rtol=1e-6, atol=1e-6)
  margin = np.take_along_axis(z, ids, axis=1) - alpha[:, None]
  np.testing.assert_allclose(rt.margin, margin, rtol=1e-5, atol=1e-6)
  assert float(np.min(np.asarray(rt.margin))) >= 0.5 - 1e-5
  # Complementary slackness of §6: (i, j) selected iff b_j > r_ij; here every pair is selected.
  r = np.asarray(router.required_bias(jnp.asarray(s, jnp.float32), rt.cutoff), np.float64)
  np.testing.assert_allclose(r, alpha[:, None] - s, rtol=1e-5, atol=1e-6)
  assert np.all(b[None, :] > r)


def test_capacity_is_the_ceiling_of_the_mean_assignments():
  """cfg.capacity_factor: each expert keeps at most ceil(capacity_factor * N * k / E)
  assignments (latent_moe docstring). N k / E = 30 * 2 / 8 = 7.5 here, so the cap is 8 (a floor
  would give 7). The routing is recomputed in NumPy (sigmoid scores, top-k of s + b) and the
  number of dropped pairs is sum_j max(load_j − cap, 0)."""
  import moe_testlib as T  # tests/moe helpers: the shared small config and jitted forward
  m = T.make(T.cfg(capacity_factor=1.0), seed=1234)
  bias = np.array([0.6, 0.3, 0.0, -0.2, 0.1, -0.1, 0.0, 0.05], np.float32)
  m.balancer_bias[...] = jnp.asarray(bias)
  rng = np.random.default_rng(77)
  x = rng.normal(size=(2, 15, T.D)).astype(np.float32)
  _, aux = T.fwd(m, jnp.asarray(x))
  s = _np_sigmoid(x.reshape(-1, T.D).astype(np.float64) @ np.asarray(m.router[...], np.float64))
  z = s + bias[None, :].astype(np.float64)
  zs = -np.sort(-z, axis=1)
  assert np.min(zs[:, T.K - 1] - zs[:, T.K]) > 1e-5  # no near-tie: fp32 picks the same experts
  ids = np.argsort(-z, axis=1)[:, :T.K]
  load = np.bincount(ids.ravel(), minlength=T.E)
  np.testing.assert_array_equal(np.asarray(aux["load"]), load)
  cap = int(np.ceil(1.0 * 30 * T.K / T.E))
  assert cap == 8
  assert np.sum(load >= cap) > 0  # some expert is at or over the cap: a cap of 7 drops more
  expect = np.maximum(load - cap, 0).sum()
  assert float(aux["assigned"]) == 30 * T.K
  assert float(aux["dropped"]) == expect, (float(aux["dropped"]), expect, load)


def test_swiglu_limit_values_and_gradients():
  """beta1 = beta2 = None is the unclipped limit h = silu(g) * u (ARCHITECTURE §5 "equals SwiGLU
  as beta -> inf"; the Kimi-Linear experts): values and gradients against float64 NumPy, and the
  FFN y = (silu(x W_g) * (x W_u)) W_d."""
  rng = np.random.default_rng(3)
  g = (rng.normal(size=(16, 24)) * 3).astype(np.float32)
  u = (rng.normal(size=(16, 24)) * 3).astype(np.float32)
  ct = rng.normal(size=(16, 24)).astype(np.float32)
  gn, un, cn = (x.astype(np.float64) for x in (g, u, ct))
  sig = _np_sigmoid(gn)
  h_ref = gn * sig * un
  h, vjp = jax.vjp(lambda a, b: situ_activation(a, b, None, None), jnp.asarray(g), jnp.asarray(u))
  np.testing.assert_allclose(np.asarray(h), h_ref, rtol=1e-5, atol=1e-5)
  dg, du = vjp(jnp.asarray(ct))
  np.testing.assert_allclose(np.asarray(dg), cn * un * (sig + gn * sig * (1 - sig)), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(du), cn * gn * sig, rtol=1e-5, atol=1e-5)
  x = rng.normal(size=(5, 8)).astype(np.float32)
  wg, wu = (rng.normal(size=(8, 12)).astype(np.float32) for _ in range(2))
  wd = rng.normal(size=(12, 8)).astype(np.float32)
  y = situ_glu(jnp.asarray(x), jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd), None, None)
  xg, xu = x.astype(np.float64) @ wg, x.astype(np.float64) @ wu
  y_ref = (xg * _np_sigmoid(xg) * xu) @ wd
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())
