"""GRPO: advantages, the clipped token-level loss and its gradient against NumPy references,
masking. (The train step itself: test_grpo_learns.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import grpo
from sparse_lm.rl.rollout import Episode
from sparse_lm.train.state import split_model

SEED = 0
# 3 layers (KDA, MLA, MLA), one MoE, the standard residual: the quickest model to compile (the
# references below read only the logits, or the final hidden states and the LM head)
SMALL = {"num_layers": 3, "mla_every": 2, "residual": "standard", "num_dense_layers": 2}


@pytest.fixture(scope="module")
def model():
  print("seed", SEED)
  return Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(SEED))


def _episodes(rng, n, vocab, length=21):
  eps = []
  for _ in range(n):
    L = int(rng.integers(length // 2, length))
    gen = rng.random(L) < 0.6
    gen[:3] = False
    eps.append(Episode(tokens=rng.integers(8, vocab, L).tolist(), generated=gen.tolist(),
                       logprobs=(np.where(gen, -rng.random(L) * 3, 0.0)).tolist()))
  return eps


def test_group_advantages():
  adv = grpo.group_advantages([1, 0, 0, 1, 1, 1], 3)
  r = np.array([1, 0, 0]); expect = (r - r.mean()) / (r.std() + 1e-6)
  np.testing.assert_allclose(adv[:3], expect, rtol=1e-5)
  np.testing.assert_allclose(adv[3:], 0.0)
  np.testing.assert_allclose(grpo.group_advantages([2, 0], 2, scale_by_std=False), [1, -1])
  with pytest.raises(ValueError, match="group_size=4"):
    grpo.group_advantages([1, 2, 3], 4)


def _reference_loss(model, batch, cfg):
  """Written from the equations with full logits in numpy; the policy is softmax(logits / T)."""
  logits = np.asarray(model(jnp.asarray(batch["tokens"]),
                            segment_ids=jnp.asarray(batch["segment_ids"])), np.float64)
  logits = logits / cfg.temperature
  logp_all = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                             keepdims=True)) - logits.max(-1, keepdims=True)
  B, T = batch["tokens"].shape
  num = den = kl_num = 0.0
  for b in range(B):
    for t in range(T - 1):
      if not (batch["loss_mask"][b, t + 1] and batch["segment_ids"][b, t + 1]):
        continue
      lp = logp_all[b, t, batch["tokens"][b, t + 1]]
      rho = np.exp(lp - batch["old_logprobs"][b, t + 1])
      a = batch["advantages"][b]
      num += -min(rho * a, np.clip(rho, 1 - cfg.clip_low, 1 + cfg.clip_high) * a)
      d = batch["ref_logprobs"][b, t + 1] - lp
      kl_num += np.exp(d) - d - 1
      den += 1
  return num / den, kl_num / den


def test_loss_matches_reference_and_masks_tool_output(model):
  rng = np.random.default_rng(SEED)
  eps = _episodes(rng, 4, model.cfg.vocab_size)
  batch = grpo.episodes_to_batch(eps, rng.normal(size=4), seq_len=24)
  batch["ref_logprobs"] = batch["old_logprobs"] + rng.normal(size=batch["old_logprobs"].shape
                                                             ).astype(np.float32) * 0.3
  cfg = grpo.GRPOConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, temperature=0.7)
  jb = {k: jnp.asarray(v) for k, v in batch.items()}
  loss, metrics = grpo.grpo_loss_fn(model, jb, train=False, cfg=cfg)
  policy, kl = _reference_loss(model, batch, cfg)
  np.testing.assert_allclose(float(metrics["loss"]), policy, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(metrics["kl"]), kl, rtol=1e-4, atol=1e-6)
  assert float(metrics["num_tokens"]) == sum(
      sum(e.generated[1:]) for e in eps)
  # tool-output (ungenerated) positions never enter the loss
  poked = dict(batch)
  poked["old_logprobs"] = np.where(batch["loss_mask"] > 0, batch["old_logprobs"], 5.0)
  _, m2 = grpo.grpo_loss_fn(model, {k: jnp.asarray(v) for k, v in poked.items()},
                            train=False, cfg=cfg)
  assert float(m2["loss"]) == float(metrics["loss"])


def _log_softmax(x):
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _reference_lm_head_grad(h, w, batch, cfg):
  """d L / d lm_head written from the policy-gradient equations in float64 NumPy: for each
  model-written target y_t (predicted at position t from the final hidden state h_t),
  d log p_T(y_t) / d W = h_t (e_{y_t} - softmax(h_t W / T))^T / T, and the loss's derivative in
  log p_T(y_t) is c_t = -A rho_t [the ratio is not clipped against A] + beta (1 - exp(ref_t -
  log p_t)); the sum of c_t d log p_t / d W over the batch's model-written tokens is divided by
  their count."""
  T = cfg.temperature
  logp_all = _log_softmax(h @ w / T)  # [B, S, V]
  grad, n = np.zeros_like(w), 0
  B, S = batch["tokens"].shape
  for b in range(B):
    a = float(batch["advantages"][b])
    for t in range(S - 1):
      if not (batch["loss_mask"][b, t + 1] and batch["segment_ids"][b, t + 1]):
        continue
      y = batch["tokens"][b, t + 1]
      lp = logp_all[b, t, y]
      rho = np.exp(lp - batch["old_logprobs"][b, t + 1])
      clipped = (a > 0 and rho > 1 + cfg.clip_high) or (a < 0 and rho < 1 - cfg.clip_low)
      c = -a * rho * (not clipped)
      c += cfg.kl_coef * (1.0 - np.exp(batch["ref_logprobs"][b, t + 1] - lp))
      dlogits = -np.exp(logp_all[b, t])
      dlogits[y] += 1.0
      grad += c * np.outer(h[b, t], dlogits) / T
      n += 1
  return grad / n


def test_gradient_matches_numpy_reference():
  """The GRPO loss's gradient in the LM head against the policy-gradient formula (advantage
  broadcast to every written token, the loss mask's alignment, the 1 / token-count
  normalisation, the temperature, the clip and the KL term), on random ratios of which some are
  clipped; a second batch with every ratio clipped (and no KL) has exactly zero gradient.
  One compiled program gives the gradient, the loss's metrics and the final hidden states."""
  print("seed", SEED + 1)
  model = Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(SEED + 1))
  rng = np.random.default_rng(SEED + 1)
  eps = _episodes(rng, 4, model.cfg.vocab_size)
  batch = grpo.episodes_to_batch(eps, [1.3, -0.7, 0.4, -1.1], seq_len=24)
  batch["ref_logprobs"] = batch["old_logprobs"]
  cfg = grpo.GRPOConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, temperature=0.7)
  graphdef, params, rest = split_model(model)

  @jax.jit
  def probe(p, r, b, kl_coef):
    """(d(policy + kl_coef KL) / d params, the loss's metrics, final hidden states [B, S, D])."""
    c = dataclasses.replace(cfg, kl_coef=1.0)  # the KL term is built; kl_coef scales it
    def loss(p):
      _, m = grpo.grpo_loss_fn(nnx.merge(graphdef, p, r, copy=True), b, train=True, cfg=c)
      return m["loss"] + kl_coef * m["kl"], m
    g, m = jax.grad(loss, has_aux=True)(p)
    h, _ = nnx.merge(graphdef, p, r, copy=True).forward_hidden(
        b["tokens"], segment_ids=b["segment_ids"])
    return g, m, h

  def run(b, kl_coef):
    return probe(params, rest, {k: jnp.asarray(v) for k, v in b.items()}, kl_coef)

  _, _, h = run(batch, cfg.kl_coef)  # the hidden states do not depend on the log-prob inputs
  h, w = np.asarray(h, np.float64), np.asarray(model.lm_head[...], np.float64)
  logp_all = _log_softmax(h @ w / cfg.temperature)
  lp = np.zeros(batch["tokens"].shape, np.float32)  # log p_T(token t), aligned with tokens
  lp[:, 1:] = np.take_along_axis(logp_all[:, :-1], batch["tokens"][:, 1:, None], -1)[..., 0]
  noise = lambda: rng.normal(size=lp.shape).astype(np.float32) * 0.3  # pylint: disable=unnecessary-lambda-assignment
  batch["old_logprobs"], batch["ref_logprobs"] = lp + noise(), lp + noise()
  grads, m, _ = run(batch, cfg.kl_coef)
  g = np.asarray(jax.tree.leaves(grads["lm_head"])[0], np.float64)
  ref = _reference_lm_head_grad(h, w, batch, cfg)
  assert 0.1 < float(m["clip_frac"]) < 0.9, float(m["clip_frac"])  # both branches exercised
  assert np.linalg.norm(g - ref) / np.linalg.norm(ref) < 1e-4, (
      np.linalg.norm(g - ref) / np.linalg.norm(ref))
  # every ratio = e > 1 + clip_high with A > 0 (and no KL): no gradient at all
  allclip = dict(batch, advantages=np.ones(4, np.float32), old_logprobs=lp - 1.0)
  grads, _, _ = run(allclip, 0.0)
  assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads)) == 0.0
