"""The inference engine on 8 fake CPU devices (fsdp, expert and context all 2) vs one device
(fp32): the same greedy tokens and log-probs within 1e-5 through a prefill piece, a decode call
and a second turn; the compiled prefill and decode hold no array with every routed expert and
the decode step gathers no weight; the training loop's end-of-stage sample
(`sparse_lm.train.sample.generate`) on the mesh equals one device's. See
scripts/engine_check.py."""

from tests.multidevice._subproc import run_script


def test_engine_on_a_mesh_matches_one_device():
  out = run_script("engine_check.py")
  lines = [l for l in out.splitlines() if l.startswith(("OK", "FAIL"))]
  assert len(lines) == 3 and all(l.startswith("OK") for l in lines), out
