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


def _kernel(xw, tq, tk, tv, cq, ck, cv, gate_ref, alog_ref, dtb_ref, og_ref, onorm_ref,
            s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, *, B, W, cols, og_col, z_col,
            scale, gate_lower_bound, l2_eps, norm_eps, dtype):
  b, h = pl.program_id(0), pl.program_id(1)

  @pl.when(b >= B)
  def _():  # a padding row of the projections (rows >= B): zero output, no state
    o_ref[b, h, :] = jnp.zeros((o_ref.shape[-1],), o_ref.dtype)

  @pl.when(b < B)
  def _():
    _row(b, h, xw, tq, tk, tv, cq, ck, cv, gate_ref, alog_ref, dtb_ref, og_ref, onorm_ref,
         s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, W=W, cols=cols, og_col=og_col,
         z_col=z_col, scale=scale, gate_lower_bound=gate_lower_bound, l2_eps=l2_eps,
         norm_eps=norm_eps, dtype=dtype)


def _row(b, h, xw, tq, tk, tv, cq, ck, cv, gate_ref, alog_ref, dtb_ref, og_ref, onorm_ref,
         s_ref, act_ref, o_ref, s_out, tq_out, tk_out, tv_out, *, W, cols, og_col, z_col, scale,
         gate_lower_bound, l2_eps, norm_eps, dtype):
  """Row b < B, head h (module docstring). xw [R, N]: the projections side by side, branch n's
  head h at columns cols[n] + h d .. + d (rounded to the compute dtype here, as XLA's
  projection rounds its fp32 accumulator); the beta logit at cols["beta"] + h. gate_ref: the
  gate's pre-activation z [R, H K] when z_col is None, else W_g_up [K, H, K], and z_h =
  round(round(xw[b, z_col:z_col + K]) W_g_up[:, h]) is computed here, as `nn.project` of the
  rounded down-projection gives it."""
  active = act_ref[b] > 0
  f32 = jnp.float32
  feats = {}
  for name, t_ref, c_ref, t_out in (("q", tq, cq, tq_out), ("k", tk, ck, tk_out),
                                    ("v", tv, cv, tv_out)):
    d = c_ref.shape[-1]
    tail_cols = pl.ds(h * d, d)
    x = xw[b, pl.ds(cols[name] + h * d, d)].astype(dtype)
    taps = [t_ref[b, i, tail_cols] for i in range(W - 1)] + [x.astype(t_ref.dtype)]
    acc = taps[W - 1].astype(f32) * c_ref[W - 1, h, :].astype(f32)
    for j in range(W - 2, -1, -1):  # lag 1 .. W-1, the order of model.kda.short_conv
      acc = acc + taps[j].astype(f32) * c_ref[j, h, :].astype(f32)
    y = acc.astype(dtype).astype(f32)
    y = y * _sigmoid(y)  # SiLU
    if name != "v":
      y = y * jax.lax.rsqrt(jnp.sum(y * y) + l2_eps)
    feats[name] = y.astype(dtype).astype(f32)
    for i in range(W - 1):  # shift the tail by one token; an idle row keeps its own
      t_out[b, i, tail_cols] = jnp.where(active, taps[i + 1], taps[i])
  q, k, v = feats["q"], feats["k"], feats["v"]
  K = q.shape[0]
  if z_col is None:
    z = gate_ref[b, pl.ds(h * K, K)].astype(f32)
  else:  # [K] @ [K, K]: the gate's second low-rank factor, this head's columns, by blocks of
    # rows (a whole [K, K] block at K = 128 held 255 registers and spilled at 4 warps)
    rows = min(K, 32)
    z = jnp.zeros((K,), f32)
    for r in range(0, K, rows):
      zd = xw[b, pl.ds(z_col + r, rows)].astype(dtype).astype(f32)
      w = gate_ref[pl.ds(r, rows), h, :].astype(dtype).astype(f32)
      z = z + jnp.sum(zd[:, None] * w, axis=0)
    z = z.astype(dtype).astype(f32)
  xg = z + dtb_ref[h, :]
  a = jnp.exp(alog_ref[h])
  if gate_lower_bound is None:
    g = -a * (jnp.maximum(xg, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(xg))))
  else:
    g = gate_lower_bound * _sigmoid(a * xg)
  g = jnp.where(active, g, 0.0)
  beta = jnp.where(active, _sigmoid(xw[b, cols["beta"] + h].astype(f32)), 0.0)
  S = jnp.exp(g)[:, None] * s_ref[b, h, :, :]
  pred = jnp.sum(S * k[:, None], axis=0)
  S = S + (beta * k)[:, None] * (v - pred)[None, :]
  s_out[b, h, :, :] = S
  o = jnp.sum(S * (q * scale)[:, None], axis=0).astype(dtype).astype(f32)
  o = o * jax.lax.rsqrt(jnp.mean(o * o) + norm_eps) * onorm_ref[...]
  V = o.shape[0]
  og = og_ref[b, pl.ds(og_col + h * V, V)].astype(f32)
  o_ref[b, h, :] = (o * _sigmoid(og)).astype(o_ref.dtype)


