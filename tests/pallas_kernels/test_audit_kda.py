"""Audit tests for the chunked KDA segment/state bookkeeping (ARCHITECTURE.md §2.1, §2.4, §2.5).

The expected values come from a float64 NumPy token loop written from the recurrence of §2.1
(never from the code under test). The inputs are chosen so that the bookkeeping matters:
document boundaries exactly at a chunk start and in the middle of the last chunk, padding
between documents, a non-zero initial state, and mild gates (g in [−0.3, −0.01]) so that a state
wrongly carried across a document boundary (or across a chunk) is still large when it arrives.
Strong gates (g ≈ −5 per token) shrink such a leak below e^−80 and hide it.

Mutations these tests kill (each survived the rest of tests/pallas_kernels):
  xla._chunk_docs: doc_in = doc[..., 0] (a document that opens exactly at a chunk start still
    receives the previous document's state);
  xla._intra_chunk: the e^(G_C) state decay not masked by m0 (the state of a document that ended
    inside the chunk leaks into the outgoing state); the (K ⊙ e^(G_C − G)) term not masked by
    m_C (earlier documents of the chunk leak into the outgoing state); Γ not masked by m0 (the
    incoming state reaches a later document of the chunk).
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.kda import recurrent_kda, xla

B, T, H, K, V, C = 2, 48, 2, 16, 8, 16

# Row 0: a document opening exactly at the chunk start t = 16, padding inside the last chunk,
# and a last document that opens mid-chunk (t = 41). Row 1: a mid-chunk boundary (t = 10) and a
# last document opening exactly at the last chunk's start (t = 32).
SEGMENTS = np.array([[1] * 16 + [2] * 21 + [0] * 4 + [3] * 7,
                     [5] * 10 + [6] * 22 + [7] * 16], np.int32)


def _numpy_kda(q, k, v, g, beta, seg, S0, scale):
  """§2.1 token by token in float64: reset at a segment start, padding an identity step."""
  q, k, v, g, beta, S0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, S0))
  o = np.zeros(v.shape)
  S_T = np.zeros(S0.shape)
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      S = S0[b, h].copy()
      for t in range(q.shape[1]):
        if seg[b, t] == 0:
          continue  # padding: g = 0, beta = 0, output 0
        if t > 0 and seg[b, t] != seg[b, t - 1]:
          S = np.zeros_like(S)  # a new document starts from the zero state
        S = np.exp(g[b, t, h])[:, None] * S
        pred = S.T @ k[b, t, h]
        S = S + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - pred)
        o[b, t, h] = S.T @ (scale * q[b, t, h])
      S_T[b, h] = S
  return o, S_T


def _inputs(seed):
  r = np.random.default_rng(seed)
  q = r.normal(size=(B, T, H, K))
  k = r.normal(size=(B, T, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the layer's L2-normalised keys
  v = r.normal(size=(B, T, H, V))
  g = r.uniform(-0.3, -0.01, size=(B, T, H, K))  # mild decay: a leaked state stays visible
  beta = r.uniform(0.2, 0.9, size=(B, T, H))
  S0 = r.normal(size=(B, H, K, V))
  return [np.asarray(x, np.float32) for x in (q, k, v, g, beta, S0)]


def _rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return float(np.linalg.norm(ref - out) / np.linalg.norm(ref))


@pytest.mark.parametrize("diag", ["dense", "safe"])
def test_chunk_boundaries_and_documents_match_numpy_loop(diag):
  q, k, v, g, beta, S0 = _inputs(20261207)
  scale = K ** -0.5
  o_ref, S_ref = _numpy_kda(q, k, v, g, beta, SEGMENTS, S0, scale)
  o, S = xla.chunk_kda_xla(*(jnp.asarray(x) for x in (q, k, v, g, beta)),
                           initial_state=jnp.asarray(S0), output_final_state=True,
                           segment_ids=jnp.asarray(SEGMENTS), chunk_size=C, diag=diag,
                           gate_lower_bound=-5.0)
  o, S = np.asarray(o), np.asarray(S)
  # fp32 inputs: ARCHITECTURE §2.5 "much tighter" than bf16 (kda_testing.TOL_FP32 = 1e-5).
  assert _rel(o_ref, o) <= 1e-5, _rel(o_ref, o)
  assert _rel(S_ref, S) <= 1e-5, _rel(S_ref, S)
  # Per document and per row, so a leak confined to one document cannot hide in the norm.
  for b in range(B):
    for d in np.unique(SEGMENTS[b][SEGMENTS[b] > 0]):
      m = SEGMENTS[b] == d
      assert _rel(o_ref[b, m], o[b, m]) <= 1e-5, (b, d, _rel(o_ref[b, m], o[b, m]))
    assert _rel(S_ref[b], S[b]) <= 1e-5, (b, _rel(S_ref[b], S[b]))
  np.testing.assert_array_equal(o[SEGMENTS == 0], 0.0)


def test_reference_with_segments_and_initial_state_matches_numpy_loop():
  """The naive reference itself, on the same inputs (it must stay an independent definition)."""
  q, k, v, g, beta, S0 = _inputs(7)
  o_ref, S_ref = _numpy_kda(q, k, v, g, beta, SEGMENTS, S0, 0.3)
  o, S = recurrent_kda(*(jnp.asarray(x) for x in (q, k, v, g, beta)), scale=0.3,
                       initial_state=jnp.asarray(S0), segment_ids=jnp.asarray(SEGMENTS))
  assert _rel(o_ref, o) <= 1e-5, _rel(o_ref, o)
  assert _rel(S_ref, S) <= 1e-5, _rel(S_ref, S)
