"""A short generated sample at the end of a stage, through the inference engine.

The engine prefills the prompt through the chunked paths and decodes from the KDA states and
the MLA latent cache (sparse_lm.inference), the same code that serves RL rollouts and the
`python -m sparse_lm.generate` CLI.
"""

from __future__ import annotations

from typing import Sequence

from flax import nnx


def generate(graphdef: nnx.GraphDef, params: nnx.State, model_vars: nnx.State,
             prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, pad_id: int = 0, eos_id: int | None = None,
             length_multiple: int = 64, mesh=None) -> list[int]:
  """Continue `prompt` (token ids) by up to `max_new_tokens` tokens.

  temperature 0 = greedy; otherwise sample from softmax(logits / temperature). Stops at
  `eos_id` (not returned). An empty prompt starts from `pad_id`. Returns only the new token ids.
  `length_multiple` rounds the engine's max_length (fewer distinct compiled shapes). `mesh`:
  the devices to generate on (default: the active `sharding.use_mesh` mesh); on more than one
  device the engine keeps the weights sharded as the rules place them (`Engine(mesh=...)`).
  """
  from sparse_lm.inference import Engine, SamplingParams

  prompt = list(prompt) or [pad_id]
  total = len(prompt) + max_new_tokens
  total = -(-total // length_multiple) * length_multiple
  model = nnx.merge(graphdef, params, model_vars)
  engine = Engine(model, max_length=total, max_batch=1, prefill_chunk=min(total, 512),
                  mesh=mesh)
  stops = () if eos_id is None else (eos_id,)
  out = engine.generate([prompt], max_new_tokens=max_new_tokens, seed=seed,
                        sampling=SamplingParams(temperature=temperature, stop_tokens=stops))[0]
  tokens = out.tokens
  return tokens[:-1] if out.finish_reason == "stop" else tokens
