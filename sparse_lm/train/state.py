"""The training state: one pytree holding everything a step reads and writes.

The model is split once into a static `GraphDef` (kept outside the state, closed over by the
jitted step) and two `nnx.State`s: the trainable `nnx.Param`s (fp32 master weights) and every
other variable (the Quantile Balancing biases and histograms of §6, RNG counters). Both are
saved in checkpoints; only the params reach the optimizer.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class TrainState(flax.struct.PyTreeNode):
  """step (int32 scalar), params, model_vars (non-Param variables), opt_state, rng (uint32[2])."""

  step: jax.Array
  params: nnx.State
  model_vars: nnx.State
  opt_state: optax.OptState
  rng: jax.Array


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, params, other variables) of an NNX model."""
  return nnx.split(model, nnx.Param, ...)


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, model_vars: nnx.State):
  """The NNX model of `split_model`'s three parts (the inverse of `split_model`)."""
  return nnx.merge(graphdef, params, model_vars)


def make_init_fn(model_factory: Callable[[int], nnx.Module], tx: optax.GradientTransformation,
                 seed: int) -> Callable[[], TrainState]:
  """A function of no arguments building a fresh TrainState (jit it with out_shardings)."""

  def init() -> TrainState:
    model = model_factory(seed)
    _, params, model_vars = split_model(model)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_vars=model_vars,
                      opt_state=tx.init(params),
                      rng=jax.random.PRNGKey(seed + 1))

  return init


def graphdef_of(model_factory: Callable[[int], nnx.Module], seed: int) -> nnx.GraphDef:
  """The static graph of the model, without allocating its arrays."""
  box: dict[str, Any] = {}

  def build():
    graphdef, params, model_vars = split_model(model_factory(seed))
    box["graphdef"] = graphdef
    return params, model_vars

  jax.eval_shape(build)
  return box["graphdef"]
