"""GRPO: group-relative advantages, the clipped token-level objective, and its train step.

Shao et al., DeepSeekMath (arXiv 2402.03300) §4.1: for each prompt, G episodes are sampled;
episode i's advantage is its reward standardised within the group,

    A_i = (r_i - mean(r)) / (std(r) + eps),

and every model-written token t of episode i gets A_i. The loss is the clipped surrogate of PPO
with an optional KL penalty to a frozen reference policy (the k3 estimator
exp(ref - logp) - (ref - logp) - 1, §4.1 eq. 4), averaged over all model-written tokens of the
batch (token-level, as in DAPO, arXiv 2503.14476 §3.3), so long episodes are not down-weighted:

    L = sum_t m_t [ -min(rho_t A, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A) + beta KL_t ] / sum m_t,
    rho_t = exp(logp_t - logp_old_t).

m_t is 1 on tokens the model wrote (tool calls, answers) and 0 on the task and on tool results
(`rollout.Episode.generated`). Every log-probability is that of the distribution the episodes
were sampled from, softmax(logits / T) at the sampling temperature T (`GRPOConfig.temperature`),
so the ratio is 1 on the step's own samples and the gradient is the sampling policy's.
logp_old is the trainer's recomputation on the rollout's weights (the engine reports log-probs
at T = 1, which the trainer checks against its own: `logprob_mismatch_max`).

The train step is the project's (`sparse_lm.train.step.make_train_step`) with this loss: a pure
function of (TrainState, batch), jitted by the caller; AdamW, clipping, the non-finite guard and
the §6 balancer update all come with it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparse_lm.model.loss import next_token_targets
from sparse_lm.train.step import make_train_step


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """clip_low / clip_high: the ratio's clip range (1 - clip_low, 1 + clip_high); kl_coef: beta
  (0 = no reference model); scale_by_std: divide advantages by the group's std (DeepSeekMath);
  False keeps only the mean-centring (Dr. GRPO, arXiv 2503.20783); temperature: the rollouts'
  sampling temperature T > 0, the policy being softmax(logits / T)."""

  group_size: int = 8
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0
  scale_by_std: bool = True
  eps: float = 1e-6
  temperature: float = 1.0


def group_advantages(rewards: Sequence[float], group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
  """Per-episode advantages [N] from rewards [N] ordered group by group (N = groups * G).

  Raises ValueError if N is not a multiple of group_size. A group whose rewards are all equal
  gets advantages 0 (it carries no learning signal).
  """
  r = np.asarray(rewards, np.float64)
  if r.size % group_size:
    raise ValueError(f"{r.size} rewards do not split into groups of group_size={group_size}")
  r = r.reshape(-1, group_size)
  # exactly 0 for a constant group: its float mean may differ from the rewards by a rounding
  # error, which a small eps would turn into an advantage (eps = 1e-16: -0.5 each)
  adv = np.where((r == r[:, :1]).all(axis=1, keepdims=True), 0.0,
                 r - r.mean(axis=1, keepdims=True))
  if scale_by_std:
    adv = adv / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


def episode_rewards(episodes, partial_credit: float = 0.0) -> list[float]:
  """The reward GRPO optimises per episode: the task's reward, or `partial_credit` (in [0, 1))
  when the final answer earned less but a tool returned exactly the task's answer
  (`Episode.found_answer`). Success is still judged on the task's reward alone."""
  return [max(e.reward, partial_credit * float(e.found_answer)) for e in episodes]


def episodes_to_batch(episodes, advantages: Sequence[float] | None, seq_len: int,
                      pad_id: int = 0) -> dict[str, np.ndarray]:
  """Pad episodes into a training batch.

  Returns int32 `tokens`, `segment_ids` (1 on tokens, 0 on padding), `positions` [B, T];
  float32 `loss_mask` (1 where the model wrote the token), `old_logprobs` (the engine's log p of
  each token, aligned with `tokens`) [B, T]; float32 `advantages` [B] (zeros if None).
  Raises ValueError if an episode is longer than seq_len.
  """
  B = len(episodes)
  out = {"tokens": np.full((B, seq_len), pad_id, np.int32),
         "segment_ids": np.zeros((B, seq_len), np.int32),
         "positions": np.zeros((B, seq_len), np.int32),
         "loss_mask": np.zeros((B, seq_len), np.float32),
         "old_logprobs": np.zeros((B, seq_len), np.float32),
         "advantages": np.zeros((B,), np.float32) if advantages is None
                       else np.asarray(advantages, np.float32)}
  for i, ep in enumerate(episodes):
    n = len(ep.tokens)
    if n > seq_len:
      raise ValueError(f"episode {i} has {n} tokens > seq_len={seq_len}; raise seq_len")
    out["tokens"][i, :n] = ep.tokens
    out["segment_ids"][i, :n] = 1
    out["positions"][i, :n] = np.arange(n)
    out["loss_mask"][i, :n] = ep.generated
    out["old_logprobs"][i, :n] = ep.logprobs
  return out


