"""Episodes: the turn protocol on a scripted engine, SFT transcripts, and engine vs trainer
log-probs on real rollouts (fp32, tiny preset, random weights)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm.rl import envs, grpo, rollout
from sparse_lm.rl.format import format_call
from tests.rl.rollout_testlib import (SCRIPTED_LOGPROB, Sampling, ScriptedEngine,
                                     arithmetic_tokenizer)

SEED = 0


@pytest.fixture(scope="module")
def tok():
  return arithmetic_tokenizer(SEED)


def test_episode_turns_rewards_and_masks(tok):
  task = envs.ArithmeticEnv().sample(np.random.default_rng(3))
  expr = task.prompt[:-2]
  engine = ScriptedEngine(tok, ['<tool_call>calculator {"expression": 1+}</tool_call>',
                                format_call("calculator", {"expression": expr}),
                                f"{task.answer}<eos>"])
  (ep,) = rollout.run_episodes(engine, tok, [task], max_steps=3, max_turn_tokens=40,
                               max_length=200, sampling_cls=Sampling)
  assert ep.reward == 1.0 and ep.answer == task.answer and ep.steps == 3
  assert ep.num_calls == 2 and ep.num_errors == 1
  assert ep.found_answer  # the second call returned the answer
  text = tok.decode(ep.tokens)
  assert "<tool_result>error: arguments of 'calculator' are not valid JSON" in text
  assert f"<tool_result>{task.answer}</tool_result>" in text
  # observations and the prompt are not model-written; every engine token is
  gen_text = tok.decode([t for t, g in zip(ep.tokens, ep.generated) if g])
  assert "<tool_result>" not in gen_text and task.prompt not in gen_text
  assert sum(ep.generated) == sum(1 for lp in ep.logprobs if lp == SCRIPTED_LOGPROB)
  # later turns feed only the new observation and continue the kept state
  prompts, states, sampling = engine.calls[1]
  assert tok.decode(prompts[0]).startswith("<tool_result>error:") and states == [("state", 1)]
  assert sampling.stop_tokens == (tok.tool_call_end_id, tok.eos_id)


def test_step_budget_and_wrong_answer(tok):
  task = envs.ArithmeticEnv().sample(np.random.default_rng(4))
  engine = ScriptedEngine(tok, ["no format here"] * 2)
  (ep,) = rollout.run_episodes(engine, tok, [task], max_steps=2, max_turn_tokens=8,
                               max_length=200, sampling_cls=Sampling)
  assert ep.reward == 0.0 and ep.answer is None and ep.steps == 2 and ep.num_errors == 2
  engine = ScriptedEngine(tok, [f"{task.answer}1<eos>"])
  (ep,) = rollout.run_episodes(engine, tok, [task], max_steps=2, max_turn_tokens=16,
                               max_length=200, sampling_cls=Sampling)
  assert ep.reward == 0.0 and ep.answer == task.answer + "1" and not ep.found_answer
  # a right call and a wrong final answer: partial credit only for GRPO, no success
  engine = ScriptedEngine(tok, [format_call("calculator", {"expression": task.prompt[:-2]}),
                                f"{task.answer}1<eos>"])
  (right_call,) = rollout.run_episodes(engine, tok, [task], max_steps=2, max_turn_tokens=40,
                                       max_length=200, sampling_cls=Sampling)
  assert right_call.found_answer and right_call.reward == 0.0 and not right_call.success
  assert grpo.episode_rewards([ep, right_call], partial_credit=0.25) == [0.0, 0.25]
  assert grpo.episode_rewards([right_call], partial_credit=0.0) == [0.0]


def test_transcript_masks_tool_results(tok):
  task = envs.ArithmeticEnv().sample(np.random.default_rng(5))
  ids, gen = rollout.transcript(tok, task)
  assert tok.decode(ids).endswith(f"<tool_result>{task.answer}</tool_result>{task.answer}<eos>")
  model_text = tok.decode([i for i, g in zip(ids, gen) if g])
  assert model_text == format_call("calculator", {"expression": task.prompt[:-2]}) + \
      task.answer + "<eos>"


def test_engine_and_trainer_logprobs_agree(tok):
  """Issue 14: within 1e-4 on the tiny preset in fp32 (random weights, sampled episodes)."""
  from sparse_lm.config import get_preset
  from sparse_lm.inference import Engine, SamplingParams
  from sparse_lm.model.transformer import Transformer
  print("seed", SEED)
  model = Transformer(get_preset("tiny", num_layers=5), rngs=nnx.Rngs(SEED))
  rng = np.random.default_rng(SEED)
  tasks = [envs.ArithmeticEnv().sample(rng) for _ in range(2) for _ in range(2)]
  engine = Engine(model, max_length=64, max_batch=4)
  eps = rollout.run_episodes(engine, tok, tasks, max_steps=2, max_turn_tokens=10,
                             max_length=64, temperature=1.0, seed=SEED,
                             sampling_cls=SamplingParams)
  batch = grpo.episodes_to_batch(eps, None, seq_len=64)
  lp = np.asarray(grpo.token_logprobs(model, jnp.asarray(batch["tokens"]),
                                      jnp.asarray(batch["segment_ids"])))
  mask = batch["loss_mask"] > 0
  assert mask.sum() > 20
  diff = np.abs(lp - batch["old_logprobs"])[mask]
  print("max |engine - trainer| log-prob:", diff.max())
  assert diff.max() < 1e-4
