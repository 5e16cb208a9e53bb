"""Native-resolution patch geometry: padding, patchify, validity, 2x2 merge, token compaction.

Pure array functions, no parameters (ARCHITECTURE.md §7). An image of H x W pixels is never
resized: it is zero-padded up to a multiple of the merge cell (2 x patch = 28 px at p = 14), cut
into p x p patches on a (2*ceil(H/2p)) x (2*ceil(W/2p)) grid, and after the 2x2 patch merge
gives ceil(H/2p) * ceil(W/2p) tokens, in row-major order over the image's own merged grid.
This is the native-resolution scheme of NaViT (arXiv 2307.06304) and of Kimi-VL's MoonViT
(arXiv 2504.07491 §2.1), without NaViT's sequence packing: a batch of N images is a padded
array [N, H_max, W_max, 3] with per-image sizes [N, 2], and padding patches are masked out of
attention (so they never change the valid outputs).

Batch format (`ImageBatch`):
  pixels [N, H_max, W_max, 3] uint8 RGB 0..255 (the encoder normalises it with
    `sparse_lm.data.images.normalize`, as it does packed uint8 patches) or float (any float
    dtype, already normalised by the caller, e.g. `normalize(uint8_image)`, taken as is);
    image n occupies pixels[n, :h_n, :w_n]; whatever lies outside is ignored (zeroed).
  sizes  [N, 2] int32 (h_n, w_n) in pixels, 0 <= h_n <= H_max, 0 <= w_n <= W_max. A size of
    (0, 0) is an empty slot (all its tokens masked), so N can stay fixed under jit.
`pad_images(list of [h, w, 3] arrays)` builds one on the host; `pack_images` builds the packed
form (`PackedImages`) from uint8 images.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MERGE = 2  # patches per side of one output token (the 2x2 patch merge)


class PackedImages(NamedTuple):
  """Images packed into rows of encoder patches, aligned with the packed text rows (a pytree).

  patches: [R, L, p*p*3] uint8 (normalised by `data.images.normalize`) or float (already
    normalised); image k of row r occupies consecutive slots, merge-cell-major
    (`sparse_lm.data.images.image_patches`), its count a multiple of 4.
  segment_ids: int32 [R, L], the image's text segment id; 0 = empty slot.
  coords: int32 [R, L, 2], (row, col) of each patch in its own image's patch grid.
  Row r's images fill the `<image>` spans of text row r, in order.
  """
  patches: jax.Array
  segment_ids: jax.Array
  coords: jax.Array


def _check_patch_size(fn: str, patch_size) -> None:
  """Raises ValueError unless patch_size is a positive int."""
  if (isinstance(patch_size, bool) or not isinstance(patch_size, (int, np.integer))
      or patch_size < 1):
    raise ValueError(f"{fn}: patch_size must be a positive int, got {patch_size!r}")


def _check_images(fn: str, images, dtype=None) -> None:
  """Raises ValueError unless `images` is a sequence of [h, w, 3] arrays whose dtype matches
  `dtype`: uint8 images for a uint8 target, floating-point (already normalised) images for a
  float target; dtype None checks only the shapes. Messages name the image index."""
  if isinstance(images, (np.ndarray, jax.Array)) and images.ndim == 3:
    raise ValueError(f"{fn}: images must be a list of [h, w, 3] arrays, got one array of "
                     f"shape {images.shape}: pass [image]")
  uint8 = np.dtype(np.uint8)
  for n, im in enumerate(images):
    if not isinstance(im, (np.ndarray, jax.Array)):
      raise ValueError(f"{fn}: images[{n}] is a {type(im).__name__}, not an array: pass "
                       "NumPy arrays, e.g. np.asarray(image, np.uint8) for pixels 0..255")
    if im.ndim != 3 or im.shape[-1] != 3:
      raise ValueError(f"{fn}: expected [h, w, 3] images, got shape {im.shape} for "
                       f"images[{n}] (grayscale: np.repeat(x[..., None], 3, -1); RGBA: "
                       "x[..., :3]; CHW: x.transpose(1, 2, 0))")
    if dtype is None:
      continue
    if dtype == uint8 and im.dtype != uint8:
      fix = ("(x * 255).round().astype(np.uint8) for floats in [0, 1]"
             if jnp.issubdtype(im.dtype, jnp.floating) else
             "np.clip(x, 0, 255).astype(np.uint8)")
      raise ValueError(f"{fn}: images[{n}] has dtype {im.dtype}; pass uint8 pixels 0..255: "
                       f"{fix}")
    if dtype != uint8 and not jnp.issubdtype(im.dtype, jnp.floating):
      raise ValueError(f"{fn}: images[{n}] has dtype {im.dtype} but dtype={dtype.name} takes "
                       "float pixels already normalised: pass uint8 images with dtype=None "
                       "or np.uint8 (the encoder normalises them), or normalise first with "
                       "sparse_lm.data.images.normalize")


def pack_images(images: Sequence[np.ndarray], patch_size: int = 14, slots: int | None = None
                ) -> PackedImages:
  """Host-side: uint8 [h, w, 3] images -> one packed row (R = 1) of `slots` patch slots
  (default: just enough), images in order with segment ids 1, 2, ...

  Pixels must be uint8 RGB 0..255 (the encoder normalises them); float images, or other
  integer dtypes (whose values could wrap), are refused rather than cast.

  Raises:
    ValueError: an image is not a uint8 [h, w, 3] array (the message names its index, dtype
      or shape and the fix), patch_size < 1, or the images need more than `slots` patches.
  """
  from sparse_lm.data import images as image_data
  _check_patch_size("pack_images", patch_size)
  _check_images("pack_images", images, np.uint8)
  parts = [image_data.image_patches(np.asarray(im), patch_size) for im in images]
  n = sum(p.shape[0] for p, _ in parts)
  slots = n if slots is None else slots
  if n > slots:
    raise ValueError(f"pack_images: {n} patches do not fit {slots} slots")
  out = PackedImages(np.zeros((1, slots, patch_size * patch_size * 3), np.uint8),
                     np.zeros((1, slots), np.int32), np.zeros((1, slots, 2), np.int32))
  at = 0
  for k, (p, c) in enumerate(parts):
    out.patches[0, at:at + len(p)], out.coords[0, at:at + len(p)] = p, c
    out.segment_ids[0, at:at + len(p)] = k + 1
    at += len(p)
  return out


class ImageBatch(NamedTuple):
  """A padded batch of native-size images (a pytree; see the module docstring).

  pixels: [N, H_max, W_max, 3] uint8 0..255 (normalised by the encoder) or float (already
  normalised).  sizes: [N, 2] int32 (height, width) in pixels.
  """
  pixels: jax.Array
  sizes: jax.Array


def num_image_tokens(height: int, width: int, patch_size: int = 14) -> int:
  """Tokens one image of height x width pixels becomes: ceil(H/2p) * ceil(W/2p).

  This is the length of the `<image>` placeholder span the text sequence must hold for it.

  Raises:
    ValueError: negative sizes or patch_size < 1.
  """
  if height < 0 or width < 0 or patch_size < 1:
    raise ValueError(f"num_image_tokens: bad height={height}, width={width}, "
                     f"patch_size={patch_size}")
  cell = MERGE * patch_size
  return math.ceil(height / cell) * math.ceil(width / cell)


def image_token_span(height: int, width: int, patch_size: int, image_token_id: int
                     ) -> np.ndarray:
  """The placeholder span for one image: num_image_tokens(...) copies of image_token_id.

  Returns int32 [num_image_tokens]. Splice it into a token sequence where the image goes, e.g.
  `np.concatenate([prompt_ids, image_token_span(h, w, 14, IMAGE_TOKEN_ID), more_ids])`.
  """
  return np.full((num_image_tokens(height, width, patch_size),), image_token_id, np.int32)


def pad_images(images: Sequence[np.ndarray], patch_size: int = 14, *,
               height: int | None = None, width: int | None = None,
               dtype=None) -> ImageBatch:
  """Host-side: stack native-size images [h_n, w_n, 3] into a zero-padded ImageBatch.

  H_max / W_max are the largest height / width rounded up to a multiple of 2 * patch_size, or
  the given `height` / `width` (fixed shapes avoid recompiles; they must be multiples of
  2 * patch_size and at least as large as every image).

  Pixels are either uint8 RGB 0..255 (the encoder normalises them, as in the packed path) or
  float, already normalised (e.g. `sparse_lm.data.images.normalize(uint8_image)`), and are
  never rescaled here. `dtype`: of the padded pixels; None (default) keeps uint8 when every
  image is uint8, else float32. A uint8 dtype takes only uint8 images, a float dtype only float
  images (a uint8 image cast to float would reach the encoder unnormalised).

  Raises:
    ValueError: an image is not an [h, w, 3] array or its dtype does not match `dtype` (the
      message names its index), patch_size < 1, or an image does not fit the requested
      height / width.
  """
  _check_patch_size("pad_images", patch_size)
  _check_images("pad_images", images)
  if dtype is None:
    all_uint8 = len(images) > 0 and all(im.dtype == np.uint8 for im in images)
    dtype = np.uint8 if all_uint8 else np.float32
  dtype = np.dtype(dtype)
  _check_images("pad_images", images, dtype)
  cell = MERGE * patch_size
  hmax = max([im.shape[0] for im in images], default=0)
  wmax = max([im.shape[1] for im in images], default=0)
  H = height if height is not None else max(cell, -(-hmax // cell) * cell)
  W = width if width is not None else max(cell, -(-wmax // cell) * cell)
  if H % cell or W % cell or hmax > H or wmax > W:
    raise ValueError(f"pad_images: canvas {H}x{W} must be multiples of {cell} and hold the "
                     f"largest image {hmax}x{wmax}")
  pixels = np.zeros((len(images), H, W, 3), dtype)
  sizes = np.zeros((len(images), 2), np.int32)
  for n, im in enumerate(images):
    pixels[n, :im.shape[0], :im.shape[1]] = np.asarray(im)
    sizes[n] = im.shape[:2]
  return ImageBatch(jnp.asarray(pixels), jnp.asarray(sizes))


def pad_to_cells(pixels: jax.Array, patch_size: int) -> jax.Array:
  """Zero-pad [N, H, W, C] on the bottom/right so H and W are multiples of 2 * patch_size."""
  cell = MERGE * patch_size
  _, H, W, _ = pixels.shape
  ph, pw = -H % cell, -W % cell
  if ph or pw:
    pixels = jnp.pad(pixels, ((0, 0), (0, ph), (0, pw), (0, 0)))
  return pixels


def mask_pixels(pixels: jax.Array, sizes: jax.Array) -> jax.Array:
  """Zero every pixel outside its image: pixels [N, H, W, C], sizes [N, 2] -> [N, H, W, C].

  The last row/column of patches of an image whose size is not a multiple of the patch is part
  real image, part padding; zeroing makes that padding identical whatever the batch holds.
  """
  _, H, W, _ = pixels.shape
  rows = jnp.arange(H)[None, :, None] < sizes[:, 0, None, None]
  cols = jnp.arange(W)[None, None, :] < sizes[:, 1, None, None]
  return jnp.where((rows & cols)[..., None], pixels, jnp.zeros((), pixels.dtype))


def patchify(pixels: jax.Array, patch_size: int) -> jax.Array:
  """[N, H, W, C] (H, W multiples of patch_size) -> [N, H/p, W/p, p*p*C] patches.

  Each patch vector is its pixels in (row, col, channel) order.
  """
  N, H, W, C = pixels.shape
  p = patch_size
  x = pixels.reshape(N, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(N, H // p, W // p, p * p * C)


def patch_grid_sizes(sizes: jax.Array, patch_size: int) -> jax.Array:
  """Merged-grid size per image: sizes [N, 2] pixels -> [N, 2] int32 ceil(size / 2p)."""
  cell = MERGE * patch_size
  return (sizes.astype(jnp.int32) + cell - 1) // cell


def patch_positions(grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
  """Row and column index of each patch of a grid_h x grid_w patch grid in raster order.

  Returns two int32 [grid_h * grid_w] NumPy arrays (static: the grid shape is static).
  """
  rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
  return rows.reshape(-1).astype(np.int32), cols.reshape(-1).astype(np.int32)


def patch_validity(sizes: jax.Array, grid_h: int, grid_w: int, patch_size: int) -> jax.Array:
  """Which patches of the padded grid belong to each image.

  Args:
    sizes: [N, 2] int (height, width) in pixels.
    grid_h, grid_w: patch grid of the padded canvas (static).
    patch_size: p.

  Returns:
    bool [N, grid_h * grid_w] in raster order: patch (r, c) is valid for image n when
    r < 2*ceil(h_n/2p) and c < 2*ceil(w_n/2p) (whole merge cells, so the 2x2 merge never mixes
    valid and padding patches).
  """
  cells = patch_grid_sizes(sizes, patch_size) * MERGE  # [N, 2] in patches
  rows, cols = patch_positions(grid_h, grid_w)
  return (rows[None] < cells[:, :1]) & (cols[None] < cells[:, 1:])


def merge_2x2(x: jax.Array, grid_h: int, grid_w: int) -> jax.Array:
  """2x2 patch merge: x [N, grid_h * grid_w, C] (raster) -> [N, grid_h/2 * grid_w/2, 4C].

  Output token (i, j) of the merged grid (raster order) concatenates patches (2i, 2j),
  (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) along channels (the "pixel shuffle" of MoonViT /
  Qwen2-VL's patch merger).
  """
  N, _, C = x.shape
  x = x.reshape(N, grid_h // MERGE, MERGE, grid_w // MERGE, MERGE, C).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(N, (grid_h // MERGE) * (grid_w // MERGE), MERGE * MERGE * C)


def compact_tokens(x: jax.Array, sizes: jax.Array, merged_h: int, merged_w: int,
                   patch_size: int) -> tuple[jax.Array, jax.Array]:
  """Move each image's valid merged tokens to the front, in row-major order of its own grid.

  Args:
    x: [N, merged_h * merged_w, D], raster order over the padded merged grid.
    sizes: [N, 2] int (height, width) in pixels.
    merged_h, merged_w: the padded merged grid (static).
    patch_size: p.

  Returns:
    (tokens [N, M, D], mask bool [N, M]) with M = merged_h * merged_w: tokens[n, t] for
    t < gh_n * gw_n is merged cell (t // gw_n, t % gw_n) of image n; the rest are zeros and
    mask False. A gather, so it is differentiable in x.
  """
  grid = patch_grid_sizes(sizes, patch_size)  # [N, 2]
  gh, gw = grid[:, :1], grid[:, 1:]
  M = merged_h * merged_w
  t = jnp.arange(M, dtype=jnp.int32)[None]  # [1, M]
  mask = t < gh * gw
  safe_w = jnp.maximum(gw, 1)
  src = jnp.where(mask, (t // safe_w) * merged_w + t % safe_w, 0)
  out = jnp.take_along_axis(x, src[..., None], axis=1)
  return jnp.where(mask[..., None], out, jnp.zeros((), x.dtype)), mask
