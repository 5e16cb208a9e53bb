"""The capacity-drop rule of docs/architecture.md ("Capacity drops"), written from the text in
plain numpy loops over the whole expert-parallel group (the code under test computes it per
sender with collectives and a binary search). Used by ep_check.py and drop_check.py."""
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
