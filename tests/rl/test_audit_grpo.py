"""Audit tests of grpo.py against references written from the equations of its module
docstring (DeepSeekMath §4.1; DAPO token-level averaging):

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)                 (population std, per group)
    L   = sum_t m_t [-min(rho_t A, clip(rho_t, 1 - lo, 1 + hi) A) + beta KL_t] / sum_t m_t + aux
    rho_t = exp(logp_t - logp_old_t),  KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

The loss tests run `grpo_loss_fn` on a stand-in model whose logits are a fixed random table (no
Transformer to compile), so every metric it returns is checked in milliseconds."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_lm.rl import grpo
from sparse_lm.rl.rollout import Episode

SEED = 5


def _reference_advantages(rewards, G, scale_by_std, eps):
  out = []
  for g in range(len(rewards) // G):
    group = [float(x) for x in rewards[g * G:(g + 1) * G]]
    mean = sum(group) / G
    std = (sum((x - mean) ** 2 for x in group) / G) ** 0.5
    out += [(x - mean) / (std + eps) if scale_by_std else x - mean for x in group]
  return np.array(out)


@pytest.mark.parametrize("G,eps", [(4, 1e-6), (6, 1e-2)])
def test_group_advantages_standardise_within_each_group(G, eps):
  """Groups of different spreads (one of them tiny: the eps is added to the std, not under a
  square root; each group's own std, not the batch's) and one constant group (advantage 0)."""
  print("seed", SEED)
  rng = np.random.default_rng(SEED + G)
  groups = [rng.random(G), rng.random(G) * 7.0 - 2.0, 0.3 + rng.random(G) * 2e-3,
            np.full(G, rng.random()), (rng.random(G) < 0.5) * 1.0 + 0.2 * (rng.random(G) < 0.3)]
  rewards = np.concatenate(groups)
  for scale in (True, False):
    got = grpo.group_advantages(rewards.tolist(), G, scale_by_std=scale, eps=eps)
    assert got.shape == (len(rewards),) and got.dtype == np.float32
    np.testing.assert_allclose(got, _reference_advantages(rewards, G, scale, eps), rtol=2e-5,
                               atol=1e-6)
  np.testing.assert_array_equal(grpo.group_advantages(rewards, G, eps=eps)[3 * G:4 * G], 0.0)


def test_a_constant_group_gets_exactly_zero_whatever_eps():
  """The float mean of G equal rewards can differ from them by a rounding error (0.7 x 6);
  divided by std + eps with a small eps (> 0, so allowed) that error became an advantage on every
  episode of the group (-0.53 each at eps = 1e-16, -1.1e-4 at 1e-12) instead of 0."""
  rng = np.random.default_rng(SEED + 2)
  other = rng.random(6)
  for eps in (1e-6, 1e-12, 1e-16):
    for scale in (True, False):
      adv = grpo.group_advantages([0.7] * 6 + other.tolist(), 6, scale_by_std=scale, eps=eps)
      np.testing.assert_array_equal(adv[:6], 0.0)
      np.testing.assert_allclose(adv[6:], _reference_advantages(other, 6, scale, eps), rtol=2e-5)


def test_episode_rewards_take_the_larger_of_reward_and_partial_credit():
  rng = np.random.default_rng(SEED + 1)
  eps = [Episode([1], [False], [0.0], reward=float(r), found_answer=bool(f))
         for r, f in zip(np.r_[1.0, 1.0, 0.0, rng.random(9)], np.r_[True, False, True,
                                                                    rng.random(9) < 0.5])]
  for credit in (0.0, 0.3, float(rng.random() * 0.9)):
    expect = [max(e.reward, credit) if e.found_answer else e.reward for e in eps]
    assert grpo.episode_rewards(eps, partial_credit=credit) == pytest.approx(expect, abs=0)


class _TableModel:
  """Stands in for the Transformer in `target_logprobs`: the logits are a fixed table
  [B, T, V], and the MoE aux loss a fixed per-layer vector (summed by the loss)."""

  def __init__(self, logits, aux):
    self.table, self.aux = jnp.asarray(logits, jnp.float32), jnp.asarray(aux, jnp.float32)

  def forward_hidden(self, tokens, *, segment_ids=None, train=False):
    del segment_ids, train
    assert tokens.shape == self.table.shape[:2]
    return self.table, {"aux_loss": self.aux}

  def logits(self, h):
    return h


def _batch(rng, B, T, V):
  """Random episodes of different lengths (prompt, model turns, tool results, padding)."""
  eps = []
  for _ in range(B):
    L = int(rng.integers(T // 2, T + 1))
    gen = rng.random(L) < 0.6
    gen[:2] = False
    eps.append(Episode(tokens=rng.integers(1, V, L).tolist(), generated=gen.tolist(),
                       logprobs=np.where(gen, -rng.random(L) * 2, 0.0).tolist()))
  return grpo.episodes_to_batch(eps, rng.normal(size=B), seq_len=T)


def _reference(logits, batch, cfg, aux):
  """(total loss, policy, kl, mean ratio, clip fraction, token count) from the equations."""
  x = logits.astype(np.float64) / cfg.temperature
  logp = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
      -1, keepdims=True))
  B, T = batch["tokens"].shape
  pol, kl, ratios, clipped = [], [], [], []
  for b in range(B):
    a = float(batch["advantages"][b])
    for t in range(1, T):  # token t, predicted at position t - 1
      if not (batch["loss_mask"][b, t] and batch["segment_ids"][b, t]):
        continue
      lp = logp[b, t - 1, batch["tokens"][b, t]]
      rho = np.exp(lp - float(batch["old_logprobs"][b, t]))
      c = min(max(rho, 1 - cfg.clip_low), 1 + cfg.clip_high)
      pol.append(-min(rho * a, c * a))
      d = float(batch["ref_logprobs"][b, t]) - lp
      kl.append(np.exp(d) - d - 1)
      ratios.append(rho)
      clipped.append(c != rho)
  n = len(pol)
  policy, k = sum(pol) / n, sum(kl) / n
  return (policy + cfg.kl_coef * k + float(np.sum(aux)), policy, k, sum(ratios) / n,
          sum(clipped) / n, n)


@pytest.mark.parametrize("temperature,clip_low,clip_high,kl_coef", [(1.0, 0.2, 0.2, 0.05),
                                                                    (0.6, 0.15, 0.3, 0.3)])
def test_loss_and_every_metric_match_the_equations(temperature, clip_low, clip_high, kl_coef):
  """The returned total loss (policy + beta KL + aux), and the `loss`, `kl`, `ratio` and
  `clip_frac` metrics, all averaged over the model-written tokens of the whole batch."""
  print("seed", SEED)
  rng = np.random.default_rng(SEED + int(temperature * 10))
  B, T, V = 5, 20, 17
  batch = _batch(rng, B, T, V)
  logits = rng.normal(0.0, 1.5, (B, T, V)).astype(np.float32)
  aux = rng.random(3).astype(np.float32) * 0.1
  # old / ref log-probs near the policy's own, so some ratios are clipped and some are not
  x = logits.astype(np.float64) / temperature
  lp_all = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
      -1, keepdims=True))
  own = np.zeros((B, T))
  own[:, 1:] = np.take_along_axis(lp_all[:, :-1], batch["tokens"][:, 1:, None], -1)[..., 0]
  mask = batch["loss_mask"] > 0
  batch["old_logprobs"] = np.where(mask, own + rng.normal(0, 0.3, (B, T)), 0).astype(np.float32)
  batch["ref_logprobs"] = np.where(mask, own + rng.normal(0, 0.5, (B, T)), 0).astype(np.float32)
  cfg = grpo.GRPOConfig(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef,
                        temperature=temperature)
  loss, m = grpo.grpo_loss_fn(_TableModel(logits, aux), {k: jnp.asarray(v) for k, v in
                                                         batch.items()}, train=False, cfg=cfg)
  total, policy, kl, ratio, clip_frac, n = _reference(logits, batch, cfg, aux)
  assert 0.1 < clip_frac < 0.9, clip_frac  # both sides of the clip are exercised
  assert float(m["num_tokens"]) == n
  np.testing.assert_allclose(float(m["loss"]), policy, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(m["kl"]), kl, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(m["ratio"]), ratio, rtol=1e-5)
  np.testing.assert_allclose(float(m["clip_frac"]), clip_frac, rtol=1e-6)
  np.testing.assert_allclose(float(loss), total, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.45])
def test_token_logprobs_are_token_aligned_at_the_temperature(temperature):
  """token_logprobs[b, t] = log softmax(logits[b, t - 1] / T)[tokens[b, t]], 0 at t = 0 (the
  trainer's tempered old-policy log-probs, aligned with `tokens` as the engine's are)."""
  rng = np.random.default_rng(SEED + 3)
  B, T, V = 3, 9, 11
  logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  got = np.asarray(grpo.token_logprobs(_TableModel(logits, [0.0]), jnp.asarray(tokens),
                                       jnp.ones((B, T), jnp.int32), temperature=temperature))
  expect = np.zeros((B, T))
  for b in range(B):
    for t in range(1, T):
      z = logits[b, t - 1].astype(np.float64) / temperature
      expect[b, t] = z[tokens[b, t]] - z.max() - np.log(np.exp(z - z.max()).sum())
  np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)


def test_a_batch_without_model_written_tokens_has_a_finite_zero_policy_loss():
  """Every episode ended before the model wrote a token (prompts only): nothing to average, so
  the policy and KL terms are 0 (not 0 / 0) and the loss is the aux loss alone."""
  rng = np.random.default_rng(SEED + 4)
  B, T, V = 3, 8, 13
  eps = [Episode(tokens=rng.integers(1, V, L).tolist(), generated=[False] * L, logprobs=[0.0] * L)
         for L in (5, 8, 3)]
  batch = grpo.episodes_to_batch(eps, rng.normal(size=B), seq_len=T)
  batch["ref_logprobs"] = rng.normal(size=(B, T)).astype(np.float32)
  aux = rng.random(2).astype(np.float32)
  cfg = grpo.GRPOConfig(kl_coef=0.2)
  loss, m = grpo.grpo_loss_fn(_TableModel(rng.normal(size=(B, T, V)), aux),
                              {k: jnp.asarray(v) for k, v in batch.items()}, train=False, cfg=cfg)
  assert float(m["num_tokens"]) == 0.0
  for key in ("loss", "kl", "ratio", "clip_frac"):
    assert float(m[key]) == 0.0, (key, float(m[key]))
  np.testing.assert_allclose(float(loss), float(aux.sum()), rtol=1e-6)
