"""tokamax's attention is given a sequence padded to a multiple of SEQ_BLOCK (an unpadded
T = 32 gave NaN gradients in the tiny SFT step on an H100, finite padded: see SEQ_BLOCK), with
the padding invisible: values and gradients equal the unpadded attention's.

On the CPU tokamax's "xla" implementation runs; a spy checks the length the kernel gets."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

pytest.importorskip("tokamax")

from pallas_kernels.attention import tokamax as tk  # pylint: disable=wrong-import-position
from sparse_lm.model import attention  # pylint: disable=wrong-import-position


def _naive(q, k, v, visible, scale):
  """o[b, i] = softmax over the keys j with visible[b, i, j] (an independent reference)."""
  s = np.einsum("bihd,bjhd->bhij", q, k) * scale
  s = np.where(visible[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return np.einsum("bhij,bjhd->bihd", p, v)


@pytest.fixture
def seen_lengths(monkeypatch):
  """The sequence lengths tokamax's xla implementation is called with."""
  from tokamax._src.ops.attention import api as tk_api
  lengths = []
  real = tk_api.IMPLEMENTATIONS["xla"]

  def spy(q, *a, **kw):
    lengths.append(q.shape[1])
    return real(q, *a, **kw)
  monkeypatch.setattr(tk_api, "IMPLEMENTATIONS", {**tk_api.IMPLEMENTATIONS, "xla": spy})
  return lengths


@pytest.mark.parametrize("causal", [True, False])
def test_padded_ranges_equal_the_unpadded_attention(causal, seen_lengths):
  rng = np.random.default_rng(7)
  B, T, H, Dk, Dv = 2, 45, 2, 24, 16
  q, k = (rng.standard_normal((B, T, H, Dk)).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
  do = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
  seg = np.zeros((B, T), np.int32)
  seg[0, 20:] = 1
  seg[1, 7:30] = 1
  seg[1, 30:] = 2
  start, end = (np.asarray(a) for a in tk.run_ranges(jnp.asarray(seg)))
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  visible = (j[None] >= start[:, :, None]) & (j[None] < end[:, :, None])
  if causal:
    visible &= (j <= i)[None]
  scale = Dk ** -0.5

  def loss(q, k, v):
    o = tk.tokamax_masked(q, k, v, scale=scale, k_start=jnp.asarray(start),
                          k_end=None if causal else jnp.asarray(end), is_causal=causal,
                          implementation="xla")
    return jnp.sum(o * do), o
  (dq, dk, dv), o = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  assert seen_lengths and all(n % tk.SEQ_BLOCK == 0 for n in seen_lengths), seen_lengths
  assert o.shape == (B, T, H, Dv)
  np.testing.assert_allclose(o, _naive(q, k, v, visible, scale), atol=1e-5)
  # gradients against autodiff of a dense masked softmax (no tokamax, no padding)
  def dense(q, k, v):
    s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
    p = jax.nn.softmax(jnp.where(visible[:, None], s, -1e30), axis=-1)
    return jnp.sum(jnp.einsum("bhij,bjhd->bihd", p, v) * do)
  for got, want in zip((dq, dk, dv), jax.grad(dense, argnums=(0, 1, 2))(q, k, v)):
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_unsegmented_causal_attention_is_padded_too(monkeypatch):
  import tokamax
  lengths = []
  real = tokamax.dot_product_attention

  def spy(q, *a, **kw):
    lengths.append(q.shape[1])
    return real(q, *a, **kw)
  monkeypatch.setattr(tokamax, "dot_product_attention", spy)
  rng = np.random.default_rng(8)
  B, T, H, D = 1, 40, 2, 16
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
  o = attention.attention_tokamax(q, k, v, scale=D ** -0.5, implementation="xla")
  assert lengths == [tk.SEQ_BLOCK]
  visible = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
  np.testing.assert_allclose(o, _naive(*(np.asarray(a) for a in (q, k, v)), visible, D ** -0.5),
                             atol=1e-5)
