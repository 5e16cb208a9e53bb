"""Which softmax-attention backend "auto" means on the current platform."""

from __future__ import annotations

import importlib.util

import jax


def resolve_backend(backend: str) -> str:
  """The backend `backend` names: "auto" is "tokamax" on a GPU where tokamax is installed,
  "splash" on a TPU, "xla_chunked" elsewhere; any other name is returned as it is (the callers
  validate it: `sparse_lm.model.attention.dot_product_attention`, `ModelConfig`)."""
  if backend != "auto":
    return backend
  platform = jax.default_backend()
  if platform == "gpu" and importlib.util.find_spec("tokamax") is not None:
    return "tokamax"
  if platform == "tpu":
    return "splash"
  return "xla_chunked"
