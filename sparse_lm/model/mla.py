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

from sparse_lm.config import ModelConfig
from sparse_lm import sharding
from sparse_lm import nn
from sparse_lm.model import context_parallel
from sparse_lm.model.attention import dot_product_attention


class MLACache(NamedTuple):
  """Latent cache of one MLA layer: c_kv [B, S, kv_lora] (normalised), k_rope [B, S, rope],
  and the number of filled positions `length` (int32 scalar)."""
  c_kv: jax.Array
  k_rope: jax.Array
  length: jax.Array


class MLA(nnx.Module):
  """Gated MLA token mixer (input already pre-normalised).

  Params (cfg.param_dtype; norms fp32): w_dq [D, q_lora] (embed, q_lora); q_norm [q_lora];
  w_uq [q_lora, H, nope+rope] (q_lora, heads, kv); w_dkv [D, kv_lora+rope] (embed, kv_lora);
  kv_norm [kv_lora]; w_ukv [kv_lora, H, nope+v] (kv_lora, heads, kv); w_gate [D, H, v]
  (embed, heads, kv); w_o [H, v, D] (heads, kv, embed).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H = cfg.d_model, cfg.mla_num_heads
    self.cfg = cfg
    dense = lambda i, o, n: nn.dense_param(rngs, i, o, n, cfg)
    self.w_dq = dense((D,), (cfg.q_lora_rank,), ("embed", "q_lora"))
    self.q_norm = nn.RMSNorm(cfg.q_lora_rank, cfg=cfg, rngs=rngs)
    self.w_uq = dense((cfg.q_lora_rank,), (H, cfg.qk_head_dim), ("q_lora", "heads", "kv"))
    self.w_dkv = dense((D,), (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), ("embed", "kv_lora"))
    self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, cfg=cfg, rngs=rngs)
    self.w_ukv = dense((cfg.kv_lora_rank,), (H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                       ("kv_lora", "heads", "kv"))
    self.w_gate = dense((D,), (H, cfg.v_head_dim), ("embed", "heads", "kv"))
    self.w_o = dense((H, cfg.v_head_dim), (D,), ("heads", "kv", "embed"))

  @property
  def scale(self) -> float:
    return self.cfg.qk_head_dim ** -0.5

  def _query(self, x):
    dtype = jnp.dtype(self.cfg.dtype)
    c_q = self.q_norm(nn.project(x, self.w_dq[...], dtype=dtype)).astype(dtype)
    return nn.project(c_q, self.w_uq[...], dtype=dtype)  # [B, T, H, 192]

  def _latent(self, x):
    dtype = jnp.dtype(self.cfg.dtype)
    ckv = nn.project(x, self.w_dkv[...], dtype=dtype)
    c_kv, k_rope = ckv[..., :self.cfg.kv_lora_rank], ckv[..., self.cfg.kv_lora_rank:]
    return self.kv_norm(c_kv).astype(dtype), k_rope

  def _gated_out(self, x, o):
    dtype = jnp.dtype(self.cfg.dtype)
    gate = jax.nn.sigmoid(nn.project(x, self.w_gate[...], dtype=dtype, out_dtype=jnp.float32))
    o = (o.astype(jnp.float32) * gate).astype(dtype)
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

  def output(self, x: jax.Array, o: jax.Array) -> jax.Array:
    """G1 gate + W_o: (x [B,T,D], o [B,T,H,v]) -> [B,T,D] in cfg.dtype."""
    return self._gated_out(x, o)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               backend: str | None = None) -> jax.Array:
    """x [B, T, D] (pre-normalised) -> y [B, T, D] in cfg.dtype (causal, segment-masked)."""
    mesh = sharding.current_mesh()
    how = context_parallel.mla_under_mesh(mesh, backend or self.cfg.attention_backend)
    if how == "latent":  # T sharded over `context`: gather the latent
      c_kv, k_rope = self._latent(x)
      o = context_parallel.mla_latent_attention(
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
    """
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    B, T, _ = x.shape
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
    return self._gated_out(x, o), MLACache(c_all, r_all, start + T)
