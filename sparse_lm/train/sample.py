"""A short generated sample at the end of a stage (full recompute; not the serving path).

Each new token re-runs the whole fixed-length buffer through the model (one compile, since the
buffer's shape never changes); the model is causal, so the padding after the cursor does not
influence the logits read at the cursor. O(n^2) work, fine for a few dozen tokens.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef: nnx.GraphDef, params: nnx.State, model_vars: nnx.State,
             prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, pad_id: int = 0, eos_id: int | None = None,
             length_multiple: int = 64) -> list[int]:
  """Continue `prompt` (token ids) by up to `max_new_tokens` tokens.

  temperature 0 = greedy; otherwise sample from softmax(logits / temperature). Stops at
  `eos_id`. Returns only the new token ids.
  """
  prompt = list(prompt) or [pad_id]
  total = len(prompt) + max_new_tokens
  total = -(-total // length_multiple) * length_multiple

  @jax.jit
  def next_token(params, model_vars, tokens, cursor, key):
    model = nnx.merge(graphdef, params, model_vars)
    logits = model(tokens, train=False)[0]  # [T, V]
    row = jax.lax.dynamic_index_in_dim(logits, cursor, keepdims=False).astype(jnp.float32)
    if temperature <= 0:
      return jnp.argmax(row).astype(jnp.int32)
    return jax.random.categorical(key, row / temperature).astype(jnp.int32)

  buf = np.full((1, total), pad_id, np.int32)
  buf[0, :len(prompt)] = prompt
  key = jax.random.PRNGKey(seed)
  out = []
  for cursor in range(len(prompt) - 1, len(prompt) - 1 + max_new_tokens):
    key, sub = jax.random.split(key)
    tok = int(next_token(params, model_vars, jnp.asarray(buf), cursor, sub))
    if eos_id is not None and tok == eos_id:
      break
    buf[0, cursor + 1] = tok
    out.append(tok)
  return out
