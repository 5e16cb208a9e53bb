"""Shared by the engine tests (tests/inference/test_engine.py) and the multi-device engine check
(tests/multidevice/scripts/engine_check.py, a subprocess: this module imports no pytest)."""

import jax
from flax import nnx

from sparse_lm.moe.balancing import BalancerBias


def randomize_balancer_biases(model: nnx.Module, seed: int, scale: float = 0.05) -> None:
  """Set every MoE layer's routing bias (BalancerBias [E] fp32) of `model` in place to
  `scale` x N(0, 1) draws, one key split per layer from jax.random.key(seed), in graph order.

  Non-zero biases make a test route as a trained model does (a fresh model's biases are zero,
  so a path that ignored them would pass unnoticed)."""
  key = jax.random.key(seed)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, BalancerBias):
      key, sub = jax.random.split(key)
      var[...] = scale * jax.random.normal(sub, var[...].shape)
