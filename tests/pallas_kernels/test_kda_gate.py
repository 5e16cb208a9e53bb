"""KDA gate (ARCHITECTURE.md §2.3): values, ranges, analytic backward vs autodiff, errors.
Source: Kimi Linear (arXiv 2510.26692) §3; the lower bound is the seed's innovation 1."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kda_testing as kt
from pallas_kernels.kda import kda_gate
from pallas_kernels.kda.gate import kda_gate_autodiff

H, K = 3, 8


def _params(seed, z_scale=3.0, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  z = jnp.asarray(r.normal(size=(2, 7, H, K)) * z_scale, dtype)
  A_log = jnp.asarray(np.log(r.uniform(1, 16, size=H)), jnp.float32)
  dt = np.clip(np.exp(r.uniform(np.log(1e-3), np.log(1e-1), size=H * K)), 1e-4, None)
  dt_bias = jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32)  # inverse softplus
  ct = jnp.asarray(r.normal(size=(2, 7, H, K)), jnp.float32)
  return z, A_log, dt_bias, ct


@pytest.mark.parametrize("gate_lower_bound", [-5.0, -2.5, None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_analytic_backward_matches_autodiff(gate_lower_bound, dtype):
  z, A_log, dt_bias, ct = _params(1, dtype=dtype)
  dt_bias = dt_bias.reshape(H, K) if dtype == jnp.bfloat16 else dt_bias  # both layouts
  loss = lambda f: (lambda *a: jnp.sum(f(*a, gate_lower_bound=gate_lower_bound) * ct))
  g1 = jax.jit(jax.grad(loss(kda_gate), argnums=(0, 1, 2)))(z, A_log, dt_bias)
  g2 = jax.grad(loss(kda_gate_autodiff), argnums=(0, 1, 2))(z, A_log, dt_bias)
  for a, b, x in zip(g1, g2, (z, A_log, dt_bias)):
    assert a.dtype == x.dtype and a.shape == x.shape
    assert np.any(np.asarray(a, np.float32) != 0)
    assert kt.rel_rmse(b, a) <= (1e-6 if a.dtype == jnp.float32 else 1e-2), kt.rel_rmse(b, a)


def test_values_and_ranges():
  z, A_log, dt_bias, _ = _params(2, z_scale=30.0)
  g = kda_gate(z, A_log, dt_bias)
  gn = np.asarray(g)
  assert g.dtype == jnp.float32 and g.shape == z.shape
  assert np.all(gn <= 0) and np.all(gn >= -5.0) and gn.min() < -4.9
  x = np.asarray(z) + np.asarray(dt_bias).reshape(H, K)
  a = np.exp(np.asarray(A_log))[:, None]
  with np.errstate(over="ignore"):
    np.testing.assert_allclose(gn, -5.0 / (1 + np.exp(-a * x)), rtol=1e-5, atol=1e-6)
  gu = np.asarray(kda_gate(z, A_log, dt_bias, gate_lower_bound=None))
  np.testing.assert_allclose(gu, -a * np.logaddexp(0, x), rtol=1e-5, atol=1e-6)
  assert gu.min() < -100  # the unbounded form reaches far below −5


@pytest.mark.parametrize("bad", [-5.5, 0.0, 0.5, -100.0])
def test_lower_bound_out_of_range_raises(bad):
  z, A_log, dt_bias, _ = _params(3)
  with pytest.raises(ValueError, match="gate_lower_bound"):
    kda_gate(z, A_log, dt_bias, gate_lower_bound=bad)


def test_bad_param_shapes_raise():
  z, A_log, dt_bias, _ = _params(4)
  with pytest.raises(ValueError):
    kda_gate(z, A_log[:2], dt_bias)
  with pytest.raises(ValueError):
    kda_gate(z, A_log, dt_bias[:5])


def test_the_spec_spelling_lower_bound():
  """ARCHITECTURE §2.3 writes `kda_gate(z, A_log, dt_bias, *, lower_bound=-5.0)`: that call
  works, with the values of the formula (not of gate_lower_bound's default)."""
  z, A_log, dt_bias, _ = _params(5, z_scale=10.0)
  x = np.asarray(z) + np.asarray(dt_bias).reshape(H, K)
  a = np.exp(np.asarray(A_log))[:, None]
  with np.errstate(over="ignore"):
    want = -3.0 / (1 + np.exp(-a * x))
  np.testing.assert_allclose(np.asarray(kda_gate(z, A_log, dt_bias, lower_bound=-3.0)), want,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(kda_gate(z, A_log, dt_bias, lower_bound=None)),
                             -a * np.logaddexp(0, x), rtol=1e-5, atol=1e-6)
  with pytest.raises(TypeError, match="not both"):
    kda_gate(z, A_log, dt_bias, gate_lower_bound=-2.0, lower_bound=-3.0)
  with pytest.raises(TypeError, match="not both"):  # the default's value, given: still both
    kda_gate(z, A_log, dt_bias, gate_lower_bound=-5.0, lower_bound=-3.0)
  with pytest.raises(ValueError, match="must be in"):
    kda_gate(z, A_log, dt_bias, lower_bound=1.0)
