"""The pallas_tpu KDA backend in Pallas interpret mode on CPU, against the naive reference.

Test contract: ARCHITECTURE.md §2.5 (relative RMSE against `recurrent_kda` in float64 on fresh
random inputs; bf16: o, S ≤ 5e-3, dq dk dv dh0 ≤ 8e-3, dg dβ ≤ 2e-2; fp32 much tighter) and the
seed's claim of §2.4 (dense diagonal tiles are safe for the lower-bounded gate only).

Output poisoning: every case runs with `poison_outputs=True`, which hands each kernel output
buffer (o, final state, saved per-chunk states, dq, dk, dv, dg, dβ, dh0) to the kernel as a
NaN-filled aliased input (`input_output_aliases`), so any element the kernels fail to write stays
NaN and `assert_all_finite` fails. Shapes are tiny: interpret mode is a slow emulation.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda import pallas_tpu, tiles
import kda_testing as kt  # tests/pallas_kernels/kda_testing.py (pytest puts its dir on sys.path)

BF16, F32 = jnp.bfloat16, jnp.float32


@functools.lru_cache(maxsize=None)
def _kernel_fn_cached(static: tuple):
  return _make_kernel_fn(**dict(static))


def _kernel_fn(**static):
  return _kernel_fn_cached(tuple(sorted(static.items())))


def _make_kernel_fn(**static):
  """jit(chunk_kda_pallas_tpu) in interpret mode with output poisoning and fixed static args."""
  def fn(q, k, v, g, beta, *, initial_state=None, segment_ids=None, output_final_state=True):
    return pallas_tpu.chunk_kda_pallas_tpu(
        q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
        output_final_state=output_final_state, interpret=True, poison_outputs=True, **static)
  return jax.jit(fn, static_argnames=("output_final_state",))


def _check(inp, tol, label, **static):
  ref = kt.reference_fp64(inp)
  out = kt.run_with_grads(_kernel_fn(**static), inp)
  kt.assert_all_finite(out, label)
  errs = kt.check_against_reference(ref, out, tol, label=label)
  print(label, {n: f"{e:.1e}" for n, e in errs.items()})
  return errs


CASES = [
    # label, (B, T, H, K, V), dtype, gate, static kwargs, initial_state, segments
    ("T1_bf16", (1, 1, 2, 64, 64), BF16, "bounded", dict(diag="dense"), True, False),
    ("T63_saturated_K128", (1, 63, 2, 128, 128), BF16, "saturated", dict(diag="dense"), True,
     False),
    ("T64_near_zero_fp32_C32", (1, 64, 2, 64, 64), F32, "near_zero",
     dict(diag="dense", chunk_size=32), False, False),
    ("T200_K96_segments_C32", (2, 200, 1, 96, 64), BF16, "bounded",
     dict(gate_lower_bound=-5.0, chunk_size=32), True, True),
    ("T100_unbounded_safe_bf16", (2, 100, 1, 64, 64), BF16, "unbounded", dict(diag="safe"),
     True, True),
    ("T100_unbounded_safe_fp32_V96", (1, 100, 2, 64, 96), F32, "unbounded", dict(), True, True),
]


@pytest.mark.parametrize("label,shape,dtype,gate,static,init,segs", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_reference(label, shape, dtype, gate, static, init, segs):
  B, T, H, K, V = shape
  inp = kt.make_inputs(zlib.crc32(label.encode()) % 1000, B, T, H, K, V, dtype=dtype, gate=gate,
                       initial_state=init, segments=segs)
  _check(inp, kt.TOL_BF16 if dtype == BF16 else kt.TOL_FP32, label, **static)


def test_dispatch_and_no_final_state():
  """Through `chunk_kda(backend="pallas_tpu")`: same values, final state None unless asked."""
  inp = kt.make_inputs(11, 1, 20, 1, 32, 32, dtype=F32, initial_state=True)
  args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
  o, S = chunk_kda(*args, initial_state=inp["initial_state"], backend="pallas_tpu",
                   interpret=True)
  assert S is None
  o_ref, _, _ = kt.reference_fp64(inp, grads=False)
  assert kt.rel_rmse(o_ref, o) <= kt.TOL_FP32["o"]


def test_prefix_state_continues_into_suffix():
  """A prefix's final state, fed as the initial state of the suffix, gives the whole run."""
  inp = kt.make_inputs(13, 1, 40, 1, 32, 32, dtype=F32, initial_state=True)
  names = ("q", "k", "v", "g", "beta")
  fn = _kernel_fn()
  o, S = fn(*[inp[n] for n in names], initial_state=inp["initial_state"])
  o1, S1 = fn(*[inp[n][:, :23] for n in names], initial_state=inp["initial_state"])
  o2, S2 = fn(*[inp[n][:, 23:] for n in names], initial_state=S1)
  assert kt.rel_rmse(o, jnp.concatenate([o1, o2], axis=1)) <= kt.TOL_FP32["o"]
  assert kt.rel_rmse(S, S2) <= kt.TOL_FP32["final_state"]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_seed_claim_dense_diagonal_tiles(dtype):
  """Dense diagonal tiles: right for g ≥ −5 (largest exponent 75 nats), broken for g ≪ −6.

  The safe path on unbounded gates is checked in `test_matches_reference`.
  """
  tol = kt.TOL_BF16 if dtype == BF16 else kt.TOL_FP32
  # Bounded gate saturated at its bound: the worst case for the dense path.
  inp = kt.make_inputs(5, 1, 64, 2, 64, 64, dtype=dtype, gate="saturated", initial_state=True)
  e = float(tiles.dense_diag_max_exponent(inp["g"]))
  print(f"bounded gate (g = -5): largest dense-tile exponent {e:.1f} nats (fp32 max 88.7)")
  assert 74.0 < e < 88.0
  _check(inp, tol, f"dense/bounded/{jnp.dtype(dtype).name}", diag="dense")

  # Unbounded gate forced onto the dense path (same compiled function): overflow or wrong values.
  inp = kt.make_inputs(6, 1, 64, 2, 64, 64, dtype=dtype, gate="unbounded", initial_state=True)
  e = float(tiles.dense_diag_max_exponent(inp["g"]))
  print(f"unbounded gate: largest dense-tile exponent {e:.1f} nats")
  assert e > 88.7
  o_ref, _, _ = kt.reference_fp64(inp, grads=False)
  o, _, grads = kt.run_with_grads(_kernel_fn(diag="dense"), inp)
  finite = bool(jnp.all(jnp.isfinite(o.astype(F32))))
  err = kt.rel_rmse(o_ref, o) if finite else float("nan")
  grads_finite = all(bool(jnp.all(jnp.isfinite(x.astype(F32)))) for x in grads.values())
  print(f"dense path on the unbounded gate: o finite={finite} (rel RMSE {err:.2e}), "
        f"gradients finite={grads_finite}")
  assert not finite or err > tol["o"]


