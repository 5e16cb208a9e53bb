"""The Kimi-Linear config variants against references written from the equations (NumPy,
reading only the parameter arrays): SwiGLU, the MoE without latent projection, the low-rank
KDA output gate, MLA without q-LoRA / output gate with its own norm epsilon."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.kda import KDA
from sparse_lm.model.mla import MLA
from sparse_lm.moe import LatentMoE
from sparse_lm.moe.situ_glu import situ_activation

SEED = 7
_call = nnx.jit(lambda m, x: m(x))  # eager calls of these layers take ~10x longer


def _rng():
  print("seed", SEED)
  return np.random.default_rng(SEED)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_swiglu_is_the_unclipped_limit():
  rng = _rng()
  g, u = rng.standard_normal((2, 3, 50)).astype(np.float32) * 6
  got = np.asarray(situ_activation(jnp.asarray(g), jnp.asarray(u), None, None))
  np.testing.assert_allclose(got, _silu(g) * u, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="ffn_activation"):
    get_preset("tiny", ffn_activation="gelu")


def test_moe_without_latent_matches_reference():
  rng = _rng()
  cfg = get_preset("tiny", ffn_activation="swiglu", moe_latent=False, route_scale=2.5,
                   num_shared_experts=1, shared_expert_hidden=48, gmm_backend="ragged_dot")
  moe = LatentMoE(cfg, rngs=nnx.Rngs(SEED))
  assert moe.w_down is None and moe.w_up is None and moe.latent_norm is None
  bias = rng.standard_normal(cfg.num_experts).astype(np.float32) * 0.05
  moe.balancer_bias[...] = jnp.asarray(bias)
  x = rng.standard_normal((2, 5, cfg.d_model)).astype(np.float32)
  y, _ = _call(moe, jnp.asarray(x))
  p = {k: np.asarray(getattr(moe, k)[...]) for k in ("router", "expert_gate", "expert_up",
                                                      "expert_down")}
  xf = x.reshape(-1, cfg.d_model).astype(np.float64)
  s = 1 / (1 + np.exp(-(xf @ p["router"])))
  want = np.zeros_like(xf)
  for n in range(xf.shape[0]):
    top = np.argsort(-(s[n] + bias))[:cfg.experts_per_token]
    gates = s[n, top] / s[n, top].sum() * cfg.route_scale
    for e, gt in zip(top, gates):
      h = _silu(xf[n] @ p["expert_gate"][e]) * (xf[n] @ p["expert_up"][e])
      want[n] += gt * (h @ p["expert_down"][e])
  sh = moe.shared
  want += (_silu(xf @ np.asarray(sh.w_gate[...])) * (xf @ np.asarray(sh.w_up[...]))
           ) @ np.asarray(sh.w_down[...])
  np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.d_model), want, rtol=2e-4,
                             atol=2e-5)


def test_kda_low_rank_output_gate_equals_its_product():
  rng = _rng()
  low = get_preset("tiny", kda_output_gate_rank=8)
  a = KDA(low, rngs=nnx.Rngs(SEED))
  b = KDA(get_preset("tiny"), rngs=nnx.Rngs(SEED + 1))
  for name in ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_g_down", "w_g_up",
               "A_log", "dt_bias", "w_beta", "o_norm", "w_o"):
    getattr(b, name)[...] = getattr(a, name)[...]
  down, up = np.asarray(a.w_og_down[...]), np.asarray(a.w_og_up[...])
  assert down.shape == (low.d_model, 8) and not hasattr(a, "w_og")
  b.w_og[...] = jnp.asarray(np.einsum("dr,rhv->dhv", down, up))
  x = jnp.asarray(rng.standard_normal((1, 20, low.d_model)).astype(np.float32))
  np.testing.assert_allclose(np.asarray(_call(a, x)), np.asarray(_call(b, x)), rtol=1e-5,
                             atol=1e-6)


def test_mla_without_q_lora_and_gate_matches_reference():
  rng = _rng()
  cfg = get_preset("tiny", q_lora_rank=0, mla_output_gate=False, norm_eps=1e-5,
                   mla_norm_eps=1e-3)
  mla = MLA(cfg, rngs=nnx.Rngs(SEED))
  assert not hasattr(mla, "w_dq") and not hasattr(mla, "w_gate")
  mla.kv_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.kv_lora_rank),
                                       jnp.float32)
  T, H, nope, kv = 9, cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
  x = rng.standard_normal((1, T, cfg.d_model)).astype(np.float32) * 0.3
  w = {k: np.asarray(v[...], np.float64) for k, v in
       (("q", mla.w_q), ("dkv", mla.w_dkv), ("ukv", mla.w_ukv), ("o", mla.w_o),
        ("kvn", mla.kv_norm.scale))}
  q = np.einsum("td,dhk->thk", x[0], w["q"])
  c = x[0] @ w["dkv"]
  ckv = _rms(c[:, :kv], w["kvn"], 1e-3)
  kvh = np.einsum("tc,chk->thk", ckv, w["ukv"])
  k = np.concatenate([kvh[..., :nope], np.repeat(c[:, None, kv:], H, 1)], -1)
  v = kvh[..., nope:]
  s = np.einsum("thk,shk->hts", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  pr = np.exp(s - s.max(-1, keepdims=True))
  pr /= pr.sum(-1, keepdims=True)
  o = np.einsum("hts,shv->thv", pr, v)
  want = np.einsum("thv,hvd->td", o, w["o"])
  np.testing.assert_allclose(np.asarray(_call(mla, jnp.asarray(x)))[0], want, rtol=1e-4, atol=1e-5)
