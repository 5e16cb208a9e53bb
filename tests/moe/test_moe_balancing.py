"""Quantile Balancing and the ablation balancers (ARCHITECTURE §6)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.moe import (BalancerBias, BalancerStats, LatentMoE, bias_sign_update,
                           quantile_bias_update, update_balancers)
from sparse_lm.moe import balancing, router
import moe_testlib as T


_key, _cfg, _make, _fwd = T.key, T.cfg, T.make, T.fwd


# ------------------------------------------------------------------ pure functions
E, K, N, BINS = 64, 4, 8192, 1000


@functools.partial(jax.jit, static_argnames=("kind",))
def _synthetic_step(bias, key, offsets, kind):
  """Route one synthetic batch with `bias`; return its max violation and the next bias."""
  s = jax.nn.sigmoid(jax.random.normal(key, (N, E)) + offsets)
  rt = router.route(s, bias, K)
  ones = jnp.ones((N,))
  load = balancing.expert_load(rt.expert_ids, ones, E)
  violation = balancing.load_metrics(load)["max_violation"]
  if kind == "quantile":
    lo, hi = balancing.histogram_range(bias)
    hist = balancing.required_bias_histogram(router.required_bias(s, rt.cutoff), ones, lo, hi,
                                             BINS)
    new = quantile_bias_update(hist, lo, hi, K, E)
  else:
    new = bias_sign_update(load, bias, 1e-3)
  return violation, new


def _run(kind, offsets, seed, steps):
  bias, out = jnp.zeros((E,)), []
  for t in range(steps):
    v, bias = _synthetic_step(bias, jax.random.key(seed + t), offsets, kind)
    out.append(float(v))
  return np.array(out)


def test_quantile_balancing_converges_in_3_updates_and_holds():
  """64 experts, top-4, 8192 tokens/batch; each update estimated on one batch, applied to the
  next. From the 3rd update on, over 21 batches: median max/mean < 1.15 (ARCHITECTURE §6 measured
  1.12 with the midpoint cutoff; 60 seeds here gave medians 1.11-1.14, and the kplus1 cutoff
  1.15-1.18) and every batch < 1.35. One batch alone is only statistically balanced (§6): the
  population-balanced bias itself (fitted on 8x the tokens) reached 1.23 on one unlucky batch,
  and the one-batch estimate 1.27 there (1 seed in 100 put one batch above 1.25). bias_sign is
  slower."""
  seed = T.seed() % (1 << 20)
  offsets = jax.random.permutation(jax.random.key(seed), jnp.linspace(-3.0, 3.0, E))
  qb = _run("quantile", offsets, seed, 24)
  sign = _run("bias_sign", offsets, seed, 4)
  assert qb[0] > 5.0, qb[0]  # strongly unbalanced before any update
  # batch 3 is routed with the bias of the 3rd update
  assert np.median(qb[3:]) < 1.15, qb
  assert np.all(qb[3:] < 1.35), qb
  assert sign[0] == qb[0]
  assert sign[3] > 4.0, sign  # bias_sign (gamma = 1e-3) has barely moved after 3 updates


def test_histogram_quantile_interpolates_inside_the_bin():
  # Range [0, 10], 10 bins of width 1. Row 0: mass 4 in bin 2, 4 in bin 7 -> the 0.25-quantile
  # is the middle of bin 2 (2.5); row 1: uniform -> the 0.25-quantile is 2.5 as well; row 2:
  # mass 1 in bin 0 and 3 in bin 9 -> 0.5 lies 1/3 of the way into bin 9.
  hist = np.zeros((3, 10), np.float32)
  hist[0, 2] = hist[0, 7] = 4
  hist[1] = 1
  hist[2, 0], hist[2, 9] = 1, 3
  q = balancing.histogram_quantile(jnp.asarray(hist), 0.0, 10.0, 0.25)
  np.testing.assert_allclose(q[:2], [2.5, 2.5], atol=1e-6)
  q = balancing.histogram_quantile(jnp.asarray(hist), 0.0, 10.0, 0.5)
  np.testing.assert_allclose(q[2], 9 + 1 / 3, atol=1e-5)


def _binomial_two_sided_p(x, h, f):
  """P(|X - h f| >= |x - h f|) for X ~ Binomial(h, f); x one past 0..h counts as the end (a
  token on a bin edge can fall on either side of it in fp32), further out gives 0."""
  if not -1 <= x <= h + 1:
    return 0.0
  x = min(max(x, 0), h)
  pmf = [math.comb(h, i) * f ** i * (1 - f) ** (h - i) for i in range(h + 1)]
  d = abs(x - h * f) - 1e-9
  return float(sum(q for i, q in enumerate(pmf) if abs(i - h * f) >= d))


def test_quantile_update_matches_exact_quantiles():
  n, e, k, bins = 4000, 16, 3, 1000
  r = jax.random.uniform(_key(), (n, e), minval=-1.2, maxval=1.3) * jnp.linspace(0.3, 1.0, e)
  lo, hi = jnp.float32(-1.5), jnp.float32(1.5)
  hist = balancing.required_bias_histogram(r, jnp.ones((n,)), lo, hi, bins)
  assert float(hist.sum()) == n * e
  new = quantile_bias_update(hist, lo, hi, k, e)
  exact = np.quantile(np.asarray(r), k / e, axis=0)
  exact -= exact.mean()
  np.testing.assert_allclose(new, exact, atol=2 * 3.0 / bins)
  assert abs(float(new.mean())) < 1e-6
  # With the uncentred quantile as bias and alpha held fixed, each expert takes n k / E tokens
  # up to where b_hat falls inside its bin: below b_hat lie the c0 tokens of the lower bins and
  # X of the h tokens of b_hat's bin. r is uniform inside a bin, so with the linear
  # interpolation X ~ Binomial(h, f), f = (n k / E - c0) / h: each expert's X must not be in
  # the binomial's two-sided 1e-7 tail (16 experts: a correct update fails < 2e-6 of runs).
  # The old bound |counts - n k / E| <= 0.002 n (8; the narrowest expert's bin holds ~16)
  # failed 1 seed in 5,000 (340178251: 9 on expert 0). 3,000 seeds: smallest p 1.6e-4, 0.4%
  # of them below 1e-3 (calibrated); b_hat at the bin's start, end or middle, or one bin up,
  # gave p <= 1e-7 in 99%, 90%, 92%, 100% of them (the old bound caught 96%, 90%, 29%, 100%).
  b_hat = balancing.histogram_quantile(hist, lo, hi, k / e)
  counts = np.sum(np.asarray(r) < np.asarray(b_hat), axis=0)
  h64 = np.asarray(hist, np.float64)
  cdf = np.cumsum(h64, axis=-1)
  idx = np.sum(cdf < n * k / e, axis=-1)  # the bin holding the quantile
  c0 = np.where(idx > 0, cdf[np.arange(e), np.maximum(idx - 1, 0)], 0.0)
  h = h64[np.arange(e), idx].astype(int)
  f = (n * k / e - c0) / h
  p = [_binomial_two_sided_p(x, hj, fj) for x, hj, fj in zip(counts - c0, h, f)]
  assert min(p) > 1e-7, (counts - n * k / e, h, f, p)


@pytest.mark.parametrize("bins", [1000, 64, 7])
def test_histogram_and_load_equal_a_numpy_count(bins):
  """The scatter-free histogram / load (one-hot contractions) against np.add.at counts."""
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  n, e, k = 777, 24, 3
  lo, hi = -1.0, 1.5
  width = (hi - lo) / bins
  # Each value lies in the middle half of a known bin (some bins beyond [lo, hi], which count
  # in the end bins), a quarter of a bin away from any edge: the expected bin does not depend
  # on how a platform rounds the bin arithmetic (a value on an edge did on the H200).
  true_bin = rng.integers(-max(2, bins // 5), bins + max(2, bins // 5), size=(n, e))
  r = (lo + (true_bin + rng.uniform(0.25, 0.75, size=(n, e))) * width).astype(np.float32)
  weight = rng.integers(0, 3, size=n).astype(np.float32)  # 0 (padding), 1, 2
  idx = np.clip(true_bin, 0, bins - 1)
  want = np.zeros((e, bins), np.float64)
  np.add.at(want, (np.broadcast_to(np.arange(e), (n, e)), idx), weight[:, None])
  got = balancing.required_bias_histogram(jnp.asarray(r), jnp.asarray(weight),
                                          jnp.float32(lo), jnp.float32(hi), bins)
  np.testing.assert_array_equal(np.asarray(got), want)
  ids = rng.integers(0, e + 1, size=(n, k))  # e = the sentinel, ignored
  want_load = np.zeros(e + 1)
  np.add.at(want_load, ids, np.broadcast_to(weight[:, None], (n, k)))
  got_load = balancing.expert_load(jnp.asarray(ids, jnp.int32), jnp.asarray(weight), e)
  np.testing.assert_array_equal(np.asarray(got_load), want_load[:e])


def test_padding_is_excluded_from_the_histogram():
  n, e = 300, 8
  r = jax.random.uniform(_key(), (n, e), minval=-0.9, maxval=0.9)
  weight = (jax.random.uniform(_key(), (n,)) > 0.3).astype(jnp.float32)
  r_pad = jnp.where(weight[:, None] > 0, r, 0.95)  # padded rows would pile up in one bin
  h = balancing.required_bias_histogram(r_pad, weight, -1.0, 1.0, 64)
  h_valid = balancing.required_bias_histogram(r[weight > 0], jnp.ones((int(weight.sum()),)),
                                              -1.0, 1.0, 64)
  np.testing.assert_array_equal(h, h_valid)
  h_all = balancing.required_bias_histogram(r_pad, jnp.ones((n,)), -1.0, 1.0, 64)
  assert float(jnp.abs(h_all - h).sum()) > 0


def test_route_top_k_gates_and_cutoff():
  s = jnp.array([[0.9, 0.2, 0.6, 0.4, 0.1], [0.3, 0.8, 0.5, 0.7, 0.2]])
  b = jnp.array([0.0, 0.5, 0.0, 0.0, 0.0])
  rt = router.route(s, b, 2, route_scale=2.0)  # z = [.9 .7 .6 .4 .1], [.3 1.3 .5 .7 .2]
  np.testing.assert_array_equal(rt.expert_ids, [[0, 1], [1, 3]])
  # Gates use the unbiased scores: 0.9 / 1.1 and 0.8 / 1.5, times route_scale.
  np.testing.assert_allclose(rt.gates, 2.0 * np.array([[0.9 / 1.1, 0.2 / 1.1],
                                                       [0.8 / 1.5, 0.7 / 1.5]]), rtol=1e-6)
  # Midpoint of the k-th and (k+1)-th biased scores; margins z_sel - alpha.
  np.testing.assert_allclose(rt.cutoff, [0.65, 0.6], rtol=1e-6)
  np.testing.assert_allclose(rt.margin, [[0.25, 0.05], [0.7, 0.1]], rtol=1e-5)
  lit = router.route(s, b, 2, cutoff="kplus1")
  np.testing.assert_allclose(lit.cutoff, [0.6, 0.5], rtol=1e-6)
  # r_ij = alpha_i - s_ij: expert j is chosen exactly when b_j > r_ij.
  r = router.required_bias(s, rt.cutoff)
  chosen = np.asarray(b)[None, :] > np.asarray(r)
  np.testing.assert_array_equal(chosen.sum(1), [2, 2])
  np.testing.assert_array_equal(np.argwhere(chosen)[:, 1], [0, 1, 1, 3])


def test_bias_sign_update():
  load = jnp.array([10.0, 2.0, 6.0, 6.0])
  b = jnp.array([0.1, -0.2, 0.0, 0.3])
  np.testing.assert_allclose(bias_sign_update(load, b, 1e-3), b + 1e-3 * jnp.array(
      [-1.0, 1.0, 0.0, 0.0]))


# ------------------------------------------------------------------ module path
def _skewed_batch(key, offsets, bsz=4, seq=512, d=32):
  """x with a constant feature 0 that the router turns into per-expert offsets."""
  x = jax.random.normal(key, (bsz, seq, d))
  return x.at[..., 0].set(1.0)


def _skew_router(m, offsets):
  m.router[...] = (0.05 * jax.random.normal(_key(), m.router.shape)).at[0].set(offsets)


@nnx.jit
def _train_step(m, x, valid):
  _, aux = m(x, valid=valid, train=True)
  update_balancers(m)
  return aux


def test_module_quantile_balancing_and_eval_mode():
  # 16 rows of 512 tokens (8,192 tokens, ~2,048 assignments per expert) so that the load's
  # batch-to-batch noise sits well under the 1.25 bound: with 4 rows one CI run's seeds gave
  # 1.266 at step 4 (40 other seeds stayed under 1.19; with 16 rows the median fell from 1.14
  # to 1.10).
  rows = 16
  m = _make(_cfg())
  offsets = jnp.array([2.5, 1.5, 1.0, 0.0, -0.5, -1.0, -2.0, -3.0])
  _skew_router(m, offsets)
  valid = jnp.ones((rows, 512), bool)
  violations = []
  for _ in range(6):
    aux = _train_step(m, _skewed_batch(_key(), offsets, bsz=rows), valid)
    violations.append(float(aux["max_violation"]))
  assert violations[0] > 2.5, violations  # E = 8, k = 2: the maximum possible is 4
  assert max(violations[3:]) < 1.25, violations
  # An eval pass touches neither the bias nor the statistics.
  m.balancer_hist[...] = jax.random.uniform(_key(), m.balancer_hist.shape)
  snapshot = lambda: {n: np.array(getattr(m, n)[...]) for n in (
      "balancer_bias", "balancer_hist", "balancer_load")}
  before = snapshot()
  assert np.abs(before["balancer_bias"]).max() > 0.1
  _, aux = _fwd(m, _skewed_batch(_key(), offsets, bsz=rows), valid, train=False)
  after = snapshot()
  for name in before:
    np.testing.assert_array_equal(before[name], after[name])
  assert float(aux["max_violation"]) < 1.3
  # A training pass accumulates (it adds exactly one histogram count per token and expert).
  _fwd(m, _skewed_batch(_key(), offsets, bsz=rows), valid, train=True)
  added = float(m.balancer_hist[...].sum()) - float(before["balancer_hist"].sum())
  assert added == pytest.approx(rows * 512 * 8, rel=1e-6)


def test_module_padding_excluded_from_statistics():
  seed = T.seed()
  m_pad, m_ref, m_all = _make(_cfg(), seed), _make(_cfg(), seed), _make(_cfg(), seed)
  x = jax.random.normal(_key(), (2, 16, 32))
  valid = jnp.ones((2, 16), bool).at[0, 10:].set(False).at[1, 13:].set(False)
  # Padding rows that would dominate the routing statistics if they were counted.
  x_pad = jnp.where(valid[..., None], x, 50.0 * m_pad.router[...][:, 0])
  _fwd(m_pad, x_pad, valid, train=True)
  _fwd(m_ref, x, valid, train=True)  # same valid tokens, ordinary content in the padding
  np.testing.assert_array_equal(m_pad.balancer_hist[...], m_ref.balancer_hist[...])
  np.testing.assert_array_equal(m_pad.balancer_load[...], m_ref.balancer_load[...])
  # Only the 23 valid tokens are counted: one histogram entry per (token, expert).
  assert float(m_pad.balancer_hist[...].sum()) == 23 * 8
  assert float(m_pad.balancer_load[...].sum()) == 23 * 2
  # Counting the padding would have changed the statistics.
  _fwd(m_all, x_pad, None, train=True)
  assert float(jnp.abs(m_all.balancer_hist[...] - m_pad.balancer_hist[...]).sum()) > 0
  assert float(jnp.abs(m_all.balancer_load[...] - m_pad.balancer_load[...]).sum()) > 0
  update_balancers(m_pad)
  update_balancers(m_ref)
  np.testing.assert_array_equal(m_pad.balancer_bias[...], m_ref.balancer_bias[...])
  assert float(jnp.abs(m_pad.balancer_bias[...]).max()) > 0


class _Stack(nnx.Module):
  """MoE layers stacked with nnx.vmap and applied with nnx.scan (the model's layer scan)."""

  def __init__(self, cfg, num_layers, rngs):
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
      return LatentMoE(cfg, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x, train=False):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(h, layer):
      y, aux = layer(h, train=train)
      return h + y, aux["load"]

    return body(x, self.layers)


def test_stacked_layers_update_inside_jit_after_merge():
  cfg = _cfg()
  model = nnx.jit(lambda: _Stack(cfg, 3, nnx.Rngs(jax.random.key(0, impl="rbg"))))()
  assert model.layers.balancer_hist.shape == (3, 8, 128)
  assert model.layers.balancer_bias.get_metadata()["out_sharding"] == ("layers", None)
  x = jax.random.normal(_key(), (2, 16, 32))
  _, loads = nnx.jit(lambda m, x: m(x, train=True))(model, x)
  hist = np.asarray(model.layers.balancer_hist[...])
  np.testing.assert_allclose(hist.sum(axis=(1, 2)), 32 * 8)
  np.testing.assert_array_equal(model.layers.balancer_load[...], loads)
  bias0 = np.asarray(model.layers.balancer_bias[...])

  graphdef, state = nnx.split(model)

  @jax.jit
  def update(state):
    m = nnx.merge(graphdef, state)
    metrics = update_balancers(m)
    return nnx.state(m), metrics

  state, metrics = update(state)
  nnx.update(model, state)
  bias = np.asarray(model.layers.balancer_bias[...])
  for layer in range(3):
    lo, hi = balancing.histogram_range(jnp.asarray(bias0[layer]))
    expect = quantile_bias_update(jnp.asarray(hist[layer]), lo, hi, 2, 8)
    np.testing.assert_allclose(bias[layer], expect, atol=1e-6)
  assert not np.allclose(bias[0], bias[1])
  np.testing.assert_array_equal(model.layers.balancer_hist[...], 0.0)
  np.testing.assert_array_equal(model.layers.balancer_load[...], 0.0)
  lm = balancing.load_metrics(jnp.asarray(loads))
  assert float(metrics["balancer/max_violation"]) == pytest.approx(float(
      lm["max_violation"].max()))
  # An update with empty statistics keeps the bias.
  update_balancers(model)
  np.testing.assert_array_equal(model.layers.balancer_bias[...], bias)


def test_balancer_state_is_not_a_param():
  m = _make(_cfg())
  params = nnx.state(m, nnx.Param)
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
  assert not any(n.startswith("balancer") for n in names)
  assert isinstance(m.balancer_bias, BalancerBias) and isinstance(m.balancer_hist, BalancerStats)


@pytest.mark.parametrize("kind", ["bias_sign", "aux_loss", "none"])
def test_ablation_balancers(kind):
  m = _make(_cfg(balancer=kind, bias_sign_rate=0.01))
  assert m.balancer_hist is None
  x = jax.random.normal(_key(), (2, 16, 32))
  _, aux = _fwd(m, x, None, train=True)
  load = np.asarray(aux["load"])
  np.testing.assert_array_equal(m.balancer_load[...], load)
  update_balancers(m)
  bias = np.asarray(m.balancer_bias[...])
  if kind == "bias_sign":
    np.testing.assert_allclose(bias, 0.01 * np.sign(load.mean() - load), atol=1e-7)
    assert np.abs(bias).max() > 0
  else:
    np.testing.assert_array_equal(bias, 0.0)
  if kind == "aux_loss":
    s = router.router_scores(x.reshape(-1, 32), m.router[...])
    expect = 1e-2 * balancing.switch_aux_loss(s, jnp.asarray(load), jnp.ones((32,)), 2)
    assert float(aux["aux_loss"]) == pytest.approx(float(expect), rel=1e-5)
    assert float(aux["aux_loss"]) > 0.5e-2  # E sum f P is about 1 near balance
  else:
    assert float(aux["aux_loss"]) == 0.0
