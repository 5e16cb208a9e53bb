"""Vision input (ARCHITECTURE.md §7): native-resolution ViT encoder and `<image>` splicing.

Integration with the decoder (the whole API it needs):

    from sparse_lm import vision
    # Transformer.__init__:  self.vision = vision.VisionEncoder(cfg, rngs=rngs) if cfg.vision
    #                        else None
    # forward_hidden:        x = self.embed(tokens)                      # fp32 [B, T, D]
    #                        if images is not None:                      # vision.ImageBatch
    #                          x = self.vision.embed_into(x, tokens, images)
    # loss mask on targets:  ~vision.image_placeholder_mask(targets)     # no loss on images

Data side: `vision.pad_images([img_a, img_b], patch_size)` -> ImageBatch(pixels [N, H, W, 3]
uint8 0..255 or normalised float, sizes [N, 2]), or `vision.pack_images` (uint8 only) ->
PackedImages; the text holds `vision.image_token_span(h, w, patch_size, IMAGE_TOKEN_ID)` where
each image goes (length `num_image_tokens(h, w, patch_size)` = ceil(h/2p) * ceil(w/2p)).
"""

from __future__ import annotations

from sparse_lm.config import ModelConfig, get_preset
from sparse_lm.vision.encoder import VisionBlock, VisionEncoder, apply_rope_2d, rope_2d_tables
from sparse_lm.vision.merge import (IMAGE_TOKEN_ID, image_placeholder_mask,
                                    merge_image_embeddings, merge_rows)
from sparse_lm.vision.patches import (ImageBatch, PackedImages, image_token_span,
                                      num_image_tokens, pack_images, pad_images)

TINY_VISION = dict(vision=True, vision_width=32, vision_layers=2, vision_heads=2,
                   vision_mlp=64)


def packed_from_batch(batch) -> PackedImages | None:
  """The `PackedImages` of a data-pipeline batch (keys image_patches / image_segment_ids /
  image_coords, `sparse_lm.data.images`), or None for a text-only batch."""
  if "image_patches" not in batch:
    return None
  return PackedImages(batch["image_patches"], batch["image_segment_ids"], batch["image_coords"])


def tiny_vision_config(**overrides) -> ModelConfig:
  """The tiny preset with a tiny ViT (width 32, 2 layers, 2 heads of 16, MLP 64, patch 14):
  `get_preset("tiny", **TINY_VISION, **overrides)`; for tests (seconds on a CPU)."""
  return get_preset("tiny", **{**TINY_VISION, **overrides})


__all__ = ["IMAGE_TOKEN_ID", "ImageBatch", "PackedImages", "TINY_VISION", "merge_rows",
           "pack_images", "packed_from_batch", "VisionBlock", "VisionEncoder",
           "apply_rope_2d", "image_placeholder_mask", "image_token_span",
           "merge_image_embeddings", "num_image_tokens", "pad_images", "rope_2d_tables",
           "tiny_vision_config"]
