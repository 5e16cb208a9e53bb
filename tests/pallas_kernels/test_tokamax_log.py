"""tokamax's autotuning-cache-miss warnings: the first per op is shown, the rest are counted."""

import logging

from absl import logging as absl_logging

from pallas_kernels.attention import tokamax as tk


class _RaggedDotStandIn:  # tokamax logs the op object; the filter keys on its class name
  pass


class _AttentionStandIn:
  pass


def test_first_cache_miss_per_op_is_shown_and_the_rest_counted(caplog):
  tk.tokamax_flags()
  tk.tokamax_flags()  # idempotent: one filter
  absl = logging.getLogger("absl")
  assert sum(isinstance(f, tk.CacheMissFilter) for f in absl.filters) == 1
  with caplog.at_level(logging.WARNING, logger="absl"):
    for op in (_RaggedDotStandIn(), _AttentionStandIn()) * 3:
      absl_logging.warning("Autotuning cache miss for %s on %s with key %s", op, "NVIDIA H200",
                           '{"lhs": "bf16[2048,512]"}')
    absl_logging.warning("something else from absl")
  shown = [r.getMessage() for r in caplog.records if r.name == "absl"]
  assert len(shown) == 3, shown
  assert "_RaggedDotStandIn" in shown[0] and "first cache miss of each tokamax op" in shown[0]
  assert "_AttentionStandIn" in shown[1]
  assert shown[2] == "something else from absl"
  dropped = tk._CACHE_MISS_FILTER.dropped
  assert dropped["_RaggedDotStandIn"] == 2 and dropped["_AttentionStandIn"] == 2
