"""Environments with verifiable rewards (ARCHITECTURE.md §10).

An environment samples `Task`s from a numpy Generator (so a seed fixes the task stream). A task
holds its prompt, its tools, a `reward(answer_text) -> float` that checks the final answer
(exact match or unit tests run in the sandbox) and a reference `solution` (the calls a correct
agent makes and the answer it gives) from which the SFT warm-up transcripts are written.

  arithmetic  an expression of `num_operands` integers; calculator; exact integer answer.
  lookup      follow `hops` links through a generated key-value store; lookup; the last value.
  passkey     a pass key hidden in `doc_chars` characters of the Python standard library's
              sources (grows with the stage's length); search; the key.
  code        write a small function; python (the sandbox); reward = its unit tests pass (graded
              by a harness that exiting early, printing a success marker or an always-equal
              result does not fool; what it does not stop is written at `_HARNESS`).

Every setting is checked when the env is built (`__post_init__`: types, ranges and the settings
that constrain each other), so a bad override fails before anything runs; `make_env(name,
**overrides)` also names an unknown override and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import secrets
import string
from typing import Any, Callable

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


# ----------------------------------------------------------------------------- settings checks
def _bad(env, field: str, value: Any, rule: str) -> ValueError:
  return ValueError(f"{type(env).__name__}.{field}={value!r}: {rule}")


def _check_int(env, field: str, lo: int, hi: int | None = None, why: str = "") -> int:
  """The int setting `field` of `env` (an int, not a bool or a str) in [lo, hi]; stores it as a
  plain int (a numpy integer is accepted) and returns it. Raises ValueError naming it."""
  value = getattr(env, field)
  rule = f"must be an int >= {lo}" if hi is None else f"must be an int in [{lo}, {hi}]"
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise _bad(env, field, value, f"{rule}{why} (got a {type(value).__name__})")
  if value < lo or (hi is not None and value > hi):
    raise _bad(env, field, value, rule + why)
  object.__setattr__(env, field, int(value))
  return int(value)


def _check_common(env, min_steps: int, solution: str) -> None:
  """`name` a non-empty str; `max_steps` at least the turns of the reference solution (its
  tool calls and the answer): with fewer, every episode of the SFT-taught policy earns 0."""
  if not isinstance(env.name, str) or not env.name:
    raise _bad(env, "name", env.name, "must be a non-empty str")
  _check_int(env, "max_steps", min_steps,
             why=f" (model turns per episode; the reference solution takes {solution})")


_ARITHMETIC_OPS = "+-*"  # '/' and '%' would divide by a drawn 0
_MAX_EXPRESSION_CHARS = 500  # tools.evaluate's limit
_INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ArithmeticEnv:
  """`a op b op c ...` with `num_operands` integers in [0, max_value]; ops from `ops`."""

  num_operands: int = 2
  max_value: int = 99
  ops: str = "+-*"
  max_steps: int = 3
  name: str = "arithmetic"

  def __post_init__(self):
    n = _check_int(self, "num_operands", 1, _MAX_EXPRESSION_CHARS // 2)
    m = _check_int(self, "max_value", 1, _INT64_MAX - 1, " (operands are drawn from [0, "
                   "max_value] by numpy's int64 integers)")
    if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(_ARITHMETIC_OPS):
      raise _bad(self, "ops", self.ops, "must be a non-empty str of the operators "
                 f"{', '.join(map(repr, _ARITHMETIC_OPS))} (one character per operator; repeat "
                 "one to draw it more often)")
    longest = n * (len(str(m)) + 1) - 1
    if longest > _MAX_EXPRESSION_CHARS:
      raise _bad(self, "num_operands", n, f"with max_value={m} an expression can be {longest} "
                 f"characters; the calculator takes at most {_MAX_EXPRESSION_CHARS} (lower "
                 "num_operands or max_value)")
    largest = max(n * m, m ** n if "*" in self.ops else 0)  # bounds every partial result
    if largest.bit_length() > tools_lib.MAX_DIGITS * 3.33:
      raise _bad(self, "num_operands", n, f"with max_value={m} and ops={self.ops!r} a value "
                 f"can reach {len(str(largest))} digits; the calculator allows "
                 f"{tools_lib.MAX_DIGITS} (lower num_operands or max_value, or drop '*')")
    _check_common(self, 2, "a calculator call and the answer: 2")

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

  def __post_init__(self):
    num_keys = _check_int(self, "num_keys", 1, 26**4, " (distinct 4-letter keys)")
    hops = _check_int(self, "hops", 1)
    if hops > num_keys:
      raise _bad(self, "hops", hops, f"must be <= num_keys={num_keys} (the chain visits "
                 "distinct keys; raise num_keys or lower hops)")
    _check_common(self, hops + 1, f"hops={hops} lookups and the answer: {hops + 1}")

  def sample(self, rng: np.random.Generator) -> Task:
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < self.num_keys:
      k = _word(rng)
      if k not in seen:
        keys.append(k)
        seen.add(k)
    store = {k: str(int(rng.integers(1000, 10000))) for k in keys}
    chain = [keys[int(i)] for i in rng.permutation(self.num_keys)[:self.hops]]
    for a, b in zip(chain, chain[1:]):
      store[a] = b
    answer = store[chain[-1]]
    calls = tuple(ToolCall("lookup", {"key": k}) for k in chain)
    return Task(f"follow {self.hops} lookups from {chain[0]}", tools_lib.ToolBox(
        [tools_lib.lookup(store)]), exact(answer), (calls, answer), answer)


_PASSKEY_MAX_START = 200_000  # the document starts at a random character below this


@functools.lru_cache(maxsize=16)
def _stdlib_shortfall(doc_chars: int) -> str | None:
  """None when the standard library's sources hold `doc_chars` characters from every start
  `PasskeyEnv.sample` draws, else why not (reads the sources once per value)."""
  try:
    tools_lib.stdlib_document(doc_chars, start=_PASSKEY_MAX_START - 1)
  except ValueError as e:
    return f"too long: documents start anywhere below {_PASSKEY_MAX_START} and {e}"
  return None


@dataclasses.dataclass(frozen=True)
class PasskeyEnv:
  """A 5-digit pass key inserted at a random line of `doc_chars` characters of real text."""

  doc_chars: int = 20_000
  max_steps: int = 3
  name: str = "passkey"

  def __post_init__(self):
    chars = _check_int(self, "doc_chars", 1)
    problem = _stdlib_shortfall(chars)
    if problem:
      raise _bad(self, "doc_chars", chars, problem)
    _check_common(self, 2, "a search and the answer: 2")

  def sample(self, rng: np.random.Generator) -> Task:
    doc = tools_lib.stdlib_document(self.doc_chars,
                                    start=int(rng.integers(0, _PASSKEY_MAX_START)))
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


# The program a code answer is graded by. Its first line (a comment, so in no code object's
# constants) carries the secret: a nonce drawn for this one evaluation and the expected results.
# The harness reads that line and deletes its own file (/sandbox/main.py) before the model's code
# runs, makes itself non-dumpable (so no other process of the sandbox may ptrace it) and forks:
# the child drops the secret, runs the model's code in a fresh namespace with `exec` and calls
# `f` on each test input, sending `TYPE:repr` per result down a pipe, where TYPE names the
# result's exact type (`type(r) is int`, ...; anything else fails, so a subclass or an object
# whose `__eq__` always says yes gets nothing). The parent, which never runs model code,
# compares those lines with the expected ones and prints the nonce last only when the child
# exited 0 and every line matched. So printing a success marker, exiting (sys.exit, raise
# SystemExit, os._exit) or failing before or during the tests, reading the harness's source or
# looking through the frames, globals and constants of the process the model's code runs in all
# give reward 0 (the parent is PID 1 of the sandbox's PID namespace, so the child cannot kill it;
# were it killed, no nonce would be printed).
# What stays possible in one sandbox (no stronger boundary is claimed): the child is a copy of
# the parent's memory, so the freed bytes of the secret line may still be in it and a program
# that scans its own memory (ctypes) could recover the nonce; the non-dumpable flag is set
# best-effort (through ctypes) and is all that keeps the child from reading the parent; since
# the test inputs are in the child, a program can special-case them (a lookup table) instead of
# computing f. The closed holes are the simple ones a small policy stumbles on under GRPO.
# (%-formatted: the template has no other percent signs; keep _EXACT_TYPES in step with `tags`.)
_HARNESS = r"""# %(secret)s
import os
import sys


