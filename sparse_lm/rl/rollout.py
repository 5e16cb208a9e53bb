"""Episodes: the model, its tools and the environment, turn by turn (format.py's protocol).

`run_episodes` drives the inference engine (`sparse_lm.inference.Engine`, used only through
its public `generate`) over a batch of tasks: each turn generates every live episode's next
model turn in one call, continuing each episode's kept engine state with the new observation
tokens (no re-reading of the history), parses the turn, runs the tool and appends its result.
An episode ends on a final answer (reward = the task's check) or when its step budget or the
length limit is spent (reward 0).

`transcript` writes the reference solution of a task in the same format (tools really run), the
SFT warm-up data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from sparse_lm.rl import format as fmt
from sparse_lm.rl.envs import Task
from sparse_lm.rl.sandbox import ToolResult


@dataclasses.dataclass
class Episode:
  """One episode as a token sequence.

  tokens: every id (prompt, model turns, observations); `generated[i]` is True where the model
  wrote tokens[i] (the loss trains only there); `logprobs[i]` the engine's log p of it (nats,
  0.0 elsewhere). `answer` is the final answer text (None if none was given); `found_answer`
  is True once a tool returned exactly the task's answer (the call was right, whatever the
  final answer: what a partial-credit reward pays for).
  """

  tokens: list[int]
  generated: list[bool]
  logprobs: list[float]
  reward: float = 0.0
  answer: str | None = None
  num_calls: int = 0
  num_errors: int = 0
  steps: int = 0
  found_answer: bool = False
  done: bool = False
  state: Any = None

  @property
  def success(self) -> bool:
    return self.reward >= 1.0


def prompt_ids(tok, task: Task) -> list[int]:
  """`<bos>TASK\\n` as ids."""
  return [tok.bos_id] + tok.encode(task.prompt + "\n")


def observation_ids(tok, result: ToolResult) -> list[int]:
  """`<tool_result>text</tool_result>` (failures as 'error: ...'); the text is encoded without
  special tokens, so a tool's output cannot close the span early."""
  text = result.output.strip() if result.ok else fmt.ERROR_PREFIX + (result.error or "")
  return [tok.tool_result_id] + tok.encode(text[:500]) + [tok.tool_result_end_id]


def step_observation(task: Task, turn_text: str) -> tuple[str | None, ToolResult | None, bool]:
  """(final answer or None, tool result or None, the turn was malformed)."""
  parsed = fmt.parse_turn(turn_text)
  if isinstance(parsed, fmt.FinalAnswer):
    return parsed.text, None, False
  if isinstance(parsed, fmt.ParseError):
    return None, ToolResult(False, "", parsed.message), True
  result = task.tools.call(parsed)
  return None, result, not result.ok


def transcript(tok, task: Task) -> tuple[list[int], list[bool]]:
  """The reference solution as (ids, generated mask): each call really runs its tool."""
  ids, gen = prompt_ids(tok, task), None
  gen = [False] * len(ids)
  calls, answer = task.solution
  for call in calls:
    turn = tok.encode(fmt.format_call(call.name, call.arguments), allow_special=True)
    obs = observation_ids(tok, task.tools.call(call))
    ids += turn + obs
    gen += [True] * len(turn) + [False] * len(obs)
  final = tok.encode(answer) + [tok.eos_id]
  return ids + final, gen + [True] * len(final)


def _sampling_params(sampling_cls, *, temperature: float, top_p: float, stop: Sequence[int]):
  """SamplingParams with the stop tokens under whichever field name the engine uses."""
  fields = {f.name for f in dataclasses.fields(sampling_cls)}
  name = next((n for n in ("stop_tokens", "stop_token_ids", "stop_ids", "stop") if n in fields),
              None)
  if name is None:
    raise TypeError(f"{sampling_cls.__name__} has no stop-token field: {sorted(fields)}")
  return sampling_cls(temperature=temperature, top_p=top_p, **{name: tuple(stop)})


def run_episodes(engine, tok, tasks: Sequence[Task], *, max_steps: int, max_turn_tokens: int,
                 max_length: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, sampling_cls=None) -> list[Episode]:
  """Run one episode per task (batched through the engine) and score them.

  Args:
    engine: has `generate(prompts, max_new_tokens=, sampling=, seed=, states=)` returning
      outputs with `.tokens`, `.logprobs`, `.state` (sparse_lm.inference.Engine).
    tok: the tokenizer (special ids of format.py).
    tasks: one per episode (repeat a task G times for a GRPO group).
    max_steps: model turns per episode; max_turn_tokens: new tokens per turn.
    max_length: an episode whose next turn could exceed this many tokens ends (reward 0);
      episodes never hold more than max_length tokens.
    temperature, top_p, seed: sampling (seed + turn index per turn).
    sampling_cls: the engine's SamplingParams (default: sparse_lm.inference.SamplingParams).
  """
  if sampling_cls is None:
    from sparse_lm.inference import SamplingParams as sampling_cls  # pylint: disable=import-outside-toplevel
  sampling = _sampling_params(sampling_cls, temperature=temperature, top_p=top_p,
                              stop=(tok.tool_call_end_id, tok.eos_id))
  episodes = []
  for task in tasks:
    ids = prompt_ids(tok, task)
    episodes.append(Episode(tokens=list(ids), generated=[False] * len(ids),
                            logprobs=[0.0] * len(ids)))
  pending = {i: list(e.tokens) for i, e in enumerate(episodes)}  # new tokens to feed
  for turn in range(max_steps):
    live = [i for i in pending if len(episodes[i].tokens) + max_turn_tokens <= max_length]
    for i in set(pending) - set(live):
      episodes[i].done = True
    if not live:
      break
    first = episodes[live[0]].state is None
    outs = engine.generate([pending[i] for i in live], max_new_tokens=max_turn_tokens,
                           sampling=sampling, seed=seed + turn,
                           states=None if first else [episodes[i].state for i in live])
    pending = {}
    for i, out in zip(live, outs):
      ep, task = episodes[i], tasks[i]
      new = [int(t) for t in out.tokens]
      ep.tokens += new
      ep.generated += [True] * len(new)
      ep.logprobs += [float(x) for x in out.logprobs]
      ep.state, ep.steps = out.state, ep.steps + 1
      answer, result, malformed = step_observation(task, tok.decode(new))
      if answer is not None:
        ep.answer, ep.reward, ep.done = answer, task.reward(answer), True
        continue
      ep.num_calls += 1
      ep.num_errors += int(malformed)
      ep.found_answer |= result.ok and result.output.strip() == task.answer
      obs = observation_ids(tok, result)
      if ep.steps >= max_steps or len(ep.tokens) + len(obs) + max_turn_tokens > max_length:
        ep.done = True  # no turn follows, so the observation is not appended
        continue
      ep.tokens += obs
      ep.generated += [False] * len(obs)
      ep.logprobs += [0.0] * len(obs)
      pending[i] = obs
  for ep in episodes:
    ep.done, ep.state = True, None  # drop the engine states (memory)
  return episodes
