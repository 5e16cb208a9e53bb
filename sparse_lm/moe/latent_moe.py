"""Stable LatentMoE: fp32 sigmoid router on the full width, routed SiTU-GLU experts in a latent
space, fp32 aggregation, RMSNorm and up-projection, plus shared experts (ARCHITECTURE.md §5).

    s = sigmoid(x W_r)                       [N, E] fp32, on the full-width x
    ids, p = top-k of s + b, p = s_sel / sum(s_sel) * route_scale     (router.route)
    z = x W_down                             [N, L]
    u = sum_{i in top-k} p_i E_i(z)          [N, L] fp32, E_i a SiTU-GLU L -> F -> L
    y = sum_shared E_s(x) + W_up RMSNorm(u)  [N, D]

Dispatch (`dispatch_and_compute`, the seam an expert-parallel path replaces): sort the (token,
expert) pairs by expert, run the three expert matmuls as grouped matmuls over contiguous groups
(gmm.py), unsort and combine with the gates in fp32. Dropless by default; with
cfg.capacity_factor each expert keeps at most ceil(capacity_factor * N * k / E) assignments,
dropping those with the lowest routing margin (z_sel - alpha). Dropped assignments and padding
tokens carry the sentinel expert id E and contribute nothing.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparse_lm import nn, sharding
from sparse_lm.config import ModelConfig
from sparse_lm.moe import balancing, gmm as gmm_lib, router as router_lib
from sparse_lm.moe.situ_glu import SiTUGLU, situ_activation

BATCH_AXES = ("activation_batch", "activation_length", "activation_embed")
LATENT_AXES = ("activation_batch", "activation_length", None)


# ------------------------------------------------------------------------ pure functions
def capacity_keep(expert_ids: jax.Array, margin: jax.Array, capacity: int,
                  num_experts: int) -> jax.Array:
  """Which assignments survive a per-expert cap of `capacity` (the highest-margin ones).

  Args:
    expert_ids: [N, k] int32; the sentinel id num_experts marks pairs already excluded.
    margin: [N, k] fp32 routing margins (larger = chosen more decisively).
    capacity: max assignments per expert.
    num_experts: E.

  Returns:
    keep: [N, k] bool, False for dropped pairs (and for sentinel pairs).
  """
  flat_ids = expert_ids.reshape(-1)
  order = jnp.lexsort((-margin.reshape(-1), flat_ids))  # by expert, then margin descending
  counts = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_ids].add(1)
  starts = jnp.cumsum(counts) - counts
  sorted_ids = flat_ids[order]
  rank = jnp.arange(flat_ids.shape[0], dtype=jnp.int32) - starts[sorted_ids]
  keep_sorted = (rank < capacity) & (sorted_ids < num_experts)
  keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
  return keep.reshape(expert_ids.shape)


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
  """ceil(capacity_factor * tokens * k / E): the per-expert cap (tokens include padding)."""
  return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


def dense_reference(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                    params: dict[str, jax.Array], *, beta1: float = 4.0,
                    beta2: float = 25.0) -> jax.Array:
  """Reference for `dispatch_and_compute`: every expert on every token, masked combine.

  O(N E F) work and memory: for tests and tiny models only. Same contract as
  `dispatch_and_compute`.
  """
  num_experts = params["w_gate"].shape[0]
  dt = z.dtype
  g = jnp.einsum("nl,elf->enf", z, params["w_gate"].astype(dt))
  u = jnp.einsum("nl,elf->enf", z, params["w_up"].astype(dt))
  h = situ_activation(g, u, beta1, beta2).astype(dt)
  out = jnp.einsum("enf,efl->enl", h, params["w_down"].astype(dt)).astype(jnp.float32)
  combine = jnp.einsum("nk,nke->ne", gates.astype(jnp.float32),
                       jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32))
  return jnp.einsum("ne,enl->nl", combine, out)


def sorted_dispatch(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                    params: dict[str, jax.Array], *, backend: str = "auto",
                    beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
  """Single-program dispatch: sort by expert, grouped matmuls, unsort, gate-weighted sum.

  Same contract as `dispatch_and_compute`. The sentinel id E sorts after every real expert
  and lies beyond sum(group_sizes), so the grouped matmuls give zeros there; it is also
  masked explicitly.
  """
  num_tokens, k = expert_ids.shape
  num_experts = params["w_gate"].shape[0]
  flat_ids = expert_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)  # [N k]
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  token_of = order // k
  group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_ids].add(1)[:num_experts]
  zs = z[token_of]  # [N k, L] sorted by expert
  g = gmm_lib.gmm(zs, params["w_gate"], group_sizes, backend=backend)
  u = gmm_lib.gmm(zs, params["w_up"], group_sizes, backend=backend)
  h = situ_activation(g, u, beta1, beta2).astype(z.dtype)
  out = gmm_lib.gmm(h, params["w_down"], group_sizes, backend=backend)  # [N k, L]
  out = out[inverse].reshape(num_tokens, k, -1).astype(jnp.float32)
  w = jnp.where(expert_ids < num_experts, gates.astype(jnp.float32), 0.0)
  return jnp.einsum("nk,nkl->nl", w, out)


def dispatch_and_compute(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                         params: dict[str, jax.Array], *, backend: str = "auto",
                         beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
  """u = sum_i gates_i E_{id_i}(z): the routed-expert part of LatentMoE (ARCHITECTURE §5).

  This is the seam for expert parallelism: when the active mesh (sparse_lm.sharding.use_mesh)
  has an `expert` axis of size > 1 and `sparse_lm.moe.expert_parallel` exists, its
  `dispatch_and_compute` (same contract: all-to-all under shard_map) is used instead.

  Args:
    z: [N, L] latent activations in the compute dtype.
    expert_ids: [N, k] int32 in [0, E]; E is the sentinel for a dropped/padding assignment.
    gates: [N, k] fp32 combine weights.
    params: {"w_gate": [E, L, F], "w_up": [E, L, F], "w_down": [E, F, L]}.
    backend: cfg.gmm_backend ("auto", "ragged_dot", "tokamax", "megablox", "dense").
    beta1, beta2: SiTU-GLU soft-clip levels.

  Returns:
    u: [N, L] fp32. Tokens whose assignments are all sentinels get 0; an expert with no
    tokens costs nothing and is fine.
  """
  mesh = sharding.current_mesh()
  if (mesh is not None and mesh.shape.get("expert", 1) > 1
      and importlib.util.find_spec("sparse_lm.moe.expert_parallel") is not None):
    # Until that module exists, GSPMD partitions the single-program path below.
    from sparse_lm.moe import expert_parallel  # pylint: disable=g-import-not-at-top
    return expert_parallel.dispatch_and_compute(z, expert_ids, gates, params, backend=backend,
                                                beta1=beta1, beta2=beta2)
  if backend == "dense":
    return dense_reference(z, expert_ids, gates, params, beta1=beta1, beta2=beta2)
  return sorted_dispatch(z, expert_ids, gates, params, backend=backend, beta1=beta1,
                         beta2=beta2)


# ------------------------------------------------------------------------ module
class LatentMoE(nnx.Module):
  """Stable LatentMoE layer with its balancer state (ARCHITECTURE §5-§6).

  Params (logical axes): router [embed, exp] (fp32 always: routing precision), w_down
  [embed, latent], expert_gate / expert_up [exp, latent, expert_mlp], expert_down
  [exp, expert_mlp, latent], latent_norm [latent], w_up [latent, embed], shared (a fused
  SiTUGLU of hidden num_shared_experts * shared_expert_hidden: [embed, mlp], [mlp, embed]).
  Non-trainable state: balancer_bias [E] (BalancerBias), balancer_load [E] and, for
  balancer="quantile", balancer_hist [E, balancer_bins] (BalancerStats).

  With cfg.moe_latent=False (Kimi-Linear) there is no latent space: w_down, latent_norm and
  w_up are None, the experts map D -> F -> D and y = u + shared(x). With
  cfg.ffn_activation="swiglu" every expert is SwiGLU (silu(g) * u).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, lat, f, e = cfg.d_model, cfg.moe_latent_dim, cfg.expert_hidden, cfg.num_experts
    std, pdt = cfg.init_std, jnp.dtype(cfg.param_dtype)
    self.num_experts = e
    self.experts_per_token = cfg.experts_per_token
    self.route_scale = cfg.route_scale
    self.capacity_factor = cfg.capacity_factor
    self.gmm_backend = cfg.gmm_backend
    self.balancer = cfg.balancer
    self.balancer_bins = cfg.balancer_bins
    self.bias_sign_rate = cfg.bias_sign_rate
    self.aux_loss_coef = cfg.aux_loss_coef
    self.beta1, self.beta2 = cfg.glu_betas
    self.norm_eps = cfg.norm_eps
    self.compute_dtype = cfg.dtype
    self.qb_cutoff = "midpoint"  # router.route: alpha between z_(k) and z_(k+1)

    normal = nn.jax_normal_init(std)
    self.router = nn.param(rngs, (d, e), ("embed", "exp"), init=normal, dtype=jnp.float32)
    self.latent = cfg.moe_latent
    if not cfg.moe_latent:  # Kimi-Linear: the experts read and write the full width
      lat = d
    self.w_down = (nn.param(rngs, (d, lat), ("embed", "latent"), init=normal, dtype=pdt)
                   if self.latent else None)
    self.expert_gate = nn.param(rngs, (e, lat, f), ("exp", "latent", "expert_mlp"),
                                init=normal, dtype=pdt)
    self.expert_up = nn.param(rngs, (e, lat, f), ("exp", "latent", "expert_mlp"),
                                init=normal, dtype=pdt)
    self.expert_down = nn.param(rngs, (e, f, lat), ("exp", "expert_mlp", "latent"),
                                init=normal, dtype=pdt)
    if self.latent:
      self.latent_norm = nnx.Param(jnp.ones((lat,), pdt), out_sharding=("latent",),
                                   eager_sharding=False)
      self.w_up = nn.param(rngs, (lat, d), ("latent", "embed"), init=normal, dtype=pdt)
    else:
      self.latent_norm = self.w_up = None
    if cfg.num_shared_experts > 0:
      self.shared = SiTUGLU(d, cfg.num_shared_experts * cfg.shared_expert_hidden, cfg=cfg,
                            rngs=rngs, in_axis="embed", hidden_axis="mlp")
    else:
      self.shared = None

    self.balancer_bias = balancing.BalancerBias(jnp.zeros((e,), jnp.float32),
                                                out_sharding=(None,), eager_sharding=False)
    self.balancer_load = balancing.BalancerStats(jnp.zeros((e,), jnp.float32),
                                                 out_sharding=(None,), eager_sharding=False)
    if cfg.balancer == "quantile":
      self.balancer_hist = balancing.BalancerStats(
          jnp.zeros((e, cfg.balancer_bins), jnp.float32), out_sharding=(None, None),
          eager_sharding=False)
    else:
      self.balancer_hist = None

  def expert_params(self) -> dict[str, jax.Array]:
    """The routed-expert weights in the compute dtype, as `dispatch_and_compute` takes them."""
    dt = jnp.dtype(self.compute_dtype)
    return {"w_gate": self.expert_gate[...].astype(dt), "w_up": self.expert_up[...].astype(dt),
            "w_down": self.expert_down[...].astype(dt)}

  def __call__(self, x: jax.Array, *, valid: jax.Array | None = None,
               train: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Apply the layer.

    Args:
      x: [B, T, D] in the compute dtype.
      valid: [B, T] bool (False = padding: not dispatched, excluded from balancing statistics
        and load metrics) or None (all valid).
      train: accumulate the balancer statistics (an eval pass leaves all state untouched).

    Returns:
      y: [B, T, D] in x's dtype.
      aux: fp32 "max_violation" (max_load / mean_load), "dead_frac", "drop_rate", "load" [E]
        (routed assignments per expert, before any capacity drop), "aux_loss" (coef times the
        Switch loss for balancer="aux_loss", else 0).
    """
    bsz, seq, dim = x.shape
    n, e, k = bsz * seq, self.num_experts, self.experts_per_token
    dt = jnp.dtype(self.compute_dtype)
    x = sharding.constrain(x, BATCH_AXES)
    xf = x.reshape(n, dim)
    weight = (jnp.ones((n,), jnp.float32) if valid is None
              else valid.reshape(n).astype(jnp.float32))

    bias = self.balancer_bias[...]
    scores = router_lib.router_scores(xf, self.router[...])
    routing = router_lib.route(scores, bias, k, self.route_scale, cutoff=self.qb_cutoff)
    ids = jnp.where(weight[:, None] > 0, routing.expert_ids, e)
    load = balancing.expert_load(ids, weight, e)

    drop_rate = jnp.zeros((), jnp.float32)
    if self.capacity_factor is not None:
      cap = expert_capacity(n, k, e, self.capacity_factor)
      keep = capacity_keep(ids, routing.margin, cap, e)
      assigned = jnp.sum((ids < e).astype(jnp.float32))
      dropped = assigned - jnp.sum(keep.astype(jnp.float32))
      drop_rate = dropped / jnp.maximum(assigned, 1.0)
      ids = jnp.where(keep, ids, e)

    z = jnp.dot(x.astype(dt), self.w_down[...].astype(dt)) if self.latent else x.astype(dt)
    z = sharding.constrain(z, LATENT_AXES)
    u = dispatch_and_compute(z.reshape(n, -1), ids, routing.gates, self.expert_params(),
                             backend=self.gmm_backend, beta1=self.beta1, beta2=self.beta2)
    if self.latent:
      u = nn.rms_norm(u, self.latent_norm[...], self.norm_eps).astype(dt)
      y = jnp.dot(u, self.w_up[...].astype(dt)).reshape(bsz, seq, dim)
    else:
      y = u.astype(dt).reshape(bsz, seq, dim)
    if self.shared is not None:
      y = y + self.shared(x.astype(dt))
    y = sharding.constrain(y.astype(x.dtype), BATCH_AXES)

    if train:
      self.balancer_load[...] += load
      if self.balancer == "quantile":
        r = router_lib.required_bias(scores, routing.cutoff)
        lo, hi = balancing.histogram_range(bias)
        self.balancer_hist[...] += balancing.required_bias_histogram(
            r, weight, lo, hi, self.balancer_bins)

    aux_loss = jnp.zeros((), jnp.float32)
    if self.balancer == "aux_loss":
      aux_loss = self.aux_loss_coef * balancing.switch_aux_loss(scores, load, weight, k)
    aux = dict(balancing.load_metrics(load), drop_rate=drop_rate, load=load, aux_loss=aux_loss)
    return y, aux
