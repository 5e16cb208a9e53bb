"""KDA GPU kernels (Pallas, Triton lowering): the sequential inter-chunk state pass, forward and
backward. The layout, the custom VJP and the public entry point are in pallas_gpu.py.

Per chunk n (C tokens) the state pass reads W_n, U_n [C, K|V], Kd_n [K, C] (= (K ⊙ e^(G_C − G)
⊙ m_C)ᵀ) and the decay d_n = m0_C e^(G_C) [K] (ARCHITECTURE §2.4), and computes

    H_n = S                       (the state entering chunk n, saved for the output and backward)
    V'_n = U_n − W_n S
    S   ← d_n ⊙ S + Kd_n V'_n

One program per (batch·head, block of BV value columns): the columns of S are independent, so the
grid is B·H × V/BV and each program walks the chunks in a `fori_loop` with its fp32 state block
[K, BV] in registers. The backward walks the chunks in reverse with ∂L/∂S:

    ∂V'_n = ∂V'_n(out) + Kd_nᵀ ∂S        (= ∂U_n)
    ∂Kd_n = ∂S V'_nᵀ,   ∂d_n = Σ_v ∂S ⊙ H_n,   ∂W_n = −∂V'_n H_nᵀ
    ∂S    ← d_n ⊙ ∂S − W_nᵀ ∂V'_n + ∂H_n

∂Kd, ∂d and ∂W sum over all value columns: each program writes its block's partial sum (a leading
axis of size V/BV) and the wrapper adds them. Shapes (all power-of-two tile sizes, as the Triton
lowering requires): K, V padded to powers of two ≥ 16; C ∈ {16, 32, 64}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _dot(a, b, precision, ta=False, tb=False):
  """a @ b with optional transposes, fp32 accumulation."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def state_fwd_kernel(w_ref, u_ref, kd_ref, dec_ref, h0_ref, hs_ref, vn_ref, ht_ref, *,
                     num_chunks, C, BV, precision):
  """Refs (whole arrays): w [BH, Tp, K], u [BH, Tp, V], kd [BH, N, K, C], dec [BH, N, K],
  h0 [BH, K, V] -> hs [BH, N, K, V], vn [BH, Tp, V], ht [BH, K, V] (all fp32)."""
  bh, j = pl.program_id(0), pl.program_id(1)
  vs = pl.ds(j * BV, BV)

  def body(n, S):
    rows = pl.ds(n * C, C)
    hs_ref[bh, n, :, vs] = S
    vn = u_ref[bh, rows, vs] - _dot(w_ref[bh, rows, :], S, precision)
    vn_ref[bh, rows, vs] = vn
    return dec_ref[bh, n, :][:, None] * S + _dot(kd_ref[bh, n, :, :], vn, precision)

  S = jax.lax.fori_loop(0, num_chunks, body, h0_ref[bh, :, vs])
  ht_ref[bh, :, vs] = S


def state_bwd_kernel(w_ref, kd_ref, dec_ref, hs_ref, vn_ref, dhs_ref, dvn_ref, dht_ref,
                     du_ref, dw_ref, dkd_ref, ddec_ref, dh0_ref, *, num_chunks, C, BV,
                     precision):
  """Refs: w, kd, dec, hs, vn as in the forward; cotangents dhs [BH, N, K, V], dvn [BH, Tp, V],
  dht [BH, K, V] -> du [BH, Tp, V], partial sums over value blocks dw [J, BH, Tp, K],
  dkd [J, BH, N, K, C], ddec [J, BH, N, K], and dh0 [BH, K, V] (all fp32)."""
  bh, j = pl.program_id(0), pl.program_id(1)
  vs = pl.ds(j * BV, BV)

  def body(i, dS):
    n = num_chunks - 1 - i
    rows = pl.ds(n * C, C)
    H = hs_ref[bh, n, :, vs]                                          # [K, BV]
    vn = vn_ref[bh, rows, vs]                                         # [C, BV]
    kd = kd_ref[bh, n, :, :]                                          # [K, C]
    w = w_ref[bh, rows, :]                                            # [C, K]
    dvt = dvn_ref[bh, rows, vs] + _dot(kd, dS, precision, ta=True)    # [C, BV]
    du_ref[bh, rows, vs] = dvt
    dkd_ref[j, bh, n, :, :] = _dot(dS, vn, precision, tb=True)        # [K, C]
    ddec_ref[j, bh, n, :] = jnp.sum(dS * H, axis=1)
    dw_ref[j, bh, rows, :] = -_dot(dvt, H, precision, tb=True)        # [C, K]
    dec = dec_ref[bh, n, :][:, None]
    return dec * dS - _dot(w, dvt, precision, ta=True) + dhs_ref[bh, n, :, vs]

  dS = jax.lax.fori_loop(0, num_chunks, body, dht_ref[bh, :, vs])
  dh0_ref[bh, :, vs] = dS
