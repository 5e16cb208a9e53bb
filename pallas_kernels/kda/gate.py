"""KDA decay gate: lower-bounded (default) and unbounded forms (ARCHITECTURE.md §2.3).

Source: Kimi Linear (arXiv 2510.26692) §3; the lower-bounded scaled-sigmoid form is the seed
article's innovation 1. The backward is the analytic one of ARCHITECTURE §2.3 (custom_vjp), so
it does not keep the autodiff intermediates (softplus / sigmoid chains) alive.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


_UNSET = object()


def kda_gate(z: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *,
             gate_lower_bound: float | None = _UNSET, lower_bound=_UNSET) -> jax.Array:
  """Log-decay g from the gate pre-activation.

  Args:
    z: [..., H, K] gate pre-activation (any float dtype).
    A_log: [H] fp32.
    dt_bias: [H * K] or [H, K] fp32.
    gate_lower_bound: g_min in [-5, 0) for g = g_min * sigmoid(exp(A_log) * (z + dt_bias));
      None for the unbounded g = -exp(A_log) * softplus(z + dt_bias). Default -5.0.
    lower_bound: the same value under ARCHITECTURE.md §2.3's (and fla's) name; give one of the
      two.

  Returns:
    g: [..., H, K] fp32, in (gate_lower_bound, 0) or (-inf, 0). All math in fp32; gradients flow to
    z (in z's dtype), A_log and dt_bias (their dtypes and shapes) by the analytic rule of §2.3:
      x = z + dt_bias, a = exp(A_log), ĝ = dL/dg,
      bounded:   dL/dx = ĝ g_min σ(ax)(1 − σ(ax)) a,   dL/dA_log = Σ dL/dx · x
      unbounded: dL/dx = −a σ(x) ĝ,                   dL/dA_log = Σ ĝ · g
    and dL/dz = dL/dx, dL/ddt_bias = Σ over the leading axes of dL/dx.

  Raises:
    ValueError: gate_lower_bound outside [-5, 0); z's trailing dims not matching A_log / dt_bias.
    TypeError: both gate_lower_bound and lower_bound given.
  """
  if lower_bound is not _UNSET:
    if gate_lower_bound is not _UNSET:
      raise TypeError("kda_gate: give gate_lower_bound or lower_bound (the same value), not both")
    gate_lower_bound = lower_bound
  elif gate_lower_bound is _UNSET:
    gate_lower_bound = -5.0
  if gate_lower_bound is not None and not (-5.0 <= gate_lower_bound < 0.0):
    raise ValueError(f"gate_lower_bound={gate_lower_bound} must be in [-5, 0) (or None for the "
                     "unbounded softplus gate)")
  H, K = z.shape[-2:]
  if A_log.shape != (H,):
    raise ValueError(f"A_log {A_log.shape} must be [H] = {(H,)}")
  if dt_bias.size != H * K:
    raise ValueError(f"dt_bias {dt_bias.shape} must be [H * K] or [H, K] with H, K = {(H, K)}")
  return _gate(None if gate_lower_bound is None else float(gate_lower_bound), z, A_log, dt_bias)


def _forward(gate_lower_bound, z, A_log, dt_bias):
  H, K = z.shape[-2:]
  x = z.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, K)
  a = jnp.exp(A_log.astype(jnp.float32))[:, None]
  if gate_lower_bound is None:
    return -a * jax.nn.softplus(x), (x, a)
  return gate_lower_bound * jax.nn.sigmoid(a * x), (x, a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gate(gate_lower_bound, z, A_log, dt_bias):
  return _forward(gate_lower_bound, z, A_log, dt_bias)[0]


def _gate_fwd(gate_lower_bound, z, A_log, dt_bias):
  g = _forward(gate_lower_bound, z, A_log, dt_bias)[0]
  # Residuals: just the inputs; x, a and the sigmoid are cheap to recompute in the backward.
  return g, (z, A_log, dt_bias)


def _gate_bwd(gate_lower_bound, res, g_bar):
  z, A_log, dt_bias = res
  g, (x, a) = _forward(gate_lower_bound, z, A_log, dt_bias)
  g_bar = g_bar.astype(jnp.float32)
  if gate_lower_bound is None:
    dx = -a * jax.nn.sigmoid(x) * g_bar
    dA_elem = g_bar * g
  else:
    s = jax.nn.sigmoid(a * x)
    dx = g_bar * gate_lower_bound * s * (1.0 - s) * a
    dA_elem = dx * x
  lead = tuple(range(dx.ndim - 2))
  dz = dx.astype(z.dtype)
  ddt = jnp.sum(dx, axis=lead).reshape(dt_bias.shape).astype(dt_bias.dtype)
  dA = jnp.sum(dA_elem, axis=lead + (dx.ndim - 1,)).astype(A_log.dtype)
  return dz, dA, ddt


_gate.defvjp(_gate_fwd, _gate_bwd)


def kda_gate_autodiff(z: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *,
                      gate_lower_bound: float | None = -5.0) -> jax.Array:
  """`kda_gate` without the custom_vjp (plain autodiff): the test oracle for the analytic rule."""
  if gate_lower_bound is not None and not (-5.0 <= gate_lower_bound < 0.0):
    raise ValueError(f"gate_lower_bound={gate_lower_bound} must be in [-5, 0)")
  return _forward(gate_lower_bound, z, A_log, dt_bias)[0]
