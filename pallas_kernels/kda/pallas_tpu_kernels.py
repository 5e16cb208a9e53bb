"""KDA TPU kernel bodies (Mosaic Pallas): the in-kernel chunk math, the forward kernel and the
backward kernel. The `pallas_call`s, the custom VJP and the public entry point are in
pallas_tpu.py, whose docstring gives the layout and the equations (ARCHITECTURE §2.4).

Each kernel instance handles one (batch·head, chunk) grid cell: [C, Kp] / [C, Vp] tiles of
q, k, v, g, the packed per-token rows (beta, document index, state-valid flag) and the fp32
transposed state Sᵀ [Vp, Kp] carried across chunks in VMEM scratch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.tiles import SUB

_HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- in-kernel math

def _dot(a, b):  # a @ b
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI,
                             preferred_element_type=jnp.float32)


def _dot_nt(a, b):  # a @ bᵀ
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                             preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # aᵀ @ b
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                             preferred_element_type=jnp.float32)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, i):
  """Row i of x as [1, n] (masked sublane reduction: no unaligned single-row slicing)."""
  return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _range_sum(g, lo_excl, hi_incl):
  """Σ_{lo_excl[i] < m ≤ hi_incl[i]} g_m per row i, as a matmul with a 0/±1 matrix.

  Every exponent is such a direct sum of g over a token range, never a difference of two
  cumulative sums: that difference loses ~|G|·eps nats when a large-magnitude gate (unbounded
  form, g in the hundreds) precedes both ends.
  """
  m = _iota((lo_excl.shape[0], g.shape[0]), 1)
  return _dot(((m > lo_excl) & (m <= hi_incl)).astype(jnp.float32), g)


def _pair_strip_operands(g, lo, dense):
  """Exponent factors for query sub-block rows [lo, lo + SUB): (e^(G_i − r), e^(r − G_j) masked).

  r = G_lo. The query side is e^(Σ_{lo<m≤i} g_m) ≤ 1. The key side covers every row j of the
  chunk: j < lo: e^(Σ_{j<m≤lo} g_m) ≤ 1; the diagonal tile rows (dense only):
  e^(−Σ_{lo<m≤j} g_m) ≥ 1; zero elsewhere, the exponent clamped to 0 before exp where masked.
  """
  C = g.shape[0]
  i = _iota((SUB, 1), 0) + lo
  fq = jnp.exp(_range_sum(g, jnp.full((SUB, 1), lo), i))
  j = _iota((C, 1), 0)
  keep = j < (lo + SUB if dense else lo)
  ek = _range_sum(g, j, jnp.full((C, 1), lo))                          # j < lo
  if dense:
    ek = ek - _range_sum(g, jnp.full((C, 1), lo), jnp.where(j < lo + SUB, j, lo))
  fk = jnp.where(keep, jnp.exp(jnp.where(keep, ek, 0.0)), 0.0)
  return fq, fk


def _diag_tile_factor(gt, jj):
  """Safe path: e^(G_i − G_jj) = e^(Σ_{jj<m≤i} g_m) for rows i ≥ jj of a diagonal tile, 0 above."""
  i = _iota((SUB, 1), 0)
  causal = i >= jj
  E = _range_sum(gt, jnp.full((SUB, 1), jj), i)
  return jnp.where(causal, jnp.exp(jnp.where(causal, E, 0.0)), 0.0)


def _pair_scores(a_list, b, g, dense):
  """P_n[i, j] = Σ_d a_n[i, d] b[j, d] e^(G_id − G_jd) for j ≤ i (zero for j > i).

  Args:
    a_list: query-side operands, each [C, Kp] fp32; b: [C, Kp]; g: [C, Kp] fp32 log-decay
      (G is its in-chunk cumsum).
    dense: diagonal tiles by the split matmul (bounded gate) or element-wise (safe).

  Returns:
    list of [C, C] fp32, one per a_n (entries j > i are zero; callers apply their own masks).
  """
  C = g.shape[0]
  lane = _iota((SUB, C), 1)
  strips = [[] for _ in a_list]
  for lo in range(0, C, SUB):
    fq, fk = _pair_strip_operands(g, lo, dense)
    kb = b * fk
    for n, a in enumerate(a_list):
      strips[n].append(_dot_nt(a[lo:lo + SUB] * fq, kb))
    if not dense:
      gt, bt = g[lo:lo + SUB], b[lo:lo + SUB]
      ats = [a[lo:lo + SUB] for a in a_list]

      def column(jj, acc, gt=gt, bt=bt, ats=ats, lo=lo):
        w = _diag_tile_factor(gt, jj) * _row(bt, jj)
        return tuple(jnp.where(lane == lo + jj, jnp.sum(at * w, axis=1, keepdims=True), s)
                     for at, s in zip(ats, acc))

      acc = jax.lax.fori_loop(0, SUB, column, tuple(s[-1] for s in strips))
      for n in range(len(a_list)):
        strips[n][-1] = acc[n]
  causal = _iota((C, C), 1) <= _iota((C, C), 0)
  return [jnp.where(causal, jnp.concatenate(s, axis=0), 0.0) for s in strips]


def _pair_scores_bwd(a, b, g, dP, dense):
  """Vjp of P = _pair_scores([a], b, G)[0] given dP [C, C] (zero where P is masked).

  Returns (da, db), each [C, Kp] fp32; the gradient w.r.t. G is a ⊙ da − b ⊙ db.
  """
  C = g.shape[0]
  lane = _iota((SUB, C), 1)
  da_strips, db_diag = [], []
  db = jnp.zeros(b.shape, jnp.float32)
  for lo in range(0, C, SUB):
    fq, fk = _pair_strip_operands(g, lo, dense)
    dPs = dP[lo:lo + SUB]
    da_s = _dot(dPs, b * fk) * fq
    db = db + _dot_tn(dPs, a[lo:lo + SUB] * fq) * fk
    if not dense:
      gt, at, bt = g[lo:lo + SUB], a[lo:lo + SUB], b[lo:lo + SUB]
      rows = _iota((SUB, 1), 0)

      def column(jj, acc, gt=gt, at=at, bt=bt, dPs=dPs, lo=lo):
        da_s, db_t = acc
        w = _diag_tile_factor(gt, jj)
        c = jnp.sum(jnp.where(lane == lo + jj, dPs, 0.0), axis=1, keepdims=True)  # [SUB, 1]
        da_s = da_s + c * _row(bt, jj) * w
        db_t = jnp.where(rows == jj, jnp.sum(c * at * w, axis=0, keepdims=True), db_t)
        return da_s, db_t

      da_s, db_t = jax.lax.fori_loop(0, SUB, column,
                                     (da_s, jnp.zeros(bt.shape, jnp.float32)))
      db_diag.append(db_t)
    da_strips.append(da_s)
  da = jnp.concatenate(da_strips, axis=0)
  if not dense:
    db = db + jnp.concatenate(db_diag, axis=0)
  return da, db


def _eye(n):
  return (_iota((n, n), 0) == _iota((n, n), 1)).astype(jnp.float32)


def _cumsum(g):
  """Inclusive cumsum over the chunk's rows as a matmul with a lower-triangular ones matrix."""
  C = g.shape[0]
  return _dot((_iota((C, C), 1) <= _iota((C, C), 0)).astype(jnp.float32), g)


