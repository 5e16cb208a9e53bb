"""Muon and QK-clip (sparse_lm/train/optimizer.py) against NumPy references written from the
papers: two Muon updates of a random matrix (Newton-Schulz as Jordan et al. write it, optax's
Nesterov momentum with bias correction, Moonlight's RMS matching), the Muon/AdamW split of the
tiny model, and QK-clip bounding each MLA head's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.mla import MLA
from sparse_lm.model.transformer import Transformer
from sparse_lm.train.optimizer import (OptimizerConfig, _path_name, make_optimizer,
                                       muon_dimension_numbers, muon_labels, qk_clip)

NS = (3.4445, -4.775, 2.0315)  # Jordan et al. 2024, the quintic's (a, b, c)


def newton_schulz(g, steps=5, eps=1e-8):
  """Orthogonalise g [m, n] (float64): X = G/||G||_F; X <- aX + (bA + cA^2)X, A = XXᵀ."""
  a, b, c = NS
  x = g.T if g.shape[0] > g.shape[1] else g
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if g.shape[0] > g.shape[1] else x


def adam_reference(grads, b1, b2, eps):
  m = v = 0.0
  out = []
  for t, g in enumerate(grads, 1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    out.append((m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps))
  return out


def test_two_muon_updates_match_numpy_reference():
  seed = 1234
  print("seed", seed)
  rng = np.random.default_rng(seed)
  m, n = 12, 20
  w = rng.normal(size=(m, n)).astype(np.float32)
  s = rng.normal(size=(n,)).astype(np.float32)
  grads = [{"mlp": {"w_up": rng.normal(size=(m, n)).astype(np.float32)},
            "norm": {"scale": rng.normal(size=(n,)).astype(np.float32)}} for _ in range(2)]
  cfg = OptimizerConfig(name="muon", peak_lr=0.02, warmup_steps=0, decay_fraction=0.0,
                        weight_decay=0.1, clip_norm=1e9)
  tx = make_optimizer(cfg, total_steps=10)
  params = {"mlp": {"w_up": jnp.asarray(w)}, "norm": {"scale": jnp.asarray(s)}}
  assert muon_labels(params) == {"mlp": {"w_up": "muon"}, "norm": {"scale": "adamw"}}
  state = tx.init(params)
  beta, lr = cfg.muon_beta, cfg.peak_lr
  mu = np.zeros((m, n))
  w_ref, s_ref = w.astype(np.float64), s.astype(np.float64)
  adam = adam_reference([g["norm"]["scale"].astype(np.float64) for g in grads], cfg.b1, cfg.b2,
                        cfg.eps)
  for t, g in enumerate(grads, 1):
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    gm = g["mlp"]["w_up"].astype(np.float64)
    mu = beta * mu + (1 - beta) * gm  # Nesterov with bias correction (optax's convention)
    nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * gm / (1 - beta ** t)
    o = newton_schulz(nesterov) * cfg.muon_rms * np.sqrt(max(m, n))  # Moonlight RMS match
    w_ref = w_ref - lr * (o + cfg.weight_decay * w_ref)
    s_ref = s_ref - lr * adam[t - 1]  # 1-D: AdamW without decay
    np.testing.assert_allclose(np.asarray(params["mlp"]["w_up"]), w_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(params["norm"]["scale"]), s_ref, rtol=1e-5, atol=1e-6)
  # The update is orthogonal up to NS's spread of singular values (0.5..1.5 of the target).
  sv = np.linalg.svd(o / (cfg.muon_rms * np.sqrt(max(m, n))), compute_uv=False)
  assert 0.5 < sv.min() and sv.max() < 1.5


def test_muon_groups_of_the_tiny_model():
  cfg = get_preset("tiny")
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  _, params, _ = nnx.split(model, nnx.Param, ...)
  dims = {}
  jax.tree_util.tree_map_with_path(
      lambda p, d: dims.__setitem__(_path_name(p), d), muon_dimension_numbers(params),
      is_leaf=lambda x: x is None or hasattr(x, "reduction_axis"))
  labels = {}
  jax.tree_util.tree_map_with_path(lambda p, l: labels.__setitem__(_path_name(p), l),
                                   muon_labels(params))
  adamw = [k for k, l in labels.items() if l == "adamw"]
  muon = [k for k, l in labels.items() if l == "muon"]
  for name in ("embed/embedding", "lm_head", "last/ffn/router", "last/attn_norm/scale",
               "last/mixer/w_gate", "head/layers/2/mixer/w_og", "head/layers/2/mixer/w_beta",
               "head/layers/2/mixer/A_log", "last/attn_query", "final_norm/scale"):
    assert name in adamw, (name, labels.get(name))
  for name in ("last/mixer/w_uq", "last/mixer/w_o", "last/ffn/expert_up",
               "last/ffn/shared/w_gate", "head/layers/2/mixer/w_k", "groups/layers/0/mixer/w_q"):
    assert name in muon, (name, labels.get(name))
  d = lambda k: (dims[k].reduction_axis, dims[k].output_axis)
  assert d("last/mixer/w_uq") == (0, 2)  # [q_lora, H, d]: one matrix per head
  assert d("last/mixer/w_o") == (1, 2)  # [H, v, D]
  assert d("last/ffn/expert_up") == (1, 2)  # [E, latent, hidden]: one per expert
  assert d("groups/layers/0/mixer/w_q") == (1, 3)  # [layers, D, H, d]
  assert d("last/ffn/shared/w_gate") == (0, 1)
  assert all(l in ("muon", "adamw") for l in labels.values()) and len(muon) > 20


def _np_mla_logits(mla, x, cfg):
  """Per-head causal logits [H, B, T, T] (float64) of an MLA (q_lora path) from its params."""
  P = lambda v: np.asarray(v[...], np.float64)
  rms = lambda z, w, eps: z / np.sqrt(np.mean(z * z, -1, keepdims=True) + eps) * w
  eps = cfg.norm_eps if cfg.mla_norm_eps is None else cfg.mla_norm_eps
  x = np.asarray(x, np.float64)
  c_q = rms(x @ P(mla.w_dq), P(mla.q_norm.scale), eps)
  q = np.einsum("btc,chd->bthd", c_q, P(mla.w_uq))
  ckv = x @ P(mla.w_dkv)
  c_kv = rms(ckv[..., :cfg.kv_lora_rank], P(mla.kv_norm.scale), eps)
  k_rope = ckv[..., cfg.kv_lora_rank:]
  k_nope = np.einsum("btc,chd->bthd", c_kv, P(mla.w_ukv)[..., :cfg.qk_nope_head_dim])
  T = q.shape[1]
  k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] +
                                              (cfg.qk_rope_head_dim,))], -1)
  s = np.einsum("bqhd,bkhd->hbqk", q, k) / np.sqrt(cfg.qk_head_dim)
  return np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)


def test_qk_clip_bounds_each_head_and_keeps_the_rest():
  seed = 7
  print("seed", seed)
  cfg = get_preset("tiny", dtype="float32", mla_logit_max=True, mla_num_heads=4)
  mla = MLA(cfg, rngs=nnx.Rngs(seed))
  x = jax.random.normal(jax.random.PRNGKey(seed), (2, 12, cfg.d_model)) * 3.0
  mla.w_uq[...] = mla.w_uq[...] * 40.0  # logits of a few nats, different per head
  mla(x, train=True)
  s_ref = _np_mla_logits(mla, x, cfg).max(axis=(1, 2, 3))
  np.testing.assert_allclose(np.asarray(mla.attn_logit_max[...]), s_ref, rtol=1e-4)
  mla(x * 0.1, train=False)  # evaluation records nothing
  np.testing.assert_allclose(np.asarray(mla.attn_logit_max[...]), s_ref, rtol=1e-4)
  tau = float(np.median(s_ref))
  assert (s_ref > tau).any() and (s_ref <= tau).any()
  w_v = np.asarray(mla.w_ukv[...])[..., cfg.qk_nope_head_dim:]
  w_o = np.asarray(mla.w_o[...])
  before = _np_mla_logits(mla, x, cfg)
  metrics = qk_clip(mla, tau)
  assert float(metrics["attn/max_logit"]) == pytest.approx(s_ref.max(), rel=1e-4)
  assert float(metrics["attn/clipped_heads"]) == (s_ref > tau).sum()
  after = _np_mla_logits(mla, x, cfg)
  np.testing.assert_allclose(after.max(axis=(1, 2, 3)), np.minimum(s_ref, tau), rtol=1e-4)
  keep = s_ref <= tau  # unclipped heads keep every logit; clipped ones are scaled by tau/S_max
  fin = np.isfinite(before)
  scaled = np.where(keep, 1.0, tau / s_ref)[:, None, None, None] * np.where(fin, before, 0)
  np.testing.assert_allclose(np.where(fin, after, 0), scaled, rtol=1e-4, atol=1e-5)
  assert np.array_equal(np.asarray(mla.w_ukv[...])[..., cfg.qk_nope_head_dim:], w_v)
  assert np.array_equal(np.asarray(mla.w_o[...]), w_o)
  assert np.all(np.asarray(mla.attn_logit_max[...]) == 0)


def test_bad_optimizer_name_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"optim.name='sgd'.*muon"):
    make_optimizer(OptimizerConfig(name="sgd"), 10)
  with pytest.raises(ValueError, match="optim.qk_clip_threshold"):
    OptimizerConfig(qk_clip_threshold=0.0).validate()
