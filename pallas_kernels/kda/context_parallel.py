"""Context parallelism of KDA: the state-passing folds over sequence shards (ARCHITECTURE §9).

Runs inside a `shard_map` over a sequence axis (a mesh axis name or a tuple of them, one
combined axis); the plumbing that builds the shard_map lives with the model
(`sparse_lm/model/context_parallel.py`). Shard r of P holds tokens [r T/P, (r+1) T/P).

The recurrence is affine in the state entering a shard: S_out = M S_in + S_ext, with
M = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t)) (K x K per head, later factors on the left)
and S_ext the shard's final state from zero. Both come from ONE chunked KDA run with the value
width extended by K: values [v | 0] and initial state [0 | I] give the final state [S_ext | M]
(with v = 0 the delta rule is exactly the homogeneous step). A segment reset inside the shard
zeroes the state, so M = 0 and S_ext restarts there, as required. Then (S_ext, M) are combined
over the sequence axis (up to GATHER_FOLD_MAX_SHARDS shards all-gathered, `fold_states`; above
that a log-depth prefix exchange, `prefix_states`); shard r folds its predecessors,
S <- M_j (keep_j S) + S_ext_j for j < r, where keep_j = 0 when shard j's first token starts a
new document (the reset the local kernel cannot see at its position 0); and the chunked kernel
runs again from S_in = keep_r S. Backward is the autodiff of this (all-gather transposes to a
reduce-scatter). Cost: two kernel passes, one of width V + K, plus P K x K matmuls per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.api import chunk_kda


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


def sharded_chunk_kda(q, k, v, g, beta, seg, *, axis, scale, chunk_size, backend, want_final,
                      interpret=False, gate_lower_bound=None, fold=None):
  """Inside a shard_map whose sequence axis is `axis` (None: not sharded): `chunk_kda` of this
  shard's tokens, started from the true state entering the shard (module docstring).

  Args (this shard's): q, k, g [B, T/P, H, K]; v [B, T/P, H, V]; beta [B, T/P, H]; seg
  [B, T/P] int32 or None; the kernel arguments as `chunk_kda`; want_final: also return the
  state after the whole sequence; fold: "gather", "prefix" or None (gather up to
  GATHER_FOLD_MAX_SHARDS shards, prefix above).

  Returns:
    (o [B, T/P, H, V], S_final [B, H, K, V] fp32 replicated over `axis`, or a zero scalar
    when not `want_final`).

  Raises:
    ValueError: unknown fold.
  """
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
