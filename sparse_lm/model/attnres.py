"""Attention Residuals: the residual stream of the decoder (ARCHITECTURE.md §4).

Source: Attention Residuals (arXiv 2603.15031). Three kinds (cfg.residual):

  "attnres_block"  Sources are b_0 (the token embedding), the sums b_1..b_{n-1} of the finished
                   blocks, and the running sum b_n^{i-1} of the current block's sub-layer
                   outputs (when it is non-empty). The input of sub-layer l is
                       h_l = sum_j alpha_j s_j,   alpha = softmax_j( w_l · RMSNorm(s_j) )
                   with one learned pseudo-query w_l [D] per sub-layer, zero-initialised (so
                   alpha is uniform at init). A block of cfg.attnres_block_layers decoder
                   layers = 2x as many sub-layers (attention and FFN each count).
  "attnres_full"   Every sub-layer output is its own source (block size one sub-layer).
  "standard"       h_l = running sum of all outputs (pre-norm residual stream).

The stream is a pytree of arrays with static shapes so it can be a `lax.scan` carry: a fixed
stack [N_max, B, T, D] of sources, a `count` of filled slots (unused slots get -inf logits), the
partial block sum and a flag saying whether it is non-empty. All mixing is fp32, and the
running partial sum is fp32; the committed sources in the stack are stored in
cfg.attnres_stack_dtype, by default the compute dtype (cfg.dtype: bf16 for the small and full
presets, fp32 for tiny). The stack is carried
through the scan over layer groups and saved at every group boundary for the backward pass,
so its storage dtype sets that memory (full preset, 2,048 tokens per chip: 470 MB per boundary
in fp32, 235 MB in bf16, x 22 boundaries).

The RMSNorm on the keys has no learned scale: a per-channel scale would be redundant with w_l.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sparse_lm.config import ModelConfig
from sparse_lm.sharding import constrain

_ACT = ("activation_batch", "activation_length", "activation_embed")
_NEG_INF = -jnp.inf


def attnres_mix(sources: jax.Array, valid: jax.Array, query: jax.Array,
                partial: jax.Array | None = None, partial_valid: jax.Array | bool = False,
                eps: float = 1e-6) -> jax.Array:
  """One AttnRes read: softmax over sources of w · RMSNorm(s), applied to the raw sources.

      r_j = 1 / sqrt(mean_d(s_j^2) + eps),   l_j = r_j (s_j · w),
      alpha = softmax_j(l_j) over the valid sources,   h = sum_j alpha_j s_j
                                                      (arXiv 2603.15031; ARCHITECTURE §4)

  Written with exact fp32 contractions (products and sums, or dots on XLA:CPU: `_dots`) and
  a hand-written backward (`_mix_bwd`) that keeps, besides its inputs, only
  the [N, B, T] weights, norms and logits and recomputes the rest from the sources: two passes
  over the stack. Being a `jax.custom_vjp`, it has no forward-mode derivative (`jax.jvp`).

  Args:
    sources: [N, B, T, D] stacked sources (any float dtype; math in fp32).
    valid: [N] bool, which slots hold a source (others get -inf logits).
    query: [D] pseudo-query w_l.
    partial: optional [B, T, D] extra source (the running block sum), kept out of the stack
      so that the stack is never copied.
    partial_valid: bool scalar, whether `partial` takes part.
    eps: RMSNorm epsilon.

  Returns:
    h [B, T, D] fp32. With a zero query: the uniform average of the valid sources. Gradients
    flow to sources, query and partial (in their dtypes); none to valid / partial_valid.
  """
  if partial is None:
    partial = jnp.zeros(sources.shape[1:], jnp.float32)
    partial_valid = False
  return _mix(sources, query, partial, jnp.asarray(valid, bool),
              jnp.asarray(partial_valid, bool), eps)


def _dots() -> bool:
  """Whether the contractions below run as fp32 dots (XLA:CPU) or as products and sums.

  Both are exact fp32. XLA:GPU compiled the dots as GEMMs of inner size N (the stack
  transposed around them; products and sums are 1.9-2.2x faster there, docs/benchmarks.md),
  while XLA:CPU ran products and sums 2-6x slower than the dots at the `small` width (a
  reduction over the leading axis; two reductions of one operand fused into one loop).
  """
  return jax.default_backend() == "cpu"


def _separate_passes() -> bool:
  """Whether `_mix_bwd` puts its outputs behind an optimization barrier (XLA:GPU).

  Without it XLA:GPU fused the backward of a layer group's eight reads, the accumulation of
  the stack's cotangent and the dw reductions into one reduction fusion: 15 ms per group of
  the `small` step on an H200; with it each read's d_sources is written once and summed by a
  plain fusion (`python -m benchmarks.attnres_group`, docs/benchmarks.md). On XLA:CPU the
  barrier made the same program slower, so it is GPU-only."""
  return jax.default_backend() == "gpu"


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.einsum(spec, x, y, precision=jax.lax.Precision.HIGHEST)


def _logits(s: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """r = rsqrt(mean(s^2) + eps) and l = r (s · w) over the last axis; s, w fp32."""
  if _dots():
    ss, sw = _dot("...d,...d->...", s, s), _dot("...d,d->...", s, w)
  else:
    ss, sw = jnp.sum(s * s, axis=-1), jnp.sum(s * w, axis=-1)
  r = jax.lax.rsqrt(ss / s.shape[-1] + eps)
  return r, r * sw


def _mix_weights(sources, query, partial, valid, partial_valid, eps):
  """Softmax weights alpha [N, B, T], alpha_p [B, T], norms r, r_p and logits l, l_p."""
  w = query.astype(jnp.float32)
  r, l = _logits(sources.astype(jnp.float32), w, eps)
  r_p, l_p = _logits(partial.astype(jnp.float32), w, eps)
  l = jnp.where(valid[:, None, None], l, _NEG_INF)
  l_p = jnp.where(partial_valid, l_p, _NEG_INF)
  m = jnp.maximum(jnp.max(l, axis=0), l_p)  # cancels in the softmax
  e, e_p = jnp.exp(l - m), jnp.exp(l_p - m)
  den = jnp.sum(e, axis=0) + e_p
  return e / den, e_p / den, r, r_p, l, l_p


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mix(sources, query, partial, valid, partial_valid, eps):
  return _mix_fwd(sources, query, partial, valid, partial_valid, eps)[0]


def _mix_fwd(sources, query, partial, valid, partial_valid, eps):
  a, a_p, r, r_p, l, l_p = _mix_weights(sources, query, partial, valid, partial_valid, eps)
  s = sources.astype(jnp.float32)
  h = _dot("n...,n...d->...d", a, s) if _dots() else jnp.sum(a[..., None] * s, axis=0)
  h = h + a_p[..., None] * partial.astype(jnp.float32)
  return h, (sources, query, partial, valid, partial_valid, a, a_p, r, r_p, l, l_p)


def _mix_bwd(eps, res, dh):
  """dalpha_j = s_j · dh;  dl_j = alpha_j (dalpha_j - sum_i alpha_i dalpha_i);
  ds_j = alpha_j dh + dl_j (r_j w - l_j r_j^2 s_j / D)  (d l_j / d s_j, r_j = rsqrt(...));
  dw = sum_{j,b,t} dl_j r_j s_j. Invalid slots have alpha = 0, so dl = 0 and ds = 0 there."""
  sources, query, partial, valid, partial_valid, a, a_p, r, r_p, l, l_p = res
  w = query.astype(jnp.float32)
  dh = dh.astype(jnp.float32)
  s = sources.astype(jnp.float32)
  p = partial.astype(jnp.float32)
  d = s.shape[-1]
  if _dots():
    da = _dot("n...d,...d->n...", s, dh)  # [N, B, T]
    da_p = _dot("...d,...d->...", p, dh)
  else:
    da = jnp.sum(s * dh, axis=-1)
    da_p = jnp.sum(p * dh, axis=-1)
  c = jnp.sum(a * da, axis=0) + a_p * da_p
  dl = a * (da - c)  # 0 where alpha = 0 (also where l = -inf)
  dl_p = a_p * (da_p - c)
  # Masked logits are -inf where alpha = 0; zero them so 0 * inf cannot appear.
  l = jnp.where(a > 0, l, 0.0)
  l_p = jnp.where(a_p > 0, l_p, 0.0)

  def ds_of(x, alpha, dlog, rr, ll):
    return (alpha[..., None] * dh + (dlog * rr)[..., None] * w
            - (dlog * ll * rr * rr / d)[..., None] * x)

  ds = ds_of(s, a, dl, r, l)
  dp = ds_of(p, a_p, dl_p, r_p, l_p)
  if _dots():
    dw = _dot("...,...d->d", dl * r, s) + _dot("...,...d->d", dl_p * r_p, p)
  else:
    dw = (jnp.sum((dl * r)[..., None] * s, axis=(0, 1, 2))
          + jnp.sum((dl_p * r_p)[..., None] * p, axis=(0, 1)))
  ds = ds.astype(sources.dtype)
  if _separate_passes():
    ds, dw = jax.lax.optimization_barrier((ds, dw))
  return ds, dw.astype(query.dtype), dp.astype(partial.dtype), None, None


_mix.defvjp(_mix_fwd, _mix_bwd)


def num_sources(cfg: ModelConfig) -> int:
  """Stack size N_max: the embedding plus every committed block (the last block stays the
  partial sum); for attnres_full, the embedding plus every sub-layer output."""
  if cfg.residual == "attnres_full":
    return 1 + 2 * cfg.num_layers
  return cfg.num_attnres_blocks


def stack_dtype(cfg: ModelConfig):
  """Storage dtype of the committed sources: cfg.attnres_stack_dtype, by default (None) the
  compute dtype (see the module docstring)."""
  return jnp.dtype(cfg.attnres_stack_dtype or cfg.dtype)


def init_stream(cfg: ModelConfig, emb: jax.Array) -> dict:
  """The residual stream holding only the embedding b_0 [B, T, D] (made fp32)."""
  emb = constrain(emb.astype(jnp.float32), _ACT)
  if cfg.residual == "standard":
    return {"h": emb}
  n = num_sources(cfg)
  stack = jnp.zeros((n,) + emb.shape, stack_dtype(cfg)).at[0].set(emb.astype(stack_dtype(cfg)))
  return {"stack": stack, "count": jnp.ones((), jnp.int32),
          "partial": jnp.zeros_like(emb), "has_partial": jnp.zeros((), bool)}


def sublayer_input(cfg: ModelConfig, stream: dict, query: jax.Array) -> jax.Array:
  """h_l [B, T, D] fp32, the (un-normalised) input of a sub-layer with pseudo-query w_l."""
  if cfg.residual == "standard":
    return stream["h"]
  stack = stream["stack"]
  valid = jnp.arange(stack.shape[0]) < stream["count"]
  partial = stream["partial"] if cfg.residual == "attnres_block" else None
  h = attnres_mix(stack, valid, query, partial, stream["has_partial"], cfg.norm_eps)
  return constrain(h, _ACT)


def _push(stream: dict, value: jax.Array, do: jax.Array) -> dict:
  """Write `value` into slot `count` and increment count, where `do` (bool scalar)."""
  stack, count = stream["stack"], stream["count"]
  idx = jnp.minimum(count, stack.shape[0] - 1)
  old = jax.lax.dynamic_index_in_dim(stack, idx, 0, keepdims=False)
  new = jnp.where(do, value.astype(stack.dtype), old)
  stack = jax.lax.dynamic_update_index_in_dim(stack, new, idx, 0)
  return dict(stream, stack=stack, count=count + do.astype(jnp.int32))


def add_output(cfg: ModelConfig, stream: dict, y: jax.Array) -> dict:
  """Add a sub-layer output y [B, T, D] to the stream."""
  y = constrain(y.astype(jnp.float32), _ACT)
  if cfg.residual == "standard":
    return {"h": stream["h"] + y}
  if cfg.residual == "attnres_full":
    return _push(stream, y, jnp.ones((), bool))
  return dict(stream, partial=stream["partial"] + y, has_partial=jnp.ones((), bool))


def open_block(cfg: ModelConfig, stream: dict, opens: jax.Array | bool) -> dict:
  """At the first layer of a block: commit the previous block's sum b_{n-1} to the stack.

  `opens` may be traced (inside the scan over layer groups). No-op for the other kinds, and
  for a Python `False` (the layers inside a block): no stack write is traced there, so the
  backward pass accumulates no cotangent through a write that cannot happen.
  """
  if cfg.residual != "attnres_block" or opens is False:
    return stream
  do = jnp.asarray(opens) & stream["has_partial"]
  stream = _push(stream, stream["partial"], do)
  return dict(stream, partial=jnp.where(do, 0.0, stream["partial"]),
              has_partial=stream["has_partial"] & ~do)


def final_output(cfg: ModelConfig, stream: dict, query: jax.Array) -> jax.Array:
  """The last AttnRes over all sources (its own pseudo-query), before the final norm."""
  return sublayer_input(cfg, stream, query)
