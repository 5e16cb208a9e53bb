"""The tokamax path of `moe.gmm`: our VJP around tokamax's grouped-matmul kernel and its
weight gradient, `gmm.grouped_weight_grad` (XLA batched matmuls over group-padded blocks).

References are per-group loops of plain fp32 matmuls (NumPy group bounds) and their autodiff,
never the code under test. On the CPU tokamax runs its XLA fallback, so the VJP's wiring and
the weight gradient run everywhere; the Mosaic GPU kernel with `gmm.SM90_TILES` runs on a
Hopper GPU with tokamax installed (skipped elsewhere, with the reason).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.platform import compute_capability
from sparse_lm.moe import gmm as gmm_lib

_HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None


def _sizes(rng, total, g, empty=(2,)):
  sizes = rng.multinomial(total, rng.dirichlet(np.ones(g)))
  for e in empty:
    sizes[0] += sizes[e]
    sizes[e] = 0
  sizes[0] += total - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def _loop_matmul(lhs, rhs, sizes):
  """out rows of group g = lhs rows of g @ rhs[g] (fp32, highest); rows past the sum zero."""
  out, start = [], 0
  for gi, s in enumerate(np.asarray(sizes)):
    out.append(jnp.dot(lhs[start:start + s].astype(jnp.float32),
                       rhs[gi].astype(jnp.float32), precision="highest"))
    start += int(s)
  out.append(jnp.zeros((lhs.shape[0] - start, rhs.shape[-1]), jnp.float32))
  return jnp.concatenate(out, axis=0)


def _loop_weight_grad(lhs, dout, sizes):
  out, start = [], 0
  for s in np.asarray(sizes):
    out.append(np.asarray(lhs[start:start + s], np.float64).T
               @ np.asarray(dout[start:start + s], np.float64))
    start += int(s)
  return np.stack(out)


@pytest.mark.parametrize("block,max_bytes", [(1024, 1 << 30), (16, 1 << 30), (16, 3 * 4 * 24 * 40)])
def test_grouped_weight_grad_matches_per_group_products(block, max_bytes):
  """Blocks larger than M (one block per group), blocks that split groups, and passes of 3
  blocks (the scan); an empty group; rows past the sum holding NaN are ignored."""
  rng = np.random.default_rng(0)
  m, k, n, g = 300, 24, 40, 6
  sizes = _sizes(rng, m - 23, g)
  lhs = jax.random.normal(jax.random.key(0), (m, k))
  dout = jax.random.normal(jax.random.key(1), (m, n)).at[m - 23:].set(jnp.nan)
  out = jax.jit(lambda a, b, s: gmm_lib.grouped_weight_grad(a, b, s, block=block,
                                                            max_bytes=max_bytes))(
      lhs, dout, sizes)
  ref = _loop_weight_grad(lhs, dout, sizes)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
  assert np.abs(ref).max() > 1.0


def test_grouped_weight_grad_bf16_accumulates_in_fp32():
  rng = np.random.default_rng(1)
  m, k, n, g = 2048, 16, 8, 4
  sizes = _sizes(rng, m, g, empty=())
  lhs = jax.random.normal(jax.random.key(2), (m, k)).astype(jnp.bfloat16)
  dout = jax.random.normal(jax.random.key(3), (m, n)).astype(jnp.bfloat16)
  out = gmm_lib.grouped_weight_grad(lhs, dout, sizes, block=64, out_dtype=jnp.float32)
  ref = _loop_weight_grad(lhs.astype(jnp.float32), dout.astype(jnp.float32), sizes)
  # products of bf16 values are exact in fp32; only the fp32 sums round
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-3)


def test_grouped_weight_grad_rejects_bad_input():
  a, d, s = jnp.zeros((8, 4)), jnp.zeros((8, 3)), jnp.asarray([4, 4])
  with pytest.raises(ValueError, match="same M"):
    gmm_lib.grouped_weight_grad(a, jnp.zeros((7, 3)), s)
  with pytest.raises(ValueError, match=r"group_sizes must be \[G\]"):
    gmm_lib.grouped_weight_grad(a, d, s[None])
  with pytest.raises(ValueError, match="block must be >= 1"):
    gmm_lib.grouped_weight_grad(a, d, s, block=0)
  with pytest.raises(ValueError, match="max_bytes must be >= 1"):
    gmm_lib.grouped_weight_grad(a, d, s, max_bytes=0)


def test_grouped_weight_grad_empty_groups_ignore_nan_rows():
  """No rows in any group: zeros, even with NaN in every row (both operands are masked)."""
  lhs = jnp.full((40, 8), jnp.nan).at[1:].set(1.0)
  dout = jnp.full((40, 4), jnp.nan)
  out = gmm_lib.grouped_weight_grad(lhs, dout, jnp.zeros((3,), jnp.int32), block=16)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert gmm_lib.grouped_weight_grad(lhs[:0], dout[:0], jnp.zeros((3,), jnp.int32)).shape == (
      3, 8, 4)


@pytest.mark.skipif(not _HAVE_TOKAMAX, reason="tokamax is not installed")
@pytest.mark.parametrize("covered", [True, False])
def test_tokamax_path_values_and_gradients(covered, monkeypatch):
  """`gmm(backend="tokamax")` (the masked path when rows are left over) against per-group fp32
  matmuls and their autodiff: d_lhs through the kernel on the transposed weight, d_rhs from
  `grouped_weight_grad`. On the CPU tokamax's XLA fallback computes the forward."""
  rng = np.random.default_rng(2)
  m, k, n, g = 256, 32, 16, 6
  sizes = _sizes(rng, m if covered else m - 37, g)
  lhs = jax.random.normal(jax.random.key(4), (m, k))
  rhs = jax.random.normal(jax.random.key(5), (g, k, n)) / k ** 0.5
  dout = jax.random.normal(jax.random.key(6), (m, n))
  calls = []  # our VJP, not tokamax's own, computes the weight gradient
  real = gmm_lib.grouped_weight_grad
  monkeypatch.setattr(gmm_lib, "grouped_weight_grad",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  fn = lambda a, b: gmm_lib.gmm(a, b, sizes, backend="tokamax", rows_covered=covered)
  loss = lambda f, a, b: jnp.vdot(f(a, b), dout)
  np.testing.assert_allclose(jax.jit(fn)(lhs, rhs), _loop_matmul(lhs, rhs, sizes),
                             rtol=1e-5, atol=1e-5)
  grads = jax.jit(jax.grad(lambda a, b: loss(fn, a, b), argnums=(0, 1)))(lhs, rhs)
  assert calls, "the weight gradient did not go through grouped_weight_grad"
  refs = jax.grad(lambda a, b: loss(lambda x, w: _loop_matmul(x, w, sizes), a, b),
                  argnums=(0, 1))(lhs, rhs)
  for got, ref, name in zip(grads, refs, ("d_lhs", "d_rhs")):
    assert float(jnp.max(jnp.abs(ref))) > 0.1, name
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=name)
  np.testing.assert_array_equal(np.asarray(grads[1][2]), 0.0)  # the empty group


