"""Projections of a few rows, y = x W, split over both the output columns and the depth
(split-K), for the decode step's matmuls at batch 1-16.

XLA's GEMMs of two rows read the small preset's weights at ~0.5 TB/s (~4 us for 2 MB,
docs/inference.md); a kernel with one program per column block was slower still (too few
programs, each streaming its whole column block). Here program (j, i) reads the [BD, BN] block
(i, j) of W once, so a [1024, 1024] weight is 128 programs of 16 KB; each writes its fp32
partial product, and XLA sums the D / BD partials (deterministic: no atomics).

    partial[i, b, n] = sum_{d in block i} x[b, d] W[d, n];   y = sum_i partial[i]   (fp32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode.common import compiler_params

MAX_ROWS = 16


def _kernel(x_ref, w_ref, o_ref, *, B, BD, BN, use_dot):
  j, i = pl.program_id(0), pl.program_id(1)
  ns, ds = pl.ds(j * BN, BN), pl.ds(i * BD, BD)
  f32 = jnp.float32
  w = w_ref[ds, ns]
  if use_dot:  # the rows in a 16-row tile: one tensor-core product
    rows = jax.lax.broadcasted_iota(jnp.int32, (MAX_ROWS, BD), 0)
    xt = jnp.zeros((MAX_ROWS, BD), w.dtype)
    for r in range(B):
      xt = jnp.where(rows == r, x_ref[r, ds].astype(w.dtype)[None, :], xt)
    acc = jnp.dot(xt, w, preferred_element_type=f32)
    out_rows = jax.lax.broadcasted_iota(jnp.int32, (MAX_ROWS, BN), 0)
    for r in range(B):
      o_ref[i, r, ns] = jnp.sum(jnp.where(out_rows == r, acc, 0.0), axis=0)
  else:
    wf = w.astype(f32)
    for r in range(B):
      o_ref[i, r, ns] = jnp.sum(x_ref[r, ds].astype(f32)[:, None] * wf, axis=0)


def _block(n: int, pref: int) -> int:
  """The largest power of two <= pref dividing n (0 if below 16)."""
  b = pref
  while b >= 16 and n % b:
    b //= 2
  return b if b >= 16 else 0


def gemv_supported(D: int, N: int, block_n: int = 64, block_d: int = 128) -> bool:
  """Whether `gemv` runs for a [D, N] weight (power-of-two blocks >= 16 dividing D and N)."""
  return bool(_block(N, block_n) and _block(D, block_d))


def gemv(x: jax.Array, w: jax.Array, *, n_in: int = 1, dtype=None, out_dtype=None,
         block_n: int = 64, block_d: int = 128, num_warps: int = 4, use_dot: bool = True,
         interpret: bool = False) -> jax.Array:
  """x [B, *in] @ w [*in, *out] -> [B, *out]: `sparse_lm.nn.project` for B <= 16 rows.

  Args:
    x: [B, *in], cast to `dtype`; w: [*in, *out] (the first n_in dims contract), cast to
      `dtype`; dtype: of the product's inputs (default x's); out_dtype: of the result
      (default dtype).
    block_n, block_d: preferred column / depth blocks (powers of two; the largest divisor of
      N / D not above them is used). num_warps: Triton warps. use_dot: bf16 products on the
      tensor cores (fp32 inputs always multiply and reduce in fp32: no TF32).
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    y [B, *out] in out_dtype (fp32 accumulation).

  Raises:
    ValueError: B > 16, or no power-of-two block >= 16 divides N or D.
  """
  dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  out_dtype = jnp.dtype(dtype if out_dtype is None else out_dtype)
  B = x.shape[0]
  D = 1
  for s in w.shape[:n_in]:
    D *= s
  N = w.size // D
  BN, BD = _block(N, block_n), _block(D, block_d)
  if B > MAX_ROWS or not BN or not BD:
    raise ValueError(f"gemv: {B} rows x [{D}, {N}] needs B <= {MAX_ROWS} and power-of-two "
                     f"blocks >= 16 dividing D and N (block_n={block_n}, block_d={block_d})")
  kernel = functools.partial(_kernel, B=B, BD=BD, BN=BN,
                             use_dot=use_dot and dtype != jnp.float32)
  partial = pl.pallas_call(
      kernel, grid=(N // BN, D // BD),
      out_shape=jax.ShapeDtypeStruct((D // BD, B, N), jnp.float32),
      compiler_params=compiler_params(interpret, num_warps=num_warps), interpret=interpret,
      name="decode_gemv")(x.reshape(B, D).astype(dtype), w.reshape(D, N).astype(dtype))
  return jnp.sum(partial, axis=0).astype(out_dtype).reshape((B,) + w.shape[n_in:])
