"""The logical-axis rules table on pod-sized meshes (abstract meshes: no devices needed)."""

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from sparse_lm import sharding as shd


def _mesh(data=1, fsdp=1, expert=1, tensor=1, context=1):
  return AbstractMesh((data, fsdp, expert, tensor, context), shd.MESH_AXES)


def _storage_spec(names, shape, mesh):
  spec = shd.logical_to_spec(names, mesh=mesh, shape=shape)
  return shd._place_dropped_axes(spec, names, shape, mesh)


@pytest.mark.parametrize("names, shape, want", [
    # d_model 7168 over fsdp x context x expert = 2048 does not divide: expert moves to heads.
    (("embed", "heads"), (7168, 12288), P(("fsdp", "context"), "expert")),
    (("layers", "embed", "heads"), (22, 7168, 12288), P(None, ("fsdp", "context"), "expert")),
    (("vocab", "embed"), (163840, 7168), P("expert", ("fsdp", "context"))),
    # the routed experts already use every axis: unchanged
    (("layers", "exp", "latent", "expert_mlp"), (22, 896, 3584, 3072),
     P(None, "expert", ("fsdp", "context"), None)),
    # a norm scale (small) has no sharded logical axis: stays replicated
    (("norm",), (7168,), P(None)),
    # a large weight whose logical axes map to `tensor` only still gets the ZeRO axes
    (("layers", "q_lora", "heads", "kv"), (22, 1536, 96, 192),
     P(None, ("fsdp", "context"), None, None)),
])
def test_dropped_axes_move_to_a_dimension_they_divide(names, shape, want):
  assert _storage_spec(names, shape, _mesh(fsdp=4, expert=128, context=4)) == want


def test_divisible_dimensions_keep_the_rules_placement():
  mesh = _mesh(fsdp=8, expert=16, context=4)  # 512 divides 7168
  assert _storage_spec(("embed", "heads"), (7168, 12288), mesh) == P(
      ("fsdp", "context", "expert"), None)


def test_axis_that_divides_nothing_stays_replicated():
  assert _storage_spec(("embed", "heads"), (7, 9), _mesh(fsdp=2)) == P(None, None)
