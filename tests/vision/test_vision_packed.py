"""Packed image rows in the model: an image's tokens do not depend on the other images of its
row; text after an image sees it, text before does not (bit for bit); no loss on image
positions (ARCHITECTURE §7)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import vision
from sparse_lm.data import images as image_data
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer

P = 14
IMG = vision.IMAGE_TOKEN_ID
SEED = 20261130


def _imgs(rng, *sizes):
  return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


@pytest.fixture(scope="module")
def cfg():
  return vision.tiny_vision_config(num_layers=5, attnres_block_layers=4)


@pytest.fixture(scope="module")
def model(cfg):
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _encode(enc, packed):
  return nnx.jit(lambda e, x: e.encode_packed(x))(enc, jax.tree.map(jnp.asarray, packed))


def test_image_tokens_do_not_depend_on_the_other_images_of_the_row(model):
  print("seed", SEED)
  rng = np.random.default_rng(SEED)
  a, b, c = _imgs(rng, (40, 60), (28, 84), (70, 30))
  n_a = image_data.num_tokens(40, 60, P)
  e_ab, v_ab = _encode(model.vision, vision.pack_images([a, b], P, slots=64))
  e_ac, v_ac = _encode(model.vision, vision.pack_images([a, c], P, slots=64))
  # Same slots, other neighbour: a's tokens equal bit for bit.
  np.testing.assert_array_equal(np.asarray(e_ab[0, :n_a]), np.asarray(e_ac[0, :n_a]))
  assert float(jnp.abs(e_ab[0, n_a:n_a + 2] - e_ac[0, n_a:n_a + 2]).max()) > 1e-3
  # a alone, and a after c (other slots): equal up to summation order.
  e_a, _ = _encode(model.vision, vision.pack_images([a], P, slots=64))
  e_ca, v_ca = _encode(model.vision, vision.pack_images([c, a], P, slots=64))
  n_c = image_data.num_tokens(70, 30, P)
  np.testing.assert_allclose(np.asarray(e_ca[0, n_c:n_c + n_a]), np.asarray(e_a[0, :n_a]),
                             rtol=1e-5, atol=1e-5)
  assert int(v_ab.sum()) == n_a + image_data.num_tokens(28, 84, P) and not bool(v_ab[0, -1])


def test_packed_path_equals_padded_image_batch_path(model):
  rng = np.random.default_rng(SEED + 1)
  ims = _imgs(rng, (40, 60), (28, 28))
  e_packed, valid = _encode(model.vision, vision.pack_images(ims, P, slots=32))
  batch = vision.pad_images([image_data.normalize(im) for im in ims], P)
  e_pad, mask = nnx.jit(lambda e, x: e.encode(x))(model.vision, batch)
  want = np.concatenate([np.asarray(e_pad[n])[np.asarray(mask[n])] for n in range(2)])
  np.testing.assert_allclose(np.asarray(e_packed[0])[np.asarray(valid[0])], want,
                             rtol=1e-5, atol=1e-5)


def _row(rng, ims):
  """tokens [1, 40]: text, image 0 span, text, image 1 span, text; packed patches."""
  spans = [image_data.num_tokens(*im.shape[:2], P) for im in ims]
  toks = [1, *rng.integers(8, 500, 4)]
  starts = []
  for n in spans:
    starts.append(len(toks))
    toks += [IMG] * n + list(rng.integers(8, 500, 3))
  toks += list(rng.integers(8, 500, 40 - len(toks)))
  return np.asarray([toks], np.int32), starts


def test_text_after_an_image_sees_it_text_before_does_not(model):
  rng = np.random.default_rng(SEED + 2)
  a, b = _imgs(rng, (40, 60), (30, 30))
  b2 = rng.integers(0, 256, b.shape, dtype=np.uint8)
  tokens, (_, start_b) = _row(rng, [a, b])
  fwd = nnx.jit(lambda m, t, x: m(t, images=x))
  logits = fwd(model, tokens, jax.tree.map(jnp.asarray, vision.pack_images([a, b], P, 48)))
  other = fwd(model, tokens, jax.tree.map(jnp.asarray, vision.pack_images([a, b2], P, 48)))
  np.testing.assert_array_equal(np.asarray(logits[:, :start_b]), np.asarray(other[:, :start_b]))
  after = start_b + image_data.num_tokens(30, 30, P)
  assert float(jnp.abs(logits[:, after:] - other[:, after:]).min(-1).max()) > 0
  assert float(jnp.abs(logits[:, after] - other[:, after]).max()) > 1e-4


def test_loss_mask_excludes_image_positions(model):
  rng = np.random.default_rng(SEED + 3)
  a, b = _imgs(rng, (40, 60), (30, 30))
  tokens, _ = _row(rng, [a, b])
  packed = vision.pack_images([a, b], P, 48)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones_like(tokens),
           "image_patches": packed.patches, "image_segment_ids": packed.segment_ids,
           "image_coords": packed.coords}
  (_, metrics), grads = nnx.jit(nnx.value_and_grad(lambda m: loss_fn(m, batch, train=False),
                                                   has_aux=True))(model)
  n_img = int((tokens == IMG).sum())
  assert float(metrics["num_tokens"]) == tokens.shape[1] - 1 - n_img  # no image targets
  vision_grads = jax.tree.leaves(nnx.state(grads, nnx.Param)["vision"])
  assert max(float(jnp.abs(g).max()) for g in vision_grads) > 0


def _stack_rows(*rows):
  return vision.PackedImages(*[np.concatenate(parts) for parts in zip(*rows)])


@nnx.jit
def _loss_and_grads(enc, packed, w):
  """Loss sum(valid tokens * w) of `enc.encode_packed(packed)`, (tokens, valid), and the
  gradients (one compile per encoder config for every batch of the same shapes)."""
  def f(e):
    tokens, valid = e.encode_packed(packed)
    return jnp.sum(jnp.where(valid[..., None], tokens, 0) * w), (tokens, valid)
  return nnx.value_and_grad(f, has_aux=True)(enc)


@pytest.mark.parametrize("reach", ["short", "long", "none"])
def test_prefix_buckets_equal_the_whole_row_encoder(cfg, reach):
  """cfg.vision_prefix_buckets = 3 over L = 64 slots (prefixes of 16, 32, 64) against the
  encoder on all 64 slots, same parameters: the valid tokens within 1e-5, the tokens past the
  prefix 0 (as the whole-row encoder's padding tokens are: which prefix ran is checked by
  `test_prefix_branch_at_the_bucket_boundaries`), and the gradients of every parameter through
  the valid tokens within 1e-4 (plus 1e-5
  of each leaf's largest entry: they are sums over patches, rounded in another order). The
  batch's images end within the first 16 slots (prefix 16), past slot 32 (prefix 64), or there
  is no image (prefix 16)."""
  rng = np.random.default_rng(SEED + 4)
  L = 64
  if reach == "short":
    rows = [vision.pack_images(_imgs(rng, (28, 56)), P, L), vision.pack_images([], P, L)]
  elif reach == "long":
    rows = [vision.pack_images(_imgs(rng, (40, 60), (56, 84)), P, L),
            vision.pack_images(_imgs(rng, (28, 28)), P, L)]
  else:
    rows = [vision.pack_images([], P, L), vision.pack_images([], P, L)]
  packed = jax.tree.map(jnp.asarray, _stack_rows(*rows))
  extent = int(np.max(np.where(np.asarray(packed.segment_ids) > 0, np.arange(L) + 1, 0)))
  prefix = min(m for m in (16, 32, 64) if m >= extent)
  assert prefix == {"short": 16, "long": 64, "none": 16}[reach]
  assert (extent > 0) == (reach != "none")
  whole = vision.VisionEncoder(cfg, rngs=nnx.Rngs(5))
  cut = vision.VisionEncoder(dataclasses.replace(cfg, vision_prefix_buckets=3),
                             rngs=nnx.Rngs(5))  # same seed -> same params
  w = jnp.asarray(rng.standard_normal((2, L // 4, cfg.d_model)), jnp.float32)
  (l1, (t1, v1)), g1 = _loss_and_grads(whole, packed, w)
  (l2, (t2, v2)), g2 = _loss_and_grads(cut, packed, w)
  v = np.asarray(v1)
  np.testing.assert_array_equal(v, np.asarray(v2))
  np.testing.assert_allclose(np.asarray(t2)[v], np.asarray(t1)[v], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(t2)[:, prefix // 4:] == 0)
  np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(g2, nnx.Param)),
                  jax.tree.leaves(nnx.state(g1, nnx.Param))):
    b = np.asarray(b)  # sums over patches: rounding is relative to the leaf's scale
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_prefix_branch_at_the_bucket_boundaries():
  """The shortest of the prefixes 16, 32, 64 that holds the last used slot of any row; an
  image ending exactly at a boundary stays in the shorter prefix."""
  from sparse_lm.vision import encoder as encoder_lib
  for last_used, want in ((None, 0), (0, 0), (15, 0), (16, 1), (31, 1), (32, 2), (63, 2)):
    seg = np.zeros((2, 64), np.int32)
    if last_used is not None:
      seg[1, max(0, last_used - 3):last_used + 1] = 7
    got = int(encoder_lib.prefix_branch(jnp.asarray(seg), [16, 32, 64]))
    assert got == want, (last_used, got, want)


def test_prefix_buckets_refuse_a_row_length_they_cannot_halve(cfg):
  enc = vision.VisionEncoder(dataclasses.replace(cfg, vision_prefix_buckets=3),
                             rngs=nnx.Rngs(5))
  packed = jax.tree.map(jnp.asarray, vision.pack_images([], P, 36))  # 36 % 16 != 0
  with pytest.raises(ValueError, match="multiple of 4 x 2\\^2 = 16 for vision_prefix_buckets=3"):
    enc.encode_packed(packed)
  with pytest.raises(ValueError, match="vision_prefix_buckets=0"):
    dataclasses.replace(cfg, vision_prefix_buckets=0)
