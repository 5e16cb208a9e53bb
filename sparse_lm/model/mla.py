"""Gated Multi-head Latent Attention, NoPE (ARCHITECTURE.md §3).

Sources: DeepSeek-V2/V3 MLA (arXiv 2412.19437 §2.1.1), Gated Attention's G1 output gate
(arXiv 2505.06708), Kimi Linear's NoPE MLA layers (arXiv 2510.26692).

    c_q = RMSNorm(h W_dq);            [q_nope; q_rope] = c_q W_uq           (per head 128 + 64)
    [c_kv; k_rope] = h W_dkv;         c_kv = RMSNorm(c_kv)
    [k_nope; v] = c_kv W_ukv          (per head 128 + 128);  k = [k_nope; k_rope] (k_rope shared)
    o_i = softmax(q_i k_iᵀ / sqrt(192) + causal/segment mask) v_i
    y = W_o [ sigmoid(h W_gate) ⊙ concat_i o_i ]

No rotary embedding anywhere: the "rope" channels are ordinary, unrotated query/key channels.
Decoding with the latent cache ([c_kv; k_rope], 576 values per token at full scale) and the
absorbed W_uk / W_uv is `MLA.decode`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from sparse_lm import nn, sharding
from sparse_lm.config import ModelConfig
from sparse_lm.model import context_parallel
from sparse_lm.model.attention import dot_product_attention


class MLACache(NamedTuple):
  """Latent cache of one MLA layer: c_kv [B, S, kv_lora] (normalised), k_rope [B, S, rope],
  and the number of filled positions `length` (int32 scalar)."""
  c_kv: jax.Array
  k_rope: jax.Array
  length: jax.Array


def mla_latent_attention(q: jax.Array, c_kv: jax.Array, k_rope: jax.Array, w_ukv: jax.Array,
                         *, nope_dim: int, scale: float, mesh: jax.sharding.Mesh,
                         axis: str | tuple[str, ...] | None = None,
                         segment_ids: jax.Array | None = None,
                         block: int = 512) -> jax.Array:
  """Gated MLA attention over a context-sharded sequence in the absorbed (latent) form.

  Only the latent [c_kv; k_rope] (kv_lora + rope values per token, 576 at full scale) is
  all-gathered over `axis`; W_uk is folded into the query and W_uv applied to the latent
  output, so attention runs as one MQA head of width kv_lora + rope (DeepSeek-V2 §2.1.2).

  Args:
    q: [B, T, H, nope + rope] queries; c_kv: [B, T, kv_lora] (normalised); k_rope:
      [B, T, rope]; w_ukv: [kv_lora, H, nope + v] the up-projection (k_nope | v).
  Returns:
    o [B, T, H, v] in q's dtype (before the output gate and W_o).
  """
  dt = q.dtype
  w_uk, w_uv = w_ukv[..., :nope_dim], w_ukv[..., nope_dim:]
  q_lat = jnp.einsum("bthd,chd->bthc", q[..., :nope_dim], w_uk.astype(dt),
                     preferred_element_type=jnp.float32).astype(dt)
  q_full = jnp.concatenate([q_lat, q[..., nope_dim:]], axis=-1)  # [B, T, H, kv_lora + rope]
  k_lat = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)[:, :, None, :]
  o_lat = context_parallel.cp_attention(q_full, k_lat.astype(dt), c_kv[:, :, None, :].astype(dt),
                                        mesh=mesh, axis=axis, segment_ids=segment_ids,
                                        scale=scale, block=block)
  return jnp.einsum("bthc,chd->bthd", o_lat, w_uv.astype(dt),
                    preferred_element_type=jnp.float32).astype(dt)


class AttnLogitMax(nnx.Variable):
  """Per-head running maximum of the attention logits over a training step: [H] fp32 (with a
  leading layer axis when stacked). Written by `MLA.__call__(train=True)` when
  cfg.mla_logit_max, read and reset to 0 by QK-clip after the optimizer update."""


def max_attention_logit(q: jax.Array, k: jax.Array, *, scale: float,
                        segment_ids: jax.Array | None = None, block: int = 512) -> jax.Array:
  """max over batch, query i and visible key j <= i (same segment) of scale * q_i . k_j.

  Args:
    q, k: [B, T, H, Dk] queries and keys (any float dtype; the product is fp32).
    scale: the logit scale (Dk ** -0.5 in MLA).
    segment_ids: [B, T] int (0 = padding, never visible); None = one segment.
    block: query rows per step (memory B * H * block * T fp32).
  Returns:
    [H] fp32, the largest logit of each head (-1e30 for a head with no visible pair).
  Source: the S_max of QK-clip, Kimi K2 (arXiv 2507.20534) §2.1.
  """
  B, T, H, _ = q.shape
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
  C = min(block, T)
  n = -(-T // C)
  pad = n * C - T
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  sp = jnp.pad(seg, ((0, 0), (0, pad)))
  kpos = jnp.arange(T)

  def one(i):
    qc = jax.lax.dynamic_slice_in_dim(qp, i * C, C, 1)
    sc = jax.lax.dynamic_slice_in_dim(sp, i * C, C, 1)
    s = jnp.einsum("bqhd,bkhd->bhqk", qc, k, preferred_element_type=jnp.float32) * scale
    qpos = i * C + jnp.arange(C)
    ok = (kpos[None, :] <= qpos[:, None])[None] & (sc[:, :, None] == seg[:, None, :])
    ok = ok & (sc[:, :, None] != 0)
    return jnp.max(jnp.where(ok[:, None], s, -1e30), axis=(0, 2, 3))

  return jnp.max(jax.lax.map(one, jnp.arange(n)), axis=0)


class MLA(nnx.Module):
  """Gated MLA token mixer (input already pre-normalised).

  Params (cfg.param_dtype; norms fp32): w_dq [D, q_lora] (embed, q_lora); q_norm [q_lora];
  w_uq [q_lora, H, nope+rope] (q_lora, heads, kv); w_dkv [D, kv_lora+rope] (embed, kv_lora);
  kv_norm [kv_lora]; w_ukv [kv_lora, H, nope+v] (kv_lora, heads, kv); w_gate [D, H, v]
  (embed, heads, kv); w_o [H, v, D] (heads, kv, embed).

  Kimi-Linear variants: cfg.q_lora_rank = 0 replaces w_dq / q_norm / w_uq by one w_q
  [D, H, nope+rope] (embed, heads, kv); cfg.mla_output_gate = False drops w_gate (y = W_o o).
  The q / kv latent norms use cfg.mla_norm_eps (None = cfg.norm_eps).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H = cfg.d_model, cfg.mla_num_heads
    self.cfg = cfg
    dense = lambda i, o, n: nn.dense_param(rngs, i, o, n, cfg)
    eps = cfg.norm_eps if cfg.mla_norm_eps is None else cfg.mla_norm_eps
    if cfg.q_lora_rank:
      self.w_dq = dense((D,), (cfg.q_lora_rank,), ("embed", "q_lora"))
      self.q_norm = nn.RMSNorm(cfg.q_lora_rank, cfg=cfg, rngs=rngs, eps=eps)
      self.w_uq = dense((cfg.q_lora_rank,), (H, cfg.qk_head_dim), ("q_lora", "heads", "kv"))
    else:
      self.w_q = dense((D,), (H, cfg.qk_head_dim), ("embed", "heads", "kv"))
    self.w_dkv = dense((D,), (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), ("embed", "kv_lora"))
    self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, cfg=cfg, rngs=rngs, eps=eps)
    self.w_ukv = dense((cfg.kv_lora_rank,), (H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                       ("kv_lora", "heads", "kv"))
    if cfg.mla_output_gate:
      self.w_gate = dense((D,), (H, cfg.v_head_dim), ("embed", "heads", "kv"))
    self.w_o = dense((H, cfg.v_head_dim), (D,), ("heads", "kv", "embed"))
    if cfg.mla_logit_max:
      self.attn_logit_max = AttnLogitMax(jnp.zeros((H,), jnp.float32), out_sharding=(None,),
                                         eager_sharding=False)

  @property
  def scale(self) -> float:
    return self.cfg.qk_head_dim ** -0.5

  def query(self, x: jax.Array) -> jax.Array:
    """x [B,T,D] -> q [B,T,H,qk_nope+qk_rope] in cfg.dtype (the inference engine's entry)."""
    return self._query(x)

  def latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B,T,D] -> (c_kv [B,T,kv_lora] normalised, k_rope [B,T,rope]) in cfg.dtype: what a
    latent cache stores per token."""
    return self._latent(x)

  def query_from_down(self, c_q: jax.Array) -> jax.Array:
    """The query from its down-projection c_q = x W_dq [B,T,q_lora] (any float dtype: rounded
    to cfg.dtype here, as `nn.project` rounds it): W_uq RMSNorm(c_q) [B,T,H,qk_nope+qk_rope]
    in cfg.dtype. For a caller that computed x W_dq in a wider GEMM (the decode step's)."""
    dtype = jnp.dtype(self.cfg.dtype)
    c_q = self.q_norm(c_q.astype(dtype)).astype(dtype)
    return nn.project(c_q, self.w_uq[...], dtype=dtype)  # [B, T, H, 192]

  def latent_from_down(self, ckv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`latent` from x W_dkv [B,T,kv_lora+rope] (any float dtype: rounded to cfg.dtype here):
    (RMSNorm(c_kv) [B,T,kv_lora], k_rope [B,T,rope]) in cfg.dtype."""
    dtype = jnp.dtype(self.cfg.dtype)
    ckv = ckv.astype(dtype)
    c_kv, k_rope = ckv[..., :self.cfg.kv_lora_rank], ckv[..., self.cfg.kv_lora_rank:]
    return self.kv_norm(c_kv).astype(dtype), k_rope

  def _query(self, x):
    dtype = jnp.dtype(self.cfg.dtype)
    if not self.cfg.q_lora_rank:
      return nn.project(x, self.w_q[...], dtype=dtype)  # [B, T, H, 192]
    return self.query_from_down(nn.project(x, self.w_dq[...], dtype=dtype))

  def _latent(self, x):
    return self.latent_from_down(nn.project(x, self.w_dkv[...],
                                            dtype=jnp.dtype(self.cfg.dtype)))

  def _gated_out(self, x, o, gate_logits=None):
    dtype = jnp.dtype(self.cfg.dtype)
    if self.cfg.mla_output_gate:
      if gate_logits is None:
        gate_logits = nn.project(x, self.w_gate[...], dtype=dtype, out_dtype=jnp.float32)
      gate = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
      o = (o.astype(jnp.float32) * gate).astype(dtype)
    else:
      o = o.astype(dtype)
    return checkpoint_name(nn.project(o, self.w_o[...], 2, dtype=dtype), "out_proj")

  def qkv(self, x: jax.Array):
    """x [B,T,D] -> q, k [B,T,H,192], v [B,T,H,128] (cfg.dtype), as fed to the attention."""
    cfg = self.cfg
    B, T, _ = x.shape
    H = cfg.mla_num_heads
    q = self._query(x)
    c_kv, k_rope = self._latent(x)
    kv = nn.project(c_kv, self.w_ukv[...], dtype=jnp.dtype(cfg.dtype))
    k_nope, v = kv[..., :cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
    k = jnp.concatenate(
        [k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (B, T, H, cfg.qk_rope_head_dim))], -1)
    return (checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"),
            checkpoint_name(v, "value_proj"))

  def output(self, x: jax.Array, o: jax.Array, gate_logits: jax.Array | None = None
             ) -> jax.Array:
    """G1 gate + W_o: (x [B,T,D], o [B,T,H,v]) -> [B,T,D] in cfg.dtype. gate_logits: x W_gate
    [B,T,H,v] in fp32 where the caller has computed it (the decode step's one input GEMM,
    `sparse_lm.inference.fused.mla_input_matrix`); else computed here from x."""
    return self._gated_out(x, o, gate_logits)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               backend: str | None = None, train: bool = False) -> jax.Array:
    """x [B, T, D] (pre-normalised) -> y [B, T, D] in cfg.dtype (causal, segment-masked).

    With train=True and cfg.mla_logit_max, also raises `attn_logit_max` to each head's
    largest attention logit of this call (`max_attention_logit`, no gradient)."""
    mesh = sharding.current_mesh()
    if train and self.cfg.mla_logit_max:
      q, k, _ = self.qkv(jax.lax.stop_gradient(x))
      s_max = max_attention_logit(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k),
                                  scale=self.scale, segment_ids=segment_ids,
                                  block=self.cfg.attention_chunk_size)
      nn.assign(self.attn_logit_max, jnp.maximum(self.attn_logit_max[...], s_max))
    how = context_parallel.mla_under_mesh(mesh, backend or self.cfg.attention_backend)
    if how == "latent":  # T sharded over `context`: gather the latent
      c_kv, k_rope = self._latent(x)
      o = mla_latent_attention(
          self._query(x), c_kv, k_rope, self.w_ukv[...], nope_dim=self.cfg.qk_nope_head_dim,
          scale=self.scale, mesh=mesh, segment_ids=segment_ids,
          block=self.cfg.attention_chunk_size)
      return self._gated_out(x, o)
    q, k, v = self.qkv(x)
    if how == "sharded":  # TPU mesh: flash attention per batch / head shard
      o = context_parallel.cp_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                                        scale=self.scale, block=self.cfg.attention_chunk_size)
      return self._gated_out(x, o)
    o = dot_product_attention(q, k, v, segment_ids=segment_ids, scale=self.scale,
                              backend=backend or self.cfg.attention_backend,
                              chunk_size=self.cfg.attention_chunk_size)
    return self._gated_out(x, o)

  # ------------------------------------------------------------------ decoding
  def init_cache(self, batch_size: int, max_length: int) -> MLACache:
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    return MLACache(jnp.zeros((batch_size, max_length, cfg.kv_lora_rank), dt),
                    jnp.zeros((batch_size, max_length, cfg.qk_rope_head_dim), dt),
                    jnp.zeros((), jnp.int32))

  def decode(self, x: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
    """Absorbed-weight attention over the latent cache: x [B, T, D] -> (y, new cache).

    W_uk is folded into the query (q_lat = q_nope W_ukᵀ, [B,T,H,kv_lora]) and W_uv into the
    output (o = (p · c_kv) W_uv), so attention runs as one (kv_lora + rope)-wide MQA head over
    the cache. The T new tokens attend causally to the cache and to each other (one document).

    Raises:
      ValueError: the T tokens do not fit: cache.length + T > the cache's max_length (checked
        when cache.length is concrete; under jit, where it is traced, the outputs of a call that
        would pass the end are NaN instead of silently wrong).
    """
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    B, T, _ = x.shape
    max_length = cache.c_kv.shape[1]
    if T > max_length or (not isinstance(cache.length, jax.core.Tracer)
                          and int(cache.length) + T > max_length):
      raise ValueError(
          f"MLA.decode: writing {T} token(s) at position {cache.length} passes the end of the "
          f"cache (max_length={max_length}); make it with init_cache(batch_size, max_length=...) "
          "large enough for the prompt and every generated token")
    q = self._query(x).astype(jnp.float32)
    q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    c_kv, k_rope = self._latent(x)
    start = cache.length
    c_all = jax.lax.dynamic_update_slice_in_dim(cache.c_kv, c_kv.astype(cache.c_kv.dtype),
                                                start, 1)
    r_all = jax.lax.dynamic_update_slice_in_dim(cache.k_rope, k_rope.astype(cache.k_rope.dtype),
                                                start, 1)
    w_ukv = self.w_ukv[...].astype(jnp.float32)
    w_uk, w_uv = w_ukv[..., :cfg.qk_nope_head_dim], w_ukv[..., cfg.qk_nope_head_dim:]
    q_lat = jnp.einsum("bthd,chd->bthc", q_nope, w_uk)
    s = (jnp.einsum("bthc,bsc->bhts", q_lat, c_all.astype(jnp.float32)) +
         jnp.einsum("bthr,bsr->bhts", q_rope, r_all.astype(jnp.float32))) * self.scale
    S = c_all.shape[1]
    mask = jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None]
    s = jnp.where(mask[None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o_lat = jnp.einsum("bhts,bsc->bthc", p, c_all.astype(jnp.float32))
    o = jnp.einsum("bthc,chd->bthd", o_lat, w_uv).astype(dtype)
    y = self._gated_out(x, o)
    y = jnp.where(start + T > max_length, jnp.asarray(jnp.nan, y.dtype), y)  # traced overflow
    return y, MLACache(c_all, r_all, start + T)
