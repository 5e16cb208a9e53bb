"""Context parallelism: the `shard_map` plumbing that runs KDA and attention over a sequence
sharded over mesh axes. The math lives beside each operator:

  KDA state passing   pallas_kernels/kda/context_parallel.py  (`sharded_chunk_kda`: the two
                      kernel passes and the fold of the shards' affine maps, ARCHITECTURE §9)
  blocked softmax     pallas_kernels/attention/xla.py  (`flash_attention`, recomputing backward)
  MLA latent gather   sparse_lm/model/mla.py  (`mla_latent_attention`)
  short-conv halo     sparse_lm/model/kda.py  (`cp_short_conv`)

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
visits every key block (masked), so the work per shard is balanced; the price is the 2x of not
skipping fully masked blocks. Gated MLA crosses the network in its latent form (576 values per
token at full scale, not the 30,720 of the expanded per-head keys and values) and runs as one
MQA head through `flash_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.attention import flash_attention
from pallas_kernels.kda.api import resolve_backend
from pallas_kernels.kda.context_parallel import sharded_chunk_kda
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


def shard_specs(mesh, axis, B, H):
  """(batch axes, sequence axes, tensor axis) for [B, T, H, ...] arrays; batch axes and
  tensor that do not divide B or H are left out (those dimensions are replicated over them).
  `axis` is a `seq_axes` result."""
  seq = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
  b = shd.logical_to_spec(("activation_batch",), mesh=mesh, shape=(B,))[0]
  # (an explicit `axis` wins over the batch axes)
  b = shd.spec_entry(a for a in ((b,) if isinstance(b, str) else b or ()) if a not in seq)
  t = "tensor" if mesh.shape.get("tensor", 1) > 1 and H % mesh.shape["tensor"] == 0 else None
  return b, axis, t


def kda_under_mesh(mesh: jax.sharding.Mesh | None, backend: str) -> bool:
  """Whether a KDA layer must call `cp_chunk_kda` under `mesh`: with the sequence sharded
  (context parallelism over the `activation_length` axes), or when the kernel is a Pallas
  (Mosaic / Triton) one, which GSPMD cannot partition (backend "pallas_*", or "auto" where it
  resolves to one: a TPU or Hopper GPU mesh)."""
  if mesh is None:
    return False
  if seq_shards(mesh) > 1:
    return True
  return resolve_backend(backend, mesh.devices.flat[0]).startswith("pallas")


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
  GATHER_FOLD_MAX_SHARDS shards, prefix above (pallas_kernels/kda/context_parallel.py). The
  final state (if asked) is the state after the whole sequence, replicated over `axis`.

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
  b, c, t = shard_specs(mesh, axis, B, H)
  s4, s3, s2 = P(b, c, t, None), P(b, c, t), P(b, c)
  sf = P(b, t, None, None)
  # the mesh's devices decide, not the host's (AOT compiles for TPU from a CPU host)
  backend = resolve_backend(backend, mesh.devices.flat[0])
  body = functools.partial(sharded_chunk_kda, axis=axis, scale=scale,
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


def cp_attention(q, k, v, *, mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None = None,
                 segment_ids: jax.Array | None = None, scale: float, block: int = 512):
  """Causal attention with T sharded over `axis`: keys/values all-gathered over `axis`
  (pass MLA's latent [c_kv; k_rope] as a single MQA head, Hk = 1, so only 576 values per
  token cross the network), queries stay local. Contiguous sharding (module docstring).

  q [B, T, H, Dk]; k [B, T, Hk, Dk]; v [B, T, Hk, Dv]; segment_ids [B, T] or None.
  Returns [B, T, H, Dv] in q's dtype.
  """
  axis = seq_axes(mesh, axis)
  b, c, t = shard_specs(mesh, axis, q.shape[0], q.shape[2])
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
