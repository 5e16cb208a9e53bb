"""Load balancing of the routed experts: Quantile Balancing and the ablation balancers.

ARCHITECTURE.md §6. Per MoE layer the balancing bias b [E] and the statistics gathered in the
forward pass live on the module as non-trainable variables (`BalancerBias`, `BalancerStats`,
not nnx.Param: an optimizer built with `wrt=nnx.Param` never sees them; they are saved with the
model state). The forward pass accumulates statistics only in training mode; `update_balancers`
turns them into a new bias after the optimizer step and resets them.

Quantile Balancing (QB), per layer with m tokens, E experts, top-k:
  r_ij = alpha_i - s_ij, alpha_i token i's cutoff: the spec's (k+1)-th largest s_i + b, here by
         default the midpoint of the k-th and (k+1)-th (router.route explains why);
  hist_j = histogram of r_{.,j} over all tokens since the last update (padding excluded),
           bins uniform over [min b - 1, max b + 1] (s in (0, 1) keeps r in that range);
  b_hat_j = the (k/E)-quantile of r_{.,j} (linear interpolation inside the bin);
  b = b_hat - mean(b_hat).
With alpha fixed exactly m k / E tokens would then pick each expert: one coordinate step of the
dual of the balanced-assignment LP, with no step size.

Ablations: "bias_sign" (DeepSeek-V3 §2.1.2: b_j += rate * sign(mean_load - load_j)),
"aux_loss" (Switch Transformer style, on the normalised sigmoid scores), "none".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparse_lm import nn


class BalancerBias(nnx.Variable):
  """The routing bias b [E] (fp32): persistent, never trained, frozen at inference."""


class BalancerStats(nnx.Variable):
  """Statistics accumulated in training-mode forward passes until `update_balancers`."""


# ------------------------------------------------------------------------ pure functions
def histogram_range(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """QB histogram range [min b - 1, max b + 1] over the last axis of bias [..., E]."""
  lo = jnp.min(bias, axis=-1) - 1.0
  hi = jnp.max(bias, axis=-1) + 1.0
  return lo, hi


def required_bias_histogram(r: jax.Array, weight: jax.Array, lo: jax.Array, hi: jax.Array,
                            bins: int) -> jax.Array:
  """Per-expert histograms of r (§6 step 4).

  Args:
    r: [N, E] fp32 required biases; values outside [lo, hi] go to the edge bins.
    weight: [N] fp32 token weights (0 for padding, 1 otherwise).
    lo, hi: scalar fp32 histogram range.
    bins: number of uniform bins.

  Returns:
    hist: [E, bins] fp32 weighted counts.
  """
  num_experts = r.shape[-1]
  width = (hi - lo) / bins
  idx = jnp.clip(jnp.floor((r - lo) / width), 0, bins - 1).astype(jnp.int32)
  flat = idx + (jnp.arange(num_experts, dtype=jnp.int32) * bins)[None, :]
  w = jnp.broadcast_to(weight.astype(jnp.float32)[:, None], r.shape)
  hist = jnp.zeros((num_experts * bins,), jnp.float32).at[flat.reshape(-1)].add(w.reshape(-1))
  return hist.reshape(num_experts, bins)


def histogram_quantile(hist: jax.Array, lo: jax.Array, hi: jax.Array,
                       q: float) -> jax.Array:
  """The q-quantile of each row of a uniform-bin histogram, linear inside the bin.

  Args:
    hist: [E, bins] non-negative counts over [lo, hi]; q in [0, 1].

  Returns:
    [E] fp32: x such that a fraction q of each row's mass lies below x (assuming the mass is
    uniform inside each bin). Rows with no mass give lo.
  """
  bins = hist.shape[-1]
  width = (hi - lo) / bins
  cdf = jnp.cumsum(hist, axis=-1)
  target = q * cdf[:, -1:]
  idx = jnp.sum(cdf < target, axis=-1)  # first bin whose cdf reaches the target
  idx = jnp.minimum(idx, bins - 1)
  prev = jnp.where(idx > 0, jnp.take_along_axis(cdf, jnp.maximum(idx - 1, 0)[:, None], -1)[:, 0],
                   0.0)
  count = jnp.take_along_axis(hist, idx[:, None], -1)[:, 0]
  frac = jnp.where(count > 0, (target[:, 0] - prev) / jnp.where(count > 0, count, 1.0), 0.0)
  return lo + (idx.astype(jnp.float32) + jnp.clip(frac, 0.0, 1.0)) * width


def quantile_bias_update(hist: jax.Array, lo: jax.Array, hi: jax.Array, k: int,
                         num_experts: int) -> jax.Array:
  """Quantile Balancing update (§6 step 5): b = b_hat - mean(b_hat), b_hat_j the (k/E)-quantile.

  Args:
    hist: [E, bins] histograms of r over [lo, hi] (from `required_bias_histogram`).
    lo, hi: scalar histogram range used when accumulating.
    k, num_experts: top-k and E.

  Returns:
    new bias [E] fp32 (centred). The caller keeps the old bias when hist is empty.
  """
  b_hat = histogram_quantile(hist, lo, hi, k / num_experts)
  return b_hat - jnp.mean(b_hat)


def bias_sign_update(load: jax.Array, bias: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 bias update b_j += rate * sign(mean(load) - load_j).

  Args:
    load: [E] tokens routed to each expert since the last update; bias: [E]; rate: gamma.

  Returns:
    new bias [E] fp32 (unchanged where load equals its mean, e.g. with no statistics).
  """
  load = load.astype(jnp.float32)
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def expert_load(expert_ids: jax.Array, weight: jax.Array, num_experts: int) -> jax.Array:
  """Tokens per expert [E] fp32; expert_ids [N, k] (ids >= E ignored), weight [N]."""
  w = jnp.broadcast_to(weight.astype(jnp.float32)[:, None], expert_ids.shape)
  return jnp.zeros((num_experts + 1,), jnp.float32).at[
      jnp.minimum(expert_ids, num_experts).reshape(-1)].add(w.reshape(-1))[:num_experts]


