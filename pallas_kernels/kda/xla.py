"""Chunked KDA in pure jax.numpy: runs everywhere (CPU, GPU, TPU), differentiable by autodiff.

Source: Kimi Linear (arXiv 2510.26692) §3 (chunkwise WY form of the gated delta rule);
ARCHITECTURE.md §2.4 (the algorithm, the exponent-safety argument) and §2.5 (the contract).

Per chunk of C tokens (C in {16, 32, 64}), G = inclusive cumsum of g inside the chunk, Γ = e^G:

    A_kk[i, j] = β_i Σ_d k_id k_jd e^(G_id − G_jd)      j < i, same document
    A_qk[i, j] = scale Σ_d q_id k_jd e^(G_id − G_jd)    j ≤ i, same document
    T_c = (I + A_kk)^(−1) diag(β),   W = T_c (K ⊙ Γ ⊙ m0),   U = T_c V
    V'  = U − W S;   O = scale (Q ⊙ Γ ⊙ m0) S + A_qk V'
    S'  = m0_C e^(G_C) ⊙ S + (K ⊙ e^(G_C − G) ⊙ m_C)ᵀ V'

with m0_i = 1 where token i is still in the document that was open when the chunk began (the
incoming state reaches it) and m_C,i = 1 where token i is in the chunk's last document (only that
document's tokens survive into the outgoing state). Every exponent outside A_kk / A_qk is ≤ 0.

The pairwise factors e^(G_i − G_j) are computed on 16-token sub-tiles (`_pairwise_scores`):
off-diagonal sub-blocks as one matmul per query sub-block with the reference point r at the
first row of that sub-block (e^(G_i − r) ≤ 1 and e^(r − G_j) ≤ 1); diagonal sub-tiles either
  "dense": the same split, r at the tile's first row: e^(r − G_j) ≥ 1 reaches at most
            e^(15·|g_min|) = e^75 for the lower-bounded gate (g ≥ −5), inside fp32 range. Wrong
            (inf / NaN) for unbounded gates.
  "safe":   element-wise [16, 16, K] tensor e^(G_i − G_j) with the anti-causal entries set to
            −inf *before* exp (so no inf·0 in either direction); always finite.
r never depends on a token later than the row it serves, so outputs are causal bit for bit.
Every exponent is a direct sum of g over a token range, never a difference of two cumulative
sums (which loses |G|·eps nats after a gate of −1000). The triangular inverse is forward
substitution with the closed-form derivative −X dA X. The state recurrence over chunks is a
`lax.scan` with the fp32 state as carry; gradients come from autodiff through it.

Choosing the diagonal method: `chunk_kda(..., gate_lower_bound=cfg.kda_gate_lower_bound)`;
a float bound (the default gate: −5.0) selects "dense", None (unbounded gate, or unknown) "safe".

Memory (XLA:CPU buffer assignment, B=1, H=16, T=8192, K=V=128, bf16 in): fwd+bwd temp 1.8 GB
dense, 2.4 GB safe; forward 0.7 / 1.2 GB.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.kda.tiles import SUB, resolve_diag, segment_resets

def supported_on(device) -> bool:
  """Where this backend runs: every platform (plain jax.numpy)."""
  del device
  return True


def _mm(a, b, precision):
  return jnp.matmul(a, b, precision=precision)


def _rev_cumsum(x, axis=-2):
  return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)


def tri_cumsum(x, reverse=False):
  """Inclusive cumulative sum over axis −2 as one matmul with a 0/1 triangular matrix.

  Same sums as `jnp.cumsum` (each output a direct sum of the inputs it covers), in another
  order: a few ulp apart in fp32. Why: XLA lowers `cumsum` to an O(n²) reduce-window, which on
  a GPU took 2 ms (forward) + 2 ms (backward) of a 21 ms KDA fwd+bwd at T = 32K, H = 16
  (docs/benchmarks.md); the matmul runs on the GEMM units. HIGHEST precision: the products
  with 0 and 1 are exact and the sums are fp32 (never TF32, which would round g to 10 bits).
  Entries after row i are multiplied by an exact 0, so row i stays causal.

  Args: x [..., n, d] float (here the per-token log-decays g, nats). reverse: Σ_{j ≥ i}
    instead of Σ_{j ≤ i}.
  Returns: [..., n, d] in x's dtype. Raises nothing of its own (x of rank < 2: einsum's error).
  Source: the in-chunk cumulative log-decay G of ARCHITECTURE.md §2.4 (Kimi Linear, arXiv
  2510.26692, §3); test: `test_tri_cumsum_matches_fp64_prefix_sums_and_is_causal`.
  """
  n = x.shape[-2]
  ii = jnp.arange(n)
  tri = (ii[:, None] <= ii[None, :]) if reverse else (ii[:, None] >= ii[None, :])
  return jnp.einsum("ij,...jd->...id", tri.astype(x.dtype), x,
                    precision=jax.lax.Precision.HIGHEST)


def _cumsum_fn(matmul: bool):
  """(cumsum, reverse cumsum) over axis −2: XLA's, or `tri_cumsum` (matmul=True, GPU)."""
  if matmul:
    return tri_cumsum, functools.partial(tri_cumsum, reverse=True)
  return functools.partial(jnp.cumsum, axis=-2), _rev_cumsum


