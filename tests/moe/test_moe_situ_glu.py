"""SiTU-GLU: bounded activation, SwiGLU limit, module params (ARCHITECTURE §5)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.moe import SiTUGLU, situ_activation, situ_glu
import moe_testlib as T


def test_activation_bounded_by_100_even_for_huge_inputs():
  key = jax.random.key(T.seed())
  kg, ku = jax.random.split(key)
  for scale in (1.0, 1e2, 1e6, 1e30):
    g = scale * jax.random.normal(kg, (4096,))
    u = scale * jax.random.normal(ku, (4096,))
    h = situ_activation(g, u)
    assert bool(jnp.all(jnp.isfinite(h)))
    assert float(jnp.max(jnp.abs(h))) <= 100.0
  # The bound is approached (not a trivially small activation).
  h = situ_activation(jnp.array([1e4]), jnp.array([1e4]))
  assert float(h[0]) > 99.0


def test_matches_swiglu_for_small_inputs():
  key = jax.random.key(T.seed())
  kx, kg, ku, kd = jax.random.split(key, 4)
  d, f = 48, 96
  # |x| < 0.1 and unit-variance weights keep |g|, |u| small.
  x = jax.random.uniform(kx, (64, d), minval=-0.1, maxval=0.1)
  w_g = jax.random.normal(kg, (d, f)) / np.sqrt(d)
  w_u = jax.random.normal(ku, (d, f)) / np.sqrt(d)
  w_d = jax.random.normal(kd, (f, d)) / np.sqrt(f)
  y = situ_glu(x, w_g, w_u, w_d)
  swiglu = (jax.nn.silu(x @ w_g) * (x @ w_u)) @ w_d
  # The true gap is relative O(g^2 / 48) <= 2e-4 here: 1e-3 of the signal catches a 10% error.
  assert float(jnp.max(jnp.abs(y - swiglu))) < 1e-3 * float(jnp.max(jnp.abs(swiglu)))
  assert float(jnp.max(jnp.abs(y))) > 1e-3  # nonzero output
  # Elementwise activation too, on |x| < 0.1 directly.
  g = jax.random.uniform(kg, (1000,), minval=-0.1, maxval=0.1)
  u = jax.random.uniform(ku, (1000,), minval=-0.1, maxval=0.1)
  np.testing.assert_allclose(situ_activation(g, u), jax.nn.silu(g) * u, rtol=1e-3, atol=1e-9)


def test_activation_matches_formula_where_the_clips_bend():
  """h = [beta1 tanh(g/beta1) sigmoid(g)] [beta2 tanh(u/beta2)] (fp64 NumPy) for |g|, |u| up
  to ~40, where the two clips differ: swapping beta1 and beta2 fails by far."""
  kg, ku = jax.random.split(jax.random.key(T.seed()))
  g = 10 * jax.random.normal(kg, (4096,))
  u = 10 * jax.random.normal(ku, (4096,))
  gn, un = np.asarray(g, np.float64), np.asarray(u, np.float64)
  formula = lambda b1, b2: (b1 * np.tanh(gn / b1) / (1 + np.exp(-gn))) * (b2 * np.tanh(un / b2))
  h = np.asarray(situ_activation(g, u), np.float64)
  np.testing.assert_allclose(h, formula(4.0, 25.0), rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(h - formula(25.0, 4.0))) > 10.0


def test_large_beta_is_swiglu():
  key = jax.random.key(T.seed())
  kg, ku = jax.random.split(key)
  g = 3 * jax.random.normal(kg, (512,))
  u = 3 * jax.random.normal(ku, (512,))
  np.testing.assert_allclose(situ_activation(g, u, 1e4, 1e4), jax.nn.silu(g) * u, rtol=1e-5,
                             atol=1e-5)


def test_module_shapes_axes_and_dtype():
  cfg = get_preset("tiny", dtype="bfloat16")
  m = SiTUGLU(cfg.d_model, cfg.dense_hidden, cfg=cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model), jnp.bfloat16)
  y = m(x)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16
  assert m.w_gate[...].dtype == jnp.float32  # param_dtype
  specs = nnx.get_partition_spec(nnx.state(m))
  assert tuple(specs["w_gate"].value) == ("embed", "mlp")
  assert tuple(specs["w_down"].value) == ("mlp", "embed")
  ref = situ_glu(x.astype(jnp.float32), m.w_gate[...], m.w_up[...], m.w_down[...])
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=3e-2 * float(
      jnp.max(jnp.abs(ref))))


def test_out_dtype_bf16_matches_the_cast_and_the_analytic_gradient():
  """out_dtype=bf16 casts inside the checkpoint: the same values and gradients as casting the
  fp32 result afterwards (bit for bit), and the gradients of the formula (fp64 NumPy)."""
  kg, ku, kc = jax.random.split(jax.random.key(T.seed()), 3)
  g = (6 * jax.random.normal(kg, (64, 96))).astype(jnp.bfloat16)
  u = (30 * jax.random.normal(ku, (64, 96))).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (64, 96)).astype(jnp.bfloat16)
  inside = lambda g, u: situ_activation(g, u, out_dtype=jnp.bfloat16)
  after = lambda g, u: situ_activation(g, u).astype(jnp.bfloat16)
  h_in, vjp_in = jax.vjp(inside, g, u)
  h_af, vjp_af = jax.vjp(after, g, u)
  assert h_in.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(h_in, np.float32), np.asarray(h_af, np.float32))
  for a, b in zip(vjp_in(cot), vjp_af(cot)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  gn, un, cn = (np.asarray(x, np.float64) for x in (g, u, cot))
  sig = 1 / (1 + np.exp(-gn))
  tg, tu = np.tanh(gn / 4.0), np.tanh(un / 25.0)
  dg = cn * 25.0 * tu * ((1 - tg**2) * sig + 4.0 * tg * sig * (1 - sig))
  du = cn * 4.0 * tg * sig * (1 - tu**2)
  for got, want in zip(vjp_in(cot), (dg, du)):
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert err < 1e-2, err  # bf16 rounding of the result (2^-8); a wrong term is O(1) off


def test_out_dtype_keeps_fp32_copies_out_of_the_checkpoint_barrier():
  """With out_dtype=bf16 the backward's rematerialisation barrier holds g, u and the cotangent
  in bf16; the cast after the call put an fp32 [rows, F] cotangent there (on the GPU a separate
  kernel writing 4 bytes per element, then read back)."""
  g = jnp.ones((256, 128), jnp.bfloat16)

  def barrier_types(fn):
    loss = lambda g, u: jnp.sum(fn(g, u).astype(jnp.float32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(g, g).as_text()
    lines = [l for l in text.splitlines() if "optimization_barrier" in l]
    assert lines, "no optimization barrier: jax.checkpoint's lowering changed"
    return " ".join(lines)

  assert "256x128xf32" not in barrier_types(
      lambda g, u: situ_activation(g, u, out_dtype=jnp.bfloat16))
  assert "256x128xf32" in barrier_types(lambda g, u: situ_activation(g, u).astype(jnp.bfloat16))
