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
import numpy as np


# Temperatures below this sample greedily (SamplingParams.mode).
GREEDY_BELOW = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the engine picks each new token.

  Attributes:
    temperature: >= 0; 0 = greedy (argmax, ties to the lowest id), and so is any value below
      GREEDY_BELOW (1e-5, as vLLM): logits / T in fp32 would overflow (or divide by a
      subnormal flushed to zero) and the pick would not be the argmax.
    top_k: keep the k most likely tokens; 0 = all.
    top_p: nucleus mass in (0, 1]; 1 = all.
    stop_tokens: token ids (ints; one int is taken as one id) that end a row (the stop token
      is returned, with its log-prob).

  Raises:
    ValueError: a value outside its range (names the field).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: Sequence[int] = ()

  def __post_init__(self):
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise ValueError(f"SamplingParams: {name}={value!r} must be a number")
    if not 0 <= self.temperature < float("inf"):
      raise ValueError(f"SamplingParams: temperature={self.temperature} must be finite and "
                       ">= 0 (0 = greedy)")
    if (not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool)
        or not 0 <= self.top_k < 2**31):
      raise ValueError(f"SamplingParams: top_k={self.top_k!r} must be an int in [0, 2**31) "
                       "(0 = all; a k past the vocabulary keeps all)")
    object.__setattr__(self, "top_k", int(self.top_k))
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams: top_p={self.top_p} must be in (0, 1] (1 = no nucleus "
                       "truncation)")
    stops = self.stop_tokens
    if isinstance(stops, (int, np.integer)) and not isinstance(stops, bool):
      stops = (stops,)  # one stop id
    if (isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__") or not all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in stops)):
      raise ValueError(f"SamplingParams: stop_tokens={self.stop_tokens!r} must be token ids "
                       "(ints), e.g. (tokenizer.eos_id,)")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stops))

  @property
  def mode(self) -> int:
    """0 greedy (temperature < GREEDY_BELOW), 1 plain sampling, 2 sampling with top-k / top-p
    truncation."""
    if self.temperature < GREEDY_BELOW:
      return 0
    return 2 if (self.top_k > 0 or self.top_p < 1) else 1


def sample(logits: jax.Array, keys: jax.Array, *, mode, temperature, top_k,
           top_p) -> tuple[jax.Array, jax.Array]:
  """Pick one token per row.

  Args:
    logits: [B, V] fp32.
    keys: [B] PRNG keys (one per row; greedy ignores them).
    mode: int32 scalar, SamplingParams.mode; temperature, top_k, top_p: scalars. All traced:
      changing the sampling parameters never recompiles (the mode picks a branch at run time,
      so greedy decoding does not pay for the sort).

  Returns:
    tokens [B] int32 and their log-probabilities [B] fp32 under log_softmax(logits).
  """
  V = logits.shape[-1]

  def greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def plain(logits):
    return jax.vmap(jax.random.categorical)(keys, logits / temperature).astype(jnp.int32)

  def truncated(logits):
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / temperature
    keep = jnp.arange(V)[None] < jnp.where(top_k > 0, top_k, V)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the first token always stays
    pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

  tokens = jax.lax.switch(mode, (greedy, plain, truncated), logits)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
