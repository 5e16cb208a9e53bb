"""GRPO must learn a problem it cannot fail: a one-token bandit through the trainer's own GRPO
pieces (`trainer.grpo_batch`: group advantages, the batch, the tempered old log-probs; the
jitted `grpo.make_grpo_step` with AdamW).

Each episode is a prompt and ONE model-written token sampled at temperature T from the current
weights; the reward is 1 iff that token is in the lower half of the vocabulary (chance ~0.5 at
initialisation). A correct policy gradient drives the sampled reward to ~1 within a few dozen
steps; a wrong sign, a loss mask off by one token, a zero gradient or a step that does not move
the policy would leave it at chance. The first step is also checked to be a pure function of
(state, batch) that moves the weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import grpo, trainer
from sparse_lm.rl.rollout import Episode
from sparse_lm.train.optimizer import OptimizerConfig, wsd_schedule

SEED = 0
PROMPTS = ([1, 20, 21, 22], [1, 30, 31, 32])


def test_grpo_learns_a_one_token_bandit():
  print("seed", SEED)
  # 3 layers (KDA, MLA, MLA), one of them MoE; the standard residual compiles the GRPO step
  # in 2/3 of the time of the preset's attnres_block (the step's compile is most of the test)
  model_cfg = get_preset("tiny", num_layers=3, mla_every=2, residual="standard",
                         num_dense_layers=2)
  model = Transformer(model_cfg, rngs=nnx.Rngs(SEED))
  V, G, T, steps = model_cfg.vocab_size, 8, 0.7, 24
  cfg = dataclasses.replace(trainer.RLConfig(), seq_len=8,
                            grpo=grpo.GRPOConfig(group_size=G, temperature=T))
  optim = OptimizerConfig(peak_lr=1e-2, warmup_steps=0, decay_fraction=0.0, weight_decay=0.0)
  graphdef, tx, state = trainer._fresh_state(model, optim, steps, SEED)
  step_fn = jax.jit(grpo.make_grpo_step(graphdef, tx, wsd_schedule(optim, steps), cfg.grpo))
  logp_fn = trainer.make_logp_fn(graphdef)
  prompts = jnp.asarray(PROMPTS, jnp.int32)
  next_logits = jax.jit(lambda p, r: nnx.merge(graphdef, p, r)(prompts)[:, -1])
  rng = np.random.default_rng(SEED)
  success = []
  for step in range(steps):
    logits = np.asarray(next_logits(state.params, state.model_vars), np.float64)  # [2, V]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)  # T = 1
    p_t = np.exp(logp / T - np.log(np.exp(logp / T).sum(-1, keepdims=True)))
    eps, rewards = [], []
    for i, prompt in enumerate(PROMPTS):
      for a in rng.choice(V, size=G, p=p_t[i]):
        eps.append(Episode(tokens=prompt + [int(a)], generated=[False] * len(prompt) + [True],
                           logprobs=[0.0] * len(prompt) + [float(logp[i, a])]))
        rewards.append(float(a < V // 2))
    batch, mismatch = trainer.grpo_batch(eps, rewards, cfg, logp_fn, state)
    assert mismatch < 1e-4, mismatch  # the sampled log-probs are the trainer's
    new_state, metrics = step_fn(state, batch)
    assert float(metrics["num_tokens"]) == len(eps)  # exactly the one written token each
    assert float(metrics["finite"]) == 1.0
    if step == 0:  # the step is a pure function of (state, batch), and it moves the weights
      again, _ = step_fn(state, batch)
      for x, y in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      assert max(float(jnp.max(jnp.abs(x - y))) for x, y in
                 zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params))) > 0
    state = new_state
    success.append(float(np.mean(rewards)))
  print("sampled success per step", np.round(success, 3).tolist())
  assert 0.2 < np.mean(success[:2]) < 0.8  # ~chance at the start
  assert np.mean(success[-4:]) >= 0.95, success
