"""Causal, segment-masked softmax attention with per-platform backends (ARCHITECTURE.md §3).

Layout: q, k [B, T, H, Dk], v [B, T, H, Dv] (Dk may differ from Dv: MLA has 192 vs 128);
segment_ids [B, T] int32 (packed documents; token i sees token j iff j <= i and
seg[i] == seg[j]). Every query sees at least itself, so no row is fully masked.

Backends (`attention_backend`):
  "xla"          full softmax, materialises [B, H, T, T] scores: the reference.
  "xla_chunked"  memory-efficient online softmax over query and key blocks with a recomputing
                 backward (pallas_kernels/attention/xla.py): runs everywhere, the CPU default.
  "tokamax"      tokamax.dot_product_attention (Mosaic GPU kernels; accepts Dk != Dv). GPU.
  "cudnn"        jax.nn.dot_product_attention(implementation="cudnn") with v padded to Dk. GPU.
  "splash"       Pallas splash attention, v padded to Dk. TPU.
  "auto"         tokamax on a Hopper or newer GPU (xla_chunked where tokamax is not installed,
                 and on older GPUs: tokamax's attention backward needs sm90), splash on TPU,
                 xla_chunked elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import (flash_attention, resolve_backend, run_ranges,
                                     tokamax_flags, tokamax_masked)
from pallas_kernels.attention.tokamax import pad_to_block

_NEG = -1e30  # finite "minus infinity" for masked logits (avoids inf - inf = nan)


def _mask(q_pos, k_pos, q_seg, k_seg):
  """[B, Tq, Tk] bool: causal and same segment."""
  m = q_pos[:, None] >= k_pos[None, :]
  if q_seg is not None:
    m = m[None] & (q_seg[:, :, None] == k_seg[:, None, :])
  else:
    m = m[None]
  return m


def attention_xla(q, k, v, *, segment_ids=None, scale: float):
  """Full-softmax reference: o [B, T, H, Dv] in q's dtype; softmax in fp32."""
  T = q.shape[1]
  pos = jnp.arange(T)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  m = _mask(pos, pos, segment_ids, segment_ids)[:, None]
  s = jnp.where(m, s, _NEG)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.astype(q.dtype)


def attention_xla_chunked(q, k, v, *, segment_ids=None, scale: float, chunk_size: int = 512):
  """Blocked online-softmax attention over [chunk_size] query and key blocks: the project's one
  blocked softmax, `pallas_kernels.attention.flash_attention`, its gradients by autodiff through
  the checkpointed block loops (`backward="autodiff"`: the decoder's numbers before the
  blocked softmax was shared, bit for bit on CPU in fp32; the README job's losses, issue 11).

  Memory O(B·H·chunk²) for scores instead of O(B·H·T²), in the forward and the backward pass.
  T is padded to a multiple of the block; padded keys are masked. Key blocks entirely in a query
  block's future are still visited (static shapes) but contribute exactly zero, which keeps the
  result bit-identical under changes of later tokens. Segment id 0 is an ordinary document here
  (as in `attention_xla`): the ids are shifted by one before the kernel, whose 0 means padding.

  Returns o [B, T, H, Dv] in q's dtype (fp32 accumulation).
  """
  B, T = q.shape[:2]
  seg = (jnp.ones((B, T), jnp.int32) if segment_ids is None
         else segment_ids.astype(jnp.int32) + 1)
  pos = jnp.arange(T, dtype=jnp.int32)
  return flash_attention(q, k, v, pos, pos, seg, seg, scale=scale, block_q=chunk_size,
                         block_k=chunk_size, backward="autodiff")


