"""KDA decode: token-by-token `recurrent_step` and prefix/suffix state hand-off equal the chunked
path (ARCHITECTURE.md §2.5, "Decode"). Source: Kimi Linear (arXiv 2510.26692)."""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

import kda_testing as kt
from pallas_kernels.kda import recurrent_step
from pallas_kernels.kda import chunk_kda as _chunk_kda

_STATIC = ("backend", "chunk_size", "output_final_state", "gate_lower_bound")
chunk_kda = jax.jit(_chunk_kda, static_argnames=_STATIC)
_step = jax.jit(lambda S, q, k, v, g, b: recurrent_step(S, q, k, v, g, b, K ** -0.5))

T, B, H, K, V = 50, 2, 2, 32, 24


def _inputs(seed, dtype=jnp.float32, gate="bounded"):
  return kt.make_inputs(seed, B, T, H, K, V, dtype=dtype, gate=gate, initial_state=True)


def test_token_by_token_decode_equals_chunked():
  """recurrent_step one token at a time from a state == chunk_kda(backend="xla") on the tokens."""
  x = _inputs(61)
  o_ref, S_ref = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="xla",
                           chunk_size=32, initial_state=x["initial_state"],
                           output_final_state=True, gate_lower_bound=-5.0)
  step = _step
  S = x["initial_state"]
  outs = []
  for t in range(T):
    o_t, S = step(S, x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t])
    outs.append(o_t)
  o = jnp.stack(outs, axis=1)
  assert S.dtype == jnp.float32
  assert kt.rel_rmse(o_ref, o) <= 1e-5, kt.rel_rmse(o_ref, o)
  assert kt.rel_rmse(S_ref, S) <= 1e-5, kt.rel_rmse(S_ref, S)


def test_prefix_state_continues_into_suffix():
  """chunk_kda(prefix) final state as initial state of chunk_kda(suffix) == chunk_kda(whole),
  with a split inside a chunk, in bf16 (fp32 state)."""
  x = _inputs(62, dtype=jnp.bfloat16, gate="unbounded")
  P = 37
  args = ("q", "k", "v", "g", "beta")
  for backend in ("xla",):
    o_all, S_all = chunk_kda(*[x[n] for n in args], backend=backend, chunk_size=32,
                             initial_state=x["initial_state"], output_final_state=True)
    o1, S1 = chunk_kda(*[x[n][:, :P] for n in args], backend=backend, chunk_size=32,
                       initial_state=x["initial_state"], output_final_state=True)
    o2, S2 = chunk_kda(*[x[n][:, P:] for n in args], backend=backend, chunk_size=32,
                       initial_state=S1, output_final_state=True)
    o = jnp.concatenate([o1, o2], axis=1)
    assert S1.dtype == jnp.float32
    assert kt.rel_rmse(o_all, o) <= 5e-3, (backend, kt.rel_rmse(o_all, o))
    assert kt.rel_rmse(S_all, S2) <= 1e-5, (backend, kt.rel_rmse(S_all, S2))
    # The prefix outputs do not depend on the suffix at all.
    np.testing.assert_array_equal(np.asarray(o_all[:, :P], np.float32),
                                  np.asarray(o1, np.float32))


def test_decode_continues_from_chunked_prefill():
  """Prefill with chunk_kda, then decode the rest with recurrent_step: equals the whole run."""
  x = _inputs(63)
  P = 40
  args = ("q", "k", "v", "g", "beta")
  o_all, S_all = chunk_kda(*[x[n] for n in args], backend="xla", chunk_size=16,
                           output_final_state=True)
  _, S = chunk_kda(*[x[n][:, :P] for n in args], backend="xla", chunk_size=16,
                   output_final_state=True)
  for t in range(P, T):
    o_t, S = _step(S, *[x[n][:, t] for n in args])
    assert kt.rel_rmse(o_all[:, t], o_t) <= 1e-5
  assert kt.rel_rmse(S_all, S) <= 1e-5