def _unit_lower_inverse(A):
  """(I + A)^(−1) for strictly lower-triangular A [C, C] (C a power of two), by block recursion.

  The diagonal blocks of a triangular matrix's inverse are the inverses of its diagonal blocks,
  so with M_s the inverse's block-diagonal part of block size s (M_1 = I):
      M_2s = M_s − M_s (A ∘ B_s) M_s,
  B_s selecting the entries of A inside a 2s-block and outside every s-block (block row 2 of
  [[X, 0], [Y, Z]]⁻¹ is −Z⁻¹ Y X⁻¹). Two matmuls per level, as many as the doubling product
  (I − A)(I + A²)(I + A⁴)… that this replaces, but every intermediate is a block of the true
  inverse: with correlated keys and a near-zero gate the powers of A grow large and cancel in
  fp32 (relative error 4e-3 at key cosine 0.6, C = 64), while this stays at the row-serial
  solve's accuracy (`xla._unit_lower_inverse`). Every factor is lower-triangular with exact
  zeros above the diagonal, so row i only combines rows ≤ i (causal bit for bit)."""
  C = A.shape[0]
  x = _iota((C, C), 0) ^ _iota((C, C), 1)  # < 2s: one 2s-block; >= s: two s-blocks
  M = (x == 0).astype(jnp.float32) - jnp.where(x == 1, A, 0.0)  # M_2 (A is zero above)
  s = 2
  while s < C:
    M = M - _dot(M, _dot(jnp.where((x >= s) & (x < 2 * s), A, 0.0), M))
    s *= 2
  return M


