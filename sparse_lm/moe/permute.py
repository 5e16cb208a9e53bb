"""Row permutations for expert dispatch that compile to gathers only, forward and backward.

The MoE dispatch sorts token-expert pairs by expert (or by destination rank), runs the experts
on the sorted rows and puts the results back. Written the obvious way (`x[order]` forward,
`zeros.at[order].set(y)` back) the program holds scatters: `.at[].set` itself, and the
transpose of every differentiated gather is a scatter-add. The TPU compiler implements each
scatter as a sort of its indices, and a sort is among the most expensive ops it compiles (tens
of seconds and ~1-4 MB of code each at full scale: docs/scaling.md, "Host memory of the
planner"). Here a permutation travels with its inverse, computed once (one sort), and every
application in either direction is a gather: the backward of `x[perm]` is `dy[inverse]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def inverse_permutation(perm: jax.Array) -> jax.Array:
  """inverse[perm[i]] = i for a permutation perm [M] of range(M) (int32 in, int32 out).

  One sort (an argsort of perm). Raises nothing: perm is not checked to be a permutation (a
  repeated entry gives a meaningless result); the callers build it with `jnp.argsort`.
  """
  return jnp.argsort(perm).astype(perm.dtype)


def one_hot_counts(ids: jax.Array, num: int, mask: jax.Array | None = None) -> jax.Array:
  """counts[j] = #{i : ids[i] == j (and mask[i])} for j < num, int32 [num].

  The same as `jax.ops.segment_sum(mask, ids, num)` for ids in [0, num] (ids >= num are not
  counted), as a compare-and-sum instead of a scatter-add (a sort on TPU). ids: any shape,
  integer; mask: same shape, bool. Work and memory O(ids.size x num): meant for small `num`
  (experts, ranks), not for histograms over thousands of bins. Raises nothing.
  """
  hit = ids.reshape(-1)[:, None] == jnp.arange(num, dtype=ids.dtype)[None, :]
  if mask is not None:
    hit = hit & mask.reshape(-1)[:, None]
  return jnp.sum(hit.astype(jnp.int32), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(x: jax.Array, perm: jax.Array, inverse: jax.Array, repeats: int = 1
                 ) -> jax.Array:
  """y[i] = x[perm[i] // repeats]: rows of x [N, ...] in the order of perm [N * repeats].

  Args:
    x: [N, ...] rows (differentiable).
    perm: [N * repeats] int32, a permutation of range(N * repeats): with repeats = k, row i
      of the result is pair perm[i] = (token perm[i] // k, its choice perm[i] % k).
    inverse: inverse_permutation(perm).
    repeats: how many result rows each row of x feeds (k for token -> pair dispatch).

  Returns:
    [N * repeats, ...]. The backward is a gather as well: dx[t] = sum_j dy[inverse[t k + j]]
    (the k cotangents of a token summed in choice order j; the transpose of the plain gather,
    a scatter-add, sums the same terms in another order).

  Raises nothing; perm and inverse are trusted (see `inverse_permutation`). Tested against
  the plain gather and its autodiff in tests/moe/test_permute.py.
  """
  return x[perm // repeats]


def _permute_fwd(x, perm, inverse, repeats):
  return x[perm // repeats], (perm, inverse)


def _permute_bwd(repeats, res, dy):
  perm, inverse = res
  dx = dy[inverse]
  if repeats > 1:
    dx = jnp.sum(dx.reshape(-1, repeats, *dy.shape[1:]), axis=1)
  return dx, None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)
