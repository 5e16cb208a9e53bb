"""CI checks of launch/aot_plan.py (compile-only TPU devices from libtpu; no TPU needed).

- The `tiny` preset's full train step, its eval step at twice the length (the same program as
  at 1x, larger) and the end-of-stage sample's engine calls (a prefill piece and a decode call,
  caches donated) compile with the real TPU compiler for v5p:2x2x2 (8 chips) with the fsdp,
  expert and context axes all > 1, and the per-chip totals are below HBM.
- A mid-size plan (the reduced tiny model on a 256-chip v5p:4x8x8 slice, EP 16, the sequence
  over expert x context) compiles with the planner's peak host memory below a recorded bound,
  so that a change that makes the planner's host memory grow shows here before it kills a
  full-scale plan (issue 20; docs/scaling.md has the numbers).
- The hosts of a real 16-host slice load the batch row groups their chips hold.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

# These compile TPU programs from this host through libtpu (jax[tpu] in requirements.txt); an
# image without it (the GPU machine's) cannot build a TPU topology.
pytest.importorskip("libtpu", reason="needs libtpu (jax[tpu]) to compile TPU programs here")

ROOT = pathlib.Path(__file__).resolve().parents[2]

SMALLER = ["num_layers=5", "d_model=32", "vocab_size=128", "dense_hidden=64",
           "moe_latent_dim=16", "expert_hidden=32", "shared_expert_hidden=32",
           "balancer_bins=64", "attention_chunk_size=16", "loss_chunk_size=64"]

# Peak RSS of the mid-size plan: 1.85 and 1.87 GB measured 2026-11-30 (docs/scaling.md), + 1/3.
MID_SIZE_RSS_BOUND_GB = 2.5


def _aot_env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' CPU cache (conftest): not TPU programs
  return env


def _plan(tmp_path, args):
  out = tmp_path / "plan.json"
  cmd = [sys.executable, "-m", "launch.aot_plan", *args, "--json", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=_aot_env(), capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return json.loads(out.read_text()), proc.stdout


def _sets(items):
  return [a for s in items for a in ("--set", s)]


def test_tiny_train_eval_and_sample_steps_compile_for_v5p_2x2x2_with_fsdp_expert_context(tmp_path):
  sets = ["mesh=fsdp=2,expert=2,context=2", "tokens_per_batch=256", "seq_len=64",
          "micro_batches=1", "eval_batch_size=4", "model.ragged_buffer_factor=1.25"]
  plan, stdout = _plan(tmp_path, ["--preset", "tiny", "--stage", "stage_8k", "--topology",
                                  "v5p:2x2x2", "--steps",
                                  "train,eval_2x,sample_prefill,sample_decode"]
                       + _sets(sets + [f"model.{s}" for s in SMALLER]))
  assert plan["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1, "context": 2}
  assert plan["expert_shards"] == "batch"
  assert [(s["step"], s["rows"], s["seq_len"]) for s in plan["steps"]] == [
      ("train", 4, 64), ("eval_2x", 4, 128), ("sample_prefill", 1, 64), ("sample_decode", 1, 64)]
  for s in plan["steps"]:
    assert 0 < s["total"] < s["hbm"] and s["fits"], s
    assert s["arguments"] > 0 and s["temporaries"] > 0 and s["compile_s"] > 0
  assert plan["steps"][0]["aliased"] > 0  # the train state is donated
  assert plan["steps"][2]["aliased"] > 0 and plan["steps"][3]["aliased"] > 0  # the caches
  assert 0 < plan["peak_rss"] < 8e9
  assert "FITS" in stdout and "peak host RSS" in stdout


def test_mid_size_plan_stays_within_its_host_memory_bound(tmp_path):
  """256 chips, the sequence over expert x context = 128 shards (`expert_shards=context`,
  the long stages' mode), 16 experts over EP 16."""
  sets = ["mesh=fsdp=2,expert=16,context=8,expert_shards=context", "topology=v5p:4x8x8",
          "seq_len=2048", "tokens_per_batch=4096", "micro_batches=1",
          "model.ragged_buffer_factor=1.25", "model.num_experts=16"]
  plan, stdout = _plan(tmp_path, ["--preset", "tiny", "--stage", "stage_8k"]
                       + _sets(sets + [f"model.{s}" for s in SMALLER]))
  assert plan["mesh"] == {"data": 1, "fsdp": 2, "expert": 16, "tensor": 1, "context": 8}
  assert plan["expert_shards"] == "context" and plan["steps"][0]["fits"]
  print(f"mid-size plan: peak host RSS {plan['peak_rss'] / 1e9:.2f} GB; {stdout[-600:]}")
  assert plan["peak_rss"] < MID_SIZE_RSS_BOUND_GB * 1e9, (
      f"the planner's peak host memory {plan['peak_rss'] / 1e9:.2f} GB exceeds the recorded "
      f"bound {MID_SIZE_RSS_BOUND_GB} GB; phases: {plan['phases']}")


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
  proc = subprocess.run([sys.executable, "-c", ROWS_SCRIPT], cwd=ROOT, env=_aot_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("fsdp=")]
  assert lines == [
      "fsdp=4,expert=4,context=4 " + str([((i, 8), 2) for i in range(8)]),
      "fsdp=2,expert=4,context=8,expert_shards=context [((0, 2), 8), ((1, 2), 8)]"], proc.stdout


MESH_SCRIPT = """
import numpy as np
from launch.aot_plan import topology_devices
from sparse_lm import sharding as shd
from experiments import stage_1m, stage_64k, stage_256k, stage_8k
for m in (stage_8k, stage_64k, stage_256k, stage_1m):
  st = m.FULL
  devs = topology_devices(st.topology, st.num_slices)
  mesh = shd.make_mesh(st.mesh, devs)
  shd.validate_layout(st.model_config(), st.mesh, mesh, global_batch=st.global_batch,
                      seq_len=st.seq_len, num_microbatches=st.micro_batches)
  slices = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
  print(st.name, len(devs), mesh.devices.shape,
        [sorted(int(i) for i in set(slices[k].flat)) for k in range(mesh.shape["data"])])
"""


def test_each_stage_mesh_builds_on_its_compile_only_slices():
  """The four `full` meshes on the libtpu compile-only devices of their topologies; stage_1m's
  two v5p:16x16x16 slices are exactly its `data` axis (only data parallelism crosses DCN)."""
  proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, env=_aot_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("stage_")]
  assert lines == ["stage_8k 2048 (1, 2, 128, 1, 8) [[0]]",
                   "stage_64k 2048 (1, 16, 128, 1, 1) [[0]]",
                   "stage_256k 2048 (1, 8, 128, 1, 2) [[0]]",
                   "stage_1m 8192 (2, 4, 128, 1, 8) [[0], [1]]"], proc.stdout
