"""Expert parallelism for LatentMoE: experts sharded over the `expert` mesh axis (ARCHITECTURE §5, §9).

`ep_dispatch_and_compute` is the multi-device version of the single-device "sort, grouped
matmul, unsort, combine" dispatch: it computes, for latent tokens z [N, L] routed to k experts,

    u[t] = sum_j gates[t, j] * E_{ids[t, j]}(z[t])        (fp32 accumulation)

with E_e the SiTU-GLU expert FFN L -> F -> L. Only latent-width (L, not D) tokens cross the
network. Inside one `jax.shard_map` over the whole mesh, each device holds N / (data * fsdp *
expert * context) tokens and E / expert experts; the exchange runs along `expert` only:

  1. The device sorts its (token, expert) pairs by destination rank (= expert // E_local), then
     by position in the sequence, then by descending margin, and all-gathers its
     per-destination counts -> a [P, P] count matrix C (P = expert axis size), identical on
     every rank of the group.
  2. Optional receive cap R (rows per rank, cfg.ragged_buffer_factor x the mean n k): the
     causal rule of docs/architecture.md ("Capacity drops"): a receiver keeps the group's
     pairs in order of position, up to R; at the position where R runs out, the room left is
     shared among the senders in proportion to their pairs there, highest margins first.
     No pair is ever dropped because of a later token of its sequence. The drop rate and the
     receive rows are returned as metrics. Default: dropless (the receive buffer has the
     worst-case size P * n * k).
  3. Exchange, one of
       "ragged":    jax.lax.ragged_all_to_all (GPU, TPU): exactly the kept rows move.
       "dense":     jax.lax.all_to_all of fixed-size [P, cap, L] blocks, padded (runs
                    everywhere, incl. XLA:CPU, which has no ragged all-to-all).
       "allgather": all-gather the tokens of the group, compute the local experts on the pairs
                    that chose them, reduce-scatter the combined outputs. Used when P < k: then
                    a token goes to ~min(k, P) ranks anyway, and the all-gather moves no more
                    data than the all-to-all while needing no counts or ragged buffers.
  4. The receiver sorts its rows by local expert and runs the grouped matmuls
     (`sparse_lm.moe.gmm`); with `tensor` > 1 the hidden F is sharded and the partial outputs
     are summed over `tensor`. The results travel back by the inverse exchange and are combined
     with the gates at the sender.

A rank (or expert) that receives no rows works: its grouped matmuls see zero-size groups.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import nn
from sparse_lm import sharding as shd
from sparse_lm.config import EP_EXCHANGES
from sparse_lm.moe import permute
from sparse_lm.moe.gmm import gmm
from sparse_lm.moe.situ_glu import situ_activation

# Mesh axes the flattened [B, T] tokens span, in order. The same tuple for both values of
# MeshLayout.expert_shards: B over (data, fsdp, expert) and T over context, or B over
# (data, fsdp) and T over (expert, context), both flatten to data, fsdp, expert, context.
TOKEN_AXES = ("data", "fsdp", "expert", "context")


def resolve_impl(impl: str, ep_size: int, top_k: int, platform: str | None = None) -> str:
  """Concrete exchange for `impl` ("auto": allgather when ep_size < top_k, else ragged on
  GPU/TPU and dense on CPU). `platform` is the mesh's (AOT compiles for TPU from a CPU host)."""
  if impl not in EP_EXCHANGES:
    raise ValueError(f"unknown expert-parallel impl {impl!r}; choose one of {EP_EXCHANGES}")
  if impl != "auto":
    return impl
  if ep_size < top_k:
    return "allgather"
  platform = platform or jax.default_backend()
  return "dense" if platform == "cpu" else "ragged"


