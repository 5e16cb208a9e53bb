"""KDA on NVIDIA GPUs: the intra-chunk work of one chunk as one fused Pallas kernel (Triton
lowering), forward and backward, for the lower-bounded gate ("dense" diagonal tiles).

Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4. Every equation is the one of
`xla._intra_chunk` (its docstring and `xla._pairwise_scores`'); this module computes the same
outputs per chunk with everything on chip, instead of XLA fusions that write fp32
intermediates to HBM and an autodiff backward that reads them back (the bound of the earlier
design: docs/benchmarks.md, "The pallas_gpu backend").

One program per chunk (grid = the B·H·N chunks). The chunk's C tokens are n = C/16 sub-tiles
of SUB = 16 rows (the kernel reads its inputs a sub-tile at a time; Triton cannot slice a
value). With G the in-chunk cumulative log-decay and r_a = G at the first row s_a of tile a:

    Pf_a   = Σ_{s_a<m≤i} g_m              (row i of tile a; direct sums, ≤ 0)
    qt_a   = q_a e^(Pf_a),  kt_a = k_a e^(Pf_a)                       (query-side operands)
    kneg_a = k_a e^(−Pf_a)                (diagonal key operand: ≤ e^(15|g_min|), the bound)
    kk_ba  = k_b e^(E_ba),  E_ba = Σ_{j<m≤s_a} g_m = tail_b + Σ_{b<c<a} tot_c + g_{s_a}  (b < a)
    Sq_ab  = qt_a kk_baᵀ (b < a),  Sq_aa = lower(qt_a kneg_aᵀ);  Sk likewise with kt
    A_qk   = scale · Sq ⊙ same,   A = strict(Sk) ⊙ β_i ⊙ same
    X      = (I + A)⁻¹: X_aa by forward substitution (row r = e_r − A[r, :] X), then
             X_ab = −X_aa Σ_{b≤c<a} A_ac X_cb
    T      = X diag(β),  W = T (K ⊙ Γ),  U = T V,  Qg = scale · Q ⊙ Γ,  Γ = e^G ⊙ m0
    Kd     = (K ⊙ e^(Σ_{j<m<C} g_m) ⊙ m_C)ᵀ,  d = e^(G_C) · m0_C

Status (measured on an H200, 2026-12-01, docs/benchmarks.md): correct (the XLA path's outputs
and gradients to 1e-5 at T = 32K, H = 16, K = V = 128, bf16 inputs) but slower: forward kernel
6.7 ms, backward kernel 45.7 ms, against about 13.6 ms for the XLA intra-chunk forward and
backward it replaces (the whole operator 61.0 against 20.6 ms; the 7.0 ms of other kernels are
shared by both paths). So `chunk_kda_pallas_gpu(fused=False)` is
the default; this is the per-chunk formulation (recompute policy, tile-wise chain rule) that a
faster kernel (Mosaic GPU, larger MMA tiles) can follow, with tests.

The 0/1 sums (Pf, G, tails) and the inverse run at HIGHEST (exact products, fp32 sums: row i
reads no later row, so outputs are causal bit for bit); the score, W and U matmuls at the
caller's precision. The backward kernel recomputes all of the above for its chunk (nothing but
the inputs is stored) and applies the chain rule tile by tile (`_bwd_kernel`'s docstring).

Masks for packed documents (`xla._chunk_docs`): the document index of every token (same
document = equal index), m0 and m_C, passed as fp32 vectors [M, C]; without segments the
kernels skip them.
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


def _idx():
  return jnp.arange(SUB, dtype=jnp.int32)[:, None], jnp.arange(SUB, dtype=jnp.int32)[None, :]


def _ones_where(cond):
  return jnp.where(cond, 1.0, 0.0).astype(f32)


def _rows(a):
  return pl.ds(a * SUB, SUB)


def _load(ref, a):
  return ref[_rows(a), :].astype(f32)


def _inv_unit_lower(A):
  """(I + A)⁻¹ of a strictly lower-triangular [SUB, SUB] fp32 tile, forward substitution in
  registers: row r = e_r − A[r, :] X (rows ≥ r of X are still identity rows, times A's exact
  zeros). Row r reads rows ≤ r of A only."""
  i, j = _idx()
  X = _ones_where(i == j)
  for r in range(1, SUB):
    a_r = jnp.sum(jnp.where(i == r, A, 0.0), axis=0)  # row r of A, [SUB]
    row = jnp.sum(a_r[:, None] * X, axis=0)  # A[r, :] X
    X = jnp.where(i == r, _ones_where(j == r) - row[None, :], X)
  return X


class _Chunk:
  """One chunk's inputs and the cheap per-tile quantities, recomputed where used: the kernels
  hold the [SUB, SUB] tiles (scores, A, X and their adjoints) and [K] vectors (tile totals of
  g) for the whole chunk, but a [SUB, K] tile only while it is used. (A first version that
  kept every [SUB, K] tile of the chunk for the whole kernel took 87.6 ms fwd+bwd against this
  one's 61.0 at T = 32K, H = 16, K = V = 128 on an H200.)"""

  def __init__(self, q_ref, k_ref, g_ref, b_ref, doc_ref, m0_ref, mlast_ref, n, C):
    self.q_ref, self.k_ref, self.g_ref = q_ref, k_ref, g_ref
    self.m0_ref, self.mlast_ref, self.n, self.C = m0_ref, mlast_ref, n, C
    i, j = _idx()
    self.E1 = _ones_where((j > 0) & (j <= i))  # Σ_{s_a<m≤i}
    self.Lin = _ones_where(j <= i)  # Σ_{s_a≤m≤i}
    self.Eup = _ones_where(j > i)  # Σ_{i<m≤e_a}
    # their transposes, which map adjoints back to g (the backward kernel)
    self.E1t = _ones_where((i > 0) & (i <= j))
    self.Lint = _ones_where(i <= j)
    self.Eupt = _ones_where(i > j)
    self.beta = [b_ref[_rows(a)].astype(f32) for a in range(n)]
    self.doc = [None if doc_ref is None else doc_ref[_rows(a)] for a in range(n)]
    self.tot = [jnp.sum(_load(g_ref, a), axis=0) for a in range(n)]
    Kp = q_ref.shape[-1]
    self.g0 = [g_ref[pl.ds(a * SUB, 1), :].astype(f32).reshape(Kp) for a in range(n)]
    run = jnp.zeros_like(self.tot[0])
    self.Gpre = []
    for a in range(n):
      self.Gpre.append(run)
      run = run + self.tot[a]
    self.Gtot = run

  def same(self, a, b):
    if self.doc[a] is None:
      return None
    return self.doc[a][:, None] == self.doc[b][None, :]

  def B(self, a, b):
    """Σ_{e_b<m≤s_a} g_m [K], b < a (≤ 0)."""
    s = self.g0[a]
    for c in range(b + 1, a):
      s = s + self.tot[c]
    return s

  def query_side(self, a, with_q=True):
    """(Pf, e^Pf, q, k, qt, kt, kneg) of tile a."""
    g = _load(self.g_ref, a)
    k = _load(self.k_ref, a)
    Pf = _dot(self.E1, g, HI)
    ePf = jnp.exp(Pf)
    q = _load(self.q_ref, a) if with_q else None
    return Pf, ePf, q, k, (q * ePf if with_q else None), k * ePf, k * jnp.exp(-Pf)

  def key_side(self, b):
    """(k_b, e^tail_b, ko_b = k_b e^tail_b), tail_b = Σ_{j<m≤e_b} g_m."""
    k = _load(self.k_ref, b)
    et = jnp.exp(_dot(self.Eup, _load(self.g_ref, b), HI))
    return k, et, k * et

  def gamma(self, a):
    """Γ_a = e^G ⊙ m0 [SUB, K], G = Σ_{c<a} tot_c + Σ_{s_a≤m≤i} g_m."""
    G = self.Gpre[a][None, :] + _dot(self.Lin, _load(self.g_ref, a), HI)
    gam = jnp.exp(G)
    if self.m0_ref is not None:
      gam = gam * self.m0_ref[_rows(a)][:, None]
    return gam

  def kd_factor(self, a, et):
    """e^(Σ_{j<m<C} g_m) ⊙ m_C for tile a, from its e^tail."""
    after = jnp.zeros_like(self.Gtot)
    for c in range(a + 1, self.n):
      after = after + self.tot[c]
    do = et * jnp.exp(after)[None, :]
    if self.mlast_ref is not None:
      do = do * self.mlast_ref[_rows(a)][:, None]
    return do

  def dec(self):
    d = jnp.exp(self.Gtot)
    if self.m0_ref is not None:
      d = d * self.m0_ref[pl.ds(self.C - 1, 1)]
    return d

  def scores(self, precision, aqk_ref=None, scale=1.0):
    """Sk blocks (b ≤ a; masked, unscaled) and, with aqk_ref, A_qk written tile by tile."""
    i, j = _idx()
    n, Sk = self.n, {}
    for a in range(n):
      _, _, _, _, qt, kt, kneg = self.query_side(a, with_q=aqk_ref is not None)
      keep = j <= i
      same = self.same(a, a)
      if same is not None:
        keep = keep & same
      Sk[a, a] = jnp.where(keep, _dot(kt, kneg, precision, tb=True), 0.0)
      if aqk_ref is not None:
        aqk_ref[_rows(a), _rows(a)] = jnp.where(keep, _dot(qt, kneg, precision, tb=True) * scale,
                                                0.0)
        for b in range(a + 1, n):
          aqk_ref[_rows(a), _rows(b)] = jnp.zeros((SUB, SUB), f32)
      for b in range(a):
        kk = self.key_side(b)[2] * jnp.exp(self.B(a, b))[None, :]
        sk = _dot(kt, kk, precision, tb=True)
        same = self.same(a, b)
        Sk[a, b] = sk if same is None else jnp.where(same, sk, 0.0)
        if aqk_ref is not None:
          sq = _dot(qt, kk, precision, tb=True) * scale
          aqk_ref[_rows(a), _rows(b)] = sq if same is None else jnp.where(same, sq, 0.0)
    return Sk

  def inverse(self, Sk):
    """A = strict(Sk) ⊙ β_i and X = (I + A)⁻¹ as dicts of [SUB, SUB] blocks (b ≤ a)."""
    i, j = _idx()
    A, X = {}, {}
    for a in range(self.n):
      for b in range(a + 1):
        s = jnp.where(j < i, Sk[a, a], 0.0) if a == b else Sk[a, b]
        A[a, b] = s * self.beta[a][:, None]
    for a in range(self.n):
      X[a, a] = _inv_unit_lower(A[a, a])
      for b in range(a):
        acc = _dot(A[a, b], X[b, b], HI)
        for c in range(b + 1, a):
          acc = acc + _dot(A[a, c], X[c, b], HI)
        X[a, b] = -_dot(X[a, a], acc, HI)
    return A, X


def _split_refs(refs, segments):
  """(the 8 input refs, None for absent masks; the rest)."""
  refs = list(refs)
  ins = refs[:8] if segments else refs[:5] + [None, None, None]
  rest = refs[8:] if segments else refs[5:]
  return ins, rest


def _fwd_kernel(*refs, n, C, scale, precision, segments):
  ins, outs = _split_refs(refs, segments)
  q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, m0_ref, mlast_ref = ins
  w_ref, u_ref, qg_ref, aqk_ref, kd_ref, dec_ref = outs
  ch = _Chunk(q_ref, k_ref, g_ref, b_ref, doc_ref, m0_ref, mlast_ref, n, C)
  Sk = ch.scores(precision, aqk_ref, scale)
  _, X = ch.inverse(Sk)
  for a in range(n):
    w = u = None
    for b in range(a + 1):
      T = X[a, b] * ch.beta[b][None, :]
      kg = _load(k_ref, b) * ch.gamma(b)
      wb, ub = _dot(T, kg, precision), _dot(T, _load(v_ref, b), precision)
      w, u = (wb, ub) if w is None else (w + wb, u + ub)
    w_ref[_rows(a), :] = w
    u_ref[_rows(a), :] = u
  for a in range(n):
    k, et, _ = ch.key_side(a)
    qg_ref[_rows(a), :] = _load(q_ref, a) * ch.gamma(a) * scale
    kd_ref[:, _rows(a)] = (k * ch.kd_factor(a, et)).T
  dec_ref[...] = ch.dec()


def _bwd_kernel(*refs, n, C, scale, precision, segments):
  """The chain rule of the forward, on recomputed values, in phases that hold only small tiles
  across phases:

  1. Sk, A, X ([SUB, SUB] blocks), as in the forward.
  2. dT_ab = dW_a (K⊙Γ)_bᵀ + dU_a V_bᵀ (b ≤ a), dX = dT diag(β) (lower), ∂β from T; the
     inverse's adjoint dA = −Xᵀ dX Xᵀ (P_ad = Σ_{b≤d} dX_ab X_dbᵀ, dA_cd = −Σ_{a≥c} X_acᵀ P_ad),
     ∂β from A, dSk = dA ⊙ β_i, dSq = scale · dA_qk (masked).
  3. The Kd factor's adjoint on the tile totals (a [K] vector per tile) and d's.
  4. Tiles in reverse order x = n−1 … 0, each finishing its own gradients: dq, dk, dv, dg.
     The key-side adjoint of pair (x, b < x) is carried to tile b as Y_b = Σ_x dkk_xb ⊙ e^(B_xb)
     (one [SUB, K] accumulator per earlier tile); everything a tile's dg needs from later tiles
     (their pairs' and Γ's adjoints on the totals) is complete when it is reached.
  dg = E1ᵀ dPf + Linᵀ dG_in + Eupᵀ dtail + dtot (broadcast) + the g_{s_x} row.
  """
  ins, outs = _split_refs(refs, segments)
  q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, m0_ref, mlast_ref = ins
  dw_ref, du_ref, dqg_ref, daqk_ref, dkd_ref, ddec_ref = outs[:6]
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref = outs[6:]
  i, j = _idx()
  ch = _Chunk(q_ref, k_ref, g_ref, b_ref, doc_ref, m0_ref, mlast_ref, n, C)
  Sk = ch.scores(precision)
  _, X = ch.inverse(Sk)
  beta = ch.beta
  zvec = jnp.zeros_like(ch.tot[0])
  db = [jnp.zeros((SUB,), f32)] * n
  # 2. dT, dX, the inverse's adjoint, dSk, dSq
  dX = {}
  for b in range(n):
    kg = _load(k_ref, b) * ch.gamma(b)
    v = _load(v_ref, b)
    for a in range(b, n):
      dT = (_dot(_load(dw_ref, a), kg, precision, tb=True)
            + _dot(_load(du_ref, a), v, precision, tb=True))
      if a == b:
        dT = jnp.where(j <= i, dT, 0.0)
      dX[a, b] = dT * beta[b][None, :]
      db[b] = db[b] + jnp.sum(dT * X[a, b], axis=0)
  P = {}
  for a in range(n):
    for d in range(a + 1):
      acc = _dot(dX[a, 0], X[d, 0], HI, tb=True)
      for b in range(1, d + 1):
        acc = acc + _dot(dX[a, b], X[d, b], HI, tb=True)
      P[a, d] = acc
  dSk, dSq = {}, {}
  for c in range(n):
    for d in range(c + 1):
      acc = _dot(X[c, c], P[c, d], HI, ta=True)
      for a in range(c + 1, n):
        acc = acc + _dot(X[a, c], P[a, d], HI, ta=True)
      same = ch.same(c, d)
      keep_k = (j < i) if c == d else None
      keep_q = (j <= i) if c == d else None
      if same is not None:
        keep_k = same if keep_k is None else keep_k & same
        keep_q = same if keep_q is None else keep_q & same
      dA = -acc if keep_k is None else jnp.where(keep_k, -acc, 0.0)
      s = jnp.where(j < i, Sk[c, c], 0.0) if c == d else Sk[c, d]
      db[c] = db[c] + jnp.sum(dA * s, axis=1)
      dSk[c, d] = dA * beta[c][:, None]
      dsq = daqk_ref[_rows(c), _rows(d)] * scale
      dSq[c, d] = dsq if keep_q is None else jnp.where(keep_q, dsq, 0.0)
  # 3. the totals' adjoints of Kd's factor (tiles after b) and of d
  dtot = [ch.dec() * ddec_ref[...] for _ in range(n)]
  for b in range(n - 1):
    k, et, _ = ch.key_side(b)
    s = jnp.sum(dkd_ref[:, _rows(b)].T * k * ch.kd_factor(b, et), axis=0)
    for c in range(b + 1, n):
      dtot[c] = dtot[c] + s
  # 4. tiles in reverse order
  Y = [None] * n
  for x in reversed(range(n)):
    Pf, ePf, q, k, qt, kt, kneg = ch.query_side(x)
    gam = ch.gamma(x)
    kg = k * gam
    dkg = dv = None
    for a in range(x, n):
      T = X[a, x] * beta[x][None, :]
      y1 = _dot(T, _load(dw_ref, a), precision, ta=True)
      y2 = _dot(T, _load(du_ref, a), precision, ta=True)
      dkg, dv = (y1, y2) if dkg is None else (dkg + y1, dv + y2)
    dv_ref[_rows(x), :] = dv
    dqg = _load(dqg_ref, x)
    dq = dqg * gam * scale
    dG = dqg * q * gam * scale + dkg * kg
    dk = dkg * gam
    dqt = _dot(dSq[x, x], kneg, precision)
    dkt = _dot(dSk[x, x], kneg, precision)
    dkneg = _dot(dSq[x, x], qt, precision, ta=True) + _dot(dSk[x, x], kt, precision, ta=True)
    dg0 = zvec
    for b in range(x):
      eB = jnp.exp(ch.B(x, b))[None, :]
      kk = ch.key_side(b)[2] * eB
      dqt = dqt + _dot(dSq[x, b], kk, precision)
      dkt = dkt + _dot(dSk[x, b], kk, precision)
      dkk = _dot(dSq[x, b], qt, precision, ta=True) + _dot(dSk[x, b], kt, precision, ta=True)
      Y[b] = dkk * eB if Y[b] is None else Y[b] + dkk * eB
      dB = jnp.sum(dkk * kk, axis=0)
      for c in range(b + 1, x):
        dtot[c] = dtot[c] + dB
      dg0 = dg0 + dB
    dq_ref[_rows(x), :] = dq + dqt * ePf
    dk = dk + dkt * ePf + dkneg * jnp.exp(-Pf)
    dPf = dqt * qt + dkt * kt - dkneg * kneg
    _, et, _ = ch.key_side(x)
    dkdt = dkd_ref[:, _rows(x)].T * ch.kd_factor(x, et)  # ∂/∂k of Kd, ⊙ its factor
    dk = dk + dkdt
    dtail = dkdt * k
    if Y[x] is not None:
      z = Y[x] * et
      dk = dk + z
      dtail = dtail + z * k
    dk_ref[_rows(x), :] = dk
    s = jnp.sum(dG, axis=0)
    for c in range(x):
      dtot[c] = dtot[c] + s
    dg = (_dot(ch.E1t, dPf, HI) + _dot(ch.Lint, dG, HI) + _dot(ch.Eupt, dtail, HI)
          + dtot[x][None, :] + jnp.where(i == 0, dg0[None, :], 0.0))
    dg_ref[_rows(x), :] = dg
    db_ref[_rows(x)] = db[x]


# Triton warps per program. 8 compiled to wrong gradients (relative error 0.17 in dq at T = 32K,
# H = 16, K = V = 128 on an H200, jax 0.11.2; 4 matched the XLA path to 1e-5): keep 4.
NUM_WARPS = 4


def _params(interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _specs(C, Kp, Vp, segments):
  row_k = pl.BlockSpec((None, C, Kp), lambda m: (m, 0, 0))
  row_v = pl.BlockSpec((None, C, Vp), lambda m: (m, 0, 0))
  vec = pl.BlockSpec((None, C), lambda m: (m, 0))
  ins = [row_k, row_k, row_v, row_k, vec] + ([vec] * 3 if segments else [])
  return row_k, row_v, vec, ins


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def intra_chunk(q, k, v, g, beta, doc, m0, mlast, scale, precision, interpret):
  """The intra-chunk outputs of `xla._intra_chunk` (diag="dense") from one fused kernel.

  Args:
    q, k, g [M, C, Kp], v [M, C, Vp], beta [M, C]: fp32 chunks (C ∈ {16, 32, 64}; Kp, Vp powers
      of two ≥ 16). doc, m0, mlast [M, C] fp32 (document id, "reached by the incoming state",
      "in the chunk's last document") or all None (no segments).
    scale: query scale; precision: of the score, W and U matmuls (the 0/1 sums and the inverse
      are HIGHEST); interpret: Pallas interpret mode.

  Returns:
    (W [M, C, Kp], U [M, C, Vp], Qg [M, C, Kp], A_qk [M, C, C], Kd [M, Kp, C], d [M, Kp]),
    fp32. Differentiable in q, k, v, g, beta (custom VJP: one fused backward kernel).

  Raises: nothing of its own (the caller, `chunk_kda_pallas_gpu`, checks chunk size and pads
  K, V to powers of two; Triton rejects other block shapes when lowering).
  Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4; the module docstring.
  """
  return _fwd(q, k, v, g, beta, doc, m0, mlast, scale, precision, interpret)


def _fwd(q, k, v, g, beta, doc, m0, mlast, scale, precision, interpret):
  M, C, Kp = q.shape
  Vp = v.shape[-1]
  segments = doc is not None
  row_k, row_v, _, ins = _specs(C, Kp, Vp, segments)
  out_shape = [jax.ShapeDtypeStruct((M, C, Kp), f32), jax.ShapeDtypeStruct((M, C, Vp), f32),
               jax.ShapeDtypeStruct((M, C, Kp), f32), jax.ShapeDtypeStruct((M, C, C), f32),
               jax.ShapeDtypeStruct((M, Kp, C), f32), jax.ShapeDtypeStruct((M, Kp), f32)]
  out_specs = [row_k, row_v, row_k, pl.BlockSpec((None, C, C), lambda m: (m, 0, 0)),
               pl.BlockSpec((None, Kp, C), lambda m: (m, 0, 0)),
               pl.BlockSpec((None, Kp), lambda m: (m, 0))]
  kernel = functools.partial(_fwd_kernel, n=C // SUB, C=C, scale=scale, precision=precision,
                             segments=segments)
  args = [q, k, v, g, beta] + ([doc, m0, mlast] if segments else [])
  return tuple(pl.pallas_call(
      kernel, grid=(M,), in_specs=ins, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(interpret), interpret=interpret,
      name="kda_intra_fwd")(*args))


def _intra_fwd(q, k, v, g, beta, doc, m0, mlast, scale, precision, interpret):
  out = _fwd(q, k, v, g, beta, doc, m0, mlast, scale, precision, interpret)
  return out, (q, k, v, g, beta, doc, m0, mlast)


def _intra_bwd(scale, precision, interpret, res, cts):
  q, k, v, g, beta, doc, m0, mlast = res
  M, C, Kp = q.shape
  Vp = v.shape[-1]
  segments = doc is not None
  row_k, row_v, vec, ins = _specs(C, Kp, Vp, segments)
  ins = ins + [row_k, row_v, row_k, pl.BlockSpec((None, C, C), lambda m: (m, 0, 0)),
               pl.BlockSpec((None, Kp, C), lambda m: (m, 0, 0)),
               pl.BlockSpec((None, Kp), lambda m: (m, 0))]
  out_shape = [jax.ShapeDtypeStruct(x.shape, f32) for x in (q, k, v, g, beta)]
  kernel = functools.partial(_bwd_kernel, n=C // SUB, C=C, scale=scale, precision=precision,
                             segments=segments)
  args = [q, k, v, g, beta] + ([doc, m0, mlast] if segments else [])
  args += [c.astype(f32) for c in cts]
  dq, dk, dv, dg, db = pl.pallas_call(
      kernel, grid=(M,), in_specs=ins, out_specs=[row_k, row_k, row_v, row_k, vec],
      out_shape=out_shape, compiler_params=_params(interpret), interpret=interpret,
      name="kda_intra_bwd")(*args)
  zeros = (None, None, None) if not segments else tuple(jnp.zeros_like(x) for x in (doc, m0, mlast))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          db.astype(beta.dtype)) + zeros


intra_chunk.defvjp(_intra_fwd, _intra_bwd)