@pytest.mark.parametrize("dtype,gate,diag", [(BF16, "saturated", "dense"),
                                             (F32, "unbounded", "safe")],
                         ids=["bf16_dense", "fp32_safe"])
def test_causal_bit_for_bit(dtype, gate, diag):
  """Outputs and gradients at t < P are identical when only q, k, v, g, β at t ≥ P change."""
  B, T, H, K, V, P = 1, 100, 2, 64, 64, 45   # P inside a chunk and inside a 16-token tile
  base = kt.make_inputs(21, B, T, H, K, V, dtype=dtype, gate=gate, initial_state=True,
                        segments=True)
  other = kt.make_inputs(22, B, T, H, K, V, dtype=dtype, gate=gate)
  names = ("q", "k", "v", "g", "beta")
  changed = dict(base)
  for n in names:
    changed[n] = base[n].at[:, P:].set(other[n][:, P:])
  do = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, H, V)), F32).at[:, P:].set(0)
  fn = _kernel_fn(diag=diag)

  def run(d):
    def loss(q, k, v, g, beta, h0):
      o, _ = fn(q, k, v, g, beta, initial_state=h0, segment_ids=d["segment_ids"])
      return jnp.sum(o.astype(F32) * do), o
    grads, o = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
        *[d[n] for n in names], d["initial_state"])
    return o, grads

  (o1, g1), (o2, g2) = run(base), run(changed)
  assert not np.array_equal(np.asarray(o1[:, P:], F32), np.asarray(o2[:, P:], F32))
  np.testing.assert_array_equal(np.asarray(o1[:, :P], F32), np.asarray(o2[:, :P], F32))
  for n, a, b in zip(names, g1, g2):
    np.testing.assert_array_equal(np.asarray(a[:, :P], F32), np.asarray(b[:, :P], F32),
                                  err_msg=f"d{n}")
  np.testing.assert_array_equal(np.asarray(g1[5]), np.asarray(g2[5]), err_msg="dh0")


