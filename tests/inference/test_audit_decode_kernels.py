"""Audit of pallas_kernels/decode (Pallas interpret mode on the CPU): the fused decode kernels
against independent float64 NumPy references written from their documented equations
(ARCHITECTURE.md §2.1-§2.3 and §4), never from the pure-JAX decode path they are otherwise
compared with (tests/inference/test_fused_decode.py). The pure-JAX path shares the config's
epsilons with the kernel and runs at O(1) activations, so a kernel that dropped the q/k L2-norm
epsilon, or used one RMSNorm epsilon for the other, matched it; here the epsilons are distinct
and the activations small enough for each to matter. The AttnRes read is also run with the
partial block sum not yet a source (partial_valid False), which no other test of the kernel
did (a kernel that always mixed it in passed), and the routed-experts kernel on exact score
ties (the documented lowest-index rule).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode import attnres_mix, kda_step

SEED = 2024


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
  return x * _sigmoid(x)


def _rel(ref, out):
  ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
  return np.linalg.norm(ref - out) / np.linalg.norm(ref)


def _np_kda_step(S, xw, cols, tails, conv, z, A_log, dt_bias, og, o_norm, active, *, scale,
                 gate_lower_bound, l2_eps, norm_eps, R):
  """One token per row: short conv over [tail, x], SiLU, L2 norm (eps inside the sqrt) of q
  and k, the gate, sigmoid beta, the delta rule, readout, per-head RMSNorm * o_norm * sigmoid
  output gate. Idle rows (active 0): g = 0, beta = 0, tails kept."""
  B, H, K, V = S.shape
  W = conv["q"].shape[0]
  y = np.zeros((R, H, V))
  S_new = S.copy()
  tails_new = {n: t.copy() for n, t in tails.items()}
  for b in range(B):
    for h in range(H):
      feats = {}
      for n, d in (("q", K), ("k", K), ("v", V)):
        sl = slice(h * d, (h + 1) * d)
        taps = [tails[n][b, i, sl] for i in range(W - 1)] + [xw[b, cols[n] + h * d:
                                                                cols[n] + (h + 1) * d]]
        c = sum(conv[n][j, h] * taps[j] for j in range(W))
        f = _silu(c)
        if n != "v":
          f = f / np.sqrt(np.sum(f * f) + l2_eps)
        feats[n] = f
        if active[b]:
          for i in range(W - 1):
            tails_new[n][b, i, sl] = taps[i + 1]
      xg = z[b, h * K:(h + 1) * K] + dt_bias[h * K:(h + 1) * K]
      a = np.exp(A_log[h])
      if gate_lower_bound is None:
        g = -a * np.log1p(np.exp(xg))
      else:
        g = gate_lower_bound * _sigmoid(a * xg)
      beta = _sigmoid(xw[b, cols["beta"] + h])
      if not active[b]:
        g, beta = np.zeros_like(g), 0.0
      q, k, v = feats["q"], feats["k"], feats["v"]
      St = np.exp(g)[:, None] * S[b, h]
      Sn = St + beta * np.outer(k, v - St.T @ k)
      S_new[b, h] = Sn
      o = Sn.T @ (scale * q)
      o = o / np.sqrt(np.mean(o * o) + norm_eps) * o_norm
      y[b, h] = o * _sigmoid(og[b, h * V:(h + 1) * V])
  return y, S_new, tails_new


@pytest.mark.parametrize("regime", ["unit", "small"])
@pytest.mark.parametrize("gate_lower_bound", [-5.0, None])
def test_kda_step_matches_numpy_step(regime, gate_lower_bound):
  """3 rows (row 1 idle) + 1 padding row, H = 2, K = 16, V = 32, conv width 4, l2_eps 1e-6,
  norm_eps 1e-5. "small": q/k/v projections, tails and state at ~1e-3, where both epsilons
  change the result by more than the tolerance."""
  rng = np.random.default_rng(SEED)
  B, R, H, K, V, W = 3, 4, 2, 16, 32, 4
  amp = 1.0 if regime == "unit" else 1e-3
  cols = {"q": 0, "k": H * K, "v": 2 * H * K, "beta": 2 * H * K + H * V}
  N = cols["beta"] + H + 3  # a few unrelated columns at the end
  xw = rng.standard_normal((R, N))
  xw[:, :cols["beta"]] *= amp
  tails = {n: rng.standard_normal((B, W - 1, H * d)) * amp
           for n, d in (("q", K), ("k", K), ("v", V))}
  conv = {n: rng.standard_normal((W, H, d)) * 0.5 for n, d in (("q", K), ("k", K), ("v", V))}
  z = rng.standard_normal((R, H * K))
  A_log = rng.standard_normal(H) * 0.5
  dt_bias = rng.standard_normal(H * K) * 0.5
  og = rng.standard_normal((R, 5 + H * V))
  o_norm = rng.uniform(0.5, 1.5, V)
  S = rng.standard_normal((B, H, K, V)) * amp
  active = np.array([1, 0, 1], np.int32)
  kw = dict(scale=K ** -0.5, gate_lower_bound=gate_lower_bound, l2_eps=1e-6, norm_eps=1e-5)
  ref_y, ref_S, ref_t = _np_kda_step(S, xw, cols, tails, conv, z, A_log, dt_bias, og[:, 5:],
                                     o_norm, active, R=R, **kw)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  y, S_out, t_out = kda_step(
      f32(S), f32(xw), cols, {n: f32(t) for n, t in tails.items()},
      {n: f32(c) for n, c in conv.items()}, f32(z), f32(A_log), f32(dt_bias), f32(og),
      f32(o_norm), jnp.asarray(active), dtype=jnp.float32, og_col=5, interpret=True, **kw)
  assert np.std(ref_y[:B]) > 1e-3
  assert _rel(ref_y, y) < 1e-5, _rel(ref_y, y)
  assert _rel(ref_S, S_out) < 1e-5, _rel(ref_S, S_out)
  for n in ("q", "k", "v"):
    np.testing.assert_allclose(np.asarray(t_out[n]), ref_t[n], rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(y[B:]), 0.0)


def _np_attnres_mix(stack, valid, partial, pvalid, query, norm_scale, y, mix_eps, norm_eps):
  """p = partial + y; l_j = w . RMSNorm(s_j) (mix_eps; -inf unless valid), l_p likewise for p;
  x = RMSNorm(sum_j softmax(l)_j s_j) (norm_eps) * norm_scale."""
  rms = lambda x, eps: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  p = partial + y
  srcs = [stack[j] for j in range(stack.shape[0]) if valid[j]] + ([p] if pvalid else [])
  s = np.stack(srcs)  # [n, B, D]
  logits = rms(s, mix_eps) @ query  # [n, B]
  a = np.exp(logits - logits.max(0))
  a /= a.sum(0)
  h = np.sum(a[..., None] * s, 0)
  return rms(h, norm_eps) * norm_scale, p


@pytest.mark.parametrize("pvalid", [True, False])
def test_attnres_mix_matches_numpy_with_distinct_epsilons(pvalid):
  """Sources at RMS ~1e-2 with mix_eps 1e-5 (keys) and norm_eps 1e-3 (pre-norm): each epsilon
  changes the result, so using one for the other is visible. 3 of 4 slots valid; rows = 4
  (two zero rows past B = 2)."""
  rng = np.random.default_rng(SEED + 1)
  N, B, D = 4, 2, 32
  stack = rng.standard_normal((N, B, D)) * rng.uniform(0.5, 2.0, (N, 1, 1)) * 1e-2
  valid = np.array([1, 1, 1, 0], np.int32)
  partial = rng.standard_normal((B, D)) * 1e-2
  y = rng.standard_normal((B, D)) * 1e-2
  query = rng.standard_normal(D) * 2.0
  norm_scale = rng.uniform(0.5, 1.5, D)
  mix_eps, norm_eps = 1e-5, 1e-3
  ref_x, ref_p = _np_attnres_mix(stack, valid, partial, pvalid, query, norm_scale, y, mix_eps,
                                 norm_eps)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  x, p = attnres_mix(f32(stack), jnp.asarray(valid), f32(partial), jnp.asarray(pvalid),
                     f32(query), f32(norm_scale), y=f32(y), mix_eps=mix_eps, norm_eps=norm_eps,
                     dtype=jnp.float32, rows=4, interpret=True)
  assert x.shape == (4, D)
  assert _rel(ref_x, x[:B]) < 1e-5, _rel(ref_x, x[:B])
  np.testing.assert_allclose(np.asarray(p), ref_p, rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(x[B:]), 0.0)


def _np_situ(z, wg, wu, wd, b1, b2):
  g, u = z @ wg, z @ wu
  return (b1 * np.tanh(g / b1) * _sigmoid(g) * b2 * np.tanh(u / b2)) @ wd


def test_moe_experts_routed_ties_go_to_the_lowest_index():
  """Routing inside the kernel (§5 / §6: s = sigmoid(clipped logits), top k of s + b, gates
  s_sel / sum s_sel * route_scale, 0 for an invalid token) against NumPy, on tokens whose
  scores tie exactly: the documented rule (that of jax.lax.top_k) keeps the lowest expert
  index. Token 0: experts 1, 2, 3 tie for the top; token 1: 0 and 5 tie for second place
  after the bias; token 2 is invalid."""
  rng = np.random.default_rng(SEED + 2)
  E, k, L, F, N = 8, 2, 16, 32, 3
  logits = rng.uniform(-2.0, 0.0, (N, E))
  logits[0, [1, 2, 3]] = 1.5
  bias = np.zeros(E)
  bias[4] = 0.25
  logits[1, 4] = 1.0
  logits[1, [0, 5]] = 0.75
  valid = np.array([1, 1, 0], np.int32)
  params = {"w_gate": rng.standard_normal((E, L, F)) * 0.5,
            "w_up": rng.standard_normal((E, L, F)) * 0.5,
            "w_down": rng.standard_normal((E, F, L)) * 0.5}
  z = rng.standard_normal((N, 4 + L))
  route_scale = 1.7
  s = _sigmoid(np.clip(logits, -40.0, 40.0))
  ref = np.zeros((N, L))
  for n in range(N):
    ids = np.argsort(-(s[n] + bias), kind="stable")[:k]  # ties: lowest index first
    gates = s[n, ids] / s[n, ids].sum() * route_scale * valid[n]
    for e, gt in zip(ids, gates):
      ref[n] += gt * _np_situ(z[n, 4:], params["w_gate"][e], params["w_up"][e],
                              params["w_down"][e], 4.0, 25.0)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  from pallas_kernels.decode import moe_experts_routed
  u = moe_experts_routed(f32(z), f32(logits), f32(bias), jnp.asarray(valid),
                         {n: f32(w) for n, w in params.items()}, k=k, route_scale=route_scale,
                         logit_bound=40.0, beta1=4.0, beta2=25.0, z_col=4, dtype=jnp.float32,
                         block_f=16, interpret=True)
  np.testing.assert_array_equal(np.asarray(u[2]), 0.0)
  assert _rel(ref[:2], u[:2]) < 1e-5, _rel(ref[:2], u[:2])
