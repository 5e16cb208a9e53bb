"""Sampling parameters and the batched sampler of the engine.

Each token is drawn from softmax(logits / temperature) restricted to the top_k most likely
tokens and then to the smallest set whose probability reaches top_p (nucleus sampling,
Holtzman et al. 2019); temperature 0 is greedy (argmax). The log-probability returned with a
token is always under the model's own distribution, log softmax(logits) at temperature 1 with
no truncation: the quantity a trainer computes for that token (what RL needs), not the
probability under the modified sampling distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the engine picks each new token.

  Attributes:
    temperature: >= 0; 0 = greedy (argmax, ties to the lowest id).
    top_k: keep the k most likely tokens; 0 = all.
    top_p: nucleus mass in (0, 1]; 1 = all.
    stop_tokens: token ids that end a row (the stop token is returned, with its log-prob).

  Raises:
    ValueError: a value outside its range (names the field).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: Sequence[int] = ()

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams: temperature={self.temperature} must be >= 0 "
                       "(0 = greedy)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"SamplingParams: top_k={self.top_k!r} must be an int >= 0 (0 = all)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams: top_p={self.top_p} must be in (0, 1] (1 = no nucleus "
                       "truncation)")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def truncates(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1)


def sample(logits: jax.Array, keys: jax.Array, *, temperature, top_k, top_p, greedy: bool,
           truncates: bool) -> tuple[jax.Array, jax.Array]:
  """Pick one token per row.

  Args:
    logits: [B, V] fp32.
    keys: [B] PRNG keys (one per row; greedy ignores them).
    temperature, top_k, top_p: scalars (traced: changing them does not recompile).
    greedy, truncates: static (SamplingParams.greedy / .truncates).

  Returns:
    tokens [B] int32 and their log-probabilities [B] fp32 under log_softmax(logits).
  """
  logp = jax.nn.log_softmax(logits, axis=-1)
  if greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    scaled = logits / temperature
    if truncates:
      V = logits.shape[-1]
      order = jnp.argsort(-scaled, axis=-1)
      sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
      rank = jnp.arange(V)[None]
      keep = rank < jnp.where(top_k > 0, top_k, V)
      probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
      keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the first token always stays
      sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
      pick = jax.vmap(jax.random.categorical)(keys, sorted_logits)
      tokens = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    else:
      tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
