"""The routed experts of a small decode batch, reading the chosen experts' weights in place
(ARCHITECTURE.md §5: SiTU-GLU experts in the MoE latent space).

For assignment a (token n = a // k, expert e = ids[a]) and hidden block J_j of BF columns:

    g = z_n W_gate[e][:, J_j],  u = z_n W_up[e][:, J_j]         rounded to the compute dtype
    h = [b1 tanh(g / b1) sigmoid(g)] [b2 tanh(u / b2)]         (SwiGLU silu(g) u when b1 = None)
    partial[a, j] = h W_down[e][J_j, :]                        fp32

One program per (a, j): the expert's weights are read where they lie (the expert index is a
load inside the kernel), no gather copy. `moe_experts` sums the partials over j, rounds to the
compute dtype (the matmul output of the pure-JAX path) and combines with the gates.

`moe_experts_routed` also routes (§5, §6 step 2: s = sigmoid(router logits), top-k of s + b,
gates s_sel / sum s_sel x route_scale): each program takes its token's top k from the router
logits itself (k passes of max and lowest index, the order and tie rule of `jax.lax.top_k`)
and writes its gate, so the routing's sigmoid, top-k sort and gate kernels of the XLA path are
gone from the decode step; it reads z by columns from an unsliced GEMM output.
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
  _expert_block(z_ref, a // k, ids_ref[a], j, wg_ref, wu_ref, wd_ref, out_ref, a=a, BF=BF,
                BL=BL, beta1=beta1, beta2=beta2, dtype=dtype, use_dot=use_dot)


def _top_k_slot(s, bias, k: int, r):
  """Expert id and unbiased score of slot r (traced, 0 <= r < k) of the top k of s + bias,
  and the sum of the k selected scores. s, bias: [E] fp32. Selection as jax.lax.top_k:
  largest first, ties to the lowest index."""
  E = s.shape[0]
  iota = jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
  z = s + bias
  e, s_r, total = jnp.int32(0), jnp.float32(0), jnp.float32(0)
  for t in range(k):
    idx = jnp.min(jnp.where(z == jnp.max(z), iota, E))
    hit = iota == idx
    s_t = jnp.sum(jnp.where(hit, s, 0.0))
    total = total + s_t
    e = jnp.where(r == t, idx, e)
    s_r = jnp.where(r == t, s_t, s_r)
    z = jnp.where(hit, -jnp.inf, z)
  return e, s_r, total


def _routed_kernel(z_ref, s_ref, b_ref, valid_ref, wg_ref, wu_ref, wd_ref, out_ref, gate_ref, *,
                   k, route_scale, logit_bound, z_col, BF, BL, beta1, beta2, dtype, use_dot):
  a, j = pl.program_id(0), pl.program_id(1)
  n = a // k
  s = _sigmoid(jnp.clip(s_ref[n, :], -logit_bound, logit_bound))
  e, s_r, total = _top_k_slot(s, b_ref[:], k, a % k)
  gate = s_r / jnp.maximum(total, jnp.finfo(jnp.float32).tiny) * route_scale
  gate = jnp.where(valid_ref[n] != 0, gate, 0.0)
  gate_ref[a, j, :] = jnp.full((gate_ref.shape[-1],), gate, jnp.float32)
  _expert_block(z_ref, n, e, j, wg_ref, wu_ref, wd_ref, out_ref, a=a, BF=BF, BL=BL,
                beta1=beta1, beta2=beta2, dtype=dtype, use_dot=use_dot, z_col=z_col)


def _expert_block(z_ref, n, e, j, wg_ref, wu_ref, wd_ref, out_ref, *, a, BF, BL, beta1, beta2,
                  dtype, use_dot, z_col=0):
  """partial[a, j] = h W_down[e][J_j, :] for token n's latent row, z_ref[n, z_col:z_col + L]
  rounded to the compute dtype (module docstring)."""
  L = wg_ref.shape[1]
  f32 = jnp.float32
  fs = pl.ds(j * BF, BF)
  g = jnp.zeros((BF,), f32)
  u = jnp.zeros((BF,), f32)
  for i in range(L // BL):
    ls = pl.ds(i * BL, BL)
    zl = z_ref[n, pl.ds(z_col + i * BL, BL)].astype(dtype)
    if use_dot:  # z in row 0 of a 16-row tile: a tensor-core product, row 0 kept
      zt = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (16, BL), 0) == 0,
                     zl[None, :], 0).astype(wg_ref.dtype)
      g = g + jnp.sum(jnp.dot(zt, wg_ref[e, ls, fs], preferred_element_type=f32), axis=0)
      u = u + jnp.sum(jnp.dot(zt, wu_ref[e, ls, fs], preferred_element_type=f32), axis=0)
    else:
      zb = zl.astype(f32)[:, None]
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


def _blocks(name: str, L: int, F: int, block_f: int, interpret: bool) -> tuple[int, int]:
  """(hidden columns per program, latent columns per load) for F hidden and L latent columns.
  Raises ValueError naming `name` when block_f does not divide F, or (GPU) L or the block is
  not a power of two >= 16."""
  BF = min(block_f, F)
  if F % BF:
    raise ValueError(f"{name}: block_f={block_f} must divide expert_hidden F={F}")
  if not interpret and not (is_pow2(L) and is_pow2(BF)):
    raise ValueError(f"{name}: L={L} and block_f={BF} must be powers of two >= 16 on the GPU")
  return BF, min(L, 128)


def _combine(partial: jax.Array, w: jax.Array, k: int, dtype) -> jax.Array:
  """u [N, L] fp32 from the programs' partials [N k, J, L]: summed over the hidden blocks,
  rounded to the compute dtype (the pure-JAX path's matmul output), weighted by the gates
  w [N k, 1] and summed over each token's k experts."""
  A, _, L = partial.shape
  out = jnp.sum(partial, axis=1).astype(dtype).astype(jnp.float32)  # [A, L]
  return jnp.sum((w * out).reshape(A // k, k, L), axis=1)


def moe_experts(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                params: dict[str, jax.Array], *, beta1: float | None, beta2: float | None,
                block_f: int = 32, num_warps: int = 4, num_stages: int = 1,
                use_dot: bool = False, interpret: bool = False) -> jax.Array:
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
    num_warps: Triton warps per program. num_stages: Triton pipelining stages of the
      program's loops over L (1: none). use_dot: the gate / up products of bf16 weights as
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
  BF, BL = _blocks("moe_experts", L, F, block_f, interpret)
  dtype = z.dtype
  use_dot = use_dot and params["w_gate"].dtype != jnp.float32  # fp32: no TF32 dot
  ids = jnp.minimum(expert_ids, E - 1).reshape(N * k).astype(jnp.int32)
  kernel = functools.partial(_kernel, k=k, BF=BF, BL=BL, beta1=beta1, beta2=beta2, dtype=dtype,
                             use_dot=use_dot)
  partial = pl.pallas_call(
      kernel, grid=(N * k, F // BF),
      out_shape=jax.ShapeDtypeStruct((N * k, F // BF, L), jnp.float32),
      compiler_params=compiler_params(interpret, num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="moe_decode_experts")(
          z, ids, params["w_gate"], params["w_up"], params["w_down"])
  w = jnp.where(expert_ids < E, gates.astype(jnp.float32), 0.0).reshape(N * k, 1)
  return _combine(partial, w, k, dtype)


def moe_experts_routed(z: jax.Array, logits: jax.Array, bias: jax.Array, valid: jax.Array,
                       params: dict[str, jax.Array], *, k: int, route_scale: float,
                       logit_bound: float, beta1: float | None, beta2: float | None,
                       z_col: int = 0, dtype=None, block_f: int = 32, num_warps: int = 4,
                       num_stages: int = 1, use_dot: bool = False,
                       interpret: bool = False) -> jax.Array:
  """Routing and the routed experts in one kernel (module docstring): u = sum over token n's
  top k experts e of gate_e E_e(z_n), with s = sigmoid(clip(logits, +-logit_bound)) (the
  router scores, ARCHITECTURE §5), the top k of s + bias, gate_e = s_e / (sum of the k
  selected s) x route_scale (0 for an invalid token).

  Same result as `sparse_lm.moe.router.router_scores` and `route` (any cutoff rule: the
  cutoff does not enter the output) followed by `moe_experts` with the invalid tokens' ids
  set to the sentinel E; the selection follows `jax.lax.top_k` (largest first, ties to the
  lowest index).

  Args:
    z: [N', C] with token n's latent activations in columns [z_col, z_col + L) of row n, in
      any float dtype (rounded to `dtype` in the kernel: the fp32 output of a GEMM whose
      other columns are other products can be passed unsliced); N' >= N (rows past N are not
      read).
    logits: [N, E] fp32 router logits x W_r.
    bias: [E] fp32 balancing bias b (Quantile Balancing, §6).
    valid: [N] bool or int; False / 0: the token's gates are 0.
    params: {"w_gate", "w_up": [E, L, F], "w_down": [E, F, L]} in the compute dtype.
    k: experts per token, 1 <= k <= E. route_scale: multiplies the normalised gates.
    logit_bound: the router's logit clip (`sparse_lm.moe.router.ROUTER_LOGIT_BOUND`).
    z_col: see z. dtype: the compute dtype (default: z's).
    beta1, beta2, block_f, num_warps, num_stages, use_dot, interpret: as `moe_experts`.

  Returns:
    u [N, L] fp32.

  Raises:
    ValueError: k outside [1, E], logits / bias / valid shapes that do not match, z without
      columns [z_col, z_col + L), block_f does not divide F, or (GPU) L, E or block_f not a
      power of two >= 16.
  """
  E, L, F = params["w_gate"].shape
  N = logits.shape[0]
  if logits.shape != (N, E) or bias.shape != (E,) or valid.shape != (N,):
    raise ValueError(f"moe_experts_routed: logits {logits.shape}, bias {bias.shape}, valid "
                     f"{valid.shape} must be [N, E], [E], [N] with E={E} experts")
  if not 1 <= k <= E:
    raise ValueError(f"moe_experts_routed: k={k} experts per token must be in [1, E={E}]")
  if z.ndim != 2 or z.shape[0] < N or not 0 <= z_col <= z.shape[1] - L:
    raise ValueError(f"moe_experts_routed: z {z.shape} must be [N' >= {N}, C] with the latent "
                     f"in columns [z_col={z_col}, z_col + L={z_col + L})")
  if not interpret and not is_pow2(E):
    raise ValueError(f"moe_experts_routed: E={E} experts must be a power of two >= 16 on the "
                     "GPU")
  BF, BL = _blocks("moe_experts_routed", L, F, block_f, interpret)
  dtype = jnp.dtype(z.dtype if dtype is None else dtype)
  use_dot = use_dot and params["w_gate"].dtype != jnp.float32
  kernel = functools.partial(_routed_kernel, k=k, route_scale=float(route_scale),
                             logit_bound=float(logit_bound), z_col=int(z_col), BF=BF, BL=BL,
                             beta1=beta1, beta2=beta2, dtype=dtype, use_dot=use_dot)
  A, J = N * k, F // BF
  partial, gate = pl.pallas_call(
      kernel, grid=(A, J),
      out_shape=(jax.ShapeDtypeStruct((A, J, L), jnp.float32),
                 jax.ShapeDtypeStruct((A, J, 16), jnp.float32)),
      compiler_params=compiler_params(interpret, num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="moe_decode_routed_experts")(
          z, logits.astype(jnp.float32), bias.astype(jnp.float32), valid.astype(jnp.int32),
          params["w_gate"], params["w_up"], params["w_down"])
  return _combine(partial, gate[:, 0, :1], k, dtype)
