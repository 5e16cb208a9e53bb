"""Image-caption data: bad input is converted or skipped and counted, never a crash; sources;
packing of several images with their text per row; exact resume (ARCHITECTURE §7)."""

import io
import json
import tarfile
import warnings

import numpy as np
import pytest
from PIL import Image

from sparse_lm.data import DataConfig, make_eval_batches, make_train_iterator
from sparse_lm.data import image_sources, images
from sparse_lm.data.tokenizer import SPECIAL_TOKENS

IMG = SPECIAL_TOKENS.index("<image>")
P = 14


def _png(img: Image.Image, fmt="PNG") -> bytes:
  buf = io.BytesIO()
  img.save(buf, format=fmt)
  return buf.getvalue()


def _decode(data):
  stats = images.ImageStats()
  return images.decode_image(data, "x.png", stats), stats


def test_zero_byte_image_is_skipped_and_counted():
  out, stats = _decode(b"")
  assert out is None and stats.counts["skipped_empty"] == 1


def test_unreadable_image_is_skipped_and_counted():
  out, stats = _decode(b"\x89PNG\r\n\x1a\n this is not a png")
  assert out is None and stats.counts["skipped_unreadable"] == 1
  assert "x.png" in stats.summary()


def test_grayscale_is_converted():
  g = np.arange(30 * 20, dtype=np.uint8).reshape(30, 20)
  out, stats = _decode(_png(Image.fromarray(g, "L")))
  assert out.shape == (30, 20, 3) and out.dtype == np.uint8
  np.testing.assert_array_equal(out[..., 1], g)
  assert stats.counts["converted_L"] == 1


def test_16bit_is_converted_to_8bit():
  g = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257)  # 0 .. 65535
  out, stats = _decode(_png(Image.fromarray(g)))
  assert out.dtype == np.uint8 and out.shape == (16, 16, 3)
  np.testing.assert_array_equal(out[..., 0], np.arange(256, dtype=np.uint8).reshape(16, 16))
  assert sum(v for k, v in stats.counts.items() if k.startswith("converted_I")) == 1


def test_palette_is_converted():
  rgb = np.zeros((8, 8, 3), np.uint8)
  rgb[:4] = (255, 0, 0)
  rgb[4:] = (0, 0, 255)
  pal = Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=4)
  out, stats = _decode(_png(pal))
  np.testing.assert_array_equal(out[0, 0], (255, 0, 0))
  np.testing.assert_array_equal(out[7, 7], (0, 0, 255))
  assert stats.counts["converted_P"] == 1


def test_rgba_is_composited_on_white():
  a = np.zeros((4, 4, 4), np.uint8)
  a[..., 0] = 200
  a[:2, :, 3] = 255  # top half opaque red-ish, bottom half fully transparent
  out, stats = _decode(_png(Image.fromarray(a, "RGBA")))
  np.testing.assert_array_equal(out[0, 0], (200, 0, 0))
  np.testing.assert_array_equal(out[3, 3], (255, 255, 255))
  assert stats.counts["converted_RGBA"] == 1


def test_too_large_image_is_downscaled_with_a_warning():
  stats = images.ImageStats()
  big = np.zeros((300, 90, 3), np.uint8)
  with pytest.warns(UserWarning, match=r"big\.png: 300x90 px .* downscaled to 100x30"):
    out = images.fit_image(big, patch_size=P, max_side=100, max_tokens=1000, where="big.png",
                           stats=stats)
  assert out.shape == (100, 30, 3) and stats.counts["downscaled"] == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an image within the limits is untouched, silently
    assert images.fit_image(out, patch_size=P, max_side=100, max_tokens=1000, where="s",
                            stats=stats) is out
  # A token budget below the image's count also downscales (a row must hold it).
  with pytest.warns(UserWarning):
    small = images.fit_image(big, patch_size=P, max_side=1000, max_tokens=4, where="b",
                             stats=stats)
  assert images.num_tokens(small.shape[0], small.shape[1], P) <= 4


def test_caption_file_naming_a_missing_image_is_reported_with_its_path(tmp_path):
  Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(tmp_path / "ok.png")
  with open(tmp_path / "metadata.jsonl", "w") as f:
    f.write(json.dumps({"file_name": "ok.png", "text": "a black square"}) + "\n")
    f.write(json.dumps({"file_name": "gone.png", "text": "missing"}) + "\n")
  with pytest.warns(UserWarning, match=str(tmp_path / "gone.png")):
    src = image_sources.open_images(f"imagefolder:{tmp_path}", split="train",
                                    eval_fraction=0.0)
  assert len(src) == 1 and src.load(0)[1] == "a black square"
  assert src.parts[0].stats.counts["missing_file"] == 1