def expert_ffn_local(x: jax.Array, local_ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array, *, beta1: float, beta2: float,
                     gmm_backend: str = "auto", platform: str | None = None) -> jax.Array:
  """SiTU-GLU experts on rows x [R, L] with local expert ids [R] (id >= G marks an empty row).

  w_gate, w_up: [G, L, F]; w_down: [G, F, L]. Returns [R, L] in x's dtype; empty rows give 0.
  """
  G = w_gate.shape[0]
  order = jnp.argsort(local_ids, stable=True).astype(jnp.int32)
  inverse = permute.inverse_permutation(order)
  xs = permute.permute_rows(x, order, inverse)
  sizes = permute.one_hot_counts(local_ids, G)
  mm = functools.partial(gmm, group_sizes=sizes, backend=gmm_backend, platform=platform)
  g = checkpoint_name(mm(xs, w_gate), nn.EXPERT_MATMUL_NAME)
  u = checkpoint_name(mm(xs, w_up), nn.EXPERT_MATMUL_NAME)
  h = situ_activation(g, u, beta1, beta2, out_dtype=x.dtype)
  ys = checkpoint_name(mm(h, w_down), nn.EXPERT_MATMUL_NAME)
  valid = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]
  ys = jnp.where(valid, ys, 0)  # rows past the groups: zero whatever the backend returns
  return permute.permute_rows(ys, inverse, order)


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def _count_by_dest(mask, dest, num_ranks):
  """Per-destination count of the pairs where `mask` holds ([num_ranks] int32)."""
  return permute.one_hot_counts(dest, num_ranks, mask)


