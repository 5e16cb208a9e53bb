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

Only the ∂S recursion is sequential: the kernel writes ∂S after every chunk, and ∂U, ∂Kd, ∂d, ∂W
(which sum over all value columns) are matmuls batched over all chunks in the wrapper. (Computing
them inside the loop made the backward kernel 4× the forward: 6.0 ms against 1.5 ms at T = 32K,
H = 16, K = V = 128 on an H200.) Shapes (all power-of-two tile sizes, as the Triton
lowering requires): K, V padded to powers of two ≥ 16; C ∈ {16, 32, 64}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


# `precision=BF16_OPERANDS`: both operands of every product are rounded to bf16 and the product
# is accumulated in fp32 (bf16 tensor-core MMA on a GPU, as fla's and jax-linear-attention's
# kernels multiply), in place of DEFAULT's TF32 products of fp32 operands.
BF16_OPERANDS = jax.lax.DotAlgorithmPreset.BF16_BF16_F32


def _dot(a, b, precision, ta=False, tb=False):
  """a @ b with optional transposes, fp32 accumulation; with precision=BF16_OPERANDS the
  operands are rounded to bf16 first (explicit casts: the same numbers in interpret mode)."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  if precision == BF16_OPERANDS:
    a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def state_fwd_kernel(w_ref, u_ref, kd_ref, dec_ref, h0_ref, hs_ref, vn_ref, ht_ref, *,
                     num_chunks, C, BV, precision):
  """Refs (whole arrays): w [BH, Tp, K], u [BH, Tp, V], kd [BH, N, K, C] (fp32 or bf16),
  dec [BH, N, K], h0 [BH, K, V] (fp32) -> hs [BH, N, K, V], vn [BH, Tp, V] (their refs' dtype:
  fp32 or bf16), ht [BH, K, V] fp32. Loads are promoted to fp32; the state S stays fp32."""
  bh, j = pl.program_id(0), pl.program_id(1)
  vs = pl.ds(j * BV, BV)
  f32 = jnp.float32

  def body(n, S):
    rows = pl.ds(n * C, C)
    hs_ref[bh, n, :, vs] = S.astype(hs_ref.dtype)
    vn = u_ref[bh, rows, vs].astype(f32) - _dot(w_ref[bh, rows, :].astype(f32), S, precision)
    vn_ref[bh, rows, vs] = vn.astype(vn_ref.dtype)
    return (dec_ref[bh, n, :][:, None] * S
            + _dot(kd_ref[bh, n, :, :].astype(f32), vn, precision))

  S = jax.lax.fori_loop(0, num_chunks, body, h0_ref[bh, :, vs])
  ht_ref[bh, :, vs] = S


def state_bwd_kernel(w_ref, kd_ref, dec_ref, dvn_ref, dhs_ref, dht_ref, ds_ref, dh0_ref, *,
                     num_chunks, C, BV, precision):
  """The sequential part of the backward only: ∂L/∂S after every chunk.

  Refs: w, kd, dec as in the forward; cotangents dvn [BH, Tp, V], dhs [BH, N, K, V] (the
  storage dtype), dht [BH, K, V] fp32 -> ds [BH, N, K, V] (∂L/∂S after chunk n, before it is
  decayed into chunk n − 1's; in dvn's dtype) and dh0 [BH, K, V] fp32. The recursion is fp32.
  The gradients of U, W, Kd and d follow from ds by matmuls batched over all chunks
  (pallas_gpu._state_pass_bwd), outside the sequential loop.
  """
  bh, j = pl.program_id(0), pl.program_id(1)
  vs = pl.ds(j * BV, BV)
  f32 = jnp.float32

  def body(i, dS):
    n = num_chunks - 1 - i
    rows = pl.ds(n * C, C)
    ds_ref[bh, n, :, vs] = dS.astype(ds_ref.dtype)
    dvt = (dvn_ref[bh, rows, vs].astype(f32)
           + _dot(kd_ref[bh, n, :, :].astype(f32), dS, precision, ta=True))  # [C, BV]
    dec = dec_ref[bh, n, :][:, None]
    return (dec * dS - _dot(w_ref[bh, rows, :].astype(f32), dvt, precision, ta=True)
            + dhs_ref[bh, n, :, vs].astype(f32))

  dS = jax.lax.fori_loop(0, num_chunks, body, dht_ref[bh, :, vs])
  dh0_ref[bh, :, vs] = dS
