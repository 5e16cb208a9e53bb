"""Context parallelism on 8 fake CPU devices vs single device (fp32, loss and gradients):
KDA without CP (the kernel in a shard_map over batch and heads) and over CP 2 and 4 (T per
shard not a multiple of the chunk, documents crossing and starting on shard boundaries,
padding, final state), both ways of combining the shards' state maps (all-gather, and the
log-depth prefix exchange at CP 4 and 8), the short-conv halo, and attention with gathered
keys/values (MQA latent form and per-head); KDA, conv and attention again with the sequence
over expert x context (`MeshLayout.expert_shards="context"`); and the pallas_tpu kernels in
Pallas interpret mode (XLA:CPU arithmetic, not Mosaic on a TPU) under CP 4, safe and dense
diagonal tiles. See scripts/cp_check.py."""

from tests.multidevice._subproc import run_script


def test_context_parallel_matches_single_device():
  out = run_script("cp_check.py")
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 15 and all(l.startswith("OK") for l in lines), out
