"""The decode step (one token per row) through the fused Pallas kernels of
`pallas_kernels.decode`: the same layer as `forward.layer_cached`, fewer GPU kernels.

A batch-1 decode step of the small preset ran ~750 XLA kernels of 1-4 us (docs/inference.md):
norms, gates, AttnRes mixes, the conv update, routing glue. Here, per decoder layer:
  AttnRes  each sub-layer's read + pre-norm is one `attnres_mix` kernel; the attention
           output's add into the block sum is fused into the FFN's read.
  KDA      the input projections are one XLA GEMM (the weights concatenated once per load,
           `kda_input_matrix`; on zero-padded rows, `forward.pad_rows`), read by the kernel
           unsliced; conv update, SiLU, L2 norm, the gate (with FUSE["gate_up"] also its
           up-projection W_g_up, else an XLA GEMM), beta, the delta-rule step and the gated
           output norm are one `kda_step` kernel; then W_o.
  MoE      `forward.moe_decode` (routing, projections; the latent down-projection and the
           shared expert's gate and up as one GEMM, `moe_input_matrix`) with the routed
           experts of a small batch reading their weights in place (`moe_experts`) instead
           of a gather and batched matmuls; with a power-of-two expert count the kernel also
           takes each token's top k and gates (`moe_experts_routed`: no top-k sort); the
           up-projection of the latent and the shared expert's down-projection as one GEMM
           (`moe_output_matrix`).
  MLA      `forward.mla_cached`, with its input projections (W_dq or W_q, W_dkv, the output
           gate's W_gate) as one GEMM (`mla_input_matrix`).
`decode_kernels(cfg)` says whether the engine uses this path: cfg.decode_backend "pallas"
(interpret mode off the GPU: the tests), "xla" (never), "auto" (on a GPU when the shapes are
powers of two, as Triton needs). Tests: tests/inference/test_fused_decode.py compares every
kernel and the whole step with the pure-JAX path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode import (attnres_mix, is_pow2, kda_step, moe_experts,
                                    moe_experts_routed, on_gpu)
from sparse_lm import nn
from sparse_lm.moe import router as router_lib

F32 = jnp.float32
# moe_experts(_routed): hidden columns per program, tensor-core dots, Triton warps and pipeline
# stages (benchmarks/decode.py --moe-variants times others inside the decode step).
MOE_BLOCK_F, MOE_DOT, MOE_WARPS, MOE_STAGES = 32, True, 4, 1
# Which parts of the layer take the kernels (benchmarks/decode.py --fused-ablate measures each;
# a part that is off there is tried on as "+name"). "gate_up" (the KDA gate's W_g_up inside
# kda_step) is off: on an H100 it made the batch-1 step 3-5% slower in two runs, though it
# removes a GEMM per KDA layer (docs/inference.md, 2026-12-06 afternoon).
FUSE = {"attnres": True, "kda": True, "moe": True, "routing": True, "moe_output": True,
        "gate_up": False, "mla_input": True}


def shapes_supported(cfg) -> bool:
  """Whether the kernels compile for cfg on a GPU (Triton block sizes: powers of two)."""
  lat = cfg.moe_latent_dim if cfg.moe_latent else cfg.d_model
  return (is_pow2(cfg.kda_head_dim) and is_pow2(cfg.kda_value_dim) and is_pow2(cfg.d_model)
          and is_pow2(lat) and cfg.expert_hidden % min(MOE_BLOCK_F, cfg.expert_hidden) == 0
          and is_pow2(min(MOE_BLOCK_F, cfg.expert_hidden)))


def decode_kernels(cfg) -> tuple[bool, bool]:
  """(use the fused decode kernels, in Pallas interpret mode) for cfg.decode_backend."""
  if cfg.decode_backend == "xla":
    return False, False
  gpu = on_gpu()
  if cfg.decode_backend == "auto":
    return gpu and shapes_supported(cfg), False
  return True, not gpu


def stream_read(cfg, stream: dict, query, norm, *, y=None, interpret: bool, rows: int = 0):
  """The sub-layer input RMSNorm(AttnRes(stream)) [R, 1, D] in cfg.dtype, adding y [B, 1, D]
  into the block sum first when given; returns (x, stream). R = max(B, rows): the rows past B
  are zeros (the padded rows of the sub-layer's GEMMs, `forward.pad_rows`, written by the
  kernel). Block AttnRes only."""
  stack = stream["stack"][:, :, 0]  # [N, B, D]
  valid = jnp.arange(stack.shape[0]) < stream["count"]
  has_partial = stream["has_partial"] if y is None else jnp.ones((), bool)
  x, partial = attnres_mix(stack, valid, stream["partial"][:, 0], has_partial, query,
                           norm.scale[...], y=None if y is None else y[:, 0],
                           mix_eps=cfg.norm_eps, norm_eps=norm.eps,
                           dtype=jnp.dtype(cfg.dtype), rows=rows, interpret=interpret)
  return x[:, None], dict(stream, partial=partial[:, None], has_partial=has_partial)


def kda_input_names(p: dict) -> tuple[str, ...]:
  """The KDA weights that read the layer input, in the column order of `kda_input_matrix`."""
  og = "w_og_down" if "w_og_down" in p else "w_og"
  return ("w_q", "w_k", "w_v", og, "w_beta", "w_g_down")


def side_by_side_cols(weights: dict) -> dict:
  """{name: (first column, width)} of each [D, ...] weight of `weights` (in its order) in the
  matrix `side_by_side` makes of them: width = the weight's output axes flattened."""
  cols, at = {}, 0
  for n, w in weights.items():
    width = w.size // w.shape[0]
    cols[n], at = (at, width), at + width
  return cols


