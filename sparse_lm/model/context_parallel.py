"""Context parallelism: KDA and attention over a sequence sharded over mesh axes.

The sequence axes are those the active rules give `activation_length`: ("context",) by default,
("expert", "context") with `MeshLayout(expert_shards="context")`; every function here runs
over them as one combined axis (shard index expert-major), or over an explicit `axis` (a mesh
axis name or a tuple of them).

Layout: plain contiguous sequence sharding. Shard r of P holds tokens [r T/P, (r+1) T/P) of
every sequence. KDA needs contiguous shards (its state flows left to right), and every other
sequence op of the model (short conv, packing masks, the loss shift, which the data pipeline
precomputes as `targets`) then stays a plain shifted slice that GSPMD handles with a halo
exchange. Attention uses the same layout with a causal mask on global positions (no striping:
striping would need a token permutation before and after every KDA layer). Every query block
visits every key block (masked), so the work per shard is balanced; the price is the 2x of not skipping fully masked blocks. Gated MLA crosses the
network in its latent form (`mla_latent_attention`: 576 values per token at full scale, not the
30,720 of the expanded per-head keys and values) and runs as one MQA head through
`flash_attention`, whose backward recomputes the probabilities block by block (O(T) memory;
autodiff through an online-softmax scan would store all T x T probabilities).

KDA (ARCHITECTURE §9). The recurrence is affine in the state entering a shard:
S_out = M S_in + S_ext, with M = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t)) (K x K per head,
later factors on the left) and S_ext the shard's final state from zero. Both come from ONE
chunked KDA run with the value width extended by K: values [v | 0] and initial state [0 | I]
give the final state [S_ext | M] (with v = 0 the delta rule is exactly the homogeneous step).
A segment reset inside the shard zeroes the state, so M = 0 and S_ext restarts there, as
required. Then (S_ext, M) are combined over the sequence axes (up to 8 shards all-gathered, above
that a log-depth prefix exchange, `prefix_states`); shard r folds its predecessors,
S <- M_j (keep_j S) + S_ext_j for j < r, where keep_j = 0 when shard j's first token starts a
new document (the reset the local kernel cannot see at its position 0); and the chunked kernel
runs again from S_in = keep_r S. Backward is the autodiff of this (all-gather transposes to a
reduce-scatter). Cost: two kernel passes, one of width V + K, plus P K x K matmuls per head.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.kda import chunk_kda
from sparse_lm import sharding as shd

def seq_axes(mesh: jax.sharding.Mesh | None, axis: str | tuple[str, ...] | None = None):
  """The mesh axes (of size > 1) the sequence is sharded over, as one collective axis name:
  None (no sequence sharding), a mesh axis name, or a tuple of names (combined, first axis
  major). `axis` None means the active rules' `activation_length` axes."""
  if mesh is None:
    return None
  names = (shd.mesh_axes("activation_length", mesh) if axis is None else
           tuple(a for a in ((axis,) if isinstance(axis, str) else axis)
                 if mesh.shape.get(a, 1) > 1))
  return shd.spec_entry(names)


def seq_shards(mesh: jax.sharding.Mesh | None, axis=None) -> int:
  """How many shards the sequence is split into (1 without sequence sharding)."""
  names = seq_axes(mesh, axis)
  return 1 if names is None else math.prod(mesh.shape[a] for a in
                                           ((names,) if isinstance(names, str) else names))


def _specs(mesh, axis, B, H):
  """(batch axes, sequence axes, tensor axis) for [B, T, H, ...] arrays; batch axes and
  tensor that do not divide B or H are left out (those dimensions are replicated over them).
  `axis` is a `seq_axes` result."""
  seq = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
  b = shd.logical_to_spec(("activation_batch",), mesh=mesh, shape=(B,))[0]
  # (an explicit `axis` wins over the batch axes)
  b = shd.spec_entry(a for a in ((b,) if isinstance(b, str) else b or ()) if a not in seq)
  t = "tensor" if mesh.shape.get("tensor", 1) > 1 and H % mesh.shape["tensor"] == 0 else None
  return b, axis, t