def load_metrics(load: jax.Array) -> dict[str, jax.Array]:
  """max_violation = max_load / mean_load and dead_frac = fraction of experts with no tokens.

  load [..., E] fp32. With no tokens at all max_violation is 0.
  """
  mean = jnp.mean(load, axis=-1)
  return {
      "max_violation": jnp.where(mean > 0, jnp.max(load, axis=-1) / jnp.where(mean > 0, mean,
                                                                                1.0), 0.0),
      "dead_frac": jnp.mean((load == 0).astype(jnp.float32), axis=-1),
  }


def switch_aux_loss(scores: jax.Array, load: jax.Array, weight: jax.Array, k: int) -> jax.Array:
  """Switch-style balance loss E * sum_j f_j P_j (1 at perfect balance), fp32 scalar.

  f_j = load_j / (k * tokens) is the fraction of assignments to expert j; P_j the mean over
  tokens of the normalised scores s_ij / sum_j s_ij (DeepSeek-V3 eq. 17-20 for sigmoid
  scores). Gradient flows through P (the scores) only. Padding (weight 0) is excluded.

  Args:
    scores: [N, E] fp32; load: [E] fp32 from `expert_load`; weight: [N]; k: top-k.
  """
  num_experts = scores.shape[-1]
  weight = weight.astype(jnp.float32)
  tokens = jnp.maximum(jnp.sum(weight), 1.0)
  p = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True),
                          jnp.finfo(jnp.float32).tiny)  # all-underflowed scores: p = 0
  p_mean = jnp.sum(p * weight[:, None], axis=0) / tokens
  f = jax.lax.stop_gradient(load) / (k * tokens)
  return num_experts * jnp.sum(f * p_mean)


