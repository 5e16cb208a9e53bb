"""CI check of launch/aot_plan.py: the `tiny` preset's full train step (forward, backward,
AdamW, balancer update) compiles with the real TPU compiler for v5p:2x2x2 (8 chips) with the
fsdp, expert and context axes all > 1, and the reported per-chip total is below HBM; also with
the sequence over expert x context (`expert_shards=context`, the stage_1m layout's mode)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SMALLER = ["num_layers=5", "d_model=32", "vocab_size=128", "dense_hidden=64",
           "moe_latent_dim=16", "expert_hidden=32", "shared_expert_hidden=32",
           "balancer_bins=64", "attention_chunk_size=16", "loss_chunk_size=64"]


@pytest.mark.parametrize("layout", ["fsdp=2,expert=2,context=2",
                                    "fsdp=2,expert=2,context=2,expert_shards=context"])
def test_tiny_compiles_for_v5p_2x2x2_with_fsdp_expert_context(tmp_path, layout):
  out = tmp_path / "plan.json"
  cmd = [sys.executable, "-m", "launch.aot_plan", "--preset", "tiny", "--stage", "stage_8k",
         "--topology", "v5p:2x2x2", "--mesh", layout,
         "--global-batch", "4", "--seq-len", "64", "--json", str(out)]
  for s in SMALLER:
    cmd += ["--set", s]
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  plan = json.loads(out.read_text())
  assert plan["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1, "context": 2}
  assert 0 < plan["total"] < plan["hbm"] and plan["fits"]
  assert plan["arguments"] > 0 and plan["temporaries"] > 0
  assert "FITS" in proc.stdout
  assert plan["expert_shards"] == ("context" if "expert_shards=context" in layout else "batch")


ROWS_SCRIPT = """
import collections
from launch.aot_plan import topology_devices
from sparse_lm import sharding as shd
devs = topology_devices("v5p:4x4x4")  # 64 chips, 16 hosts of 4
for text, B in [("fsdp=4,expert=4,context=4", 16),
                ("fsdp=2,expert=4,context=8,expert_shards=context", 4)]:
  layout = shd.MeshLayout.parse(text)
  mesh = shd.make_mesh(layout, devs)
  with shd.use_mesh(mesh, layout.rules):
    sh = shd.batch_sharding(mesh)
  got = [shd.process_rows(sh, (B, 4096), process_index=p)
         for p in sorted({d.process_index for d in devs})]
  print(text, sorted(collections.Counter(got).items()))
"""


def test_hosts_of_a_v5p_slice_load_their_row_groups():
  """`sharding.process_rows` on the real device layout of a 16-host v5p slice. Batch over
  fsdp x expert, sequence over context = 4: the device mesh puts each sequence's 4 chips on 2
  hosts, so 8 row groups of 2 rows, each loaded by 2 hosts. Sequence over expert x context =
  32 chips (8 hosts): 8 hosts load the same 2 rows."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", ROWS_SCRIPT], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("fsdp=")]
  assert lines == [
      "fsdp=4,expert=4,context=4 " + str([((i, 8), 2) for i in range(8)]),
      "fsdp=2,expert=4,context=8,expert_shards=context [((0, 2), 8), ((1, 2), 8)]"], proc.stdout
