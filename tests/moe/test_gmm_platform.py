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