def side_by_side(weights: dict, dtype) -> jax.Array:
  """The [D, ...] weights of `weights` as one [D, N] matrix in `dtype`, in its order, each
  weight's output axes flattened (head-major): one GEMM reads them all."""
  return jnp.concatenate([w.reshape(w.shape[0], -1).astype(dtype) for w in weights.values()],
                         axis=1)


def kda_input_cols(p: dict) -> dict:
  """{name: (first column, width)} of each weight of `kda_input_names` in the matrix."""
  return side_by_side_cols({n: p[n] for n in kda_input_names(p)})


def kda_input_matrix(p: dict, dtype) -> jax.Array:
  """A KDA layer's input projections side by side, for one GEMM per decode step:
  [W_q | W_k | W_v | W_og (or W_og_down) | W_beta | W_g_down] as [D, N] in `dtype`, each
  weight's output axes flattened (head-major). p: KDA.arrays(). The engine builds it once per
  weight load (`forward.DecoderStack(model, input_matrices=True)`); built inside a step it would
  be a copy of the weights every step."""
  return side_by_side({n: p[n] for n in kda_input_names(p)}, dtype)


def mla_input_names(mixer) -> tuple[str, ...]:
  """The MLA weights that read the layer input, in the column order of `mla_input_matrix`:
  W_dq (or W_q without a query LoRA), W_dkv, W_gate (with the output gate)."""
  cfg = mixer.cfg
  return (("w_dq",) if cfg.q_lora_rank else ("w_q",)) + ("w_dkv",) + (
      ("w_gate",) if cfg.mla_output_gate else ())


def mla_input_cols(mixer) -> dict:
  """{name: (first column, width)} of each weight of `mla_input_names` in the matrix."""
  return side_by_side_cols({n: getattr(mixer, n)[...] for n in mla_input_names(mixer)})


def mla_input_matrix(mixer, dtype) -> jax.Array:
  """An MLA layer's input projections side by side, [D, N] in `dtype` (each weight's output
  axes flattened, head-major): one GEMM per decode step instead of two or three. Built once per
  weight load (`forward.DecoderStack(model, input_matrices=True)`)."""
  return side_by_side({n: getattr(mixer, n)[...] for n in mla_input_names(mixer)}, dtype)


