"""The tools an agent can call: calculator, lookup, search and python.

Each `Tool` declares its argument names and JSON types; `ToolBox.call` checks a parsed call
against them and runs the tool, turning every failure (unknown tool, missing, extra or
mistyped argument, an exception inside the tool) into a failed `ToolResult`, so an episode never
crashes on model output.
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import operator
import os
import re
import sysconfig
from typing import Callable

from sparse_lm.rl.format import ToolCall
from sparse_lm.rl.sandbox import ToolResult, run_python


@dataclasses.dataclass(frozen=True)
class Tool:
  """`fn(**arguments) -> ToolResult`; `params` maps each argument to its Python type."""

  name: str
  description: str
  params: dict[str, type]
  fn: Callable[..., ToolResult]


class ToolBox:
  """The tools of an environment, by name."""

  def __init__(self, tools: list[Tool]):
    self.tools = {t.name: t for t in tools}

  def call(self, call: ToolCall) -> ToolResult:
    """Run `call`; never raises (see the module docstring)."""
    tool = self.tools.get(call.name)
    if tool is None:
      return ToolResult(False, "", f"unknown tool {call.name!r}; tools: "
                        f"{', '.join(sorted(self.tools))}")
    missing = sorted(set(tool.params) - set(call.arguments))
    extra = sorted(set(call.arguments) - set(tool.params))
    if missing or extra:
      return ToolResult(False, "", f"{call.name} takes {sorted(tool.params)}; missing "
                        f"{missing}, unexpected {extra}")
    for key, tp in tool.params.items():
      value = call.arguments[key]
      if not isinstance(value, tp) or isinstance(value, bool) and tp is not bool:
        return ToolResult(False, "", f"{call.name}: argument {key!r} must be a "
                          f"{tp.__name__}, got {type(value).__name__}")
    try:
      return tool.fn(**call.arguments)
    except Exception as e:  # pylint: disable=broad-except  (a tool failure is an observation)
      return ToolResult(False, "", f"{call.name} failed: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_DIGITS = 200


def evaluate(expression: str) -> fractions.Fraction:
  """Exact value of an arithmetic expression: numbers, + - * / // % **, parentheses.

  Walks the Python AST over `fractions.Fraction` (no `eval`): decimals are exact
  ("0.1" is 1/10). Raises ValueError on anything else (names, calls, attributes), on a
  non-integer exponent or one above MAX_EXPONENT, on a result over MAX_DIGITS digits, and
  ZeroDivisionError on division by zero.
  """
  if len(expression) > 500:
    raise ValueError("expression longer than 500 characters")
  tree = ast.parse(expression.strip(), mode="eval")

  def walk(node) -> fractions.Fraction:
    if isinstance(node, ast.Expression):
      return walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return fractions.Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = walk(node.left), walk(node.right)
      if isinstance(node.op, ast.Pow):
        if right.denominator != 1 or abs(right) > MAX_EXPONENT:
          raise ValueError(f"exponent must be an integer of at most {MAX_EXPONENT}")
        right = int(right)
      value = _BINARY[type(node.op)](left, right)
      if max(abs(value.numerator), value.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
      return fractions.Fraction(value)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

  return walk(tree)


def format_number(value: fractions.Fraction) -> str:
  """An integer as digits, other rationals as 'p/q'."""
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _calculator(expression: str) -> ToolResult:
  try:
    return ToolResult(True, format_number(evaluate(expression)))
  except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as e:
    return ToolResult(False, "", f"calculator: {type(e).__name__}: {e}")


def calculator() -> Tool:
  return Tool("calculator", "exact arithmetic: + - * / // % ** and parentheses",
              {"expression": str}, _calculator)


# ----------------------------------------------------------------------------- lookup
def lookup(store: dict[str, str]) -> Tool:
  """`lookup {"key": K}` -> the value stored under K in `store` (a generated key-value store)."""

  def fn(key: str) -> ToolResult:
    if key not in store:
      return ToolResult(False, "", f"no key {key!r}")
    return ToolResult(True, store[key])

  return Tool("lookup", "value stored under a key", {"key": str}, fn)


# ----------------------------------------------------------------------------- search
def stdlib_document(num_chars: int, *, start: int = 0) -> str:
  """A long real text: the Python standard library's own sources (sorted `*.py` files of
  `sysconfig.get_paths()['stdlib']`, concatenated with a header per file), characters
  [start, start + num_chars). Raises ValueError if the library is shorter than asked."""
  root = sysconfig.get_paths()["stdlib"]
  parts, total = [], 0
  for name in sorted(os.listdir(root)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
      text = f"# ==== {name} ====\n" + f.read()
    parts.append(text)
    total += len(text)
    if total >= start + num_chars:
      break
  doc = "".join(parts)[start:start + num_chars]
  if len(doc) < num_chars:
    raise ValueError(f"the standard library under {root} has only {len(doc)} characters")
  return doc


def passages(document: str, *, lines_per_passage: int = 8) -> list[str]:
  """The document cut into passages of `lines_per_passage` lines."""
  lines = document.splitlines()
  return ["\n".join(lines[i:i + lines_per_passage])
          for i in range(0, len(lines), lines_per_passage)]


def search(document: str, *, top_k: int = 2, lines_per_passage: int = 8,
           max_chars: int = 400) -> Tool:
  """`search {"query": Q}` -> the `top_k` passages that contain Q verbatim (case-insensitive)
  first, then those sharing the most words with Q (ties: earlier first), each cut to
  `max_chars` characters around its first hit."""
  chunks = passages(document, lines_per_passage=lines_per_passage)
  lowered = [" ".join(c.lower().split()) for c in chunks]
  words = [set(re.findall(r"\w+", c)) for c in lowered]

  def excerpt(chunk: str, terms: set[str]) -> str:
    low = chunk.lower()  # the window starts a little before the first hit
    hits = [low.find(t) for t in terms if low.find(t) >= 0]
    start = max(0, min(hits, default=0) - max_chars // 4)
    return chunk[start:start + max_chars]

  def fn(query: str) -> ToolResult:
    terms = set(re.findall(r"\w+", query.lower()))
    if not terms:
      return ToolResult(False, "", "empty query")
    phrase = " ".join(query.lower().split())
    scored = sorted(((phrase not in lowered[i], -len(terms & w), i)
                     for i, w in enumerate(words) if terms & w))
    if not scored:
      return ToolResult(True, "no match")
    return ToolResult(True, "\n---\n".join(excerpt(chunks[i], terms) for *_, i in scored[:top_k]))

  return Tool("search", "passages of the document matching the query", {"query": str}, fn)


# ----------------------------------------------------------------------------- python
def python(*, timeout_s: float = 5.0, memory_mb: int = 512, allow_unsafe: bool = False) -> Tool:
  """`python {"code": C}` -> stdout of C run in the sandbox (`sandbox.run_python`)."""

  def fn(code: str) -> ToolResult:
    return run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, allow_unsafe=allow_unsafe)

  return Tool("python", "run Python code in a sandbox; returns its stdout", {"code": str}, fn)


def describe(box: ToolBox) -> str:
  """One line per tool, for the task prompt."""
  return "\n".join(f"{t.name}({', '.join(t.params)}): {t.description}"
                   for t in box.tools.values())