def _shift(x: jax.Array) -> jax.Array:
  """Token-aligned [B, T] -> target-aligned (position t holds the value of token t+1)."""
  return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def target_logprobs(model: nnx.Module, tokens: jax.Array, segment_ids: jax.Array, *,
                    train: bool = False, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(log p(tokens[t+1] | tokens[<=t]) [B, T] fp32, the model's MoE aux loss (scalar)), with
  p = softmax(logits / temperature).

  Full fp32 logits [B, T, V] are made: fine at the vocabularies RL runs on here (use the
  chunked cross-entropy of model/loss.py for 160K vocabularies and long episodes).
  """
  targets = _shift(tokens)
  h, aux = model.forward_hidden(tokens, segment_ids=segment_ids, train=train)
  logits = model.logits(h).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], jnp.sum(aux["aux_loss"])


def token_logprobs(model: nnx.Module, tokens: jax.Array, segment_ids: jax.Array, *,
                   temperature: float = 1.0) -> jax.Array:
  """log p(tokens[t] | tokens[<t]) [B, T] fp32, aligned with `tokens` (0 at t = 0), p =
  softmax(logits / temperature): at temperature 1 what the engine reports per generated token,
  computed by one full forward pass."""
  lp, _ = target_logprobs(model, tokens, segment_ids, temperature=temperature)
  return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp[:, :-1]], axis=1)


def grpo_loss_fn(model: nnx.Module, batch: dict, *, train: bool = True, z_loss_coef: float = 0.0,
                 cfg: GRPOConfig = GRPOConfig()) -> tuple[jax.Array, dict]:
  """The GRPO objective of the module docstring on a batch of `episodes_to_batch` (plus
  `ref_logprobs` [B, T] when cfg.kl_coef > 0). Returns (loss, metrics): `loss` (the policy
  term), `kl`, `clip_frac` (fraction of tokens whose ratio was clipped), `ratio` (mean),
  `num_tokens`."""
  del z_loss_coef
  tokens, seg = batch["tokens"], batch["segment_ids"]
  _, weights = next_token_targets(tokens, seg, batch["loss_mask"])
  logp, aux_loss = target_logprobs(model, tokens, seg, train=train, temperature=cfg.temperature)
  old = _shift(batch["old_logprobs"])
  ratio = jnp.exp(logp - old)
  adv = batch["advantages"][:, None]
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  n = jnp.maximum(jnp.sum(weights), 1.0)
  policy = jnp.sum(per_token * weights) / n
  kl = jnp.zeros((), jnp.float32)
  if cfg.kl_coef > 0:
    d = _shift(batch["ref_logprobs"]) - logp
    kl = jnp.sum((jnp.exp(d) - d - 1.0) * weights) / n
  loss = policy + cfg.kl_coef * kl + aux_loss
  metrics = {"loss": policy, "kl": kl, "num_tokens": jnp.sum(weights),
             "ratio": jnp.sum(ratio * weights) / n,
             "clip_frac": jnp.sum((ratio != clipped) * weights) / n}
  return loss, metrics


def make_grpo_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                   schedule: optax.Schedule, cfg: GRPOConfig, *, micro_batches: int = 1):
  """`step(state, batch) -> (state, metrics)`: the project's train step with the GRPO loss and
  the §6 balancer update (jit it; donate the state)."""
  from sparse_lm.moe.balancing import update_balancers  # pylint: disable=import-outside-toplevel
  return make_train_step(graphdef, tx, schedule, functools.partial(grpo_loss_fn, cfg=cfg),
                         micro_batches=micro_batches, balance_fn=update_balancers)


def make_sft_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                  schedule: optax.Schedule, *, micro_batches: int = 1):
  """The supervised warm-up step: next-token loss on the model-written tokens of transcripts
  (`loss_mask` = generated), i.e. the project's pretraining step and loss."""
  from sparse_lm.model.loss import loss_fn  # pylint: disable=import-outside-toplevel
  from sparse_lm.moe.balancing import update_balancers  # pylint: disable=import-outside-toplevel
  return make_train_step(graphdef, tx, schedule, loss_fn, micro_batches=micro_batches,
                         balance_fn=update_balancers)
