"""The logical-axis rules table on pod-sized meshes (abstract meshes: no devices needed)."""

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from sparse_lm import sharding as shd
from sparse_lm.sharding.rules import _place_dropped_axes


def _mesh(data=1, fsdp=1, expert=1, tensor=1, context=1):
  return AbstractMesh((data, fsdp, expert, tensor, context), shd.MESH_AXES)


def _storage_spec(names, shape, mesh):
  spec = shd.logical_to_spec(names, mesh=mesh, shape=shape)
  return _place_dropped_axes(spec, names, shape, mesh)


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


# ------------------------------------------------ expert_shards: what `expert` splits outside
# the routed experts


def test_expert_shards_context_moves_expert_from_batch_to_sequence():
  mesh = _mesh(fsdp=8, expert=128, context=8)
  batch = shd.logical_to_spec(("activation_batch", "activation_length"), mesh=mesh)
  assert batch == P(("fsdp", "expert"), "context")
  rules = shd.MeshLayout(fsdp=8, expert=128, context=8, expert_shards="context").rules
  seq = shd.logical_to_spec(("activation_batch", "activation_length"), rules=rules, mesh=mesh)
  assert seq == P("fsdp", ("expert", "context"))
  assert shd.mesh_axes("activation_length", mesh, rules) == ("expert", "context")
  # parameters are placed as before: the routed experts over expert, d_model ZeRO-sharded
  for names, shape in [(("layers", "exp", "latent", "expert_mlp"), (22, 896, 3584, 3072)),
                       (("embed", "heads"), (7168, 12288))]:
    assert (shd.logical_to_spec(names, rules=rules, mesh=mesh, shape=shape)
            == shd.logical_to_spec(names, mesh=mesh, shape=shape))


def test_mesh_layout_parses_expert_shards_and_rejects_unknown_values():
  lay = shd.MeshLayout.parse("fsdp=8,expert=128,context=8,expert_shards=context")
  assert (lay.fsdp, lay.expert, lay.context, lay.expert_shards) == (8, 128, 8, "context")
  assert str(lay) == "fsdp=8,expert=128,context=8,expert_shards=context"
  assert shd.MeshLayout.parse(str(lay)) == lay
  assert shd.MeshLayout().rules is shd.LOGICAL_AXIS_RULES
  with pytest.raises(ValueError, match="expert_shards='sequence'.*'batch', 'context'"):
    shd.MeshLayout.parse("expert=2,expert_shards=sequence")


def test_validate_layout_follows_the_layouts_batch_and_sequence_axes():
  from sparse_lm.config import get_preset
  cfg = get_preset("full")
  sizes = {"fsdp": 8, "expert": 128, "context": 8}
  batch_lay = shd.MeshLayout(**sizes)
  seq_lay = shd.MeshLayout(**sizes, expert_shards="context")
  # 1M stage: 8 sequences per micro-batch cannot feed fsdp x expert = 1024 batch shards...
  with pytest.raises(ValueError, match=r"global_batch/num_microbatches=8 is not divisible by "
                     r"data=1\*fsdp=8\*expert=128 \(= 1024\)"):
    shd.validate_layout(cfg, batch_lay, sizes, global_batch=32, seq_len=1 << 20,
                        num_microbatches=4)
  # ...but with the sequence over expert x context they divide (8 over fsdp, 1M over 1024)
  shd.validate_layout(cfg, seq_lay, sizes, global_batch=32, seq_len=1 << 20,
                      num_microbatches=4)
  # 2,048 tokens over 1,024 sequence shards: 2 per shard, less than the 3-token conv halo
  with pytest.raises(ValueError, match=r"seq_len=2048 over expert\*context=1024 leaves fewer"):
    shd.validate_layout(cfg, seq_lay, sizes, global_batch=32, seq_len=2048,
                        num_microbatches=4)


# ------------------------------------------------ which batch rows each host loads


def _rows(per_device_rows, hosts_of):
  """Synthetic device -> row slice / process maps (devices are ints)."""
  rows = {d: slice(a, b) for d, (a, b) in enumerate(per_device_rows)}
  return rows, {d: hosts_of(d) for d in rows}


