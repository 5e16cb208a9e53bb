"""Image-text examples for the packing pipeline: decoding, conversion, patching (ARCHITECTURE §7).

An image-text example is one packed element with four features (all in one packed row):

  tokens         int32 [n_tok]          <bos> <image> x n  caption ids  <eos>
  doc_positions  int32 [n_tok]          0 .. n_tok - 1
  patches        uint8 [4n, p*p*3]      the image's p x p patches (RGB, 0..255), merge-cell
                                         major: cell (i, j) of its ceil(h/2p) x ceil(w/2p) grid
                                         in raster order, then the cell's four patches (0,0),
                                         (0,1), (1,0), (1,1); pixels past the image are
                                         PIXEL_PAD (128: 0.0 after `normalize`)
  patch_coords   int32 [4n, 2]          (row, col) of each patch in the image's own patch grid

with n = ceil(h/2p) * ceil(w/2p) = `sparse_lm.vision.num_image_tokens(h, w, p)`. A text chunk
has the same features with zero patches, so text and images pack together. Because every
element's patch count is a multiple of 4 and the packer appends elements to a row in the same
order for every feature, the k-th `<image>` placeholder of a packed row is the k-th merged
cell of that row's patches: the encoder's 2x2 merge is a reshape of the packed patch row.

Bad input never stops a run: an unreadable or zero-byte file is skipped; grayscale, 16-bit,
32-bit (float in [0, 1], or scaled by range: `to_rgb8`), palette, CMYK and RGBA / LA images
are converted to 8-bit RGB (alpha composited on white); an image with a side above `max_side`
(or more patches than a row holds) is downscaled with a warning. Each of these is counted in
`ImageStats`.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import threading
import warnings

import numpy as np

_log = logging.getLogger(__name__)

MERGE = 2  # patches per side of one image token (the encoder's 2x2 merge)
PIXEL_PAD = 128  # fill past an image's edge inside its last cells; normalises to exactly 0.0


@dataclasses.dataclass
class ImageStats:
  """What an image source skipped, converted or downscaled (thread-safe counters).

  counts: {"skipped_unreadable", "skipped_empty", "converted_<MODE>", "downscaled",
  "missing_file"} -> number of images; examples: the first few paths of each kind.
  """
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  examples: dict = dataclasses.field(default_factory=dict)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def add(self, kind: str, where: str = "") -> None:
    with self._lock:
      self.counts[kind] += 1
      seen = self.examples.setdefault(kind, [])
      if where and len(seen) < 5 and where not in seen:
        seen.append(where)

  def summary(self) -> str:
    """e.g. "skipped_empty 1 (a.png); converted_L 3" or "" when nothing happened."""
    with self._lock:
      return "; ".join(f"{k} {v}" + (f" ({', '.join(self.examples.get(k, []))})"
                                     if self.examples.get(k) else "")
                       for k, v in sorted(self.counts.items()))


# ------------------------------------------------------------------------------ decoding


def to_rgb8(img, where: str, stats: ImageStats) -> np.ndarray:
  """A PIL image of any mode -> uint8 [h, w, 3] RGB; a conversion is counted as
  `converted_<mode>` (16-bit images are scaled by 1/257, alpha is composited on white).

  32-bit images are scaled by their range: a float ("F") image whose values all lie in
  [0, 1] is taken as intensities 0..1 (x 255); otherwise, as for int ("I") images, a maximum
  above 255 means a 16-bit range (x 255 / 65535), else 0..255 as is. NaN becomes 0; the
  result is clipped to 0..255."""
  from PIL import Image

  mode = img.mode
  if mode == "RGB":
    return np.asarray(img, np.uint8).copy()
  stats.add(f"converted_{mode}", where)
  if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
    a = np.nan_to_num(np.asarray(img).astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if mode == "F" and a.size and a.min() >= 0.0 and a.max() <= 1.0:
      pass  # intensities in [0, 1]
    elif mode == "F" or mode == "I":
      hi = max(float(a.max()), 1.0)
      a = a / (65535.0 if hi > 255 else 255.0)
    else:
      a = a / 65535.0
    g = np.clip(np.round(a * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(g[..., None], 3, axis=-1)
  if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in img.info):
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"), np.uint8).copy()
  return np.asarray(img.convert("RGB"), np.uint8).copy()


def decode_image(data: bytes, where: str, stats: ImageStats) -> np.ndarray | None:
  """Encoded image bytes (PNG, JPEG, GIF, TIFF, BMP, ...) -> uint8 [h, w, 3], or None (skipped
  and counted: `skipped_empty` for zero bytes, `skipped_unreadable` when Pillow cannot decode
  it). Never raises for bad image data."""
  from PIL import Image

  if not data:
    stats.add("skipped_empty", where)
    return None
  try:
    with Image.open(io.BytesIO(data)) as img:
      img.load()
      if img.width == 0 or img.height == 0:
        stats.add("skipped_empty", where)
        return None
      return to_rgb8(img, where, stats)
  except Exception as e:  # pylint: disable=broad-except  (any decoder error = a bad file)
    stats.add("skipped_unreadable", where)
    _log.debug("unreadable image %s: %s", where, e)
    return None


def read_image(path: str, stats: ImageStats) -> np.ndarray | None:
  """`decode_image` of a file; a missing or unreadable file is skipped and counted."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    stats.add("missing_file", path)
    return None
  return decode_image(data, path, stats)


