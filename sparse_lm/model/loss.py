"""Next-token loss without materialising [B, T, vocab] logits (chunked cross-entropy).

Convention: position t predicts token t+1; the pair (t, t+1) counts iff loss_mask[t+1] > 0
and segment_ids[t+1] == segment_ids[t] != 0 (no prediction across documents or into padding).
The sequence is cut into chunks of cfg.loss_chunk_size positions; each chunk's logits
[B, C, vocab] are made, reduced to per-token log-likelihoods in fp32 and dropped, inside a
`jax.checkpoint`-ed `lax.scan` body so the backward pass recomputes them chunk by chunk too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sparse_lm.model.transformer import Transformer
from sparse_lm.vision.merge import image_placeholder_mask
from sparse_lm.vision.patches import PackedImages


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array | None = None,
                       loss_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(targets [B, T] int32, weights [B, T] fp32) under the convention of the module docstring.

  The last position has weight 0 (its target is unknown).
  """
  B, T = tokens.shape
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
  mask = jnp.ones((B, T), jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
  nxt_seg = jnp.concatenate([seg[:, 1:], jnp.zeros((B, 1), seg.dtype)], axis=1)
  nxt_mask = jnp.concatenate([mask[:, 1:], jnp.zeros((B, 1), mask.dtype)], axis=1)
  ok = (nxt_seg == seg) & (seg != 0) & (nxt_mask > 0)
  return targets.astype(jnp.int32), ok.astype(jnp.float32)


def cross_entropy_reference(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                            z_loss_coef: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Plain weighted cross-entropy on full logits (the definition the chunked path matches).

  Args:
    logits: [B, T, V]; targets: [B, T] int; weights: [B, T].
  Returns:
    (mean NLL in nats per weighted token, mean z-loss term z_loss_coef * logsumexp^2).
  """
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  n = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum((lse - tgt) * weights) / n, z_loss_coef * jnp.sum(lse ** 2 * weights) / n


def _head_logits(hc: jax.Array, head: jax.Array, grad_dtype) -> jax.Array:
  """fp32 logits [B, C, V] of hc [B, C, D] @ head [D, V] (both already in the compute dtype),
  fp32 accumulation. grad_dtype None: plain autodiff (the logits' fp32 cotangent reaches both
  backward GEMMs, which XLA:GPU runs as fp32 / TF32 GEMMs); a 16-bit dtype: the cotangent is
  rounded to it once and both backward GEMMs take 16-bit operands (`_head_logits_lowp`)."""
  if grad_dtype is None:
    return jnp.einsum("bcd,dv->bcv", hc, head, preferred_element_type=jnp.float32)
  return _head_logits_lowp(hc, head, jnp.dtype(grad_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_logits_lowp(hc, head, grad_dtype):
  del grad_dtype
  return jnp.einsum("bcd,dv->bcv", hc, head, preferred_element_type=jnp.float32)


def _head_logits_lowp_fwd(hc, head, grad_dtype):
  return _head_logits_lowp(hc, head, grad_dtype), (hc, head)


def _head_logits_lowp_bwd(grad_dtype, res, ct):
  """d hc = bf16(ct) @ headᵀ, d head = hcᵀ @ bf16(ct): 16-bit operands, fp32 accumulation;
  only the cotangent is rounded (hc and head are already 16-bit when the model is)."""
  hc, head = res
  ct = ct.astype(grad_dtype)
  f32 = jnp.float32
  dh = jnp.einsum("bcv,dv->bcd", ct, head.astype(grad_dtype), preferred_element_type=f32)
  dw = jnp.einsum("bcd,bcv->dv", hc.astype(grad_dtype), ct, preferred_element_type=f32)
  return dh.astype(hc.dtype), dw.astype(head.dtype)


_head_logits_lowp.defvjp(_head_logits_lowp_fwd, _head_logits_lowp_bwd)


def chunked_cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array,
                          weights: jax.Array, *, chunk_size: int, dtype=None,
                          grad_dtype=None) -> dict[str, jax.Array]:
  """Sums over tokens of NLL, logsumexp², and correct top-1 predictions, chunk by chunk.

  Args:
    h: [B, T, D] final hidden states; head: [D, V] LM head (matmul in `dtype`, default h's,
      fp32 accumulation; log-softmax in fp32).
    targets: [B, T] int32; weights: [B, T] fp32.
    chunk_size: positions per chunk (T is padded to a multiple with weight 0).
    grad_dtype: None (default): exact autodiff, the logits' cotangent stays fp32 in the two
      backward GEMMs. "bfloat16": that cotangent (softmax − one-hot, times the weights) is
      rounded to bf16 once and the backward GEMMs run on bf16 operands with fp32 accumulation,
      as when a model's logits come out of the head in bf16 (MaxText's default). Forward
      values are unchanged; gradients move by about one bf16 rounding of dlogits.

  Returns:
    dict of fp32 scalars: "nll_sum", "z_sum" (sum of weight * lse²), "correct_sum".

  Raises:
    ValueError: grad_dtype not None, "bfloat16" or "float16".
  """
  if grad_dtype is not None and jnp.dtype(grad_dtype) not in (jnp.dtype(jnp.bfloat16),
                                                               jnp.dtype(jnp.float16)):
    raise ValueError(f"grad_dtype={grad_dtype!r}: expected None, 'bfloat16' or 'float16'")
  B, T, D = h.shape
  dtype = h.dtype if dtype is None else dtype
  C = min(chunk_size, T)
  n = -(-T // C)
  pad = n * C - T
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    weights = jnp.pad(weights, ((0, 0), (0, pad)))
  hs = h.reshape(B, n, C, D).swapaxes(0, 1)
  ts = targets.reshape(B, n, C).swapaxes(0, 1)
  ws = weights.reshape(B, n, C).swapaxes(0, 1)

  @jax.checkpoint
  def chunk(head, hc, tc, wc):
    logits = _head_logits(hc.astype(dtype), head.astype(dtype), grad_dtype)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == tc).astype(jnp.float32)
    return (jnp.sum((lse - tgt) * wc), jnp.sum(lse ** 2 * wc),
            jax.lax.stop_gradient(jnp.sum(correct * wc)))

  def body(acc, xs):
    out = chunk(head, *xs)
    return tuple(a + o for a, o in zip(acc, out)), None

  zero = jnp.zeros((), jnp.float32)
  (nll, z, correct), _ = jax.lax.scan(body, (zero, zero, zero), (hs, ts, ws))
  return {"nll_sum": nll, "z_sum": z, "correct_sum": correct}


def loss_fn(model: Transformer, batch: dict, *, train: bool = False,
            z_loss_coef: float = 0.0) -> tuple[jax.Array, dict]:
  """Loss of `model` on a packed batch: `loss_fn(model, batch)` evaluates (reads the model,
  writes nothing); the train step calls `loss_fn(model, batch, train=True, z_loss_coef=...)`.

  Args:
    model: the Transformer.
    batch: "tokens" [B, T] int32; optional "segment_ids" [B, T] int32 (0 = padding; default
      all ones), "loss_mask" [B, T] (default ones) and "images" (a vision.ImageBatch or
      PackedImages whose tokens fill the `<image>` spans; those positions are never targets),
      or the data pipeline's "image_patches" / "image_segment_ids" / "image_coords" (packed
      rows). Convention in the module docstring.
    train: forwarded to the model; True accumulates the MoE balancer statistics in the
      model's variables (training only; default False: evaluation mutates nothing).
    z_loss_coef: weight of the z-loss mean(logsumexp²) (PaLM), 0 to disable.

  Returns:
    loss: fp32 scalar = mean NLL (nats / counted token) + z-loss + sum over MoE layers of
      aux_loss (non-zero only for balancer="aux_loss").
    metrics: "loss" (mean NLL), "z_loss", "aux_loss", "total_loss", "num_tokens", "accuracy"
      (fp32 scalars); "moe/<key>" for every key of the MoE layers' aux ([num MoE layers]
      arrays, layer order, "moe/load" [layers, E]): balance, drops ("moe/assigned",
      "moe/dropped", "moe/drop_rate") and, under expert parallelism, receive rows.
  """
  tokens = batch["tokens"]
  seg = batch.get("segment_ids")
  if seg is None:
    seg = jnp.ones_like(tokens, jnp.int32)
  targets, weights = next_token_targets(tokens, seg, batch.get("loss_mask"))
  images = batch.get("images")
  if images is None and "image_patches" in batch:  # packed rows from the data pipeline
    images = PackedImages(batch["image_patches"], batch["image_segment_ids"],
                          batch["image_coords"])
  if images is not None:  # no loss on image positions (ARCHITECTURE §7)
    weights = jnp.where(image_placeholder_mask(targets), 0.0, weights)
  h, aux = model.forward_hidden(tokens, segment_ids=seg, images=images, train=train)
  with jax.named_scope("lm_head_loss"):  # labels profiles; changes no value
    sums = chunked_cross_entropy(h, model.lm_head[...], targets, weights,
                                 chunk_size=model.cfg.loss_chunk_size,
                                 dtype=jnp.dtype(model.cfg.dtype),
                                 grad_dtype=model.cfg.lm_head_grad_dtype)
  num = jnp.sum(weights)
  denom = jnp.maximum(num, 1.0)
  nll = sums["nll_sum"] / denom
  z_loss = z_loss_coef * sums["z_sum"] / denom
  aux_loss = jnp.sum(aux["aux_loss"])
  total = nll + z_loss + aux_loss
  metrics = {
      "loss": nll, "z_loss": z_loss, "aux_loss": aux_loss, "total_loss": total,
      "num_tokens": num, "accuracy": sums["correct_sum"] / denom,
      **{f"moe/{k}": v for k, v in aux.items() if k != "aux_loss"},
  }
  return total, metrics