def fold_states(S_ext: jax.Array, M: jax.Array, keep: jax.Array) -> jax.Array:
  """Initial state of every shard from the all-gathered per-shard maps.

  Args:
    S_ext: [P, B, H, K, V] fp32 final states from a zero initial state.
    M: [P, B, H, K, K] fp32 transition matrices.
    keep: [P, B] fp32, 0 where the shard's first token starts a new document.
  Returns:
    (S_in [P, B, H, K, V]: the state entering each shard, already multiplied by keep;
     S_final [B, H, K, V]: the state after the last shard).
  """
  def step(S, xs):
    s_ext, m, kp = xs
    S_in = kp[:, None, None, None] * S
    S_out = jnp.einsum("bhij,bhjv->bhiv", m, S_in, precision="highest") + s_ext
    return S_out, S_in

  S_final, S_in = jax.lax.scan(step, jnp.zeros_like(S_ext[0]), (S_ext, M, keep))
  return S_in, S_final


# Context sizes above this fold the shard maps with the log-depth prefix exchange
# (`prefix_states`) instead of all-gathering them (`fold_states`).
GATHER_FOLD_MAX_SHARDS = 8


def prefix_states(S_ext: jax.Array, M: jax.Array, keep: jax.Array,
                  axis: str | tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
  """Inside a shard_map over `axis`: the state entering this shard and the final state, by a
  Hillis-Steele inclusive scan of the shards' affine maps f_j(S) = keep_j M_j S + S_ext_j.

  Same result as `fold_states` on the all-gathered maps, but each shard holds O(1) maps at a
  time and exchanges 2 ceil(log2 P) + 1 of them (ppermute), instead of receiving all P: at
  context = 512 and the full preset's KDA heads the all-gather is 6.4 GB per layer per
  chip, the prefix exchange 12.6 MB per step. Composition (g after f):
  (A_g, E_g) o (A_f, E_f) = (A_g A_f, A_g E_f + E_g).

  Args (this shard's): S_ext [B, H, K, V] fp32, M [B, H, K, K] fp32, keep [B] fp32.
  Returns: (S_in [B, H, K, V], already multiplied by keep; S_final [B, H, K, V], the state
  after the last shard, the same on every shard).
  """
  n = jax.lax.axis_size(axis)
  r = jax.lax.axis_index(axis)
  mm = lambda a, b: jnp.einsum("bhij,bhjv->bhiv", a, b, precision="highest")
  A = keep[:, None, None, None] * M
  E = S_ext
  d = 1
  while d < n:
    perm = [(i, i + d) for i in range(n - d)]
    A_prev, E_prev = jax.lax.ppermute((A, E), axis, perm)
    has = r >= d
    E = jnp.where(has, mm(A, E_prev) + E, E)
    A = jnp.where(has, mm(A, A_prev), A)
    d *= 2
  # E is now the inclusive prefix applied to the zero state: the state after this shard.
  E_before = jax.lax.ppermute(E, axis, [(i, i + 1) for i in range(n - 1)])
  S_in = jnp.where(r == 0, 0.0, keep[:, None, None, None] * E_before)
  S_final = jax.lax.psum(jnp.where(r == n - 1, E, 0.0), axis)
  return S_in, S_final


def _kda_cp_body(q, k, v, g, beta, seg, *, axis, scale, chunk_size, backend, want_final,
                 interpret=False, gate_lower_bound=None, fold=None):
  B, T, H, K = q.shape
  V = v.shape[-1]
  kw = dict(scale=scale, chunk_size=chunk_size, backend=backend, interpret=interpret,
            gate_lower_bound=gate_lower_bound)
  if axis is None:  # no context sharding: the kernel per (batch, head) shard
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=want_final, segment_ids=seg, **kw)
    return o, (S if want_final else jnp.zeros((), jnp.float32))
  r = jax.lax.axis_index(axis)
  # pass 1: [S_ext | M] from values [v | 0] and initial state [0 | I]
  v_ext = jnp.concatenate([v, jnp.zeros((B, T, H, K), v.dtype)], axis=-1)
  eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
  s0 = jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32), eye], axis=-1)
  _, SM = chunk_kda(q, k, v_ext, g, beta, initial_state=s0, output_final_state=True,
                    segment_ids=seg, **kw)
  S_ext, M = SM[..., :V], SM[..., V:]
  if seg is None:
    keep = jnp.ones((B,), jnp.float32)
  else:
    last = jax.lax.all_gather(seg[:, -1], axis)  # [P, B]
    prev = last[jnp.maximum(r - 1, 0)]
    first = seg[:, 0]
    keep = jnp.where((first != prev) & (first != 0), 0.0, 1.0).astype(jnp.float32)
  n = jax.lax.axis_size(axis)
  if fold is None:
    fold = "gather" if n <= GATHER_FOLD_MAX_SHARDS else "prefix"
  if fold == "gather":
    all_S = jax.lax.all_gather(S_ext, axis)
    all_M = jax.lax.all_gather(M, axis)
    all_keep = jax.lax.all_gather(keep, axis)
    S_in, S_final = fold_states(all_S, all_M, all_keep)
    S_in = S_in[r]
  elif fold == "prefix":
    S_in, S_final = prefix_states(S_ext, M, keep, axis)
  else:
    raise ValueError(f"fold={fold!r}: choose 'gather' or 'prefix'")
  # pass 2: the real outputs from the true incoming state
  o, _ = chunk_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=False,
                   segment_ids=seg, **kw)
  if want_final:
    return o, S_final
  return o, jnp.zeros((), jnp.float32)


