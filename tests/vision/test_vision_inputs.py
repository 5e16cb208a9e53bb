"""What the vision entry points accept: uint8 vs float pixels (pack_images, pad_images, both
encoder paths), image shapes, the `images` argument of the model, float TIFFs from image
folders. Mostly NumPy-level; one tiny encoder, run eagerly."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_lm import vision
from sparse_lm.data import images as image_data
from sparse_lm.model.transformer import Transformer

P = 14


def _rgb(rng, h=40, w=60):
  return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------ dtypes


def test_pack_images_refuses_float_and_wider_int_pixels():
  rng = np.random.default_rng(0)
  rgb = _rgb(rng)
  with pytest.raises(ValueError, match=r"images\[1\] has dtype float32.*\(x \* 255\)"):
    vision.pack_images([rgb, rgb.astype(np.float32) / 255], P)  # was: silently all black
  with pytest.raises(ValueError, match=r"images\[0\] has dtype int64.*np.clip"):
    vision.pack_images([np.full((28, 28, 3), 300, np.int64)], P)  # was: 300 wrapped to 44
  packed = vision.pack_images([rgb], P)
  assert packed.patches.dtype == np.uint8 and packed.patches.max() > 200


def test_pad_images_keeps_uint8_and_refuses_mismatched_dtypes():
  rng = np.random.default_rng(1)
  rgb = _rgb(rng)
  flt = image_data.normalize(rgb)
  assert vision.pad_images([rgb], P).pixels.dtype == jnp.uint8  # default: kept, not cast
  assert vision.pad_images([flt], P).pixels.dtype == jnp.float32
  np.testing.assert_array_equal(vision.pad_images([rgb], P, dtype=np.uint8).pixels[0, :40, :60],
                                rgb)
  with pytest.raises(ValueError, match=r"images\[0\] has dtype float32.*uint8"):
    vision.pad_images([flt], P, dtype=np.uint8)  # was: cast to 0 / -1 wrapped
  with pytest.raises(ValueError, match=r"images\[0\] has dtype uint8 but dtype=float32"):
    vision.pad_images([rgb], P, dtype=np.float32)  # was: 0..255 taken as normalised
  with pytest.raises(ValueError, match=r"images\[1\] has dtype uint8"):
    vision.pad_images([flt, rgb], P)  # mixed: float32, and the uint8 one would be unscaled


@pytest.fixture(scope="module")
def enc():
  return vision.VisionEncoder(vision.tiny_vision_config(), rngs=nnx.Rngs(0))


def test_uint8_and_normalised_float_give_the_same_tokens_on_both_paths(enc):
  """The padded (`ImageBatch`) path normalises uint8 pixels as the packed path does, so an
  image as uint8 and as `normalize(uint8)` gives the same tokens through either path."""
  rng = np.random.default_rng(2)
  ims = [_rgb(rng, 40, 60), _rgb(rng, 30, 28)]
  n = [image_data.num_tokens(*im.shape[:2], P) for im in ims]
  want, mask = enc.encode(vision.pad_images([image_data.normalize(im) for im in ims], P))
  want = np.concatenate([np.asarray(want[k, :n[k]]) for k in range(2)])
  assert np.asarray(mask).sum() == sum(n)
  got_u8, mask_u8 = enc.encode(vision.pad_images(ims, P, dtype=np.uint8))
  np.testing.assert_array_equal(np.asarray(mask_u8), np.asarray(mask))
  np.testing.assert_allclose(
      np.concatenate([np.asarray(got_u8[k, :n[k]]) for k in range(2)]), want,
      rtol=1e-5, atol=1e-5)
  packed = vision.pack_images(ims, P)
  for patches in (packed.patches, image_data.normalize(packed.patches)):
    e, valid = enc.encode_packed(packed._replace(patches=jnp.asarray(patches)))
    np.testing.assert_allclose(np.asarray(e[0])[np.asarray(valid[0])], want,
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ shapes, args


@pytest.mark.parametrize("fn", [vision.pack_images, vision.pad_images])
@pytest.mark.parametrize("shape", [(28, 28), (28, 28, 4), (3, 28, 28)])
def test_wrong_image_shapes_are_named(fn, shape):
  ok = np.zeros((28, 28, 3), np.uint8)
  with pytest.raises(ValueError, match=r"expected \[h, w, 3\] images, got shape .* images\[1\]"):
    fn([ok, np.zeros(shape, np.uint8)], P)


@pytest.mark.parametrize("fn", [vision.pack_images, vision.pad_images])
def test_bad_patch_size_and_non_array_images(fn):
  im = np.zeros((28, 28, 3), np.uint8)
  for bad in (0, -14, 14.0):
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
      fn([im], bad)
  with pytest.raises(ValueError, match=r"images\[0\] is a list, not an array"):
    fn([im.tolist()], P)
  with pytest.raises(ValueError, match=r"a list of \[h, w, 3\] arrays.*pass \[image\]"):
    fn(im, P)


def test_model_images_must_be_an_image_batch_or_packed_images():
  cfg = vision.tiny_vision_config(num_layers=5, attnres_block_layers=4)  # smallest valid
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 8), jnp.int32)
  batch = vision.pad_images([np.zeros((28, 28, 3), np.uint8)], P)
  for bad in (batch.pixels, (batch.pixels, batch.sizes)):  # was: AttributeError 'pixels'
    with pytest.raises(TypeError, match=r"images must be a vision.ImageBatch or PackedImages "
                                        r"\(build one with vision.pad_images"):
      model(tokens, images=bad)
  with pytest.raises(TypeError, match="PackedImages"):
    model.vision.encode_packed(batch)


# ------------------------------------------------------------------------------ decoding


def test_float_tiff_in_unit_range_is_not_black(tmp_path):
  from PIL import Image
  a = np.linspace(0.0, 1.0, 20 * 30, dtype=np.float32).reshape(20, 30)
  Image.fromarray(a).save(tmp_path / "unit.tif")
  Image.fromarray(a * 255).save(tmp_path / "byte.tif")
  Image.fromarray(a * 65535).save(tmp_path / "wide.tif")
  stats = image_data.ImageStats()
  want = np.round(a * 255).astype(np.uint8)
  for name in ("unit", "byte", "wide"):
    im = image_data.read_image(str(tmp_path / f"{name}.tif"), stats)
    assert im.shape == (20, 30, 3) and im.dtype == np.uint8, name
    np.testing.assert_allclose(im[..., 0].astype(int), want, atol=1, err_msg=name)
  assert stats.counts["converted_F"] == 3
