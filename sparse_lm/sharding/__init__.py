"""Mesh axes, the one table of logical-axis rules, meshes and state shardings (ARCHITECTURE §9).

Every parameter is created with logical axis names (`embed`, `heads`, `exp`, ...) and every
large activation is constrained with `constrain(x, names)`. This package is the only place those
names meet mesh axes. Without an active mesh (`use_mesh`), `constrain` is the identity, so the
model runs unchanged on one CPU.

Files, by concern: `rules.py` (the logical-axis rules, the active mesh, `constrain`, the
state and batch shardings), `mesh.py` (`MeshLayout`, `make_mesh`, `validate_layout`,
`check_topology`), `hosts.py` (which batch rows each host loads).

Typical use (a train script):

    layout = MeshLayout.parse("fsdp=-1,expert=8,context=2")
    mesh = make_mesh(layout)
    validate_layout(cfg, layout, mesh, global_batch=256, seq_len=8192)
    with use_mesh(mesh, layout.rules):
      abstract = nnx.eval_shape(lambda: make_state(cfg))
      shardings = state_shardings(nnx.state(abstract), mesh)
      ...jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)), ...)

Mesh axes, outermost (slowest network) first:
  data    - pure data parallel (replicated params); across slices (DCN) usually.
  fsdp    - data parallel with parameters / optimizer state sharded (ZeRO-3).
  expert  - routed experts sharded; tokens exchanged by all-to-all (moe/expert_parallel.py).
            Outside the routed experts it is a batch axis (`expert_shards="batch"`, the
            default) or a second sequence axis (`expert_shards="context"`, for 1M-token
            stages whose few sequences per step cannot feed a large expert-parallel degree).
  tensor  - Megatron-style head / hidden sharding.
  context - sequence sharding for the 256K and 1M stages (model/context_parallel.py).
"""

from sparse_lm.sharding.hosts import process_rows, row_groups
from sparse_lm.sharding.mesh import (MeshLayout, check_topology, make_mesh, mesh_sizes,
                                     topology_devices, validate_layout)
from sparse_lm.sharding.rules import (EXPERT_SHARDS, LOGICAL_AXIS_RULES, MESH_AXES,
                                      ZERO_MIN_SIZE, axis_size,
                                      batch_sharding, batch_shardings, batch_spec, constrain,
                                      current_mesh, logical_axis_rules, logical_to_spec,
                                      mesh_axes, replicated, shard_pytree, spec_entry,
                                      spec_for, state_shardings, use_mesh, with_shardings)
