"""The capacity-drop rule of docs/architecture.md ("Capacity drops"), written from the text in
plain numpy loops over the whole expert-parallel group (the code under test computes it per
sender with collectives and a binary search). Used by ep_check.py and drop_check.py;
`virtual_keep` is the pair-by-pair reference of benchmarks/ep_virtual.py's counts."""
import numpy as np


def expected_keep(ids, positions, margin, *, num_blocks, ep, num_experts, cap):
  """The receive-cap rule as docs/architecture.md ("Capacity drops") states it, over the
  whole group at once (token block b sits on expert rank b % ep): receiver j takes the pairs
  sent to it in order of position; at the first position p* where they would overflow `cap`,
  the room left is shared among the senders in proportion to their pairs at p* (rounded
  down), each keeping its highest margins; every pair after p* is dropped."""
  ids, positions, margin = np.asarray(ids), np.asarray(positions), np.asarray(margin)
  N, k = ids.shape
  n = N // num_blocks
  el = num_experts // ep
  keep = ids < num_experts
  for grp in range(num_blocks // ep):
    for j in range(ep):
      pairs = [(int(positions[t]), r, t, s) for r in range(ep)
               for t in range((grp * ep + r) * n, (grp * ep + r + 1) * n) for s in range(k)
               if ids[t, s] < num_experts and ids[t, s] // el == j]
      taken = 0
      for p in sorted({q[0] for q in pairs}):
        here = [q for q in pairs if q[0] == p]
        if taken + len(here) <= cap:
          taken += len(here)
          continue
        room = cap - taken
        for r in range(ep):
          mine = sorted((q for q in here if q[1] == r), key=lambda q: -margin[q[2], q[3]])
          for _, _, t, s in mine[len(mine) * room // len(here):]:
            keep[t, s] = False
        for _, _, t, s in (q for q in pairs if q[0] > p):
          keep[t, s] = False
        break
  return keep


def virtual_keep(ids, positions, margin, *, sizes, num_experts, cap):
  """`expected_keep` on a whole layer's routing in logical [B, T] order, grouped as the
  expert-parallel shard_map of a mesh with per-axis `sizes` holds it: the token axes are
  data, fsdp, expert, context (those of size > 1, first one major); the device at linear
  index i over them holds rows [i n, (i+1) n); its group is the devices that differ from it on
  `expert` alone, its rank there its `expert` coordinate."""
  ids = np.asarray(ids)
  axes = [a for a in ("data", "fsdp", "expert", "context") if sizes.get(a, 1) > 1]
  dims = [sizes[a] for a in axes]
  blocks = int(np.prod(dims))
  n = ids.shape[0] // blocks
  ep = sizes.get("expert", 1)
  groups = {}
  for i in range(blocks):
    coord = dict(zip(axes, np.unravel_index(i, dims)))
    rank = int(coord.pop("expert", 0))
    groups.setdefault(tuple(int(v) for v in coord.values()), {})[rank] = i
  keep = np.zeros(ids.shape, bool)
  for members in groups.values():
    rows = np.concatenate([np.arange(members[r] * n, (members[r] + 1) * n) for r in range(ep)])
    keep[rows] = expected_keep(ids[rows], np.asarray(positions)[rows], np.asarray(margin)[rows],
                               num_blocks=ep, ep=ep, num_experts=num_experts, cap=cap)
  return keep
