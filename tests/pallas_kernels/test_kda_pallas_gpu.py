"""The pallas_gpu KDA backend against the naive reference: the real kernels on a GPU, Pallas
interpret mode elsewhere (CPU CI).

Test contract: ARCHITECTURE.md §2.5 (relative RMSE against `recurrent_kda` in float64 on fresh
random inputs; bf16: o, S ≤ 5e-3, dq dk dv dh0 ≤ 8e-3, dg dβ ≤ 2e-2; fp32 much tighter), causality
bit for bit, packed segments, initial/final state, K and V padding. The state-pass kernel alone is
also checked against a plain `lax.scan` of its equations (forward and vjp). Shapes are tiny:
interpret mode is a slow emulation; the GPU-only case is larger.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.kda import api, chunk_kda, pallas_gpu, pallas_gpu_intra, pallas_gpu_wy
from pallas_kernels.kda import xla as kda_xla
from pallas_kernels.kda.pallas_gpu_kernels import BF16_OPERANDS
import kda_testing as kt  # tests/pallas_kernels/kda_testing.py
from tests import jaxpr_testlib

BF16, F32 = jnp.bfloat16, jnp.float32
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU  # the real Triton kernels on a GPU, interpret mode elsewhere
NAMES = ("q", "k", "v", "g", "beta")


@functools.lru_cache(maxsize=None)
def _fn(static: tuple):
  def fn(q, k, v, g, beta, *, initial_state=None, segment_ids=None, output_final_state=True):
    return pallas_gpu.chunk_kda_pallas_gpu(
        q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
        output_final_state=output_final_state, interpret=INTERPRET, **dict(static))
  return jax.jit(fn, static_argnames=("output_final_state",))


def _kernel_fn(**static):
  return _fn(tuple(sorted(static.items())))


CASES = [
    # label, (B, T, H, K, V), dtype, gate, static kwargs, initial_state, segments
    ("T100_bf16_dense_h0", (1, 100, 2, 64, 64), BF16, "bounded",
     dict(gate_lower_bound=-5.0, intra="wy"), True, False),
    # bf16 inputs store their intermediates in bf16 by default; fp32 storage stays available
    ("T100_bf16_dense_h0_fp32_store", (1, 100, 2, 64, 64), BF16, "bounded",
     dict(gate_lower_bound=-5.0, store_dtype=F32, intra="wy"), True, False),
    # the intra-chunk step as XLA ops + autodiff (intra="wy": the kernels of pallas_gpu_wy.py)
    ("T100_bf16_dense_h0_xla_intra", (1, 100, 2, 64, 64), BF16, "bounded",
     dict(gate_lower_bound=-5.0, intra="xla"), True, True),
    ("T130_fp32_saturated_segments_h0_auto", (2, 130, 1, 32, 32), F32, "saturated",
     dict(gate_lower_bound=-5.0), True, True),
    ("T77_K96_V48_segments_C32", (2, 77, 1, 96, 48), BF16, "bounded",
     dict(gate_lower_bound=-5.0, chunk_size=32, intra="wy"), True, True),
    # the contract's saturated gate (g = -5 everywhere: e^±75 diagonal factors) with bf16 inputs
    ("T140_K128_bf16_saturated", (1, 140, 1, 128, 128), BF16, "saturated",
     dict(gate_lower_bound=-5.0, intra="wy"), True, False),
    # bf16 operands in the kernels' products (the diagonal tiles' excepted: their e^(±75)
    # factors cancel; rounding them to bf16 put dg at 0.24 in the saturated case)
    ("T100_bf16_dense_h0_bf16_operands", (1, 100, 2, 64, 64), BF16, "bounded",
     dict(gate_lower_bound=-5.0, intra="wy", precision=BF16_OPERANDS), True, False),
    ("T77_K96_V48_segments_C32_bf16_operands", (2, 77, 1, 96, 48), BF16, "bounded",
     dict(gate_lower_bound=-5.0, chunk_size=32, intra="wy", precision=BF16_OPERANDS), True,
     True),
    ("T140_K128_bf16_saturated_bf16_operands", (1, 140, 1, 128, 128), BF16, "saturated",
     dict(gate_lower_bound=-5.0, intra="wy", precision=BF16_OPERANDS), True, False),
    ("T64_saturated_K128_C16_fp32", (1, 64, 1, 128, 128), F32, "saturated",
     dict(gate_lower_bound=-5.0, chunk_size=16, intra="wy"), True, False),
    ("T70_unbounded_safe_fp32_segments", (1, 70, 2, 64, 64), F32, "unbounded", dict(), True,
     True),
    # bf16 q, k, v stay bf16 into the safe path's element-wise tiles (promoted there)
    ("T90_bf16_unbounded_safe_segments_C32", (1, 90, 2, 64, 32), BF16, "unbounded",
     dict(chunk_size=32), True, True),
    # the fused intra-chunk kernels (pallas_gpu_intra.py), opt-in
    ("T77_bf16_fused_segments_h0", (1, 77, 2, 64, 32), BF16, "bounded",
     dict(gate_lower_bound=-5.0, fused=True), True, True),
    ("T50_fp32_fused_C32", (1, 50, 1, 32, 32), F32, "saturated",
     dict(gate_lower_bound=-5.0, fused=True, chunk_size=32), False, False),
]


@pytest.mark.parametrize("label,shape,dtype,gate,static,init,segs", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_reference(label, shape, dtype, gate, static, init, segs):
  seed = zlib.crc32(label.encode()) % 1000
  print(f"seed={seed} interpret={INTERPRET}")
  B, T, H, K, V = shape
  inp = kt.make_inputs(seed, B, T, H, K, V, dtype=dtype, gate=gate, initial_state=init,
                       segments=segs)
  ref = kt.reference_fp64(inp)
  out = kt.run_with_grads(_kernel_fn(**static), inp)
  kt.assert_all_finite(out, label)
  tol = kt.TOL_BF16 if dtype == BF16 else kt.TOL_FP32
  if gate == "saturated" and dtype == F32:
    # g = −5 everywhere on the dense path (e^±75 factors): dg is small and absorbs O(eps)
    # cancellations of the e^75·e^−75 pairs, ~1e−3 relative (as test_kda_xla's saturated case).
    tol = dict(tol, g=5e-3)
  errs = kt.check_against_reference(ref, out, tol, label=label)
  print(label, {n: f"{e:.1e}" for n, e in errs.items()})


def _state_pass_scan(w, u, kd, dec, h0, C):
  """The state pass written from its equations (pallas_gpu_kernels docstring) as a lax.scan."""
  BH, Tp, K = w.shape
  N = Tp // C
  hi = jax.lax.Precision.HIGHEST
  ws = jnp.moveaxis(w.reshape(BH, N, C, K), 1, 0)
  us = jnp.moveaxis(u.reshape(BH, N, C, -1), 1, 0)

  def step(S, xs):
    w_n, u_n, kd_n, d_n = xs
    vn = u_n - jnp.einsum("bck,bkv->bcv", w_n, S, precision=hi)
    return d_n[..., None] * S + jnp.einsum("bkc,bcv->bkv", kd_n, vn, precision=hi), (S, vn)

  S, (hs, vn) = jax.lax.scan(step, h0, (ws, us, jnp.moveaxis(kd, 1, 0), jnp.moveaxis(dec, 1, 0)))
  return jnp.moveaxis(hs, 0, 1), jnp.moveaxis(vn, 0, 1).reshape(BH, Tp, -1), S


@pytest.mark.parametrize("store", [F32, BF16])
def test_state_pass_kernel_and_its_vjp_match_a_scan(store):
  """Two value blocks per head (each runs the dS recursion on its columns; dW, dKd, dd sum over
  all columns in the batched einsums), random cotangents. fp32 storage: 1e-5. bf16 storage
  (w, u, kd, the written hs, vn, ∂S and the cotangents in bf16, the recursion in fp32): against
  the fp32 scan of the same bf16-rounded inputs, within 5e-3 (a few bf16 roundings of 2^-9)."""
  seed = 5
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  BH, N, C, K, V, BV = 2, 5, 16, 32, 32, 16
  r = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, F32).astype(store)
  args = (r(BH, N * C, K), r(BH, N * C, V), r(BH, N, K, C),
          jnp.asarray(rng.uniform(0.2, 1.0, (BH, N, K)), F32), r(BH, K, V).astype(F32))
  prec = jax.lax.Precision.HIGHEST
  kern = lambda *a: pallas_gpu.state_pass(*a, C, BV, prec, INTERPRET)
  out, vjp = jax.vjp(kern, *args)
  assert [x.dtype for x in out] == [store, store, F32]
  args_r = tuple(x.astype(F32) for x in args)
  out_r, vjp_r = jax.vjp(lambda *a: _state_pass_scan(*a, C), *args_r)
  cts = tuple(r(*x.shape).astype(x.dtype) for x in out)
  tol = 1e-5 if store == F32 else 5e-3
  grads = vjp(cts)
  assert [x.dtype for x in grads] == [x.dtype for x in args]
  for name, a, b in zip(("hs", "vn", "ht", "dw", "du", "dkd", "ddec", "dh0"),
                        out + grads, out_r + vjp_r(tuple(c.astype(F32) for c in cts))):
    err = kt.rel_rmse(b, a)
    print(name, f"{err:.1e}")
    # the final state and dh0 never leave the kernel's fp32 registers: fp32 accuracy either way
    assert err <= (1e-5 if name in ("ht", "dh0") else tol), name


@pytest.mark.skipif(ON_GPU, reason=(
    "CPU-only: bit equality of two separately compiled programs (bf16 and fp32 inputs) holds "
    "on XLA:CPU; XLA:GPU may pick different GEMM algorithms for the two"))
@pytest.mark.parametrize("intra", ["xla", "wy"])
def test_bf16_inputs_with_fp32_storage_are_the_fp32_program_rounded_once(intra):
  """bf16 q, k, v cross the layout change as bf16 and are promoted once after it (the wy
  kernels: once, inside the kernel): with fp32 storage and HIGHEST matmuls, the output and
  every gradient equal the fp32-input program's (same intra path) rounded to bf16, bit for
  bit (output cotangent bf16-exact). Fails if the promotion happens at each read (the
  cotangents of the reads are then rounded and summed in bf16: 22% of dk's elements
  differed)."""
  inp = kt.make_inputs(7, 1, 100, 2, 32, 32, dtype=BF16, initial_state=True, segments=True)
  w = jnp.asarray(np.random.default_rng(0).normal(size=(1, 100, 2, 32)), BF16).astype(F32)

  def run(dtype):
    def loss(q, k, v, g, beta):
      o, S = pallas_gpu.chunk_kda_pallas_gpu(
          q, k, v, g, beta, initial_state=inp["initial_state"],
          segment_ids=inp["segment_ids"], output_final_state=True, interpret=INTERPRET,
          gate_lower_bound=-5.0, store_dtype=F32, precision=jax.lax.Precision.HIGHEST,
          intra=intra)
      return jnp.sum(o.astype(F32) * w) + jnp.sum(S), o
    args = [inp[n].astype(dtype) for n in NAMES]
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)

  (_, o_b), g_b = run(BF16)
  (_, o_f), g_f = run(F32)
  rounded = lambda x: np.asarray(x.astype(BF16).astype(F32))
  assert np.all(np.isfinite(rounded(o_f))) and all(np.all(np.isfinite(x)) for x in g_f)
  np.testing.assert_array_equal(np.asarray(o_b.astype(F32)), rounded(o_f), err_msg="o")
  for n, a, b in zip(NAMES, g_b, g_f):
    assert a.dtype == BF16, n
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), rounded(b), err_msg=n)


def test_store_dtype_auto_is_bf16_only_for_bf16_q_k_v():
  sd = pallas_gpu._store_dtype  # pylint: disable=protected-access
  assert sd("auto", (BF16, BF16, BF16)) == BF16
  assert sd("auto", (BF16, F32, BF16)) == F32  # a mixed call keeps its fp32 inputs fp32
  assert sd("auto", (F32, F32, F32)) == F32
  assert sd(None, (BF16,) * 3) == F32 and sd(F32, (BF16,) * 3) == F32
  assert sd(BF16, (F32,) * 3) == BF16
  with pytest.raises(ValueError, match="float64"):
    sd(BF16, (jnp.float64,) * 3)


@pytest.mark.parametrize("C,segments", [(64, True)])
def test_fused_intra_chunk_kernels_match_the_xla_intra_chunk(C, segments):
  """The fused kernels' outputs and vjp against `xla._intra_chunk` (dense diagonal tiles,
  HIGHEST; itself checked against the fp64 reference through the `xla` backend's tests), fp32,
  gates down to the −5 bound, random cotangents: an independent, op-by-op formulation."""
  seed = 40 + C + segments
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  M, K, V = 3, 32, 16
  r = lambda *s: jnp.asarray(rng.normal(size=s), F32)
  k = rng.normal(size=(M, C, K))
  k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), F32)
  g = jnp.asarray(-5.0 * rng.uniform(size=(M, C, K)) ** 3, F32)
  args = (r(M, C, K), k, r(M, C, V), g, jnp.asarray(rng.uniform(size=(M, C)), F32))
  if segments:
    doc = np.cumsum(rng.uniform(size=(M, C)) < 0.1, axis=1)
    m0, mlast = doc == doc[:, :1], doc == doc[:, -1:]
    xla_masks = (jnp.asarray(doc[:, :, None] == doc[:, None, :]), jnp.asarray(m0),
                 jnp.asarray(mlast))
    kern_masks = tuple(jnp.asarray(x, F32) for x in (doc, m0, mlast))
  else:
    xla_masks = kern_masks = (None, None, None)
  hi = jax.lax.Precision.HIGHEST
  scale = K ** -0.5
  ref = lambda *a: kda_xla._intra_chunk(*a, *xla_masks, scale=scale, diag="dense", precision=hi)
  new = lambda *a: pallas_gpu_intra.intra_chunk(*a, *kern_masks, scale, hi, INTERPRET)
  out_r, vjp_r = jax.vjp(ref, *args)
  out_n, vjp_n = jax.vjp(new, *args)
  cts = tuple(r(*x.shape) for x in out_r)
  names = ("W", "U", "Qg", "A_qk", "Kd", "d", "dq", "dk", "dv", "dg", "dbeta")
  for name, a, b in zip(names, out_r + vjp_r(cts), out_n + vjp_n(cts)):
    assert kt.rel_rmse(a, b) <= 1e-5, name


@pytest.mark.parametrize("C,segments,V,block_k", [(64, True, 32, 16), (32, False, 16, 16),
                                                   (16, True, 64, 16), (32, True, 32, (32, 16))])
def test_wy_kernels_match_the_xla_intra_chunk(C, segments, V, block_k):
  """pallas_gpu_wy's forward and backward kernels against `xla._intra_chunk` (an op-by-op
  formulation with direct sums, differentiated by autodiff; itself checked against the fp64
  reference through the `xla` backend's tests): fp32, HIGHEST, gates down to the −5 bound,
  block_k 16 of K = 32 (two key blocks) and V = 16, 32, 64 (fewer, as many and more value
  blocks than key blocks: the channel-block programs' guards), and a (forward, backward) pair
  of blocks (32, 16); random cotangents, inputs in the [B, T, H, ·] layout the kernels read."""
  seed = 60 + C + segments + (0 if isinstance(block_k, int) else 7)
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  B, H, K = 2, 2, 32
  T = 2 * C
  r = lambda *s: jnp.asarray(rng.normal(size=s), F32)
  k = rng.normal(size=(B, T, H, K))
  k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), F32)
  g = jnp.asarray(-5.0 * rng.uniform(size=(B, T, H, K)) ** 3, F32)
  args = (r(B, T, H, K), k, r(B, T, H, V), g, jnp.asarray(rng.uniform(size=(B, T, H)), F32))
  seg = kt.random_segment_ids(rng, B, T) if segments else None
  _, doc, m0, mlast = kda_xla._chunk_docs(seg, B, T, T, C)
  N, M, BH = T // C, B * H * (T // C), B * H
  if segments:  # padding tokens: identity steps, as the wrapper makes them
    valid = jnp.asarray(seg != 0)
    args = args[:3] + (jnp.where(valid[..., None, None], args[3], 0),
                       jnp.where(valid[..., None], args[4], 0))
  hi = jax.lax.Precision.HIGHEST
  scale = K ** -0.5

  def chunks(x):  # [B, T, H, ...] -> [B·H·N, C, ...], the XLA path's layout
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape((M, C) + x.shape[3:])

  def per_chunk(m):  # [B, N, C] -> [B·H·N, C]
    return jnp.broadcast_to(m[:, None], (B, H) + m.shape[1:]).reshape(M, C)

  def ref(q, k, v, g, beta):
    same = m0_ = ml_ = None
    if segments:
      d = per_chunk(doc)
      same, m0_, ml_ = d[..., :, None] == d[..., None, :], per_chunk(m0), per_chunk(mlast)
    W, U, Qg, A, Kd, dec = kda_xla._intra_chunk(
        *(chunks(x) for x in (q, k, v, g, beta)), same, m0_, ml_, scale=scale, diag="dense",
        precision=hi)
    return (W.reshape(BH, T, K), U.reshape(BH, T, V), Qg.reshape(BH, T, K),
            A.reshape(BH, N, C, C), Kd.reshape(BH, N, K, C), dec.reshape(BH, N, K))

  masks = None if not segments else (doc.reshape(B, T).astype(jnp.int32),
                                     m0.reshape(B, T).astype(F32), mlast.reshape(B, T).astype(F32))
  new = lambda *a: pallas_gpu_wy.intra_chunk_wy(*a, masks, C, scale, hi, F32, INTERPRET, 4,
                                                block_k)
  out_r, vjp_r = jax.vjp(ref, *args)
  out_n, vjp_n = jax.vjp(new, *args)
  cts = tuple(r(*x.shape) for x in out_r)
  names = ("W", "U", "Qg", "A_qk", "Kd", "d", "dq", "dk", "dv", "dg", "dbeta")
  for name, a, b in zip(names, out_r + vjp_r(cts), out_n + vjp_n(cts)):
    err = kt.rel_rmse(a, b)
    print(name, f"{err:.1e}")
    assert err <= 1e-5, name


@pytest.mark.parametrize("form", ["chunk", "tile"])
def test_wy_inverse_matches_a_solve_on_hard_matrices(form):
  """`pallas_gpu_wy._inverse` (blocked forward substitution as whole-chunk products) and
  `tile_inverse` (forward substitution by 16-row tiles, `_inverse` on the diagonal blocks:
  what the scores kernel's calls compute) against numpy's fp64 inverse, also where a doubling
  product Σ L^m loses digits: near-identical keys (A close to a strictly lower matrix of ones),
  and a random A whose inverse reaches 400."""
  rng = np.random.default_rng(12)
  hi = jax.lax.Precision.HIGHEST
  for C in (16, 32, 64):
    G = np.cumsum(np.full(C, -0.05))
    cases = {"near_identical_keys": np.tril(np.exp(G[:, None] - G[None, :]), -1) * 0.99,
             "ones_0.9": np.tril(np.full((C, C), 0.9), -1),
             "random_0.5": np.tril(rng.normal(size=(C, C)) * 0.5, -1)}
    for name, A in cases.items():
      inv = ((lambda a: pallas_gpu_wy._inverse(a, C // 16, hi)) if form == "chunk"
             else (lambda a: pallas_gpu_wy.tile_inverse(a, hi)))
      X = jax.jit(inv)(jnp.asarray(A, F32))
      err = kt.rel_rmse(np.linalg.inv(np.eye(C) + A), X)
      print(C, name, f"{err:.1e}")
      assert err <= 1e-6, (C, name)
      assert np.all(np.triu(np.asarray(X), 1) == 0) and np.all(np.diagonal(X) == 1)


def test_blocked_unit_lower_inverse():
  """(I + A)⁻¹ by 16-row blocks against numpy's inverse in fp64, and its jvp (−X dA X)."""
  seed = 9
  print(f"seed={seed}")
  rng = np.random.default_rng(seed)
  A = np.tril(rng.normal(size=(3, 64, 64)) * 0.2, -1)
  dA = np.tril(rng.normal(size=A.shape), -1)
  X_ref = np.linalg.inv(np.eye(64) + A)
  X, dX = jax.jvp(pallas_gpu.blocked_unit_lower_inverse, (jnp.asarray(A, F32),),
                  (jnp.asarray(dA, F32),))
  assert kt.rel_rmse(X_ref, X) <= 1e-5
  assert kt.rel_rmse(-X_ref @ dA @ X_ref, dX) <= 1e-5
  assert np.all(np.triu(np.asarray(X), 1) == 0) and np.all(np.diagonal(X, 0, 1, 2) == 1)


@pytest.mark.parametrize("intra", ["wy", "xla", "fused"])
def test_causal_bit_for_bit(intra):
  """Outputs and gradients at t < P are identical when only q, k, v, g, β at t ≥ P change."""
  B, T, H, K, V, P = 1, 100, 2, 64, 64, 45   # P inside a chunk and inside a 16-token tile
  print("seeds=21,22")
  base = kt.make_inputs(21, B, T, H, K, V, dtype=BF16, initial_state=True, segments=True)
  other = kt.make_inputs(22, B, T, H, K, V, dtype=BF16)
  changed = dict(base)
  for n in NAMES:
    changed[n] = base[n].at[:, P:].set(other[n][:, P:])
  do = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, H, V)), F32).at[:, P:].set(0)
  fn = _kernel_fn(gate_lower_bound=-5.0, fused=intra == "fused",
                  intra="xla" if intra == "fused" else intra)

  @jax.jit
  def run(q, k, v, g, beta, h0, seg):
    def loss(q, k, v, g, beta, h0):
      o, _ = fn(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
      return jnp.sum(o.astype(F32) * do), o
    return jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(q, k, v, g, beta, h0)

  (g1, o1), (g2, o2) = (run(*[d[n] for n in NAMES], d["initial_state"], d["segment_ids"])
                        for d in (base, changed))
  assert not np.array_equal(np.asarray(o1[:, P:], F32), np.asarray(o2[:, P:], F32))
  np.testing.assert_array_equal(np.asarray(o1[:, :P], F32), np.asarray(o2[:, :P], F32))
  for n, a, b in zip(NAMES, g1, g2):
    np.testing.assert_array_equal(np.asarray(a[:, :P], F32), np.asarray(b[:, :P], F32),
                                  err_msg=f"d{n}")
  np.testing.assert_array_equal(np.asarray(g1[5]), np.asarray(g2[5]), err_msg="dh0")


def test_dispatch_errors_and_where_it_runs():
  inp = kt.make_inputs(11, 1, 20, 1, 32, 32, dtype=F32, initial_state=True)
  args = [inp[n] for n in NAMES]
  f = jax.jit(functools.partial(chunk_kda, backend="pallas_gpu", interpret=INTERPRET))
  o, S = f(*args, initial_state=inp["initial_state"])
  assert S is None
  o_ref, _, _ = kt.reference_fp64(inp, grads=False)
  assert kt.rel_rmse(o_ref, o) <= kt.TOL_FP32["o"]
  with pytest.raises(ValueError, match="chunk_size"):
    pallas_gpu.chunk_kda_pallas_gpu(*args, chunk_size=48, interpret=True)
  with pytest.raises(ValueError, match="block_v"):
    pallas_gpu.chunk_kda_pallas_gpu(*args, block_v=24, interpret=True)
  with pytest.raises(ValueError, match="store_dtype"):
    pallas_gpu.chunk_kda_pallas_gpu(*args, store_dtype=jnp.float16, interpret=True)
  with pytest.raises(ValueError, match="intra"):
    pallas_gpu.chunk_kda_pallas_gpu(*args, intra="triton", interpret=True)
  with pytest.raises(ValueError, match="intra='wy' needs dense"):  # unbounded gate: safe tiles
    pallas_gpu.chunk_kda_pallas_gpu(*args, intra="wy", interpret=True)
  fake = lambda platform, cc: type("Dev", (), dict(platform=platform, compute_capability=cc))()
  assert pallas_gpu.supported_on(fake("gpu", "9.0"))
  assert not pallas_gpu.supported_on(fake("gpu", "8.0"))
  assert not pallas_gpu.supported_on(fake("cpu", "9.0"))
  assert api.resolve_backend("auto", fake("gpu", "9.0")) == "pallas_gpu"
  assert api.resolve_backend("auto", fake("gpu", "8.6")) == "xla"


def test_auto_intra_is_wy_for_bf16_where_it_applies_else_xla():
  """intra="auto" traces to the same program as "wy" for the bounded gate with bf16 inputs
  (where the kernels were measured faster) and as "xla" for fp32 and fp64 inputs and the
  unbounded gate (safe tiles): the jaxprs of the forward and backward are equal as text, and
  differ from the other path's (the comparison has teeth). Traced, not run: the kernels'
  numbers are the other tests' subject."""
  def program(dtype, bound, intra):
    inp = kt.make_inputs(12, 1, 40, 1, 32, 32, dtype=dtype, initial_state=False)
    kw = {} if bound is None else dict(gate_lower_bound=bound)
    def loss(q, k, v, g, beta):
      o, S = pallas_gpu.chunk_kda_pallas_gpu(q, k, v, g, beta, interpret=INTERPRET,
                                             output_final_state=True, **kw, intra=intra)
      return jnp.sum(o.astype(F32)) + jnp.sum(S)
    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
        *[inp[n] for n in NAMES]))
  # (wy refuses the unbounded gate and fp64: those cases have no other path to tell apart)
  for dtype, bound, picked, other in [(BF16, -5.0, "wy", "xla"), (F32, -5.0, "xla", "wy"),
                                      (F32, None, "xla", None), (jnp.float64, -5.0, "xla", None)]:
    with jax.enable_x64(dtype == jnp.float64):
      auto = program(dtype, bound, "auto")
      assert auto == program(dtype, bound, picked), f"{dtype} {bound}: auto is not {picked}"
      if other:
        assert auto != program(dtype, bound, other), f"{dtype} {bound}: {picked} == {other}"


