"""Environments with verifiable rewards (ARCHITECTURE.md §10).

An environment samples `Task`s from a numpy Generator (so a seed fixes the task stream). A task
holds its prompt, its tools, a `reward(answer_text) -> float` that checks the final answer
(exact match or unit tests run in the sandbox) and a reference `solution` (the calls a correct
agent makes and the answer it gives) from which the SFT warm-up transcripts are written.

  arithmetic  an expression of `num_operands` integers; calculator; exact integer answer.
  lookup      follow `hops` links through a generated key-value store; lookup; the last value.
  passkey     a pass key hidden in `doc_chars` characters of the Python standard library's
              sources (grows with the stage's length); search; the key.
  code        write a small function; python (the sandbox); reward = its unit tests pass.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Callable

import numpy as np

from sparse_lm.rl import tools as tools_lib
from sparse_lm.rl.format import ToolCall
from sparse_lm.rl.sandbox import run_python


@dataclasses.dataclass(frozen=True)
class Task:
  """One episode's problem. `solution` is the reference calls and final answer text."""

  prompt: str
  tools: tools_lib.ToolBox
  reward: Callable[[str], float]
  solution: tuple[tuple[ToolCall, ...], str]
  answer: str


def exact(answer: str) -> Callable[[str], float]:
  """1.0 when the final answer equals `answer` after stripping whitespace, else 0.0."""
  return lambda text: float(text.strip() == answer)


@dataclasses.dataclass(frozen=True)
class ArithmeticEnv:
  """`a op b op c ...` with `num_operands` integers in [0, max_value]; ops from `ops`."""

  num_operands: int = 2
  max_value: int = 99
  ops: str = "+-*"
  max_steps: int = 3
  name: str = "arithmetic"

  def sample(self, rng: np.random.Generator) -> Task:
    nums = [int(x) for x in rng.integers(0, self.max_value + 1, self.num_operands)]
    ops = [self.ops[int(i)] for i in rng.integers(0, len(self.ops), self.num_operands - 1)]
    expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
    value = tools_lib.format_number(tools_lib.evaluate(expr))
    box = tools_lib.ToolBox([tools_lib.calculator()])
    return Task(f"{expr}=?", box, exact(value),
                ((ToolCall("calculator", {"expression": expr}),), value), value)


def _word(rng: np.random.Generator, n: int = 4) -> str:
  return "".join(string.ascii_lowercase[int(i)] for i in rng.integers(0, 26, n))


@dataclasses.dataclass(frozen=True)
class LookupEnv:
  """A store of `num_keys` random 4-letter keys; a chain of `hops` keys ends in a number."""

  num_keys: int = 32
  hops: int = 2
  max_steps: int = 4
  name: str = "lookup"

  def sample(self, rng: np.random.Generator) -> Task:
    keys: list[str] = []
    while len(keys) < self.num_keys:
      k = _word(rng)
      if k not in keys:
        keys.append(k)
    store = {k: str(int(rng.integers(1000, 10000))) for k in keys}
    chain = [keys[int(i)] for i in rng.permutation(self.num_keys)[:self.hops]]
    for a, b in zip(chain, chain[1:]):
      store[a] = b
    answer = store[chain[-1]]
    calls = tuple(ToolCall("lookup", {"key": k}) for k in chain)
    return Task(f"follow {self.hops} lookups from {chain[0]}", tools_lib.ToolBox(
        [tools_lib.lookup(store)]), exact(answer), (calls, answer), answer)


@dataclasses.dataclass(frozen=True)
class PasskeyEnv:
  """A 5-digit pass key inserted at a random line of `doc_chars` characters of real text."""

  doc_chars: int = 20_000
  max_steps: int = 3
  name: str = "passkey"

  def sample(self, rng: np.random.Generator) -> Task:
    doc = tools_lib.stdlib_document(self.doc_chars, start=int(rng.integers(0, 200_000)))
    lines = doc.splitlines()
    key = str(int(rng.integers(10_000, 100_000)))
    lines.insert(int(rng.integers(0, len(lines) + 1)), f"The pass key is {key}.")
    box = tools_lib.ToolBox([tools_lib.search("\n".join(lines), top_k=1)])
    return Task("find the pass key", box, exact(key),
                ((ToolCall("search", {"query": "pass key"}),), key), key)


_CODE_TASKS = (  # (description, body, the same function in Python, test inputs); {k} a constant
    ("f(x) returns x times {k}", "return x * {k}", lambda x, k: x * k, (0, 3, -7)),
    ("f(x) returns x plus {k}", "return x + {k}", lambda x, k: x + k, (0, 5, -2)),
    ("f(x) returns the sum of the list x, plus {k}", "return sum(x) + {k}",
     lambda x, k: sum(x) + k, ([], [1, 2], [5, -3, 9])),
    ("f(x) returns the string x repeated {k} times", "return x * {k}", lambda x, k: x * k,
     ("", "ab", "z")),
)


def _code_reward(body_tests: str) -> Callable[[str], float]:
  def reward(text: str) -> float:
    res = run_python(text + "\n" + body_tests, timeout_s=3.0, memory_mb=256)
    return float(res.ok and res.output.strip() == "PASS")
  return reward


@dataclasses.dataclass(frozen=True)
class CodeEnv:
  """Write `def f(x): ...`; the answer is the code, checked by unit tests in the sandbox."""

  max_steps: int = 3
  name: str = "code"

  def sample(self, rng: np.random.Generator) -> Task:
    desc, body, fn, inputs = _CODE_TASKS[int(rng.integers(0, len(_CODE_TASKS)))]
    k = int(rng.integers(2, 10))
    code = f"def f(x):\n  {body.format(k=k)}"
    expected = [fn(x, k) for x in inputs]
    tests = (f"assert [f(x) for x in {list(inputs)!r}] == {expected!r}\nprint('PASS')")
    check = ToolCall("python", {"code": f"{code}\nprint(f({inputs[1]!r}))"})
    box = tools_lib.ToolBox([tools_lib.python(timeout_s=3.0, memory_mb=256)])
    return Task(f"write {desc.format(k=k)}", box, _code_reward(tests), ((check,), code), code)


ENVS = {"arithmetic": ArithmeticEnv, "lookup": LookupEnv, "passkey": PasskeyEnv,
        "code": CodeEnv}