def _bad_folder(path):
  """One image of every awkward kind, captions from file names."""
  rng = np.random.default_rng(0)
  rgb = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
  Image.fromarray(rgb).save(path / "good_rgb.png")
  Image.fromarray(rgb[..., 0], "L").save(path / "gray_cat.png")
  Image.fromarray(rgb[..., 0].astype(np.uint16) * 257).save(path / "deep_16bit.png")
  Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE).save(path / "palette_dog.png")
  Image.fromarray(np.dstack([rgb, rgb[..., :1]]), "RGBA").save(path / "alpha_logo.png")
  Image.fromarray(rng.integers(0, 256, (700, 90, 3), dtype=np.uint8)).save(path / "tall.png")
  (path / "empty.png").write_bytes(b"")
  (path / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")


def test_imagefolder_with_bad_files_feeds_the_pipeline_and_counts(tmp_path, stdlib_tok):
  _bad_folder(tmp_path)
  cfg = DataConfig(images=f"imagefolder:{tmp_path}", image_ratio=1.0, eval_fraction=0.0,
                   image_max_side=200, prefetch=0)
  with pytest.warns(UserWarning, match="tall.png: 700x90 px"):
    it = make_train_iterator(cfg, stdlib_tok, seq_len=128, batch_size=2, patch_size=P)
    batches = [next(it) for _ in range(4)]
  for b in batches:  # every row's <image> count equals its image tokens (patches / 4)
    assert ((b["tokens"] == IMG).sum(1) * 4 == (b["image_segment_ids"] > 0).sum(1)).all()
  text = stdlib_tok.decode([t for b in batches for t in b["tokens"].ravel() if t > 3])
  assert "gray cat" in text and "palette dog" in text and "alpha logo" in text
  # The counters of one pass over the folder: each awkward kind once.
  src = image_sources.open_images(f"imagefolder:{tmp_path}", split="train", eval_fraction=0.0)
  loaded = [src.load(i) for i in range(len(src))]
  assert sum(x is None for x in loaded) == 2 and len(loaded) == 8
  counts = src.parts[0].stats.counts
  assert counts["skipped_empty"] == 1 and counts["skipped_unreadable"] == 1
  assert counts["converted_L"] == 1 and counts["converted_P"] == 1
  assert counts["converted_RGBA"] == 1
  assert sum(v for k, v in counts.items() if k.startswith("converted_I")) == 1
  assert "empty.png" in src.summary() and "broken.jpg" in src.summary()


def test_sources_jsonl_tar_and_builtin(tmp_path):
  rng = np.random.default_rng(1)
  img = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
  Image.fromarray(img).save(tmp_path / "a.png")
  with open(tmp_path / "caps.jsonl", "w") as f:
    f.write(json.dumps({"image": "a.png", "caption": "noise"}) + "\n")
  src = image_sources.open_images(f"imagejsonl:{tmp_path / 'caps.jsonl'}", split="train",
                                  eval_fraction=0.0)
  got, cap = src.load(0)
  np.testing.assert_array_equal(got, img) and None
  assert cap == "noise"
  with tarfile.open(tmp_path / "shard.tar", "w") as tf:
    for key, data in (("0001.png", _png(Image.fromarray(img))), ("0001.txt", b"tar noise"),
                      ("0002.png", b""), ("0002.txt", b"empty one")):
      info = tarfile.TarInfo(key)
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
  tar = image_sources.open_images(f"imagetar:{tmp_path / 'shard.tar'}", split="train",
                                  eval_fraction=0.0)
  assert len(tar) == 2 and tar.load(0)[1] == "tar noise" and tar.load(1) is None
  assert tar.parts[0].stats.counts["skipped_empty"] == 1
  digits = image_sources.open_images("digits", split="eval", eval_fraction=0.1)
  d_img, d_cap = digits.load(0)
  assert d_img.shape == (24, 24, 3) and d_cap in "0123456789" and len(d_cap) == 1
  w_img, w_cap = image_sources.open_images("words", split="train", eval_fraction=0.1).load(3)
  assert w_img.ndim == 3 and w_cap in image_sources.word_list()
  with pytest.raises(ValueError, match="choose from"):
    DataConfig(images="pictures:/x", image_ratio=0.5)


def test_patches_roundtrip_and_merge_cell_order():
  rng = np.random.default_rng(2)
  img = rng.integers(0, 256, (30, 45, 3), dtype=np.uint8)  # 2 x 2 cells of 28 px
  patches, coords = images.image_patches(img, P)
  assert patches.shape == (16, P * P * 3) and images.num_tokens(30, 45, P) == 4
  # cell (0, 1) = patches 4..7 at patch rows 0-1, cols 2-3
  np.testing.assert_array_equal(coords[4:8], [[0, 2], [0, 3], [1, 2], [1, 3]])
  back = images.patches_to_image(patches, coords, P)
  np.testing.assert_array_equal(back[:30, :45], img)
  assert (back[30:] == images.PIXEL_PAD).all() and images.normalize(np.uint8(128)) == 0.0


@pytest.fixture(scope="module")
def mixed_cfg():
  return DataConfig(images="digits+words", image_ratio=0.95, eval_fraction=0.1, prefetch=0,
                    image_patches_per_row=96)


def test_packed_rows_hold_several_images_and_their_text(mixed_cfg, stdlib_tok):
  it = make_train_iterator(mixed_cfg, stdlib_tok, seq_len=64, batch_size=4, patch_size=P)
  multi, sizes = 0, set()
  for _ in range(3):
    b = next(it)
    assert b["image_patches"].shape == (4, 96, P * P * 3)
    assert b["image_coords"].shape == (4, 96, 2)
    tok, seg, lm, iseg = b["tokens"], b["segment_ids"], b["loss_mask"], b["image_segment_ids"]
    assert (lm[tok == IMG] == 0).all() and (lm[(tok != IMG) & (seg > 0)] == 1).all()
    for r in range(4):
      ids = [s for s in np.unique(iseg[r]) if s > 0]
      multi += len(ids) > 1
      assert ((tok[r] == IMG).sum()) * 4 == (iseg[r] > 0).sum()
      for s in ids:  # the patches of segment s are its image: 4 per <image> of segment s
        assert 4 * ((tok[r] == IMG) & (seg[r] == s)).sum() == (iseg[r] == s).sum()
        span = np.flatnonzero((tok[r] == IMG) & (seg[r] == s))
        assert np.all(np.diff(span) == 1) and tok[r, span[0] - 1] == stdlib_tok.bos_id
        sizes.add(tuple(b["image_coords"][r][iseg[r] == s].max(0)))
  assert multi > 0, "expected rows with several images"
  assert len(sizes) > 1, "expected images of different native sizes"


def test_resume_is_exact(mixed_cfg, stdlib_tok):
  kw = dict(seq_len=64, batch_size=2, patch_size=P)
  it = make_train_iterator(mixed_cfg, stdlib_tok, **kw)
  for _ in range(3):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(3)]
  it2 = make_train_iterator(mixed_cfg, stdlib_tok, **kw)
  it2.set_state(json.loads(json.dumps(state, default=int)))
  for a, b in zip(want, [next(it2) for _ in range(3)]):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  other = make_train_iterator(DataConfig(images="digits", image_ratio=0.6, eval_fraction=0.1,
                                         prefetch=0, image_patches_per_row=96), stdlib_tok, **kw)
  with pytest.raises(ValueError, match="images"):
    other.set_state(state)


