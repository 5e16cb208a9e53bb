"""The pure-XLA chunked KDA (pallas_kernels/kda/xla.py) against the fp64 naive reference.

Test contract: ARCHITECTURE.md §2.5 (relative RMSE on fresh random inputs; bf16: o, S_T ≤ 5e-3,
dq dk dv dh0 ≤ 8e-3, dg dβ ≤ 2e-2; fp32 much tighter), causality bit for bit, and the seed's
claim about dense diagonal tiles (§2.4). Source: Kimi Linear (arXiv 2510.26692).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kda_testing as kt
from pallas_kernels.kda import chunk_kda, recurrent_kda
from pallas_kernels.kda import tiles, xla

BF16, FP32 = jnp.bfloat16, jnp.float32


# (T, B, H, K, V, gate, chunk, diag, initial_state, segments)
CONTRACT_CASES = [
    (200, 1, 2, 64, 64, "bounded", 64, "auto_bounded", True, True),
    (63, 2, 1, 72, 48, "saturated", 32, "dense", True, False),
    (64, 1, 1, 128, 128, "near_zero", 64, "auto_bounded", False, False),
    (200, 1, 2, 64, 64, "unbounded", 32, "auto", True, True),
    (1, 1, 2, 64, 64, "bounded", 64, "dense", True, False),
    (100, 2, 1, 32, 32, "bounded", 16, "safe", False, True),
]


def _xla_fn(chunk, diag):
  """chunk_kda through the public API; "auto_bounded" = auto with the gate bound declared."""
  if diag == "auto_bounded":
    return functools.partial(chunk_kda, backend="xla", chunk_size=chunk, gate_lower_bound=-5.0)
  if diag == "auto":
    return functools.partial(chunk_kda, backend="xla", chunk_size=chunk)
  return functools.partial(xla.chunk_kda_xla, chunk_size=chunk, diag=diag)


@pytest.mark.parametrize("T,B,H,K,V,gate,chunk,diag,h0,seg", CONTRACT_CASES)
def test_contract_bf16(T, B, H, K, V, gate, chunk, diag, h0, seg):
  seed = zlib.crc32(repr((T, K, gate, chunk)).encode())
  x = kt.make_inputs(seed, B, T, H, K, V, dtype=BF16, gate=gate, initial_state=h0, segments=seg)
  ref = kt.reference_fp64(x, seed=seed)
  out = kt.run_with_grads(_xla_fn(chunk, diag), x, seed=seed)
  kt.assert_all_finite(out, "xla ")
  assert out[0].dtype == BF16 and out[1].dtype == FP32
  errs = kt.check_against_reference(ref, out, kt.TOL_BF16, label=f"bf16 {gate} C={chunk}")
  print(f"T={T} K={K} V={V} {gate} C={chunk} {diag}:",
        {n: f"{e:.1e}" for n, e in errs.items()})


@pytest.mark.parametrize("gate,diag,chunk", [("bounded", "dense", 64), ("unbounded", "safe", 32)])
def test_contract_fp32_tight(gate, diag, chunk):
  x = kt.make_inputs(11, 1, 150, 2, 48, 40, dtype=FP32, gate=gate, initial_state=True,
                     segments=True)
  ref = kt.reference_fp64(x, seed=11)
  out = kt.run_with_grads(_xla_fn(chunk, diag), x, seed=11)
  errs = kt.check_against_reference(ref, out, kt.TOL_FP32, label=f"fp32 {gate}")
  print(f"fp32 {gate} {diag}:", {n: f"{e:.1e}" for n, e in errs.items()})


def test_saturated_dense_fp32():
  """g = −5 everywhere on the dense path: e^±75 factors. o and S_T stay at fp32 precision; dg
  is small (fast decay) and absorbs O(eps) cancellations of the e^75·e^−75 pairs, so its
  relative error is ~1e−3 — still far inside the bf16 contract of 2e−2."""
  x = kt.make_inputs(5, 1, 96, 1, 64, 32, dtype=FP32, gate="saturated", initial_state=True)
  ref = kt.reference_fp64(x, seed=5)
  out = kt.run_with_grads(_xla_fn(32, "dense"), x, seed=5)
  tol = dict(kt.TOL_FP32, g=5e-3)
  errs = kt.check_against_reference(ref, out, tol, label="fp32 saturated dense")
  print("fp32 saturated dense:", {n: f"{e:.1e}" for n, e in errs.items()})


def _causality_check(fn, gate, P=45, T=100):
  x = kt.make_inputs(21, 1, T, 2, 32, 16, dtype=BF16, gate=gate, initial_state=True,
                     segments=True)
  y = kt.make_inputs(22, 1, T, 2, 32, 16, dtype=BF16, gate=gate)
  x2 = dict(x)
  for n in ("q", "k", "v", "g", "beta"):
    x2[n] = jnp.concatenate([x[n][:, :P], y[n][:, P:]], axis=1)
  do = jnp.asarray(np.random.default_rng(3).normal(size=(1, T, 2, 16)), FP32)
  mask = (jnp.arange(T) < P)[None, :, None, None]

  @jax.jit
  def f(q, k, v, g, beta, h0):
    def loss(q, k, v, g, beta, h0):
      o, _ = fn(q, k, v, g, beta, initial_state=h0, segment_ids=x["segment_ids"],
                output_final_state=True)
      return jnp.sum(jnp.where(mask, o.astype(FP32) * do, 0.0)), o
    return jax.grad(loss, argnums=range(6), has_aux=True)(q, k, v, g, beta, h0)

  names = ("q", "k", "v", "g", "beta", "initial_state")
  g1, o1 = f(*[x[n] for n in names])
  g2, o2 = f(*[x2[n] for n in names])
  assert not np.array_equal(np.asarray(o1[:, P:], FP32), np.asarray(o2[:, P:], FP32))
  np.testing.assert_array_equal(np.asarray(o1[:, :P], FP32), np.asarray(o2[:, :P], FP32))
  for n, a, b in zip(names, g1, g2):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if n == "initial_state":
      np.testing.assert_array_equal(a, b, err_msg=n)
    else:
      assert np.any(a[:, :P] != 0), n
      np.testing.assert_array_equal(a[:, :P], b[:, :P], err_msg=f"d{n} at t < P")


@pytest.mark.parametrize("backend,gate", [
    ("xla_dense", "bounded"), ("xla_auto", "unbounded"), ("reference", "unbounded")])
def test_causality_bit_exact(backend, gate):
  """Outputs and gradients at t < P are bit-identical when only q, k, v, g, β at t ≥ P change."""
  fn = {"xla_dense": functools.partial(xla.chunk_kda_xla, chunk_size=32, diag="dense"),
        "xla_auto": functools.partial(chunk_kda, backend="xla", chunk_size=32),
        "reference": functools.partial(chunk_kda, backend="reference")}[backend]
  _causality_check(fn, gate)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_seed_claim_dense_diagonal_tiles(dtype):
  """ARCHITECTURE §2.4: with g ≥ −5 the dense diagonal tiles stay finite and correct (largest
  exponent ≤ 15·5 = 75 nats); forcing them with an unbounded gate (g ≪ −6) overflows."""
  T, H, K, V = 64, 2, 32, 32
  tol = 5e-3 if dtype == BF16 else 1e-5
  # Bounded, saturated somewhere: the worst case of the claim.
  x = kt.make_inputs(31, 1, T, H, K, V, dtype=dtype, gate="bounded", initial_state=True)
  x["g"] = x["g"].at[:, :20].set(-5.0)
  e_b = float(tiles.dense_diag_max_exponent(x["g"]))
  o_ref, S_ref, _ = kt.reference_fp64(x, grads=False)
  o, S = xla.chunk_kda_xla(x["q"], x["k"], x["v"], x["g"], x["beta"], diag="dense",
                           initial_state=x["initial_state"], output_final_state=True)
  kt.assert_all_finite((o, S), "dense, bounded gate: ")
  err_b = kt.rel_rmse(o_ref, o)
  # Unbounded: the same path overflows.
  u = kt.make_inputs(32, 1, T, H, K, V, dtype=dtype, gate="unbounded", initial_state=True)
  e_u = float(tiles.dense_diag_max_exponent(u["g"]))
  o_ref_u, _, _ = kt.reference_fp64(u, grads=False)
  o_u, _ = xla.chunk_kda_xla(u["q"], u["k"], u["v"], u["g"], u["beta"], diag="dense",
                             initial_state=u["initial_state"])
  finite_u = bool(np.all(np.isfinite(np.asarray(o_u, np.float32))))
  err_u = kt.rel_rmse(o_ref_u, o_u) if finite_u else float("nan")
  o_s, _ = xla.chunk_kda_xla(u["q"], u["k"], u["v"], u["g"], u["beta"], diag="safe",
                             initial_state=u["initial_state"])
  err_s = kt.rel_rmse(o_ref_u, o_s)
  print(f"\n[{jnp.dtype(dtype).name}] largest dense diagonal exponent: bounded gate {e_b:.1f} "
        f"nats (rel err {err_b:.1e}); unbounded gate (min g {float(jnp.min(u['g'])):.0f}) "
        f"{e_u:.1f} nats -> finite={finite_u}, rel err {err_u:.1e}; safe path rel err "
        f"{err_s:.1e}")
  assert 70.0 <= e_b <= 75.0 + 1e-3
  assert err_b <= tol
  assert e_u > 88.7
  assert (not finite_u) or err_u > 1e-2
  assert err_s <= tol


def test_auto_diag_choice():
  assert tiles.resolve_diag("auto", -5.0) == "dense"
  assert tiles.resolve_diag("auto", None) == "safe"
  assert tiles.resolve_diag("safe", -5.0) == "safe"
  assert tiles.resolve_diag("dense", None) == "dense"
  with pytest.raises(ValueError):
    tiles.resolve_diag("fast", None)


def test_outputs_finite_and_written_with_padding():
  """No NaN can survive (all outputs are written); padding tokens give exactly 0, others not."""
  x = kt.make_inputs(41, 2, 77, 1, 16, 8, dtype=BF16, gate="unbounded", initial_state=True,
                     segments=True)
  o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="xla", chunk_size=32,
                   initial_state=x["initial_state"], segment_ids=x["segment_ids"],
                   output_final_state=True)
  kt.assert_all_finite((o, S))
  pad = np.asarray(x["segment_ids"]) == 0
  o = np.asarray(o, np.float32)
  assert pad.any() and np.all(o[pad] == 0)
  assert np.all(np.abs(o[~pad]).sum(-1) > 0)
  assert o.shape == (2, 77, 1, 8)


def test_gradient_autodiff_matches_reference_autodiff_fp64(monkeypatch):
  """Algorithmic exactness: in fp64 the chunked path (both diagonal methods) equals the reference
  to ~1e−12, forward and gradients (covers the custom derivative of the triangular inverse).
  The safe run also takes the grouped (`lax.map`) diagonal path and the remat option."""
  x = kt.to_fp64(kt.make_inputs(51, 1, 70, 1, 16, 8, dtype=FP32, gate="bounded",
                                initial_state=True, segments=True))
  # 3 chunks of 32 tokens with 2 tiles each -> groups of 2 chunks (and a remainder of 1).
  monkeypatch.setattr(xla, "SAFE_GROUP_BYTES", 2 * 2 * 16 * 16 * 16 * 4)
  with jax.enable_x64(True):
    d = {n: (None if v is None else jnp.asarray(v)) for n, v in x.items()}
    ref = kt.run_with_grads(recurrent_kda, d)
    for diag in ("dense", "safe"):
      out = kt.run_with_grads(functools.partial(xla.chunk_kda_xla, chunk_size=32, diag=diag,
                                                remat=diag == "safe"), d)
      assert out[0].dtype == jnp.float64
      kt.check_against_reference(ref, out, {n: 1e-10 for n in kt.TOL_FP32}, label=diag)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
    "CPU-only: the reference side is the unclamped, unfenced program (T = 5 with segments "
    "padded to a 64-token chunk), which XLA:GPU fails to compile (the crash the workaround "
    "avoids)"))
def test_short_sequence_chunk_is_exact(monkeypatch):
  """The XLA:GPU compiler-crash workaround changes no result. (1) The optimization barrier
  around the padded chunks (`_fence`) is bit for bit the program without it. (2) A sequence
  shorter than the chunk runs in a smaller chunk (`effective_chunk_size`): the appended
  identity tokens add exact zeros, only the order of the fp32 sums differs (matmuls of another
  length; a few ulp on the CPU, 4.8e-6 relative at most): held to 1e-6 relative RMSE for the
  output, final state and every gradient. Dropping or mis-masking a token fails it by far."""
  T, chunk = 5, 64
  seed = zlib.crc32(repr(("short", T, chunk)).encode())
  print("seed", seed)
  assert [xla.effective_chunk_size(t, 64) for t in (1, 16, 17, 32, 33, 64, 65)] == [
      16, 16, 32, 32, 64, 64, 64]
  assert xla.effective_chunk_size(T, chunk) < chunk
  x = kt.make_inputs(seed, 1, T, 1, 16, 8, dtype=FP32, gate="bounded", initial_state=True,
                     segments=True)
  fn = functools.partial(xla.chunk_kda_xla, chunk_size=chunk, diag="dense")
  got = kt.run_with_grads(fn, x, seed=seed)
  kt.assert_all_finite(got)
  monkeypatch.setattr(xla, "effective_chunk_size", lambda T, chunk_size: chunk_size)
  fenced = kt.run_with_grads(fn, x, seed=seed)
  errs = kt.check_against_reference(fenced, got, {n: 1e-6 for n in kt.TOL_FP32},
                                    label=f"clamped T={T}")
  print({n: f"{e:.1e}" for n, e in errs.items()})
  monkeypatch.setattr(xla, "_fence", lambda xs: xs)
  plain = kt.run_with_grads(fn, x, seed=seed)
  for a, b in zip(jax.tree.leaves(fenced), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("reverse", [False, True])
def test_tri_cumsum_matches_fp64_prefix_sums_and_is_causal(reverse):
  """xla.tri_cumsum (the GPU path's cumulative sum) against fp64 prefix sums from numpy, within
  fp32 rounding of 64 terms; each output reads only the rows it sums (changing the others leaves
  it bit for bit)."""
  rng = np.random.default_rng(zlib.crc32(f"tri_cumsum{reverse}".encode()))
  g = -5.0 * rng.random((3, 4, 64, 32))  # log-decays in (−5, 0]
  want = np.cumsum(g[..., ::-1, :], axis=-2)[..., ::-1, :] if reverse else np.cumsum(g, axis=-2)
  got = np.asarray(xla.tri_cumsum(jnp.asarray(g, FP32), reverse=reverse), np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=64 * 320 * np.finfo(np.float32).eps)
  i = 20
  g2 = g.copy()
  if reverse:  # rows ≥ i read only rows ≥ i
    g2[..., :i, :] = -5.0 * rng.random(g2[..., :i, :].shape)
    keep = np.s_[..., i:, :]
  else:
    g2[..., i + 1:, :] = -5.0 * rng.random(g2[..., i + 1:, :].shape)
    keep = np.s_[..., :i + 1, :]
  got2 = np.asarray(xla.tri_cumsum(jnp.asarray(g2, FP32), reverse=reverse))
  np.testing.assert_array_equal(got2[keep], np.asarray(got, np.float32)[keep])
