"""Blocked (flash) softmax attention in plain JAX: the one online softmax of the project.

Used by the decoder's memory-efficient XLA attention (`attention_backend="xla_chunked"`), the
vision encoder's bidirectional attention over padded images, and the context-parallel
attention (each shard's queries against the all-gathered keys, MLA in its latent MQA form).

    for each query block i:  m = -inf, l = 0, acc = 0
      for each key block j:  s = scale q_i k_j^T + mask_ij          (-inf where not visible)
                             m' = max(m, rowmax s);  p = exp(s - m')
                             l = l e^{m - m'} + rowsum p;  acc = acc e^{m - m'} + p v_j
      o_i = acc / l,  lse_i = m + log l

Forward: the online softmax of FlashAttention (Dao et al. 2022; Rabe & Staats, arXiv
2112.05682). Backward, by `backward=`: FlashAttention-2 (Dao 2023, Alg. 2), recomputing p
block by block from the saved log-sum-exp; or autodiff through the `jax.checkpoint`-ed block
loops, which recomputes each query block's forward (autodiff through an unchecked scan would
keep every [bq, bk] probability block). Memory is O(T) in both passes either way. Softmax
statistics and accumulation in fp32.

Visibility: a key is visible from a query when both segment ids are equal and non-zero (0 =
padding) and, if `causal`, the key's global position is <= the query's. Positions are explicit
so that a shard's queries can attend to keys of other shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _pad_to(x, n, axis, value=0):
  pad = (-x.shape[axis]) % n
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _blocks(x, n, axis=1):
  """[B, T, ...] -> [T/n, B, n, ...]."""
  shape = x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis=1):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _visible(qp, kp, qs, ks, causal):
  """[B, 1, bq, bk]: key at kp visible from query at qp (same non-zero segment; causal:
  kp <= qp)."""
  vis = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  if causal:
    vis = vis & (kp[None, :] <= qp[:, None])[None]
  return vis[:, None]


def _mask_bias(vis):
  """[B, 1, bq, bk] additive mask: 0 where visible, -inf elsewhere. Adding it (rather than
  `where(vis, s, -inf)` on the [B, H, bq, bk] scores) keeps the mask free of the head axis, so
  that XLA, when it hoists the mask out of the block loops, stores [.., bq, bk] floats and not
  per-head booleans (1.5 GB per MLA layer for the full preset at 2K tokens per chip)."""
  return jnp.where(vis, 0.0, -jnp.inf).astype(jnp.float32)


def _scores(qb, kb, scale):
  """qb [B, bq, H, Dk], kb [B, bk, Hk, Dk] (Hk in {1, H}) -> [B, H, bq, bk] fp32."""
  if kb.shape[2] == 1:
    return jnp.einsum("bqhd,bkd->bhqk", qb, kb[:, :, 0], preferred_element_type=jnp.float32
                      ) * scale
  return jnp.einsum("bqhd,bkhd->bhqk", qb, kb, preferred_element_type=jnp.float32) * scale


def _heads_first(x):
  """[B, b, H, D] block -> [B, H, b, D]."""
  return jnp.swapaxes(x, 1, 2)


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk, causal):
  """Blocked online softmax. Returns (o [B, Tq, H, Dv] fp32, lse [B, H, Tq] fp32, -inf for
  a query that sees no key).

  The blocks are contracted head-major ([B, H, b, D]) and the running max is a constant for
  autodiff (it cancels): the operations, in order, of the decoder's blocked softmax before
  the one below replaced it (`sparse_lm.model.attention` up to aff6a94), so the decoder's
  fp32 CPU numbers (forward, and the `backward="autodiff"` gradients) are what they were, bit
  for bit. Both loops are `jax.checkpoint`-ed: under autodiff the backward recomputes a query
  block's scores instead of keeping every [bq, bk] block (memory O(T))."""
  qb_all, qp_all, qs_all = _blocks(q, bq), qpos.reshape(-1, bq), _blocks(qseg, bq)
  kb_all, vb_all = _blocks(k, bk), _blocks(v, bk)
  kp_all, ks_all = kpos.reshape(-1, bk), _blocks(kseg, bk)
  B, _, H, _ = q.shape
  Dv = v.shape[-1]

  def q_block(xs):
    qb, qp, qs = xs
    qh = _heads_first(qb)  # [B, H, bq, Dk]

    def k_block(carry, ys):
      m, l, acc = carry
      kb, vb, kp, ks = ys
      kh, vh = _heads_first(kb), _heads_first(vb).astype(jnp.float32)  # [B, Hk, bk, D]
      if kh.shape[1] == 1:  # MQA: one key head for every query head
        s = jnp.einsum("bhqd,bkd->bhqk", qh, kh[:, 0], preferred_element_type=jnp.float32)
      else:
        s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32)
      s = s * scale + _mask_bias(_visible(qp, kp, qs, ks, causal))
      m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])  # exp(-inf) = 0 for masked keys
      corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
      l = l * corr + jnp.sum(p, axis=-1)
      if vh.shape[1] == 1:
        pv = jnp.einsum("bhqk,bkd->bhqd", p, vh[:, 0], preferred_element_type=jnp.float32)
      else:
        pv = jnp.einsum("bhqk,bhkd->bhqd", p, vh, preferred_element_type=jnp.float32)
      acc = acc * corr[..., None] + pv
      return (m_new, l, acc), None

    init = (jnp.full((B, H, bq), -jnp.inf, jnp.float32), jnp.zeros((B, H, bq), jnp.float32),
            jnp.zeros((B, H, bq, Dv), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(jax.checkpoint(k_block), init,
                                  (kb_all, vb_all, kp_all, ks_all))
    # l >= 1 for a query that sees a key; 1 in the denominator of one that sees none keeps
    # its autodiff gradient 0 (not 0 x inf).
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), -jnp.inf)
    return _heads_first(o), lse  # [B, bq, H, Dv], [B, H, bq]

  o, lse = jax.lax.map(jax.checkpoint(q_block), (qb_all, qp_all, qs_all))
  return _unblocks(o), jnp.moveaxis(lse, 0, 2).reshape(B, H, -1)


