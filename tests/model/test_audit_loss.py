"""Audit tests for the next-token loss bookkeeping (sparse_lm/model/loss.py).

Convention (loss.py docstring): position t predicts token t+1, and the pair counts iff
loss_mask[t+1] > 0 and segment_ids[t+1] == segment_ids[t] != 0. Expected values are written
in NumPy from that rule (never from the code under test), on fixed-seed random inputs.

Mutations these tests kill (each survived tests/model/test_transformer.py's loss test and
tests/model/test_loss_grad_dtype.py):
  next_token_targets without the `seg != 0` term (padding-to-padding pairs counted as targets).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from sparse_lm.model.loss import chunked_cross_entropy, next_token_targets


def _np_targets(tokens, seg, mask):
  B, T = tokens.shape
  targets = np.zeros((B, T), np.int64)
  weights = np.zeros((B, T))
  for b in range(B):
    for t in range(T - 1):
      targets[b, t] = tokens[b, t + 1]
      if seg[b, t] != 0 and seg[b, t + 1] == seg[b, t] and mask[b, t + 1] > 0:
        weights[b, t] = 1.0
  return targets, weights


# Documents, runs of padding (id 0) of length >= 2 inside and at the end of a row, a document
# boundary with no padding between, and one row that starts with padding.
SEG = np.array([[1, 1, 1, 1, 0, 0, 0, 2, 2, 2, 2, 3, 3, 3, 0, 0],
                [0, 0, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 0, 0, 0]], np.int32)


def test_next_token_targets_match_the_convention_with_padding_runs():
  rng = np.random.default_rng(5)
  B, T = SEG.shape
  tokens = rng.integers(1, 1000, size=(B, T)).astype(np.int32)
  mask = (rng.random((B, T)) < 0.8).astype(np.float32)
  mask[:, 1] = 1.0
  tgt_ref, w_ref = _np_targets(tokens, SEG, mask)
  tgt, w = next_token_targets(jnp.asarray(tokens), jnp.asarray(SEG), jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(w), w_ref)
  np.testing.assert_array_equal(np.asarray(tgt)[w_ref > 0], tgt_ref[w_ref > 0])
  # Nothing is predicted from or into padding, and never across documents.
  assert np.all(np.asarray(w)[SEG == 0] == 0)
  # Without a loss mask: the same rule with mask = 1.
  _, w_ref1 = _np_targets(tokens, SEG, np.ones((B, T)))
  np.testing.assert_array_equal(np.asarray(next_token_targets(jnp.asarray(tokens),
                                                              jnp.asarray(SEG))[1]), w_ref1)


def test_chunked_cross_entropy_matches_numpy_sums():
  """nll_sum, z_sum (weight * lse²) and correct_sum against float64 NumPy, T not a multiple of
  the chunk (padded positions must carry weight 0)."""
  rng = np.random.default_rng(9)
  B, T, D, V = 2, 13, 8, 40
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  head = (rng.normal(size=(D, V)) * 0.7).astype(np.float32)
  targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
  weights = (rng.random((B, T)) < 0.7).astype(np.float32)
  out = chunked_cross_entropy(jnp.asarray(h), jnp.asarray(head), jnp.asarray(targets),
                              jnp.asarray(weights), chunk_size=4)
  logits = np.einsum("btd,dv->btv", h.astype(np.float64), head.astype(np.float64))
  m = logits.max(-1)
  lse = m + np.log(np.exp(logits - m[..., None]).sum(-1))
  tgt = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(out["nll_sum"]), np.sum((lse - tgt) * weights), rtol=1e-5)
  np.testing.assert_allclose(float(out["z_sum"]), np.sum(lse ** 2 * weights), rtol=1e-5)
  correct = (logits.argmax(-1) == targets).astype(np.float64)
  assert float(out["correct_sum"]) == np.sum(correct * weights)