def _secret_line():
  path = os.path.abspath(__file__)
  with open(path, "rb") as fh:
    line = fh.readline()
  os.unlink(path)
  return line


def _child(write_fd):
  type_, repr_, write, exit_ = type, repr, os.write, os._exit
  tags = ((int, "int"), (str, "str"), (float, "float"), (bool, "bool"), (type(None), "None"))
  status = 1
  try:
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(%(source)s, "answer.py", "exec"), namespace)
    f = namespace["f"]
    lines = []
    for x in %(inputs)s:
      r = f(x)
      t = type_(r)
      tag = None
      for k, name in tags:
        if t is k:
          tag = name
      if tag is None:
        raise TypeError("f returned a " + t.__name__)
      lines.append(tag + ":" + repr_(r))
    data = "\n".join(lines).encode("utf-8")
    while data:
      data = data[write(write_fd, data):]
    status = 0
  except BaseException as e:
    try:
      sys.__stderr__.write("harness: " + type_(e).__name__ + ": " + str(e) + "\n")
    except BaseException:
      pass
  finally:
    try:
      sys.stdout.flush()
    except BaseException:
      pass
    exit_(status)


def _main():
  line = _secret_line()
  try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: not ptrace-able by the child
  except Exception:
    pass
  read_fd, write_fd = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    del line
    os.close(read_fd)
    _child(write_fd)
    os._exit(1)
  os.close(write_fd)
  chunks = []
  while True:
    chunk = os.read(read_fd, 1 << 16)
    if not chunk:
      break
    chunks.append(chunk)
  _, status = os.waitpid(pid, 0)
  nonce, _, expected = bytes.fromhex(line[2:].decode("ascii").strip()).partition(b"\n")
  if status == 0 and b"".join(chunks) == expected:
    os.write(1, b"\n" + nonce + b"\n")


