"""Causal, segment-masked softmax attention with per-platform backends (ARCHITECTURE.md §3).

Layout: q, k [B, T, H, Dk], v [B, T, H, Dv] (Dk may differ from Dv: MLA has 192 vs 128);
segment_ids [B, T] int32 (packed documents; token i sees token j iff j <= i and
seg[i] == seg[j]). Every query sees at least itself, so no row is fully masked.

Backends (`attention_backend`):
  "xla"          full softmax, materialises [B, H, T, T] scores: the reference.
  "xla_chunked"  memory-efficient online softmax over key blocks (Rabe & Staats,
                 arXiv 2112.05682), queries in blocks too: runs everywhere, the CPU default.
  "tokamax"      tokamax.dot_product_attention (Mosaic GPU kernels; accepts Dk != Dv). GPU.
  "cudnn"        jax.nn.dot_product_attention(implementation="cudnn") with v padded to Dk. GPU.
  "splash"       Pallas splash attention, v padded to Dk. TPU.
  "auto"         tokamax on GPU, splash on TPU, xla_chunked elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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
  """Online-softmax attention over [chunk_size] query and key blocks.

  Memory O(B·H·chunk²) for scores instead of O(B·H·T²), in the forward and (the block loops
  are `jax.checkpoint`-ed) in the backward pass. T is padded to a multiple of the
  block; padded keys are masked (they sit after every real query, so causality masks them).
  Key blocks entirely in a query block's future are still visited (static shapes) but
  contribute exactly zero, which keeps the result bit-identical under changes of later tokens.

  Returns o [B, T, H, Dv] in q's dtype (fp32 accumulation).
  """
  B, T, H, Dk = q.shape
  Dv = v.shape[-1]
  C = min(chunk_size, T)
  n = -(-T // C)
  pad = n * C - T
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  if pad:
    padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, segment_ids = padt(q), padt(k), padt(v), padt(segment_ids)
  qb = q.reshape(B, n, C, H, Dk).transpose(1, 0, 3, 2, 4)  # [n, B, H, C, Dk]
  kb = k.reshape(B, n, C, H, Dk).transpose(1, 0, 3, 2, 4)
  vb = v.reshape(B, n, C, H, Dv).transpose(1, 0, 3, 2, 4)
  sb = segment_ids.reshape(B, n, C).transpose(1, 0, 2)  # [n, B, C]
  pos = jnp.arange(n * C).reshape(n, C)

  def one_query_block(args):
    qi, si, pi = args  # [B,H,C,Dk], [B,C], [C]

    def body(carry, kv):
      m, l, acc = carry
      kj, vj, sj, pj = kv
      s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32) * scale
      mask = _mask(pi, pj, si, sj)[:, None]  # [B,1,C,C]
      s = jnp.where(mask, s, _NEG)
      # The running max cancels mathematically: no gradient through it.
      m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + jnp.sum(p, axis=-1)
      acc = acc * corr[..., None] + jnp.einsum(
          "bhqk,bhkd->bhqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
      return (m_new, l, acc), None

    init = (jnp.full((B, H, C), _NEG, jnp.float32), jnp.zeros((B, H, C), jnp.float32),
            jnp.zeros((B, H, C, Dv), jnp.float32))
    # Checkpointed body: the backward pass recomputes each block's scores instead of keeping
    # every [B, H, C, C] score block of the scan (which would make it O(T²) again).
    (m, l, acc), _ = jax.lax.scan(jax.checkpoint(body), init, (kb, vb, sb, pos))
    return acc / l[..., None]

  # Checkpointed per query block too, so the map keeps only its inputs for the backward pass,
  # not the per-step carries of all n query blocks (O(n² · B·H·C·Dv)).
  o = jax.lax.map(jax.checkpoint(one_query_block), (qb, sb, pos))  # [n, B, H, C, Dv]
  o = o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, H, Dv)[:, :T]
  return o.astype(q.dtype)


def _segment_starts(segment_ids):
  """[B, T] int32: index of the first token of the run of equal ids containing t."""
  B, T = segment_ids.shape
  t = jnp.arange(T)[None]
  prev = jnp.concatenate([segment_ids[:, :1] - 1, segment_ids[:, :-1]], axis=1)
  start = jnp.where(segment_ids != prev, t, 0)
  return jax.lax.cummax(start, axis=1)


def attention_tokamax(q, k, v, *, segment_ids=None, scale: float, implementation=None):
  """tokamax.dot_product_attention with causal + document mask (Dk != Dv is supported).

  Documents are contiguous runs of equal ids, so the mask is expressed without a [T, T]
  array: causal plus a per-query start index (`k_start`). That needs tokamax's `Mask`, which
  the public function builds only from dense arrays, so we call the op's implementation table.
  `implementation=None` lets tokamax choose (Mosaic GPU on an H100/H200); "xla" and
  "xla_chunked" run on CPU and are used by the tests.
  """
  import tokamax
  from absl import flags
  from tokamax._src.ops.attention import api as tk_api
  if not flags.FLAGS.is_parsed():
    # tokamax reads its absl flags on first use and, if nobody parsed them, parses sys.argv,
    # which fails under non-absl programs (pytest, notebooks): take the flag defaults.
    flags.FLAGS.mark_as_parsed()
  from tokamax._src.ops.attention import base as tk_base
  if segment_ids is None:
    return tokamax.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                         implementation=implementation)
  mask = tk_base.Mask(k_start=_segment_starts(segment_ids)[:, None, :], is_causal=True)
  impls = (implementation,) if implementation else ("mosaic", "triton", "xla")
  errors = []
  for impl in impls:
    if impl == "mosaic":
      kind = jax.devices()[0].device_kind
      impl = "mosaic_gpu" if "NVIDIA" in kind else "mosaic_tpu"
    fn = tk_api.IMPLEMENTATIONS[impl]
    try:
      return fn(q, k, v, bias=None, mask=mask, logits_scale=scale, precision=None,
                logits_soft_cap=None, q_sharding=None)
    except NotImplementedError as e:
      errors.append(e)
  raise RuntimeError(f"no tokamax attention implementation accepted the inputs: {errors}")


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


def resolve_backend(backend: str) -> str:
  if backend != "auto":
    return backend
  platform = jax.default_backend()
  if platform == "gpu":
    return "tokamax"
  if platform == "tpu":
    return "splash"
  return "xla_chunked"


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
