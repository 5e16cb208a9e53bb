"""Image-text examples in the Grain pipeline: mixed with text chunks at `DataConfig.image_ratio`.

    image documents [split] -> shuffle / repeat -> load, fit, patch, tokenize (reader threads)
    text chunks (+ zero patches)  --.
                                     >- grain mix (weights 1 - r, r) -> packing (tokens: T,
    image examples  ----------------'                                   patches: L per row)

Packing keeps each element whole in one row for every feature, so an image's `<image>` span
and its patches always share a row and a segment id (see `images` for the element format).
The state of the mixed iterator is Grain's, so a run resumes at exactly the same example.
"""

from __future__ import annotations

import grain
import numpy as np

from sparse_lm.data import image_sources, images

IMAGE_FEATURES = ("patches", "patch_coords")


def patches_per_row(data_cfg, seq_len: int) -> int:
  """L: patch slots per packed row (`DataConfig.image_patches_per_row`, default seq_len)."""
  return data_cfg.image_patches_per_row or seq_len


class _LoadExample:
  """Image document index -> packed element (or None when the image is skipped)."""

  def __init__(self, source, tokenizer, *, seq_len: int, patch_size: int, max_side: int,
               max_patches: int):
    self._source, self._tok = source, tokenizer
    self._seq_len, self._p, self._max_side = seq_len, patch_size, max_side
    self._max_tokens = max(1, min(max_patches // 4, seq_len // 2))
    ids = tokenizer.special_ids
    self._bos, self._eos, self._img = ids["<bos>"], ids["<eos>"], ids["<image>"]

  def __call__(self, index):
    item = self._source.load(int(index))
    if item is None:
      return None
    image, caption = item
    where = self._source.doc_ids[int(index)]
    image = images.fit_image(image, patch_size=self._p, max_side=self._max_side,
                             max_tokens=self._max_tokens, where=where, stats=self._source.stats)
    n = images.num_tokens(image.shape[0], image.shape[1], self._p)
    ids = self._tok.encode(caption)[:max(0, self._seq_len - 2 - n)]
    return images.example(image, ids, patch_size=self._p, bos_id=self._bos, eos_id=self._eos,
                          image_token_id=self._img)


class _WithPatches:
  def __init__(self, patch_size):
    self._p = patch_size

  def __call__(self, chunk):
    return images.text_element(chunk, self._p)


def open_split(data_cfg, split: str):
  """The `split` of `data_cfg.images`; ValueError when it has no documents."""
  src = image_sources.open_images(data_cfg.images, split=split,
                                  eval_fraction=data_cfg.eval_fraction)
  if len(src) == 0:
    everything = len(image_sources.open_images(data_cfg.images, split="train",
                                               eval_fraction=0.0))
    raise ValueError(
        f"image source {data_cfg.images!r} has no {split} images ({everything} images in all, "
        f"data.eval_fraction={data_cfg.eval_fraction} held out by a hash of each image's "
        "name). " + ("Add images, or raise data.eval_fraction (it holds out text and images "
                     "alike), or set data.eval_fraction=0 to train without a held-out split."
                     if split == "eval" else "Add images, or lower data.eval_fraction."))
  return src


def mix_images(text_chunks: grain.IterDataset, data_cfg, tokenizer, *, split: str,
               seq_len: int, patch_size: int, read_options, shard=(0, 1),
               num_epochs: int | None = None, shuffle: bool = True) -> grain.IterDataset:
  """Text chunks mixed with image examples at data_cfg.image_ratio (module docstring).

  Args:
    text_chunks: {"tokens", "doc_positions"} elements (already cut to seq_len).
    shard: (index, count): this host reads image documents [index::count].
    shuffle: shuffle the image documents (seeded; reshuffled every epoch); eval reads them in
      order.
  """
  src = open_split(data_cfg, split)
  idx = np.arange(len(src), dtype=np.int64)[shard[0]::shard[1]]
  ds = grain.MapDataset.source(idx)
  if shuffle:
    ds = ds.shuffle(seed=data_cfg.seed + 1)
  # The held-out images repeat (in order) so that the mix below, which ends with its shorter
  # input, ends with the held-out text: a few held-out images used to cut the held-out
  # batches short, the same handful of documents at every length.
  ds = ds.repeat(num_epochs if split == "train" else
                 None if data_cfg.image_ratio < 1.0 else 1)
  load = _LoadExample(src, tokenizer, seq_len=seq_len, patch_size=patch_size,
                      max_side=data_cfg.image_max_side,
                      max_patches=patches_per_row(data_cfg, seq_len))
  image_ds = ds.map(load).to_iter_dataset(read_options)
  if data_cfg.image_ratio >= 1.0:
    return image_ds
  text = text_chunks.map(_WithPatches(patch_size))
  r = data_cfg.image_ratio
  return grain.IterDataset.mix([text, image_ds], [1.0 - r, r])


def length_struct(data_cfg, seq_len: int) -> dict[str, int]:
  """The packer's per-feature row lengths with images."""
  L = patches_per_row(data_cfg, seq_len)
  return {"tokens": seq_len, "doc_positions": seq_len, "patches": L, "patch_coords": L}
