"""KDA at one token per row, fused (ARCHITECTURE.md §2.1-§2.3; Kimi Linear, arXiv 2510.26692).

Per (row b, head h), from the layer's projections x W (computed by XLA GEMMs):

    c_t  = sum_j w[j] [tail_0 .. tail_{W-2}, x W]_j      short conv (depthwise, per channel)
    q    = L2Norm(SiLU(c_q)),  k = L2Norm(SiLU(c_k)),  v = SiLU(c_v)
    g    = kda_gate(z, A_log, dt_bias)                    g_min sigmoid(e^A (z + dt)) or
                                                          -e^A softplus(z + dt)
    beta = sigmoid(x W_beta)
    S~   = Diag(e^g) S;  S = S~ + beta k (v - S~ᵀ k)ᵀ;  o = Sᵀ (scale q)
    y    = RMSNorm(o) * o_norm * sigmoid(x W_og)          the input of W_o

The state is read and written once, in place (aliased); the conv tails shift by one. A row
with active[b] = 0 is an identity step (g = 0, beta = 0: its state and tails are unchanged),
as the engine's idle slots. Rounding follows the pure-JAX path (`kda_projections`,
`recurrent_step`, `kda_output`): the conv output, q, k, v and o are rounded to the compute
dtype where that path rounds them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode.common import compiler_params, is_pow2

_BRANCHES = ("q", "k", "v")


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _kernel(xq, xk, xv, tq, tk, tv, cq, ck, cv, z_ref, alog_ref, dtb_ref, beta_ref, og_ref,
            onorm_ref, s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, *, B, W, scale,
            gate_lower_bound, l2_eps, norm_eps, dtype):
  b, h = pl.program_id(0), pl.program_id(1)

  @pl.when(b >= B)
  def _():  # a padding row of the projections (rows >= B): zero output, no state
    o_ref[b, h, :] = jnp.zeros((o_ref.shape[-1],), o_ref.dtype)

  @pl.when(b < B)
  def _():
    _row(b, h, xq, xk, xv, tq, tk, tv, cq, ck, cv, z_ref, alog_ref, dtb_ref, beta_ref, og_ref,
         onorm_ref, s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, W=W, scale=scale,
         gate_lower_bound=gate_lower_bound, l2_eps=l2_eps, norm_eps=norm_eps, dtype=dtype)


def _row(b, h, xq, xk, xv, tq, tk, tv, cq, ck, cv, z_ref, alog_ref, dtb_ref, beta_ref, og_ref,
         onorm_ref, s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, *, W, scale,
         gate_lower_bound, l2_eps, norm_eps, dtype):
  """Row b < B, head h (module docstring)."""
  active = act_ref[b] > 0
  f32 = jnp.float32
  feats = {}
  for name, x_ref, t_ref, c_ref, t_out in (("q", xq, tq, cq, tq_out), ("k", xk, tk, ck, tk_out),
                                           ("v", xv, tv, cv, tv_out)):
    d = x_ref.shape[-1]
    cols = pl.ds(h * d, d)
    x = x_ref[b, h, :]
    taps = [t_ref[b, i, cols] for i in range(W - 1)] + [x.astype(t_ref.dtype)]
    acc = taps[W - 1].astype(f32) * c_ref[W - 1, h, :].astype(f32)
    for j in range(W - 2, -1, -1):  # lag 1 .. W-1, the order of model.kda.short_conv
      acc = acc + taps[j].astype(f32) * c_ref[j, h, :].astype(f32)
    y = acc.astype(x.dtype).astype(f32)
    y = y * _sigmoid(y)  # SiLU
    if name != "v":
      y = y * jax.lax.rsqrt(jnp.sum(y * y) + l2_eps)
    feats[name] = y.astype(dtype).astype(f32)
    for i in range(W - 1):  # shift the tail by one token; an idle row keeps its own
      t_out[b, i, cols] = jnp.where(active, taps[i + 1], taps[i])
  q, k, v = feats["q"], feats["k"], feats["v"]
  xg = z_ref[b, h, :].astype(f32) + dtb_ref[h, :]
  a = jnp.exp(alog_ref[h])
  if gate_lower_bound is None:
    g = -a * (jnp.maximum(xg, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(xg))))
  else:
    g = gate_lower_bound * _sigmoid(a * xg)
  g = jnp.where(active, g, 0.0)
  beta = jnp.where(active, _sigmoid(beta_ref[b, h]), 0.0)
  S = jnp.exp(g)[:, None] * s_ref[b, h, :, :]
  pred = jnp.sum(S * k[:, None], axis=0)
  S = S + (beta * k)[:, None] * (v - pred)[None, :]
  s_out[b, h, :, :] = S
  o = jnp.sum(S * (q * scale)[:, None], axis=0).astype(dtype).astype(f32)
  o = o * jax.lax.rsqrt(jnp.mean(o * o) + norm_eps) * onorm_ref[...]
  o_ref[b, h, :] = (o * _sigmoid(og_ref[b, h, :])).astype(o_ref.dtype)


def kda_step(S: jax.Array, x: dict, tails: dict, conv: dict, z: jax.Array, A_log: jax.Array,
             dt_bias: jax.Array, beta_logit: jax.Array, og_logit: jax.Array,
             o_norm: jax.Array, active: jax.Array, *, scale: float,
             gate_lower_bound: float | None, l2_eps: float, norm_eps: float,
             num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array, dict]:
  """One KDA token per row (module docstring), one program per (row, head); the projections
  may carry zero rows past B (the GEMMs' padding, `sparse_lm.inference.forward.pad_rows`), so
  no slice kernel runs between them and this one.

  Args:
    S: [B, H, K, V] fp32 recurrent state.
    x: {"q", "k": [R, H, K], "v": [R, H, V]} projections x W_q|k|v in the compute dtype, R >= B
      rows (the rows past B, zero padding of the GEMMs, are not read).
    tails: {"q", "k": [B, W-1, H K], "v": [B, W-1, H V]} the last W-1 conv inputs.
    conv: {"q", "k": [W, H, K], "v": [W, H, V]} conv kernels (w[W-1] multiplies the token).
    z: [R, H, K] gate pre-activation (x W_g_down) W_g_up, compute dtype.
    A_log: [H] fp32; dt_bias: [H K] fp32.
    beta_logit: [R, H] fp32 (x W_beta); og_logit: [R, H, V] fp32 (x W_og, before sigmoid).
    o_norm: [V] fp32 output-norm scale.
    active: [B] int32, 0 = identity step (idle slot).
    scale: query scale (K ** -0.5); gate_lower_bound: g_min in [-5, 0) or None (unbounded);
    l2_eps: q/k L2-norm epsilon; norm_eps: output RMSNorm epsilon.
    num_warps: Triton warps per program.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    (y [R, H, V] in the compute dtype: the gated, normalised output (W_o's input; rows past B
    zero), the new state [B, H, K, V] fp32, the new tails (same shapes and dtypes)).

  Raises:
    ValueError: K or V not a power of two >= 16 when compiling for the GPU.
  """
  B, H, K, V = S.shape
  R = x["q"].shape[0]
  W = conv["q"].shape[0]
  if not interpret and not (is_pow2(K) and is_pow2(V)):
    raise ValueError(f"kda_step: K={K}, V={V} must be powers of two >= 16 on the GPU")
  dtype = x["q"].dtype
  kernel = functools.partial(_kernel, B=B, W=W, scale=float(scale),
                             gate_lower_bound=gate_lower_bound, l2_eps=float(l2_eps),
                             norm_eps=float(norm_eps), dtype=dtype)
  out_shape = [jax.ShapeDtypeStruct((R, H, V), dtype), jax.ShapeDtypeStruct(S.shape, S.dtype)]
  out_shape += [jax.ShapeDtypeStruct(tails[n].shape, tails[n].dtype) for n in _BRANCHES]
  args = ([x[n] for n in _BRANCHES] + [tails[n] for n in _BRANCHES] +
          [conv[n] for n in _BRANCHES] +
          [z, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32).reshape(H, K),
           beta_logit.astype(jnp.float32), og_logit.astype(jnp.float32),
           o_norm.astype(jnp.float32), S, active.astype(jnp.int32)])
  # S and the tails are updated in place: inputs 15 (S), 3-5 (tails) -> outputs 1, 2-4.
  aliases = {15: 1, 3: 2, 4: 3, 5: 4}
  y, S, tq, tk, tv = pl.pallas_call(
      kernel, grid=(R, H), out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=compiler_params(interpret, num_warps=num_warps), interpret=interpret,
      name="kda_decode_step")(*args)
  return y, S, {"q": tq, "k": tk, "v": tv}
