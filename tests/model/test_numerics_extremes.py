"""Numerics at the extremes (issue 12.5): every routing, gating and normalisation path stays
finite, forward and gradient, for router logits from -1e4 to +1e4 and any balancing bias, in
fp32 and bf16; the same for the auxiliary-loss balancer. (Before the fix a token whose router
logits were all below about -104 got gates 0/0 = NaN, and so did the aux loss.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.kda.gate import kda_gate
from sparse_lm import nn
from sparse_lm.moe import balancing, router, update_balancers
from sparse_lm.moe.situ_glu import situ_activation
from tests.moe import moe_testlib as T

N, E, K = 24, 8, 2
BIASES = {"zero": 0.0, "1e4": 1e4, "1e30": 1e30}


def _finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32))))
             for x in jax.tree.leaves(tree))


def _logits(seed: int) -> np.ndarray:
  """[N, E] router logits spanning -1e4..1e4: random magnitudes, an all -1e4 token, an all
  +1e4 token, and ties."""
  rng = np.random.default_rng(seed)
  logits = rng.uniform(-1, 1, (N, E)) * 10.0 ** rng.integers(0, 5, (N, 1))
  logits[0], logits[1], logits[2] = -1e4, 1e4, 0.0
  return logits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bias_scale", list(BIASES))
def test_routing_and_balancer_updates_are_finite(dtype, bias_scale):
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  rng = np.random.default_rng(seed)
  x = jnp.eye(E, dtype=dtype)[rng.integers(0, E, N)] * 0 + jnp.asarray(_logits(seed), dtype)
  w = jnp.eye(E, dtype=jnp.float32)  # logits = x W = x
  bias = jnp.asarray(rng.uniform(-1, 1, E) * BIASES[bias_scale], jnp.float32)
  weight = jnp.ones((N,), jnp.float32).at[3].set(0.0)

  def loss(x, w):
    s = router.router_scores(x, w)
    rt = router.route(s, bias, K, route_scale=2.5)
    load = balancing.expert_load(rt.expert_ids, weight, E)
    aux = balancing.switch_aux_loss(s, load, weight, K)
    return jnp.sum(rt.gates * jnp.arange(K)) + aux, (s, rt, load, aux)

  (value, (s, rt, load, aux)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
  assert _finite((value, s, rt, aux, grads)), (value, rt.gates, aux)
  assert float(jnp.max(jnp.abs(jnp.sum(rt.gates, -1) - 2.5))) < 1e-5  # every token: sums to 2.5
  lo, hi = balancing.histogram_range(bias)
  hist = balancing.required_bias_histogram(router.required_bias(s, rt.cutoff), weight, lo, hi,
                                           64)
  assert float(jnp.sum(hist)) == (N - 1) * E  # every valid (token, expert) pair counted once
  for new in (balancing.quantile_bias_update(hist, lo, hi, K, E),
              balancing.bias_sign_update(load, bias, 1e-3)):
    assert _finite(new)
  assert _finite(balancing.load_metrics(load))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("balancer", ["quantile", "aux_loss"])
def test_moe_layer_forward_gradient_and_balancer_update_are_finite(dtype, balancer):
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  m = T.make(T.cfg(dtype=dtype, balancer=balancer), seed)
  rng = np.random.default_rng(seed)
  # Router logits of order 1e4 (x ~ N(0, 1) and entries of 2e3), biases of 1e4; one token
  # with every logit at -1e4 and one with every logit at +1e4.
  w = rng.normal(size=m.router[...].shape) * 2e3
  w[0] = 2e3
  m.router[...] = jnp.asarray(w, jnp.float32)
  m.balancer_bias[...] = jnp.asarray(rng.uniform(-1e4, 1e4, E), jnp.float32)
  x = rng.normal(size=(2, 16, T.D))
  x[0, :2] = 0.0
  x[0, 0, 0], x[0, 1, 0] = -5.0, 5.0
  x = jnp.asarray(x, jnp.dtype(dtype))

  def loss(m, x):
    y, aux = m(x, train=True)
    return jnp.sum(y.astype(jnp.float32)) + aux["aux_loss"], (y, aux)

  (value, (y, aux)), (grads, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
  assert _finite((value, y, aux, gx)) and _finite(nnx.state(grads, nnx.Param))
  if balancer == "aux_loss":
    assert float(aux["aux_loss"]) > 0
  metrics = update_balancers(m)
  assert _finite(metrics) and _finite(m.balancer_bias[...])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gates_and_norms_are_finite_at_extreme_inputs(dtype):
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  rng = np.random.default_rng(seed)
  big = jnp.asarray(rng.uniform(-1, 1, (4, 2, 16)) * 1e4, dtype).at[0].set(0).at[1, 0].set(1e4)
  a_log = jnp.asarray([-10.0, 5.0], jnp.float32)
  dt_bias = jnp.asarray(rng.uniform(-1e4, 1e4, 32), jnp.float32)
  for bound in (-5.0, None):
    g, grads = jax.value_and_grad(
        lambda z, a, d: jnp.sum(kda_gate(z, a, d, gate_lower_bound=bound)), (0, 1, 2))(
            big, a_log, dt_bias)
    assert _finite((g, grads)), bound
  paths = {
      "situ": lambda v: situ_activation(v, -v),
      "sigmoid output gate": lambda v: jax.nn.sigmoid(v.astype(jnp.float32)) * v,
      "rms_norm": lambda v: nn.rms_norm(v, jnp.ones((16,), v.dtype)),
      "l2_norm": lambda v: nn.l2_norm(v),
  }
  for name, fn in paths.items():
    out, grad = jax.value_and_grad(lambda v: jnp.sum(fn(v).astype(jnp.float32)))(big)
    assert _finite((out, grad)), name
