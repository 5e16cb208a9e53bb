"""The routed experts of a small decode batch, reading the chosen experts' weights in place
(ARCHITECTURE.md §5: SiTU-GLU experts in the MoE latent space).

For assignment a (token n = a // k, expert e = ids[a]) and hidden block J_j of BF columns:

    g = z_n W_gate[e][:, J_j],  u = z_n W_up[e][:, J_j]         rounded to the compute dtype
    h = [b1 tanh(g / b1) sigmoid(g)] [b2 tanh(u / b2)]         (SwiGLU silu(g) u when b1 = None)
    partial[a, j] = h W_down[e][J_j, :]                        fp32

One program per (a, j): the expert's weights are read where they lie (the expert index is a
load inside the kernel), no gather copy. `moe_experts` sums the partials over j, rounds to the
compute dtype (the matmul output of the pure-JAX path) and combines with the gates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode.common import compiler_params, is_pow2


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _kernel(z_ref, ids_ref, wg_ref, wu_ref, wd_ref, out_ref, *, k, BF, BL, beta1, beta2, dtype,
            use_dot):
  a, j = pl.program_id(0), pl.program_id(1)
  e = ids_ref[a]
  n = a // k
  L = z_ref.shape[-1]
  f32 = jnp.float32
  fs = pl.ds(j * BF, BF)
  g = jnp.zeros((BF,), f32)
  u = jnp.zeros((BF,), f32)
  for i in range(L // BL):
    ls = pl.ds(i * BL, BL)
    if use_dot:  # z in row 0 of a 16-row tile: a tensor-core product, row 0 kept
      zt = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (16, BL), 0) == 0,
                     z_ref[n, ls][None, :], 0).astype(wg_ref.dtype)
      g = g + jnp.sum(jnp.dot(zt, wg_ref[e, ls, fs], preferred_element_type=f32), axis=0)
      u = u + jnp.sum(jnp.dot(zt, wu_ref[e, ls, fs], preferred_element_type=f32), axis=0)
    else:
      zb = z_ref[n, ls].astype(f32)[:, None]
      g = g + jnp.sum(zb * wg_ref[e, ls, fs].astype(f32), axis=0)
      u = u + jnp.sum(zb * wu_ref[e, ls, fs].astype(f32), axis=0)
  g = g.astype(dtype).astype(f32)
  u = u.astype(dtype).astype(f32)
  if beta1 is None:
    h = g * _sigmoid(g) * u
  else:
    h = beta1 * jnp.tanh(g / beta1) * _sigmoid(g) * (beta2 * jnp.tanh(u / beta2))
  h = h.astype(dtype).astype(f32)[:, None]
  for i in range(L // BL):
    ls = pl.ds(i * BL, BL)
    out_ref[a, j, ls] = jnp.sum(h * wd_ref[e, fs, ls].astype(f32), axis=0)


def moe_experts(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                params: dict[str, jax.Array], *, beta1: float | None, beta2: float | None,
                block_f: int = 32, num_warps: int = 4, use_dot: bool = False,
                interpret: bool = False) -> jax.Array:
  """u = sum_j gates_j E_{id_j}(z) over each token's chosen experts (module docstring).

  Same contract as `sparse_lm.inference.forward.gathered_experts` (its reference): matmul
  outputs rounded to z's dtype, SiTU-GLU in fp32, fp32 combine.

  Args:
    z: [N', L] latent activations in the compute dtype, N' >= N (rows past N are not read).
    expert_ids: [N, k] int32 in [0, E] (E = no expert: contributes 0).
    gates: [N, k] fp32.
    params: {"w_gate", "w_up": [E, L, F], "w_down": [E, F, L]} in the compute dtype.
    beta1, beta2: SiTU-GLU clip levels (both None: SwiGLU).
    block_f: hidden columns per program (a power of two dividing F).
    num_warps: Triton warps per program. use_dot: the gate / up products of bf16 weights as
      tensor-core dots (z in row 0 of a 16-row tile) instead of multiply-and-reduce (fp32
      weights always multiply and reduce in fp32).
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    u [N, L] fp32.

  Raises:
    ValueError: block_f does not divide F, or (GPU) L or block_f not a power of two >= 16.
  """
  E, L, F = params["w_gate"].shape
  N, k = expert_ids.shape
  BF = min(block_f, F)
  if F % BF:
    raise ValueError(f"moe_experts: block_f={block_f} must divide expert_hidden F={F}")
  if not interpret and not (is_pow2(L) and is_pow2(BF)):
    raise ValueError(f"moe_experts: L={L} and block_f={BF} must be powers of two >= 16 on "
                     "the GPU")
  BL = min(L, 128)
  dtype = z.dtype
  use_dot = use_dot and params["w_gate"].dtype != jnp.float32  # fp32: no TF32 dot
  ids = jnp.minimum(expert_ids, E - 1).reshape(N * k).astype(jnp.int32)
  kernel = functools.partial(_kernel, k=k, BF=BF, BL=BL, beta1=beta1, beta2=beta2, dtype=dtype,
                             use_dot=use_dot)
  partial = pl.pallas_call(
      kernel, grid=(N * k, F // BF),
      out_shape=jax.ShapeDtypeStruct((N * k, F // BF, L), jnp.float32),
      compiler_params=compiler_params(interpret, num_warps=num_warps),
      interpret=interpret, name="moe_decode_experts")(
          z, ids, params["w_gate"], params["w_up"], params["w_down"])
  out = jnp.sum(partial, axis=1).astype(dtype).astype(jnp.float32)  # [A, L]
  w = jnp.where(expert_ids < E, gates.astype(jnp.float32), 0.0).reshape(N * k, 1)
  return jnp.sum((w * out).reshape(N, k, L), axis=1)