def test_wy_kernels_run_with_x64_enabled():
  """A user with `jax_enable_x64` on (an fp64 reference beside the model, say) and bf16
  inputs: the wy kernels' integer tile arithmetic mixed int32 iotas with int64 Python
  constants (`lax.div` TypeError). Same numbers as with x64 off."""
  def run():
    inp = kt.make_inputs(13, 1, 40, 1, 32, 32, dtype=BF16, initial_state=False)
    o, S = pallas_gpu.chunk_kda_pallas_gpu(*[inp[n] for n in NAMES], interpret=INTERPRET,
                                           output_final_state=True, gate_lower_bound=-5.0,
                                           intra="wy")
    return np.asarray(o, np.float32), np.asarray(S, np.float32)
  want = run()
  with jax.enable_x64(True):
    got = run()
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def _tf32(x):
  """x rounded to TF32 (10 explicit mantissa bits, round to nearest): what a GPU's TF32
  tensor-core product sees of an fp32 operand."""
  bits = jax.lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
  bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(bits, F32)


@pytest.mark.skipif(ON_GPU, reason="emulates TF32 in interpret mode; on a GPU the real TF32 "
                    "products run in test_matches_reference[T140_K128_bf16_saturated]")
@pytest.mark.parametrize("precision", [None, BF16_OPERANDS])
def test_tf32_products_keep_the_saturated_gate_within_the_contract(monkeypatch, precision):
  """On a GPU the kernels' DEFAULT products are TF32; on the CPU they are fp32. With every
  product at TF32 (emulated here), the saturated gate's dg was 2.8e-2 (3.0e-2 on an H100,
  2026-12-06) against the 2e-2 bound: the diagonal tiles' e^(±75) products cancel in ∂g. The
  pairwise backward runs those at `hi` (3×TF32 on a GPU), which this emulation leaves exact;
  the forward's diagonal score tiles stay TF32 (DEFAULT, emulated here). (The XLA
  intra-chunk step runs its diagonal tiles at HIGHEST for the same reason; the emulation does
  not reach it: rounding by bit casts has no gradient.)"""
  from pallas_kernels.kda import pallas_gpu_kernels  # pylint: disable=g-import-not-at-top
  dot = pallas_gpu_kernels._dot

  def tf32_dot(a, b, prec, ta=False, tb=False):
    if prec == jax.lax.Precision.DEFAULT:
      return dot(_tf32(a), _tf32(b), jax.lax.Precision.HIGHEST, ta, tb)
    return dot(a, b, prec, ta, tb)

  monkeypatch.setattr(pallas_gpu_kernels, "_dot", tf32_dot)
  monkeypatch.setattr(pallas_gpu_wy, "_dot", tf32_dot)
  label = "T140_K128_bf16_saturated"
  inp = kt.make_inputs(zlib.crc32(label.encode()) % 1000, 1, 140, 1, 128, 128, dtype=BF16,
                       gate="saturated", initial_state=True)
  fn = jax.jit(functools.partial(pallas_gpu.chunk_kda_pallas_gpu, gate_lower_bound=-5.0,
                                 intra="wy", precision=precision, interpret=True),
               static_argnames=("output_final_state",))
  errs = kt.check_against_reference(kt.reference_fp64(inp), kt.run_with_grads(fn, inp),
                                    kt.TOL_BF16, label=label)
  print(precision, {n: f"{e:.1e}" for n, e in errs.items()})