def test_eval_batches_with_images(mixed_cfg, stdlib_tok):
  a = make_eval_batches(mixed_cfg, stdlib_tok, seq_len=64, batch_size=2, num_batches=2,
                        patch_size=P)
  b = make_eval_batches(mixed_cfg, stdlib_tok, seq_len=64, batch_size=2, num_batches=2,
                        patch_size=P)
  assert len(a) == 2 and "image_patches" in a[0]
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_a_few_held_out_images_do_not_cut_the_held_out_batches_short(tmp_path, stdlib_tok):
  """A newcomer's folder of a few images: the held-out batches ended when the held-out images
  ran out (the mix ends with its shorter input), the same rows at every length; and a split
  with no held-out image is refused with the fix named."""
  rng = np.random.default_rng(3)
  for i in range(12):
    Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(
        tmp_path / f"picture_{i}.png")
  frac = 0.2
  held = len(image_sources.open_images(f"imagefolder:{tmp_path}", split="eval",
                                       eval_fraction=frac))
  assert 1 <= held <= 4  # a few held-out images (a hash of the names picks them)
  cfg = DataConfig(images=f"imagefolder:{tmp_path}", image_ratio=0.5, eval_fraction=frac,
                   prefetch=0, image_patches_per_row=64)
  batches = make_eval_batches(cfg, stdlib_tok, seq_len=64, batch_size=2, num_batches=8,
                              patch_size=P)
  assert len(batches) == 8
  assert sum(int((b["tokens"] == IMG).sum()) for b in batches) > 0
  again = make_eval_batches(cfg, stdlib_tok, seq_len=64, batch_size=2, num_batches=8,
                            patch_size=P)
  for x, y in zip(batches, again):  # still deterministic
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  only = tmp_path / "one"
  only.mkdir()
  Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(only / "a.png")
  none_held = DataConfig(images=f"imagefolder:{only}", image_ratio=0.5, eval_fraction=0.02,
                         prefetch=0)
  if len(image_sources.open_images(f"imagefolder:{only}", split="eval", eval_fraction=0.02)):
    pytest.skip("the hash held out the only image")  # not with this name
  with pytest.raises(ValueError, match=r"has no eval images \(1 images in all.*"
                     r"data.eval_fraction=0 to train without"):
    make_eval_batches(none_held, stdlib_tok, seq_len=64, batch_size=2, num_batches=1,
                      patch_size=P)
