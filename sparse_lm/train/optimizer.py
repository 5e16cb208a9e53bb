"""AdamW with a warmup-stable-decay schedule, global-norm clipping and masked weight decay.

The optimizer works on the model's `nnx.Param` leaves only (fp32 master weights, since
`ModelConfig.param_dtype` is float32; the model casts to the bf16 compute dtype itself). The
balancer buffers of §6 are other `nnx.Variable` kinds and never reach it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax

# Parameters with a path component matching one of these get no weight decay: norms and their
# scales (attn_norm/scale, latent_norm, o_norm), biases, the KDA decay parameters (A_log,
# dt_bias) and the AttnRes pseudo-queries (attn_query, ffn_query, final_query). Matching is by
# name because scanned layers stack a leading layer axis onto every parameter, so a norm scale
# is 2-D there; unstacked 1-D parameters are exempt whatever their name.
NO_DECAY_PATTERNS = (r"norm", r"bias", r"A_log", r"scale", r"query")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW and its learning-rate schedule.

  The schedule is warmup-stable-decay (WSD): linear warmup from 0 to `peak_lr` over
  `warmup_steps`, constant, then a linear decay to `min_lr_ratio * peak_lr` over the last
  `decay_fraction` of the stage's steps (Hu et al., MiniCPM, arXiv 2404.06395, §4).
  """

  peak_lr: float = 3e-4
  warmup_steps: int = 100
  decay_fraction: float = 0.2
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0


def wsd_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Learning rate (float32 scalar) as a function of the step, for a stage of `total_steps`."""
  warmup = max(0, min(cfg.warmup_steps, total_steps))
  decay = int(round(cfg.decay_fraction * total_steps))
  decay = max(0, min(decay, total_steps - warmup))
  stable = total_steps - warmup - decay
  peak, floor = cfg.peak_lr, cfg.peak_lr * cfg.min_lr_ratio

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(1.0, (step + 1.0) / max(warmup, 1))
    frac = jnp.clip((step - warmup - stable) / max(decay, 1), 0.0, 1.0)
    cooled = peak + (floor - peak) * frac
    return jnp.where(step < warmup, warm, cooled)

  return schedule


def _path_name(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return "/".join(p for p in parts if p != "value")


def decay_mask(params):
  """A pytree of bools like `params`: True where weight decay applies."""
  patterns = [re.compile(p) for p in NO_DECAY_PATTERNS]

  def leaf(path, x):
    name = _path_name(path)
    if jnp.ndim(x) < 2:
      return False
    return not any(p.search(part) for part in name.split("/") for p in patterns)

  return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW with the WSD schedule and the decay mask."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(wsd_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask),
  )
