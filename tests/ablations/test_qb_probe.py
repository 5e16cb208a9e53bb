"""The Quantile Balancing diagnostics (experiments/ablations/qb_probe.py) on random scores: its
NumPy routing equals the model's router, and its QB oracle does what it measures (an exact
update re-estimated on one batch balances that batch; the code's histogram lands within a bin
of the exact quantile)."""

import jax.numpy as jnp
import numpy as np

from experiments.ablations import qb_probe
from sparse_lm.moe import router


def _scores(rng, n=2048, e=64, spread=0.3):
  # Concentrated sigmoid scores with per-expert offsets, like a small trained router's.
  return 1 / (1 + np.exp(-(spread * rng.standard_normal((n, e)) + rng.normal(0, 0.2, e))))


def test_numpy_route_equals_the_router():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print("seed", seed)
  rng = np.random.default_rng(seed)
  s, b = _scores(rng), rng.normal(0, 0.02, 64)
  for cutoff in ("midpoint", "kplus1"):
    ids, alpha = qb_probe.np_route(s, b, 4, cutoff)
    rt = router.route(jnp.asarray(s, jnp.float32), jnp.asarray(b, jnp.float32), 4,
                      cutoff=cutoff)
    got = np.asarray(rt.expert_ids)
    # The router ranks s + b in fp32, np_route in fp64: two experts whose biased scores round
    # to the same fp32 value (about one row in 10^4 here) may come out in either order. So
    # the biased scores of the chosen experts must agree rank by rank to fp32 resolution, and
    # the ids themselves wherever no such near-tie exists.
    sb = s + b
    np.testing.assert_allclose(np.take_along_axis(sb, got, 1),
                               np.take_along_axis(sb, ids, 1), rtol=0, atol=1e-6)
    differ = np.any(got != ids, axis=1)
    assert differ.mean() < 1e-2, (cutoff, np.flatnonzero(differ)[:10])
    np.testing.assert_allclose(alpha, np.asarray(rt.cutoff), atol=1e-6)


def test_qb_oracle_balances_its_own_batch():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print("seed", seed)
  rng = np.random.default_rng(seed)
  s, b0 = _scores(rng), np.zeros(64)
  assert qb_probe.max_mean(qb_probe.np_route(s, b0, 4, "midpoint")[0], 64) > 1.5
  exact = qb_probe.qb_bias(s, b0, 4, "midpoint", "exact", iters=8)
  # m k / E = 128 assignments per expert; converged, the same batch is balanced to a few %
  assert qb_probe.max_mean(qb_probe.np_route(s, exact, 4, "midpoint")[0], 64) < 1.08
  # one update: the code's histogram (4096 bins over [min b - 1, max b + 1], width 2 / 4096)
  # against the exact (k/E)-quantile of the same r: equal up to a bin plus the gap between the
  # order statistics around the quantile (any value in that gap is a (k/E)-quantile), twice
  # over for the centring (b = b_hat - mean b_hat)
  one = qb_probe.qb_bias(s, b0, 4, "midpoint", "exact")
  hist = qb_probe.qb_bias(s, b0, 4, "midpoint", 4096)
  _, alpha = qb_probe.np_route(s, b0, 4, "midpoint")
  r = np.sort(alpha[:, None] - s, axis=0)
  t = int(4 / 64 * (len(r) - 1))
  tol = 2 / 4096 + (r[t + 2] - r[t - 1])  # [E], per expert before the centring
  assert np.all(np.abs(hist - one) <= tol + tol.mean()), np.abs(hist - one) - tol - tol.mean()
  assert np.median(tol) < 0.1 * np.std(one), (np.median(tol), np.std(one))  # a fine check
