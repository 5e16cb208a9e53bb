"""The expert-parallel receive cap applied to routing recorded without expert parallelism.

`benchmarks/ep_drops.py --virtual-mesh` trains on the devices there are, dropless, records every
MoE layer's routing, and asks here what the capped exchange of a named layout (say
`fsdp=2,expert=4` on 8 devices) would have dropped on it. The counting is numpy.

Where the tokens of a layer sit on a real mesh. `LatentMoE` flattens its [B, T] input to
N = B*T rows in logical order (row b*T + t) and hands them to one `shard_map` whose token spec
is P(TOKEN_AXES) (`sparse_lm/moe/expert_parallel.py`: data, fsdp, expert, context; the axes of
size > 1, first one major). By shard_map's definition the device whose linear index over those
axes (row-major) is i holds rows [i n, (i+1) n), n = N / (their product). This holds for both
values of `MeshLayout.expert_shards`: with "context" the activations outside the MoE hold a
slice of the sequence of every row of their (data, fsdp) shard, and the reshape to [N] moves
the rows to the layout above (when a (data, fsdp) shard has more than one row). The
expert-parallel group of a device is the devices with the same coordinates on every token axis
but `expert`; its rank in the group is its `expert` coordinate. A micro-batch is its own layer
call. `tests/multidevice/scripts/drop_check.py` checks this placement against real 8-device
steps, device by device, in both modes.

The rule (docs/architecture.md, "Capacity drops"): receiver j of a group takes the group's
pairs in order of position; at the first position p* where they would pass the cap R, the room
left is shared among the senders in proportion to their pairs at p* (rounded down); every pair
after p* is dropped. How many pairs a sender loses depends only on the pair counts per
(receiver, sender, position), so `drop_counts` counts with one histogram per layer call and
serves every cap at once; which pairs among equals go (the margin order) does not change the
counts. The pair-by-pair reference is `tests/multidevice/scripts/ep_rule.py`.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

# The token-sharding axes of the expert-parallel shard_map, in order: the layout counted here is
# the one the real exchange uses.
from sparse_lm.moe.expert_parallel import TOKEN_AXES


def mesh_shape(layout, num_devices: int) -> dict[str, int]:
  """Concrete per-axis sizes of a single-slice `MeshLayout` on `num_devices` devices.

  Raises:
    ValueError: a multislice layout (dcn_* sizes) or sizes that do not fit the devices.
  """
  if any(v != 1 for v in layout.dcn.values()):
    raise ValueError(f"virtual layout {layout}: only single-slice layouts (no dcn_* sizes)")
  ici, _ = layout.resolve(num_devices, 1)
  return ici


def block_layout(shape: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray, int]:
  """(group [blocks], rank [blocks], ep): the expert-parallel group and rank of token block i
  (rows [i n, (i+1) n) of a layer's flattened tokens) on a mesh of per-axis `shape`."""
  axes = [a for a in TOKEN_AXES if shape.get(a, 1) > 1]
  sizes = [shape[a] for a in axes]
  coords = np.indices(sizes).reshape(len(sizes), -1) if axes else np.zeros((0, 1), int)
  ep = int(shape.get("expert", 1))
  rank = coords[axes.index("expert")] if "expert" in axes else np.zeros(coords.shape[1], int)
  others = [i for i, a in enumerate(axes) if a != "expert"]
  group = (np.ravel_multi_index(tuple(coords[others]), [sizes[i] for i in others]) if others
           else np.zeros(coords.shape[1], int))
  return np.asarray(group), np.asarray(rank), ep


def drop_counts(ids: np.ndarray, positions: np.ndarray, *, shape: Mapping[str, int],
                num_experts: int, caps: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """Pairs each token block would send and lose under each receive cap.

  Args:
    ids: [N, k] int routed experts of one layer call, rows in logical [B, T] order; ids >=
      num_experts are padding (never sent, not counted).
    positions: [N] int position of each row in its sequence (the cap's priority).
    shape: per-axis mesh sizes (`mesh_shape`).
    num_experts: E; the expert size of `shape` must divide it.
    caps: receive caps in rows per rank (ceil(factor * n * k)).

  Returns:
    (dropped [len(caps), blocks] int64, assigned [blocks] int64).

  Raises:
    ValueError: N not divisible by the token blocks, or E by the expert size.
  """
  ids, positions = np.asarray(ids), np.asarray(positions).astype(np.int64)
  group, rank, ep = block_layout(shape)
  num_blocks, num_groups = group.size, int(group.max()) + 1
  N = ids.shape[0]
  if N % num_blocks or num_experts % ep:
    raise ValueError(f"{N} tokens over {num_blocks} token blocks and {num_experts} experts over "
                     f"expert={ep}: both must divide")
  n, el, T = N // num_blocks, num_experts // ep, int(positions.max()) + 1
  tok, slot = np.nonzero(ids < num_experts)
  block = tok // n
  g, r, j = group[block], rank[block], ids[tok, slot] // el
  key = ((g * ep + j) * ep + r) * T + positions[tok]
  counts = np.bincount(key, minlength=num_groups * ep * ep * T).reshape(num_groups, ep, ep, T)
  cum = np.cumsum(counts, axis=-1)  # [group, receiver, sender, p]: pairs at positions <= p
  sent = cum[..., -1]  # [group, receiver, sender]
  at_all = counts.sum(axis=2)  # [group, receiver, p]
  below = np.concatenate([np.zeros(at_all.shape[:2] + (1,), np.int64),
                          np.cumsum(at_all, axis=-1)], axis=-1)  # pairs at positions < p
  assigned = np.bincount(block, minlength=num_blocks)
  dropped = np.zeros((len(caps), num_blocks), np.int64)
  for c, cap in enumerate(caps):
    p_star = (below <= cap).sum(axis=-1) - 1  # [group, receiver]; T = everything fits
    ps = np.minimum(p_star, T - 1)[..., None, None]
    at = np.take_along_axis(counts, np.broadcast_to(ps, sent.shape + (1,)), -1)[..., 0]
    before = np.take_along_axis(cum, np.broadcast_to(ps, sent.shape + (1,)), -1)[..., 0] - at
    room = cap - np.take_along_axis(below, ps[..., 0], -1)  # [group, receiver, 1]
    quota = at * room // np.maximum(at.sum(axis=-1, keepdims=True), 1)
    kept = np.where((p_star >= T)[..., None], sent, before + quota)
    lost = (sent - kept).sum(axis=1)  # [group, sender]
    dropped[c] = lost[group, rank]
  return dropped, assigned


def caps_in_rows(factors: Sequence[float], num_tokens: int, k: int, num_blocks: int) -> list:
  """The receive cap of each factor c: ceil(c * n * k) rows per rank, n = tokens per block
  (as ep_dispatch_and_compute sizes it)."""
  return [int(math.ceil(c * (num_tokens // num_blocks) * k)) for c in factors]


def distinct_calls(records: Sequence[tuple], same: float = 0.99) -> list:
  """The recorded layer calls of a step, each once.

  Under remat the backward's recompute of a forward runs its routing callback again:
  bit-identical on a CPU, but not always on a GPU (2026-12-01, one H200: none of the 64 repeats
  of a `small` step was). A call whose ids agree with an earlier kept call's in at least `same`
  of the entries, with the same positions, is taken for its repeat (the earlier call compared
  is the one with the nearest per-expert load).

  Args:
    records: (ids [N, k], positions [N], ...) tuples in the order recorded.
  """
  out, loads = [], []
  for rec in records:
    ids = np.asarray(rec[0])
    load = np.bincount(ids.ravel(), minlength=int(ids.max()) + 1)
    near = [i for i, kept in enumerate(out) if kept[0].shape == ids.shape]
    if near:
      def gap(i):
        a, b = loads[i], load
        size = max(a.size, b.size)
        return np.abs(np.pad(a, (0, size - a.size)) - np.pad(b, (0, size - b.size))).sum()
      j = min(near, key=gap)
      if np.mean(out[j][0] == ids) >= same and np.array_equal(out[j][1], rec[1]):
        continue
    out.append(rec)
    loads.append(load)
  return out


if __name__ == "__main__":  # a library of benchmarks/ep_drops.py, not a benchmark of its own
  import sys
  print(__doc__.split("\n\n")[0] + "\n\nA library: run `python -m benchmarks.ep_drops "
        "--virtual-mesh LAYOUT` (its --help lists the flags).", file=sys.stderr)
  sys.exit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
