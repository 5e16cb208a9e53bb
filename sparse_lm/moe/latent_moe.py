"""Stable LatentMoE: fp32 sigmoid router on the full width, routed SiTU-GLU experts in a latent
space, fp32 aggregation, RMSNorm and up-projection, plus shared experts (ARCHITECTURE.md §5).

    s = sigmoid(x W_r)                       [N, E] fp32, on the full-width x
    ids, p = top-k of s + b, p = s_sel / sum(s_sel) * route_scale     (router.route)
    z = x W_down                             [N, L]
    u = sum_{i in top-k} p_i E_i(z)          [N, L] fp32, E_i a SiTU-GLU L -> F -> L
    y = sum_shared E_s(x) + W_up RMSNorm(u)  [N, D]

Dispatch (`dispatch_and_compute`): on one program, sort the (token, expert) pairs by expert,
run the three expert matmuls as grouped matmuls over contiguous groups (gmm.py), unsort and
combine with the gates in fp32; under an `expert` mesh axis, expert_parallel.py. Dropless by
default; with cfg.capacity_factor each expert keeps at most ceil(capacity_factor * N * k / E)
assignments, and with cfg.ragged_buffer_factor each expert-parallel rank receives at most
that factor x the mean rows; both drop by the causal rule of docs/architecture.md ("Capacity
drops": position first, then routing margin z_sel - alpha). Dropped assignments and padding
tokens carry the sentinel expert id E and contribute nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from sparse_lm import nn, sharding
from sparse_lm.config import ModelConfig
from sparse_lm.moe import balancing, expert_parallel, gmm as gmm_lib, permute
from sparse_lm.moe import router as router_lib
from sparse_lm.moe.situ_glu import SiTUGLU, situ_activation

BATCH_AXES = ("activation_batch", "activation_length", "activation_embed")
LATENT_AXES = ("activation_batch", "activation_length", None)


# ------------------------------------------------------------------------ pure functions
def capacity_keep(expert_ids: jax.Array, margin: jax.Array, positions: jax.Array,
                  capacity: int, num_experts: int) -> jax.Array:
  """Which assignments survive a per-expert cap of `capacity`, by the causal rule of
  docs/architecture.md ("Capacity drops"): each expert takes its assignments in order of
  position in the sequence, and among one position by descending margin, until it is full.

  Args:
    expert_ids: [N, k] int32; the sentinel id num_experts marks pairs already excluded.
    margin: [N, k] fp32 routing margins (larger = chosen more decisively).
    positions: [N] int32 position of each token in its sequence (earlier = higher priority).
    capacity: max assignments per expert.
    num_experts: E.

  Returns:
    keep: [N, k] bool, False for dropped pairs (and for sentinel pairs).
  """
  flat_ids = expert_ids.reshape(-1)
  flat_pos = jnp.repeat(positions, expert_ids.shape[-1])
  order = jnp.lexsort((-margin.reshape(-1), flat_pos, flat_ids))  # expert, position, margin
  counts = permute.one_hot_counts(flat_ids, num_experts + 1)
  starts = jnp.cumsum(counts) - counts
  sorted_ids = flat_ids[order]
  rank = jnp.arange(flat_ids.shape[0], dtype=jnp.int32) - starts[sorted_ids]
  keep_sorted = (rank < capacity) & (sorted_ids < num_experts)
  keep = keep_sorted[permute.inverse_permutation(order.astype(jnp.int32))]
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

  Same contract as `dispatch_and_compute`. The sentinel id E sorts after every real expert.
  With a Pallas grouped matmul (tokamax, megablox), whose kernels leave rows past
  sum(group_sizes) unwritten, the sentinel rows are counted into the last expert's group
  instead (computed, finite, then given combine weight 0: exactly nothing in value and
  gradient), which spares the kernels' row masks; other backends give zeros past the sum. The
  combine weight of a sentinel is 0 either way.
  """
  num_tokens, k = expert_ids.shape
  num_experts = params["w_gate"].shape[0]
  flat_ids = expert_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)  # [N k]
  inverse = permute.inverse_permutation(order)
  group_sizes = permute.one_hot_counts(flat_ids, num_experts)
  covered = gmm_lib.resolve_backend(backend, jax.default_backend(), k=z.shape[-1],
                                    n=params["w_gate"].shape[-1]) in ("tokamax", "megablox")
  if covered:
    group_sizes = group_sizes.at[-1].add(flat_ids.shape[0] - jnp.sum(group_sizes))
  zs = permute.permute_rows(z, order, inverse, k)  # [N k, L] sorted by expert
  mm = functools.partial(gmm_lib.gmm, backend=backend, rows_covered=covered)
  g = checkpoint_name(mm(zs, params["w_gate"], group_sizes), nn.EXPERT_MATMUL_NAME)
  u = checkpoint_name(mm(zs, params["w_up"], group_sizes), nn.EXPERT_MATMUL_NAME)
  h = situ_activation(g, u, beta1, beta2, out_dtype=z.dtype)
  out = checkpoint_name(mm(h, params["w_down"], group_sizes), nn.EXPERT_MATMUL_NAME)  # [N k, L]
  out = permute.permute_rows(out, inverse, order).reshape(num_tokens, k, -1).astype(jnp.float32)
  w = jnp.where(expert_ids < num_experts, gates.astype(jnp.float32), 0.0)
  return jnp.einsum("nk,nkl->nl", w, out)