def attention_tokamax(q, k, v, *, segment_ids=None, scale: float, implementation=None):
  """tokamax.dot_product_attention with causal + document mask (Dk != Dv is supported).

  Documents are contiguous runs of equal ids, so the mask is expressed without a [T, T]
  array: causal plus a per-query start index (`k_start`). That needs tokamax's `Mask`, which
  the public function builds only from dense arrays, so we call the op's implementation table
  (`tokamax_masked`). `implementation=None` lets tokamax choose (Mosaic GPU on an H100/H200);
  "xla" and "xla_chunked" run on CPU and are used by the tests. T is padded to a multiple of
  `pallas_kernels.attention.tokamax.SEQ_BLOCK` for the kernels (why: there).
  """
  import tokamax
  if segment_ids is None:  # causal: the padding keys (after every query) are never seen
    tokamax_flags()
    T = q.shape[1]
    return tokamax.dot_product_attention(
        pad_to_block(q), pad_to_block(k), pad_to_block(v), scale=scale, is_causal=True,
        implementation=implementation)[:, :T]
  return tokamax_masked(q, k, v, scale=scale, k_start=run_ranges(segment_ids)[0],
                        is_causal=True, implementation=implementation)


def _pad_v(q, v):
  Dk, Dv = q.shape[-1], v.shape[-1]
  return jnp.pad(v, [(0, 0)] * 3 + [(0, Dk - Dv)]) if Dv < Dk else v


def attention_cudnn(q, k, v, *, segment_ids=None, scale: float):
  """cuDNN flash attention; v padded to q's head dim (cuDNN needs Dk == Dv)."""
  Dv = v.shape[-1]
  lengths = None
  if segment_ids is not None:
    raise NotImplementedError("cudnn backend: packed segments are not wired; use tokamax")
  o = jax.nn.dot_product_attention(q, k, _pad_v(q, v), scale=scale, is_causal=True,
                                   implementation="cudnn", query_seq_lengths=lengths)
  return o[..., :Dv]


def attention_splash(q, k, v, *, segment_ids=None, scale: float, interpret: bool = False,
                     block: int = 512):
  """Pallas splash attention (TPU), causal + segment ids; v padded to q's head dim."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  B, T, H, Dk = q.shape
  Dv = v.shape[-1]
  mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H)])
  bs = min(block, T)
  sizes = sk.BlockSizes(block_q=bs, block_kv=bs, block_kv_compute=bs, block_q_dkv=bs,
                        block_kv_dkv=bs, block_kv_dkv_compute=bs, block_q_dq=bs, block_kv_dq=bs)
  kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
  to_hd = lambda x: x.transpose(0, 2, 1, 3)  # [B, H, T, D]
  o = jax.vmap(lambda qq, kk, vv, ss: kernel(qq, kk, vv, segment_ids=sk.SegmentIds(ss, ss)))(
      to_hd(q * jnp.asarray(scale, q.dtype)), to_hd(k), to_hd(_pad_v(q, v)), seg)
  return o.transpose(0, 2, 1, 3)[..., :Dv].astype(q.dtype)


def dot_product_attention(q, k, v, *, segment_ids=None, scale: float | None = None,
                          backend: str = "auto", chunk_size: int = 512) -> jax.Array:
  """Causal, segment-masked attention: q, k [B,T,H,Dk], v [B,T,H,Dv] -> o [B,T,H,Dv].

  Args:
    segment_ids: [B, T] int32 or None (one document). Token i attends to j iff j <= i and
      segment_ids[i] == segment_ids[j]; documents must be contiguous runs.
    scale: logit scale, default Dk ** -0.5.
    backend: see the module docstring.
    chunk_size: query/key block of "xla_chunked".

  Raises:
    ValueError: unknown backend.
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  backend = resolve_backend(backend)
  if backend == "xla":
    return attention_xla(q, k, v, segment_ids=segment_ids, scale=scale)
  if backend == "xla_chunked":
    return attention_xla_chunked(q, k, v, segment_ids=segment_ids, scale=scale,
                                 chunk_size=chunk_size)
  if backend == "tokamax":
    return attention_tokamax(q, k, v, segment_ids=segment_ids, scale=scale)
  if backend == "cudnn":
    return attention_cudnn(q, k, v, segment_ids=segment_ids, scale=scale)
  if backend == "splash":
    return attention_splash(q, k, v, segment_ids=segment_ids, scale=scale)
  raise ValueError(f"unknown attention backend {backend!r}")
