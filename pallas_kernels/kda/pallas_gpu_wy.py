"""KDA on NVIDIA GPUs: the intra-chunk work (scores, triangular inverse, WY form) as Pallas
kernels (Triton lowering), forward and a hand-written backward.

Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4 (the equations, exponent
safety). The same outputs as `xla._intra_chunk` (W, U, Q ⊙ Γ · scale, A_qk, Kdᵀ, the chunk
decay), for the lower-bounded gate ("dense" diagonal tiles) only; `pallas_gpu.py` calls it.

Four kernels, 4 warps each; the first runs as one call per 16-row query tile a (n = C / 16
calls, named `kda_wy_fwd_scores_t0` ... `_t{n-1}`, each writing its tile's rows; call a
reads the rows of X that the calls before it wrote). q, k, v, g, β are read in the caller's
[B, T, H, ·] layout (no transposes).

  forward  `kda_wy_fwd_scores`  grid B·H × N:       rows of tile a of S_k, A_qk (16 × 16 tile
                                                    products) and X = (I + β S_k)⁻¹ (call a)
           `kda_wy_fwd_wu`      grid B·H × N × nb:  W, Q ⊙ Γ, Kd, d of key block j; U of
                                                    value block j (reads X)
  backward `kda_wy_bwd_dx`      grid B·H × N:       dX, ∂A, ∂V, U's part of ∂β (reads X, S_k)
           `kda_wy_bwd_pair`    grid B·H × N × nk:  ∂q, ∂k, ∂g, the rest of ∂β of key block j,
                                                    by 16-row tiles

X and S_k (2 · C² fp32 per chunk) are the forward's residuals, so the backward does not
recompute the scores or the inverse. The split by channel block exists for occupancy (the
whole-chunk kernels of the twentieth session ran at one 8-warp block per SM); the scores and
the pairwise backward work on 16-row tiles read from the refs, because their earlier form
(n = C/16 masked whole-chunk products, [C, C] and [C, BK] fp32 values live together) used
255 registers and spilled 448 B / 2,752 B per thread (pip Triton, block 32) and took
0.92 / 1.68 ms of the 4.42 ms fwd+bwd at B=1, H=16, T=8K on an H200 (2026-12-05). The
scores run as one call per tile, with the inverse folded in, since 2026-12-06: on an H100 at
that shape the four calls took 0.55 ms where the whole-chunk scores program (247 registers)
and the inverse kernel (whole-chunk products, 255 registers and 224 B of stack) took
0.61 + 0.33 ms. The same split of the pairwise backward (one call per tile i, each with the
n + 1 blocks that meet tile i) was slower: 1.88 ms against 1.36 for one program per chunk,
and so was a split by side (2026-12-06: a query-side call, P and R, at 184 registers and no
stack, then a key-side call, Z and Xᵀ∂W, at 255 and 16 B, adding into the first's fp32 ∂k,
∂g through aliased outputs): the operator took 4.94 / 15.81 ms against 4.29 / 13.36 at
B=1, H=16 and B=8, H=8, T=8K on one H100, though the single call spills 88 B.

The math:

  * Pairwise scores on 16-token sub-tiles (query tile a, reference r_a = G at its first row
    s_a; `_TileGate`): with
        Lx_i  = Σ_{s_a<m≤i} g_m                  (a direct sum inside the tile, ≤ 0)
        QF_a  = e^(Lx) on the rows of tile a                                    (≤ 1)
        KF_ab = e^(r_a − G_j) on the rows of key tile b ≤ a: e^(−Lx_j) for b = a (≤
                e^(15|g_min|), the bound of the lower-bounded gate), e^((tp_b − Lx_j) +
                Σ_{b<c<a} tot_c + g_{s_a}) for b < a (≤ 1)
    block (a, b) of S_q is (q_a ⊙ QF_a)(k_b ⊙ KF_ab)ᵀ, summed over key-channel blocks, and
    S_k likewise with k on the query side; every exponent is a direct sum of g over a token
    range or a sum of such (tile totals tot_c, their part after the first row tp_c), never a
    difference of whole-chunk cumulative sums.
  * X = (I + A_kk)⁻¹ by forward substitution over 16-row tiles (`_x_rows`): the diagonal
    block X[a, a] = (I + A[a, a])⁻¹ (`_inverse`: 4 × 4 blocks by (I + L)(I + L²), then block
    rows of 4), and X[a, b] = −X[a, a] Σ_{b≤c<a} A[a, c] X[c, b] from the earlier tile rows.
    Row i of every product reads rows ≤ i only (the others are exact zeros), so the result
    is causal bit for bit.
  * W = X (β ⊙ K ⊙ Γ), U = X (β ⊙ V), Q ⊙ Γ · scale, Kdᵀ = (K ⊙ e^(G_C − G) ⊙ m_C)ᵀ,
    d = e^(G_C) m0_C, Γ = e^G ⊙ m0.

The backward reads X and S_k from the forward and applies the chain rule:

    dX = dW (β K Γ)ᵀ + dU (β V)ᵀ,   dA = −Xᵀ dX Xᵀ (strictly lower, same document)
    dS_k = β_i dA,  dS_q = scale · dA_qk (causal, same document)
    for S = Σ_d a_id b_jd e^(G_id − G_jd), per 16-row tile i (`_bwd_pair_kernel`):
        Da_i = QF_i ⊙ Σ_{b≤i} dS[i, b] (b_b ⊙ KF_ib),
        Db_i = Σ_{a≥i} KF_ai ⊙ (dS[a, i]ᵀ (a_a ⊙ QF_a)),
        ∂a += Da,  ∂b += Db,  ∂G += a ⊙ Da − b ⊙ Db
    ∂g = reverse cumulative sum of ∂G in the chunk (+ ∂G_C on every row): inside each tile
    by a [16, 16] triangular product, across tiles by a carried column sum.

Status (docs/benchmarks.md, 2026-12-06, H100s): exact (the XLA intra-chunk step's outputs and
gradients to 1e-5 in fp32 interpret mode; the kernels against the XLA step on the GPU too).
The operator, fwd+bwd at B=1, H=16, T=8K, K=V=128, bf16: 4.29 ms against
jax-linear-attention's 2.25 in the same run (one H100). Registers (pip Triton, block 32):
the scores calls 92 / 170 / 188 / 201, no spill; pair 255 with 88 B of stack.

Precision: `precision` (DEFAULT = TF32 for bf16 inputs, HIGHEST for fp32; or BF16_OPERANDS,
bf16 operands) for the off-diagonal score products, W, U and the gradient products; DEFAULT
(TF32) for the forward's diagonal 16 × 16 score tiles (`_diag_scores`); `hi` (3×TF32 on the
GPU, true fp32 in interpret mode and for fp32 inputs) for the diagonal tiles' gradient terms
in the pairwise backward (`_diag`: TF32 there failed the saturated gate's dg bound on an
H100), the inverse (`_x_rows`), its derivative and the reverse cumulative sum.
Accumulation is fp32.
Shapes: K, V powers of two ≥ 16 (the wrapper pads), T a multiple of C (likewise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.kda.pallas_gpu_kernels import _dot
from pallas_kernels.kda.tiles import SAVE_NAME, SUB

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
    lr = jax.lax.rem(row, jnp.int32(SUB))
    self.tile = jax.lax.div(row, jnp.int32(SUB))
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



class _TileGate:
  """The gate's exponents of one [C, BK] block of g, per 16-row tile c (the same quantities as
  `_Gate`, module docstring, each a [SUB, BK] value or a [BK] vector): Lx_c, g0_c (g at the
  tile's first row), tp_c (Lx at its last row), tot_c = g0_c + tp_c. Built from 16-row loads
  of the ref, so no [C, BK] value is kept."""

  def __init__(self, g_ref, n, cols=slice(None)):
    gc = g_ref[_tile(0), cols]
    r = _iota(gc.shape, 0)
    self.n, self.Lx, self.g0, self.tp, self.tot = n, [], [], [], []
    for c in range(n):
      gc = g_ref[_tile(c), cols].astype(f32)
      lx = jnp.cumsum(jnp.where(r == 0, 0.0, gc), axis=0)  # Σ_{s_c<m≤i} g_m
      g0 = jnp.sum(jnp.where(r == 0, gc, 0.0), axis=0)
      tp = jnp.sum(jnp.where(r == SUB - 1, lx, 0.0), axis=0)
      self.Lx.append(lx)
      self.g0.append(g0)
      self.tp.append(tp)
      self.tot.append(g0 + tp)

  def _sum(self, vecs, start=None):
    out = start
    for v in vecs:
      out = v if out is None else out + v
    return out

  @property
  def Gtot(self):
    """G_C = Σ_c tot_c [BK]."""
    return self._sum(self.tot)

  def G(self, a):
    """G on the rows of tile a: Lx + Σ_{c<a} tot_c + g0_a, [SUB, BK] (≤ 0)."""
    pre = self._sum(self.tot[:a])
    pre = self.g0[a] if pre is None else pre + self.g0[a]
    return self.Lx[a] + pre[None, :]

  def E(self, a):
    """G_C − G_j on the rows of tile a: tp_a − Lx + Σ_{c>a} tot_c, [SUB, BK] (≤ 0)."""
    after = self._sum(self.tot[a + 1:])
    e = self.tp[a][None, :] - self.Lx[a]
    return e if after is None else e + after[None, :]

  def qf(self, a):
    """e^(G_i − r_a) on the rows of query tile a (≤ 1)."""
    return jnp.exp(self.Lx[a])

  def kf(self, a, b):
    """e^(r_a − G_j) on the rows of key tile b ≤ a: e^(−Lx) for b = a (≤ e^(15|g_min|)),
    e^(tp_b − Lx + Σ_{b<c<a} tot_c + g0_a) for b < a (≤ 1)."""
    if b == a:
      return jnp.exp(-self.Lx[a])
    btw = self._sum(self.tot[b + 1:a], self.g0[a])
    return jnp.exp((self.tp[b] + btw)[None, :] - self.Lx[b])


def _diag(prec, hi):
  """The precision of the pairwise backward's diagonal-tile products: `hi` (3×TF32 on a GPU)
  unless `prec` is already HIGHEST. Their operands carry the e^(±Lx) factors (up to
  e^(15|g_min|)) whose products cancel in ∂g: at g = −5 everywhere (bf16 inputs, an H100,
  2026-12-06) TF32 there put dg at 2.8e-2 (default precision) and 1.4e-2 (bf16 operands
  elsewhere) against the 2e-2 bound (3×TF32 there: 4.1e-3 and 2.9e-3 on an H100); true fp32
  (interpret mode) 3e-3; bf16 operands there 0.12-0.24."""
  return prec if prec == HI else hi


def _diag_scores(prec):
  """The precision of the forward's diagonal-tile score products (S_k, A_qk): TF32 (DEFAULT)
  unless `prec` is HIGHEST. There TF32 keeps the saturated gate inside the contract (emulated
  in `test_tf32_products_keep_the_saturated_gate_within_the_contract`: dg 4.1e-3, as with
  3×TF32), and bf16 operands do not (`BF16_OPERANDS`: o at 4.0e-3 against the 5e-3 bound)."""
  return prec if prec == HI else jax.lax.Precision.DEFAULT


def _tile(c):
  """The rows of 16-row tile c (a static slice)."""
  return slice(c * SUB, (c + 1) * SUB)


def _inverse(A, n, hi):
  """(I + A)⁻¹ of a strictly lower-triangular [C, C] fp32 A, C = 16 n: blocked forward
  substitution on whole-chunk products. The kernels call it on the 16 × 16 diagonal blocks
  only (n = 1, `_x_rows`); C = 32 and 64 remain for its test (the whole-chunk inverse kernel
  that used them was folded into the scores' tile calls on 2026-12-06).

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
  L = jnp.where(jax.lax.div(r, jnp.int32(4)) == jax.lax.div(c, jnp.int32(4)), -A, 0.0)
  P = eye + L
  X = P + _dot(P, _dot(L, L, hi), hi)  # the inverses of the 4 × 4 diagonal blocks
  s = 4
  while s < C:
    big = min(4 * s, C)
    rpos, cpos = (jax.lax.rem(jax.lax.div(x, jnp.int32(s)), jnp.int32(big // s)) for x in (r, c))
    same_big = jax.lax.div(r, jnp.int32(big)) == jax.lax.div(c, jnp.int32(big))
    Xd = X  # block diagonal with s × s blocks
    for j in range(1, big // s):
      R = _dot(jnp.where(same_big & (rpos == j) & (cpos < j), A, 0.0), X, hi)
      X = X - _dot(jnp.where(rpos == j, Xd, 0.0), R, hi)
    s = big
  return X


def _x_rows(A, x_prev, a, hi):
  """Tile row a of X = (I + A)⁻¹ (A strictly lower triangular, [C, C] fp32, C = 16 n), by
  forward substitution over 16-row tiles: X[a, a] = (I + A[a, a])⁻¹ (`_inverse` of the
  16 × 16 block) and, for b < a, X[a, b] = −X[a, a] Σ_{b≤c<a} A[a, c] X[c, b].

  A: the blocks A[a, b] for b ≤ a, a list of [16, 16] values; x_prev(c, b): the block X[c, b]
  of an earlier tile row c < a (read from where the earlier rows were written). Returns the
  blocks X[a, b] for b ≤ a ([16, 16] each; the blocks b > a are zero). Products at `hi`.
  Row i of every product reads rows ≤ i of its right operand only (the others meet exact
  zeros): causal bit for bit."""
  xaa = _inverse(A[a], 1, hi)
  out = []
  for b in range(a):
    r = None
    for c in range(b, a):
      p = _dot(A[c], x_prev(c, b), hi)
      r = p if r is None else r + p
    out.append(-_dot(xaa, r, hi))
  return out + [xaa]


def tile_inverse(A, hi=HI):
  """(I + A)⁻¹ of a strictly lower-triangular [C, C] fp32 A (C a multiple of 16) by 16-row
  tiles (`_x_rows`, row a after rows < a), outside a kernel: what the scores kernel's calls
  compute one tile row each (for tests). Returns [C, C] fp32, unit lower triangular; `hi`:
  the products' precision. Raises nothing of its own. Source: forward substitution by
  blocks; ARCHITECTURE.md §2.4 (X = (I + A_kk)⁻¹)."""
  n = A.shape[0] // SUB
  rows = []
  for a in range(n):
    blocks = [A[_tile(a), _tile(b)] for b in range(a + 1)]
    rows.append(_x_rows(blocks, lambda c, b: rows[c][b], a, hi))
  z = jnp.zeros((SUB, SUB), A.dtype)
  return jnp.concatenate([jnp.concatenate(r + [z] * (n - len(r)), axis=1) for r in rows], 0)


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


# ---------------------------------------------------------------------------------------------
# Forward: (A) scores and inverse by tile rows; (B) W, Q ⊙ Γ, Kd, d and U per chunk and
# channel block, reading X from (A).


def _fwd_scores_kernel(*refs, a, n, BK, scale, prec, hi, segs):
  """Grid (B·H, N); one call per query tile a. Rows of tile a of S_k and A_qk: the blocks
  (a, b ≤ a) as [16, BK] × [BK, 16] products summed over the key-channel blocks (the
  exponents of `_TileGate`), zeros in the blocks b > a; and rows of tile a of
  X = (I + β S_k)⁻¹ (`_x_rows`, reading X's rows of the earlier tiles, which the earlier calls
  wrote). Refs: q, k, g [C, Kp], β [C] (, doc [C]), and for a > 0 the outputs of the call for
  tile a − 1 (aliased; X [C, C] is read) -> A_qk [16, C] (store dtype; causal, same
  document), S_k [16, C] fp32 (strictly lower, same document), X [16, C] fp32.

  One call per tile rather than one program walking the chunk's n tiles, and the inverse
  here rather than in its own whole-chunk kernel: 0.55 ms against 0.61 + 0.33 ms at B=1,
  H=16, T=8K, K=128 (an H100, 2026-12-06; module docstring). The calls' work grows with a."""
  x_in = refs[-4] if a else None  # calls a > 0: ..., A_qk, S_k, X (aliased), A_qk, S_k, X
  refs = refs[:-6] + refs[-3:] if a else refs
  *refs, x_ref = refs
  if segs:
    q_ref, k_ref, g_ref, b_ref, doc_ref, aqk_ref, sk_ref = refs
  else:
    q_ref, k_ref, g_ref, b_ref, aqk_ref, sk_ref = refs
  Kp = q_ref.shape[1]
  ii, jj = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
  zero = jnp.zeros((SUB, SUB), f32)
  Sk, Sq = [zero] * (a + 1), [zero] * (a + 1)
  for kb in range(Kp // BK):
    ks = slice(kb * BK, (kb + 1) * BK)
    t = _TileGate(g_ref, a + 1, ks)
    qf = t.qf(a)
    lk = k_ref[_tile(a), ks].astype(f32) * qf
    lq = q_ref[_tile(a), ks].astype(f32) * qf
    for b in range(a + 1):
      rk = k_ref[_tile(b), ks].astype(f32) * t.kf(a, b)
      p = _diag_scores(prec) if b == a else prec
      Sk[b] = Sk[b] + _dot(lk, rk, p, tb=True)
      Sq[b] = Sq[b] + _dot(lq, rk, p, tb=True)
  for b in range(n):
    if b > a:
      aqk_ref[:, _tile(b)] = zero.astype(aqk_ref.dtype)
      sk_ref[:, _tile(b)] = zero
      x_ref[:, _tile(b)] = zero
      continue
    keep_q = ii >= jj if a == b else None
    keep_k = ii > jj if a == b else None
    if segs:
      same = doc_ref[_tile(a)][:, None] == doc_ref[_tile(b)][None, :]
      keep_q = same if keep_q is None else keep_q & same
      keep_k = same if keep_k is None else keep_k & same
    sq, sk = scale * Sq[b], Sk[b]
    if keep_q is not None:
      sq, sk = jnp.where(keep_q, sq, 0.0), jnp.where(keep_k, sk, 0.0)
    aqk_ref[:, _tile(b)] = sq.astype(aqk_ref.dtype)
    sk_ref[:, _tile(b)] = sk
    Sk[b] = sk
  beta = b_ref[_tile(a)].astype(f32)[:, None]
  X = _x_rows([beta * Sk[b] for b in range(a + 1)], lambda c, b: x_in[_tile(c), _tile(b)], a,
              hi)
  for b in range(a + 1):
    x_ref[:, _tile(b)] = X[b]


def _chunk_factors(t, m0_ref, ml_ref):
  """Γ = e^G ⊙ m0 and e^(G_C − G) ⊙ m_last [C, BK], and the chunk decay d = e^(G_C) m0_{C−1}
  [BK], for the gate block t (`_Gate`); without segments (refs None) the masks are all ones."""
  gam, ed, dec = jnp.exp(t.G), jnp.exp(t.E), jnp.exp(t.Gtot)
  if m0_ref is not None:
    m0 = m0_ref[...].astype(f32)
    gam = gam * m0[:, None]
    ed = ed * ml_ref[...].astype(f32)[:, None]
    dec = dec * _last(m0)
  return gam, ed, dec


def _fwd_wu_kernel(*refs, n, nk, nv, scale, prec, segs):
  """Grid (B·H, N, max(nk, nv)); program j: key block j (if j < nk) and value block j (if
  j < nv). Refs: q, k, g [C, BK], v [C, BV], β [C] (, m0, m_last [C]), X [C, C] ->
  W, Q ⊙ Γ · scale [C, BK], U [C, BV], Kdᵀ [BK, C], d [BK]."""
  if segs:
    (q_ref, k_ref, v_ref, g_ref, b_ref, m0_ref, ml_ref, x_ref,
     w_ref, u_ref, qg_ref, kd_ref, dec_ref) = refs
  else:
    q_ref, k_ref, v_ref, g_ref, b_ref, x_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref = refs
  j = pl.program_id(2)
  beta = b_ref[...].astype(f32)

  def keys():
    t = _Gate(g_ref[...].astype(f32), n)
    k = k_ref[...].astype(f32)
    gam, ed, dec = _chunk_factors(t, *((m0_ref, ml_ref) if segs else (None, None)))
    kdv = k * ed
    w_ref[...] = _dot(x_ref[...], beta[:, None] * k * gam, prec).astype(w_ref.dtype)
    qg_ref[...] = (scale * q_ref[...].astype(f32) * gam).astype(qg_ref.dtype)
    kd_ref[...] = jnp.transpose(kdv).astype(kd_ref.dtype)
    dec_ref[...] = dec

  def values():
    v = v_ref[...].astype(f32)
    u_ref[...] = _dot(x_ref[...], beta[:, None] * v, prec).astype(u_ref.dtype)

  _when(nk < max(nk, nv), j < nk, keys)
  _when(nv < max(nk, nv), j < nv, values)


def _when(guard: bool, cond, fn):
  """fn() under `pl.when(cond)` if guard (a Python bool: whether any program fails cond)."""
  if guard:
    pl.when(cond)(fn)
  else:
    fn()


# ---------------------------------------------------------------------------------------------
# Backward: (A) dX -> dA per chunk, with dV and U's part of dβ; (B) the pairwise scores' chain
# rule and the W, Q ⊙ Γ, Kd, d terms per chunk and key block.


def _bwd_dx_kernel(*refs, n, BK, BV, prec, hi, segs):
  """Grid (B·H, N). Refs: k, g [C, Kp], v [C, Vp], β [C] (, doc, m0 [C]), X, S_k [C, C],
  ∂W [C, Kp], ∂U [C, Vp] -> ∂V [C, Vp], ∂S_k = β ⊙ ∂A [C, C] (fp32), ∂β's part [C]:
  dX = ∂W (β K Γ)ᵀ + ∂U (β V)ᵀ,  ∂A = −Xᵀ dX Xᵀ (strictly lower, same document),
  ∂V = β ⊙ Xᵀ ∂U,  ∂β ∋ Σ_v (Xᵀ ∂U) ⊙ V + Σ_j ∂A ⊙ S_k."""
  if segs:
    (k_ref, v_ref, g_ref, b_ref, doc_ref, m0_ref, x_ref, sk_ref, dw_ref, du_ref,
     dv_ref, dsk_ref, db_ref) = refs
  else:
    k_ref, v_ref, g_ref, b_ref, x_ref, sk_ref, dw_ref, du_ref, dv_ref, dsk_ref, db_ref = refs
    doc_ref = None
  C, Kp = k_ref.shape
  Vp = v_ref.shape[-1]
  beta = b_ref[...].astype(f32)
  X = x_ref[...]
  kblk, vblk = _blocks(Kp, BK), _blocks(Vp, BV)

  def dx_w(kb, dX):
    ks = kblk(kb)
    t = _Gate(g_ref[:, ks].astype(f32), n)
    gam = jnp.exp(t.G)
    if segs:
      gam = gam * m0_ref[...].astype(f32)[:, None]
    bk = beta[:, None] * k_ref[:, ks].astype(f32) * gam
    return dX + _dot(dw_ref[:, ks].astype(f32), bk, prec, tb=True)

  def dx_u(vb, acc):
    dX, dbeta = acc
    vs = vblk(vb)
    du = du_ref[:, vs].astype(f32)
    v = v_ref[:, vs].astype(f32)
    dbv = _dot(X, du, prec, ta=True)  # Xᵀ ∂U
    dv_ref[:, vs] = (beta[:, None] * dbv).astype(dv_ref.dtype)
    return dX + _dot(du, beta[:, None] * v, prec, tb=True), dbeta + jnp.sum(dbv * v, axis=1)

  dX = jax.lax.fori_loop(0, Kp // BK, dx_w, jnp.zeros((C, C), f32))
  dX, dbeta = jax.lax.fori_loop(0, Vp // BV, dx_u, (dX, jnp.zeros((C,), f32)))
  dA = -_dot(_dot(X, dX, hi, ta=True), X, hi, tb=True)  # −Xᵀ dX Xᵀ
  dA = jnp.where(_mask(C, segs, doc_ref, True), dA, 0.0)
  db_ref[...] = (dbeta + jnp.sum(dA * sk_ref[...], axis=1)).astype(db_ref.dtype)
  dsk_ref[...] = beta[:, None] * dA


def _bwd_pair_kernel(*refs, n, scale, prec, hi, segs):
  """`_bwd_pair_kernel`'s outputs, computed by 16-row tiles: the same refs and grid.

  Query tile a and key tile b ≤ a meet in one [16, 16] block of ∂S_q, ∂S_k (read from the
  refs), so each product is a [16, 16] × [16, BK] tile product and no [C, C] or [C, BK] value
  is kept: for tile i, from the last to the first,
    P_i = QF_i ⊙ Σ_{b≤i} ∂S_q[i, b] (k_b ⊙ KF_{i,b}),  R_i likewise with ∂S_k,
    Z_i = Σ_{a≥i} KF_{a,i} ⊙ (∂S_q[a, i]ᵀ (q_a ⊙ QF_a) + ∂S_k[a, i]ᵀ (k_a ⊙ QF_a)),
    Xᵀ ∂W on tile i = Σ_{a≥i} X[a, i]ᵀ ∂W_a,
  then ∂q, ∂k, ∂G of the tile as in `_bwd_pair_kernel`, and ∂g = the reverse cumulative sum
  of ∂G inside the tile plus a carry: ∂G_C and the column sums of ∂G of the later tiles."""
  if segs:
    (q_ref, k_ref, g_ref, b_ref, doc_ref, m0_ref, ml_ref, x_ref, dsk_ref, daqk_ref, dw_ref,
     dqg_ref, dkd_ref, ddec_ref, dq_ref, dk_ref, dg_ref, db_ref) = refs
  else:
    (q_ref, k_ref, g_ref, b_ref, x_ref, dsk_ref, daqk_ref, dw_ref, dqg_ref, dkd_ref, ddec_ref,
     dq_ref, dk_ref, dg_ref, db_ref) = refs
  t = _TileGate(g_ref, n)
  ii, jj = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
  q = lambda c: q_ref[_tile(c), :].astype(f32)
  k = lambda c: k_ref[_tile(c), :].astype(f32)

  def dsq(a, b):  # scale · ∂A_qk on block (a, b): causal on the diagonal, same document
    keep = (ii >= jj) if a == b else None
    if segs:
      same = doc_ref[_tile(a)][:, None] == doc_ref[_tile(b)][None, :]
      keep = same if keep is None else keep & same
    m = scale * daqk_ref[_tile(a), _tile(b)].astype(f32)
    return m if keep is None else jnp.where(keep, m, 0.0)

  def factors(c):  # Γ, e^(G_C − G) (with the masks) and Kd on tile c
    gam, ed = jnp.exp(t.G(c)), jnp.exp(t.E(c))
    if segs:
      gam = gam * m0_ref[_tile(c)].astype(f32)[:, None]
      ed = ed * ml_ref[_tile(c)].astype(f32)[:, None]
    return gam, ed, k(c) * ed

  dkd = lambda c: jnp.transpose(dkd_ref[:, _tile(c)].astype(f32))  # [16, BK]
  dec = jnp.exp(t.Gtot)
  if segs:
    dec = dec * _last(m0_ref[_tile(n - 1)].astype(f32))
  carry = ddec_ref[...].astype(f32) * dec  # ∂G_C, then + the later tiles' Σ ∂G
  for c in range(n):
    carry = carry + jnp.sum(dkd(c) * factors(c)[2], axis=0)
  rev = jnp.where(ii <= jj, 1.0, 0.0).astype(f32)  # Σ_{m≥i} inside a tile
  for i in reversed(range(n)):
    P = R = Z = dbk = None
    for b in range(i + 1):
      kk = k(b) * t.kf(i, b)
      pr = _diag(prec, hi) if b == i else prec
      p, r = _dot(dsq(i, b), kk, pr), _dot(dsk_ref[_tile(i), _tile(b)], kk, pr)
      P, R = (p, r) if P is None else (P + p, R + r)
    qf = t.qf(i)
    P, R = qf * P, qf * R
    for a in range(i, n):
      qf_a = t.qf(a)
      pr = _diag(prec, hi) if a == i else prec
      z = t.kf(a, i) * (_dot(dsq(a, i), q(a) * qf_a, pr, ta=True)
                        + _dot(dsk_ref[_tile(a), _tile(i)], k(a) * qf_a, pr, ta=True))
      w = _dot(x_ref[_tile(a), _tile(i)], dw_ref[_tile(a), :].astype(f32), prec, ta=True)
      Z, dbk = (z, w) if Z is None else (Z + z, dbk + w)
    gam, ed, kd = factors(i)
    qi, ki, dkdi = q(i), k(i), dkd(i)
    beta = b_ref[_tile(i)].astype(f32)[:, None]
    dqg = scale * gam * dqg_ref[_tile(i), :].astype(f32)
    dq_ref[_tile(i), :] = (P + dqg).astype(dq_ref.dtype)
    dk_ref[_tile(i), :] = (R + Z + beta * gam * dbk + ed * dkdi).astype(dk_ref.dtype)
    dG = qi * (P + dqg) + ki * (R - Z) + beta * ki * gam * dbk - dkdi * kd
    db_ref[_tile(i)] = jnp.sum(dbk * ki * gam, axis=1).astype(db_ref.dtype)
    dg_ref[_tile(i), :] = (_dot(rev, dG, hi) + carry[None, :]).astype(dg_ref.dtype)
    carry = carry + jnp.sum(dG, axis=0)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers


def _config(q, v, interpret, precision, num_warps, block_k):
  """Shapes, channel blocks (BK = BV = block_k, capped at Kp / Vp), the inverse's precision and
  the Triton compiler params."""
  B, Tp, H, Kp = q.shape
  Vp = v.shape[-1]
  BK, BV = min(block_k, Kp), min(block_k, Vp)
  if interpret or precision == HI:
    hi = HI
  else:
    hi = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
  return B, Tp, H, Kp, Vp, BK, BV, hi, params


def _pass_block(block_k, i):
  """The channel block of pass i (0 forward, 1 backward): block_k is one int for both passes
  or a (forward, backward) pair."""
  return block_k if isinstance(block_k, int) else block_k[i]


def _tok(C, H, d, nb=None):
  """Spec of a [B, Tp, H, d] input: one chunk of one head, all d channels (grid (B·H, N)) or,
  with nb blocks of d channels, block min(j, nb − 1) (grid (B·H, N, ·))."""
  if nb is None:
    return pl.BlockSpec((None, C, None, d), lambda i, n: (i // H, n, i % H, 0))
  return pl.BlockSpec((None, C, None, d),
                      lambda i, n, j: (i // H, n, i % H, jnp.minimum(j, nb - 1)))


def _tok_vec(C, H, grid3=False):
  """Spec of β [B, Tp, H]: one chunk of one head."""
  if grid3:
    return pl.BlockSpec((None, C, None), lambda i, n, j: (i // H, n, i % H))
  return pl.BlockSpec((None, C, None), lambda i, n: (i // H, n, i % H))


def _seq(C, H, grid3=False):
  """Spec of a [B, Tp] mask: one chunk."""
  if grid3:
    return pl.BlockSpec((None, C), lambda i, n, j: (i // H, n))
  return pl.BlockSpec((None, C), lambda i, n: (i // H, n))


def _square(C, grid3=False):
  """Spec of a [BH, N, C, C] array: one chunk."""
  if grid3:
    return pl.BlockSpec((None, None, C, C), lambda i, n, j: (i, n, 0, 0))
  return pl.BlockSpec((None, None, C, C), lambda i, n: (i, n, 0, 0))


def _rows(C, d, nb):
  """Spec of a [BH, Tp, ·] array: block min(j, nb − 1) of d channels of one chunk."""
  return pl.BlockSpec((None, C, d), lambda i, n, j: (i, n, jnp.minimum(j, nb - 1)))


def _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
              block_k):
  """Returns the six outputs of `intra_chunk_wy` and the residuals X, S_k [BH, N, C, C] f32."""
  B, Tp, H, Kp, Vp, BK, BV, hi, params = _config(q, v, interpret, precision, num_warps,
                                                 _pass_block(block_k, 0))
  segs = masks is not None
  BH, N, n = B * H, Tp // C, C // SUB
  nk, nv = Kp // BK, Vp // BV
  sq = lambda d: jax.ShapeDtypeStruct((BH, N, C, C), d)
  specs, args = [_tok(C, H, Kp)] * 3 + [_tok_vec(C, H)], (q, k, g, beta)
  if segs:
    specs.append(_seq(C, H))
    args += (masks[0],)
  outs = ()
  for a in range(n):  # one call per query tile a, each writing that tile's rows
    rows = pl.BlockSpec((None, None, SUB, C), lambda i, c, a=a: (i, c, a, 0))
    outs = pl.pallas_call(
        functools.partial(_fwd_scores_kernel, a=a, n=n, BK=BK, scale=scale, prec=precision,
                          hi=hi, segs=segs),
        grid=(BH, N), in_specs=specs + ([rows, rows, _square(C)] if a else []),
        out_specs=[rows] * 3, out_shape=[sq(store), sq(f32), sq(f32)],
        input_output_aliases={len(args) + m: m for m in range(len(outs))},
        compiler_params=params, interpret=interpret, name=f"kda_wy_fwd_scores_t{a}")(
            *args, *outs)
  aqk, Sk, X = outs

  nb = max(nk, nv)
  specs = [_tok(C, H, BK, nk), _tok(C, H, BK, nk), _tok(C, H, BV, nv), _tok(C, H, BK, nk),
           _tok_vec(C, H, True)]
  args = (q, k, v, g, beta)
  if segs:
    specs += [_seq(C, H, True)] * 2
    args += tuple(masks[1:])
  specs.append(_square(C, True))
  args += (X,)
  out_specs = [_rows(C, BK, nk), _rows(C, BV, nv), _rows(C, BK, nk),
               pl.BlockSpec((None, None, BK, C), lambda i, n, j: (i, n, jnp.minimum(j, nk - 1), 0)),
               pl.BlockSpec((None, None, BK), lambda i, n, j: (i, n, jnp.minimum(j, nk - 1)))]
  out_shape = [jax.ShapeDtypeStruct((BH, Tp, Kp), store), jax.ShapeDtypeStruct((BH, Tp, Vp), store),
               jax.ShapeDtypeStruct((BH, Tp, Kp), store),
               jax.ShapeDtypeStruct((BH, N, Kp, C), store), jax.ShapeDtypeStruct((BH, N, Kp), f32)]
  W, U, Qg, Kd, dec = pl.pallas_call(
      functools.partial(_fwd_wu_kernel, n=n, nk=nk, nv=nv, scale=scale, prec=precision,
                        segs=segs),
      grid=(BH, N, nb), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=interpret, name="kda_wy_fwd_wu")(*args)
  return (W, U, Qg, aqk, Kd, dec), (X, Sk)


def _bwd_call(q, k, v, g, beta, masks, X, Sk, cts, C, scale, precision, interpret, num_warps,
              block_k):
  B, Tp, H, Kp, Vp, BK, BV, hi, params = _config(q, v, interpret, precision, num_warps,
                                                 _pass_block(block_k, 1))
  segs = masks is not None
  BH, N, n = B * H, Tp // C, C // SUB
  nk = Kp // BK
  dw, du, dqg, daqk, dkd, ddec = cts

  specs = [_tok(C, H, Kp), _tok(C, H, Vp), _tok(C, H, Kp), _tok_vec(C, H)]
  args = (k, v, g, beta)
  if segs:
    specs += [_seq(C, H)] * 2
    args += tuple(masks[:2])
  rows = lambda d: pl.BlockSpec((None, C, d), lambda i, n: (i, n, 0))
  specs += [_square(C), _square(C), rows(Kp), rows(Vp)]
  args += (X, Sk, dw, du)
  dv, dSk, db_a = pl.pallas_call(
      functools.partial(_bwd_dx_kernel, n=n, BK=BK, BV=BV, prec=precision, hi=hi, segs=segs),
      grid=(BH, N), in_specs=specs,
      out_specs=[_tok(C, H, Vp), _square(C), _tok_vec(C, H)],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((BH, N, C, C), f32),
                 jax.ShapeDtypeStruct(beta.shape, f32)],
      compiler_params=params, interpret=interpret, name="kda_wy_bwd_dx")(*args)

  specs = [_tok(C, H, BK, nk), _tok(C, H, BK, nk), _tok(C, H, BK, nk), _tok_vec(C, H, True)]
  args = (q, k, g, beta)
  if segs:
    specs += [_seq(C, H, True)] * 3
    args += tuple(masks)
  specs += [_square(C, True), _square(C, True), _square(C, True), _rows(C, BK, nk),
            _rows(C, BK, nk),
            pl.BlockSpec((None, None, BK, C), lambda i, n, j: (i, n, j, 0)),
            pl.BlockSpec((None, None, BK), lambda i, n, j: (i, n, j))]
  args += (X, dSk, daqk, dw, dqg, dkd, ddec)
  dq, dk, dg, db_parts = pl.pallas_call(
      functools.partial(_bwd_pair_kernel, n=n, scale=scale, prec=precision, hi=hi, segs=segs),
      grid=(BH, N, nk), in_specs=specs,
      out_specs=[_tok(C, H, BK, nk)] * 3 + [
          pl.BlockSpec((None, None, C, None), lambda i, n, j: (j, i // H, n, i % H))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(g.shape, f32), jax.ShapeDtypeStruct((nk,) + beta.shape, f32)],
      compiler_params=params, interpret=interpret, name="kda_wy_bwd_pair")(*args)
  return dq, dk, dv, dg, db_a + jnp.sum(db_parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def intra_chunk_wy(q, k, v, g, beta, masks, C, scale, precision, store, interpret,
                   num_warps=4, block_k=32):
  """The intra-chunk step of `pallas_gpu` as Pallas kernels (module docstring).

  Args:
    q, k: [B, Tp, H, Kp]; v: [B, Tp, H, Vp] (bf16 or fp32; read in this dtype, promoted to
      fp32 in the kernel); g: [B, Tp, H, Kp] log-decay (≤ 0, ≥ the gate's lower bound; 0 at
      padding tokens); beta: [B, Tp, H]. Kp, Vp powers of two ≥ 16; Tp a multiple of C.
    masks: None, or (doc [B, Tp] int32 document index, m0 [B, Tp] fp32, mlast [B, Tp] fp32)
      as `xla._chunk_docs` defines them (not differentiated).
    C: chunk size (16, 32 or 64); scale: query scale; precision: of the score / W / U /
      gradient products (DEFAULT = TF32, HIGHEST = fp32); store: dtype of the outputs but d;
      interpret: Pallas interpret mode (CPU tests); num_warps: warps per program; block_k: key
      and value channels per block (a power of two ≥ 16, capped at Kp / Vp): the width of
      the per-block programs of the W / U forward and the pairwise backward, and of the
      channel loops of the per-chunk kernels; one int for both passes or a (forward,
      backward) pair (on an H100 the pair (64, 32) and 32 were equal within the noise:
      2.995 and 2.944 ms fwd+bwd of the step at B=1, H=16, T=8K; docs/benchmarks.md).

  Returns:
    W [BH, Tp, Kp], U [BH, Tp, Vp], Qg = scale Q ⊙ Γ [BH, Tp, Kp], A_qk [BH, N, C, C],
    Kdᵀ [BH, N, Kp, C] (all in `store`), d = e^(G_C) m0_C [BH, N, Kp] fp32; BH = B·H in
    b-major order, N = Tp / C.

  The gradient: `_bwd_dx_kernel` then `_bwd_pair_kernel` (q, k, v in their dtypes, g and β
  fp32), from the residuals X = (I + A_kk)⁻¹ and S_k of the forward (2 · C² fp32 per chunk).

  Raises: nothing of its own (the caller, `chunk_kda_pallas_gpu`, checks shapes, dtypes and
  the gate bound). Source: Kimi Linear (arXiv 2510.26692) §3; ARCHITECTURE.md §2.4.
  """
  return _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
                   block_k)[0]


def _wy_fwd(q, k, v, g, beta, masks, C, scale, precision, store, interpret, num_warps,
            block_k):
  out, (X, Sk) = _fwd_call(q, k, v, g, beta, masks, C, scale, precision, store, interpret,
                           num_warps, block_k)
  out, X, Sk = jax.tree.map(lambda x: checkpoint_name(x, SAVE_NAME), (out, X, Sk))
  return out, (q, k, v, g, beta, masks, X, Sk)


def _wy_bwd(C, scale, precision, store, interpret, num_warps, block_k, res, cts):
  del store
  q, k, v, g, beta, masks, X, Sk = res
  dq, dk, dv, dg, db = _bwd_call(q, k, v, g, beta, masks, X, Sk, cts, C, scale, precision,
                                 interpret, num_warps, block_k)
  dmasks = None if masks is None else tuple(
      jnp.zeros(m.shape, jax.dtypes.float0) if jnp.issubdtype(m.dtype, jnp.integer)
      else jnp.zeros_like(m) for m in masks)
  return dq, dk, dv, dg.astype(g.dtype), db.astype(beta.dtype), dmasks


intra_chunk_wy.defvjp(_wy_fwd, _wy_bwd)
