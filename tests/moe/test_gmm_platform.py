"""`moe.gmm` resolves its backend for the platform the program is compiled for, so that an
ahead-of-time TPU compile from a CPU host gets the megablox kernel (not XLA's ragged_dot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.moe import gmm as gmm_lib


@pytest.mark.parametrize("backend, platform, k, n, want", [
    ("auto", "cpu", 256, 256, "ragged_dot"),
    ("auto", "gpu", 256, 256, "tokamax"),
    ("auto", "tpu", 256, 256, "megablox"),
    ("tokamax", "tpu", 256, 256, "megablox"),  # from a CPU host: tokamax would pick for CPU
    ("auto", "tpu", 96, 256, "ragged_dot"),    # Mosaic needs K, N multiples of 128
    ("ragged_dot", "tpu", 256, 256, "ragged_dot"),
])
@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="CPU-host test: backend resolution from a host without accelerators")
def test_backend_follows_the_target_platform(backend, platform, k, n, want):
  assert jax.default_backend() == "cpu"
  assert gmm_lib.resolve_backend(backend, platform, k=k, n=n) == want


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="CPU-host test: lowers a TPU program from a host without accelerators")
def test_tpu_target_lowers_to_the_mosaic_kernel_from_a_cpu_host():
  lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  for platform, kernel in [("tpu", True), (None, False)]:
    f = jax.jit(lambda a, b, s, p=platform: gmm_lib.gmm(a, b, s, platform=p))
    text = f.trace(lhs, rhs, sizes).lower(
        lowering_platforms=("tpu" if platform else "cpu",)).as_text()
    assert ("tpu_custom_call" in text) == kernel, platform


def test_megablox_with_row_padding_matches_ragged_dot():
  seed = 3
  print("seed", seed)
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.normal(size=(600, 128)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(3, 128, 128)), jnp.float32)
  sizes = jnp.asarray([250, 0, 300], jnp.int32)  # 50 rows past the groups
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  got = gmm_lib.gmm(lhs, rhs, sizes, backend="megablox")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(got)[550:] == 0)


def test_auto_on_a_gpu_without_tokamax_is_ragged_dot(monkeypatch):
  """A GPU image without tokamax (benchmarks/gpu_setup.sh installs it) runs XLA's ragged_dot
  under "auto" instead of failing at the import; an explicit "tokamax" stays tokamax."""
  monkeypatch.setattr(gmm_lib, "have_tokamax", lambda: False)
  assert gmm_lib.resolve_backend("auto", "gpu") == "ragged_dot"
  assert gmm_lib.resolve_backend("tokamax", "gpu") == "tokamax"
  monkeypatch.setattr(gmm_lib, "have_tokamax", lambda: True)
  assert gmm_lib.resolve_backend("auto", "gpu") == "tokamax"


def _garbage_tail_kernel(lhs, rhs, group_sizes):
  """A grouped matmul that, like tokamax's Mosaic GPU kernel, writes only the rows of the
  groups: rows past sum(group_sizes) hold NaN (what an unwritten buffer may hold), in the
  output and in its lhs gradient."""
  @jax.custom_vjp
  def f(lhs, rhs):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)

  def fwd(lhs, rhs):
    return f(lhs, rhs), (lhs, rhs)

  def bwd(res, ct):
    lhs, rhs = res
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), lhs, rhs)
    dlhs, drhs = vjp(ct)
    return jnp.where(gmm_lib._live_rows(lhs.shape[0], group_sizes), dlhs, jnp.nan), drhs

  f.defvjp(fwd, bwd)
  out = f(lhs, rhs)
  return jnp.where(gmm_lib._live_rows(lhs.shape[0], group_sizes), out, jnp.nan)


def test_tokamax_rows_past_the_groups_are_zero_in_value_and_gradient(monkeypatch):
  """The padding tokens' rows sort past sum(group_sizes); a kernel that leaves them unwritten
  must not leak NaN into the MoE output or the gradients (the `small` NaN on the H200)."""
  monkeypatch.setattr(gmm_lib, "_tokamax_kernel", _garbage_tail_kernel)
  rng = np.random.default_rng(3)
  m, k, n, g = 24, 16, 8, 3
  lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32)
  sizes = jnp.asarray([5, 0, 12], jnp.int32)  # 17 live rows, 7 past the sum, an empty group
  live = np.arange(m) < 17

  def loss(fn, a, b):
    out = fn(a, b, sizes)
    return jnp.sum(jnp.sin(out) * jnp.arange(n, dtype=jnp.float32)), out

  # independent reference: each live row times its group's matrix; the tail is zero
  group = np.repeat(np.arange(g), np.asarray(sizes))
  want = np.zeros((m, n), np.float32)
  want[:17] = np.einsum("mk,mkn->mn", np.asarray(lhs)[:17], np.asarray(rhs)[group])
  (val, out), grads = jax.value_and_grad(
      lambda a, b: loss(gmm_lib._tokamax_ragged_dot, a, b), argnums=(0, 1), has_aux=True)(
          lhs, rhs)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  (_, _), ref_grads = jax.value_and_grad(
      lambda a, b: loss(lambda x, y, s: jax.lax.ragged_dot(x, y, s), a, b), argnums=(0, 1),
      has_aux=True)(lhs, rhs)
  for got, ref in zip(grads, ref_grads):
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(grads[0])[~live] == 0)
  # without the masking the same kernel leaks NaN (the test sees the failure it guards)
  leaked = _garbage_tail_kernel(lhs, rhs, sizes)
  assert np.isnan(np.asarray(leaked)[~live]).all()


@pytest.mark.parametrize("dead_last", [False, True])
def test_sorted_dispatch_leaves_no_unwritten_rows_for_a_tail_writing_kernel(monkeypatch,
                                                                            dead_last):
  """`sorted_dispatch` counts the sentinel (padding / dropped) rows into the last expert's
  group on the tokamax path and skips the row masks (`gmm(rows_covered=True)`): with a kernel
  that leaves rows past sum(group_sizes) as NaN, value and gradients must still be finite and
  equal an independent per-token loop, also when the last expert has no token of its own."""
  from sparse_lm.moe import latent_moe as lm
  from sparse_lm.moe.situ_glu import situ_activation
  monkeypatch.setattr(gmm_lib, "_tokamax_kernel", _garbage_tail_kernel)
  rng = np.random.default_rng(5)
  n, e, k, lat, f = 29, 5, 2, 8, 12
  z = jnp.asarray(rng.normal(size=(n, lat)), jnp.float32)
  ids = np.stack([rng.choice(e - int(dead_last), size=k, replace=False) for _ in range(n)])
  ids[rng.random((n, k)) < 0.2] = e  # sentinel pairs
  ids[:3] = e  # three padding tokens: all sentinels
  ids = jnp.asarray(ids, jnp.int32)
  gates = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
  params = {"w_gate": jnp.asarray(0.4 * rng.normal(size=(e, lat, f)), jnp.float32),
            "w_up": jnp.asarray(0.4 * rng.normal(size=(e, lat, f)), jnp.float32),
            "w_down": jnp.asarray(0.4 * rng.normal(size=(e, f, lat)), jnp.float32)}
  wts = jnp.asarray(rng.normal(size=(n, lat)), jnp.float32)

  def reference(z, gates, params):  # token by token, pair by pair; sentinels add nothing
    rows = []
    for t in range(n):
      acc = jnp.zeros((lat,), jnp.float32)
      for j in range(k):
        x = int(ids[t, j])
        if x < e:
          h = situ_activation(z[t] @ params["w_gate"][x], z[t] @ params["w_up"][x], 4.0, 25.0)
          acc = acc + gates[t, j] * (h @ params["w_down"][x])
      rows.append(acc)
    return jnp.stack(rows)

  def loss(fn, *a):
    return jnp.sum(wts * fn(*a))

  fast = lambda z, g, p: lm.sorted_dispatch(z, ids, g, p, backend="tokamax")
  val, grads = jax.value_and_grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2))(z, gates, params)
  ref_val, ref_grads = jax.value_and_grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(
      z, gates, params)
  assert np.isfinite(float(val))
  np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(grads[0])[:3], 0.0)  # padding tokens: no gradient