def kda_step_fused(mixer, x: jax.Array, cache: dict, n_valid: jax.Array, *, pad, rows: int,
                   interpret: bool, num_warps: int = 4, w_in: jax.Array | None = None,
                   xp: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """KDA at one token per row: x [B, 1, D] -> (y [B, 1, D], cache).

  The input projections are one XLA GEMM, x [R, D] @ w_in [D, N] with fp32 accumulation, on at
  least `rows` rows (`pad` = forward.pad_rows); `kda_step` reads q, k, v, beta (and the
  full-rank output gate) from its fp32 result by column, unsliced, and with FUSE["gate_up"]
  multiplies the gate's down-projection by W_g_up itself (else a GEMM of its slice gives z).
  The low-rank output gate's second factor is a GEMM of its slice. w_in: `kda_input_matrix(p,
  cfg.dtype)`, built here when None (a copy of the weights: the engine passes it prebuilt).
  xp: x's rows already padded, [R, D] (`stream_read(..., rows=rows)`), else pad(x[:, 0], rows).

  Raises:
    ValueError: w_in of another shape than this layer's kda_input_matrix.
  """
  cfg = mixer.cfg
  dt = jnp.dtype(cfg.dtype)
  p = mixer.arrays()
  B = x.shape[0]
  xp = pad(x[:, 0], rows) if xp is None else xp  # [R, D]
  if w_in is None:
    w_in = kda_input_matrix(p, dt)
  cols = kda_input_cols(p)
  if w_in.shape != (xp.shape[1], sum(w for _, w in cols.values())):
    raise ValueError(f"kda_step_fused: w_in {w_in.shape} is not this layer's "
                     "kda_input_matrix; rebuild it from the layer's weights")
  xw = jnp.dot(xp.astype(dt), w_in.astype(dt), preferred_element_type=F32)  # [R, N]
  proj = functools.partial(nn.project, dtype=dt)
  piece = lambda n: jax.lax.slice_in_dim(xw, cols[n][0], cols[n][0] + cols[n][1], axis=1)
  gate_up = FUSE["gate_up"]  # the gate's second factor inside kda_step: no GEMM for z
  z = None if gate_up else proj(piece("w_g_down").astype(dt), p["w_g_up"])
  if "w_og_down" in p:
    og, og_col = proj(piece("w_og_down").astype(dt), p["w_og_up"], out_dtype=F32), 0
  else:
    og, og_col = xw, cols["w_og"][0]
  conv = {n: p["conv_" + n] for n in ("q", "k", "v")}
  o, S, tails = kda_step(cache["S"], xw, {"q": cols["w_q"][0], "k": cols["w_k"][0],
                                          "v": cols["w_v"][0], "beta": cols["w_beta"][0],
                                          "g_down": cols["w_g_down"][0]},
                         cache["conv"], conv, z, p["A_log"], p["dt_bias"], og, p["o_norm"],
                         n_valid, dtype=dt, og_col=og_col,
                         w_g_up=p["w_g_up"] if gate_up else None,
                         scale=cfg.kda_head_dim ** -0.5,
                         gate_lower_bound=cfg.kda_gate_lower_bound, l2_eps=cfg.l2_norm_eps,
                         norm_eps=cfg.norm_eps, num_warps=num_warps, interpret=interpret)
  y = proj(o, p["w_o"], 2)[:B]
  return y[:, None], {"conv": tails, "S": S}


def moe_input_weights(moe) -> list[jax.Array]:
  """The LatentMoE weights that read the layer input besides the router (fp32, its own
  product): [w_down (latent), shared w_gate, shared w_up], those the layer has."""
  ws = [moe.w_down[...]] if moe.latent else []
  if moe.shared is not None:
    ws += [moe.shared.w_gate[...], moe.shared.w_up[...]]
  return ws


def moe_input_matrix(moe, dtype) -> jax.Array | None:
  """[w_down | shared w_gate | shared w_up] as [D, N] in `dtype`, for one GEMM per decode
  step (`forward.moe_decode(..., w_in=...)`); None when the layer has fewer than two of them.
  Built once per weight load (`forward.DecoderStack(model, input_matrices=True)`)."""
  ws = moe_input_weights(moe)
  return jnp.concatenate([w.astype(dtype) for w in ws], axis=1) if len(ws) > 1 else None


def moe_output_matrix(moe, dtype) -> jax.Array | None:
  """[w_up (latent -> D); shared w_down] stacked as [L + F_s, D] in `dtype`, so the MoE layer's
  two output products are one GEMM of [RMSNorm(u) | shared h] (`forward.moe_decode(...,
  w_out=...)`: fp32 accumulation, one rounding); None unless the layer has both. Built once
  per weight load with `moe_input_matrix`."""
  if not (moe.latent and moe.shared is not None):
    return None
  return jnp.concatenate([moe.w_up[...].astype(dtype), moe.shared.w_down[...].astype(dtype)],
                         axis=0)


def routed_experts(moe, z, ids, gates, *, interpret: bool) -> jax.Array:
  """moe_experts with the layer's weights: z [N, L] -> u [N, L] fp32."""
  return moe_experts(z, ids, gates, moe.expert_params(), beta1=moe.beta1, beta2=moe.beta2,
                     block_f=MOE_BLOCK_F, use_dot=MOE_DOT, num_warps=MOE_WARPS,
                     num_stages=MOE_STAGES, interpret=interpret)


def routing_in_kernel(moe, interpret: bool) -> bool:
  """Whether the decode step routes inside the experts kernel (`routed_experts_routing`):
  FUSE["routing"] and, on the GPU, a power-of-two expert count (Triton's block rule). Every
  QB cutoff rule routes alike here: the cutoff does not enter a decode step's output."""
  return FUSE["routing"] and (interpret or is_pow2(moe.num_experts))


def routed_experts_routing(moe, z, logits, valid, *, z_col: int = 0, interpret: bool
                           ) -> jax.Array:
  """moe_experts_routed with the layer's weights, biases, k and compute dtype: z [N', C] (the
  latent in columns [z_col, z_col + L), any float dtype), logits [N, E] fp32 (router.
  router_logits), valid [N] -> u [N, L] fp32."""
  return moe_experts_routed(z, logits, moe.balancer_bias[...], valid, moe.expert_params(),
                            k=moe.experts_per_token, route_scale=moe.route_scale,
                            logit_bound=router_lib.ROUTER_LOGIT_BOUND, beta1=moe.beta1,
                            beta2=moe.beta2, z_col=z_col, dtype=moe.compute_dtype,
                            block_f=MOE_BLOCK_F, use_dot=MOE_DOT, num_warps=MOE_WARPS,
                            num_stages=MOE_STAGES, interpret=interpret)
