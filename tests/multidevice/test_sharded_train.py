"""One real train step of a 3-layer model (KDA, MLA, LatentMoE, AttnRes) on 8 fake CPU devices
vs one device (fp32): AdamW with weight decay, 2 micro-batches, the Quantile Balancing update
after the optimizer step. Loss, gradient norm and balancer max-violation within 1e-4 relative,
every parameter's update within 1e-4 relative (the layer-0 AttnRes query, whose gradient is
zero in exact arithmetic, is checked to stay rounding noise instead), every model_vars leaf (biases, loads,
histograms) within 1e-6 absolute; for FSDP x tensor, for FSDP x expert x context combined (EP
through the LatentMoE seam, CP through the KDA / MLA layers), and with the sequence over expert
x context (`expert_shards="context"`). See scripts/train_check.py."""

from tests.multidevice._subproc import run_script


def test_sharded_train_step_matches_single_device():
  layouts = ["fsdp=4,tensor=2", "fsdp=2,expert=2,context=2",
             "fsdp=2,expert=2,context=2,expert_shards=context"]
  out = run_script("train_check.py", *layouts, timeout=900)
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == len(layouts) and all(l.startswith("OK") for l in lines), out
