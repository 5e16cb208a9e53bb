"""Helpers shared by the decode kernels: compiler parameters and shape rules."""

from __future__ import annotations

import jax


def is_pow2(n: int) -> bool:
  """True for a power of two >= 16 (Triton block sizes)."""
  return n >= 16 and n & (n - 1) == 0


def on_gpu() -> bool:
  """Whether the default JAX backend is a GPU (the kernels compile there; elsewhere they
  run only in interpret mode)."""
  return jax.default_backend() == "gpu"


def compiler_params(interpret: bool, num_warps: int = 4, num_stages: int = 1):
  """Triton compiler parameters (warps per program, software-pipelining stages of its loops),
  None in interpret mode."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