class _Chunk:
  """Forward quantities of one chunk (module docstring equations), shared by the forward and
  backward kernels: q, k, v, g [C, Kp|Vp] fp32, tok [8, C] fp32 rows, ST = Sᵀ [Vp, Kp] fp32."""

  def __init__(self, q, k, v, g, tok, ST, scale, dense):
    C = q.shape[0]
    G = _cumsum(g)
    self.q, self.k, self.v, self.g, self.G = q, k, v, g, G
    # tok rows: β, document index, state-valid flag. Columns via an identity matmul (exact).
    cols = _dot_nt(_eye(C), tok)                                        # [C, 8]
    self.beta, doc, self.sv = cols[:, 0:1], cols[:, 1:2], cols[:, 2:3]
    same = doc == _row(tok, 1)                                          # [C, C]
    tri = _iota((C, C), 1) < _iota((C, C), 0)
    self.mask_qk = same & (tri | (_iota((C, C), 1) == _iota((C, C), 0)))
    self.mask_kk = same & tri
    Pqk, Pkk = _pair_scores([q, k], k, g, dense)
    self.Pkk = jnp.where(self.mask_kk, Pkk, 0.0)
    self.A_qk = jnp.where(self.mask_qk, scale * Pqk, 0.0)
    A_kk = self.beta * self.Pkk
    self.X = _unit_lower_inverse(A_kk)
    self.Gam = jnp.exp(G)
    self.Kg = k * self.Gam
    self.U = _dot(self.X, self.beta * v)
    self.W = _dot(self.X, self.beta * self.Kg)
    self.Vn = self.U - self.sv * _dot_nt(self.W, ST)                   # V' [C, Vp]
    self.Qg = q * self.Gam
    self.G_L = _row(G, C - 1)                                           # [1, Kp]
    self.sv_L = _row(self.sv, C - 1)                                    # [1, 1]
    self.m_L = doc == _row(doc, C - 1)                                  # [C, 1]
    j = _iota((C, 1), 0)
    self.eL = jnp.exp(_range_sum(g, j, jnp.full((C, 1), C - 1)))       # e^(G_C − G_j) ≤ 1
    self.Kd = jnp.where(self.m_L, k * self.eL, 0.0)

  def output(self, ST, scale):
    """O = scale m0 ⊙ ((Q ⊙ Γ) S) + A_qk V'  [C, Vp] fp32."""
    return scale * self.sv * _dot_nt(self.Qg, ST) + _dot(self.A_qk, self.Vn)

  def next_state(self, ST):
    """S'ᵀ = m0_C Sᵀ ⊙ e^(G_C) + V'ᵀ (K ⊙ e^(G_C − G) ⊙ m_C)  [Vp, Kp] fp32."""
    return self.sv_L * ST * jnp.exp(self.G_L) + _dot_tn(self.Vn, self.Kd)


# ----------------------------------------------------------------------------- kernels

def fwd_kernel(q_ref, k_ref, v_ref, g_ref, tok_ref, h0_ref, *rest, scale, dense,
                save_states, num_poison):
  rest = rest[num_poison:]
  if save_states:
    o_ref, hT_ref, states_ref, S_scr = rest
  else:
    o_ref, hT_ref, S_scr = rest
  c = pl.program_id(1)

  @pl.when(c == 0)
  def _():
    S_scr[...] = h0_ref[...].astype(jnp.float32)

  ST = S_scr[...]
  if save_states:
    states_ref[...] = ST
  f32 = lambda r: r[...].astype(jnp.float32)
  ch = _Chunk(f32(q_ref), f32(k_ref), f32(v_ref), f32(g_ref), tok_ref[...], ST,
              scale, dense)
  o_ref[...] = ch.output(ST, scale).astype(o_ref.dtype)
  ST = ch.next_state(ST)
  S_scr[...] = ST

  @pl.when(c == pl.num_programs(1) - 1)
  def _():
    hT_ref[...] = ST