def _flash_bwd(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, scale, bq, bk, causal):
  """FlashAttention-2 backward (Dao 2023, Alg. 2): recompute p per block from lse."""
  B, Tq, H, Dk = q.shape
  Hk = k.shape[2]
  D = jnp.sum(do.astype(jnp.float32) * o, axis=-1)  # [B, Tq, H]
  qb_all, qp_all, qs_all = _blocks(q, bq), qpos.reshape(-1, bq), _blocks(qseg, bq)
  dob_all, Db_all = _blocks(do.astype(jnp.float32), bq), _blocks(D, bq)
  lseb_all = jnp.moveaxis(lse.reshape(B, H, -1, bq), 2, 0)  # [nq, B, H, bq]
  kb_all, vb_all = _blocks(k, bk), _blocks(v, bk)
  kp_all, ks_all = kpos.reshape(-1, bk), _blocks(kseg, bk)

  def q_block(carry, xs):
    dk, dv = carry  # [nk, B, bk, Hk, D*] fp32
    qb, qp, qs, dob, Db, lseb = xs
    lse_safe = jnp.where(jnp.isfinite(lseb), lseb, 0.0)

    def k_block(dq, ys):
      kb, vb, kp, ks = ys
      s = _scores(qb, kb, scale) + _mask_bias(_visible(qp, kp, qs, ks, causal))
      p = jnp.exp(s - lse_safe[..., None])  # 0 for masked keys
      if Hk == 1:
        dvb = jnp.einsum("bhqk,bqhd->bkd", p, dob)[:, :, None]
        dp = jnp.einsum("bqhd,bkd->bhqk", dob, vb[:, :, 0].astype(jnp.float32))
      else:
        dvb = jnp.einsum("bhqk,bqhd->bkhd", p, dob)
        dp = jnp.einsum("bqhd,bkhd->bhqk", dob, vb.astype(jnp.float32))
      ds = p * (dp - jnp.swapaxes(Db, 1, 2)[..., None]) * scale
      if Hk == 1:
        dq = dq + jnp.einsum("bhqk,bkd->bqhd", ds, kb[:, :, 0].astype(jnp.float32))
        dkb = jnp.einsum("bhqk,bqhd->bkd", ds, qb.astype(jnp.float32))[:, :, None]
      else:
        dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, kb.astype(jnp.float32))
        dkb = jnp.einsum("bhqk,bqhd->bkhd", ds, qb.astype(jnp.float32))
      return dq, (dkb, dvb)

    dq, (dkb, dvb) = jax.lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32),
                                  (kb_all, vb_all, kp_all, ks_all))
    return (dk + dkb, dv + dvb), dq

  nk = kb_all.shape[0]
  init = (jnp.zeros((nk, B, bk, Hk, Dk), jnp.float32),
          jnp.zeros((nk, B, bk, Hk, v.shape[-1]), jnp.float32))
  (dk, dv), dq = jax.lax.scan(q_block, init, (qb_all, qp_all, qs_all, dob_all, Db_all,
                                              lseb_all))
  return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
          _unblocks(dv).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk, causal):
  o, _ = _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk, causal)
  return o


