"""AdamW or Muon with a warmup-stable-decay schedule, global-norm clipping, masked weight decay
and QK-clip.

`OptimizerConfig.name` picks the optimizer: "adamw" (every parameter) or "muon" (Muon on the
weight matrices, orthogonalised per attention head and per expert; AdamW on embeddings, the LM
head, norms, gates, biases, the router and every 1-D/0-D leaf; `muon_labels`). With
`qk_clip_threshold` set, the MLA query/key projections are rescaled after each update so that
no head's attention logit passes it (`qk_clip`, Kimi K2's MuonClip).

The optimizer works on the model's `nnx.Param` leaves only (fp32 master weights, since
`ModelConfig.param_dtype` is float32; the model casts to the bf16 compute dtype itself). The
balancer buffers of §6 are other `nnx.Variable` kinds and never reach it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from sparse_lm import nn

# Parameters with a path component matching one of these get no weight decay: norms and their
# scales (attn_norm/scale, latent_norm, o_norm), biases, the KDA decay parameters (A_log,
# dt_bias) and the AttnRes pseudo-queries (attn_query, ffn_query, final_query). Matching is by
# name because scanned layers stack a leading layer axis onto every parameter, so a norm scale
# is 2-D there; unstacked 1-D parameters are exempt whatever their name.
NO_DECAY_PATTERNS = (r"norm", r"bias", r"A_log", r"scale", r"query")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer (AdamW or Muon), its learning-rate schedule and QK-clip.

  name: "adamw" or "muon". Muon (Jordan et al. 2024; optax.contrib.scale_by_muon: Nesterov
  momentum `muon_beta`, `muon_ns_steps` Newton-Schulz steps) has its update rescaled to RMS
  `muon_rms` x sqrt(max(fan_in, fan_out)) (Moonlight, arXiv 2502.16982 §2.2: 0.2 matches
  AdamW's update RMS, so both groups share `peak_lr` and `weight_decay`).
  qk_clip_threshold: tau of QK-clip (Kimi K2, arXiv 2507.20534 §2.1, tau = 100 there); None
  disables it. Works with either optimizer; the model then records each MLA head's max logit.

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
  name: str = "adamw"
  muon_beta: float = 0.95
  muon_ns_steps: int = 5
  muon_rms: float = 0.2
  qk_clip_threshold: float | None = None

  def validate(self) -> None:
    """Raise ValueError naming the field and the fix."""
    if self.name not in OPTIMIZERS:
      raise ValueError(f"optim.name={self.name!r} is not an optimizer here; choose one of "
                       f"{', '.join(OPTIMIZERS)} (e.g. --set optim.name=muon)")
    if self.qk_clip_threshold is not None and not self.qk_clip_threshold > 0:
      raise ValueError(f"optim.qk_clip_threshold={self.qk_clip_threshold} must be > 0 (Kimi "
                       "K2 uses 100) or None to disable QK-clip")
    if self.muon_ns_steps < 1:
      raise ValueError(f"optim.muon_ns_steps={self.muon_ns_steps} must be >= 1")
    # (test, what it must be); `not test` also refuses NaN
    checks = {
        "peak_lr": (self.peak_lr > 0, "> 0"),
        "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
        "decay_fraction": (0 <= self.decay_fraction <= 1, "in [0, 1]"),
        "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1] (the decay's end, a "
                         "fraction of peak_lr)"),
        "b1": (0 <= self.b1 < 1, "in [0, 1)"),
        "b2": (0 <= self.b2 < 1, "in [0, 1)"),
        "eps": (self.eps > 0, "> 0"),
        "weight_decay": (self.weight_decay >= 0, ">= 0 (0 turns it off)"),
        "clip_norm": (self.clip_norm > 0, "> 0 (a large value such as 1e9 turns clipping "
                      "off)"),
        "muon_beta": (0 <= self.muon_beta < 1, "in [0, 1)"),
        "muon_rms": (self.muon_rms > 0, "> 0"),
    }
    for field, (ok, want) in checks.items():
      if not ok:
        raise ValueError(f"optim.{field}={getattr(self, field)} must be {want}")


OPTIMIZERS = ("adamw", "muon")


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


# Muon: axes that are orthogonalised independently (the stacked-layer axis, attention heads,
# experts): the update of w_q [D, H, d] is H matrices [D, d], one per head.
MUON_BATCH_AXES = ("layers", "heads", "exp")
# 2-D+ parameters that stay with AdamW under Muon: embeddings and the LM head (a `vocab` axis),
# the router (an `exp` output over `embed`), and the gates (MLA's output gate w_gate, KDA's
# output gate w_og, its beta and forget-gate projections).
ADAMW_NAMES = ("router", "w_og", "w_beta", "w_g_down", "w_g_up")
ADAMW_MIXER_NAMES = ("w_gate",)  # under `mixer` only: the SwiGLU w_gate is a weight matrix


def _muon_dims(path, names, shape) -> MuonDimensionNumbers | None:
  """Muon's (reduction, output) axes of a parameter, None for the AdamW group (see above).

  `names` are the parameter's logical axis names (None: unknown, a plain 2-D array is then a
  matrix [in, out]). Projection kernels are [*in, *out] (nn.dense_param); dropping the batch
  axes must leave exactly two: the reduction and the output axis.
  """
  parts = _path_name(path).split("/")
  leaf = parts[-1] if parts else ""
  if leaf in ADAMW_NAMES or (leaf in ADAMW_MIXER_NAMES and "mixer" in parts):
    return None
  if names is None:
    return MuonDimensionNumbers(0, 1) if len(shape) == 2 else None
  if "vocab" in names or any(p.search(part) for part in parts
                             for p in map(re.compile, NO_DECAY_PATTERNS)):
    return None
  axes = [i for i, n in enumerate(names) if n not in MUON_BATCH_AXES]
  if len(axes) != 2:
    return None
  return MuonDimensionNumbers(axes[0], axes[1])


def _map_params(fn, tree):
  """`fn(path, logical names or None, shape)` at every parameter of `tree` (an nnx.State of
  Variables or a plain pytree of arrays; optax's MaskedNode placeholders are kept)."""
  masked = lambda x: isinstance(x, optax.MaskedNode)

  def one(path, x):
    if isinstance(x, nnx.Variable):
      meta = x.get_metadata()
      names = meta.get("out_sharding") or meta.get("sharding_names")
      value = x.get_value()
      if masked(value):
        return x
      out = fn(path, None if names is None else tuple(names), value.shape)
      return jax.tree.map(lambda _: out, x)
    if masked(x):
      return x
    return fn(path, None, jnp.shape(x))

  return jax.tree_util.tree_map_with_path(
      one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or masked(x))


def muon_dimension_numbers(params):
  """A pytree like `params` with each Muon parameter's MuonDimensionNumbers (None elsewhere)."""
  return _map_params(_muon_dims, params)


def muon_labels(params):
  """A pytree like `params` of "muon" / "adamw" labels (optax.partition)."""
  return _map_params(lambda p, n, s: "adamw" if _muon_dims(p, n, s) is None else "muon", params)


def scale_by_shape(rms: float) -> optax.GradientTransformation:
  """Multiply each orthogonalised update by rms * sqrt(max(fan_in, fan_out)) of its matrix
  (Moonlight §2.2): an orthogonal [m, n] matrix has RMS 1/sqrt(max(m, n))."""

  def update(updates, state, params=None):
    del params
    dims = muon_dimension_numbers(updates)

    def one(u, d):
      if d is None or isinstance(u, optax.MaskedNode):
        return u
      red, out = d.reduction_axis, d.output_axis
      red = red if isinstance(red, tuple) else (red,)
      out = out if isinstance(out, tuple) else (out,)
      fan_in = math.prod(u.shape[a] for a in red)
      fan_out = math.prod(u.shape[a] for a in out)
      return u * (rms * math.sqrt(max(fan_in, fan_out)))

    return jax.tree.map(one, updates, dims,
                        is_leaf=lambda x: isinstance(x, optax.MaskedNode)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW (or Muon + AdamW, `muon_partition`) with the WSD schedule
  and the decay mask.

  Raises:
    ValueError: an unknown `cfg.name` or a bad Muon / QK-clip field.
  """
  cfg.validate()
  schedule = wsd_schedule(cfg, total_steps)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.name == "adamw":
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  muon = optax.chain(
      optax.contrib.scale_by_muon(beta=cfg.muon_beta, ns_steps=cfg.muon_ns_steps,
                                  weight_dimension_numbers=muon_dimension_numbers),
      scale_by_shape(cfg.muon_rms),
      optax.add_decayed_weights(cfg.weight_decay),
      optax.scale_by_learning_rate(schedule))
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.partition({"muon": muon, "adamw": adamw}, muon_labels))


def qk_clip(model: nnx.Module, threshold: float) -> dict[str, jax.Array]:
  """QK-clip (Kimi K2, arXiv 2507.20534 §2.1, "MuonClip") on every MLA layer of `model`, in
  place; call after the optimizer update (the train step does, through the builder).

  Each MLA layer built with cfg.mla_logit_max holds S_max [.., H], its heads' largest attention
  logit over the step's forward passes (`MLA.attn_logit_max`). For a head with S_max > tau,
  gamma = tau / S_max (else 1) and
    the head's query nope columns (w_uq or w_q) and key nope columns (w_ukv's k part) x sqrt(gamma),
    the head's query rope columns x gamma (the rope key is shared by the heads: left alone),
  so that the head's logits on the same inputs are scaled by gamma (max logit <= tau). The
  values and S_max's of other heads are untouched; S_max is reset to 0.

  Returns:
    metrics: "attn/max_logit" (fp32 scalar, the largest S_max, 0 when every logit was <= 0),
    "attn/clipped_heads" (how many heads were rescaled); empty without such layers.
  """
  from sparse_lm.model.mla import MLA  # pylint: disable=g-import-not-at-top
  s_all, clipped = [], []
  for _, node in nnx.iter_graph(model):
    if not isinstance(node, MLA) or not node.cfg.mla_logit_max:
      continue
    nope = node.cfg.qk_nope_head_dim
    s_max = node.attn_logit_max[...]  # [..., H]
    gamma = jnp.where(s_max > threshold, threshold / jnp.maximum(s_max, threshold), 1.0)
    g = gamma[..., None, :, None]  # broadcasts over [..., in, H, d]
    w_q = node.w_uq if node.cfg.q_lora_rank else node.w_q
    q = w_q[...]
    nn.assign(w_q, jnp.concatenate([q[..., :nope] * jnp.sqrt(g), q[..., nope:] * g], axis=-1))
    kv = node.w_ukv[...]
    nn.assign(node.w_ukv, jnp.concatenate([kv[..., :nope] * jnp.sqrt(g), kv[..., nope:]],
                                          axis=-1))
    nn.assign(node.attn_logit_max, jnp.zeros_like(s_max))
    s_all.append(jnp.max(s_max))
    clipped.append(jnp.sum(s_max > threshold))
  if not s_all:
    return {}
  return {"attn/max_logit": jnp.max(jnp.stack(s_all)),
          "attn/clipped_heads": jnp.sum(jnp.stack(clipped)).astype(jnp.float32)}


def max_logit_metrics(model: nnx.Module) -> dict[str, jax.Array]:
  """"attn/max_logit" of a model recording MLA logits when QK-clip is off (reset to 0)."""
  return qk_clip(model, float("inf"))
