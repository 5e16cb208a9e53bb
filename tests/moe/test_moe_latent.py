"""LatentMoE: grouped-matmul dispatch against the dense reference, zero-token experts,
capacity drops, padding, gradients (ARCHITECTURE §5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import nn
from sparse_lm.moe import dispatch_and_compute
from sparse_lm.moe import latent_moe as lm
from sparse_lm.moe import router
import moe_testlib as T
from tests.model import numpy_layers


_key, _cfg, _make, _fwd, _rel = T.key, T.cfg, T.make, T.fwd, T.rel


def _random_dispatch(key, n=37, e=7, k=3, lat=12, f=20, dead=(2, 5)):
  ks = jax.random.split(key, 6)
  z = jax.random.normal(ks[0], (n, lat))
  # ids drawn from the live experts only; some pairs carry the sentinel id e (dropped).
  live = jnp.array([i for i in range(e) if i not in dead])
  ids = live[jax.random.randint(ks[1], (n, k), 0, live.shape[0])]
  ids = jnp.where(jax.random.uniform(ks[2], (n, k)) < 0.15, e, ids).astype(jnp.int32)
  gates = jax.random.uniform(ks[3], (n, k), minval=0.1)
  params = {"w_gate": 0.3 * jax.random.normal(ks[4], (e, lat, f)),
            "w_up": 0.3 * jax.random.normal(ks[5], (e, lat, f)),
            "w_down": 0.3 * jax.random.normal(ks[0], (e, f, lat))}
  return z, ids, gates, params


# megablox runs in Pallas interpret mode off TPU: the same kernel code, checked here.
@pytest.mark.parametrize("backend", ["ragged_dot", "tokamax", "megablox", "auto"])
def test_dispatch_matches_dense_reference(backend):
  z, ids, gates, params = _random_dispatch(_key())
  ref = lm.dense_reference(z, ids, gates, params)
  out, metrics = jax.jit(lambda *a: dispatch_and_compute(*a, backend=backend))(z, ids, gates,
                                                                             params)
  assert metrics == {}  # one program: no exchange
  assert out.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(ref))) > 0.1
  assert _rel(out, ref) < 1e-5
  # Tokens whose pairs are all dropped get exactly zero.
  all_dropped = np.asarray(jnp.all(ids == 7, axis=1))
  np.testing.assert_array_equal(np.asarray(out)[all_dropped], 0.0)


@pytest.mark.parametrize("backend", ["ragged_dot", "megablox"])
def test_dispatch_gradients_match_dense_reference(backend):
  z, ids, gates, params = _random_dispatch(_key())
  w = jax.random.normal(_key(), (z.shape[0], z.shape[1]))

  def loss(fn, z, gates, params):
    return jnp.sum(w * fn(z, ids, gates, params))

  g_ref = jax.grad(lambda *a: loss(lm.dense_reference, *a), argnums=(0, 1, 2))(z, gates, params)
  fast = lambda *a: lm.sorted_dispatch(*a, backend=backend)
  g_out = jax.jit(jax.grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2)))(z, gates, params)
  for a, b in zip(jax.tree.leaves(g_out), jax.tree.leaves(g_ref)):
    assert _rel(a, b) < 1e-5


def test_save_kda_experts_policy_keeps_the_grouped_matmuls_out_of_the_recompute():
  """remat_policy "save_kda_experts" (sparse_lm.nn) saves the routed experts' three
  grouped-matmul outputs: under jax.checkpoint, value_and_grad runs 3 fewer grouped matmuls
  than under "full" (no recompute of the forward's three), with the same value and gradients."""
  from tests import jaxpr_testlib  # pylint: disable=g-import-not-at-top
  z, ids, gates, params = _random_dispatch(_key())
  w = jax.random.normal(_key(), (z.shape[0], z.shape[1]))
  fn = lambda z, gates, params: jnp.tanh(lm.sorted_dispatch(z, ids, gates, params,
                                                            backend="ragged_dot"))

  def run(policy):
    f = jax.checkpoint(fn, policy=nn.remat_policy(policy))
    step = jax.value_and_grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))
    mms = jaxpr_testlib.live_calls(jax.make_jaxpr(step)(z, gates, params),
                                   jaxpr_testlib.primitive_named("ragged_dot_general"))
    return jax.jit(step)(z, gates, params), len(mms)

  ((l_full, g_full), n_full), ((l_save, g_save), n_save) = run("full"), run("save_kda_experts")
  assert n_full - n_save == 3, (n_full, n_save)
  np.testing.assert_allclose(float(l_full), float(l_save), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_save)):
    assert float(jnp.max(jnp.abs(a))) > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["ragged_dot", "tokamax"])
