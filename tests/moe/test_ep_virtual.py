"""benchmarks/ep_virtual.py: the counts of the receive-cap rule on routing grouped as a named
layout's devices hold it, against the pair-by-pair rule (tests/multidevice/scripts/ep_rule.py)
on random routings. That the grouping is the real mesh's is checked on 8 devices by
tests/multidevice/test_ep_drops.py."""

import numpy as np
import pytest

from benchmarks.ep_virtual import block_layout, distinct_calls, drop_counts
from tests.multidevice.scripts.ep_rule import virtual_keep

LAYOUTS = [dict(data=1, fsdp=2, expert=4, tensor=1, context=1),
           dict(data=1, fsdp=1, expert=8, tensor=1, context=1),
           dict(data=2, fsdp=1, expert=2, tensor=1, context=2)]


def test_block_layout_follows_the_token_axes_order():
  group, rank, ep = block_layout(dict(fsdp=2, expert=4))
  assert ep == 4 and group.tolist() == [0] * 4 + [1] * 4 and rank.tolist() == [0, 1, 2, 3] * 2
  # expert before context: block i = e * 2 + c, so the group is c and the rank e
  group, rank, _ = block_layout(dict(expert=4, context=2))
  assert group.tolist() == [0, 1] * 4 and rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_drop_counts_equal_the_pair_by_pair_rule(layout):
  seed = 20261201 + layout
  print("seed", seed)
  rng = np.random.default_rng(seed)
  sizes, E, k, rows = LAYOUTS[layout], 16, 3, 8
  for _ in range(20):
    T = int(rng.integers(2, 12))
    ids = rng.integers(0, E + 2, (rows * T, k))  # ids >= E: padding
    # a skewed routing, so that the caps bind
    ids[rng.random(ids.shape) < 0.3] = int(rng.integers(0, E))
    positions = np.tile(np.arange(T), rows)
    margin = rng.random(ids.shape)
    caps = [0, int(rng.integers(1, 2 * T * k)), T * k, 8 * T * k]
    dropped, assigned = drop_counts(ids, positions, shape=sizes, num_experts=E, caps=caps)
    assert assigned.tolist() == (ids < E).reshape(8, -1).sum(1).tolist()
    for c, cap in enumerate(caps):
      keep = virtual_keep(ids, positions, margin, sizes=sizes, num_experts=E, cap=cap)
      want = ((ids < E) & ~keep).reshape(8, -1).sum(1)
      assert dropped[c].tolist() == want.tolist(), (T, cap)
    assert dropped[0].sum() == assigned.sum() and dropped[-1].sum() == 0


def test_distinct_calls_drops_exact_and_near_repeats_only():
  seed = 20261202
  print("seed", seed)
  rng = np.random.default_rng(seed)
  positions = np.tile(np.arange(64), 4)
  calls = [(rng.integers(0, 16, (256, 2)), positions) for _ in range(6)]
  near = []
  for ids, pos in calls:  # a recompute that flips one near-tie choice
    flipped = ids.copy()
    flipped[0, 0] = (flipped[0, 0] + 1) % 16
    near.append((flipped, pos))
  other = calls[3][0].copy()
  other[:64] = rng.integers(0, 16, (64, 2))  # a quarter differs: another call
  got = distinct_calls(calls + [calls[2]] + near + [(other, positions)])
  assert [g[0] is c[0] for g, c in zip(got, calls)] == [True] * 6
  assert len(got) == 7 and got[-1][0] is other
