"""Expert parallelism on 8 fake CPU devices vs the single-device dense reference (fp32):
EP 2, 4, 8 over the dense all-to-all, EP < top-k over all-gather + reduce-scatter, with tensor,
fsdp, data and context axes, a batch routed entirely to one expert, and the receive cap (drop
rate and outputs equal to the cap rule of docs/architecture.md, applied
by a numpy loop over the whole group). See scripts/ep_check.py."""

from tests.multidevice._subproc import run_script


def test_expert_parallel_matches_single_device():
  out = run_script("ep_check.py")
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 9 and all(l.startswith("OK") for l in lines), out
