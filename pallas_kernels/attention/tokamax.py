"""tokamax's attention with a range mask: each query's visible keys as [k_start, k_end).

No sparse_lm imports; tokamax is imported at first use (it is optional on CPU). Used by the
decoder's "tokamax" backend (causal documents: `sparse_lm.model.attention.attention_tokamax`)
and the vision encoder (bidirectional images of packed rows).
"""

from __future__ import annotations

import jax


def tokamax_flags() -> None:
  """Mark the absl flags parsed (at their defaults) if nobody has: tokamax reads its absl flags
  on first use and otherwise parses sys.argv, which fails under non-absl programs (pytest,
  notebooks)."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


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
    give every query at least one key.

  Raises:
    RuntimeError: no implementation accepted the inputs (each one's reason listed).
  """
  tokamax_flags()
  from tokamax._src.ops.attention import api as tk_api
  from tokamax._src.ops.attention import base as tk_base
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
