"""tokamax's attention with a range mask: each query's visible keys as [k_start, k_end).

No sparse_lm imports; tokamax is imported at first use (it is optional on CPU). Used by the
decoder's "tokamax" backend (causal documents: `sparse_lm.model.attention.attention_tokamax`)
and the vision encoder (bidirectional images of packed rows).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels.attention.xla import _pad_to


def run_ranges(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each position's run of equal ids as [start, end): int32 [B, T] each.

  Position t of a run [a, b) of equal consecutive ids gets start a and end b (a run is
  contiguous: the same id later in the row, after another id, starts a new run). The key
  ranges of `tokamax_masked` for documents (causal: [start, t + 1)) and images (bidirectional:
  [start, end)). Args: segment_ids int [B, T].
  Raises: ValueError if segment_ids is not 2-D (pass one row as [1, T]).
  """
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_ids: expected [B, T], got shape {segment_ids.shape} "
                     "(pass one row as [1, T])")
  seg = segment_ids.astype(jnp.int32)
  T = seg.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None]
  prev = jnp.concatenate([seg[:, :1] - 1, seg[:, :-1]], axis=1)
  nxt = jnp.concatenate([seg[:, 1:], seg[:, -1:] - 1], axis=1)
  start = jax.lax.cummax(jnp.where(seg != prev, t, 0), axis=1)
  end = jax.lax.cummin(jnp.where(seg != nxt, t + 1, T), axis=1, reverse=True)
  return start, end


class CacheMissFilter(logging.Filter):
  """Lets through the first "Autotuning cache miss" warning of each tokamax op, drops the rest.

  tokamax warns once per kernel call site whose shapes are not in its autotuning cache, then
  uses its heuristic config: a GPU train step printed about a hundred such lines (each with
  the op's whole repr) before its first step. The first one per op (ragged dot, attention,
  attention backward) still says what happened; `dropped` counts the rest by op.
  """

  def __init__(self):
    super().__init__("tokamax cache misses")
    self.dropped: dict[str, int] = {}

  def filter(self, record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith("Autotuning cache miss for"):
      return True
    op = type(record.args[0]).__name__ if record.args else "?"
    first = op not in self.dropped
    self.dropped.setdefault(op, 0)
    if first:
      record.msg = (str(record.msg) + " (sparse_lm shows the first cache miss of each tokamax "
                    "op; the op runs its heuristic config)")
      return True
    self.dropped[op] += 1
    return False


_CACHE_MISS_FILTER = CacheMissFilter()


def tokamax_flags() -> None:
  """Prepare tokamax's first use; idempotent, cheap enough to call before every use.

  Marks the absl flags parsed (at their defaults) if nobody has: tokamax reads its absl flags
  on first use and otherwise parses sys.argv, which fails under non-absl programs (pytest,
  notebooks). Installs `CacheMissFilter` on the "absl" logger (tokamax logs through absl).
  """
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  absl_logger = logging.getLogger("absl")
  if _CACHE_MISS_FILTER not in absl_logger.filters:
    absl_logger.addFilter(_CACHE_MISS_FILTER)


# The sequence length tokamax's attention kernels are given: a multiple of this (see
# `pad_to_block`). With tokamax 0.0.17 on an H100 (and in an earlier H200 suite run), the SFT
# step of `tests/rl/test_trainer.py::test_sft_resumes_exactly` (T = 32, head dims 24 / 16, for
# which tokamax picks its Triton kernel) got NaN gradients from the MLA layer back, finite with
# the length padded to 128 by a wrapper like this one, and finite with either tokamax's
# attention or its grouped matmul swapped for XLA's: values that depend on what other kernels
# left in memory, as from a read past the end of a length that is not a multiple of the
# kernel's block (likely; not confirmed in tokamax's source). docs/benchmarks.md, 2026-12-07.
SEQ_BLOCK = 128


def pad_to_block(x: jax.Array, axis: int = 1, block: int = SEQ_BLOCK) -> jax.Array:
  """x zero-padded at the end of `axis` to a multiple of `block` (x itself if it is one)."""
  return _pad_to(x, block, axis)


def tokamax_masked(q, k, v, *, scale: float, k_start=None, k_end=None, is_causal: bool = False,
                   implementation=None):
  """tokamax attention where query i of row b sees keys [k_start[b, i], k_end[b, i]) (and
  j <= i if `is_causal`): a block-sparse mask without a [T, T] array. tokamax's Mosaic GPU
  forward kernel skips the key blocks outside every query's range of a query block; its
  backward (tokamax 0.0.17, sm90) skips only the causal ones and masks the rest.

  Args:
    q, k [B, T, H, Dk], v [B, T, H, Dv]; k_start, k_end int32 [B, T] or None (0, T).
    implementation: None tries "mosaic" (Mosaic GPU / TPU), "triton", "xla" in that order,
      taking the first that accepts the inputs; or one of tokamax's implementation names.

  Returns:
    o [B, T, H, Dv] in q's dtype. A query with an empty range is not defined here: callers
    give every query at least one key. T is padded to a multiple of `SEQ_BLOCK` for the
    kernel (why: there); a padding query sees only itself, no real query sees a padding key,
    and the padding is sliced off (the same values and gradients as the unpadded call).

  Raises:
    RuntimeError: no implementation accepted the inputs (each one's reason listed).
  """
  tokamax_flags()
  from tokamax._src.ops.attention import api as tk_api
  from tokamax._src.ops.attention import base as tk_base
  B, T = q.shape[:2]
  if T % SEQ_BLOCK:
    Tp = T + (-T % SEQ_BLOCK)
    t = jnp.arange(Tp, dtype=jnp.int32)[None]
    start = jnp.zeros((B, T), jnp.int32) if k_start is None else k_start.astype(jnp.int32)
    end = jnp.full((B, T), T, jnp.int32) if k_end is None else k_end.astype(jnp.int32)
    k_start = jnp.where(t < T, jnp.pad(start, ((0, 0), (0, Tp - T))), t)  # padding: itself
    k_end = jnp.where(t < T, jnp.pad(end, ((0, 0), (0, Tp - T))), t + 1)
    q, k, v = pad_to_block(q), pad_to_block(k), pad_to_block(v)
    return tokamax_masked(q, k, v, scale=scale, k_start=k_start, k_end=k_end,
                          is_causal=is_causal, implementation=implementation)[:, :T]
  row = lambda a: None if a is None else a[:, None, :]  # [B, 1 (heads), T]
  mask = tk_base.Mask(k_start=row(k_start), k_end=row(k_end), is_causal=is_causal)
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
