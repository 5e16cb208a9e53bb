"""Audit tests of the sampler (sampling.py) against distributions written out in NumPy from the
module docstring: softmax(logits / T) restricted to the top_k most likely ids, renormalised,
then to the smallest prefix (by probability) whose mass reaches top_p; temperature 0 = argmax
with ties to the lowest id; the log-prob is always log_softmax(logits) at T = 1, untruncated.

Each case checks the support (no id outside the kept set is drawn, every kept id of any weight
is) and
the frequencies, on several rows of fresh random logits at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.inference.sampling import SamplingParams, sample

SEED = 11
N_DRAWS = 12_000


def _reference(logits, temperature, top_k, top_p):
  """The promised sampling distribution of one row (float64), and its support."""
  V = len(logits)
  order = sorted(range(V), key=lambda i: (-logits[i], i))
  kept = order[:top_k] if top_k else order
  z = np.array([logits[i] / temperature for i in kept])
  p = np.exp(z - z.max())
  p /= p.sum()  # renormalised over the top-k before the nucleus is taken
  chosen, mass = [], 0.0
  for i, pi in zip(kept, p):
    if mass >= top_p:
      break
    chosen.append(i)
    mass += pi
  dist = np.zeros(V)
  for i, pi in zip(kept, p):
    if i in chosen:
      dist[i] = pi
  return dist / dist.sum(), set(chosen)


def _nucleus_margin(logits, temperature, top_k, top_p):
  """Distance of top_p from every cumulative mass of the renormalised top-k (inputs whose
  nucleus boundary is a float-rounding tie would make the expected support ambiguous)."""
  z = np.sort(np.asarray(logits, np.float64))[::-1][:top_k or len(logits)] / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  return np.min(np.abs(np.cumsum(p) - top_p))


def _draw(logits_rows, sp):
  """N_DRAWS samples of each row: tokens [R, N], log-probs [R, N]."""
  R, V = logits_rows.shape
  keys = jax.random.split(jax.random.PRNGKey(SEED), R * N_DRAWS)
  flat = jnp.asarray(np.repeat(logits_rows, N_DRAWS, axis=0), jnp.float32)
  tok, logp = jax.jit(sample)(flat, keys, mode=sp.mode, temperature=sp.temperature,
                              top_k=sp.top_k, top_p=sp.top_p)
  return np.asarray(tok).reshape(R, N_DRAWS), np.asarray(logp).reshape(R, N_DRAWS)


# (temperature, top_k, top_p, vocab, logit scale): plain sampling away from T = 1, top-k alone
# on nearly flat logits (the (k+1)-th id is as likely as the k-th), and top-k with a nucleus
# where the mass outside the top-k is large (the nucleus must be taken on the renormalised
# top-k, not on the full softmax).
CASES = [(0.5, 0, 1.0, 6, 1.0), (2.5, 0, 1.0, 6, 2.0), (1.0, 3, 1.0, 8, 0.3),
         (0.8, 5, 1.0, 9, 0.4), (1.0, 4, 0.7, 24, 0.6), (0.6, 6, 0.8, 30, 0.8)]


@pytest.mark.parametrize("temperature,top_k,top_p,vocab,scale", CASES)
def test_support_and_frequencies_match_the_promised_distribution(temperature, top_k, top_p,
                                                                 vocab, scale):
  print("seed", SEED)
  rng = np.random.default_rng(SEED + vocab)
  rows = []
  while len(rows) < 3:  # fresh random rows whose nucleus boundary is not a rounding tie
    row = rng.normal(0.0, scale, vocab)
    if top_p == 1.0 or _nucleus_margin(row, temperature, top_k, top_p) > 0.02:
      rows.append(row)
  logits = np.asarray(rows, np.float32)
  sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  tok, logp = _draw(logits, sp)
  for r in range(len(rows)):
    dist, support = _reference(logits[r].astype(np.float64), temperature, top_k, top_p)
    drawn = set(np.unique(tok[r]).tolist())
    assert drawn <= support, (r, sorted(drawn - support))  # nothing outside the kept set
    likely = {i for i in support if dist[i] > 10 / N_DRAWS}
    assert likely <= drawn, (r, sorted(likely - drawn))  # every kept id of any weight is drawn
    freq = np.bincount(tok[r], minlength=vocab) / N_DRAWS
    np.testing.assert_allclose(freq, dist, atol=0.02, err_msg=f"row {r}")
    # the log-prob is the model's own, untruncated, at T = 1
    x = logits[r].astype(np.float64)
    full = x - x.max() - np.log(np.exp(x - x.max()).sum())
    np.testing.assert_allclose(logp[r], full[tok[r]], atol=1e-5)


def test_top_k_one_and_a_tiny_nucleus_are_argmax_at_any_temperature():
  """top_k = 1 keeps only the most likely id; so does a nucleus smaller than its mass."""
  rng = np.random.default_rng(SEED + 1)
  logits = rng.normal(0.0, 0.5, (4, 10)).astype(np.float32)  # nearly flat: sampling would vary
  for sp in (SamplingParams(temperature=1.7, top_k=1), SamplingParams(temperature=2.0, top_p=0.01),
             SamplingParams(temperature=0.9, top_k=1, top_p=0.5)):
    tok, _ = _draw(logits, sp)
    np.testing.assert_array_equal(tok, np.broadcast_to(np.argmax(logits, -1)[:, None],
                                                       tok.shape), err_msg=str(sp))


def test_greedy_ties_go_to_the_lowest_id_and_logprob_is_the_models():
  rng = np.random.default_rng(SEED + 2)
  B, V = 6, 13
  logits = rng.normal(0.0, 1.0, (B, V)).astype(np.float32)
  expect = []
  for b in range(B):  # two or three ids share the row's maximum, at random places
    ids = sorted(rng.choice(V, size=2 + b % 2, replace=False).tolist())
    logits[b, ids] = logits[b].max() + 0.5
    expect.append(ids[0])
  keys = jax.random.split(jax.random.PRNGKey(SEED), B)
  for temperature in (0.0, 1e-7):
    sp = SamplingParams(temperature=temperature)
    tok, logp = jax.jit(sample)(jnp.asarray(logits), keys, mode=sp.mode,
                                temperature=max(temperature, 1e-6), top_k=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(tok), expect)
    x = logits.astype(np.float64)
    full = x - x.max(-1, keepdims=True) - np.log(
        np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logp), full[np.arange(B), expect], atol=1e-5)