def _shift_up(x, axis=-2):
  """x[m + 1] at position m along `axis` (0 at the end)."""
  x = jnp.moveaxis(x, axis, -1)
  x = jnp.concatenate([x[..., 1:], jnp.zeros_like(x[..., :1])], axis=-1)
  return jnp.moveaxis(x, -1, axis)


def _pairwise_scores(q, k, g, *, diag: str, precision, matmul_cumsum: bool = False):
  """Causal decayed scores of one chunk, for queries q and for keys-as-queries k.

  Sub-tiles of `sub` tokens: query tile a, key tile b. The reference point of query tile a is
  r_a = G at its first row s_a. Factors, each a direct sum of g over a token range (never a
  difference of two cumulative sums, which loses |G|·eps nats after one large gate):
    query:       e^(G_i − r_a)  = e^(Σ_{s_a<m≤i} g_m)          ≤ 1
    key, b < a:  e^(r_a − G_j)  = e^(Σ_{j<m≤e_b} g_m) · e^(B_ba),
                 B_ba = Σ_{e_b<m≤s_a} g_m ≤ 0
    key, b = a:  dense: e^(−Σ_{s_a<m≤j} g_m) ≥ 1 (≤ e^(15 |g_min|) for a bounded gate);
                 safe: the element-wise e^(Σ_{j<m≤i} g_m), anti-causal set to −inf before exp.
  r_a depends on no token after row i, so every row is causal bit for bit.

  Args:
    q, k, g: [..., C, K] fp32 (g: the per-token log-decay, not its cumsum).
    diag: "dense" | "safe".
    matmul_cumsum: the cumulative sums as triangular matmuls (`tri_cumsum`; the GPU backend).

  Returns:
    (Sq, Sk), each [..., C, C] fp32: Sq[i, j] = Σ_d q_id k_jd e^(G_id − G_jd) and likewise Sk
    with k on the query side, for j ≤ i, exactly 0 for j > i.
  """
  C, K = q.shape[-2:]
  sub = min(SUB, C)
  n = C // sub
  lead = q.shape[:-2]
  q, k, g = (x.reshape(lead + (n, sub, K)) for x in (q, k, g))
  ii = jnp.arange(sub)
  tri = ii[:, None] >= ii[None, :]  # causal inside a tile
  cumsum, rev_cumsum = _cumsum_fn(matmul_cumsum)
  Pf = cumsum(jnp.where((ii == 0)[:, None], 0.0, g))  # Σ_{s_a<m≤i} g_m
  dq = jnp.exp(Pf)
  qt, kt = q * dq, k * dq  # query-side operands [..., a, i, K]

  if diag == "dense":
    kd = k * jnp.exp(-Pf)  # positive exponents: the point of the lower-bounded gate
    # HIGHEST whatever `precision`: the e^(±Pf) factors (up to e^(15 |g_min|)) cancel in ∂g.
    # TF32 there (emulated on the CPU, the other products TF32 too) put the saturated gate's
    # dg at 1.46e-2 against 5.3e-3 (bound 2e-2; the wy kernels' TF32 diagonal tiles: 2.8e-2
    # on an H100, pallas_gpu_wy._diag). Test: tests/pallas_kernels/test_kda_pallas_gpu.py::
    # test_tf32_products_of_the_xla_intra_step_and_its_highest_diagonal_tiles.
    hi = jax.lax.Precision.HIGHEST
    dq_, dk_ = (_mm(x, jnp.swapaxes(kd, -1, -2), hi) for x in (qt, kt))
    Dq, Dk = jnp.where(tri, dq_, 0.0), jnp.where(tri, dk_, 0.0)  # [..., a, i, j]
  else:
    Dq, Dk = _diag_safe(q, k, g, tri)

  if n == 1:
    return Dq.reshape(lead + (C, C)), Dk.reshape(lead + (C, C))
  # Off-diagonal tiles b < a: one matmul per query tile a against all earlier keys, whose
  # copy ko ⊙ e^(B_ba) (shared by Sq and Sk) totals n(n−1)/2 tiles, 1.5 q for n = 4.
  tail = rev_cumsum(_shift_up(g))  # Σ_{j<m≤e_b} g_m ≤ 0 inside key tile b
  ko = k * jnp.exp(tail)  # [..., b, j, K]
  tot = jnp.sum(g, axis=-2)  # [..., n, K] tile totals
  aa = jnp.arange(n)
  between = ((aa[:, None, None] < aa[None, None, :]) & (aa[None, None, :] < aa[None, :, None]))
  # B[b, a] = Σ_{b<c<a} tot_c + g_{s_a} ≤ 0 (used for b < a only).
  B = jnp.einsum("bac,...cd->...bad", between.astype(g.dtype), tot, precision=precision)
  B = B + g[..., None, :, 0, :]
  rows_q, rows_k = [], []
  for a in range(n):
    parts_q, parts_k = [], []
    if a:
      kk = (ko[..., :a, :, :] * jnp.exp(B[..., :a, a, None, :])).reshape(lead + (a * sub, K))
      kk_t = jnp.swapaxes(kk, -1, -2)
      parts_q.append(_mm(qt[..., a, :, :], kk_t, precision))
      parts_k.append(_mm(kt[..., a, :, :], kk_t, precision))
    parts_q.append(Dq[..., a, :, :])
    parts_k.append(Dk[..., a, :, :])
    if a < n - 1:
      z = jnp.zeros(lead + (sub, C - (a + 1) * sub), g.dtype)
      parts_q.append(z)
      parts_k.append(z)
    rows_q.append(jnp.concatenate(parts_q, axis=-1))
    rows_k.append(jnp.concatenate(parts_k, axis=-1))
  return jnp.concatenate(rows_q, axis=-2), jnp.concatenate(rows_k, axis=-2)