def test_sm90_tiles_apply_only_where_they_fit(monkeypatch):
  bf = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((4, 128, 64), jnp.bfloat16)
  if jax.default_backend() != "gpu":
    assert not gmm_lib._use_sm90_tiles(*bf)  # CPU / TPU: never
  assert not gmm_lib._use_sm90_tiles(bf[0].astype(jnp.float32), bf[1].astype(jnp.float32))
  monkeypatch.setattr(gmm_lib, "SM90_TILES", None)
  assert not gmm_lib._use_sm90_tiles(*bf)  # switched off: tokamax chooses


_HOPPER = (jax.default_backend() == "gpu" and 9.0 <= compute_capability(jax.devices()[0]) < 10
           and _HAVE_TOKAMAX)


@pytest.mark.skipif(not _HOPPER, reason="tokamax's sm90 Mosaic GPU kernel: a Hopper GPU with "
                    "tokamax installed (benchmarks/gpu_setup.sh)")
@pytest.mark.parametrize("covered", [True, False])
def test_sm90_kernel_with_our_tiles_on_hopper(covered):
  """The Mosaic GPU kernel with SM90_TILES, bf16 operands, 16 groups over 16K rows: values and
  both gradients within bf16 rounding of per-group fp32 matmuls (tokamax's own weight-gradient
  kernel missed such a bound by 8% at the `small` preset's shapes)."""
  rng = np.random.default_rng(3)
  m, k, n, g = 16384, 512, 256, 16
  sizes = _sizes(rng, m if covered else m - 1000, g)
  lhs = jax.random.normal(jax.random.key(7), (m, k)).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(8), (g, k, n)) / k ** 0.5).astype(jnp.bfloat16)
  dout = jax.random.normal(jax.random.key(9), (m, n))
  assert gmm_lib._use_sm90_tiles(lhs, rhs)
  fn = lambda a, b: gmm_lib.gmm(a, b, sizes, backend="tokamax", rows_covered=covered)
  loss = lambda f, a, b: jnp.vdot(f(a, b).astype(jnp.float32), dout)
  live = int(np.asarray(sizes).sum())
  out = jax.jit(fn)(lhs, rhs).astype(jnp.float32)
  ref = _loop_matmul(lhs, rhs, sizes)
  assert float(jnp.max(jnp.abs(out[:live] - ref[:live]))) < 1e-2 * float(jnp.max(jnp.abs(ref)))
  if not covered:
    np.testing.assert_array_equal(np.asarray(out[live:]), 0.0)
  grads = jax.jit(jax.grad(lambda a, b: loss(fn, a, b), argnums=(0, 1)))(lhs, rhs)
  refs = jax.grad(lambda a, b: loss(lambda x, w: _loop_matmul(x, w, sizes), a, b),
                  argnums=(0, 1))(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  for got, r, name in zip(grads, refs, ("d_lhs", "d_rhs")):
    err = jnp.abs(got.astype(jnp.float32) - r)
    err = float(jnp.max(err[:live] if name == "d_lhs" else err))
    assert err < 1e-2 * float(jnp.max(jnp.abs(r))), (name, err)
