"""KDA on NVIDIA GPUs: the intra-chunk step as two whole-chunk Pallas kernels (or batched XLA
ops), the sequential inter-chunk state pass as a Pallas kernel (Triton lowering) with its own
backward kernel, the output as batched matmuls.

Where it runs: CUDA GPUs (measured on an H200, docs/benchmarks.md); "auto" picks it on Hopper
(compute capability ≥ 9.0). On CPU only with `interpret=True` (slow emulation, for tests).
Source: Kimi Linear (arXiv 2510.26692) §3 (chunkwise WY form of the gated delta rule);
ARCHITECTURE.md §2.4 (algorithm, exponent safety) and §2.5 (contract).

Structure (C-token chunks, N = T / C of them, every equation as in xla.py's docstring):
  1. intra-chunk, parallel over all B·H·N chunks: the pairwise scores A_kk, A_qk on 16-token
     sub-tiles, X = (I + A_kk)⁻¹, W, U, Q ⊙ Γ, Kd = (K ⊙ e^(G_C − G) ⊙ m_C)ᵀ and the chunk
     decay. `intra="wy"` (what "auto" picks for the lower-bounded gate's dense diagonal tiles
     and bf16 inputs; "wy" also runs fp32): pallas_gpu_wy.py, Pallas kernels reading q, k,
     v, g, β in their [B, T, H, ·] layout (forward: scores and the inverse by 16-row tiles,
     one call per tile, then W, U, Q ⊙ Γ, Kd per chunk and channel block; backward: dX per
     chunk, then the pairwise chain rule by 16-row tiles per chunk and channel block); the
     intra-chunk step fwd+bwd 2.94 against 4.19 ms for the XLA step on an H100 (2026-12-05,
     docs/benchmarks.md; before the scores' per-tile calls). `intra="xla"` (what "auto"
     picks otherwise): xla._intra_chunk as batched XLA ops differentiated by autodiff, with
     the inverse by
     `blocked_unit_lower_inverse` and the in-chunk cumulative sums as triangular matmuls
     (xla.tri_cumsum, not XLA's O(C²) reduce-window cumsum).
  2. state pass, sequential over chunks only (pallas_gpu_kernels.py, custom VJP): the states H_n
     entering every chunk and V'_n = U_n − W_n H_n, one Pallas program per (head, value block);
     its backward kernel runs only the ∂S recursion, the other gradients are batched matmuls.
  3. output, parallel: O_n = (Q ⊙ Γ)_n H_n + A_qk,n V'_n (batched matmul).
What this is not (yet): a Mosaic GPU (wgmma/TMA) kernel as issue 16 asks; the kernels use
Pallas's Triton lowering, and steps 2-3's gradients other than ∂S are XLA matmuls.
`fused=True` runs step 1 as the older per-chunk fused Triton kernels instead
(pallas_gpu_intra.py, 16-row tiles and row-serial substitution: exact, 3× slower than the XLA
step on an H200, docs/benchmarks.md).

Precision: `precision=None` runs the matmuls of steps 1-3 at DEFAULT (TF32 tensor cores on
NVIDIA) for bf16 inputs and HIGHEST (true fp32) for fp32/fp64 inputs; the triangular inverse is
always HIGHEST (3×TF32 inside the wy kernels on a GPU), and so are the diagonal 16 × 16 tiles
of the wy kernels' pairwise backward (their e^(±75) products cancel in ∂g: at TF32 the
saturated gate's dg was 2.8e-2 of the 2e-2 bound on an H100; pallas_gpu_wy._diag); the
forward's diagonal score tiles are TF32 (pallas_gpu_wy._diag_scores).
`precision=BF16_OPERANDS` (opt-in) rounds the kernels' other operands to bf16 instead of
TF32's 10-bit mantissa (chunk_kda_pallas_gpu). Accumulation and the running state are fp32.
Storage (`store_dtype`): bf16 q, k, v are read as bf16 and promoted to fp32 once (the
same values); with bf16 q, k and v the arrays passed between steps 1, 2 and 3 (W, U, Kd,
Q ⊙ Γ, A_qk, H_n, V') and their cotangents are stored in bf16, as fla and
jax-linear-attention store theirs; otherwise fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from pallas_kernels.kda import xla as kda_xla
from pallas_kernels.kda.pallas_gpu_intra import intra_chunk
from pallas_kernels.kda.pallas_gpu_kernels import (BF16_OPERANDS, state_bwd_kernel,
                                                   state_fwd_kernel)
from pallas_kernels.kda.pallas_gpu_wy import intra_chunk_wy
from pallas_kernels.kda.tiles import SAVE_NAME, SUB, resolve_diag
from pallas_kernels.platform import compute_capability

MIN_HOPPER = 9.0  # compute capability from which "auto" picks this backend


def supported_on(device) -> bool:
  """Where "auto" picks this backend: NVIDIA GPUs of compute capability ≥ 9.0 (Hopper)."""
  return compute_capability(device) >= MIN_HOPPER


@kda_xla.inverse_with_closed_form_jvp
def blocked_unit_lower_inverse(A):
  """(I + A)⁻¹ for strictly lower-triangular A [..., C, C] fp32, C a multiple of SUB = 16.

  The SUB × SUB diagonal blocks are inverted by row-wise forward substitution
  (xla._unit_lower_inverse, a quarter of the data per step at C = 64); block row a is then
  X[a, :a] = −X_aa (A[a, :a] X[:a, :a]), one pair of batched matmuls per block row (HIGHEST).
  Row i depends only on rows ≤ i of A (the zeros above the diagonal are exact): causal bit for
  bit. Derivative: the closed form dX = −X dA X.
  """
  C = A.shape[-1]
  n = C // SUB
  hi = jax.lax.Precision.HIGHEST
  blocks = jnp.stack([A[..., a * SUB:(a + 1) * SUB, a * SUB:(a + 1) * SUB] for a in range(n)],
                     axis=-3)
  Xd = kda_xla._unit_lower_inverse(blocks)  # [..., n, SUB, SUB]
  X = Xd[..., 0, :, :]
  for a in range(1, n):
    rows = A[..., a * SUB:(a + 1) * SUB, :a * SUB]
    off = -jnp.matmul(Xd[..., a, :, :], jnp.matmul(rows, X, precision=hi), precision=hi)
    top = jnp.concatenate([X, jnp.zeros(X.shape[:-1] + (SUB,), X.dtype)], axis=-1)
    X = jnp.concatenate([top, jnp.concatenate([off, Xd[..., a, :, :]], axis=-1)], axis=-2)
  return X


def _xla_precision(precision):
  """The precision of the XLA matmuls around the kernels: BF16_OPERANDS (a kernel-side
  rounding of the operands) is DEFAULT there (bf16 GEMMs for the bf16-stored arrays)."""
  return jax.lax.Precision.DEFAULT if precision == BF16_OPERANDS else precision


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


def _params(interpret, num_warps=4):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


def _fwd_call(w, u, kd, dec, h0, C, BV, precision, interpret):
  BH, Tp, Kp = w.shape
  Vp = u.shape[-1]
  N = Tp // C
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((BH, N, Kp, Vp), u.dtype),
               jax.ShapeDtypeStruct((BH, Tp, Vp), u.dtype),
               jax.ShapeDtypeStruct((BH, Kp, Vp), f32)]
  kernel = functools.partial(state_fwd_kernel, num_chunks=N, C=C, BV=BV, precision=precision)
  return pl.pallas_call(kernel, grid=(BH, Vp // BV), out_shape=out_shape,
                        compiler_params=_params(interpret), interpret=interpret,
                        name="kda_state_fwd")(w, u, kd, dec, h0)


def _bwd_call(w, kd, dec, dvn, dhs, dht, C, BV, precision, interpret):
  BH, Tp, Kp = w.shape
  Vp = dvn.shape[-1]
  N = Tp // C
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((BH, N, Kp, Vp), dvn.dtype),
               jax.ShapeDtypeStruct((BH, Kp, Vp), f32)]
  kernel = functools.partial(state_bwd_kernel, num_chunks=N, C=C, BV=BV, precision=precision)
  return pl.pallas_call(kernel, grid=(BH, Vp // BV), out_shape=out_shape,
                        compiler_params=_params(interpret), interpret=interpret,
                        name="kda_state_bwd")(w, kd, dec, dvn, dhs, dht)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def state_pass(w, u, kd, dec, h0, C, BV, precision, interpret):
  """The inter-chunk state pass (module docstring, step 2) with a hand-written backward.

  Args:
    w [BH, Tp, K], u [BH, Tp, V], kd [BH, N, K, C]: the storage dtype (fp32 or bf16, all three
      the same); dec [BH, N, K], h0 [BH, K, V]: fp32. K and V powers of two ≥ 16, Tp = N·C.
      C: chunk size; BV: value columns per program (divides V); precision: of the in-kernel
      matmuls; interpret: Pallas interpret mode.

  Returns:
    hs [BH, N, K, V] (the state entering each chunk) and vn [BH, Tp, V] (V' = U − W H) in u's
    dtype, and the final state [BH, K, V] fp32. The state is carried in fp32 inside the
    kernel; only what it writes out is rounded to the storage dtype.
  """
  return _fwd_call(w, u, kd, dec, h0, C, BV, precision, interpret)


def _state_pass_fwd(w, u, kd, dec, h0, C, BV, precision, interpret):
  hs, vn, ht = (checkpoint_name(x, SAVE_NAME)
                for x in _fwd_call(w, u, kd, dec, h0, C, BV, precision, interpret))
  return (hs, vn, ht), (w, kd, dec, hs, vn)


def _state_pass_bwd(C, BV, precision, interpret, res, cts):
  """∂L/∂S after every chunk from the sequential kernel, then (batched over all chunks n):
  ∂U_n = ∂V'_n + Kd_nᵀ ∂S_n, ∂Kd_n = ∂S_n V'_nᵀ, ∂d_n = Σ_v ∂S_n ⊙ H_n, ∂W_n = −∂U_n H_nᵀ."""
  w, kd, dec, hs, vn = res
  f32 = jnp.float32
  dhs, dvn = (x.astype(vn.dtype) for x in cts[:2])
  dht = cts[2].astype(f32)
  ds, dh0 = _bwd_call(w, kd, dec, dvn, dhs, dht, C, BV, precision, interpret)
  BH, N, Kp, Vp = hs.shape
  mm = functools.partial(jnp.einsum, precision=_xla_precision(precision),
                         preferred_element_type=f32)
  vn4 = vn.reshape(BH, N, C, Vp)
  du = dvn.reshape(BH, N, C, Vp).astype(f32) + mm("bnkc,bnkv->bncv", kd, ds)
  dkd = mm("bnkv,bncv->bnkc", ds, vn4)
  ddec = jnp.sum(ds.astype(f32) * hs.astype(f32), axis=-1)
  dw = -mm("bncv,bnkv->bnck", du, hs)
  return (dw.reshape(BH, N * C, Kp).astype(w.dtype),
          du.reshape(BH, N * C, Vp).astype(vn.dtype), dkd.astype(kd.dtype), ddec, dh0)


state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def _intra_wy(q, k, v, g, beta, doc, m0, mlast, C, Tp, Kp, Vp, scale, precision, store,
              interpret):
  """The intra-chunk step through pallas_gpu_wy's kernels: q, k, v, g, β stay in their
  [B, T, H, ·] layout (padded to Tp tokens and Kp / Vp channels only where they are not
  already), q, k, v in their own dtype; g, β as fp32 (g, β already 0 at padding tokens)."""
  B, T = q.shape[:2]

  def pad(x, d=None):
    widths = [(0, 0), (0, Tp - T), (0, 0)] + ([(0, d - x.shape[-1])] if d else [])
    return jnp.pad(x, widths) if any(w != (0, 0) for w in widths) else x

  masks = None
  if doc is not None:
    masks = (doc.reshape(B, Tp).astype(jnp.int32), m0.reshape(B, Tp).astype(jnp.float32),
             mlast.reshape(B, Tp).astype(jnp.float32))
  return intra_chunk_wy(pad(q, Kp), pad(k, Kp), pad(v, Vp), pad(g.astype(jnp.float32), Kp),
                        pad(beta.astype(jnp.float32)), masks, C, scale, precision, store,
                        interpret)


def _store_dtype(store_dtype, in_dtypes):
  """The dtype `chunk_kda_pallas_gpu` stores its intermediates in (its `store_dtype` arg);
  in_dtypes: the dtypes of q, k, v. "auto" is bf16 only when all three are bf16."""
  if isinstance(store_dtype, str) and store_dtype == "auto":
    return jnp.bfloat16 if all(d == jnp.bfloat16 for d in in_dtypes) else jnp.float32
  if store_dtype is None:
    return jnp.float32
  try:
    dt = jnp.dtype(store_dtype)
  except TypeError:
    dt = None
  if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"store_dtype={store_dtype!r}: expected 'auto', None, jnp.float32 or "
                     "jnp.bfloat16")
  if dt == jnp.bfloat16 and any(d == jnp.float64 for d in in_dtypes):
    raise ValueError("store_dtype=bfloat16 with float64 inputs: use store_dtype='auto' or "
                     "jnp.float32 (or the 'xla' backend for fp64 work)")
  return jnp.float32 if dt == jnp.float32 else jnp.bfloat16


def chunk_kda_pallas_gpu(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None,
    output_final_state: bool = False, segment_ids: jax.Array | None = None,
    chunk_size: int = 64, interpret: bool = False, diag: str = "auto",
    gate_lower_bound: float | None = None, precision=None, block_v: int = 32,
    fused: bool = False, store_dtype="auto", intra: str = "auto",
) -> tuple[jax.Array, jax.Array | None]:
  """Chunked KDA with a Pallas GPU state pass (Kimi Linear, arXiv 2510.26692; ARCH §2.4).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay after the gate (≤ 0);
      beta: [B, T, H]. bfloat16 or float32 (fp32 math inside; with float64 inputs the state
      pass still runs in fp32: use "xla" for fp64 work).
    scale: query scale, default K ** -0.5.
    initial_state: [B, H, K, V] (cast to fp32) or None (zeros).
    output_final_state: return the final state [B, H, K, V] fp32.
    segment_ids: [B, T] int32 packed-document ids, 0 = padding (identity step, zero output).
    chunk_size: 16, 32 or 64. T need not be a multiple (identity tokens are appended).
    interpret: run the Pallas kernels in interpret mode (CPU tests).
    diag: diagonal-tile method, "auto" | "dense" | "safe" (tiles.resolve_diag): "auto" is dense
      only when `gate_lower_bound` promises g ≥ g_min with |g_min| ≤ 88/15.
    gate_lower_bound: g_min of the gate that produced g (−5.0 for the bounded gate), or None.
    precision: matmul precision of all steps; None = DEFAULT for bf16 inputs, else HIGHEST.
      `pallas_gpu_kernels.BF16_OPERANDS`: the Pallas kernels' products on operands rounded to
      bf16 (fp32 accumulation; bf16 tensor-core MMA as fla's kernels use), except the
      diagonal tiles' products (TF32 in the forward's scores, 3×TF32 in the backward) and the
      triangular inverse (3×TF32); XLA's matmuls at DEFAULT.
      Within the §2.5 bf16 bounds in its three test cases (interpret mode, against the fp64
      reference: o ≤ 3.3e-3, dq dk ≤ 3.9e-3, dg dβ ≤ 4.5e-3; on an H100 the saturated
      case's dg was 1.4e-2 of 2e-2 with TF32 diagonal tiles, 2.9e-3 with the backward's at
      3×TF32). fwd+bwd on an H100 (2026-12-06,
      docs/benchmarks.md, with TF32 diagonal tiles): the same at T = 8K, 4-6% faster at 32K,
      64K and B=8 H=8 T=8K; not the default.
    block_v: value columns per state-pass program (a power of two; capped at the padded V).
    fused: with dense diagonal tiles and fp32/bf16 inputs, run the intra-chunk work as one
      fused Triton kernel per chunk, forward and backward (pallas_gpu_intra.py). Off by
      default: measured 3× slower than the XLA intra-chunk path on an H200 (61 against
      20.6 ms fwd+bwd at T = 32K, H = 16, 2026-12-01, before the bf16 storage;
      docs/benchmarks.md). False (and always for the safe path or fp64 inputs): XLA ops
      differentiated by autodiff.
    store_dtype: dtype of the arrays between the intra-chunk step, the state pass and the
      output (W, U, Kd, Q ⊙ Γ, A_qk, the chunk states H_n, V', and in the backward pass their
      cotangents and the state pass's ∂S); the math that makes and reads them stays fp32.
      "auto" (default): bfloat16 when q, k and v are all bfloat16 (as fla's and
      jax-linear-attention's kernels store them; on an H200 fwd+bwd at T = 32K, H = 16 went
      19.96 -> 17.67 ms with it, errors still within §2.5, measured before the bf16 q, k, v
      were promoted once instead of at each read; docs/benchmarks.md), else float32.
      None or jnp.float32: fp32 storage.
    intra: how the intra-chunk step runs. "xla": batched XLA ops differentiated by autodiff;
      "wy": the Pallas kernels of pallas_gpu_wy.py, forward and hand-written backward (dense
      diagonal tiles and fp32 / bf16 inputs only; at B=1, H=16, T=8K on an H100, 2026-12-05:
      the intra-chunk step fwd+bwd 2.94 against 4.19 ms for the XLA step in one run, the
      operator 4.60 ms, docs/benchmarks.md); "auto" (default): "wy" for bf16 q, k, v where it
      applies (where it was measured), else "xla".
      `fused=True` overrides it with the per-chunk kernels of pallas_gpu_intra.py.

  Returns:
    (o [B, T, H, V] in q's dtype, 0 at padding tokens; final state [B, H, K, V] fp32 or None).

  Raises:
    ValueError: chunk_size not in {16, 32, 64}; block_v not a power of two ≥ 16; unknown diag;
      intra not "auto", "wy" or "xla", or "wy" where it does not apply; store_dtype not one
      of "auto", None, float32, bfloat16, or bfloat16 with float64 inputs.
  """
  C = chunk_size
  if C not in (16, 32, 64):
    raise ValueError(f"chunk_size={C}: expected 16, 32 or 64")
  if block_v < 16 or block_v & (block_v - 1):
    raise ValueError(f"block_v={block_v}: expected a power of two >= 16")
  diag = resolve_diag(diag, gate_lower_bound)
  store_dtype = _store_dtype(store_dtype, (q.dtype, k.dtype, v.dtype))
  wy_applies = diag == "dense" and all(x.dtype in (jnp.float32, jnp.bfloat16) for x in (q, k, v))
  if intra not in ("auto", "wy", "xla"):
    raise ValueError(f"intra={intra!r}: expected 'auto', 'wy' or 'xla'")
  if intra == "wy" and not wy_applies:
    raise ValueError("intra='wy' needs dense diagonal tiles (a gate_lower_bound, or "
                     "diag='dense') and float32 / bfloat16 q, k, v; use intra='xla'")
  # "auto" runs the kernels where they were measured faster: bf16 q, k, v. fp32 inputs keep
  # the XLA step (the kernels' products would be IEEE fp32 FMA dots; not timed).
  wy_auto = wy_applies and all(x.dtype == jnp.bfloat16 for x in (q, k, v))
  use_wy = (intra == "wy" or (intra == "auto" and wy_auto)) and not fused
  if precision is None:
    hi = q.dtype != jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if hi else jax.lax.Precision.DEFAULT
  B, T, H, K = q.shape
  V = v.shape[-1]
  Kp, Vp = _pow2(K), _pow2(V)
  BV = min(block_v, Vp)
  N = max(1, math.ceil(T / C))
  Tp, BH = N * C, B * H
  M = BH * N
  acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  scale = K ** -0.5 if scale is None else scale

  valid, doc, m0, mlast = kda_xla._chunk_docs(segment_ids, B, T, Tp, C)
  if segment_ids is not None:  # padding tokens are identity steps (g = 0, β = 0)
    g = jnp.where(valid[:, :T, None, None], g.astype(acc), 0)
    beta = jnp.where(valid[:, :T, None], beta.astype(acc), 0)

  def to_chunks(x, dp=None, dtype=acc):  # [B, T, H, d] -> [B·H·N, C, dp] (zero padded)
    x = x.astype(dtype)
    pad = [(0, 0), (0, Tp - T), (0, 0)] + ([(0, dp - x.shape[-1])] if dp else [])
    x = jnp.moveaxis(jnp.pad(x, pad), 2, 1)  # [B, H, Tp, ...]
    return x.reshape((M, C) + x.shape[3:])

  def mask_chunks(m):  # [B, N, ...] -> [B·H·N, ...]
    m = jnp.broadcast_to(m[:, None], (B, H) + m.shape[1:])
    return m.reshape((M,) + m.shape[3:])

  # bf16 q, k, v move through the layout change as bf16 (half the bytes) and are promoted to
  # the accumulation dtype once after it: the same values as before, and in the backward pass
  # their cotangents are summed in fp32 and rounded to bf16 once, at the layout change.
  if use_wy:
    W, U, Qg, A_qk, Kd, dec = _intra_wy(q, k, v, g, beta, doc, m0, mlast, C, Tp, Kp, Vp,
                                        scale, precision, store_dtype, interpret)
    Qg, A_qk = Qg.reshape(M, C, Kp), A_qk.reshape(M, C, C)
  else:
    keep = lambda x: x.dtype if x.dtype == jnp.bfloat16 else acc
    qc, kc = (to_chunks(x, Kp, keep(x)).astype(acc) for x in (q, k))
    gc = to_chunks(g, Kp)
    vc = to_chunks(v, Vp, keep(v)).astype(acc)
    bc = to_chunks(beta)
    if doc is not None:
      doc, m0, mlast = mask_chunks(doc), mask_chunks(m0), mask_chunks(mlast)
    if diag == "dense" and fused and acc == jnp.float32:
      masks = (None,) * 3 if doc is None else tuple(
          x.astype(jnp.float32) for x in (doc, m0, mlast))
      W, U, Qg, A_qk, Kd, dec = intra_chunk(qc, kc, vc, gc, bc, *masks, scale, precision,
                                            interpret)
    else:
      same = None if doc is None else doc[..., :, None] == doc[..., None, :]
      W, U, Qg, A_qk, Kd, dec = kda_xla._intra_chunk(qc, kc, vc, gc, bc, same, m0, mlast,
                                                     scale=scale, diag=diag,
                                                     precision=_xla_precision(precision),
                                                     inverse=blocked_unit_lower_inverse,
                                                     matmul_cumsum=True)
  if initial_state is None:
    h0 = jnp.zeros((BH, Kp, Vp), jnp.float32)
  else:
    h0 = initial_state.astype(jnp.float32).reshape(BH, K, V)
    h0 = jnp.pad(h0, ((0, 0), (0, Kp - K), (0, Vp - V)))
  st = store_dtype
  f32 = lambda x: x.astype(jnp.float32)
  hs, vn, ht = state_pass(W.astype(st).reshape(BH, Tp, Kp), U.astype(st).reshape(BH, Tp, Vp),
                          Kd.astype(st).reshape(BH, N, Kp, C), f32(dec).reshape(BH, N, Kp), h0,
                          C, BV, precision, interpret)
  hs, vn = hs.reshape(M, Kp, Vp), vn.reshape(M, C, Vp)
  if st == jnp.float32:
    hs, vn = hs.astype(acc), vn.astype(acc)
  else:
    Qg, A_qk = Qg.astype(st), A_qk.astype(st)
  xp = _xla_precision(precision)
  o = (jnp.matmul(Qg, hs, precision=xp, preferred_element_type=acc)
       + jnp.matmul(A_qk, vn, precision=xp, preferred_element_type=acc))  # [M, C, Vp]
  o = jnp.moveaxis(o.reshape(B, H, Tp, Vp), 1, 2)[:, :T, :, :V]
  o = checkpoint_name(jnp.where(valid[:, :T, None, None], o, 0).astype(q.dtype), SAVE_NAME)
  if not output_final_state:
    return o, None
  return o, ht.reshape(B, H, Kp, Vp)[:, :, :K, :V]