@jax.custom_vjp
def _tf32_matmul(a, b):
  """a @ b as a GPU's TF32 product: operands rounded to TF32, exact products, fp32 sums; its
  gradient's two products likewise (the cotangent and the other operand rounded)."""
  return jnp.matmul(_tf32(a), _tf32(b), precision=jax.lax.Precision.HIGHEST)


def _tf32_matmul_fwd(a, b):
  return _tf32_matmul(a, b), (a, b)


def _tf32_matmul_bwd(res, ct):
  a, b = res
  exact = lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)
  _, vjp = jax.vjp(exact, _tf32(a), _tf32(b))
  return vjp(_tf32(ct))


_tf32_matmul.defvjp(_tf32_matmul_fwd, _tf32_matmul_bwd)


@pytest.mark.skipif(ON_GPU, reason="emulates TF32 on the CPU; on a GPU the real TF32 products "
                    "run in test_matches_reference[T100_bf16_dense_h0_xla_intra]")
def test_tf32_products_of_the_xla_intra_step_and_its_highest_diagonal_tiles(monkeypatch):
  """The XLA intra-chunk step (`intra="xla"`, opt-in for bf16 inputs) runs its DEFAULT
  products as TF32 on a GPU. With those emulated here (forward and backward products:
  `_tf32_matmul` in place of `xla._mm` at DEFAULT), the saturated gate is within the bf16
  contract, and the dense diagonal tiles' products, which run at HIGHEST, are what keeps dg
  well inside it: with them at TF32 too, dg is 1.46e-2 against 5.3e-3 (the 2e-2 bound; the
  wy kernels' TF32 diagonal tiles put it at 2.8e-2 on an H100). Fails if the diagonal tiles
  lose their HIGHEST (the two runs would be the same)."""
  mm = kda_xla._mm
  hi = jax.lax.Precision.HIGHEST
  label = "T140_K128_bf16_saturated"
  inp = kt.make_inputs(zlib.crc32(label.encode()) % 1000, 1, 140, 1, 128, 128, dtype=BF16,
                       gate="saturated", initial_state=True)
  ref = kt.reference_fp64(inp)

  def run(diag_tf32):
    def tf32_mm(a, b, precision):
      if diag_tf32 and precision == hi:
        precision = None  # the diagonal tiles' products (the only HIGHEST ones here)
      if precision in (None, jax.lax.Precision.DEFAULT):
        return _tf32_matmul(a, b)
      return mm(a, b, precision)

    monkeypatch.setattr(kda_xla, "_mm", tf32_mm)
    fn = jax.jit(functools.partial(pallas_gpu.chunk_kda_pallas_gpu, gate_lower_bound=-5.0,
                                   intra="xla", interpret=True),
                 static_argnames=("output_final_state",))
    return kt.run_with_grads(fn, inp)

  errs = kt.check_against_reference(ref, run(False), kt.TOL_BF16, label=label)
  dg_tf32 = kt.rel_rmse(ref[2]["g"], run(True)[2]["g"])
  print({n: f"{e:.1e}" for n, e in errs.items()}, f"dg with TF32 diagonal tiles {dg_tf32:.2e}")
  assert dg_tf32 > 2 * errs["g"]