def kda_step(S: jax.Array, xw: jax.Array, cols: dict, tails: dict, conv: dict,
             z: jax.Array | None, A_log: jax.Array, dt_bias: jax.Array, og_logit: jax.Array,
             o_norm: jax.Array, active: jax.Array, *, dtype, og_col: int = 0,
             w_g_up: jax.Array | None = None, scale: float,
             gate_lower_bound: float | None, l2_eps: float, norm_eps: float, num_warps: int = 4,
             interpret: bool = False) -> tuple[jax.Array, jax.Array, dict]:
  """One KDA token per row (module docstring), one program per (row, head). The projections
  come as one array, the layer's input projections side by side (one GEMM's output,
  `sparse_lm.inference.fused.kda_input_matrix`), and may carry zero rows past B (the GEMM's
  padding, `sparse_lm.inference.forward.pad_rows`): no slice kernel runs between the GEMM and
  this one.

  Args:
    S: [B, H, K, V] fp32 recurrent state.
    xw: [R, N] the projections, R >= B rows (rows past B are not read), fp32 (the GEMM's
      accumulator: x W_q|k|v are rounded to `dtype` here, the beta logit is not) or `dtype`.
    cols: static first columns in xw of "q", "k" ([H K] each, head-major), "v" ([H V]) and
      "beta" ([H]); with `w_g_up`, also "g_down" ([K]: x W_g_down).
    tails: {"q", "k": [B, W-1, H K], "v": [B, W-1, H V]} the last W-1 conv inputs.
    conv: {"q", "k": [W, H, K], "v": [W, H, V]} conv kernels (w[W-1] multiplies the token).
    z: [R, H K] gate pre-activation (x W_g_down) W_g_up; None with `w_g_up`.
    A_log: [H] fp32; dt_bias: [H K] fp32.
    og_logit: [R, M] holding x W_og (before the sigmoid) at columns og_col .. og_col + H V
      (head-major); any float dtype, read as fp32. May be xw itself.
    o_norm: [V] fp32 output-norm scale.
    active: [B] int32, 0 = identity step (idle slot).
    og_col: static first column of x W_og in og_logit.
    w_g_up: [K, H, K] the gate's second low-rank factor: z is computed here from xw's
      "g_down" columns (each program reads its head's [K, K] block; no GEMM or slice kernel
      between the input GEMM and this one). Exclusive with `z`.
    dtype: the compute dtype (rounding of the conv input and output, q, k, v, o; y's dtype).
    scale: query scale (K ** -0.5); gate_lower_bound: g_min in [-5, 0) or None (unbounded);
    l2_eps: q/k L2-norm epsilon; norm_eps: output RMSNorm epsilon.
    num_warps: Triton warps per program.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    (y [R, H, V] in `dtype`: the gated, normalised output (W_o's input; rows past B zero),
    the new state [B, H, K, V] fp32, the new tails (same shapes and dtypes)).

  Raises:
    ValueError: K or V not a power of two >= 16 when compiling for the GPU; a column range of
      `cols` outside xw; both or neither of `z` and `w_g_up`; w_g_up not [K, H, K].
  """
  B, H, K, V = S.shape
  R, N = xw.shape
  W = conv["q"].shape[0]
  if not interpret and not (is_pow2(K) and is_pow2(V)):
    raise ValueError(f"kda_step: K={K}, V={V} must be powers of two >= 16 on the GPU")
  if (z is None) == (w_g_up is None):
    raise ValueError("kda_step: pass the gate's pre-activation as z, or its down-projection's "
                     "columns (cols['g_down']) with w_g_up, not both or neither")
  widths = {"q": H * K, "k": H * K, "v": H * V, "beta": H}
  if w_g_up is not None:
    if w_g_up.shape != (K, H, K):
      raise ValueError(f"kda_step: w_g_up {w_g_up.shape} must be [K, H, K] = {(K, H, K)}")
    widths["g_down"] = K
  for n, w in widths.items():
    if not 0 <= cols[n] <= N - w:
      raise ValueError(f"kda_step: cols[{n!r}]={cols[n]} + width {w} is outside xw's {N} "
                       "columns; pass the offsets of fused.kda_input_matrix")
  og_width = og_logit.size // og_logit.shape[0]
  if not 0 <= og_col <= og_width - H * V:
    raise ValueError(f"kda_step: og_col={og_col} + width {H * V} is outside og_logit's "
                     f"{og_width} columns")
  dtype = jnp.dtype(dtype)
  kernel = functools.partial(_kernel, B=B, W=W, cols={n: int(cols[n]) for n in widths},
                             og_col=int(og_col),
                             z_col=None if w_g_up is None else int(cols["g_down"]),
                             scale=float(scale), gate_lower_bound=gate_lower_bound,
                             l2_eps=float(l2_eps), norm_eps=float(norm_eps), dtype=dtype)
  out_shape = [jax.ShapeDtypeStruct((R, H, V), dtype), jax.ShapeDtypeStruct(S.shape, S.dtype)]
  out_shape += [jax.ShapeDtypeStruct(tails[n].shape, tails[n].dtype) for n in _BRANCHES]
  args = ([xw] + [tails[n] for n in _BRANCHES] + [conv[n] for n in _BRANCHES] +
          [z.reshape(z.shape[0], H * K) if w_g_up is None else w_g_up, A_log.astype(jnp.float32),
           dt_bias.astype(jnp.float32).reshape(H, K), og_logit.reshape(og_logit.shape[0], -1),
           o_norm.astype(jnp.float32), S, active.astype(jnp.int32)])
  # S and the tails are updated in place: inputs 12 (S), 1-3 (tails) -> outputs 1, 2-4.
  aliases = {12: 1, 1: 2, 2: 3, 3: 4}
  y, S, tq, tk, tv = pl.pallas_call(
      kernel, grid=(R, H), out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=compiler_params(interpret, num_warps=num_warps), interpret=interpret,
      name="kda_decode_step")(*args)
  return y, S, {"q": tq, "k": tk, "v": tv}
