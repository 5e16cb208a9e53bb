"""Kimi Delta Attention layer (ARCHITECTURE.md §2.2-§2.3; Kimi Linear, arXiv 2510.26692 §3).

    q, k = L2Norm(SiLU(ShortConv(x W_q / W_k)))      per head, eps 1e-6
    v    = SiLU(ShortConv(x W_v))
    z    = (x W_g_down) W_g_up                        rank K, one value per (head, key channel)
    g    = kda_gate(z, A_log, dt_bias, gate_lower_bound)   log-decay <= 0
    beta = sigmoid(x W_beta)                          one per head
    o    = chunk_kda(q, k, v, g, beta)                the recurrence of §2.1 (pallas_kernels.kda)
    y    = W_o [ sigmoid(x W_og) * RMSNorm_per_head(o) ]

The math lives in pure functions (`short_conv`, `kda_projections`, `kda_output`); `KDA` holds
the parameters. Decoding: `KDA.init_cache` / `KDA.decode` carry the last (W - 1) conv inputs and
the recurrent state S [B, H, K, V] fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from pallas_kernels.kda import chunk_kda, kda_gate, recurrent_step
from sparse_lm import nn, sharding
from sparse_lm.config import ModelConfig
from sparse_lm.model import context_parallel


def short_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None,
               conv_state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise convolution without bias, respecting packed-document boundaries.

      y_t = sum_{i=0}^{W-1} w[W-1-i] * x_{t-i} * [seg(t-i) == seg(t)]

  Args:
    x: [B, T, C] inputs (any float dtype; math in x's dtype with fp32 accumulation).
    w: [W, C] kernel; w[W-1] multiplies the current token.
    segment_ids: [B, T] int32 or None. A token never sees inputs of another segment id (so
      a new document starts from zero padding, like a fresh sequence).
    conv_state: [B, W-1, C] inputs preceding x (decode / continuation), treated as belonging
      to the segment of x[:, 0]; None means zeros.

  Returns:
    (y [B, T, C] in x's dtype, new conv_state [B, W-1, C]: the last W-1 inputs, x's dtype).
  """
  B, T, C = x.shape
  W = w.shape[0]
  if conv_state is None:
    conv_state = jnp.zeros((B, W - 1, C), x.dtype)
  xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
  if segment_ids is not None:
    sp = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (B, W - 1)), segment_ids], 1)
  acc = jnp.zeros((B, T, C), jnp.float32)
  for i in range(W):  # i = lag
    xs = jax.lax.dynamic_slice_in_dim(xp, W - 1 - i, T, axis=1).astype(jnp.float32)
    if segment_ids is not None and i > 0:
      same = jax.lax.dynamic_slice_in_dim(sp, W - 1 - i, T, axis=1) == segment_ids
      xs = jnp.where(same[..., None], xs, 0.0)
    acc = acc + xs * w[W - 1 - i].astype(jnp.float32)
  new_state = xp[:, T:] if W > 1 else xp[:, :0]
  return acc.astype(x.dtype), new_state


