"""`nn.project`: values and gradients against an fp64 reference, and the 16-bit backward.

The reference rounds the operands to bf16, multiplies in fp64 and rounds the product to bf16,
as the contract says (16-bit operands, fp32 accumulation, output in `dtype`); the backward of
`y = bf16(bf16(x) @ bf16(W))` with an incoming bf16 cotangent g is dx = bf16(g @ bf16(W)ᵀ),
dW = bf16(bf16(x)ᵀ @ g), summed over the batch dimensions.
"""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparse_lm import nn

BF16 = ml_dtypes.bfloat16


def _bf16(a):
  return np.asarray(np.asarray(a, np.float64).astype(BF16), np.float64)


def _reference(x, w, g, n_in):
  """fp64 (y, dx, dw) of bf16(x) @ bf16(w) over the last n_in dims of x, cotangent g."""
  xb, wb, gb = _bf16(x), _bf16(w), _bf16(g)
  nb, n_out = x.ndim - n_in, w.ndim - n_in
  x2 = xb.reshape(int(np.prod(x.shape[:nb])), -1)
  w2 = wb.reshape(int(np.prod(w.shape[:n_in])), -1)
  g2 = gb.reshape(x2.shape[0], -1)
  y = _bf16(x2 @ w2).reshape(*x.shape[:nb], *w.shape[n_in:])
  dx = _bf16(g2 @ w2.T).reshape(x.shape)
  dw = _bf16(x2.T @ g2).reshape(w.shape)
  assert n_out >= 1
  return y, dx, dw


CASES = [  # (x shape, kernel shape, n_in): like w_q [D, H, K], w_o [H, V, D], a plain [D, F]
    ((2, 5, 24), (24, 3, 16), 1),
    ((2, 5, 3, 16), (3, 16, 24), 2),
    ((7, 32), (32, 40), 1),
]


@pytest.mark.parametrize("xs,ws,n_in", CASES)
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32])
def test_bf16_project_values_and_gradients_match_fp64(xs, ws, n_in, w_dtype):
  rng = np.random.default_rng(sum(xs) + sum(ws) + n_in)
  x = rng.normal(size=xs).astype(np.float32)
  w = (rng.normal(size=ws) / np.sqrt(np.prod(ws[:n_in]))).astype(np.float32)
  g = rng.normal(size=(*xs[:len(xs) - n_in], *ws[n_in:])).astype(np.float32)
  wj = jnp.asarray(w).astype(w_dtype)
  y, vjp = jax.vjp(lambda x, w: nn.project(x, w, n_in, dtype=jnp.bfloat16), jnp.asarray(x), wj)
  assert y.dtype == jnp.bfloat16
  dx, dw = vjp(jnp.asarray(g).astype(jnp.bfloat16))
  assert dx.dtype == jnp.float32 and dw.dtype == w_dtype
  ry, rdx, rdw = _reference(x, np.asarray(wj.astype(jnp.float32)), g, n_in)
  # fp32 accumulation against fp64: at most one bf16 rounding step apart (2^-8 relative)
  for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=1e-6)
    rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert rel < 1e-3, rel


def _dots(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _dots(sub)


def test_bf16_backward_products_take_bf16_operands():
  """The point of the custom VJP: no fp32 operand reaches a product (TF32 GEMMs on a GPU)."""
  x = jnp.ones((4, 6, 32), jnp.float32)
  w = jnp.ones((32, 48), jnp.bfloat16)
  f = lambda x, w: jnp.sum(jnp.sin(nn.project(x, w, dtype=jnp.bfloat16).astype(jnp.float32)))
  dots = list(_dots(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr))
  assert len(dots) == 3  # forward, dx, dw
  for eqn in dots:
    assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
    assert eqn.params["preferred_element_type"] == jnp.float32


def test_fp32_output_keeps_the_fp32_cotangent():
  x = jnp.ones((4, 32), jnp.float32)
  w = jnp.ones((32, 8), jnp.bfloat16)
  f = lambda x, w: jnp.sum(nn.project(x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32) ** 2)
  dots = list(_dots(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr))
  assert any(jnp.float32 in [v.aval.dtype for v in eqn.invars] for eqn in dots[1:])


@pytest.mark.parametrize("policy", ["minimal", "save_dots"])
def test_dot_remat_policies_save_the_bf16_projections(policy, capsys):
  """The custom VJP hides the product from the dot policies; they save it by name."""
  x = jnp.ones((4, 32), jnp.float32)
  w1, w2 = jnp.ones((32, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16)

  def f(x, w1, w2):
    h = jnp.tanh(nn.project(x, w1, dtype=jnp.bfloat16).astype(jnp.float32))
    return jnp.sum(jnp.sin(nn.project(h, w2, dtype=jnp.bfloat16).astype(jnp.float32)))

  def saved(name):  # the public report: one line per residual, "bf16[4,16] named 'project' ..."
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=nn.remat_policy(name)),
                                            x, w1, w2)
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if f"named '{nn.PROJECT_NAME}'" in line]

  assert saved(policy) == ["bf16[4,16]", "bf16[4,8]"]
  assert saved("full") == []


@pytest.mark.parametrize("policy", ["full", "minimal", "save_dots", "none"])
def test_scanned_rematerialised_layers_match_the_plain_product(policy, monkeypatch):
  """bf16 layers scanned under `jax.checkpoint` (how the model runs them): gradients through
  the custom VJP against the same program with the plain product (autodiff), equal up to
  summation order."""
  rng = np.random.default_rng(11)
  L, D, F = 3, 32, 48
  w1 = jnp.asarray(rng.normal(size=(L, D, 2, F // 2)) / np.sqrt(D), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(L, 2, F // 2, D)) / np.sqrt(F), jnp.bfloat16)
  x = jnp.asarray(rng.normal(size=(2, 5, D)), jnp.float32)

  def loss(x, w1, w2):
    def layer(h, w):
      a = nn.project(h, w[0], dtype=jnp.bfloat16)  # [B, T, 2, F/2]
      a = jax.nn.silu(a.astype(jnp.float32))
      return h + nn.project(a, w[1], 2, dtype=jnp.bfloat16).astype(jnp.float32), None
    body = layer if policy == "none" else jax.checkpoint(layer, policy=nn.remat_policy(policy))
    h, _ = jax.lax.scan(body, x, (w1, w2))
    return jnp.sum(jnp.sin(h))

  # Every bf16 rounding the programs write happens: XLA:GPU may otherwise keep a bf16 value in
  # fp32 inside a fusion (excess precision), differently in the two programs (2e-3 apart on an
  # H200 with it on); the CPU compiler keeps them either way.
  exact = {"xla_allow_excess_precision": False}
  grads = lambda *a: jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*a).compile(exact)(*a)
  custom = grads(x, w1, w2)

  def plain(x, kernel, n_in, dtype):
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), dims,
                            preferred_element_type=jnp.float32)
    return y.astype(dtype)

  monkeypatch.setattr(nn, "_project_lowp", plain)
  reference = grads(x, w1, w2)
  for got, want in zip(custom, reference):
    assert got.dtype == want.dtype
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
