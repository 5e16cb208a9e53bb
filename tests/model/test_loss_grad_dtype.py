"""The LM head's bf16 cotangent (`chunked_cross_entropy(grad_dtype="bfloat16")`).

Reference (fp64 numpy, from the definition, not the code under test): logits = bf16(h) @
bf16(W); per counted token d nll / d logits = w · (softmax(logits) − onehot(target)) and
d (w · lse²) / d logits = 2 w · lse · softmax(logits). With grad_dtype="bfloat16" that
cotangent is rounded to bf16 once, then dh = ct @ bf16(W)ᵀ and dW = bf16(h)ᵀ @ ct, each
rounded to bf16 (the operands' dtype).
"""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparse_lm.config import get_preset
from sparse_lm.model.loss import chunked_cross_entropy

BF16 = ml_dtypes.bfloat16


def _bf16(a):
  return np.asarray(np.asarray(a, np.float64).astype(BF16), np.float64)


def _inputs(seed=0, B=2, T=21, D=32, V=48):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = (rng.normal(size=(D, V)) / np.sqrt(D)).astype(np.float32) * 3
  t = rng.integers(0, V, size=(B, T)).astype(np.int32)
  wt = (rng.random((B, T)) > 0.2).astype(np.float32)
  return h, w, t, wt


def _reference(h, w, t, wt, z_coef, round_ct, chunk=8):
  """fp64 (dh, dW, bound_h, bound_w) of nll_sum + z_coef · z_sum at bf16 operands; dW is
  summed over the loss's chunks of `chunk` positions, each chunk's rounded to bf16 (the
  program's per-chunk head gradient has the bf16 operand's dtype). bound_*: Σ |terms|, the
  scale of the error one bf16 rounding of the cotangent may make."""
  hb, wb = _bf16(h), _bf16(w)
  logits = hb @ wb  # [B, T, V]
  m = logits.max(-1, keepdims=True)
  p = np.exp(logits - m)
  p /= p.sum(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
  onehot = np.eye(w.shape[1])[t]
  ct = wt[..., None] * (p - onehot) + z_coef * 2 * (wt * lse)[..., None] * p
  if round_ct:
    ct = _bf16(ct)
  dh = _bf16(ct @ wb.T)
  dw = sum(_bf16(np.einsum("btd,btv->dv", hb[:, i:i + chunk], ct[:, i:i + chunk]))
           for i in range(0, h.shape[1], chunk))
  return dh, dw, np.abs(ct) @ np.abs(wb.T), np.einsum("btd,btv->dv", np.abs(hb), np.abs(ct))


@pytest.mark.parametrize("z_coef", [0.0, 0.5])
def test_bf16_cotangent_matches_the_fp64_formula(z_coef):
  h, w, t, wt = _inputs(1)

  def loss(h, w, grad_dtype):
    s = chunked_cross_entropy(h, w, jnp.asarray(t), jnp.asarray(wt), chunk_size=8,
                              dtype=jnp.bfloat16, grad_dtype=grad_dtype)
    return s["nll_sum"] + z_coef * s["z_sum"], s

  (_, s_lo), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(h), jnp.asarray(w), "bfloat16")
  (_, s_hi), (dh32, dw32) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      jnp.asarray(h), jnp.asarray(w), None)
  for k in s_lo:  # the forward is the same program
    np.testing.assert_array_equal(np.asarray(s_lo[k]), np.asarray(s_hi[k]))
  rdh, rdw, bh, bw = _reference(h, w, t, wt, z_coef, round_ct=True)
  # One bf16 rounding of the result (2^-8 relative), and a cotangent entry whose fp32 and
  # fp64 values round to neighbouring bf16 numbers (2^-8 of that term; rare).
  for got, want, bound in ((dh, rdh, bh), (dw, rdw, bw)):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= 2 ** -8 * (np.abs(want) + bound)), (err / (np.abs(want) + bound)).max()
    rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert rel < 2 ** -8, rel
  # Rounding the cotangent is a real change of the gradient, of bf16 size, not more.
  xdh = _reference(h, w, t, wt, z_coef, round_ct=False)[0]
  rel = np.linalg.norm(np.asarray(dh, np.float64) - xdh) / np.linalg.norm(xdh)
  assert 0 < rel < 1e-2
  rel32 = np.linalg.norm(np.asarray(dh32, np.float64) - xdh) / np.linalg.norm(xdh)
  assert rel32 < 1e-2


def _backward_dot_dtypes(grad_dtype):
  h, w, t, wt = _inputs(2)
  f = lambda h, w: chunked_cross_entropy(h, w, jnp.asarray(t), jnp.asarray(wt), chunk_size=8,
                                         dtype=jnp.bfloat16, grad_dtype=grad_dtype)["nll_sum"]
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
  found = []

  def walk(jp):
    for eqn in jp.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for p in eqn.params.values():
        for x in (p if isinstance(p, (list, tuple)) else (p,)):
          if isinstance(x, jax.extend.core.ClosedJaxpr):
            walk(x.jaxpr)
          elif isinstance(x, jax.extend.core.Jaxpr):
            walk(x)

  walk(jaxpr.jaxpr)
  return found


def test_bf16_cotangent_feeds_bf16_gemms_and_fp32_is_the_default():
  lo, hi = _backward_dot_dtypes("bfloat16"), _backward_dot_dtypes(None)
  # forward, its recompute under the checkpoint, and two backward products each
  assert len(lo) >= 3 and len(hi) >= 3
  assert all(d == ("bfloat16", "bfloat16") for d in lo), lo
  assert any("float32" in d for d in hi), hi  # autodiff hands the GEMMs the fp32 cotangent


def test_config_field_is_checked():
  cfg = get_preset("tiny")
  with pytest.raises(ValueError, match="lm_head_grad_dtype"):
    type(cfg)(**{**cfg.__dict__, "lm_head_grad_dtype": "fp8"})
  with pytest.raises(ValueError, match="grad_dtype"):
    chunked_cross_entropy(jnp.ones((1, 4, 8)), jnp.ones((8, 5)), jnp.zeros((1, 4), jnp.int32),
                          jnp.ones((1, 4)), chunk_size=4, grad_dtype="float32")


def test_loss_fn_passes_the_field_to_the_head():
  """Through `loss_fn`: the same loss, the head's gradient within bf16 size of fp32's."""
  import dataclasses

  from flax import nnx

  from sparse_lm.model.loss import loss_fn
  from sparse_lm.model.transformer import Transformer

  base = dataclasses.replace(get_preset("tiny"), dtype="bfloat16", loss_chunk_size=16,
                             num_layers=5)
  rng = np.random.default_rng(3)
  batch = {"tokens": jnp.asarray(rng.integers(0, base.vocab_size, (2, 32)), jnp.int32)}
  out = {}
  for gd in (None, "bfloat16"):
    model = Transformer(dataclasses.replace(base, lm_head_grad_dtype=gd), rngs=nnx.Rngs(0))
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: loss_fn(m, batch)[0]))(model)
    out[gd] = (float(loss), np.asarray(grads.lm_head[...], np.float64))
  assert out[None][0] == out["bfloat16"][0]
  a, b = out[None][1], out["bfloat16"][1]
  rel = np.linalg.norm(a - b) / np.linalg.norm(a)
  assert 0 < rel < 1e-2, rel