def test_bf16_operands_change_the_products():
  """precision=BF16_OPERANDS is not DEFAULT under another name: the outputs and gradients differ
  (in their last bits; test_matches_reference's *_bf16_operands cases bound the difference)."""
  inp = kt.make_inputs(5, 1, 80, 1, 32, 32, dtype=BF16, initial_state=True)
  runs = [kt.run_with_grads(_kernel_fn(gate_lower_bound=-5.0, intra="wy", precision=p), inp)
          for p in (None, BF16_OPERANDS)]
  a, b = (jax.tree.leaves(r) for r in runs)
  assert all(not np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the real Triton kernels, T=1024)")
def test_gpu_longer_sequence_bf16():
  """K = V = 128, T = 1024 (16 chunks), bf16, TF32 matmuls (the default for bf16 inputs)."""
  seed = 31
  print(f"seed={seed}")
  inp = kt.make_inputs(seed, 1, 1024, 2, 128, 128, dtype=BF16, initial_state=True,
                       segments=True)
  ref = kt.reference_fp64(inp)
  out = kt.run_with_grads(_kernel_fn(gate_lower_bound=-5.0), inp)
  errs = kt.check_against_reference(ref, out, kt.TOL_BF16, label="gpu_T1024")
  print({n: f"{e:.1e}" for n, e in errs.items()})


