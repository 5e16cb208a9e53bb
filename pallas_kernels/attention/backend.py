"""Which softmax-attention backend "auto" means on the current platform."""

from __future__ import annotations

import importlib.util

import jax

from pallas_kernels.platform import compute_capability


MIN_TOKAMAX_CC = 9.0  # tokamax's Mosaic GPU attention backward needs sm90 or sm100


def resolve_backend(backend: str, device=None) -> str:
  """The backend `backend` names: "auto" is "tokamax" on an NVIDIA GPU of compute capability
  >= 9.0 (Hopper, Blackwell) where tokamax is installed, "splash" on a TPU, "xla_chunked"
  elsewhere (older GPUs included: tokamax 0.0.17 runs their forward but raises in the
  backward, at gradient time); any other name is returned as it is (the callers validate it:
  `sparse_lm.model.attention.dot_product_attention`, `ModelConfig`). `device`: default
  `jax.devices()[0]`."""
  if backend != "auto":
    return backend
  device = jax.devices()[0] if device is None else device
  if (compute_capability(device) >= MIN_TOKAMAX_CC
      and importlib.util.find_spec("tokamax") is not None):
    return "tokamax"
  if device.platform == "tpu":
    return "splash"
  return "xla_chunked"
