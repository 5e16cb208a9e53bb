"""What the rollout tests share: a small BPE tokenizer of arithmetic tool-call transcripts and a
scripted engine that plays fixed turns instead of sampling (no model, nothing compiled)."""

import dataclasses

import numpy as np

from sparse_lm.data.tokenizer import train_bpe
from sparse_lm.rl import envs
from sparse_lm.rl.format import format_call

SCRIPTED_LOGPROB = -0.5  # the log-probability the scripted engine gives every token it writes


def arithmetic_tokenizer(seed: int, texts: int = 300, vocab_size: int = 400):
  """A BPE tokenizer trained on `texts` arithmetic prompts, calculator calls and answers."""
  rng = np.random.default_rng(seed)
  corpus = []
  for _ in range(texts):
    t = envs.ArithmeticEnv().sample(rng)
    corpus.append(t.prompt + format_call("calculator", {"expression": t.prompt[:-2]}) + t.answer)
  return train_bpe(iter(corpus), vocab_size)


@dataclasses.dataclass
class Out:
  tokens: list
  logprobs: list
  state: object


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 1.0
  top_p: float = 1.0
  stop_tokens: tuple = ()


class ScriptedEngine:
  """Plays the text `turns[i]` at its i-th call, for every row (cut to max_new_tokens).

  Records each call's (prompts, states, sampling) in `calls` and its seed in `seeds`; the state
  it returns after call n is ("state", n)."""

  def __init__(self, tok, turns):
    self.tok, self.turns, self.calls, self.seeds = tok, turns, [], []

  def generate(self, prompts, *, max_new_tokens, sampling, seed, states=None):
    self.calls.append((prompts, states, sampling))
    self.seeds.append(seed)
    turn = self.turns[len(self.calls) - 1]
    ids = self.tok.encode(turn, allow_special=True)[:max_new_tokens]
    return [Out(ids, [SCRIPTED_LOGPROB] * len(ids), ("state", len(self.calls)))
            for _ in prompts]
