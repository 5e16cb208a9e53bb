"""Expert-parallel capacity drops in the model, 8 fake CPU devices (scripts/drop_check.py):
a capped train step reports per-layer and total drop rates equal to an independent count
(the rule of docs/architecture.md applied to the recorded routing), 0 without the cap; and with
the cap on and more than half the assignments dropped, logits at t < P are bit-for-bit
unchanged when the tokens at t >= P change (expert_shards "batch" and "context"); in the capped
runs, each device's sent and dropped pairs equal the virtual grouping that
`benchmarks/ep_drops.py --virtual-mesh` applies to routing recorded on one device."""

from tests.multidevice._subproc import run_script


def test_drop_rate_counted_and_capped_model_causal():
  out = run_script("drop_check.py", timeout=1500)
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 7 and all(l.startswith("OK") for l in lines), out
