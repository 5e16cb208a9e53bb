"""Run with 8 fake CPU devices (see test_sharded_import.py): import the transformers fixture
straight into a fsdp=2 x expert=4 mesh; every variable has its sharding and the values of the
single-device import (whose logits test_hf_kimi_linear.py compares with transformers)."""

import sys

import jax
import numpy as np
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.interop.hf import load_pretrained

fixture = sys.argv[1]
assert jax.device_count() == 8
single, _ = load_pretrained(fixture)  # on one device: the values to compare with
flat_single = dict(nnx.to_flat_state(nnx.state(single)))
layout = shd.MeshLayout(fsdp=2, expert=4)
mesh = shd.make_mesh(layout)
with shd.use_mesh(mesh, layout.rules):
  model, cfg = load_pretrained(fixture, mesh=mesh)
  want = shd.state_shardings(nnx.state(model), mesh)
n_sharded = 0
for (p, v), (_, s) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(want)):
  arr = v[...]
  assert arr.sharding.is_equivalent_to(s.get_value(), arr.ndim), (p, arr.sharding)
  assert np.array_equal(np.asarray(arr), np.asarray(flat_single[p][...])), p
  n_sharded += not arr.sharding.is_fully_replicated
expert = model.last.ffn.expert_gate[...]
assert len(expert.addressable_shards) == 8 and expert.addressable_shards[0].data.shape[0] == 2
print(f"sharded variables {n_sharded}, all equal to the single-device import")
assert n_sharded > 10
print("OK")