# Largest element-wise tile tensor [group, n, sub, sub, K] the safe path builds at once (bytes).
SAFE_GROUP_BYTES = 1 << 27


def _diag_safe(q, k, g, tri):
  """Element-wise diagonal tiles [M, a, i, j] (safe path), in groups of chunks.

  The [M, n, sub, sub, K] exponent tensor is 16× the size of q, so it is built for at most
  SAFE_GROUP_BYTES at a time (`lax.map` over groups of chunks) and rematerialised in the
  backward pass rather than stored.
  """
  M, n, sub, K = g.shape
  per_chunk = n * sub * sub * K * 4
  group = max(1, min(M, SAFE_GROUP_BYTES // per_chunk))
  if group >= M:
    return _diag_safe_group(q, k, g, tri)
  out = jax.lax.map(lambda a: _diag_safe_group(*a, tri), (q, k, g), batch_size=group)
  return out


@jax.checkpoint
def _diag_safe_group(q, k, g, tri):
  """Element-wise diagonal tiles [..., a, i, j]: exponent Σ_{j<m≤i} g_m ≤ 0, −inf above."""
  sub = g.shape[-2]
  ii = jnp.arange(sub)
  later = (ii[None, :] > ii[:, None])[:, :, None]  # [j, m, 1]: m > j
  E = jnp.cumsum(jnp.where(later, g[..., None, :, :], 0.0), axis=-2)  # [..., j, i, K]
  E = jnp.swapaxes(E, -2, -3)  # [..., i, j, K]
  D = jnp.exp(jnp.where(tri[:, :, None], E, -jnp.inf))
  bq = jnp.einsum("...id,...jd,...ijd->...ij", q, k, D)
  bk = jnp.einsum("...id,...jd,...ijd->...ij", k, k, D)
  return bq, bk


def inverse_with_closed_form_jvp(inverse):
  """Wrap A ↦ (I + A)⁻¹ in a custom_jvp with the closed form dX = −X dA X (HIGHEST matmuls), so
  autodiff stores nothing of the inverse's inner steps and costs two matmuls."""
  inverse = jax.custom_jvp(inverse)

  @inverse.defjvp
  def _jvp(primals, tangents):
    (A,), (dA,) = primals, tangents
    X = inverse(A)
    hi = jax.lax.Precision.HIGHEST
    return X, -jnp.matmul(jnp.matmul(X, dA, precision=hi), X, precision=hi)

  return inverse


@inverse_with_closed_form_jvp
def _unit_lower_inverse(A):
  """(I + A)^(−1) for strictly lower-triangular A [..., C, C] (fp32 or fp64).

  Forward substitution, one row per step of a `fori_loop` (vectorised over the batch): row i is
  −A[i, :] X with the rows ≥ i of X still exactly zero, so row i depends only on rows ≤ i of A
  (causal) and the result is as accurate as a triangular solve. The derivative is the closed
  form dX = −X dA X (custom_jvp), so autodiff stores nothing per step and costs two matmuls.
  """
  C = A.shape[-1]
  hi = jax.lax.Precision.HIGHEST

  def body(i, X):
    a_i = jax.lax.dynamic_index_in_dim(A, i, axis=-2, keepdims=True)  # [..., 1, C]
    row = -jnp.matmul(a_i, X, precision=hi)
    row = jnp.where(jnp.arange(C) == i, 1.0, row)
    return jax.lax.dynamic_update_index_in_dim(X, row.astype(X.dtype), i, axis=-2)

  return jax.lax.fori_loop(0, C, body, jnp.zeros_like(A))


def _chunk_masks(segment_ids, B, T, Tp, C):
  """Document masks per chunk from segment ids (same semantics as `tiles.segment_resets`).

  Returns (valid [B, Tp], same [B, N, C, C], m0 [B, N, C], mlast [B, N, C]) as bool, or
  (valid, None, None, None) when there are no segments.
  """
  valid, doc, m0, mlast = _chunk_docs(segment_ids, B, T, Tp, C)
  if doc is None:
    return valid, None, None, None
  same = doc[..., :, None] == doc[..., None, :]
  return valid, same, m0, mlast


def _chunk_docs(segment_ids, B, T, Tp, C):
  """Like `_chunk_masks`, with the document index of every token [B, N, C] int32 (counted from
  the sequence start) in place of the pairwise `same` mask: (valid, doc, m0, mlast)."""
  N = Tp // C
  if segment_ids is None:
    valid = jnp.arange(Tp)[None, :] < T
    return jnp.broadcast_to(valid, (B, Tp)), None, None, None
  reset = segment_resets(segment_ids)
  valid = segment_ids != 0
  reset = jnp.pad(reset, ((0, 0), (0, Tp - T)))  # chunk padding: identity tokens, no reset
  valid = jnp.pad(valid, ((0, 0), (0, Tp - T)))
  doc = jnp.cumsum(reset.astype(jnp.int32), axis=1).reshape(B, N, C)
  doc_in = doc[..., 0] - reset.reshape(B, N, C)[..., 0].astype(jnp.int32)
  m0 = doc == doc_in[..., None]
  mlast = doc == doc[..., -1:]
  return valid, doc, m0, mlast


def _intra_chunk(qc, kc, vc, gc, bc, same, m0, mlast, *, scale, diag, precision,
                 inverse=None, matmul_cumsum=False):
  """Everything that does not depend on the state entering a chunk (ARCHITECTURE §2.4).

  Args: [M, C, ·] chunked fp32 q, k, v, g; β [M, C]; document masks [M, C, C], [M, C], [M, C]
  (bool) or None; inverse: (I + A)⁻¹ of strictly lower-triangular A (default
  `_unit_lower_inverse`; pallas_gpu passes a blocked one); matmul_cumsum: the cumulative
  sums as triangular matmuls (`tri_cumsum`; pallas_gpu).
  Returns W, U, Q ⊙ Γ · scale, A_qk, (K ⊙ e^(G_C − G))ᵀ, e^(G_C) (masked).
  """
  C = qc.shape[-2]
  cumsum, rev_cumsum = _cumsum_fn(matmul_cumsum)
  G = cumsum(gc)  # inclusive cumulative log-decay in the chunk, ≤ 0
  # G_C − G_j = Σ_{j<m<C} g_m, summed directly (not as a difference of cumsums).
  tail = rev_cumsum(_shift_up(gc))

  Sq, Sk = _pairwise_scores(qc, kc, gc, diag=diag, precision=precision,
                            matmul_cumsum=matmul_cumsum)
  ii = jnp.arange(C)
  strict = ii[:, None] > ii[None, :]
  A_kk = jnp.where(strict, Sk, 0.0) * bc[..., :, None]
  A_qk = Sq * scale
  if same is not None:
    A_kk = jnp.where(same, A_kk, 0.0)
    A_qk = jnp.where(same, A_qk, 0.0)
  T_c = (inverse or _unit_lower_inverse)(A_kk) * bc[..., None, :]  # (I + A_kk)^-1 diag(β)

  Gam = jnp.exp(G)  # ≤ 1
  decay_out = jnp.exp(tail)  # ≤ 1
  state_decay = jnp.exp(G[..., -1, :])  # [M, K]
  if m0 is not None:
    Gam = Gam * m0[..., None]  # the incoming state reaches only the chunk's first document
    decay_out = decay_out * mlast[..., None]  # only the last document leaves the chunk
    state_decay = state_decay * m0[:, -1:]
  W = _mm(T_c, kc * Gam, precision)
  U = _mm(T_c, vc, precision)
  Qg = qc * Gam * scale
  Kd = jnp.swapaxes(kc * decay_out, -1, -2)  # [M, K, C]

  return W, U, Qg, A_qk, Kd, state_decay


def effective_chunk_size(T: int, chunk_size: int) -> int:
  """The chunk `chunk_kda_xla` runs for T tokens: chunk_size, or for a sequence shorter than it
  the smallest of 16, 32, 64 that holds the T tokens (one chunk either way).

  Cheaper (a 1-token prefill no longer pays for a 64 × 64 chunk) and exact in real arithmetic:
  the appended identity tokens (q = k = v = 0, g = 0, β = 0) add exact zeros to every sum; in
  fp32 only the order of the sums differs (a few ulp; `test_short_sequence_chunk_is_exact`).
  It also kept XLA:GPU from most of the compiler crash that `_fence` fixes (T ≤ 8 padded to 64).
  """
  if T >= chunk_size:
    return chunk_size
  return next(c for c in (16, 32, 64) if c >= min(T, chunk_size))


def _fence(xs):
  """An optimization barrier around the zero-padded chunks and the padded output (in the
  backward pass around their cotangents): XLA may not rewrite through the known zeros of the
  padding. The values are unchanged.

  Why: XLA:GPU (jax 0.11.2, H200) failed to compile the bf16 backward of short padded sequences
  (`mlir_kernel_emitter` RET_CHECK "Failed to translate module to LLVM IR" on multi-output
  transpose / reverse fusions): T = 1, 2, 3, 8 in a 64-token chunk with an initial state, and
  T = 5 with segments in a 16-token chunk. With the barrier (and `effective_chunk_size`) every
  mapped case compiled and met the bf16 contract (T = 1-13, 37, 65, 69, 100; chunks 16, 32,
  64; with and without segments and initial state; 2026-12-01, docs/benchmarks.md "The suite
  on one H200"); the barrier alone also fixed T = 1, 2, 3, 5, 8 in a 64-token chunk.
  """
  return jax.lax.optimization_barrier(xs)


def chunk_kda_xla(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                  scale: float | None = None, initial_state: jax.Array | None = None,
                  output_final_state: bool = False, segment_ids: jax.Array | None = None,
                  chunk_size: int = 64, diag: str = "auto",
                  gate_lower_bound: float | None = None,
                  precision=jax.lax.Precision.HIGHEST,
                  remat: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """Chunkwise-parallel KDA in pure jax.numpy (Kimi Linear, arXiv 2510.26692; ARCH §2.4).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (≤ 0, after the gate);
      beta: [B, T, H]. bfloat16 or float32 (float64 with x64: then all math is float64).
    scale: query scale, default K ** −0.5.
    initial_state: [B, H, K, V] (cast to fp32) or None (zeros).
    output_final_state: also return the final state [B, H, K, V] fp32.
    segment_ids: [B, T] int32 packed-document ids, 0 = padding (`tiles.segment_resets`).
    chunk_size: 16, 32 or 64 tokens. T need not be a multiple (identity tokens are appended).
      A sequence shorter than the chunk runs in the smallest of 16, 32, 64 that holds it
      (`effective_chunk_size`, the same numbers up to fp32 summation order).
    diag: diagonal-tile method, "auto" | "dense" | "safe" (module docstring, `resolve_diag`).
      "auto" is safe unless `gate_lower_bound` says g ≥ g_min with |g_min| ≤ 5.87.
    gate_lower_bound: g_min of the gate that produced g (the model passes
      `cfg.kda_gate_lower_bound`), or None if unknown / unbounded.
    precision: matmul precision (HIGHEST: true fp32 on GPU/TPU, no tf32 / bf16 passes).
    remat: recompute the intra-chunk quantities (scores, inverse, W, U) in the backward pass
      from the chunked inputs instead of storing them (ARCHITECTURE §2.4 "Backward").

  Returns:
    o [B, T, H, V] in q's dtype (0 at padding tokens); the final state [B, H, K, V] fp32 (the
    accumulation dtype) if output_final_state, else None. Everything inside is fp32: cumsums,
    exponentials, scores, the triangular inverse, the state carried by the chunk scan.

  Raises:
    ValueError: chunk_size not in {16, 32, 64}; unknown diag. (Shape/dtype checks: `chunk_kda`.)
  """
  if chunk_size not in (16, 32, 64):
    raise ValueError(f"chunk_size={chunk_size}: expected 16, 32 or 64")
  diag = resolve_diag(diag, gate_lower_bound)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = effective_chunk_size(T, chunk_size)
  N = max(1, math.ceil(T / C))
  Tp = N * C
  acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  scale = K ** -0.5 if scale is None else scale

  valid, same, m0, mlast = _chunk_masks(segment_ids, B, T, Tp, C)
  if segment_ids is not None:  # padding tokens are identity steps (g = 0, β = 0)
    g = jnp.where(valid[:, :T, None, None], g.astype(acc), 0)
    beta = jnp.where(valid[:, :T, None], beta.astype(acc), 0)

  # Layout: every per-chunk quantity is [N·B·H, C, ...] (one flat batch axis; XLA:CPU has
  # crashed on batched dots with a size-1 dim between batch dims); the scan sees [N, B·H, ...].
  BH, M = B * H, N * B * H

  def to_chunks(x):  # [B, T, H, ...] -> [N·B·H, C, ...] in acc, zero-padded to Tp
    x = x.astype(acc)
    x = jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((B, N, C) + x.shape[2:])
    x = jnp.moveaxis(x, (1, 3), (0, 2))  # [N, B, H, C, ...]
    return x.reshape((M, C) + x.shape[4:])

  def mask_chunks(m):  # [B, N, C, ...] bool -> [N·B·H, C, ...]
    m = jnp.broadcast_to(jnp.moveaxis(m, 1, 0)[:, :, None], (N, B, H) + m.shape[2:])
    return m.reshape((M,) + m.shape[3:])

  qc, kc, vc, gc = (to_chunks(x) for x in (q, k, v, g))
  bc = to_chunks(beta)  # [M, C]
  if same is not None:
    same, m0, mlast = mask_chunks(same), mask_chunks(m0), mask_chunks(mlast)
  if Tp > T:
    qc, kc, vc, gc, bc, same, m0, mlast = _fence((qc, kc, vc, gc, bc, same, m0, mlast))
  intra = functools.partial(_intra_chunk, scale=scale, diag=diag, precision=precision)
  if remat:
    intra = jax.checkpoint(intra)
  W, U, Qg, A_qk, Kd, state_decay = intra(qc, kc, vc, gc, bc, same, m0, mlast)

  def step(S, xs):
    W_n, U_n, Qg_n, A_n, Kd_n, dec_n = xs
    Vp = U_n - _mm(W_n, S, precision)  # V' = U − W S
    o_n = _mm(Qg_n, S, precision) + _mm(A_n, Vp, precision)
    S = dec_n[..., :, None] * S + _mm(Kd_n, Vp, precision)
    return S, o_n

  S0 = (jnp.zeros((B, H, K, V), acc) if initial_state is None else initial_state.astype(acc))
  xs = tuple(x.reshape((N, BH) + x.shape[1:]) for x in (W, U, Qg, A_qk, Kd, state_decay))
  S, o = jax.lax.scan(step, S0.reshape(BH, K, V), xs)  # o: [N, B·H, C, V]
  if Tp > T:
    o = _fence(o)
  o = jnp.transpose(o.reshape(N, B, H, C, V), (1, 0, 3, 2, 4)).reshape(B, Tp, H, V)[:, :T]
  o = jnp.where(valid[:, :T, None, None], o, 0).astype(q.dtype)
  return o, (S.reshape(B, H, K, V) if output_final_state else None)
