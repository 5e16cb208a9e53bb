"""Naive token-serial KDA: the definition every faster backend is tested against.

Runs everywhere (CPU, GPU, TPU). Source: Kimi Linear (arXiv 2510.26692), Eq. (1)-(2);
ARCHITECTURE.md §2.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.tiles import segment_resets


def supported_on(device) -> bool:
  """Where this backend runs: every platform (plain jax.numpy)."""
  del device
  return True


def recurrent_step(
    S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
    beta: jax.Array, scale: float,
) -> tuple[jax.Array, jax.Array]:
  """One KDA token: (S [..., K, V], q/k/g [..., K], v [..., V], beta [...]) -> (o [..., V], S).

  All math in S's dtype (fp32 or fp64). Implements ARCHITECTURE.md §2.1:
    S~ = Diag(exp(g)) S;  S = S~ + beta k (v - S~^T k)^T;  o = S^T (scale q).
  """
  dt = S.dtype
  q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
  S = jnp.exp(g)[..., :, None] * S
  pred = jnp.einsum("...kv,...k->...v", S, k)
  S = S + beta[..., None, None] * k[..., :, None] * (v - pred)[..., None, :]
  o = jnp.einsum("...kv,...k->...v", S, q * scale)
  return o, S


def recurrent_kda(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None,
    output_final_state: bool = True, segment_ids: jax.Array | None = None,
    chunk_size: int | None = None, backend: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Token-serial KDA recurrence (`lax.scan` over T) — the reference and the decode path.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0, natural log, after
      the gate); beta: [B, T, H] in (0, 1). Any float dtype.
    scale: query scale, default K ** -0.5.
    initial_state: [B, H, K, V] or None (zeros).
    output_final_state: return the final state (else None in its place), as `chunk_kda`.
    segment_ids: [B, T] int32 packed-document ids, 0 = padding (see `segment_resets`).
    chunk_size, backend: ignored (signature parity with `chunk_kda`).

  Returns:
    o [B, T, H, V] in q's dtype, and the final state [B, H, K, V] in the state dtype (fp64 when
    x64 is enabled and the inputs are fp64, else fp32) or None without output_final_state.
  """
  del chunk_size, backend
  B, T, H, K = q.shape
  V = v.shape[-1]
  acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  scale = K ** -0.5 if scale is None else scale
  S0 = (jnp.zeros((B, H, K, V), acc) if initial_state is None
        else initial_state.astype(acc))
  if segment_ids is None:
    reset = jnp.zeros((B, T), bool)
    valid = jnp.ones((B, T), bool)
  else:
    reset = segment_resets(segment_ids)
    valid = segment_ids != 0
  # Padding is an identity step.
  g = jnp.where(valid[..., None, None], g.astype(acc), 0)
  beta = jnp.where(valid[..., None], beta.astype(acc), 0)

  def step(S, xs):
    q_t, k_t, v_t, g_t, b_t, r_t, m_t = xs
    S = jnp.where(r_t[:, None, None, None], 0, S)
    o_t, S = recurrent_step(S, q_t, k_t, v_t, g_t, b_t, scale)
    return S, jnp.where(m_t[:, None, None], o_t, 0)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset, valid))
  S, o = jax.lax.scan(step, S0, xs)
  o = jnp.moveaxis(o, 0, 1).astype(q.dtype)
  return o, (S if output_final_state else None)
