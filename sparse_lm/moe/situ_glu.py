"""SiTU-GLU: the bounded gated FFN of the experts, shared experts and dense layer 0.

    SiTU-GLU(x) = W_d [ b1 tanh(g / b1) * sigmoid(g) ]  (.)  [ b2 tanh(u / b2) ],
    g = x W_g,  u = x W_u,  b1 = 4, b2 = 25            (ARCHITECTURE.md §5)

Both factors are soft-clipped, so every element of the hidden activation h satisfies
|h| < b1 * b2 = 100 whatever the input; as b1, b2 -> inf it is SwiGLU (silu(g) * u), and for
|g|, |u| << b1 it agrees with SwiGLU to O(g^3 / b1^2).

The math is in pure functions (`situ_activation`, `situ_glu`); `SiTUGLU` holds the params.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from flax import nnx

from sparse_lm import nn
from sparse_lm.config import ModelConfig


def situ_activation(g: jax.Array, u: jax.Array, beta1: float | None = 4.0,
                    beta2: float | None = 25.0, out_dtype=None) -> jax.Array:
  """Hidden activation h = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], computed in fp32.

  Args:
    g, u: gate and up pre-activations, same shape, any float dtype.
    beta1, beta2: soft-clip levels of the gate and the up branch (ARCHITECTURE §5). Both None
      gives the unclipped limit, SwiGLU h = silu(g) * u (Kimi-Linear's FFNs;
      cfg.ffn_activation="swiglu", cfg.glu_betas).
    out_dtype: dtype of h (default float32). The math runs in fp32 either way; the cast is
      inside the checkpointed function, so `situ_activation(g, u, out_dtype=bf16)` equals
      `situ_activation(g, u).astype(bf16)` in value and gradient, but its backward receives
      the cotangent in bf16: the checkpoint's barrier then never holds an fp32 copy of dh
      (on an H200 that copy was a separate 1 GB kernel per MoE layer of the `small` preset).

  Returns:
    h, same shape, out_dtype (float32 by default); |h| < beta1 * beta2 elementwise (SiTU).
  """
  out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
  return _situ(g, u, beta1, beta2, out_dtype)


# Checkpointed: the backward pass keeps only g and u (in their own, usually bf16, dtype) and
# recomputes the fp32 tanh / sigmoid terms inside the fused gradient, instead of storing
# about five fp32 copies of every [tokens·k, F] expert activation (measured: 4 GiB per
# 8K-token row for the small preset).
@functools.partial(jax.checkpoint, static_argnums=(2, 3, 4))
def _situ(g: jax.Array, u: jax.Array, beta1: float, beta2: float, out_dtype) -> jax.Array:
  g = g.astype(jnp.float32)
  u = u.astype(jnp.float32)
  if beta1 is None and beta2 is None:
    return (jax.nn.silu(g) * u).astype(out_dtype)
  gate = beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)
  return (gate * (beta2 * jnp.tanh(u / beta2))).astype(out_dtype)


def situ_glu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
             beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
  """SiTU-GLU FFN y = W_d situ_activation(x W_g, x W_u) (ARCHITECTURE §5).

  Args:
    x: [..., D_in] activations; the matmuls run in x's dtype.
    w_gate, w_up: [D_in, F]; w_down: [F, D_out] (cast to x's dtype).
    beta1, beta2: soft-clip levels.

  Returns:
    y: [..., D_out] in x's dtype.
  """
  dt = x.dtype
  g = jnp.dot(x, w_gate.astype(dt))
  u = jnp.dot(x, w_up.astype(dt))
  h = situ_activation(g, u, beta1, beta2, out_dtype=dt)
  return jnp.dot(h, w_down.astype(dt))


class SiTUGLU(nnx.Module):
  """SiTU-GLU FFN D_in -> hidden -> D_in: the dense layer-0 FFN and the shared experts.

  Params (param_dtype): w_gate, w_up [d_in, hidden] with axes (in_axis, hidden_axis);
  w_down [hidden, d_in] with axes (hidden_axis, in_axis). Compute in cfg.dtype.
  """

  def __init__(self, d_in: int, hidden: int, *, cfg: ModelConfig, rngs: nnx.Rngs,
               in_axis: str = "embed", hidden_axis: str = "mlp"):
    self.beta1, self.beta2 = cfg.glu_betas
    self.dtype = jnp.dtype(cfg.dtype)
    pdt = jnp.dtype(cfg.param_dtype)
    weight = lambda shape, names: nn.param(rngs, shape, names,
                                           init=nn.jax_normal_init(cfg.init_std), dtype=pdt)
    self.w_gate = weight((d_in, hidden), (in_axis, hidden_axis))
    self.w_up = weight((d_in, hidden), (in_axis, hidden_axis))
    self.w_down = weight((hidden, d_in), (hidden_axis, in_axis))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d_in] -> y [..., d_in] in x's dtype (matmuls in cfg.dtype)."""
    y = situ_glu(x.astype(self.dtype), self.w_gate[...], self.w_up[...], self.w_down[...],
                 self.beta1, self.beta2)
    return y.astype(x.dtype)
