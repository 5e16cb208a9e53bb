"""The vision encoder inside the Transformer: image tokens fill `<image>` spans (ARCHITECTURE §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import vision
from sparse_lm.config import get_preset
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer


def _batch(rng):
  img = rng.standard_normal((56, 84, 3)).astype(np.float32)
  span = vision.image_token_span(56, 84, 14, vision.IMAGE_TOKEN_ID)
  text = rng.integers(8, 512, size=(24 - span.size,)).astype(np.int32)
  tokens = np.concatenate([text[:5], span, text[5:]])[None]
  return {"tokens": jnp.asarray(tokens), "images": vision.pad_images([img], 14)}, span.size


def test_images_change_only_image_and_later_positions_and_get_no_loss():
  rng = np.random.default_rng(0)
  cfg = vision.tiny_vision_config(num_layers=5, attnres_block_layers=4)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  batch, n = _batch(rng)
  fwd = nnx.jit(lambda m, t, x: m(t, images=x))  # one compile for both calls (eager: 2x slower)
  logits = fwd(model, batch["tokens"], batch["images"])
  other = vision.ImageBatch(batch["images"].pixels + 1.0, batch["images"].sizes)
  logits2 = fwd(model, batch["tokens"], other)
  assert logits.shape == (1, 24, cfg.vocab_size)
  np.testing.assert_array_equal(logits[:, :5], logits2[:, :5])  # causal: before the image
  assert float(jnp.abs(logits[:, 5:] - logits2[:, 5:]).max()) > 1e-4

  def loss(m):
    return loss_fn(m, batch, train=False)

  (value, metrics), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
  assert np.isfinite(float(value))
  # Targets at image positions (t+1 in the span) carry no weight: 24 - 1 - n counted pairs.
  assert float(metrics["num_tokens"]) == 24 - 1 - n
  vision_grads = jax.tree.leaves(nnx.state(grads, nnx.Param)["vision"])
  assert vision_grads and all(np.isfinite(np.asarray(g)).all() for g in vision_grads)
  assert max(float(jnp.abs(g).max()) for g in vision_grads) > 0


def test_images_without_vision_encoder_is_a_clear_error():
  cfg = get_preset("tiny", num_layers=5, attnres_block_layers=4)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  batch, _ = _batch(np.random.default_rng(1))
  with pytest.raises(ValueError, match="vision=True"):
    model(batch["tokens"], images=batch["images"])
