"""Audit tests of rollout.run_episodes on a scripted engine: the per-turn seed, the step budget
and the length limit at their exact boundaries (no observation is appended when no turn follows;
an episode never exceeds max_length), and `found_answer` staying set once a tool returned the
answer."""

import numpy as np
import pytest

from sparse_lm.rl import envs, rollout
from sparse_lm.rl.format import format_call
from tests.rl.rollout_testlib import Sampling, ScriptedEngine, arithmetic_tokenizer

SEED = 21


@pytest.fixture(scope="module")
def tok():
  return arithmetic_tokenizer(SEED)


def _task(seed):
  return envs.ArithmeticEnv().sample(np.random.default_rng(seed))


def _run(tok, task, turns, **kw):
  engine = ScriptedEngine(tok, turns)
  (ep,) = rollout.run_episodes(engine, tok, [task], sampling_cls=Sampling, **kw)
  return ep, engine


def test_each_turn_samples_with_seed_plus_its_index(tok):
  task = _task(SEED + 1)
  call = format_call("calculator", {"expression": task.prompt[:-2]})
  seed = int(np.random.default_rng(SEED).integers(1, 10_000))
  ep, engine = _run(tok, task, [call, call, f"{task.answer}<eos>"], max_steps=3,
                    max_turn_tokens=40, max_length=300, seed=seed)
  assert ep.reward == 1.0 and ep.steps == 3
  assert engine.seeds == [seed, seed + 1, seed + 2]


def test_the_step_budget_ends_on_a_model_turn_without_its_observation(tok):
  task = _task(SEED + 2)
  call = format_call("calculator", {"expression": task.prompt[:-2]})
  P = 1 + len(tok.encode(task.prompt + "\n"))
  L = len(tok.encode(call, allow_special=True))
  O = 2 + len(tok.encode(task.answer))  # <tool_result>answer</tool_result>
  ep, engine = _run(tok, task, [call, call], max_steps=2, max_turn_tokens=40, max_length=300)
  assert ep.steps == 2 and ep.reward == 0.0 and ep.found_answer and len(engine.seeds) == 2
  assert len(ep.tokens) == P + L + O + L and ep.generated[-1]
  assert len(ep.generated) == len(ep.logprobs) == len(ep.tokens)
  assert tok.decode(ep.tokens).count("<tool_result>") == 1


def test_the_length_limit_at_its_boundaries(tok):
  task = _task(SEED + 3)
  call = format_call("calculator", {"expression": task.prompt[:-2]})
  P = 1 + len(tok.encode(task.prompt + "\n"))
  L = len(tok.encode(call, allow_special=True))
  O = 2 + len(tok.encode(task.answer))
  M = L + 3  # max_turn_tokens: the scripted turn fits
  turns = [call, f"{task.answer}<eos>"]
  # a turn that exactly fits runs; the observation after it would leave no room for a turn
  ep, engine = _run(tok, task, turns, max_steps=3, max_turn_tokens=M, max_length=P + M)
  assert ep.steps == 1 and len(engine.seeds) == 1 and len(ep.tokens) == P + L
  # one token short of room for the observation and a next turn: no observation
  ep, engine = _run(tok, task, turns, max_steps=3, max_turn_tokens=M, max_length=P + L + O + M - 1)
  assert ep.steps == 1 and len(ep.tokens) == P + L and ep.generated[-1]
  assert "<tool_result>" not in tok.decode(ep.tokens) and ep.found_answer
  # exactly room: the observation goes in and the next turn runs
  ep, engine = _run(tok, task, turns, max_steps=3, max_turn_tokens=M, max_length=P + L + O + M)
  assert ep.steps == 2 and ep.reward == 1.0 and len(engine.seeds) == 2
  assert len(ep.tokens) <= P + L + O + M
  # one short of room for the first turn: the episode ends before any turn
  ep, engine = _run(tok, task, turns, max_steps=3, max_turn_tokens=M, max_length=P + M - 1)
  assert ep.steps == 0 and engine.seeds == [] and len(ep.tokens) == P and ep.done


def test_found_answer_stays_set_after_a_later_wrong_call(tok):
  task = _task(SEED + 4)
  expr = task.prompt[:-2]
  right = format_call("calculator", {"expression": expr})
  wrong = format_call("calculator", {"expression": f"({expr})+1"})
  ep, _ = _run(tok, task, [right, wrong, f"{task.answer}1<eos>"], max_steps=3,
               max_turn_tokens=40, max_length=300)
  assert ep.num_calls == 2 and ep.num_errors == 0 and ep.reward == 0.0
  assert ep.found_answer and not ep.success
  assert f"<tool_result>{int(task.answer) + 1}</tool_result>" in tok.decode(ep.tokens)
