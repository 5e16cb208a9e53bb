"""Fused input projections of a decode step (T = 1): one GEMM where the layers do several.

At batch 1 a decode step is bound by the number of GPU kernels, not by bytes (docs/inference.md,
"Speed on one GPU"): every projection is its own kernel of a few microseconds. Here the
projections that read the same input are one matmul against their weights concatenated along
the output axis, built once per device call (`fused_weights`, outside the decode loop):

  KDA   x [w_q | w_k | w_v | w_g_down | w_beta | w_og (or w_og_down)]  (ARCHITECTURE §2.2)
  MoE   x [w_down (latent) | shared w_gate | shared w_up]                (ARCHITECTURE §5)

Everything after the matmul is the layers' own math: the same short conv, gate, L2 norms,
recurrent step and output norm as `kda_projections` / `kda_output` / `recurrent_step`, the
same SiTU-GLU. The unfused path (forward.kda_cached, forward.moe_decode) is the reference;
tests/inference/test_decode_padding.py compares the two on random weights and caches.
The concatenated weights are temporaries of one decode call (their size: the KDA input
projections and the shared experts of every layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda import kda_gate, recurrent_step
from sparse_lm import nn
from sparse_lm.model.kda import short_conv
from sparse_lm.moe.situ_glu import situ_activation

_KDA_IN = ("w_q", "w_k", "w_v", "w_g_down", "w_beta")


def _flat(w: jax.Array) -> jax.Array:
  """[D, ...] -> [D, prod(...)]."""
  return w.reshape(w.shape[0], -1)


def fused_weights(stack) -> list[dict | None]:
  """Per layer of a DecoderStack: {"w_in": [D, N]} for a KDA layer, {"w_in": [D, L + 2F]} for a
  LatentMoE with a shared expert (latent down projection, shared gate, shared up), else None.
  Kernels in the compute dtype."""
  out = []
  for layer in stack.layers:
    dt = jnp.dtype(layer.cfg.dtype)
    fused = {}
    if layer.mixer_kind == "kda":
      p = layer.mixer.arrays()
      gate = p["w_og_down"] if "w_og_down" in p else p["w_og"]
      fused["kda_in"] = jnp.concatenate(
          [_flat(p[n]).astype(dt) for n in _KDA_IN] + [_flat(gate).astype(dt)], axis=1)
    moe = layer.ffn
    if not layer.dense_ffn and moe.latent and moe.shared is not None:
      mdt = jnp.dtype(moe.compute_dtype)
      fused["moe_in"] = jnp.concatenate(
          [moe.w_down[...].astype(mdt), moe.shared.w_gate[...].astype(mdt),
           moe.shared.w_up[...].astype(mdt)], axis=1)
    out.append(fused or None)
  return out


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """x [B, ...] -> [max(B, rows), ...]: zero rows appended behind an optimization barrier.

  A batch-1 decode step's matmuls are matrix-vector products, which XLA's GPU compiler
  strength-reduces to elementwise multiplies and reductions; for the gathered experts those
  ran at about 0.4 TB/s on an H200 (docs/inference.md). With two rows a matmul stays a GEMM
  (cuBLAS / Triton), which reads its weights near the bandwidth limit. The barrier keeps the
  simplifier from seeing the zeros. Row b < B of any row-wise function of the result is
  unchanged (up to the GEMM's summation order).
  """
  if x.shape[0] >= rows:
    return x
  zeros = jnp.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
  return jax.lax.optimization_barrier(jnp.concatenate([x, zeros], axis=0))


def _split(y: jax.Array, sizes) -> list[jax.Array]:
  """y [..., sum(sizes)] -> the consecutive pieces."""
  ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
  return [y[..., e - s:e] for s, e in zip(sizes, ends)]


def kda_step_fused(cfg, p: dict, w_in: jax.Array, x: jax.Array, cache: dict,
                   n_valid: jax.Array, *, min_rows: int) -> tuple[jax.Array, dict]:
  """One KDA decode step with the fused input projection.

  Args:
    cfg: the model config; p: the KDA arrays (`KDA.arrays()`); w_in: fused_weights' "kda_in";
    x: [B, 1, D] pre-normalised input in the compute dtype; cache: {"conv": {"q","k","v":
    [B, W-1, C]}, "S": [B, H, K, V] fp32}; n_valid: [B] int32 in {0, 1} (0: the row is left
    unchanged); min_rows: matmuls run on at least this many rows (forward.pad_rows).

  Returns:
    (y [B, 1, D] in the compute dtype, the new cache).
  """
  dt = jnp.dtype(cfg.dtype)
  B = x.shape[0]
  H, K, V = p["w_q"].shape[1], p["w_q"].shape[2], p["w_v"].shape[2]
  gate_w = p["w_og_down"] if "w_og_down" in p else p["w_og"]
  sizes = [H * K, H * K, H * V, p["w_g_down"].shape[1], p["w_beta"].shape[1],
           _flat(gate_w).shape[1]]
  xp = pad_rows(x[:, 0].astype(dt), min_rows)
  y = jnp.dot(xp, w_in, preferred_element_type=jnp.float32)[:B]  # [B, N] fp32
  q_in, k_in, v_in, g_down, beta_in, og_in = _split(y, sizes)

  tails = {}

  def branch(name, lin, d):
    out, tails[name] = short_conv(lin.astype(dt)[:, None], p["conv_" + name].reshape(-1, H * d),
                                  None, cache["conv"][name])
    return jax.nn.silu(out[:, 0].astype(jnp.float32)).reshape(B, H, d)

  q = nn.l2_norm(branch("q", q_in, K), cfg.l2_norm_eps).astype(dt)
  k = nn.l2_norm(branch("k", k_in, K), cfg.l2_norm_eps).astype(dt)
  v = branch("v", v_in, V).astype(dt)
  z = nn.project(pad_rows(g_down.astype(dt), min_rows), p["w_g_up"], dtype=dt)[:B]
  g = kda_gate(z, p["A_log"], p["dt_bias"], gate_lower_bound=cfg.kda_gate_lower_bound)
  beta = jax.nn.sigmoid(beta_in)
  live = n_valid > 0
  g = jnp.where(live[:, None, None], g, 0.0)  # an idle row: identity step
  beta = jnp.where(live[:, None], beta, 0.0)
  o, S = recurrent_step(cache["S"], q, k, v, g, beta, cfg.kda_head_dim ** -0.5)
  if "w_og_down" in p:
    og = nn.project(pad_rows(og_in.astype(dt), min_rows), p["w_og_up"], dtype=dt,
                    out_dtype=jnp.float32)[:B]
  else:
    og = og_in.reshape(B, H, V)
  o = nn.rms_norm(o.astype(dt), p["o_norm"], cfg.norm_eps) * jax.nn.sigmoid(og)
  out = nn.project(pad_rows(o.astype(dt), min_rows), p["w_o"], 2, dtype=dt)[:B]
  conv = {name: jnp.where(live[:, None, None], tails[name].astype(old.dtype), old)
          for name, old in cache["conv"].items()}
  return out[:, None], {"conv": conv, "S": S}


def moe_shared_fused(moe, w_in: jax.Array, xp: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The latent down projection and the shared expert of a LatentMoE from one matmul.

  xp [R, D] (rows, padded) in the compute dtype; w_in: fused_weights' "moe_in".
  Returns (z [R, L] latent activations, shared expert output [R, D]), both in the compute
  dtype, as `jnp.dot(x, w_down)` and `moe.shared(x)` give them."""
  dt = xp.dtype
  L, F = moe.w_down.shape[1], moe.shared.w_gate.shape[1]
  z, g, u = _split(jnp.dot(xp, w_in, preferred_element_type=jnp.float32), [L, F, F])
  h = situ_activation(g.astype(dt), u.astype(dt), moe.shared.beta1, moe.shared.beta2).astype(dt)
  return z.astype(dt), jnp.dot(h, moe.shared.w_down[...].astype(dt))