def dispatch_and_compute(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                         params: dict[str, jax.Array], *, backend: str = "auto",
                         beta1: float = 4.0, beta2: float = 25.0, exchange: str = "auto",
                         ragged_buffer_factor: float | None = None,
                         positions: jax.Array | None = None, num_positions: int | None = None,
                         margin: jax.Array | None = None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """u = sum_i gates_i E_{id_i}(z): the routed-expert part of LatentMoE (ARCHITECTURE §5).

  When the active mesh (sparse_lm.sharding.use_mesh) has an `expert` axis of size > 1, the
  experts are sharded and the tokens exchanged (`expert_parallel.dispatch_and_compute`, with
  `exchange` and the receive cap `ragged_buffer_factor`); otherwise one program sorts and
  runs grouped matmuls (`sorted_dispatch`, or `dense_reference` for backend="dense").

  Args:
    z: [N, L] latent activations in the compute dtype.
    expert_ids: [N, k] int32 in [0, E]; E is the sentinel for a dropped/padding assignment.
    gates: [N, k] fp32 combine weights.
    params: {"w_gate": [E, L, F], "w_up": [E, L, F], "w_down": [E, F, L]}.
    backend: cfg.gmm_backend (config.GMM_BACKENDS).
    beta1, beta2: SiTU-GLU soft-clip levels.
    exchange, ragged_buffer_factor: cfg.ep_exchange, cfg.ragged_buffer_factor (expert
      parallelism only).
    positions, num_positions, margin: the receive cap's priority (position of each token in
      its sequence [N] and its bound; routing margins [N, k]), see expert_parallel.

  Returns:
    u: [N, L] fp32. Tokens whose assignments are all sentinels get 0; an expert with no
      tokens costs nothing and is fine.
    metrics: the expert-parallel exchange's ("dropped", "assigned", "drop_rate",
      "recv_rows_max", "recv_rows_mean", "recv_buffer_rows"), or {} on one program.
  """
  mesh = sharding.current_mesh()
  if mesh is not None and mesh.shape.get("expert", 1) > 1:
    return expert_parallel.dispatch_and_compute(
        z, expert_ids, gates, params, mesh=mesh, exchange=exchange,
        ragged_buffer_factor=ragged_buffer_factor, positions=positions,
        num_positions=num_positions, margin=margin, backend=backend, beta1=beta1,
        beta2=beta2)
  if backend == "dense":
    return dense_reference(z, expert_ids, gates, params, beta1=beta1, beta2=beta2), {}
  return sorted_dispatch(z, expert_ids, gates, params, backend=backend, beta1=beta1,
                         beta2=beta2), {}


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
    self.qb_cutoff = cfg.qb_cutoff
    self.ep_exchange = cfg.ep_exchange
    self.ragged_buffer_factor = cfg.ragged_buffer_factor

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
      aux: fp32 "max_violation" (max_load / mean_load), "dead_frac", "load" [E] (routed
        assignments per expert, before any capacity drop), "aux_loss" (coef times the Switch
        loss for balancer="aux_loss", else 0); "assigned" (real (token, expert) pairs),
        "dropped" (of those, dropped by cfg.capacity_factor and by the expert-parallel
        receive cap), "drop_rate" = dropped / assigned; under expert parallelism also
        "recv_rows_max", "recv_rows_mean" (rows per rank wanted, before the cap) and
        "recv_buffer_rows" (see expert_parallel.ep_dispatch_and_compute).
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

    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (bsz, seq)).reshape(n)
    assigned = jnp.sum((ids < e).astype(jnp.float32))
    dropped = jnp.zeros((), jnp.float32)
    if self.capacity_factor is not None:
      cap = expert_capacity(n, k, e, self.capacity_factor)
      keep = capacity_keep(ids, routing.margin, positions, cap, e)
      dropped = assigned - jnp.sum(keep.astype(jnp.float32))
      ids = jnp.where(keep, ids, e)

    z = jnp.dot(x.astype(dt), self.w_down[...].astype(dt)) if self.latent else x.astype(dt)
    z = sharding.constrain(z, LATENT_AXES)
    u, ep_metrics = dispatch_and_compute(
        z.reshape(n, -1), ids, routing.gates, self.expert_params(), backend=self.gmm_backend,
        beta1=self.beta1, beta2=self.beta2, exchange=self.ep_exchange,
        ragged_buffer_factor=self.ragged_buffer_factor, positions=positions,
        num_positions=seq, margin=routing.margin)
    if ep_metrics:  # the exchange's drops come on top of the single-program cap's
      dropped = dropped + ep_metrics.pop("dropped")
      ep_metrics.pop("assigned"), ep_metrics.pop("drop_rate")
    if self.latent:
      u = nn.rms_norm(u, self.latent_norm[...], self.norm_eps, square=True).astype(dt)
      y = jnp.dot(u, self.w_up[...].astype(dt)).reshape(bsz, seq, dim)
    else:
      y = u.astype(dt).reshape(bsz, seq, dim)
    if self.shared is not None:
      y = y + self.shared(x.astype(dt))
    y = sharding.constrain(y.astype(x.dtype), BATCH_AXES)

    if train:
      nn.assign(self.balancer_load, self.balancer_load[...] + load)
      if self.balancer == "quantile":
        r = router_lib.required_bias(scores, routing.cutoff)
        lo, hi = balancing.histogram_range(bias)
        nn.assign(self.balancer_hist, self.balancer_hist[...] + balancing.required_bias_histogram(
            r, weight, lo, hi, self.balancer_bins))

    aux_loss = jnp.zeros((), jnp.float32)
    if self.balancer == "aux_loss":
      aux_loss = self.aux_loss_coef * balancing.switch_aux_loss(scores, load, weight, k)
    aux = dict(balancing.load_metrics(load), dropped=dropped, assigned=assigned,
               drop_rate=dropped / jnp.maximum(assigned, 1.0), load=load, aux_loss=aux_loss,
               **ep_metrics)
    return y, aux