def bwd_kernel(q_ref, k_ref, v_ref, g_ref, tok_ref, states_ref, do_ref, dhT_ref,
                *rest, scale, dense, num_poison):
  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, dS_scr = rest[num_poison:]
  c = pl.program_id(1)

  @pl.when(c == 0)
  def _():
    dS_scr[...] = dhT_ref[...]

  ST, dST = states_ref[...], dS_scr[...]
  f32 = lambda r: r[...].astype(jnp.float32)
  q, k, v, g = f32(q_ref), f32(k_ref), f32(v_ref), f32(g_ref)
  ch = _Chunk(q, k, v, g, tok_ref[...], ST, scale, dense)
  dO = f32(do_ref)
  C = q.shape[0]
  beta, sv = ch.beta, ch.sv

  # S' = sv_C e^(G_C) ⊙ S + Kdᵀ V'.
  eGL = jnp.exp(ch.G_L)
  dST_in = ch.sv_L * dST * eGL
  dG_L = ch.sv_L * jnp.sum(ST * eGL * dST, axis=0, keepdims=True)
  dKd = _dot(ch.Vn, dST)
  dVn = _dot_nt(ch.Kd, dST)
  t = dKd * ch.Kd
  dG_L = dG_L + jnp.sum(t, axis=0, keepdims=True)
  dG = -t
  dk = jnp.where(ch.m_L, dKd * ch.eL, 0.0)
  # O = scale sv ⊙ (Qg S) + A_qk V'.
  dA_qk = jnp.where(ch.mask_qk, _dot_nt(dO, ch.Vn), 0.0)
  dVn = dVn + _dot_tn(ch.A_qk, dO)
  sv_dO = sv * dO
  dQg = scale * _dot(sv_dO, ST)
  dST_in = dST_in + scale * _dot_tn(sv_dO, ch.Qg)
  dq = dQg * ch.Gam
  dG = dG + dQg * ch.Qg
  # V' = U − sv ⊙ (W S).
  sv_dVn = sv * dVn
  dW = -_dot(sv_dVn, ST)
  dST_in = dST_in - _dot_tn(sv_dVn, ch.W)
  # U = X (β V), W = X (β Kg).
  bv = beta * v
  bK = beta * ch.Kg
  dX = _dot_nt(dVn, bv) + _dot_nt(dW, bK)
  dbv = _dot_tn(ch.X, dVn)
  dbK = _dot_tn(ch.X, dW)
  dv = beta * dbv
  dbeta = jnp.sum(v * dbv, axis=1, keepdims=True) + jnp.sum(ch.Kg * dbK, axis=1, keepdims=True)
  dKg = beta * dbK
  dk = dk + dKg * ch.Gam
  dG = dG + dKg * ch.Kg
  # X = (I + A_kk)^(−1): dA = −Xᵀ dX Xᵀ on A's support.
  dA = jnp.where(ch.mask_kk, -_dot_nt(_dot_tn(ch.X, dX), ch.X), 0.0)
  dbeta = dbeta + jnp.sum(dA * ch.Pkk, axis=1, keepdims=True)
  # Pairwise scores: A_qk = scale P(q, k), A_kk = β P(k, k).
  da, db = _pair_scores_bwd(q, k, g, scale * dA_qk, dense)
  dq = dq + da
  dk = dk + db
  dG = dG + q * da - k * db
  da, db = _pair_scores_bwd(k, k, g, beta * dA, dense)
  dk = dk + da + db
  dG = dG + k * (da - db)
  dG = dG + jnp.where(_iota((C, 1), 0) == C - 1, dG_L, 0.0)

  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  # G = L g (L lower-triangular ones) => dg = Lᵀ dG, the reverse cumsum within the chunk.
  tril = (_iota((C, C), 1) <= _iota((C, C), 0)).astype(jnp.float32)
  dg_ref[...] = _dot_tn(tril, dG).astype(dg_ref.dtype)
  # Back to the row layout of tok: row 0 = dβ, the other rows (non-differentiable) zero.
  dbeta_ref[...] = _dot_tn(jnp.where(_iota((C, 8), 1) == 0, dbeta, 0.0), _eye(C))
  dS_scr[...] = dST_in

  @pl.when(c == pl.num_programs(1) - 1)
  def _():
    dh0_ref[...] = dST_in