def test_hosts_with_disjoint_rows_load_disjoint_shards():
  rows, procs = _rows([(i, i + 1) for i in range(8)], lambda d: d // 4)  # 2 hosts x 4 chips
  assert [shd.row_groups(rows, procs, 8, p) for p in (0, 1)] == [(0, 2), (1, 2)]


def test_hosts_splitting_the_same_sequences_load_the_same_rows():
  # fsdp=2 (rows) x context=4 (T), 2 chips per host: hosts 0, 1 hold T-quarters of row 0
  rows, procs = _rows([(d // 4, d // 4 + 1) for d in range(8)], lambda d: d // 2)
  assert [shd.row_groups(rows, procs, 2, p) for p in range(4)] == [(0, 2), (0, 2), (1, 2),
                                                                   (1, 2)]
  # one sequence over every chip (a batch replicated over the batch axes): everyone loads it
  rows, procs = _rows([(0, 1)] * 8, lambda d: d // 4)
  assert shd.row_groups(rows, procs, 1, 1) == (0, 1)


def test_overlapping_host_rows_are_rejected():
  rows, procs = _rows([(0, 2), (1, 3), (2, 4), (3, 4)], lambda d: d)
  with pytest.raises(ValueError, match="do not split the 4 rows into equal disjoint groups"):
    shd.row_groups(rows, procs, 4, 0)


def test_process_rows_on_one_process_is_everything():
  import jax
  from jax.sharding import NamedSharding
  mesh = shd.make_mesh(shd.MeshLayout(), jax.devices()[:1])
  assert shd.process_rows(NamedSharding(mesh, P("fsdp", None)), (4, 16)) == (0, 1)


# ------------------------------------------------ every stage's full layout on its TPU slice


@pytest.mark.parametrize("stage_name", ["stage_8k", "stage_64k", "stage_256k", "stage_1m"])
def test_each_full_stage_layout_divides_on_its_real_slice(stage_name):
  """The `full` StageConfig names a slice shape Google offers, its mesh uses every chip of
  `num_slices` such slices, and the model, the micro-batch, the eval batch and the sequence
  divide over that mesh; the tokens per chip per micro-batch are 512 to 1,024."""
  import importlib
  stage = importlib.import_module(f"experiments.{stage_name}").FULL
  stage.validate()
  chips = shd.check_topology(stage.topology, stage.num_slices)
  ici, dcn = stage.mesh.resolve(chips * stage.num_slices, stage.num_slices)
  sizes = {a: ici[a] * dcn[a] for a in shd.MESH_AXES}
  cfg = stage.model_config()
  shd.validate_layout(cfg, stage.mesh, sizes, global_batch=stage.global_batch,
                      seq_len=stage.seq_len, num_microbatches=stage.micro_batches)
  shd.validate_layout(cfg, stage.mesh, sizes, global_batch=stage.eval_batch_size,
                      seq_len=stage.seq_len)
  tokens_per_chip = (stage.global_batch // stage.micro_batches * stage.seq_len
                     // (chips * stage.num_slices))
  assert 512 <= tokens_per_chip <= 1024, tokens_per_chip
  assert sizes["expert"] == 128  # 7 of the 896 experts per chip
  assert stage.num_slices == 1 or dcn["data"] == stage.num_slices  # DCN only data parallel


@pytest.mark.parametrize("topology, num_slices, error", [
    ("v5p:16x16x32", 1, r"largest v5p slice is 16x16x24 \(6,144 chips\)"),
    ("v5p:6x16x16", 1, "multiple of 4"),
    ("v5p:8x8", 1, "3 dimensions"),
    ("v9:8x8x8", 1, "unknown TPU generation"),
    ("v6e:32x16", 1, "largest v6e slice is 16x16"),
])
def test_slice_shapes_that_do_not_exist_are_refused(topology, num_slices, error):
  with pytest.raises(ValueError, match=error):
    shd.check_topology(topology, num_slices)


def test_real_slice_shapes_are_accepted():
  assert [shd.check_topology(t) for t in ("v5p:2x2x1", "v5p:2x2x4", "v5p:4x4x4", "v5p:8x16x16",
                                          "v5p:16x24x16", "v6e:16x16", "v4:16x16x16")] == [
      4, 16, 64, 2048, 6144, 256, 4096]


def test_tpu7x_slices_count_two_devices_per_chip():
  """A tpu7x chip is two JAX devices (jax.experimental.topologies: "tpu7x:2x2x1" has 8), so a
  stage planned for tpu7x resolves its mesh over twice the chips; tpu7x was refused as an
  unknown generation although launch.tpu and aot_plan's HBM table name it."""
  import dataclasses
  from experiments import stage_8k
  assert shd.check_topology("tpu7x:2x2x2") == 8
  assert shd.topology_devices("tpu7x:2x2x2") == 16
  assert shd.topology_devices("tpu7x:4x4x4", 2) == 256
  assert shd.topology_devices("v5p:2x2x4", 2) == 32
  with pytest.raises(ValueError, match="multiple of 4"):
    shd.check_topology("tpu7x:6x8x8")
  stage = dataclasses.replace(stage_8k.STAGES["tiny"], topology="tpu7x:2x2x1", num_slices=1,
                              mesh=shd.MeshLayout(fsdp=8))
  stage.validate()  # 8 devices: fsdp=8 fills them
  with pytest.raises(ValueError, match="multiply to 4, but there are 8 devices"):
    dataclasses.replace(stage, mesh=shd.MeshLayout(fsdp=4)).validate()


def test_a_stage_whose_mesh_does_not_fill_its_slices_is_refused():
  import dataclasses
  from experiments import stage_1m
  bad = dataclasses.replace(stage_1m.FULL, num_slices=1)  # dcn_data=2 but one slice
  with pytest.raises(ValueError, match=r"StageConfig\(stage_1m\): topology='v5p:16x16x16' x "
                     r"num_slices=1.*set num_slices .* to their product.*set topology=None"):
    bad.validate()
  # No dcn_* size at all: "the sizes {} multiply to 1 ... drop the dcn_* sizes" before.
  with pytest.raises(ValueError, match=r"the layout has no dcn_\* sizes, but there are 2 "
                     r"slices: give it sizes over the slices \(e.g. dcn_data=-1"):
    shd.MeshLayout.parse("fsdp=-1").resolve(256, 2)
  with pytest.raises(ValueError, match="largest v5p slice"):
    dataclasses.replace(stage_1m.FULL, topology="v5p:16x16x32", num_slices=1,
                        mesh=shd.MeshLayout(fsdp=-1, expert=128, context=8)).validate()


def test_embedding_lookup_backward_equals_autodiff_of_take():
  """nn.embedding_lookup's hand-laid-out backward (a scatter-add into a gradient buffer
  gathered over the ZeRO axes) is the transpose of the lookup: the same gradient as autodiff
  of jnp.take, bit for bit without a mesh, repeated tokens included."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from sparse_lm import nn

  seed = 5
  print("seed", seed)
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 50, (3, 40)), jnp.int32)  # 120 draws of 50: repeats
  w = jnp.asarray(rng.normal(size=(3, 40, 8)), jnp.float32)
  got = jax.jit(jax.grad(lambda t: jnp.sum(nn.embedding_lookup(t, tokens) * w)))(table)
  want = jax.jit(jax.grad(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * w)))(table)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(nn.embedding_lookup(table, tokens)),
                                np.asarray(table)[np.asarray(tokens)])


@pytest.mark.parametrize("devices, slices", [(0, 1), (-8, 1), (8, 0)])
def test_resolve_refuses_fewer_than_one_device_or_slice(devices, slices):
  """`benchmarks.ep_drops --virtual-devices 0` reported drop rates for a mesh of 0 devices:
  resolve gave {'fsdp': 0, 'expert': 8} (and fsdp=-1 for -8 devices)."""
  with pytest.raises(ValueError, match=r"num_(devices|slices)=-?\d+ must be an int >= 1"):
    shd.MeshLayout.parse("expert=8").resolve(devices, slices)