def test_rejects_bad_arguments():
  inp = kt.make_inputs(0, 1, 8, 1, 16, 16, dtype=F32)
  args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
  with pytest.raises(ValueError, match="chunk_size"):
    pallas_tpu.chunk_kda_pallas_tpu(*args, chunk_size=48, interpret=True)
  with pytest.raises(ValueError, match="diag"):
    pallas_tpu.chunk_kda_pallas_tpu(*args, diag="fast", interpret=True)
  assert tiles.resolve_diag("auto", -5.0) == "dense"
  assert tiles.resolve_diag("auto", None) == "safe"
  assert tiles.resolve_diag("auto", -10.0) == "safe"


def test_poisoning_catches_an_unwritten_block():
  """Negative control for the poisoning hook: a kernel that skips a block leaves NaN there."""
  out_shape = [jax.ShapeDtypeStruct((16, 128), F32)]
  pargs, pspecs, aliases = pallas_tpu._poison_args(out_shape, True, 1)  # pylint: disable=protected-access

  def kernel(x_ref, _, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]

  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  out = pl.pallas_call(kernel, grid=(2,), in_specs=[spec] + pspecs, out_specs=spec,
                       out_shape=out_shape[0], input_output_aliases=aliases, interpret=True)(
                           jnp.ones((16, 128), F32), *pargs)
  assert bool(jnp.all(out[:8] == 1)) and bool(jnp.all(jnp.isnan(out[8:])))


def test_save_kda_policy_keeps_the_forward_kernel_out_of_the_recompute():
  """remat_policy "save_kda" (sparse_lm.nn) with pallas_tpu: the forward kernel runs twice in
  value_and_grad under "full" (forward, recompute) and once under "save_kda" (its output and
  chunk states are saved by name), after dead code is dropped (tests/jaxpr_testlib); the
  backward kernel once either way; same value and gradients."""
  from sparse_lm import nn as slm_nn  # pylint: disable=g-import-not-at-top
  from tests import jaxpr_testlib  # pylint: disable=g-import-not-at-top
  B, T, H, K, V = 1, 40, 1, 32, 32
  print("seed=41")
  d = kt.make_inputs(41, B, T, H, K, V, dtype=F32, initial_state=False, segments=False)
  w = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, H, V)), F32)

  def layer(q, k, v, g, beta):
    o, _ = pallas_tpu.chunk_kda_pallas_tpu(q * 1.5, k, v, g, beta, diag="dense",
                                           chunk_size=16, interpret=True)
    return jnp.tanh(o.astype(F32))

  def run(policy):
    f = jax.checkpoint(layer, policy=slm_nn.remat_policy(policy))
    step = jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(5)))
    args = [d[n] for n in ("q", "k", "v", "g", "beta")]
    kernels = jaxpr_testlib.live_calls(jax.make_jaxpr(step)(*args), jaxpr_testlib.kernel_name)
    return jax.jit(step)(*args), kernels

  ((l_full, g_full), k_full), ((l_save, g_save), k_save) = run("full"), run("save_kda")
  assert (k_full.count("kda_fwd_dense"), k_save.count("kda_fwd_dense")) == (2, 1), (k_full,
                                                                                    k_save)
  assert k_full.count("kda_bwd_dense") == k_save.count("kda_bwd_dense") == 1
  np.testing.assert_allclose(float(l_full), float(l_save), rtol=1e-6)
  for a, b in zip(g_full, g_save):
    assert float(jnp.max(jnp.abs(a))) > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
