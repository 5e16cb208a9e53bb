"""The naive reference `recurrent_kda` against an independent numpy fp64 loop (ARCHITECTURE.md
§2.1 recurrence, §2.5 segment semantics), and the `chunk_kda` contract errors and dispatch.
Source: Kimi Linear (arXiv 2510.26692)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kda_testing as kt
from pallas_kernels.kda import chunk_kda, recurrent_kda, segment_resets


def _numpy_kda(q, k, v, g, beta, h0, seg, scale):
  """Plain per-token loop in float64, written from §2.1 / §2.5 independently of reference.py."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  o = np.zeros((B, T, H, V))
  S_out = np.zeros((B, H, K, V))
  for b in range(B):
    for h in range(H):
      S = h0[b, h].copy()
      for t in range(T):
        if seg is not None and seg[b, t] == 0:
          continue  # padding: identity step, zero output
        if seg is not None and t > 0 and seg[b, t] != seg[b, t - 1]:
          S = np.zeros_like(S)  # a new document starts
        S = np.exp(g[b, t, h])[:, None] * S
        S = S + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - S.T @ k[b, t, h])
        o[b, t, h] = S.T @ (scale * q[b, t, h])
      S_out[b, h] = S
  return o, S_out


@pytest.mark.parametrize("gate,segments", [("bounded", True), ("unbounded", True),
                                           ("near_zero", False)])
def test_reference_matches_numpy_loop(gate, segments):
  x = kt.make_inputs(71, 2, 40, 2, 8, 6, dtype=jnp.float32, gate=gate, initial_state=True,
                     segments=segments)
  d = kt.to_fp64(x)
  o_np, S_np = _numpy_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"],
                          d["segment_ids"], 8 ** -0.5)
  o, S, _ = kt.reference_fp64(x, grads=False)
  np.testing.assert_allclose(o, o_np, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(S, S_np, rtol=1e-10, atol=1e-12)
  o32, S32 = recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                           initial_state=x["initial_state"], segment_ids=x["segment_ids"])
  assert o32.dtype == jnp.float32 and S32.dtype == jnp.float32
  assert kt.rel_rmse(o_np, o32) <= 1e-5 and kt.rel_rmse(S_np, S32) <= 1e-5


def test_segment_resets_semantics():
  seg = jnp.asarray([[1, 1, 2, 2, 0, 0, 2, 3], [0, 0, 1, 1, 1, 0, 1, 1]], jnp.int32)
  r = np.asarray(segment_resets(seg))
  np.testing.assert_array_equal(r[0], [0, 0, 1, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(r[1], [0, 0, 1, 0, 0, 0, 1, 0])


def _args(B=1, T=8, H=2, K=16, V=8, dtype=jnp.float32):
  x = kt.make_inputs(0, B, T, H, K, V, dtype=dtype)
  return [x[n] for n in ("q", "k", "v", "g", "beta")]


def test_errors():
  q, k, v, g, beta = _args()
  with pytest.raises(ValueError, match="K=300"):
    a = _args(K=300)
    chunk_kda(*a, backend="xla")
  with pytest.raises(ValueError, match="dtype"):
    chunk_kda(q.astype(jnp.float16), k, v, g, beta, backend="xla")
  with pytest.raises(ValueError, match="dtype"):
    chunk_kda(q, k, v, g, beta.astype(jnp.int32), backend="xla")
  with pytest.raises(ValueError):
    chunk_kda(q, k[:, :7], v, g, beta, backend="xla")
  with pytest.raises(ValueError):
    chunk_kda(q, k, v[:, :, :1], g, beta, backend="xla")
  with pytest.raises(ValueError):
    chunk_kda(q, k, v, g, beta[..., :1], backend="xla")
  with pytest.raises(ValueError):
    chunk_kda(q, k, v, g, beta, initial_state=jnp.zeros((1, 2, 16, 9)), backend="xla")
  with pytest.raises(ValueError):
    chunk_kda(q, k, v, g, beta, segment_ids=jnp.ones((1, 9), jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="segment_ids dtype"):
    chunk_kda(q, k, v, g, beta, segment_ids=jnp.ones((1, 8), jnp.float32), backend="xla")
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_kda(q, k, v, g, beta, chunk_size=48, backend="xla")
  with pytest.raises(ValueError, match="backend"):
    chunk_kda(q, k, v, g, beta, backend="cuda")
  for bad in (-6.0, 0.0, 1.0):
    with pytest.raises(ValueError, match="gate_lower_bound"):
      chunk_kda(q, k, v, g, beta, backend="xla", gate_lower_bound=bad)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="CPU-only: 'auto' picks another backend on an accelerator")
def test_auto_backend_on_cpu_is_xla():
  assert jax.default_backend() == "cpu"
  args = _args(T=20)
  f = jax.jit(chunk_kda, static_argnames=("backend", "output_final_state"))
  o_auto, S_auto = f(*args, backend="auto", output_final_state=True)
  o_xla, S_xla = f(*args, backend="xla", output_final_state=True)
  np.testing.assert_array_equal(np.asarray(o_auto), np.asarray(o_xla))
  np.testing.assert_array_equal(np.asarray(S_auto), np.asarray(S_xla))
  o_ref, _ = f(*args, backend="reference", output_final_state=False)
  assert kt.rel_rmse(o_ref, o_auto) <= 1e-5
  _, none = f(*args, backend="xla", output_final_state=False)
  assert none is None