def _flash_vjp_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk, causal):
  o, lse = _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk, causal)
  return o, (q, k, v, qpos, kpos, qseg, kseg, o, lse)


def _flash_vjp_bwd(scale, bq, bk, causal, res, do):
  q, k, v, qpos, kpos, qseg, kseg, o, lse = res
  dq, dk, dv = _flash_bwd(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, scale, bq, bk, causal)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def flash_attention(q, k, v, qpos, kpos, qseg, kseg, *, scale: float, block_q: int = 512,
                    block_k: int = 512, causal: bool = True, backward: str = "flash"):
  """Memory-efficient attention: O(T) memory in forward and backward, for any query/key ranges
  (context shards).

  Args:
    q: [B, Tq, H, Dk]; k: [B, Tk, Hk, Dk]; v: [B, Tk, Hk, Dv] with Hk in {1, H} (1 = MQA,
      e.g. MLA's latent form). Any float dtype; scores and softmax in fp32.
    qpos: [Tq], kpos: [Tk] int global positions (ignored when not causal).
    qseg: [B, Tq], kseg: [B, Tk] int segment ids, 0 = padding.
    scale: logit scale.
    block_q, block_k: query / key block (clipped to Tq / Tk; the sequences are padded to a
      multiple of the block with invisible keys).
    causal: mask keys at later positions (the decoder) or not (the vision encoder).
    backward: "flash": the FlashAttention-2 backward, recomputing each probability block from
      the saved log-sum-exp (the context-parallel attention and the vision encoder);
      "autodiff": JAX differentiates the checkpointed block loops (the decoder's "xla_chunked"
      backend: the gradients of the decoder before this function replaced its own blocked
      softmax, bit for bit on CPU in fp32, so its training runs reproduce). Same memory order.

  Returns:
    [B, Tq, H, Dv] in q's dtype; a key is visible when both segment ids are equal and non-zero
    and (if causal) kpos <= qpos. A query that sees no key (padding, an empty image) gets a zero
    row and zero gradients.

  Raises:
    ValueError: `backward` is not "flash" or "autodiff".
  """
  if backward not in ("flash", "autodiff"):
    raise ValueError(f"flash_attention: backward={backward!r} must be 'flash' or 'autodiff'")
  Tq, Tk = q.shape[1], k.shape[1]
  bq, bk = min(block_q, Tq), min(block_k, Tk)
  big = jnp.iinfo(jnp.int32).max
  args = (_pad_to(q, bq, 1), _pad_to(k, bk, 1), _pad_to(v, bk, 1),
          _pad_to(qpos.astype(jnp.int32), bq, 0, -1),
          _pad_to(kpos.astype(jnp.int32), bk, 0, big),
          _pad_to(qseg.astype(jnp.int32), bq, 1, 0),
          _pad_to(kseg.astype(jnp.int32), bk, 1, 0), float(scale), bq, bk, bool(causal))
  o = _flash_fwd(*args)[0] if backward == "autodiff" else _flash(*args)
  return o[:, :Tq].astype(q.dtype)
