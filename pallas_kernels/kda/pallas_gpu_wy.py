"""KDA on NVIDIA GPUs: the intra-chunk work (scores, triangular inverse, WY form) as Pallas
kernels (Triton lowering) on whole-chunk tiles, forward and a hand-written backward.

Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4 (the equations, exponent
safety). The same outputs as `xla._intra_chunk` (W, U, Q ⊙ Γ · scale, A_qk, Kdᵀ, the chunk
decay), for the lower-bounded gate ("dense" diagonal tiles) only; `pallas_gpu.py` calls it.

One program per chunk and batch·head (grid B·H × N). q, k, v, g, β are read in the caller's
[B, T, H, ·] layout (no transposes); every matrix product is a [C, ·] × [·, C] or
[C, C] × [C, ·] tile product (C = 64 rows, the tensor cores' shape), not 16-row sub-tiles:

  * Pairwise scores on 16-token sub-tiles (query tile a, reference r_a = G at its first row
    s_a), as n = C/16 masked whole-chunk products: with
        Lx_i  = Σ_{s_a<m≤i} g_m                  (a direct sum inside the tile, ≤ 0)
        QF_a  = e^(Lx) on the rows of tile a, 0 elsewhere                       (≤ 1)
        KF_a  = e^(r_a − G_j): e^(−Lx_j) on tile a (≤ e^(15|g_min|), the bound of the
                lower-bounded gate), e^((tp_b − Lx_j) + Σ_{b<c<a} tot_c + g_{s_a}) on earlier
                tiles b (≤ 1), 0 on later tiles (exponent −inf before exp)
    S_q = Σ_a (q ⊙ QF_a)(k ⊙ KF_a)ᵀ and S_k likewise with k on the query side; every exponent
    is a direct sum of g over a token range or a sum of such (tile totals tot_c, their part
    after the first row tp_c), never a difference of whole-chunk cumulative sums.
  * X = (I + A_kk)⁻¹ without a row-serial loop: blocked forward substitution whose steps are
    whole-chunk products (4 × 4 diagonal blocks by (I + L)(I + L²), then block rows of 4 and
    of 16 rows, 14 products at C = 64; `_inverse`). Row i of every product reads rows ≤ i
    only (the others are exact zeros), so the result is causal bit for bit.
  * W = X (β ⊙ K ⊙ Γ), U = X (β ⊙ V), Q ⊙ Γ · scale, Kdᵀ = (K ⊙ e^(G_C − G) ⊙ m_C)ᵀ,
    d = e^(G_C) m0_C, Γ = e^G ⊙ m0.

The backward kernel recomputes S_k and X from the inputs (nothing else is stored) and applies
the chain rule with whole-chunk products:

    dX = dW (β K Γ)ᵀ + dU (β V)ᵀ,   dA = −Xᵀ dX Xᵀ (strictly lower, same document)
    dS_k = β_i dA,  dS_q = scale · dA_qk (causal, same document)
    for S = Σ_d a_id b_jd e^(G_id − G_jd):  Da = Σ_a QF_a ⊙ (dS (b ⊙ KF_a)),
        Db = Σ_a KF_a ⊙ (dSᵀ (a ⊙ QF_a)),  ∂a += Da,  ∂b += Db,  ∂G += a ⊙ Da − b ⊙ Db
    ∂g = reverse cumulative sum of ∂G in the chunk (+ ∂G_C on every row)

Status (docs/benchmarks.md, 2026-12-05, one H100): exact (the XLA intra-chunk step's outputs and
gradients to 1e-5 in fp32 interpret mode; on the GPU within 1.1e-3 (o) to 4.5e-3 (dg) of the
XLA path in bf16, where jax-linear-attention is within 3.7e-3 to 4.6e-3), but slower: at B=1,
H=16, T=8K, K=V=128 fwd+bwd the backward kernel took 7.04 ms and the forward 2.53 ms of 11.0
ms, against 6.4 ms for the whole operator with the XLA step. Each program runs at one block
of 8 warps per SM (255 registers per thread, still spilling) through a chain of ~60 dependent
small products; so `pallas_gpu` runs it only with `intra="wy"`.

Precision: `precision` (DEFAULT = TF32 for bf16 inputs, HIGHEST for fp32) for the score, W, U
and gradient products; `hi` (3×TF32 on the GPU, true fp32 in interpret mode and for fp32 inputs)
for the inverse, its derivative and the reverse cumulative sum. Accumulation is fp32.
Shapes: K, V powers of two ≥ 16 (the wrapper pads), T a multiple of C (likewise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.pallas_gpu_kernels import _dot
from pallas_kernels.kda.tiles import SUB

f32 = jnp.float32
HI = jax.lax.Precision.HIGHEST


def _blocks(size, block):
  """The `block`-wide slice number i of `size` channels (i a Python int or a loop index)."""
  del size
  return lambda i: (slice(i * block, (i + 1) * block) if isinstance(i, int)
                    else pl.ds(pl.multiple_of(i * block, block), block))


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


class _Gate:
  """The gate's exponents for one [C, BK] block of g (fp32, 0 at padding tokens): module
  docstring. Every quantity is per key channel, so K can be processed in blocks."""

  def __init__(self, g, n):
    C, BK = g.shape
    self.n = n
    row = _iota((C, BK), 0)
    lr = jax.lax.rem(row, SUB)
    self.tile = jax.lax.div(row, SUB)
    g3 = jnp.where(lr == 0, 0.0, g).reshape(n, SUB, BK)
    self.Lx = jnp.cumsum(g3, axis=1).reshape(C, BK)  # Σ_{s_a<m≤i} g_m
    g0 = [jnp.sum(jnp.where(row == c * SUB, g, 0.0), axis=0) for c in range(n)]
    tp = [jnp.sum(jnp.where(row == c * SUB + SUB - 1, self.Lx, 0.0), axis=0) for c in range(n)]
    self.g0, self.tp = g0, tp
    self.tot = [g0[c] + tp[c] for c in range(n)]
    self.TP = self.rows(tp)  # tp of each row's tile

  # G, E and G_C are built where they are used (after the score loops), so that the compiled
  # kernel does not keep them live through those loops.
  @property
  def Gtot(self):
    """G_C = Σ_c tot_c [BK]."""
    run = self.tot[0]
    for c in range(1, self.n):
      run = run + self.tot[c]
    return run

  @property
  def G(self):
    """The inclusive cumulative G from the chunk start (≤ 0), [C, BK]."""
    pre, run = [], None
    for a in range(self.n):
      pre.append(self.g0[a] if run is None else run + self.g0[a])  # Σ_{c<a} tot_c + g_{s_a}
      run = self.tot[a] if run is None else run + self.tot[a]
    return self.Lx + self.rows(pre)

  @property
  def E(self):
    """G_C − G_j = Σ_{j<m<C} g_m (≤ 0), [C, BK]."""
    after = []
    for b in range(self.n):  # Σ_{c>b} tot_c
      s = None
      for c in range(b + 1, self.n):
        s = self.tot[c] if s is None else s + self.tot[c]
      after.append(s)
    return self.TP - self.Lx + self.rows(after)

  def rows(self, vecs):
    """[C, BK]: vecs[c] ([BK] or None = 0) on the rows of tile c."""
    out = None
    for c in reversed(range(self.n)):
      v = 0.0 if vecs[c] is None else vecs[c][None, :]
      out = (jnp.zeros_like(self.Lx) + v) if out is None else jnp.where(self.tile == c, v, out)
    return out

  def qf(self, a):
    """e^(G_i − r_a) on the rows of query tile a, 0 elsewhere (≤ 1)."""
    return jnp.exp(jnp.where(self.tile == a, self.Lx, -jnp.inf))

  def kf(self, a):
    """e^(r_a − G_j) for keys j up to the end of tile a, 0 after (masked before exp)."""
    if a == 0:
      return jnp.exp(jnp.where(self.tile == 0, -self.Lx, -jnp.inf))
    btw = []
    for b in range(a):  # Σ_{b<c<a} tot_c + g_{s_a}
      s = self.g0[a]
      for c in range(b + 1, a):
        s = s + self.tot[c]
      btw.append(s)
    earlier = self.TP - self.Lx + self.rows(btw + [None] * (self.n - a))
    e = jnp.where(self.tile == a, -self.Lx, jnp.where(self.tile < a, earlier, -jnp.inf))
    return jnp.exp(e)


def _inverse(A, n, hi):
  """(I + A)⁻¹ of a strictly lower-triangular [C, C] fp32 A, C = 16 n: blocked forward
  substitution on whole-chunk products (module docstring).

  The 4 × 4 diagonal blocks first, as (I + L)(I + L²) = Σ_{m<4} L^m with L = −A on those
  blocks; then, for block sizes s = 4 and 16, block row j of every (4 s)-block at once:
  X[j, :j] = −X[j, j] Σ_{c<j} A[j, c] X[c, :j] (two products per block row). This is forward
  substitution by blocks, as accurate as the row-serial solve (the doubling product over
  whole 16-row blocks lost up to 7e-5 on near-identical keys in fp32). Row i of every product
  reads rows ≤ i only (the others are exact zeros): causal bit for bit.
  """
  C = A.shape[0]
  r, c = _iota((C, C), 0), _iota((C, C), 1)
  eye = jnp.where(r == c, 1.0, 0.0).astype(f32)
  L = jnp.where(jax.lax.div(r, 4) == jax.lax.div(c, 4), -A, 0.0)
  P = eye + L
  X = P + _dot(P, _dot(L, L, hi), hi)  # the inverses of the 4 × 4 diagonal blocks
  s = 4
  while s < C:
    big = min(4 * s, C)
    rpos, cpos = jax.lax.rem(jax.lax.div(r, s), big // s), jax.lax.rem(jax.lax.div(c, s), big // s)
    same_big = jax.lax.div(r, big) == jax.lax.div(c, big)
    Xd = X  # block diagonal with s × s blocks
    for j in range(1, big // s):
      R = _dot(jnp.where(same_big & (rpos == j) & (cpos < j), A, 0.0), X, hi)
      X = X - _dot(jnp.where(rpos == j, Xd, 0.0), R, hi)
    s = big
  return X


def _mask(C, segs, doc_ref, strict):
  """[C, C] bool: j < i (strict) or j ≤ i, and the same document. Built where it is used (a
  mask kept live across the kernel costs registers)."""
  ii, jj = _iota((C, C), 0), _iota((C, C), 1)
  m = ii > jj if strict else ii >= jj
  if segs:
    doc = doc_ref[...]
    m = m & (doc[:, None] == doc[None, :])
  return m


def _last(x):
  """x[C − 1] of a [C] vector, as a scalar (a masked sum: Triton cannot index a value)."""
  C = x.shape[0]
  return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (C,), 0) == C - 1, x, 0.0))


def _scores_k(k_ref, g_ref, n, BK, prec, hi, q_ref=None, unroll=False):
  """S_k (and S_q when q_ref is given), [C, C] fp32, summed over the key-channel blocks."""
  C, Kp = k_ref.shape
  blk = _blocks(Kp, BK)

  def body(kb, acc):
    ks = blk(kb)
    t = _Gate(g_ref[:, ks].astype(f32), n)
    k = k_ref[:, ks].astype(f32)
    q = None if q_ref is None else q_ref[:, ks].astype(f32)
    Sk, Sq = acc
    for a in range(n):
      qf = t.qf(a)
      kk = k * t.kf(a)
      Sk = Sk + _dot(k * qf, kk, prec, tb=True)
      if q is not None:
        Sq = Sq + _dot(q * qf, kk, prec, tb=True)
    return Sk, Sq

  zero = jnp.zeros((C, C), f32)
  acc = (zero, None if q_ref is None else zero)
  if unroll:
    for kb in range(Kp // BK):
      acc = body(kb, acc)
    Sk, Sq = acc
  else:
    Sk, Sq = jax.lax.fori_loop(0, Kp // BK, body, acc)
  return Sk, Sq


def _fwd_kernel(*refs, n, BK, BV, scale, prec, hi, segs):
  if segs:
    (q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, m0_ref, ml_ref,
     w_ref, u_ref, qg_ref, aqk_ref, kd_ref, dec_ref) = refs
  else:
    (q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, qg_ref, aqk_ref, kd_ref, dec_ref) = refs
    doc_ref = None
  C, Kp = q_ref.shape
  Vp = v_ref.shape[-1]
  beta = b_ref[...].astype(f32)
  Sk, Sq = _scores_k(k_ref, g_ref, n, BK, prec, hi, q_ref=q_ref, unroll=True)
  aqk_ref[...] = jnp.where(_mask(C, segs, doc_ref, False), scale * Sq, 0.0).astype(aqk_ref.dtype)
  X = _inverse(jnp.where(_mask(C, segs, doc_ref, True), beta[:, None] * Sk, 0.0), n, hi)
  if segs:
    m0 = m0_ref[...].astype(f32)
    ml = ml_ref[...].astype(f32)
    m0_last = _last(m0)
  kblk, vblk = _blocks(Kp, BK), _blocks(Vp, BV)

  def w_block(kb, carry):
    ks = kblk(kb)
    t = _Gate(g_ref[:, ks].astype(f32), n)
    k = k_ref[:, ks].astype(f32)
    gam = jnp.exp(t.G)
    kdv = k * jnp.exp(t.E)
    dec = jnp.exp(t.Gtot)
    if segs:
      gam = gam * m0[:, None]
      kdv = kdv * ml[:, None]
      dec = dec * m0_last
    w_ref[:, ks] = _dot(X, beta[:, None] * k * gam, prec).astype(w_ref.dtype)
    qg_ref[:, ks] = (scale * q_ref[:, ks].astype(f32) * gam).astype(qg_ref.dtype)
    kd_ref[ks, :] = jnp.transpose(kdv).astype(kd_ref.dtype)
    dec_ref[ks] = dec
    return carry

  def u_block(vb, carry):
    vs = vblk(vb)
    u_ref[:, vs] = _dot(X, beta[:, None] * v_ref[:, vs].astype(f32), prec).astype(u_ref.dtype)
    return carry

  # Unrolled (Python loops): under pip Triton 3.9 for sm_90 this spills less here than a
  # fori_loop does (704 against 456 B of stack at block 32; benchmarks/triton_resources.py).
  for kb in range(Kp // BK):
    w_block(kb, 0)
  for vb in range(Vp // BV):
    u_block(vb, 0)


def _bwd_kernel(*refs, n, BK, BV, scale, prec, hi, segs):
  if segs:
    (q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, m0_ref, ml_ref,
     dw_ref, du_ref, dqg_ref, daqk_ref, dkd_ref, ddec_ref,
     dq_ref, dk_ref, dv_ref, dg_ref, db_ref) = refs
  else:
    (q_ref, k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, dqg_ref, daqk_ref, dkd_ref, ddec_ref,
     dq_ref, dk_ref, dv_ref, dg_ref, db_ref) = refs
    doc_ref = None
  C, Kp = q_ref.shape
  Vp = v_ref.shape[-1]
  nk = Kp // BK
  beta = b_ref[...].astype(f32)
  if segs:
    m0 = m0_ref[...].astype(f32)
    ml = ml_ref[...].astype(f32)
    m0_last = _last(m0)
  Sk, _ = _scores_k(k_ref, g_ref, n, BK, prec, hi)
  Sk = jnp.where(_mask(C, segs, doc_ref, True), Sk, 0.0)
  X = _inverse(beta[:, None] * Sk, n, hi)

  def gam_of(t):
    gam = jnp.exp(t.G)
    return gam * m0[:, None] if segs else gam

  # dX = dW (β K Γ)ᵀ + dU (β V)ᵀ; U's part also gives dV and a part of dβ.
  kblk, vblk = _blocks(Kp, BK), _blocks(Vp, BV)

  def dx_w(kb, dX):
    ks = kblk(kb)
    t = _Gate(g_ref[:, ks].astype(f32), n)
    bk = beta[:, None] * k_ref[:, ks].astype(f32) * gam_of(t)
    return dX + _dot(dw_ref[:, ks].astype(f32), bk, prec, tb=True)

  def dx_u(vb, acc):
    dX, dbeta = acc
    vs = vblk(vb)
    du = du_ref[:, vs].astype(f32)
    v = v_ref[:, vs].astype(f32)
    dbv = _dot(X, du, prec, ta=True)  # Xᵀ dU
    dv_ref[:, vs] = (beta[:, None] * dbv).astype(dv_ref.dtype)
    return dX + _dot(du, beta[:, None] * v, prec, tb=True), dbeta + jnp.sum(dbv * v, axis=1)

  dX = jax.lax.fori_loop(0, nk, dx_w, jnp.zeros((C, C), f32))
  dX, dbeta = jax.lax.fori_loop(0, Vp // BV, dx_u, (dX, jnp.zeros((C,), f32)))
  dA = -_dot(_dot(X, dX, hi, ta=True), X, hi, tb=True)  # −Xᵀ dX Xᵀ
  dA = jnp.where(_mask(C, segs, doc_ref, True), dA, 0.0)
  dbeta = dbeta + jnp.sum(dA * Sk, axis=1)
  dSk = beta[:, None] * dA
  dSq = jnp.where(_mask(C, segs, doc_ref, False), scale * daqk_ref[...].astype(f32), 0.0)
  def pairwise_block(kb, dbeta):
    ks = kblk(kb)
    t = _Gate(g_ref[:, ks].astype(f32), n)
    q = q_ref[:, ks].astype(f32)
    k = k_ref[:, ks].astype(f32)
    # The pairwise scores first (the fewest arrays live): for query tile a,
    #   P = QF ⊙ (dS_q (k ⊙ KF)), R = QF ⊙ (dS_k (k ⊙ KF)), Z = KF ⊙ (dS_qᵀ (q ⊙ QF) + dS_kᵀ (k ⊙ QF))
    #   ∂q += P,  ∂k += R + Z,  ∂G += q ⊙ P + k ⊙ (R − Z).
    dq = dk = dG = None
    for a in range(n):
      qf, kf = t.qf(a), t.kf(a)
      kk = k * kf
      P = qf * _dot(dSq, kk, prec)
      R = qf * _dot(dSk, kk, prec)
      Z = kf * (_dot(dSq, q * qf, prec, ta=True) + _dot(dSk, k * qf, prec, ta=True))
      if dq is None:
        dq, dk, dG = P, R + Z, q * P + k * (R - Z)
      else:
        dq, dk, dG = dq + P, dk + R + Z, dG + q * P + k * (R - Z)
    # Then Q ⊙ Γ, W's β K Γ (∂W through Xᵀ) and Kd, and the chunk decay d.
    gam = gam_of(t)
    ed = jnp.exp(t.E)
    dec = jnp.exp(t.Gtot)
    if segs:
      ed = ed * ml[:, None]
      dec = dec * m0_last
    dqg = dqg_ref[:, ks].astype(f32)
    dq = dq + scale * gam * dqg
    dG = dG + scale * q * gam * dqg
    dbk = _dot(X, dw_ref[:, ks].astype(f32), prec, ta=True)  # Xᵀ dW
    dk = dk + beta[:, None] * gam * dbk
    dG = dG + beta[:, None] * k * gam * dbk
    dbeta = dbeta + jnp.sum(dbk * k * gam, axis=1)
    dkd = jnp.transpose(dkd_ref[ks, :].astype(f32))  # [C, BK]
    kd = k * ed
    dk = dk + ed * dkd
    dG = dG - dkd * kd
    dGtot = jnp.sum(dkd * kd, axis=0) + ddec_ref[ks].astype(f32) * dec
    dq_ref[:, ks] = dq.astype(dq_ref.dtype)
    dk_ref[:, ks] = dk.astype(dk_ref.dtype)
    rev = jnp.where(_iota((C, C), 0) <= _iota((C, C), 1), 1.0, 0.0).astype(f32)  # Σ_{i≥m}
    dg_ref[:, ks] = (_dot(rev, dG, hi) + dGtot[None, :]).astype(dg_ref.dtype)
    return dbeta

  dbeta = jax.lax.fori_loop(0, nk, pairwise_block, dbeta)
  db_ref[...] = dbeta.astype(db_ref.dtype)


def _config(q, v, C, interpret, precision, num_warps, block_k):
  B, Tp, H, Kp = q.shape
  Vp = v.shape[-1]
  BK = min(block_k, Kp)
  BV = min(block_k, Vp)
  if interpret or precision == HI:
    hi = HI
  else:
    hi = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
  return B, Tp, H, Kp, Vp, Tp // C, BK, BV, hi, params


def _in_specs(C, H, Kp, Vp, segs):
  def tok(d):  # [B, Tp, H, d] -> a chunk of one head
    return pl.BlockSpec((None, C, None, d), lambda i, n: (i // H, n, i % H, 0))
  specs = [tok(Kp), tok(Kp), tok(Vp), tok(Kp),
           pl.BlockSpec((None, C, None), lambda i, n: (i // H, n, i % H))]
  if segs:
    specs += [pl.BlockSpec((None, C), lambda i, n: (i // H, n))] * 3
  return specs


def _chunk_specs(C, Kp, Vp):
  """Specs of the outputs / their cotangents: W, U, Qg [BH, Tp, ·], A_qk [BH, N, C, C],
  Kdᵀ [BH, N, K, C], d [BH, N, K]."""
  rows = lambda d: pl.BlockSpec((None, C, d), lambda i, n: (i, n, 0))
  return [rows(Kp), rows(Vp), rows(Kp),
          pl.BlockSpec((None, None, C, C), lambda i, n: (i, n, 0, 0)),
          pl.BlockSpec((None, None, Kp, C), lambda i, n: (i, n, 0, 0)),
          pl.BlockSpec((None, None, Kp), lambda i, n: (i, n, 0))]


def _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
              block_k):
  B, Tp, H, Kp, Vp, N, BK, BV, hi, params = _config(q, v, C, interpret, precision, num_warps,
                                                   block_k[0])
  segs = masks is not None
  BH = B * H
  out_shape = [jax.ShapeDtypeStruct((BH, Tp, Kp), store), jax.ShapeDtypeStruct((BH, Tp, Vp), store),
               jax.ShapeDtypeStruct((BH, Tp, Kp), store),
               jax.ShapeDtypeStruct((BH, N, C, C), store),
               jax.ShapeDtypeStruct((BH, N, Kp, C), store),
               jax.ShapeDtypeStruct((BH, N, Kp), f32)]
  kernel = functools.partial(_fwd_kernel, n=C // SUB, BK=BK, BV=BV, scale=scale,
                             prec=precision, hi=hi, segs=segs)
  args = (q, k, v, g, beta) + (tuple(masks) if segs else ())
  return pl.pallas_call(kernel, grid=(BH, N), in_specs=_in_specs(C, H, Kp, Vp, segs),
                        out_specs=_chunk_specs(C, Kp, Vp), out_shape=out_shape,
                        compiler_params=params, interpret=interpret,
                        name="kda_wy_fwd")(*args)


def _bwd_call(q, k, v, g, beta, masks, cts, C, scale, precision, interpret, num_warps, block_k):
  B, Tp, H, Kp, Vp, N, BK, BV, hi, params = _config(q, v, C, interpret, precision, num_warps,
                                                   block_k[1])
  segs = masks is not None
  tok = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  out_shape = [tok(q), tok(k), tok(v), jax.ShapeDtypeStruct(g.shape, f32),
               jax.ShapeDtypeStruct(beta.shape, f32)]
  in_specs = _in_specs(C, H, Kp, Vp, segs)
  kernel = functools.partial(_bwd_kernel, n=C // SUB, BK=BK, BV=BV, scale=scale,
                             prec=precision, hi=hi, segs=segs)
  args = (q, k, v, g, beta) + (tuple(masks) if segs else ()) + tuple(cts)
  return pl.pallas_call(kernel, grid=(B * H, N),
                        in_specs=in_specs + _chunk_specs(C, Kp, Vp),
                        out_specs=in_specs[:5], out_shape=out_shape,
                        compiler_params=params, interpret=interpret,
                        name="kda_wy_bwd")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def intra_chunk_wy(q, k, v, g, beta, masks, C, scale, precision, store, interpret,
                   num_warps=8, block_k=(32, 16)):
  """The intra-chunk step of `pallas_gpu` as two Pallas kernels (module docstring).

  Args:
    q, k: [B, Tp, H, Kp]; v: [B, Tp, H, Vp] (bf16 or fp32; read in this dtype, promoted to
      fp32 in the kernel); g: [B, Tp, H, Kp] log-decay (≤ 0, ≥ the gate's lower bound; 0 at
      padding tokens); beta: [B, Tp, H]. Kp, Vp powers of two ≥ 16; Tp a multiple of C.
    masks: None, or (doc [B, Tp] int32 document index, m0 [B, Tp] fp32, mlast [B, Tp] fp32)
      as `xla._chunk_docs` defines them (not differentiated).
    C: chunk size (16, 32 or 64); scale: query scale; precision: of the score / W / U /
      gradient products (DEFAULT = TF32, HIGHEST = fp32); store: dtype of the outputs but d;
      interpret: Pallas interpret mode (CPU tests); num_warps, block_k: kernel tiling (warps
      per program; key and value channels per block, (forward, backward): the defaults spill
      least under pip Triton 3.9 for sm_90, benchmarks/triton_resources.py).

  Returns:
    W [BH, Tp, Kp], U [BH, Tp, Vp], Qg = scale Q ⊙ Γ [BH, Tp, Kp], A_qk [BH, N, C, C],
    Kdᵀ [BH, N, Kp, C] (all in `store`), d = e^(G_C) m0_C [BH, N, Kp] fp32; BH = B·H in
    b-major order, N = Tp / C.

  The gradient: `_bwd_kernel` (q, k, v in their dtypes, g and β fp32).

  Raises: nothing of its own (the caller, `chunk_kda_pallas_gpu`, checks shapes, dtypes and
  the gate bound). Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4.
  """
  return _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
                   block_k)


def _wy_fwd(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
            block_k):
  out = _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
                  block_k)
  return out, (q, k, v, g, beta, masks)


def _wy_bwd(C, scale, precision, store, interpret, num_warps, block_k, res, cts):
  del store
  q, k, v, g, beta, masks = res
  dq, dk, dv, dg, db = _bwd_call(q, k, v, g, beta, masks, cts, C, scale, precision, interpret,
                                 num_warps, block_k)
  dmasks = None if masks is None else tuple(
      jnp.zeros(m.shape, jax.dtypes.float0) if jnp.issubdtype(m.dtype, jnp.integer)
      else jnp.zeros_like(m) for m in masks)
  return dq, dk, dv, dg.astype(g.dtype), db.astype(beta.dtype), dmasks


intra_chunk_wy.defvjp(_wy_fwd, _wy_bwd)