def test_module_matches_dense_backend_with_dead_experts(backend):
  seed = T.seed()
  m_fast = _make(_cfg(gmm_backend=backend), seed)
  m_ref = _make(_cfg(gmm_backend="dense"), seed)
  # Experts 1 and 6 can never be selected: they receive zero tokens.
  for m in (m_fast, m_ref):
    m.balancer_bias[...] = jnp.zeros((8,)).at[1].set(-10.0).at[6].set(-10.0)
  x = jax.random.normal(_key(), (2, 16, 32))
  y_fast, aux_fast = _fwd(m_fast, x)
  y_ref, aux_ref = _fwd(m_ref, x)
  assert _rel(y_fast, y_ref) < 1e-5
  assert float(aux_fast["load"][1]) == 0 and float(aux_fast["load"][6]) == 0
  assert float(aux_fast["dead_frac"]) == pytest.approx(2 / 8)
  assert float(aux_fast["load"].sum()) == 2 * 16 * 2
  np.testing.assert_array_equal(aux_fast["load"], aux_ref["load"])
  lo = np.asarray(aux_fast["load"])
  assert float(aux_fast["max_violation"]) == pytest.approx(lo.max() / lo.mean())
  assert float(aux_fast["drop_rate"]) == 0.0 and float(aux_fast["aux_loss"]) == 0.0


def test_module_matches_numpy_forward():
  """The layer (router on the full width with a balancing bias, gates from the unbiased
  scores times route_scale, latent SiTU-GLU experts, fp32 RMSNorm, W_up, shared experts)
  against the fp64 NumPy forward of ARCHITECTURE §5 (tests/model/numpy_layers.py), with
  weights large enough that the SiTU soft clips bend (|g|, |u| ~ 3): swapping beta1 and
  beta2 moves the output by far more than the tolerance."""
  seed = T.seed()
  m = _make(_cfg(), seed)
  rng = np.random.default_rng(seed)
  normal = lambda shape, std: jnp.asarray(rng.standard_normal(shape) * std, jnp.float32)
  D, L = 32, 16
  m.w_down[...] = normal(m.w_down.shape, D ** -0.5)
  m.expert_gate[...] = normal(m.expert_gate.shape, 3 * L ** -0.5)
  m.expert_up[...] = normal(m.expert_up.shape, 3 * L ** -0.5)
  m.expert_down[...] = normal(m.expert_down.shape, 0.2)
  m.shared.w_gate[...] = normal(m.shared.w_gate.shape, 3 * D ** -0.5)
  m.shared.w_up[...] = normal(m.shared.w_up.shape, 3 * D ** -0.5)
  m.latent_norm[...] = 1.0 + normal((L,), 0.1)
  m.balancer_bias[...] = normal((8,), 0.3)
  x = jax.random.normal(jax.random.key(seed), (2, 16, D))
  y, _ = _fwd(m, x)
  p = {n: np.asarray(getattr(m, n)[...], np.float64) for n in (
      "router", "balancer_bias", "w_down", "expert_gate", "expert_up", "expert_down",
      "latent_norm", "w_up")}
  for n in ("gate", "up", "down"):
    p[f"shared_{n}"] = np.asarray(getattr(m.shared, f"w_{n}")[...], np.float64)
  kw = dict(k=2, route_scale=2.5, eps=1e-6)
  ref = numpy_layers.latent_moe_layer(p, np.asarray(x, np.float64), beta1=4.0, beta2=25.0, **kw)
  assert _rel(y, ref) < 1e-5
  swapped = numpy_layers.latent_moe_layer(p, np.asarray(x, np.float64), beta1=25.0, beta2=4.0,
                                          **kw)
  assert _rel(swapped, ref) > 1e-2  # the test can tell the two clips apart


def test_capacity_keep_constructed_case():
  # Two rows of 4 tokens (positions 0-3 each), E = 3, k = 1, capacity 3; token 7 is padding
  # (sentinel 3). Expert 0 is chosen at positions 0 (tokens 0, 4) and 1 (tokens 1, 5).
  ids = jnp.array([[0], [0], [1], [2], [0], [0], [2], [3]], jnp.int32)
  margin = jnp.array([[0.5], [0.1], [0.3], [0.9], [0.2], [0.9], [0.4], [1.0]])
  positions = jnp.array([0, 1, 2, 3, 0, 1, 2, 3], jnp.int32)
  keep = lm.capacity_keep(ids, margin, positions, capacity=3, num_experts=3)
  # Expert 0 keeps both position-0 pairs whatever their margins (0.5, 0.2), then one slot is
  # left at position 1: the higher margin (token 5: 0.9) takes it, token 1 (0.1) is dropped.
  np.testing.assert_array_equal(np.asarray(keep[:, 0]),
                                [True, False, True, True, True, True, True, False])
  # Earlier positions first: a later token never evicts an earlier one, however large its
  # margin (capacity 1: token 0 at position 0 keeps the slot against token 5's 0.9).
  keep = lm.capacity_keep(ids, margin, positions, capacity=1, num_experts=3)
  assert bool(keep[0, 0]) and not bool(keep[5, 0]) and not bool(keep[4, 0])


