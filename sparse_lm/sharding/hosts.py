"""Which rows of the global batch each host loads (multi-host data feeding)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

def process_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int], *,
                 process_index: int | None = None) -> tuple[int, int]:
  """Which rows of a [B, T, ...] global batch this process must load: (shard, num_shards).

  The rows of B are split into `num_shards` equal groups; this process loads group `shard`
  (B / num_shards rows, every T) and passes them to
  `jax.make_array_from_process_local_data(sharding, rows, global_shape)`, which takes the
  T-slices its devices hold. Processes whose devices hold the same rows (a sequence split over
  several hosts, e.g. `context` or `expert_shards="context"` wider than the chips of a host)
  get the same shard and must load identical rows (the data pipeline is deterministic per
  shard); processes with disjoint rows get disjoint shards. One process: (0, 1).

  Args:
    sharding: the batch's sharding (e.g. `batch_sharding(mesh)`), over all processes' devices.
    global_shape: (B, T, ...).
    process_index: default `jax.process_index()`.
  Raises:
    ValueError: the processes' row sets overlap without being equal, or differ in size (a
      mesh whose hosts do not tile the batch rows; reorder the mesh axes or change sizes).
  """
  index_map = sharding.devices_indices_map(tuple(global_shape))
  me = jax.process_index() if process_index is None else process_index
  return row_groups({d: idx[0] for d, idx in index_map.items()},
                    {d: d.process_index for d in index_map}, int(global_shape[0]), me)


def row_groups(rows_of_device: Mapping[Any, slice], process_of_device: Mapping[Any, int],
               num_rows: int, process: int) -> tuple[int, int]:
  """The pure part of `process_rows`: from each device's row slice and process,
  (`process`'s group, number of groups); see `process_rows`."""
  sets: dict[int, set] = {}
  for d, rows in rows_of_device.items():
    start, stop, _ = rows.indices(num_rows)
    sets.setdefault(process_of_device[d], set()).add((start, stop))
  if process not in sets:
    raise ValueError(f"process {process} holds none of the batch's devices")
  groups = sorted({tuple(sorted(v)) for v in sets.values()})
  sizes = {sum(b - a for a, b in g) for g in groups}
  covered = sorted(r for g in groups for r in g)
  overlap = any(a[1] > b[0] for a, b in zip(covered, covered[1:]))
  if len(sizes) != 1 or overlap or sum(b - a for a, b in covered) != num_rows:
    raise ValueError(
        f"the processes' batch rows do not split the {num_rows} rows into equal disjoint "
        f"groups (row sets {groups[:4]}{'...' if len(groups) > 4 else ''}); reorder or resize "
        "the mesh axes so that each host's devices hold whole row groups")
  return groups.index(tuple(sorted(sets[process]))), len(groups)