_main()
"""

_EXACT_TYPES = ((int, "int"), (str, "str"), (float, "float"), (bool, "bool"),
                (type(None), "None"))


def _result_line(value: Any) -> str:
  """`TYPE:repr(value)` as the harness writes a result of exactly that type."""
  for tp, tag in _EXACT_TYPES:
    if type(value) is tp:  # pylint: disable=unidiomatic-typecheck
      return f"{tag}:{value!r}"
  raise TypeError(f"a code task's expected result must be one of "
                  f"{[t.__name__ for t, _ in _EXACT_TYPES]}, got {type(value).__name__}")


def _new_nonce() -> str:
  """A fresh secret per evaluation (the harness prints it only when every test passed)."""
  return secrets.token_hex(16)


def _code_reward(inputs: tuple, expected: list) -> Callable[[str], float]:
  """1.0 when the answer's `f` returns, for each of `inputs`, a result of exactly the type of
  the matching `expected` value that equals it (graded by `_HARNESS` in the sandbox: see there
  for what it closes and what stays possible), else 0.0."""
  want = "\n".join(_result_line(v) for v in expected)

  def reward(text: str) -> float:
    nonce = _new_nonce()
    program = _HARNESS % dict(secret=(nonce + "\n" + want).encode("utf-8").hex(),
                              source=repr(text), inputs=repr(list(inputs)))
    res = run_python(program, timeout_s=3.0, memory_mb=256)
    return float(res.ok and res.output.endswith("\n" + nonce + "\n"))

  return reward


@dataclasses.dataclass(frozen=True)
class CodeEnv:
  """Write `def f(x): ...`; the answer is the code, checked by unit tests in the sandbox: the
  answer's `f` must return exactly the expected type and value on every test input, and the
  program must neither exit nor fail (`_code_reward`)."""

  max_steps: int = 3
  name: str = "code"

  def __post_init__(self):
    _check_common(self, 2, "a python call and the answer: 2")

  def sample(self, rng: np.random.Generator) -> Task:
    desc, body, fn, inputs = _CODE_TASKS[int(rng.integers(0, len(_CODE_TASKS)))]
    k = int(rng.integers(2, 10))
    code = f"def f(x):\n  {body.format(k=k)}"
    expected = [fn(x, k) for x in inputs]
    check = ToolCall("python", {"code": f"{code}\nprint(f({inputs[1]!r}))"})
    box = tools_lib.ToolBox([tools_lib.python(timeout_s=3.0, memory_mb=256)])
    return Task(f"write {desc.format(k=k)}", box, _code_reward(inputs, expected),
                ((check,), code), code)


ENVS = {"arithmetic": ArithmeticEnv, "lookup": LookupEnv, "passkey": PasskeyEnv,
        "code": CodeEnv}


def make_env(env_name: str, /, **overrides: Any):
  """The environment `env_name` (a key of ENVS) with `overrides` for its settings (what
  RLConfig.env_overrides holds). Raises ValueError naming an unknown env or setting (and
  listing the valid ones) or a bad value (the env's own checks)."""
  if env_name not in ENVS:
    raise ValueError(f"unknown env {env_name!r}; choose one of {sorted(ENVS)}")
  cls = ENVS[env_name]
  valid = sorted(f.name for f in dataclasses.fields(cls) if f.name != "name")
  unknown = sorted(set(overrides) - set(valid))
  if unknown:
    raise ValueError(f"{cls.__name__} ({env_name!r}) has no setting "
                     f"{', '.join(map(repr, unknown))}; its env_overrides are {', '.join(valid)}")
  return cls(**overrides)
