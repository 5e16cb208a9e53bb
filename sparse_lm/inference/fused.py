"""The decode step (one token per row) through the fused Pallas kernels of
`pallas_kernels.decode`: the same layer as `forward.layer_cached`, fewer GPU kernels.

A batch-1 decode step of the small preset ran ~750 XLA kernels of 1-4 us (docs/inference.md):
norms, gates, AttnRes mixes, the conv update, routing glue. Here, per decoder layer:
  AttnRes  each sub-layer's read + pre-norm is one `attnres_mix` kernel; the attention
           output's add into the block sum is fused into the FFN's read.
  KDA      the projections stay XLA GEMMs (on zero-padded rows, `forward.pad_rows`), read by
           the kernel unsliced; conv update, SiLU, L2 norm, gate, beta, the delta-rule step
           and the gated output norm are one `kda_step` kernel; then W_o.
  MoE      `forward.moe_decode` (routing, projections) with the routed experts of a small
           batch reading their weights in place (`moe_experts`) instead of a gather and
           batched matmuls.
  MLA      unchanged (`forward.mla_cached`).
`decode_kernels(cfg)` says whether the engine uses this path: cfg.decode_backend "pallas"
(interpret mode off the GPU: the tests), "xla" (never), "auto" (on a GPU when the shapes are
powers of two, as Triton needs). Tests: tests/inference/test_fused_decode.py compares every
kernel and the whole step with the pure-JAX path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode import attnres_mix, is_pow2, kda_step, moe_experts, on_gpu
from sparse_lm import nn

F32 = jnp.float32
MOE_BLOCK_F, MOE_DOT = 32, True  # moe_experts: hidden columns per program, tensor-core dots
# Which parts of the layer take the kernels (benchmarks/decode.py --fused-ablate measures each).
FUSE = {"attnres": True, "kda": True, "moe": True}


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


def stream_read(cfg, stream: dict, query, norm, *, y=None, interpret: bool):
  """The sub-layer input RMSNorm(AttnRes(stream)) [B, 1, D] in cfg.dtype, adding y [B, 1, D]
  into the block sum first when given; returns (x, stream). Block AttnRes only."""
  stack = stream["stack"][:, :, 0]  # [N, B, D]
  valid = jnp.arange(stack.shape[0]) < stream["count"]
  has_partial = stream["has_partial"] if y is None else jnp.ones((), bool)
  x, partial = attnres_mix(stack, valid, stream["partial"][:, 0], has_partial, query,
                           norm.scale[...], y=None if y is None else y[:, 0],
                           mix_eps=cfg.norm_eps, norm_eps=norm.eps,
                           dtype=jnp.dtype(cfg.dtype), interpret=interpret)
  return x[:, None], dict(stream, partial=partial[:, None], has_partial=has_partial)


def kda_step_fused(mixer, x: jax.Array, cache: dict, n_valid: jax.Array, *, pad, rows: int,
                   interpret: bool, num_warps: int = 4) -> tuple[jax.Array, dict]:
  """KDA at one token per row: x [B, 1, D] -> (y [B, 1, D], cache). The projections are XLA
  GEMMs on at least `rows` rows (`pad` = forward.pad_rows), passed to `kda_step` unsliced."""
  cfg = mixer.cfg
  dt = jnp.dtype(cfg.dtype)
  p = mixer.arrays()
  B = x.shape[0]
  xp = pad(x[:, 0], rows)  # [R, D]
  proj = functools.partial(nn.project, dtype=dt)
  xq = {n: proj(xp, p["w_" + n]) for n in ("q", "k", "v")}
  z = proj(proj(xp, p["w_g_down"]), p["w_g_up"])
  beta = proj(xp, p["w_beta"], out_dtype=F32)
  if "w_og_down" in p:
    og = proj(proj(xp, p["w_og_down"]), p["w_og_up"], out_dtype=F32)
  else:
    og = proj(xp, p["w_og"], out_dtype=F32)
  conv = {n: p["conv_" + n] for n in ("q", "k", "v")}
  o, S, tails = kda_step(cache["S"], xq, cache["conv"], conv, z, p["A_log"], p["dt_bias"],
                         beta, og, p["o_norm"], n_valid, scale=cfg.kda_head_dim ** -0.5,
                         gate_lower_bound=cfg.kda_gate_lower_bound, l2_eps=cfg.l2_norm_eps,
                         norm_eps=cfg.norm_eps, num_warps=num_warps, interpret=interpret)
  y = proj(o, p["w_o"], 2)[:B]
  return y[:, None], {"conv": tails, "S": S}


def routed_experts(moe, z, ids, gates, *, interpret: bool) -> jax.Array:
  """moe_experts with the layer's weights: z [N, L] -> u [N, L] fp32."""
  return moe_experts(z, ids, gates, moe.expert_params(), beta1=moe.beta1, beta2=moe.beta2,
                     block_f=MOE_BLOCK_F, use_dot=MOE_DOT, interpret=interpret)