def fit_image(image: np.ndarray, *, patch_size: int, max_side: int, max_tokens: int,
              where: str, stats: ImageStats) -> np.ndarray:
  """Downscale uint8 [h, w, 3] (aspect kept, Lanczos) so that max(h, w) <= max_side and it
  becomes at most max_tokens image tokens; unchanged when it already fits. A downscale is
  counted and warned about once per image (`UserWarning` naming the image and both sizes)."""
  from PIL import Image

  h, w = image.shape[:2]
  cell = MERGE * patch_size
  scale = min(1.0, max_side / max(h, w))
  while True:
    nh, nw = max(1, int(h * scale)), max(1, int(w * scale))
    if -(-nh // cell) * -(-nw // cell) <= max_tokens:
      break
    scale *= 0.9
  if (nh, nw) == (h, w):
    return image
  stats.add("downscaled", where)
  warnings.warn(f"image {where}: {h}x{w} px is above the limit (max side {max_side} px, "
                f"{max_tokens} image tokens); downscaled to {nh}x{nw}", stacklevel=2)
  return np.asarray(Image.fromarray(image).resize((nw, nh), Image.LANCZOS), np.uint8)


# ------------------------------------------------------------------------------ patching


def num_tokens(height: int, width: int, patch_size: int) -> int:
  """Image tokens of an h x w image: ceil(h/2p) * ceil(w/2p) (== vision.num_image_tokens)."""
  cell = MERGE * patch_size
  return -(-height // cell) * -(-width // cell)


def image_patches(image: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """uint8 [h, w, 3] -> (patches uint8 [4n, p*p*3], coords int32 [4n, 2]) in merge-cell-major
  order (module docstring); n = num_tokens(h, w, p). Pixels past the image are PIXEL_PAD."""
  p, cell = patch_size, MERGE * patch_size
  h, w, _ = image.shape
  gh, gw = -(-h // cell), -(-w // cell)
  canvas = np.full((gh * cell, gw * cell, 3), PIXEL_PAD, np.uint8)
  canvas[:h, :w] = image
  # [gh, 2, p, gw, 2, p, 3] -> [gh, gw, 2(a), 2(b), p, p, 3]
  x = canvas.reshape(gh, MERGE, p, gw, MERGE, p, 3).transpose(0, 3, 1, 4, 2, 5, 6)
  patches = x.reshape(gh * gw * MERGE * MERGE, p * p * 3)
  i, j, a, b = np.meshgrid(np.arange(gh), np.arange(gw), np.arange(MERGE), np.arange(MERGE),
                           indexing="ij")
  coords = np.stack([(MERGE * i + a).reshape(-1), (MERGE * j + b).reshape(-1)], -1)
  return patches, coords.astype(np.int32)


def normalize(pixels):
  """uint8 pixel values -> float (v - 128) / 127.5 in [-1.004, 0.996] (PIXEL_PAD -> 0.0).
  Works on NumPy and JAX arrays; what the vision encoder applies to uint8 patches."""
  return (pixels.astype("float32") - PIXEL_PAD) / 127.5


def patches_to_image(patches: np.ndarray, coords: np.ndarray, patch_size: int) -> np.ndarray:
  """Inverse of `image_patches` (up to the zero padding): -> uint8 [rows*p, cols*p, 3]."""
  p = patch_size
  rows, cols = int(coords[:, 0].max()) + 1, int(coords[:, 1].max()) + 1
  out = np.zeros((rows * p, cols * p, 3), np.uint8)
  for patch, (r, c) in zip(patches, coords):
    out[r * p:(r + 1) * p, c * p:(c + 1) * p] = patch.reshape(p, p, 3)
  return out


def example(image: np.ndarray, caption_ids, *, patch_size: int, bos_id: int, eos_id: int,
            image_token_id: int) -> dict[str, np.ndarray]:
  """One packed element (module docstring) from uint8 [h, w, 3] and the caption's ids."""
  patches, coords = image_patches(image, patch_size)
  n = patches.shape[0] // (MERGE * MERGE)
  tokens = np.concatenate([[bos_id], np.full(n, image_token_id), np.asarray(caption_ids),
                           [eos_id]]).astype(np.int32)
  return {"tokens": tokens, "doc_positions": np.arange(tokens.size, dtype=np.int32),
          "patches": patches, "patch_coords": coords}


def text_element(chunk: dict[str, np.ndarray], patch_size: int) -> dict[str, np.ndarray]:
  """A text chunk ({"tokens", "doc_positions"}) with zero patches, so it packs with images."""
  return {**chunk, "patches": np.zeros((0, patch_size * patch_size * 3), np.uint8),
          "patch_coords": np.zeros((0, 2), np.int32)}


def finalize_rows(rows: dict[str, np.ndarray], image_token_id: int) -> dict[str, np.ndarray]:
  """The image part of a packed batch: loss_mask 0 on `<image>` positions, and

    image_patches      uint8 [b, L, p*p*3]   packed patches of the row's images
    image_segment_ids  int32 [b, L]          the text segment id of each patch's image; 0 = pad
    image_coords       int32 [b, L, 2]       (row, col) in its image's patch grid
  """
  out = {"image_patches": rows["patches"].astype(np.uint8),
         "image_segment_ids": rows["patches_segment_ids"].astype(np.int32),
         "image_coords": rows["patch_coords"].astype(np.int32)}
  return out


def image_loss_mask(tokens: np.ndarray, loss_mask: np.ndarray, image_token_id: int
                    ) -> np.ndarray:
  """loss_mask with 0 wherever tokens is the `<image>` placeholder (no loss on images)."""
  return np.where(tokens == image_token_id, 0.0, loss_mask).astype(np.float32)