def test_module_capacity_drop_rate():
  m = _make(_cfg(capacity_factor=1.0))
  skew = jnp.array([0.6, 0.3, 0.0, -0.2, 0.1, -0.1, 0.0, 0.05])
  m.balancer_bias[...] = skew  # expert 0 (and 1) overflow
  x = jax.random.normal(_key(), (2, 16, 32))
  valid = jnp.ones((2, 16), bool).at[1, 12:].set(False)
  y, aux = _fwd(m, x, valid)
  load = np.asarray(aux["load"])
  assert load.sum() == 28 * 2  # the 4 padding tokens are not counted
  cap = lm.expert_capacity(32, 2, 8, 1.0)  # the cap counts padding slots: 8
  assert cap == 8
  expect = np.maximum(load - cap, 0).sum() / load.sum()
  assert expect > 0.1
  assert float(aux["drop_rate"]) == pytest.approx(expect)
  # The output is the layer with the dropped pairs removed (their gates are not renormalised).
  xf = x.reshape(-1, 32)
  rt = router.route(router.router_scores(xf, m.router[...]), skew, 2, m.route_scale)
  ids = jnp.where(valid.reshape(-1, 1), rt.expert_ids, 8)
  positions = jnp.tile(jnp.arange(16, dtype=jnp.int32), 2)
  keep = lm.capacity_keep(ids, rt.margin, positions, cap, 8)
  assert int((~keep & (ids < 8)).sum()) == round(expect * 56)
  u = lm.dense_reference(xf @ m.w_down[...], jnp.where(keep, ids, 8), rt.gates,
                         m.expert_params())
  u = nn.rms_norm(u, m.latent_norm[...], 1e-6)
  expect_y = u @ m.w_up[...] + m.shared(xf)
  assert _rel(y.reshape(-1, 32), expect_y) < 1e-5
  # ...which differs from the dropless layer.
  m_free = _make(_cfg(), 0)
  nnx.update(m_free, nnx.state(m))
  y_free, aux_free = _fwd(m_free, x, valid)
  assert float(aux_free["drop_rate"]) == 0.0
  assert _rel(y_free, y) > 1e-3


def test_padding_tokens_do_not_affect_valid_outputs_or_load():
  m = _make(_cfg())
  x = jax.random.normal(_key(), (2, 16, 32))
  valid = jnp.ones((2, 16), bool).at[0, 11:].set(False)
  x2 = x.at[0, 11:].set(100.0 * jax.random.normal(_key(), (5, 32)))
  y1, a1 = _fwd(m, x, valid)
  y2, a2 = _fwd(m, x2, valid)
  np.testing.assert_allclose(y1[valid], y2[valid], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(a1["load"], a2["load"])
  assert float(a1["load"].sum()) == 27 * 2


def test_bfloat16_compute():
  m = _make(_cfg(dtype="bfloat16"), 0)
  m_ref = _make(_cfg(dtype="float32", gmm_backend="dense"), 0)
  # The reference sees the same bf16-rounded input, so both route identically (no tie flips).
  x = jax.random.normal(_key(), (2, 16, 32)).astype(jnp.bfloat16)
  y, _ = _fwd(m, x)
  y_ref, _ = _fwd(m_ref, x.astype(jnp.float32))
  assert y.dtype == jnp.bfloat16
  assert _rel(y.astype(jnp.float32), y_ref) < 3e-2


def test_gradients_reach_every_param_and_not_the_bias():
  m = _make(_cfg())
  x = jax.random.normal(_key(), (2, 16, 32))
  w = jax.random.normal(_key(), (2, 16, 32))

  def loss(model):
    y, aux = model(x, train=True)
    return jnp.sum(w * y) + aux["aux_loss"]

  grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param)))(m)
  flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(grads)}
  expected = {"router", "w_down", "w_up", "latent_norm", "expert_gate", "expert_up",
              "expert_down", "shared/w_gate", "shared/w_up", "shared/w_down"}
  assert set(flat) == expected
  for name, g in flat.items():
    assert float(jnp.max(jnp.abs(g[...]))) > 0, name
  # The router gets its gradient through the gates only; no gradient reaches the bias.
  s = jax.nn.sigmoid(jax.random.normal(_key(), (64, 8)))
  gb = jax.grad(lambda b: jnp.sum(router.route(s, b, 2).gates ** 2))(jnp.zeros(8))
  np.testing.assert_array_equal(gb, 0.0)
  gs = jax.grad(lambda s: jnp.sum(router.route(s, jnp.zeros(8), 2).gates ** 2))(s)
  assert float(jnp.max(jnp.abs(gs))) > 0
