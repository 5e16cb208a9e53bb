"""Run with 8 fake CPU devices (see test_sharded_import.py): import the transformers fixture
straight into a fsdp=2 x expert=4 mesh and check shardings and logits."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.interop.hf import load_pretrained

fixture, reference = sys.argv[1], sys.argv[2]
assert jax.device_count() == 8
layout = shd.MeshLayout(fsdp=2, expert=4)
mesh = shd.make_mesh(layout)
with shd.use_mesh(mesh, layout.rules):
  model, cfg = load_pretrained(fixture, mesh=mesh, remat_policy="none", kda_chunk_size=16)
  want = shd.state_shardings(nnx.state(model), mesh)
  n_sharded = 0
  for (p, v), (_, s) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(want)):
    arr = v[...]
    assert arr.sharding.is_equivalent_to(s.get_value(), arr.ndim), (p, arr.sharding)
    n_sharded += not arr.sharding.is_fully_replicated
  expert = model.last.ffn.expert_gate[...]
  assert len(expert.addressable_shards) == 8 and expert.addressable_shards[0].data.shape[0] == 2
  ref = np.load(reference)
  logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"])))
err = float(np.max(np.abs(logits - ref["logits"])))
print(f"sharded variables {n_sharded}; max |logits - transformers| = {err:.3g}")
assert n_sharded > 10 and err < 1e-4
print("OK")