def _over_leading(fn, *arrays, core_ndims):
  """Apply fn to arrays whose first dims are stacked-layer axes (nnx.vmap / nnx.scan)."""
  lead = arrays[0].shape[:arrays[0].ndim - core_ndims[0]]
  if not lead:
    return fn(*arrays)
  flat = [a.reshape((-1,) + a.shape[a.ndim - c:]) for a, c in zip(arrays, core_ndims)]
  out = jax.vmap(fn)(*flat)
  return out.reshape(lead + out.shape[1:])


# ------------------------------------------------------------------------ model-level update
def is_balanced_moe(node: Any) -> bool:
  """True for modules that carry a routing bias (the LatentMoE protocol)."""
  return isinstance(node, nnx.Module) and isinstance(
      getattr(node, "balancer_bias", None), BalancerBias)


def update_balanced_moe(moe: nnx.Module) -> dict[str, jax.Array]:
  """Apply the balancer update of one (possibly layer-stacked) MoE module and reset its stats.

  The module provides: balancer_bias [..., E], balancer_load [..., E], balancer_hist
  [..., E, bins] (quantile only), and static attributes balancer, num_experts,
  experts_per_token, bias_sign_rate.

  Returns:
    metrics: "max_violation" and "dead_frac" of the accumulated load, "bias_abs_max" and
    "bias_update_abs_mean" (reduced over any stacked layer axes: max / mean).
  """
  bias = moe.balancer_bias[...]
  load = moe.balancer_load[...]
  kind = moe.balancer
  if kind == "quantile":
    hist = moe.balancer_hist[...]
    k, num_experts = moe.experts_per_token, moe.num_experts

    def one(h, b):
      lo, hi = histogram_range(b)
      new = quantile_bias_update(h, lo, hi, k, num_experts)
      return jnp.where(jnp.sum(h) > 0, new, b)

    new_bias = _over_leading(one, hist, bias, core_ndims=(2, 1))
    nn.assign(moe.balancer_hist, jnp.zeros_like(hist))
  elif kind == "bias_sign":
    new_bias = bias_sign_update(load, bias, moe.bias_sign_rate)
  else:
    new_bias = bias
  new_bias = jax.lax.stop_gradient(new_bias.astype(jnp.float32))
  nn.assign(moe.balancer_bias, new_bias)
  nn.assign(moe.balancer_load, jnp.zeros_like(load))
  lm = load_metrics(load)
  return {
      "max_violation": jnp.max(lm["max_violation"]),
      "dead_frac": jnp.mean(lm["dead_frac"]),
      "bias_abs_max": jnp.max(jnp.abs(new_bias)),
      "bias_update_abs_mean": jnp.mean(jnp.abs(new_bias - bias)),
  }


def update_balancers(model: nnx.Module) -> dict[str, jax.Array]:
  """Update the routing bias of every MoE layer in `model` from its accumulated statistics.

  Call after the optimizer step (inside or outside jit; works on a model rebuilt with
  nnx.merge and on layers stacked by nnx.vmap / nnx.scan, whose variables carry leading layer
  axes). Statistics are reset. Layers whose statistics are empty keep their bias.

  Returns:
    metrics: for each MoE module at path p, "balancer/<p>/<name>" for the names of
    `update_balanced_moe`, plus "balancer/max_violation" (max over all layers) and
    "balancer/bias_abs_max". Empty when the model has no MoE layer.
  """
  metrics: dict[str, jax.Array] = {}
  worst, bias_max = [], []
  for path, node in nnx.iter_graph(model):
    if not is_balanced_moe(node):
      continue
    name = "/".join(str(p) for p in path) or "moe"
    m = update_balanced_moe(node)
    for key, value in m.items():
      metrics[f"balancer/{name}/{key}"] = value
    worst.append(m["max_violation"])
    bias_max.append(m["bias_abs_max"])
  if worst:
    metrics["balancer/max_violation"] = jnp.max(jnp.stack(worst))
    metrics["balancer/bias_abs_max"] = jnp.max(jnp.stack(bias_max))
  return metrics
