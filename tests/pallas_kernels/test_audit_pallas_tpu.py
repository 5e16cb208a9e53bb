"""Audit of the pallas_tpu KDA kernels (Pallas interpret mode on CPU) against a naive recurrence
written here from the equations, independently of pallas_kernels.kda (reference.py included).

Test contract: ARCHITECTURE.md §2.1 (the recurrence, the initial state, the returned final state)
and §2.5 (packed documents: the state resets at each segment start, id 0 is padding, an identity
step with zero output; gradients of q, k, v, g, β and the initial state; relative RMSE against
the naive fp64 reference, fp32 inputs held to the tight fp32 tolerances of kda_testing.TOL_FP32).

What these cases add to test_kda_pallas_tpu.py (found by a hand mutation audit of pallas_tpu.py
and pallas_tpu_kernels.py):
  * document boundaries placed on purpose: exactly at a chunk start, mid-chunk, inside the first
    chunk (where the initial state must stop), padding that straddles a chunk start and padding
    followed by a new document at a chunk start, T not a multiple of the chunk;
  * correlated keys (cosine ≈ 0.4, as anisotropic trained keys are) with a near-zero gate, where
    A_kk's powers stay large, so every factor of the triangular inverse matters;
  * strongly correlated keys (cosine 0.6, 0.95) in the default 64-token chunk: the defect this
    audit found. The doubling-product inverse (I − A)(I + A²)(I + A⁴)… the kernel used is exact
    in exact arithmetic but unstable in fp32 there. Measured with it (fp32 inputs, rel. RMSE of
    o / S_T; the xla backend's forward substitution gives ≈ 2e-7): key cosine 0.4: 4e-5 / 2e-4;
    0.5: 3e-4 / 3e-3; 0.6: 4e-3 / 2e-2 (over the bf16 tolerance); 0.8: 0.5 / 3.5; 0.95: 6 / 24.
    Fixed by the block-recursive inverse (`pallas_tpu_kernels._unit_lower_inverse`).
Shapes are small: interpret mode is a slow emulation.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.kda import pallas_tpu
import kda_testing as kt  # tolerances only (tests/pallas_kernels/kda_testing.py)

F32 = jnp.float32
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

# Packed documents for B = 2, T = 58 (ids in order, 0 = padding). With C = 16: row 0 starts a
# document exactly at the chunk start t = 16, another mid-chunk at t = 37, has padding over the
# chunk start t = 48 and a document after it mid-chunk (t = 49), and tail padding; row 1 ends its
# first document (the only one the initial state reaches) mid-chunk at t = 7, starts documents
# at the chunk starts t = 32 (also a chunk start for C = 32) and t = 48 after padding.
_ROW0 = [1] * 16 + [2] * 21 + [3] * 9 + [0] * 3 + [4] * 6 + [0] * 3
_ROW1 = [1] * 7 + [2] * 25 + [3] * 9 + [0] * 7 + [5] * 10
SEGMENTS = np.array([_ROW0, _ROW1], np.int32)


# ----------------------------------------------------------------------------- naive reference

def naive_kda(q, k, v, g, beta, h0, segment_ids, scale):
  """Token-by-token KDA (ARCHITECTURE §2.1) in the dtype of its (fp64) inputs.

  Per token: S̃ = Diag(e^g) S;  S = S̃ + β k (v − S̃ᵀ k)ᵀ;  o = Sᵀ (scale q). The state is zeroed
  before a token that starts a new document (t > 0, id ≠ 0, id ≠ previous id); a padding token
  (id 0) leaves S unchanged and outputs 0. Returns (o [B, T, H, V], S_T [B, H, K, V]).
  """
  if segment_ids is None:
    segment_ids = np.ones(q.shape[:2], np.int32)
  seg = np.asarray(segment_ids)
  prev = np.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
  reset = (seg != prev) & (seg != 0) & (np.arange(seg.shape[1])[None] > 0)
  valid = seg != 0

  def step(S, x):
    q_t, k_t, v_t, g_t, b_t, r_t, m_t = x
    S = jnp.where(r_t[:, None, None, None], 0.0, S)
    St = jnp.exp(g_t)[..., None] * S
    err = v_t - jnp.einsum("bhkv,bhk->bhv", St, k_t)
    Sn = St + b_t[..., None, None] * k_t[..., None] * err[..., None, :]
    o_t = jnp.einsum("bhkv,bhk->bhv", Sn, scale * q_t)
    keep = m_t[:, None, None, None]
    return jnp.where(keep, Sn, S), jnp.where(m_t[:, None, None], o_t, 0.0)

  xs = tuple(jnp.moveaxis(jnp.asarray(x), 1, 0) for x in (q, k, v, g, beta, reset, valid))
  S, o = jax.lax.scan(step, h0, xs)
  return jnp.moveaxis(o, 0, 1), S


def _loss(fn, do, dS):
  def loss(q, k, v, g, beta, h0):
    o, S = fn(q, k, v, g, beta, h0)
    return jnp.sum(o * do) + jnp.sum(S * dS), (o, S)
  return jax.grad(loss, argnums=tuple(range(6)), has_aux=True)


def naive_with_grads(inp, segment_ids, do, dS):
  """(o, S_T, grads) of the naive recurrence in fp64 (x64 enabled only here), numpy arrays."""
  K = inp["q"].shape[-1]
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(inp[n], np.float64)) for n in NAMES]
    fn = lambda *a: naive_kda(*a, segment_ids, K ** -0.5)
    grads, (o, S) = jax.jit(_loss(fn, jnp.asarray(do, jnp.float64),
                                  jnp.asarray(dS, jnp.float64)))(*args)
    return (np.asarray(o), np.asarray(S)), [np.asarray(x) for x in grads]


def kernel_with_grads(inp, segment_ids, do, dS, **static):
  def fn(q, k, v, g, beta, h0):
    return pallas_tpu.chunk_kda_pallas_tpu(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
        interpret=True, poison_outputs=True, **static)
  grads, (o, S) = jax.jit(_loss(fn, jnp.asarray(do), jnp.asarray(dS)))(*[inp[n] for n in NAMES])
  return (o, S), list(grads)


def rel_rmse(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return float(np.linalg.norm(ref - out) / np.linalg.norm(ref))


# ----------------------------------------------------------------------------- inputs

def make_inputs(seed, B, T, H, K, V, *, gate, key_cos=0.0):
  """Random non-zero fp32 inputs. q, k unit-norm; with key_cos > 0 the keys share a common
  direction (mean pairwise cosine ≈ key_cos); β = sigmoid(N(0, 1)); S_0 ~ N(0, 0.5²).

  gate: "bounded" −5·sigmoid(N(0, 2²)); "near_zero" −U(1e-4, 1e-3); "unbounded" −e^U(ln 1e-3,
  ln 1000), down to −1000; "bounded+near_zero" / "unbounded+near_zero": the first form on the
  first half of the key channels, near zero on the other half (long memory there, so the state
  carried across chunks and documents is large, and a leak or a missed reset shows).
  """
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(B, T, H, K)))
  w = np.sqrt(key_cos / (1.0 - key_cos)) if key_cos else 0.0
  k = unit(w * unit(rng.normal(size=(1, 1, H, K))) * np.sqrt(K) + rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, H, V))
  beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(B, T, H))))
  shape = (B, T, H, K)
  forms = dict(
      bounded=lambda: -5.0 / (1.0 + np.exp(-2.0 * rng.normal(size=shape))),
      near_zero=lambda: -rng.uniform(1e-4, 1e-3, size=shape),
      unbounded=lambda: -np.exp(rng.uniform(np.log(1e-3), np.log(1000.0), size=shape)))
  first, _, second = gate.partition("+")
  g = forms[first]()
  if second:
    g[..., K // 2:] = forms[second]()[..., K // 2:]
  h0 = 0.5 * rng.normal(size=(B, H, K, V))
  inp = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
  inp = {n: jnp.asarray(x, F32) for n, x in inp.items()}
  do = rng.normal(size=(B, T, H, V)).astype(np.float32)
  dS = rng.normal(size=(B, H, K, V)).astype(np.float32)
  return inp, do, dS


def _check(inp, segment_ids, do, dS, label, **static):
  (o_r, S_r), g_r = naive_with_grads(inp, segment_ids, do, dS)
  (o, S), g = kernel_with_grads(inp, segment_ids, do, dS, **static)
  kt.assert_all_finite((o, S, g), label)  # poisoned outputs: every element was written
  tol = kt.TOL_FP32
  errs = {"o": rel_rmse(o_r, o), "final_state": rel_rmse(S_r, S)}
  errs.update({n: rel_rmse(a, b) for n, a, b in zip(NAMES, g_r, g)})
  print(label, {n: f"{e:.1e}" for n, e in errs.items()})
  bad = {n: e for n, e in errs.items() if not e <= tol[n]}
  assert not bad, f"{label}: over tolerance {bad}"
  if segment_ids is not None:  # padding outputs exactly zero
    assert not np.any(np.asarray(o)[np.asarray(segment_ids) == 0])


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("C,diag,gate", [(16, "dense", "bounded+near_zero"),
                                         (32, "safe", "unbounded+near_zero")],
                         ids=["C16_dense_bounded", "C32_safe_unbounded"])
def test_document_boundaries_at_and_inside_chunks(C, diag, gate):
  """Resets exactly at a chunk start, mid-chunk and inside the first chunk, padding across a
  chunk start; initial state given; o, S_T and all six gradients against the naive fp64 loop."""
  B, T, H, K, V = 2, 58, 2, 32, 24
  inp, do, dS = make_inputs(100 + C, B, T, H, K, V, gate=gate)
  _check(inp, SEGMENTS, do, dS, f"segments/C{C}/{diag}", chunk_size=C, diag=diag)


def test_correlated_keys_every_inverse_factor_counts():
  """Keys with pairwise cosine ≈ 0.4, near-zero gate, β = sigmoid(N(0, 1)): A_kk's powers up to
  A^15 matter inside a 16-token chunk, so a dropped factor of the doubling product shows."""
  B, T, H, K, V = 1, 40, 2, 32, 24
  inp, do, dS = make_inputs(7, B, T, H, K, V, gate="near_zero", key_cos=0.4)
  _check(inp, None, do, dS, "correlated/C16", chunk_size=16, diag="dense")


@pytest.mark.parametrize("key_cos,diag", [(0.6, "dense"), (0.95, "safe")])
def test_correlated_keys_default_chunk_fp32_accuracy(key_cos, diag):
  """Key cosine 0.6 and 0.95 in the default 64-token chunk, near-zero gate. The doubling-product
  inverse this kernel had until 2026-12-07 failed here (its intermediate powers A^(2^m) grow
  with the chunk and cancel in fp32: o 4e-3, S_T 2e-2 at cosine 0.6; o 6, S_T 24 at 0.95,
  against 2e-7 for the xla backend's forward substitution); the block-recursive inverse keeps
  every intermediate a block of the true inverse. o, S_T and all six gradients."""
  B, T, H, K, V = 1, 64, 1, 32, 32
  inp, do, dS = make_inputs(8, B, T, H, K, V, gate="near_zero", key_cos=key_cos)
  _check(inp, None, do, dS, f"correlated/C64/cos{key_cos}", chunk_size=64, diag=diag)