class KDAProjections(NamedTuple):
  """Per-token inputs of the recurrence: q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] fp32,
  beta [B,T,H] fp32."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array


def prev_shard_halo(x: jax.Array, size: int, axis: str | tuple[str, ...], *, time_axis: int = 1,
                    fill=0) -> jax.Array:
  """Inside a shard_map over `axis`: the last `size` steps of the previous shard along
  `time_axis` (shard 0 gets `fill`), e.g. the 3-token short-conv halo and its segment ids."""
  n = jax.lax.axis_size(axis)
  tail = jax.lax.slice_in_dim(x, x.shape[time_axis] - size, x.shape[time_axis], axis=time_axis)
  got = jax.lax.ppermute(tail, axis, perm=[(i, i + 1) for i in range(n - 1)])
  r = jax.lax.axis_index(axis)
  return jnp.where(r == 0, jnp.full_like(got, fill), got)


def cp_short_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None, *,
                  mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None = None
                  ) -> jax.Array:
  """Causal depthwise conv y[t] = sum_i w[i] x[t - (W-1) + i] with T sharded over `axis`,
  masked across documents (only taps of the same segment id contribute), by a halo of W - 1
  tokens (and their segment ids) from the previous shard.

  Args: x [B, T, C]; w [W, C]; segment_ids [B, T] int32 or None; axis as
  `context_parallel.cp_chunk_kda`. The model leaves this halo to GSPMD (a shifted slice);
  this explicit version is what tests/multidevice checks it against.
  Returns y [B, T, C].

  Raises:
    ValueError: the sequence is not sharded over `axis`.
  """
  axis = context_parallel.seq_axes(mesh, axis)
  if axis is None:
    raise ValueError("cp_short_conv: no sequence axis of size > 1 in the mesh; use the plain "
                     "conv")
  W = w.shape[0]
  b, c, _ = context_parallel.shard_specs(mesh, axis, x.shape[0], 1)

  def body(x, w, seg):
    halo = prev_shard_halo(x, W - 1, axis)
    xp = jnp.concatenate([halo, x], axis=1)
    if seg is not None:
      sp = jnp.concatenate([prev_shard_halo(seg, W - 1, axis, fill=-1), seg], axis=1)
    T = x.shape[1]
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(W):
      tap = xp[:, i:i + T].astype(jnp.float32)
      if seg is not None:
        tap = jnp.where((sp[:, i:i + T] == seg)[..., None], tap, 0)
      y = y + tap * w[i].astype(jnp.float32)
    return y.astype(x.dtype)

  seg_spec = P(b, c)
  if segment_ids is None:
    fn = lambda x, w: body(x, w, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(b, c, None), P()),
                         out_specs=P(b, c, None), check_vma=False)(x, w)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(b, c, None), P(), seg_spec),
                       out_specs=P(b, c, None), check_vma=False)(x, w, segment_ids)


def kda_projections(p: dict, x: jax.Array, *, gate_lower_bound: float | None, eps: float,
                    dtype, segment_ids=None, conv_state: dict | None = None
                    ) -> tuple[KDAProjections, dict]:
  """x [B, T, D] -> (KDAProjections, new conv states {"q","k","v": [B, W-1, H*dim]}).

  `p` holds the arrays of `KDA` (w_q, w_k, w_v [D,H,K|V]; conv_q, conv_k, conv_v [W,H,K|V];
  w_g_down [D,K]; w_g_up [K,H,K]; A_log [H]; dt_bias [H*K]; w_beta [D,H]). ARCHITECTURE §2.2.
  eps is the q/k L2-norm epsilon (cfg.l2_norm_eps), inside the square root.
  """
  B, T, _ = x.shape
  conv_state = conv_state or {}
  new_state = {}

  def branch(name, w, conv):
    y = nn.project(x, w, dtype=dtype)  # [B, T, H, d]
    H, d = y.shape[-2:]
    y, new_state[name] = short_conv(y.reshape(B, T, H * d), conv.reshape(-1, H * d),
                                    segment_ids, conv_state.get(name))
    return jax.nn.silu(y.astype(jnp.float32)).reshape(B, T, H, d)

  q = nn.l2_norm(branch("q", p["w_q"], p["conv_q"]), eps).astype(dtype)
  k = nn.l2_norm(branch("k", p["w_k"], p["conv_k"]), eps).astype(dtype)
  v = branch("v", p["w_v"], p["conv_v"]).astype(dtype)
  q = checkpoint_name(q, "query_proj")
  k = checkpoint_name(k, "key_proj")
  v = checkpoint_name(v, "value_proj")
  z = nn.project(nn.project(x, p["w_g_down"], dtype=dtype), p["w_g_up"], dtype=dtype)
  g = kda_gate(z, p["A_log"], p["dt_bias"], gate_lower_bound=gate_lower_bound)
  beta = jax.nn.sigmoid(nn.project(x, p["w_beta"], dtype=dtype, out_dtype=jnp.float32))
  return KDAProjections(q, k, v, g, beta), new_state


def kda_output(p: dict, x: jax.Array, o: jax.Array, *, eps: float, dtype) -> jax.Array:
  """y = W_o [sigmoid(x W_og) * RMSNorm_per_head(o)]: o [B,T,H,V] -> y [B,T,D] in dtype.

  The gate is full rank (p["w_og"] [D,H,V]) or, when p has "w_og_down" [D,r] and "w_og_up"
  [r,H,V], low rank: sigmoid((x W_og_down) W_og_up) (Kimi-Linear's g_a_proj / g_b_proj).
  """
  if "w_og_down" in p:
    xg = nn.project(x, p["w_og_down"], dtype=dtype)
    gate = jax.nn.sigmoid(nn.project(xg, p["w_og_up"], dtype=dtype, out_dtype=jnp.float32))
  else:
    gate = jax.nn.sigmoid(nn.project(x, p["w_og"], dtype=dtype, out_dtype=jnp.float32))
  o = nn.rms_norm(o, p["o_norm"], eps) * gate
  return checkpoint_name(nn.project(o.astype(dtype), p["w_o"], 2, dtype=dtype), "out_proj")


def init_dt_bias(key: jax.Array, shape, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4) -> jax.Array:
  """dt_bias = inverse-softplus(dt), dt ~ logUniform(dt_min, dt_max) clamped >= dt_floor
  (ARCHITECTURE §2.3; Mamba-2 / Kimi Linear initialisation)."""
  u = nn.uniform_init(0.0, 1.0)(key, shape)
  dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
  dt = jnp.maximum(dt, dt_floor)
  return dt + jnp.log(-jnp.expm1(-dt))  # softplus^{-1}(dt)


def init_A_log(gate_lower_bound: float | None):
  """A_log = zeros for the bounded gate, log U(1, 16) for the unbounded one (§2.3)."""
  def init(key, shape):
    if gate_lower_bound is not None:
      return jnp.zeros(shape, jnp.float32)
    return jnp.log(nn.uniform_init(1.0, 16.0)(key, shape))
  return init


class KDACache(NamedTuple):
  """Decode state of one KDA layer: conv inputs {"q","k","v": [B, W-1, H*dim]} and S fp32."""
  conv: dict
  S: jax.Array


class KDA(nnx.Module):
  """The KDA token mixer of one decoder layer (input already pre-normalised).

  Params (cfg.param_dtype unless noted): w_q, w_k [D,H,K], w_v [D,H,V] (embed, heads, kv);
  conv_q/k/v [W,H,K|V] (conv, heads, kv); w_g_down [D,K] (embed, kv); w_g_up [K,H,K]
  (kv, heads, kv); A_log [H] fp32 (heads); dt_bias [H*K] fp32 (heads); w_beta [D,H]
  (embed, heads); w_og [D,H,V] (embed, heads, kv), or with cfg.kda_output_gate_rank = r > 0
  w_og_down [D,r] (embed, kv) and w_og_up [r,H,V] (kv, heads, kv); o_norm [V] fp32 (norm),
  shared by the heads; w_o [H,V,D] (heads, kv, embed). A_log and dt_bias take no weight decay.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, V, W = (cfg.d_model, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim,
                     cfg.kda_conv_size)
    self.cfg = cfg
    dense = lambda i, o, n, std=None: nn.dense_param(rngs, i, o, n, cfg, std=std)
    self.w_q = dense((D,), (H, K), ("embed", "heads", "kv"))
    self.w_k = dense((D,), (H, K), ("embed", "heads", "kv"))
    self.w_v = dense((D,), (H, V), ("embed", "heads", "kv"))
    conv_std = 1.0 / math.sqrt(W)
    self.conv_q = dense((W,), (H, K), ("conv", "heads", "kv"), conv_std)
    self.conv_k = dense((W,), (H, K), ("conv", "heads", "kv"), conv_std)
    self.conv_v = dense((W,), (H, V), ("conv", "heads", "kv"), conv_std)
    self.w_g_down = dense((D,), (K,), ("embed", "kv"))
    self.w_g_up = dense((K,), (H, K), ("kv", "heads", "kv"))
    self.A_log = nn.param(rngs, (H,), ("heads",), init=init_A_log(cfg.kda_gate_lower_bound))
    self.dt_bias = nn.param(rngs, (H * K,), ("heads",), init=init_dt_bias)
    self.w_beta = dense((D,), (H,), ("embed", "heads"))
    r = cfg.kda_output_gate_rank
    if r:
      self.w_og_down = dense((D,), (r,), ("embed", "kv"))
      self.w_og_up = dense((r,), (H, V), ("kv", "heads", "kv"))
    else:
      self.w_og = dense((D,), (H, V), ("embed", "heads", "kv"))
    self.o_norm = nn.param(rngs, (V,), ("norm",), init=nn.ones_init)
    self.w_o = dense((H, V), (D,), ("heads", "kv", "embed"))

  def arrays(self) -> dict:
    """The parameter arrays by name, as `kda_projections` / `kda_output` take them."""
    return self._arrays()

  def _arrays(self) -> dict:
    gate = ("w_og_down", "w_og_up") if self.cfg.kda_output_gate_rank else ("w_og",)
    names = ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_g_down", "w_g_up", "A_log",
             "dt_bias", "w_beta", *gate, "o_norm", "w_o")
    return {n: getattr(self, n)[...] for n in names}

  def projections(self, x: jax.Array, segment_ids=None) -> KDAProjections:
    """x [B,T,D] -> the recurrence inputs (for tests against the naive recurrence)."""
    cfg = self.cfg
    proj, _ = kda_projections(self._arrays(), x, gate_lower_bound=cfg.kda_gate_lower_bound,
                              eps=cfg.l2_norm_eps, dtype=jnp.dtype(cfg.dtype),
                              segment_ids=segment_ids)
    return proj

  def output(self, x: jax.Array, o: jax.Array) -> jax.Array:
    """Output gate + per-head norm + W_o: (x [B,T,D], o [B,T,H,V]) -> [B,T,D]."""
    return kda_output(self._arrays(), x, o, eps=self.cfg.norm_eps, dtype=jnp.dtype(self.cfg.dtype))

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
    """x [B, T, D] (pre-normalised) -> y [B, T, D] in cfg.dtype.

    segment_ids [B, T] int32 (0 = padding) reset the conv window and the recurrent state at
    document starts; padding positions output zero from the recurrence.
    """
    cfg = self.cfg
    p = self._arrays()
    dtype = jnp.dtype(cfg.dtype)
    proj, _ = kda_projections(p, x, gate_lower_bound=cfg.kda_gate_lower_bound, eps=cfg.l2_norm_eps,
                              dtype=dtype, segment_ids=segment_ids)
    mesh = sharding.current_mesh()
    if context_parallel.kda_under_mesh(mesh, cfg.kda_backend):  # CP and/or a Pallas kernel
      o, _ = context_parallel.cp_chunk_kda(*proj, mesh=mesh, segment_ids=segment_ids,
                                           chunk_size=cfg.kda_chunk_size,
                                           backend=cfg.kda_backend,
                                           gate_lower_bound=cfg.kda_gate_lower_bound)
    else:
      o, _ = chunk_kda(*proj, segment_ids=segment_ids, chunk_size=cfg.kda_chunk_size,
                       backend=cfg.kda_backend, gate_lower_bound=cfg.kda_gate_lower_bound)
    return kda_output(p, x, o, eps=cfg.norm_eps, dtype=dtype)

  # ------------------------------------------------------------------ decoding
  def init_cache(self, batch_size: int) -> KDACache:
    cfg = self.cfg
    H, K, V, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_value_dim, cfg.kda_conv_size
    dt = jnp.dtype(cfg.dtype)
    conv = {"q": jnp.zeros((batch_size, W - 1, H * K), dt),
            "k": jnp.zeros((batch_size, W - 1, H * K), dt),
            "v": jnp.zeros((batch_size, W - 1, H * V), dt)}
    return KDACache(conv, jnp.zeros((batch_size, H, K, V), jnp.float32))

  def decode(self, x: jax.Array, cache: KDACache) -> tuple[jax.Array, KDACache]:
    """Prefill or decode from a cache: x [B, T, D] (T >= 1) -> (y [B, T, D], new cache).

    Uses the token-serial recurrence (`recurrent_step`) so it equals the chunked path on the
    same tokens up to fp32 rounding.
    """
    cfg = self.cfg
    p = self._arrays()
    dtype = jnp.dtype(cfg.dtype)
    proj, conv = kda_projections(p, x, gate_lower_bound=cfg.kda_gate_lower_bound, eps=cfg.l2_norm_eps,
                                 dtype=dtype, conv_state=cache.conv)
    scale = cfg.kda_head_dim ** -0.5

    def step(S, xs):
      o, S = recurrent_step(S, *xs, scale)
      return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in proj)
    S, o = jax.lax.scan(step, cache.S, xs)
    o = jnp.moveaxis(o, 0, 1).astype(dtype)
    return kda_output(p, x, o, eps=cfg.norm_eps, dtype=dtype), KDACache(conv, S)
