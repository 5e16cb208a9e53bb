"""The tool-call format of agentic episodes, and a parser that never raises.

An episode is one token sequence; the special tokens are the tokenizer's reserved ids
(`sparse_lm.data.tokenizer.SPECIAL_TOKENS`, so no vocabulary change is needed):

    <bos>TASK\\n
    <tool_call>NAME {"arg": value, ...}</tool_call>      <- written by the model
    <tool_result>TEXT</tool_result>                      <- written by the environment
    ... more calls ...
    ANSWER<eos>                                          <- written by the model

A model turn is generated until `</tool_call>` or `<eos>` (the engine's stop tokens):
  * a turn holding `<tool_call>` is a call: the tool's name, one space, then its arguments as a
    JSON object; text before `<tool_call>` is free reasoning;
  * a turn ending in `<eos>` without a call is the final answer (its text, stripped);
  * anything else is malformed, and the model sees the problem as an observation
    `<tool_result>error: ...</tool_result>` (tool failures read the same way), so a bad call
    costs a step of the budget, never the run.
Only the model's own tokens are trained on: the task and every `<tool_result>...</tool_result>`
span are masked out of the loss (`loss_mask` 0).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"
END = "<eos>"
ERROR_PREFIX = "error: "


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed call: the tool's `name` and its JSON `arguments` (a dict)."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
  """The episode's answer text (what the reward checks)."""

  text: str


@dataclasses.dataclass(frozen=True)
class ParseError:
  """A malformed turn; `message` is shown to the model as an error observation."""

  message: str


def format_call(name: str, arguments: dict[str, Any]) -> str:
  """The text of a call, `<tool_call>name {json}</tool_call>` (compact JSON)."""
  return f"{CALL_OPEN}{name} {json.dumps(arguments, separators=(', ', ': '))}{CALL_CLOSE}"


def format_result(text: str, *, ok: bool = True) -> str:
  """The observation appended after a call: `<tool_result>text</tool_result>`; failures start
  with 'error: '. Special-token strings inside `text` are encoded as plain characters by the
  tokenizer, so a tool cannot forge the format."""
  return f"{RESULT_OPEN}{text if ok else ERROR_PREFIX + text}{RESULT_CLOSE}"


def parse_turn(text: str) -> ToolCall | FinalAnswer | ParseError:
  """Classify one model turn (decoded with its special tokens written out).

  Never raises: every malformed turn (no call and no `<eos>`, a call that never closes, a call
  without a name, arguments that are not a JSON object) is a `ParseError` naming the fix.
  Unknown tools and wrong arguments are checked by the tool box (`tools.ToolBox.call`).
  """
  if CALL_OPEN in text:
    body = text.split(CALL_OPEN, 1)[1]
    if CALL_CLOSE not in body:
      return ParseError(f"unclosed tool call: end it with {CALL_CLOSE}")
    body = body.split(CALL_CLOSE, 1)[0].strip()
    name, _, raw = body.partition(" ")
    if not name or name.startswith("{"):
      return ParseError(f'tool call without a name: write {CALL_OPEN}NAME {{"arg": ...}}'
                        f"{CALL_CLOSE}")
    raw = raw.strip() or "{}"
    try:
      arguments = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
      return ParseError(f"arguments of {name!r} are not valid JSON ({str(e)[:80]})")
    if not isinstance(arguments, dict):
      return ParseError(f"arguments of {name!r} must be a JSON object, got "
                        f"{type(arguments).__name__}")
    return ToolCall(name, arguments)
  if text.endswith(END):
    return FinalAnswer(text[:-len(END)].strip())
  return ParseError(f"no tool call and no final answer: end a call with {CALL_CLOSE} or the "
                    f"answer with {END}")
