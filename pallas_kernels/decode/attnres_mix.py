"""One Block-AttnRes read fused with the sub-layer's pre-norm (ARCHITECTURE.md §4; Attention
Residuals, arXiv 2603.15031).

Per row (one token), with sources s_0 .. s_{N-1} (the embedding and the committed block sums)
and the running block sum p (after adding the last sub-layer output y, when given):

    p     = p + y                                            (optional)
    l_j   = w · RMSNorm(s_j)     (-inf for slots not yet filled; for p unless p_valid)
    alpha = softmax_j(l)
    x     = RMSNorm(sum_j alpha_j s_j) * norm_scale          the sub-layer's input

All math in fp32; x is returned in the compute dtype and p in fp32 (the stream's partial sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode.common import compiler_params, is_pow2


def _rms(x, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x) + eps)


def _kernel(*refs, N, B, has_y, mix_eps, norm_eps):
  b = pl.program_id(0)

  @pl.when(b >= B)
  def _():  # a padding row (rows >= B): zeros, for the next GEMM's second row
    x_out = refs[-2]
    x_out[b, :] = jnp.zeros((x_out.shape[-1],), x_out.dtype)

  @pl.when(b < B)
  def _():
    _row(b, *refs, N=N, has_y=has_y, mix_eps=mix_eps, norm_eps=norm_eps)


def _row(b, *refs, N, has_y, mix_eps, norm_eps):
  """Row b < B (module docstring)."""
  if has_y:
    stack, valid, partial, pvalid, y_ref, query, scale, x_out, p_out = refs
  else:
    stack, valid, partial, pvalid, query, scale, x_out, p_out = refs
  f32 = jnp.float32
  w = query[...]
  p = partial[b, :]
  if has_y:
    p = p + y_ref[b, :].astype(f32)
  p_out[b, :] = p
  srcs = [stack[j, b, :].astype(f32) for j in range(N)]
  logits = [jnp.where(valid[j] > 0, jnp.sum(_rms(s, mix_eps) * w), -jnp.inf)
            for j, s in enumerate(srcs)]
  lp = jnp.where(pvalid[0] > 0, jnp.sum(_rms(p, mix_eps) * w), -jnp.inf)
  m = lp
  for l in logits:
    m = jnp.maximum(m, l)
  ep = jnp.exp(lp - m)
  den, h = ep, ep * p
  for l, s in zip(logits, srcs):
    e = jnp.exp(l - m)
    den, h = den + e, h + e * s
  x_out[b, :] = (_rms(h / den, norm_eps) * scale[...]).astype(x_out.dtype)


def attnres_mix(stack: jax.Array, valid: jax.Array, partial: jax.Array,
                partial_valid: jax.Array, query: jax.Array, norm_scale: jax.Array, *,
                y: jax.Array | None = None, mix_eps: float, norm_eps: float, dtype,
                rows: int = 0, num_warps: int = 4,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """The normalised input of a sub-layer from the AttnRes stream (module docstring).

  Args:
    stack: [N, B, D] committed sources (any float dtype).
    valid: [N] bool or int, which slots hold a source (slot 0, the embedding, must).
    partial: [B, D] fp32 running block sum; partial_valid: bool scalar, whether it is a source
      (after adding y it always is: pass True).
    query: [D] the sub-layer's pseudo-query; norm_scale: [D] its pre-norm's scale.
    y: optional [B, D] previous sub-layer output, added into partial first.
    mix_eps: RMSNorm epsilon of the keys; norm_eps: of the pre-norm. dtype: of the result.
    rows: x gets max(B, rows) rows, zeros past B: the zero-padded rows the next GEMMs take
      (`sparse_lm.inference.forward.pad_rows`), written here instead of by a pad kernel.
    num_warps: Triton warps per program.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    (x [max(B, rows), D] in dtype, partial [B, D] fp32 (with y added)).

  Raises:
    ValueError: D not a power of two >= 16 when compiling for the GPU.
  """
  N, B, D = stack.shape
  if not interpret and not is_pow2(D):
    raise ValueError(f"attnres_mix: D={D} must be a power of two >= 16 on the GPU")
  R = max(B, rows)
  kernel = functools.partial(_kernel, N=N, B=B, has_y=y is not None, mix_eps=float(mix_eps),
                             norm_eps=float(norm_eps))
  args = [stack, jnp.asarray(valid).astype(jnp.int32), partial.astype(jnp.float32),
          jnp.asarray(partial_valid).astype(jnp.int32).reshape(1)]
  args += [] if y is None else [y]
  args += [query.astype(jnp.float32), norm_scale.astype(jnp.float32)]
  out_shape = [jax.ShapeDtypeStruct((R, D), dtype), jax.ShapeDtypeStruct((B, D), jnp.float32)]
  return pl.pallas_call(kernel, grid=(R,), out_shape=out_shape,
                        compiler_params=compiler_params(interpret, num_warps=num_warps),
                        interpret=interpret, name="attnres_mix")(*args)
