"""The tool-call parser never crashes (a test per malformed kind); the tools compute exactly."""

import fractions

import numpy as np
import pytest

from sparse_lm.rl import envs, tools
from sparse_lm.rl.format import (FinalAnswer, ParseError, ToolCall, format_call, parse_turn)
from sparse_lm.rl.tools import ToolBox, evaluate


def test_parse_call_and_answer():
  assert parse_turn(format_call("calculator", {"expression": "1+2"})) == ToolCall(
      "calculator", {"expression": "1+2"})
  assert parse_turn("thinking <tool_call>lookup {\"key\": \"ab\"}</tool_call>") == ToolCall(
      "lookup", {"key": "ab"})
  assert parse_turn(" 42 <eos>") == FinalAnswer("42")


@pytest.mark.parametrize("text, message", [
    ('<tool_call>calculator {"expression": 1+}</tool_call>', "not valid JSON"),
    ("<tool_call>calculator [1, 2]</tool_call>", "JSON object"),
    ('<tool_call>calculator {"expression": "1+2"}', "unclosed"),
    ('<tool_call>{"expression": "1"}</tool_call>', "without a name"),
    ("the answer is 4", "no tool call"),
])
def test_malformed_turn_is_a_parse_error(text, message):
  out = parse_turn(text)
  assert isinstance(out, ParseError) and message in out.message


def test_garbage_never_raises():
  rng = np.random.default_rng(0)
  alphabet = list('{}[]":, abc12<>/') + ["<tool_call>", "</tool_call>", "<eos>"]
  for _ in range(300):
    text = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), 20))
    assert isinstance(parse_turn(text), (ToolCall, FinalAnswer, ParseError))


def test_unknown_tool_and_wrong_arguments():
  box = ToolBox([tools.calculator()])
  res = box.call(ToolCall("python", {"code": "1"}))
  assert not res.ok and "unknown tool 'python'" in res.error
  res = box.call(ToolCall("calculator", {"expr": "1"}))
  assert not res.ok and "missing ['expression']" in res.error and "unexpected ['expr']" in res.error
  res = box.call(ToolCall("calculator", {"expression": 12}))
  assert not res.ok and "must be a str" in res.error


def test_calculator_exact_and_safe():
  assert evaluate("0.1+0.2") == fractions.Fraction(3, 10)
  assert evaluate("(2**10 - 24) // 7 % 5") == (2**10 - 24) // 7 % 5
  assert evaluate("-3*(4+5)/6") == fractions.Fraction(-9, 2)
  box = ToolBox([tools.calculator()])
  assert box.call(ToolCall("calculator", {"expression": "7/3"})).output == "7/3"
  for bad, why in (("__import__('os')", "not arithmetic"), ("1/0", "ZeroDivision"),
                   ("2**10000", "exponent"), ("9**64**2", "exponent"), ("1+", "SyntaxError")):
    res = box.call(ToolCall("calculator", {"expression": bad}))
    assert not res.ok and why in res.error, (bad, res)


def test_lookup_and_search():
  box = ToolBox([tools.lookup({"ab": "cd"})])
  assert box.call(ToolCall("lookup", {"key": "ab"})).output == "cd"
  assert not box.call(ToolCall("lookup", {"key": "zz"})).ok
  doc = tools.stdlib_document(30_000)
  assert len(doc) == 30_000 and "# ====" in doc
  search = ToolBox([tools.search(doc + "\nThe pass key is 12345.\n", top_k=1)])
  assert "12345" in search.call(ToolCall("search", {"query": "pass key"})).output


@pytest.mark.parametrize("name", ["arithmetic", "lookup", "passkey"])
def test_reference_solutions_earn_the_reward(name):
  rng = np.random.default_rng(1)
  for _ in range(5):
    task = envs.ENVS[name]().sample(rng)
    calls, answer = task.solution
    results = [task.tools.call(c) for c in calls]
    assert all(r.ok for r in results), results
    assert task.reward(answer) == 1.0 and task.reward(answer + "0") == 0.0
  if name == "lookup":  # the chain really links: the last lookup's value is the answer
    assert results[-1].output == answer
  if name == "passkey":
    assert answer in results[-1].output
