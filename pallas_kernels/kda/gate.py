"""KDA decay gate: lower-bounded (default) and unbounded forms (ARCHITECTURE.md §2.3).

Source: Kimi Linear (arXiv 2510.26692) §3; the lower-bounded scaled-sigmoid form is the seed
article's innovation 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kda_gate(z: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *,
             lower_bound: float | None = -5.0) -> jax.Array:
  """Log-decay g from the gate pre-activation.

  Args:
    z: [..., H, K] gate pre-activation (any float dtype).
    A_log: [H] fp32.
    dt_bias: [H * K] or [H, K] fp32.
    lower_bound: g_min in [-5, 0) for g = g_min * sigmoid(exp(A_log) * (z + dt_bias));
      None for the unbounded g = -exp(A_log) * softplus(z + dt_bias).

  Returns:
    g: [..., H, K] fp32, in (lower_bound, 0) or (-inf, 0).

  Raises:
    ValueError: lower_bound outside [-5, 0).
  """
  if lower_bound is not None and not (-5.0 <= lower_bound < 0.0):
    raise ValueError(f"lower_bound={lower_bound} must be in [-5, 0) (or None for the "
                     "unbounded softplus gate)")
  H, K = z.shape[-2:]
  x = z.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, K)
  a = jnp.exp(A_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(a * x)