def _keep_plan(dest, positions, margin, num_ranks, me, axis, recv_cap, num_positions):
  """The causal receive-cap rule (docs/architecture.md, "Capacity drops").

  Pairs are sorted by (destination, position, -margin). Receiver j keeps every pair at a
  position < p*_j, where p*_j is the largest p with (pairs of the whole group to j at
  positions < p) <= recv_cap; the room left at p*_j is shared among the senders in proportion
  to their pairs there (rounded down), each keeping its highest-margin ones; later positions
  are dropped. p*_j is found by a binary search over positions (one psum of [P] counts per
  halving). A pair's fate depends only on pairs at its own or earlier positions.

  Returns the sort order, sorted destinations, in-block index, kept mask (sorted order),
  C [P, P] pairs wanted (sender, receiver) and S [P, P] pairs kept.
  """
  order = jnp.lexsort((-margin.astype(jnp.float32), positions, dest))
  dest_s, pos_s = dest[order], positions[order]
  real = dest_s < num_ranks  # the sentinel (dropped / padding) sorts last
  counts = _count_by_dest(real, dest_s, num_ranks)
  C = jax.lax.all_gather(counts, axis)  # [P_src, P_dst]
  if recv_cap is None:
    kept = counts
  else:
    d = jnp.minimum(dest_s, num_ranks - 1)

    def below(p):  # pairs of the whole group to each receiver at positions < p[j]
      return jax.lax.psum(_count_by_dest(real & (pos_s < p[d]), dest_s, num_ranks), axis)

    def halve(_, lo_hi):  # invariant: below(lo) <= cap; the answer is in [lo, hi]
      lo, hi = lo_hi
      mid = (lo + hi + 1) // 2
      fits = below(mid) <= recv_cap
      return jnp.where(fits, mid, lo), jnp.where(fits, hi, mid - 1)

    lo = jnp.zeros((num_ranks,), jnp.int32)
    hi = jnp.full((num_ranks,), num_positions, jnp.int32)
    steps = max(1, int(num_positions).bit_length())
    p_star, _ = jax.lax.fori_loop(0, steps, halve, (lo, hi))
    base_local = _count_by_dest(real & (pos_s < p_star[d]), dest_s, num_ranks)
    at_local = _count_by_dest(real & (pos_s == p_star[d]), dest_s, num_ranks)
    base = jax.lax.psum(base_local, axis)
    at = jax.lax.psum(at_local, axis)
    room = recv_cap - base
    safe = jnp.maximum(at, 1)
    # floor(at_local * room / at) in int32 without overflow: room = q * at + r, r < at.
    quota = at_local * (room // safe) + (at_local * (room % safe)) // safe
    kept = base_local + jnp.where(at > 0, quota, 0)
  S = jax.lax.all_gather(kept, axis)
  starts = _exclusive_cumsum(counts)  # my block starts in the sorted order
  d = jnp.minimum(dest_s, num_ranks - 1)
  pos = jnp.arange(dest.shape[0]) - starts[d]
  keep_s = real & (pos < kept[d])
  return order, dest_s, pos, keep_s, C, S


def _local_ids(ids_s, me, num_local, keep_s):
  lid = ids_s - me * num_local
  return jnp.where(keep_s, lid, num_local).astype(jnp.int32)


def _ep_body(z, ids, gates, positions, margin, w_gate, w_up, w_down, *, axis, impl, recv_cap,
             num_positions, beta1, beta2, gmm_backend, tensor_axis, platform):
  n, L = z.shape
  k = ids.shape[-1]
  num_ranks = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  num_local = w_gate.shape[0]
  ids_f = ids.reshape(-1).astype(jnp.int32)
  gates_f = gates.reshape(-1)
  dest = jnp.minimum(ids_f // num_local, num_ranks)  # ids >= E: sentinel, never sent
  pos_f = jnp.repeat(positions.astype(jnp.int32), k)
  order, dest_s, pos, keep_s, C, S = _keep_plan(dest, pos_f, margin.reshape(-1), num_ranks, me,
                                                axis, recv_cap, num_positions)
  order = order.astype(jnp.int32)
  inverse = permute.inverse_permutation(order)
  keep_pairs = keep_s[inverse]  # the kept mask in pair order
  ids_s = ids_f[order]
  ffn = functools.partial(expert_ffn_local, w_gate=w_gate, w_up=w_up, w_down=w_down,
                          beta1=beta1, beta2=beta2, gmm_backend=gmm_backend,
                          platform=platform)

  def tensor_sum(y):
    return y if tensor_axis is None else jax.lax.psum(y, tensor_axis)

  if impl == "allgather":
    z_all = jax.lax.all_gather(z, axis, tiled=True)  # [P n, L]
    ids_all = jax.lax.all_gather(ids_f, axis, tiled=True)  # [P n k]
    keep_all = jax.lax.all_gather(keep_pairs, axis, tiled=True)
    gates_all = jax.lax.all_gather(gates_f, axis, tiled=True)
    mine = keep_all & (ids_all // num_local == me) & (ids_all >= 0)
    lid = jnp.where(mine, ids_all - me * num_local, num_local).astype(jnp.int32)
    y = tensor_sum(ffn(z_all[jnp.arange(ids_all.shape[0]) // k], lid))
    w = jnp.where(mine, gates_all, 0).astype(jnp.float32)
    u_all = jnp.sum((y.astype(jnp.float32) * w[:, None]).reshape(-1, k, L), axis=1)
    u = jax.lax.psum_scatter(u_all, axis, scatter_dimension=0, tiled=True)
  else:
    x_s = permute.permute_rows(z, order, inverse, k)  # [n k, L] rows sorted by destination
    starts = _exclusive_cumsum(C[me])
    if impl == "ragged":
      cap_rows = num_ranks * n * k if recv_cap is None else int(recv_cap)
      # forward: my block to j starts at starts[j] and lands at sum_{i<me} S[i, j] on j.
      out_off = jnp.sum(jnp.where(jnp.arange(num_ranks)[:, None] < me, S, 0), axis=0)
      recv_sizes = S[:, me]
      recv_off = _exclusive_cumsum(recv_sizes)
      send_sizes = S[me]
      buf = jnp.zeros((cap_rows, L), z.dtype)
      x_r = jax.lax.ragged_all_to_all(x_s, buf, starts, send_sizes, out_off, recv_sizes,
                                      axis_name=axis)
      lid_s = _local_ids(ids_s, dest_s, num_local, keep_s)
      lid_r = jax.lax.ragged_all_to_all(lid_s[:, None], jnp.full((cap_rows, 1), num_local,
                                                                 jnp.int32),
                                        starts, send_sizes, out_off, recv_sizes,
                                        axis_name=axis)[:, 0]
      y_r = tensor_sum(ffn(x_r, lid_r))
      # back: my received block from i (at recv_off[i]) returns to i's starts for me.
      back_off = jnp.sum(jnp.where(jnp.arange(num_ranks)[None, :] < me, C, 0), axis=1)
      y_s = jax.lax.ragged_all_to_all(y_r, jnp.zeros((n * k, L), y_r.dtype), recv_off,
                                      recv_sizes, back_off, send_sizes, axis_name=axis)
    else:  # dense: fixed-size blocks [P, cap, L]
      cap = n * k if recv_cap is None else min(n * k, int(recv_cap))
      slot = jnp.arange(cap)
      src = starts[:, None] + slot[None, :]  # [P, cap] row of x_s for block (j, slot)
      valid = slot[None, :] < S[me][:, None]
      src = jnp.where(valid, src, 0)
      x_blk = jnp.where(valid[..., None], x_s[src], 0)
      lid_s = _local_ids(ids_s, dest_s, num_local, keep_s)
      lid_blk = jnp.where(valid, lid_s[src], num_local)
      x_r = jax.lax.all_to_all(x_blk, axis, 0, 0, tiled=True)  # block i: from rank i
      lid_r = jax.lax.all_to_all(lid_blk, axis, 0, 0, tiled=True)
      y_r = tensor_sum(ffn(x_r.reshape(-1, L), lid_r.reshape(-1)))
      y_blk = jax.lax.all_to_all(y_r.reshape(num_ranks, cap, L), axis, 0, 0, tiled=True)
      dst = jnp.where(valid, src, n * k)  # out of range -> dropped
      y_s = jnp.zeros((n * k, L), y_blk.dtype).at[dst.reshape(-1)].add(
          y_blk.reshape(-1, L), mode="drop")
    y_pairs = permute.permute_rows(y_s, inverse, order)
    w = jnp.where(keep_pairs, gates_f, 0).astype(jnp.float32)
    u = jnp.sum((y_pairs.astype(jnp.float32) * w[:, None]).reshape(n, k, L), axis=1)

  total = jnp.sum(C[me]).astype(jnp.float32)  # my pairs
  dropped = total - jnp.sum(S[me]).astype(jnp.float32)
  wanted = jnp.sum(C, axis=0).astype(jnp.float32)  # rows each rank would receive, uncapped
  stats = jnp.stack([dropped, total, jnp.max(wanted), jnp.mean(wanted)])
  return u, stats[None]


def _present(mesh, axes):
  return tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)


def ep_dispatch_and_compute(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                            expert_params: Mapping[str, jax.Array], *, mesh: jax.sharding.Mesh,
                            axis: str = "expert", impl: str = "auto",
                            recv_cap: int | None = None, capacity_factor: float | None = None,
                            positions: jax.Array | None = None,
                            num_positions: int | None = None, margin: jax.Array | None = None,
                            beta1: float = 4.0, beta2: float = 25.0,
                            gmm_backend: str = "auto") -> tuple[jax.Array, dict[str, Any]]:
  """Routed-expert output u = sum_j gates[:, j] E_{ids[:, j]}(z) with experts sharded over
  `axis` (see the module docstring for the algorithm).

  Args:
    z: [N, L] latent tokens (the flattened [B, T] of the layer; N sharded over data, fsdp,
      expert, context, in that order, as GSPMD lays out a reshaped [B, T] batch).
    expert_ids: [N, k] int32 routed experts in [0, E]; E (or more) is the sentinel of a
      dropped / padding assignment: never sent, contributes 0, not counted in drop_rate.
    gates: [N, k] combine weights (fp32; zero for an unused slot).
    expert_params: {"w_gate": [E, L, F], "w_up": [E, L, F], "w_down": [E, F, L]}; E sharded
      over `axis`, F over `tensor` (other axes are gathered before the shard_map).
    mesh: the device mesh (MESH_AXES); `mesh.shape[axis]` must divide E.
    impl: one of config.EP_EXCHANGES ("auto" | "ragged" | "dense" | "allgather").
    recv_cap: per-rank receive cap in (token, expert) rows; None = dropless.
    capacity_factor: alternative to recv_cap (cfg.ragged_buffer_factor): cap =
      ceil(factor * n * k), n tokens per device.
    positions: [N] int32 position of each token in its sequence, in [0, num_positions): the
      cap's priority (earlier first). None = all at position 0 (the cap then drops by margin
      alone, which is not causal).
    num_positions: the bound of `positions` (the sequence length); default 1.
    margin: [N, k] fp32 routing margins (z_sel - alpha): priority among pairs at one position
      (larger first). None = the gates.
    beta1, beta2: SiTU-GLU clip levels. gmm_backend: see `sparse_lm.moe.gmm`.

  Returns:
    (u [N, L] float32, metrics) with fp32 scalar metrics: "dropped" and "assigned" (global
    counts of (token, expert) pairs), "drop_rate" (dropped / assigned), "recv_rows_max" and
    "recv_rows_mean" (rows a rank would receive without the cap, max and mean over ranks),
    "recv_buffer_rows" (the receive buffer per rank: the cap, or P * n * k when dropless).

  Raises:
    ValueError: E not divisible by the axis size, or token count not divisible by the
      token-sharding axes.
  """
  num_experts = expert_params["w_gate"].shape[0]
  ep = int(mesh.shape.get(axis, 1))
  N, k = expert_ids.shape
  if num_experts % ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by {axis}={ep}")
  tok_axes = _present(mesh, TOKEN_AXES)
  n_shards = math.prod(mesh.shape[a] for a in tok_axes)
  if N % n_shards:
    raise ValueError(f"{N} tokens are not divisible by the token shards {tok_axes} "
                     f"(= {n_shards})")
  n = N // n_shards
  if capacity_factor is not None and recv_cap is None:
    recv_cap = int(math.ceil(capacity_factor * n * k))
  if positions is None:
    positions, num_positions = jnp.zeros((N,), jnp.int32), 1
  num_positions = int(num_positions or 1)
  margin = gates if margin is None else margin
  platform = mesh.devices.flat[0].platform
  impl = resolve_impl(impl, ep, k, platform)
  if gmm_backend == "dense":  # the MoE's dense reference is not a grouped matmul
    gmm_backend = "auto"
  F = expert_params["w_gate"].shape[-1]
  tensor_axis = ("tensor" if "tensor" in _present(mesh, ("tensor",))
                 and F % mesh.shape["tensor"] == 0 else None)
  tok = tok_axes if tok_axes else None
  e_ax = axis if ep > 1 else None
  w_in = P(e_ax, None, tensor_axis)
  w_out = P(e_ax, tensor_axis, None)
  tspec = P(tok, None)
  # One stats row per token shard: the `tensor` replicas of a shard hold the same tokens and
  # would count its pairs again.
  stats_spec = P(tok, None)

  body = functools.partial(_ep_body, axis=axis, impl=impl, recv_cap=recv_cap,
                           num_positions=num_positions, beta1=beta1, beta2=beta2,
                           gmm_backend=gmm_backend, tensor_axis=tensor_axis, platform=platform)

  def wrapped(*args):
    with shd.use_mesh(None):  # manual axes: no sharding constraints inside
      return body(*args)

  args = (z, expert_ids.astype(jnp.int32), gates, positions.astype(jnp.int32), margin,
          expert_params["w_gate"], expert_params["w_up"], expert_params["w_down"])
  specs = (tspec, tspec, tspec, P(tok), tspec, w_in, w_in, w_out)
  args = tuple(jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))
               for a, s in zip(args, specs))
  u, stats = jax.shard_map(wrapped, mesh=mesh, in_specs=specs, out_specs=(tspec, stats_spec),
                           check_vma=False)(*args)
  dropped, assigned = jnp.sum(stats[:, 0]), jnp.sum(stats[:, 1])
  buffer_rows = ep * n * k if recv_cap is None else recv_cap
  metrics = dict(dropped=dropped, assigned=assigned,
                 drop_rate=dropped / jnp.maximum(assigned, 1.0),
                 recv_rows_max=jnp.max(stats[:, 2]), recv_rows_mean=jnp.mean(stats[:, 3]),
                 recv_buffer_rows=jnp.float32(buffer_rows))
  return u, metrics


def dispatch_and_compute(z: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                         params: Mapping[str, jax.Array], *, mesh: jax.sharding.Mesh,
                         exchange: str = "auto", ragged_buffer_factor: float | None = None,
                         positions: jax.Array | None = None, num_positions: int | None = None,
                         margin: jax.Array | None = None, backend: str = "auto",
                         beta1: float = 4.0, beta2: float = 25.0
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The seam `sparse_lm.moe.latent_moe.dispatch_and_compute` takes when the mesh has
  expert > 1: `ep_dispatch_and_compute` with the layer's settings (cfg.ep_exchange,
  cfg.ragged_buffer_factor, cfg.gmm_backend as `backend`). Returns (u [N, L] fp32, metrics).
  """
  return ep_dispatch_and_compute(z, expert_ids, gates, params, mesh=mesh, impl=exchange,
                                 capacity_factor=ragged_buffer_factor, positions=positions,
                                 num_positions=num_positions, margin=margin, beta1=beta1,
                                 beta2=beta2, gmm_backend=backend)


def reference_dispatch_and_compute(z, expert_ids, gates, expert_params, *, beta1=4.0,
                                   beta2=25.0) -> jax.Array:
  """Single-device definition: every expert on every token (dense), combined with gates.

  Returns u [N, L] float32. For tests (O(N E L F) work).
  """
  from sparse_lm.moe.situ_glu import situ_glu
  E = expert_params["w_gate"].shape[0]
  y = jax.vmap(lambda wg, wu, wd: situ_glu(z, wg, wu, wd, beta1, beta2))(
      expert_params["w_gate"], expert_params["w_up"], expert_params["w_down"])  # [E, N, L]
  onehot = jax.nn.one_hot(expert_ids, E, dtype=jnp.float32) * gates[..., None].astype(
      jnp.float32)  # [N, k, E]
  return jnp.einsum("nke,enl->nl", onehot, y.astype(jnp.float32))