@pytest.mark.parametrize("intra", ["wy", "xla"])
def test_save_kda_policy_keeps_the_forward_kernels_out_of_the_recompute(intra):
  """remat_policy "save_kda" (sparse_lm.nn): a layer under jax.checkpoint recomputes its
  cheap ops but not the operator's forward kernels, and its value and gradients are the full
  remat's.

  Counted in the jaxpr of value_and_grad (as a train step computes), after dead code is
  dropped (jaxpr_testlib.live_calls): under "full" each forward kernel runs twice (forward, recompute), under
  "save_kda" once; the backward kernels once either way."""
  from sparse_lm import nn as slm_nn  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import tiles  # pylint: disable=g-import-not-at-top
  assert slm_nn.KDA_OPERATOR_NAME == tiles.SAVE_NAME  # one string, defined on two floors
  B, T, H, K, V = 1, 80, 2, 32, 32
  print("seed=31")
  # fp32: with bf16 the saved output is rounded to bf16 where XLA may otherwise keep excess
  # precision (xla_allow_excess_precision), so the two programs would differ by bf16 rounding
  d = kt.make_inputs(31, B, T, H, K, V, dtype=F32, initial_state=False, segments=True)
  w = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, H, V)), F32)

  def layer(q, k, v, g, beta):  # cheap ops around the operator, as in a KDA layer
    o, _ = pallas_gpu.chunk_kda_pallas_gpu(q * 1.5, k, v, g, beta, gate_lower_bound=-5.0,
                                           intra=intra, segment_ids=d["segment_ids"],
                                           interpret=INTERPRET)
    return jnp.tanh(o.astype(F32))

  def run(policy_name):
    f = jax.checkpoint(layer, policy=slm_nn.remat_policy(policy_name))
    step = jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(5)))
    args = [d[n] for n in NAMES]
    kernels = jaxpr_testlib.live_calls(jax.make_jaxpr(step)(*args), jaxpr_testlib.kernel_name)
    return jax.jit(step)(*args), kernels

  ((l_full, g_full), k_full), ((l_save, g_save), k_save) = run("full"), run("save_kda")
  fwd = ["kda_state_fwd"] + (jaxpr_testlib.tile_calls(k_full, "kda_wy_fwd_scores")
                             + ["kda_wy_fwd_wu"] if intra == "wy" else [])
  bwd = ["kda_state_bwd"] + (["kda_wy_bwd_dx", "kda_wy_bwd_pair"] if intra == "wy" else [])
  assert sorted(set(k_full)) == sorted(set(k_save)) == sorted(fwd + bwd), (k_full, k_save)
  for name in fwd:
    assert (k_full.count(name), k_save.count(name)) == (2, 1), (name, k_full, k_save)
  for name in bwd:
    assert (k_full.count(name), k_save.count(name)) == (1, 1), (name, k_full, k_save)
  np.testing.assert_allclose(float(l_full), float(l_save), rtol=kt.SAME_MATH_TOL["rtol"])
  for n, a, b in zip(NAMES, g_full, g_save):
    assert np.abs(np.asarray(a, F32)).max() > 0, n
    np.testing.assert_allclose(np.asarray(a, F32), np.asarray(b, F32), **kt.SAME_MATH_TOL,
                               err_msg=f"d{n}")
