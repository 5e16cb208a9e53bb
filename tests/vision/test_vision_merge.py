"""Splicing image tokens into `<image>` spans; gradients into the encoder (ARCHITECTURE §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import vision

P = 14
IMG = vision.IMAGE_TOKEN_ID


def _tokens(rng, spans, T):
  """[B, T] random text ids (never IMG) with image spans {row: [(start, length), ...]}."""
  B = len(spans)
  toks = rng.integers(8, 500, (B, T)).astype(np.int32)
  for b, row in enumerate(spans):
    for start, length in row:
      toks[b, start:start + length] = IMG
  return jnp.asarray(toks)


def test_image_token_id_matches_tokenizer():
  from sparse_lm.data.tokenizer import SPECIAL_TOKENS
  assert SPECIAL_TOKENS.index("<image>") == IMG


def test_merge_places_tokens_exactly():
  rng = np.random.default_rng(0)
  B, T, D, N, M = 2, 12, 8, 3, 6
  # image 0: 6 tokens, image 1: 1 token, image 2: 4 tokens (invalid slots hold junk)
  counts = [6, 1, 4]
  mask = jnp.asarray(np.arange(M)[None] < np.array(counts)[:, None])
  img = jnp.asarray(rng.standard_normal((N, M, D)), jnp.float32)
  text = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  # reading order: row 0 holds image 0 (pos 2..7) then image 1 (pos 10); row 1 image 2 (pos 3..6)
  tokens = _tokens(rng, [[(2, 6), (10, 1)], [(3, 4)]], T)
  out = np.asarray(vision.merge_image_embeddings(text, tokens, img, mask, IMG))
  np.testing.assert_array_equal(out[0, 2:8], img[0, :6])
  np.testing.assert_array_equal(out[0, 10], img[1, 0])
  np.testing.assert_array_equal(out[1, 3:7], img[2, :4])
  ph = np.asarray(vision.image_placeholder_mask(tokens, IMG))
  assert ph.sum() == 11 and ph[0, 2:8].all() and ph[1, 3:7].all()
  np.testing.assert_array_equal(out[~ph], np.asarray(text)[~ph])
  # same under jit
  jitted = jax.jit(vision.merge_image_embeddings, static_argnums=4)(text, tokens, img, mask, IMG)
  np.testing.assert_array_equal(np.asarray(jitted), out)


def test_merge_count_mismatch_raises():
  rng = np.random.default_rng(1)
  text = jnp.zeros((1, 8, 4)) + 1.0
  img = jnp.ones((1, 4, 4))
  mask = jnp.asarray([[True, True, True, False]])
  with pytest.raises(ValueError, match="placeholders"):
    vision.merge_image_embeddings(text, _tokens(rng, [[(1, 2)]], 8), img, mask, IMG)


def test_encoder_to_merge_and_gradients():
  """num_image_tokens spans + encoder + merge; a scalar loss on the merged sequence reaches
  every encoder parameter, and nothing flows into the text embeddings at image positions."""
  cfg = vision.tiny_vision_config()
  enc = vision.VisionEncoder(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  images = [rng.uniform(-1, 1, (56, 84, 3)).astype(np.float32),
            rng.uniform(-1, 1, (28, 28, 3)).astype(np.float32)]
  batch = vision.pad_images(images, P)
  row0 = np.concatenate([[1, 9, 10], vision.image_token_span(56, 84, P, IMG), [11, 12]])
  row1 = np.concatenate([[1, 13], vision.image_token_span(28, 28, P, IMG), [14] * 8])
  tokens = jnp.asarray(np.stack([row0, row1]).astype(np.int32))  # [2, 11]
  text = jnp.asarray(rng.standard_normal((2, 11, cfg.d_model)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 11, cfg.d_model)), jnp.float32)

  def loss_fn(enc, text):
    return jnp.sum(enc.embed_into(text, tokens, batch) * w)

  loss, (g_enc, g_text) = nnx.jit(nnx.value_and_grad(loss_fn, argnums=(0, 1)))(enc, text)
  assert np.isfinite(float(loss))
  for path, g in nnx.to_flat_state(g_enc):
    g = np.asarray(g[...])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, path
  ph = np.asarray(vision.image_placeholder_mask(tokens))
  assert ph.sum() == 7
  g_text = np.asarray(g_text)
  assert np.all(g_text[ph] == 0)
  np.testing.assert_array_equal(g_text[~ph], np.asarray(w)[~ph])
  # the merged image positions equal the encoder output
  e, merged = nnx.jit(lambda enc: (enc.encode(batch)[0], enc.embed_into(text, tokens, batch))
                      )(enc)
  merged = np.asarray(merged)
  np.testing.assert_allclose(merged[0, 3:9], np.asarray(e[0, :6]), rtol=1e-6)
  np.testing.assert_allclose(merged[1, 2], np.asarray(e[1, 0]), rtol=1e-6)
