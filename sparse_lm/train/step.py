"""The pure train and eval steps (jit them with shardings and donation in the loop).

`train_step(state, batch) -> (state, metrics)`:
  1. split the global batch [micro_batches * b, T] into micro-batches and scan over them,
     summing in fp32 each micro-batch's gradient of (its mean loss x its target-token count)
     and the counts, threading the model's non-Param variables (the Quantile Balancing
     histograms accumulate over all micro-batches, ARCHITECTURE.md §6 step 4); dividing once
     by the total count gives exactly the one-batch mean-per-token loss and gradient, however
     unevenly the target tokens fall among the micro-batches (SFT, RL, padding);
  2. clip + AdamW (optimizer.py) on that gradient;
  3. after the optimizer step, `update_balancers` turns the histograms into new biases (§6
     step 5) on the merged model.
A step whose loss or gradient norm is not finite leaves the state unchanged and reports
`finite = False`; the loop stops on it (it never saves such a state).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparse_lm.train.state import TrainState

Batch = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def _token_weighted(metrics: dict[str, jax.Array], weights: jax.Array) -> dict[str, jax.Array]:
  """Combine per-micro-batch metrics (leading axis) as one batch would report them.

  Per-token means (loss, z_loss, accuracy, ...) are weighted by each micro-batch's token count
  `weights` [M]; `num_tokens` is summed. Per-layer arrays are weighted the same way.
  """
  total = jnp.sum(weights)
  safe = jnp.where(total > 0, total, 1.0)
  out = {}
  for k, v in metrics.items():
    v = jnp.asarray(v, jnp.float32)
    if k in ("num_tokens", "moe/dropped", "moe/assigned"):  # counts: summed
      out[k] = jnp.sum(v, axis=0)
    elif k.endswith("_max"):  # maxima (e.g. moe/recv_rows_max): the max
      out[k] = jnp.max(v, axis=0)
    else:
      w = weights.reshape((-1,) + (1,) * (v.ndim - 1))
      out[k] = jnp.sum(v * w, axis=0) / safe
  return out


def drop_rates(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """With MoE counts "moe/dropped", "moe/assigned" ([MoE layers], summed over micro-batches):
  per-layer "moe/drop_rate" and "moe/drop_rate_total" = dropped / all (token, expert)
  assignments (a ratio of sums, not a mean of ratios). Returns `metrics`."""
  if "moe/dropped" in metrics:
    dropped, assigned = metrics["moe/dropped"], metrics["moe/assigned"]
    metrics["moe/drop_rate"] = dropped / jnp.maximum(assigned, 1.0)
    metrics["moe/drop_rate_total"] = jnp.sum(dropped) / jnp.maximum(jnp.sum(assigned), 1.0)
  return metrics


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, loss_fn: LossFn, *, micro_batches: int = 1,
                    z_loss_coef: float = 0.0,
                    balance_fn: Callable[[nnx.Module], dict[str, Any]] | None = None,
                    nan_at_step: int | None = None):
  """Build `train_step(state, batch) -> (state, metrics)`.

  Args:
    graphdef: the static model graph (state.py).
    tx: the optimizer (optimizer.py); `schedule` its learning rate, reported as a metric.
    loss_fn: `loss_fn(model, batch, *, train, z_loss_coef) -> (loss, metrics)`, mean nats
      per predicted token.
    micro_batches: gradient-accumulation factor; the batch's leading size must divide by it.
    balance_fn: `update_balancers(model) -> metrics`, applied after the optimizer update.
    nan_at_step: fault injection for tests: the loss of this step is made NaN.

  Batch: int32 [B, T] arrays `tokens`, `segment_ids`, `positions`, `loss_mask` (any extra
  keys pass through to `loss_fn`).
  Metrics: float32 `objective` (the differentiated loss, per counted token over the whole
  batch), `grad_norm`, `lr`, `finite`; the loss function's own metrics combined over
  micro-batches as one batch would report them (weighted by `num_tokens`, which is summed;
  `loss` is its mean NLL when it reports one, else the objective; per-layer arrays stay
  arrays); and the balancer's.
  """

  def micro_loss(params, model_vars, micro_batch):
    """(mean loss x token count, (mean loss, token count, metrics, new model vars)); the count
    is `metrics["num_tokens"]` (1 when the loss function reports none: equal weights)."""
    model = nnx.merge(graphdef, params, model_vars, copy=True)
    loss, metrics = loss_fn(model, micro_batch, train=True, z_loss_coef=z_loss_coef)
    _, _, new_vars = nnx.split(model, nnx.Param, ...)
    count = jax.lax.stop_gradient(jnp.asarray(metrics.get("num_tokens", 1.0), jnp.float32))
    return loss * count, (loss, count, metrics, new_vars)

  def mean_loss(params, model_vars, batch):
    model = nnx.merge(graphdef, params, model_vars, copy=True)
    loss, metrics = loss_fn(model, batch, train=True, z_loss_coef=z_loss_coef)
    _, _, new_vars = nnx.split(model, nnx.Param, ...)
    return loss, (metrics, new_vars)

  weighted_grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  grad_fn = jax.value_and_grad(mean_loss, has_aux=True)

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    def split(x):
      if x.shape[0] % micro_batches:
        raise ValueError(f"batch size {x.shape[0]} does not divide into {micro_batches} "
                         "micro-batches")
      return x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])

    def accumulate(carry, micro_batch):
      grads_sum, count_sum, model_vars = carry
      (_, (loss, count, metrics, model_vars)), grads = weighted_grad_fn(
          state.params, model_vars, micro_batch)
      grads_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_sum, grads)
      return (grads_sum, count_sum + count, model_vars), (loss, count, metrics)

    if micro_batches == 1:  # no accumulator: one parameter-sized fp32 buffer less
      (loss, (metrics, model_vars)), grads = grad_fn(state.params, state.model_vars, batch)
      metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    else:
      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
      (grads, count, model_vars), (losses, counts, loss_metrics) = jax.lax.scan(
          accumulate, (zeros, jnp.zeros((), jnp.float32), state.model_vars),
          jax.tree.map(split, batch))
      # Divide once by the total count (0 counted tokens: the gradient sums are 0 too).
      count = jnp.where(count > 0, count, 1.0)
      grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, state.params)
      loss = jnp.sum(losses * counts) / count
      metrics = _token_weighted(loss_metrics, counts)
    metrics = drop_rates(metrics)
    if nan_at_step is not None:
      poison = jnp.where(state.step == nan_at_step, jnp.nan, 0.0)
      loss = loss + poison
      if "loss" in metrics:
        metrics["loss"] = metrics["loss"] + poison

    with jax.named_scope("optimizer"):  # the scope labels profiles; it changes no value
      grad_norm = optax.global_norm(grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)

    balance_metrics = {}
    if balance_fn is not None:
      with jax.named_scope("balancer_update"):
        model = nnx.merge(graphdef, params, model_vars, copy=True)
        balance_metrics = balance_fn(model) or {}
        _, params, model_vars = nnx.split(model, nnx.Param, ...)

    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(
        step=state.step + jnp.where(finite, 1, 0).astype(state.step.dtype),
        params=keep(params, state.params), model_vars=keep(model_vars, state.model_vars),
        opt_state=keep(opt_state, state.opt_state),
        rng=jnp.where(finite, jax.random.fold_in(state.rng, state.step), state.rng))
    metrics = {"loss": loss, **metrics, **balance_metrics, "objective": loss,
               "grad_norm": grad_norm, "lr": schedule(state.step),
               "finite": finite.astype(jnp.float32)}
    return new_state, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn):
  """Build `eval_step(state, batch) -> {"loss_sum", "tokens"}` (nats summed, token count),
  plus the MoE drop counts "moe/dropped", "moe/assigned" ([MoE layers]) when the loss
  function reports them (sum them over batches for the held-out drop rate).

  The loss is the mean next-token NLL (`metrics["loss"]` of the loss function, without z-loss
  or aux loss) weighted by the tokens it counted (`metrics["num_tokens"]`). The model runs with
  train=False, so balancer buffers are read, never written (§6 step 6). Sum these over batches
  and divide for the mean held-out loss in nats per token.
  """

  def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, state.params, state.model_vars, copy=True)
    total, metrics = loss_fn(model, batch, train=False)
    nll = metrics.get("loss", total).astype(jnp.float32)
    tokens = metrics["num_tokens"] if "num_tokens" in metrics else jnp.sum(
        batch["loss_mask"].astype(jnp.float32))
    out = {"loss_sum": nll * tokens, "tokens": tokens.astype(jnp.float32)}
    out.update({k: metrics[k] for k in ("moe/dropped", "moe/assigned") if k in metrics})
    return out

  return eval_step