def kda_under_mesh(mesh: jax.sharding.Mesh | None, backend: str) -> bool:
  """Whether a KDA layer must call `cp_chunk_kda` under `mesh`: with the sequence sharded
  (context parallelism over the `activation_length` axes), or when the kernel is a Pallas (Mosaic) one, which GSPMD cannot
  partition (backend "pallas_*", or "auto" on a TPU mesh)."""
  if mesh is None:
    return False
  if seq_shards(mesh) > 1:
    return True
  platform = mesh.devices.flat[0].platform
  return backend.startswith("pallas") or (backend == "auto" and platform == "tpu")


def mla_under_mesh(mesh: jax.sharding.Mesh | None, backend: str = "auto") -> str | None:
  """How an MLA layer attends under `mesh`: "latent" (sequence sharded: the context-parallel
  latent attention), "sharded" (a TPU mesh, where the attention kernel would be a Mosaic one that
  GSPMD cannot partition: `flash_attention` per batch/head shard), or None (the layer's own
  backend)."""
  if mesh is None:
    return None
  if seq_shards(mesh) > 1:
    return "latent"
  if mesh.devices.flat[0].platform == "tpu" and backend in ("auto", "splash"):
    return "sharded"
  return None


def cp_chunk_kda(q, k, v, g, beta, *, mesh: jax.sharding.Mesh,
                 axis: str | tuple[str, ...] | None = None,
                 scale: float | None = None, segment_ids: jax.Array | None = None,
                 initial_state: jax.Array | None = None, output_final_state: bool = False,
                 chunk_size: int = 64, backend: str = "auto", interpret: bool = False,
                 gate_lower_bound: float | None = None, fold: str | None = None):
  """`chunk_kda` with T sharded over mesh axis `axis` (see the module docstring; a tuple of
  axes is one combined axis; None = the active rules' `activation_length` axes).

  With `axis` of size 1 (or absent) it is the plain kernel inside a `shard_map` over the batch
  and head shardings: what a Pallas (Mosaic) kernel needs under a mesh, since custom calls
  cannot be partitioned automatically.

  Args and returns as `pallas_kernels.kda.chunk_kda` (global shapes: q, k, g [B, T, H, K],
  v [B, T, H, V], beta [B, T, H], segment_ids [B, T]); B is sharded over data/fsdp/expert,
  T over `axis`, H over tensor. `fold` picks how the shards' maps are combined: "gather"
  (all-gather + `fold_states`), "prefix" (`prefix_states`, log-depth), or None: gather up to
  GATHER_FOLD_MAX_SHARDS shards, prefix above. The final state (if asked) is the state after the whole
  sequence, replicated over `axis`.

  Raises:
    ValueError: T not divisible by the axis size; initial_state given (CP runs train/prefill
      from the start of the sequence).
  """
  axis = seq_axes(mesh, axis)
  Pn = seq_shards(mesh, axis)
  B, T, H, K = q.shape
  if initial_state is not None:
    raise ValueError("cp_chunk_kda: initial_state is not supported (sequences start at 0)")
  if T % Pn:
    raise ValueError(f"sequence length {T} is not divisible by "
                     f"{'*'.join((axis,) if isinstance(axis, str) else axis)}={Pn}")
  b, c, t = _specs(mesh, axis, B, H)
  s4, s3, s2 = P(b, c, t, None), P(b, c, t), P(b, c)
  sf = P(b, t, None, None)
  if backend == "auto":  # the mesh's platform decides (AOT compiles for TPU from a CPU host)
    backend = "pallas_tpu" if mesh.devices.flat[0].platform == "tpu" else "xla"
  body = functools.partial(_kda_cp_body, axis=axis, scale=scale,
                           chunk_size=chunk_size, backend=backend,
                           want_final=output_final_state, interpret=interpret,
                           gate_lower_bound=gate_lower_bound, fold=fold)

  def wrapped(q, k, v, g, beta, seg):
    with shd.use_mesh(None):
      return body(q, k, v, g, beta, seg)

  args = [q, k, v, g, beta]
  specs = [s4, s4, s4, s4, s3]
  if segment_ids is not None:
    args.append(segment_ids.astype(jnp.int32))
    specs.append(s2)
    fn = wrapped
  else:
    fn = lambda q, k, v, g, beta: wrapped(q, k, v, g, beta, None)
  args = [jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))
          for a, s in zip(args, specs)]
  o, S = jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs),
                       out_specs=(s4, sf if output_final_state else P()),
                       check_vma=False)(*args)
  return o, (S if output_final_state else None)


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

  Args: x [B, T, C]; w [W, C]; segment_ids [B, T] int32 or None; axis as `cp_chunk_kda`.
  Returns y [B, T, C].

  Raises:
    ValueError: the sequence is not sharded over `axis`.
  """
  axis = seq_axes(mesh, axis)
  if axis is None:
    raise ValueError("cp_short_conv: no sequence axis of size > 1 in the mesh; use the plain "
                     "conv")
  W = w.shape[0]
  b, c, _ = _specs(mesh, axis, x.shape[0], 1)

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


def _attn_cp_body(q, k, v, qseg, kseg, *, axis, scale, block_q, block_k):
  """Local queries [B, Tq, H, Dk] against all-gathered keys/values (global causal mask)."""
  Tq = q.shape[1]
  if axis is None:  # sequence not sharded: plain flash attention per batch / head shard
    gather, r = (lambda x: x), 0
  else:
    gather, r = (lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True),
                 jax.lax.axis_index(axis))
  k_all = gather(k)  # [B, T, Hk, Dk]
  v_all = gather(v)
  qpos = r * Tq + jnp.arange(Tq, dtype=jnp.int32)
  kpos = jnp.arange(k_all.shape[1], dtype=jnp.int32)
  if kseg is None:
    qseg = jnp.ones(q.shape[:2], jnp.int32)
    kseg_all = jnp.ones(k_all.shape[:2], jnp.int32)
  else:
    kseg_all = gather(kseg)
  return flash_attention(q, k_all, v_all, qpos, kpos, qseg, kseg_all, scale=scale,
                         block_q=block_q, block_k=block_k)


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


def _visible(qp, kp, qs, ks):
  """[B, 1, bq, bk]: key at kp visible from query at qp (causal, same non-zero segment)."""
  vis = (kp[None, :] <= qp[:, None])[None] & (qs[:, :, None] == ks[:, None, :]) & (
      qs[:, :, None] != 0)
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


def _pv(p, vb):
  if vb.shape[2] == 1:
    return jnp.einsum("bhqk,bkd->bqhd", p, vb[:, :, 0].astype(jnp.float32))
  return jnp.einsum("bhqk,bkhd->bqhd", p, vb.astype(jnp.float32))


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk):
  """Blocked online softmax. Returns (o [B, Tq, H, Dv] fp32, lse [B, H, Tq] fp32, -inf for
  a query that sees no key)."""
  qb_all, qp_all, qs_all = _blocks(q, bq), qpos.reshape(-1, bq), _blocks(qseg, bq)
  kb_all, vb_all = _blocks(k, bk), _blocks(v, bk)
  kp_all, ks_all = kpos.reshape(-1, bk), _blocks(kseg, bk)
  B, _, H, _ = q.shape
  Dv = v.shape[-1]

  def q_block(_, xs):
    qb, qp, qs = xs

    def k_block(carry, ys):
      m, l, acc = carry
      kb, vb, kp, ks = ys
      s = _scores(qb, kb, scale) + _mask_bias(_visible(qp, kp, qs, ks))
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])  # exp(-inf) = 0 for masked keys
      corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
      l = l * corr + jnp.sum(p, axis=-1)
      acc = acc * jnp.swapaxes(corr, 1, 2)[..., None] + _pv(p, vb)
      return (m_new, l, acc), None

    init = (jnp.full((B, H, bq), -jnp.inf, jnp.float32), jnp.zeros((B, H, bq), jnp.float32),
            jnp.zeros((B, bq, H, Dv), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, (kb_all, vb_all, kp_all, ks_all))
    o = acc / jnp.swapaxes(jnp.maximum(l, 1e-30), 1, 2)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), -jnp.inf)
    return None, (o, lse)

  _, (o, lse) = jax.lax.scan(q_block, None, (qb_all, qp_all, qs_all))
  return _unblocks(o), jnp.moveaxis(lse, 0, 2).reshape(B, H, -1)


def _flash_bwd(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, scale, bq, bk):
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
      s = _scores(qb, kb, scale) + _mask_bias(_visible(qp, kp, qs, ks))
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk):
  o, _ = _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk)
  return o


def _flash_vjp_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk):
  o, lse = _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, scale, bq, bk)
  return o, (q, k, v, qpos, kpos, qseg, kseg, o, lse)


def _flash_vjp_bwd(scale, bq, bk, res, do):
  q, k, v, qpos, kpos, qseg, kseg, o, lse = res
  dq, dk, dv = _flash_bwd(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, scale, bq, bk)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def flash_attention(q, k, v, qpos, kpos, qseg, kseg, *, scale: float, block_q: int = 512,
                    block_k: int = 512):
  """Memory-efficient attention with a recomputing backward (FlashAttention-2 in plain JAX):
  O(T) memory in forward and backward, for any query/key ranges (context shards).

  q [B, Tq, H, Dk]; k [B, Tk, Hk, Dk]; v [B, Tk, Hk, Dv] with Hk in {1, H} (1 = MQA, e.g.
  MLA's latent form); qpos [Tq], kpos [Tk] int32 global positions; qseg [B, Tq], kseg [B, Tk]
  int32 segment ids (0 = padding). A key is visible when kpos <= qpos and both segment ids are
  equal and non-zero. Softmax statistics in fp32. Returns [B, Tq, H, Dv] in q's dtype (zero
  rows for queries that see no key, e.g. padding).
  """
  Tq, Tk = q.shape[1], k.shape[1]
  bq, bk = min(block_q, Tq), min(block_k, Tk)
  big = jnp.iinfo(jnp.int32).max
  qp = _pad_to(qpos.astype(jnp.int32), bq, 0, -1)
  qs = _pad_to(qseg.astype(jnp.int32), bq, 1, 0)
  o = _flash(_pad_to(q, bq, 1), _pad_to(k, bk, 1), _pad_to(v, bk, 1), qp,
             _pad_to(kpos.astype(jnp.int32), bk, 0, big), qs,
             _pad_to(kseg.astype(jnp.int32), bk, 1, 0), float(scale), bq, bk)
  return o[:, :Tq].astype(q.dtype)


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
  o_lat = cp_attention(q_full, k_lat.astype(dt), c_kv[:, :, None, :].astype(dt), mesh=mesh,
                       axis=axis, segment_ids=segment_ids, scale=scale, block=block)
  return jnp.einsum("bthc,chd->bthd", o_lat, w_uv.astype(dt),
                    preferred_element_type=jnp.float32).astype(dt)


def cp_attention(q, k, v, *, mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None = None,
                 segment_ids: jax.Array | None = None, scale: float, block: int = 512):
  """Causal attention with T sharded over `axis`: keys/values all-gathered over `axis`
  (pass MLA's latent [c_kv; k_rope] as a single MQA head, Hk = 1, so only 576 values per
  token cross the network), queries stay local. Contiguous sharding (module docstring).

  q [B, T, H, Dk]; k [B, T, Hk, Dk]; v [B, T, Hk, Dv]; segment_ids [B, T] or None.
  Returns [B, T, H, Dv] in q's dtype.
  """
  axis = seq_axes(mesh, axis)
  b, c, t = _specs(mesh, axis, q.shape[0], q.shape[2])
  Hk = k.shape[2]
  kt = t if Hk > 1 else None
  body = functools.partial(_attn_cp_body, axis=axis, scale=scale, block_q=block,
                           block_k=block)

  def wrapped(q, k, v, seg):
    with shd.use_mesh(None):
      return body(q, k, v, seg, seg)

  qs, ks = P(b, c, t, None), P(b, c, kt, None)
  if segment_ids is None:
    fn = lambda q, k, v: wrapped(q, k, v, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qs, ks, ks), out_specs=qs,
                         check_vma=False)(q, k, v)
  return jax.shard_map(wrapped, mesh=mesh, in_specs=(qs, ks, ks, P(b, c)), out_specs=qs,
                       check_vma=False)(q, k, v, segment_ids.astype(jnp.int32))
