"""Every preset is multimodal as ARCHITECTURE §7 says (tiny text-only by default), and the
stage files carry the image mix (no compile: configs only)."""

import dataclasses

import jax
import pytest
from flax import nnx

from experiments import stage_1m, stage_8k, stage_64k
from sparse_lm.config import get_preset
from sparse_lm.vision.encoder import VisionEncoder


def test_full_and_small_presets_have_the_encoder_tiny_does_not():
  full = get_preset("full")
  assert full.vision and (full.vision_layers, full.vision_width, full.vision_heads,
                          full.vision_mlp, full.vision_patch_size) == (27, 1152, 16, 4304, 14)
  enc = nnx.eval_shape(lambda: VisionEncoder(full, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(enc, nnx.Param)))
  vit = n - (4 * 1152) ** 2 - 4 * 1152 * full.d_model - full.d_model  # minus the projector
  assert 0.39e9 < vit < 0.43e9, vit  # the ~400M SigLIP-so400m-shaped ViT
  assert get_preset("small").vision and not get_preset("tiny").vision


def test_stage_files_mix_images_in_small_and_full_not_tiny():
  for stages in (stage_8k.STAGES, stage_64k.STAGES, stage_1m.STAGES):
    for preset in ("small", "full"):
      s = stages[preset]
      assert s.data.images and 0 < s.data.image_ratio < 1 and s.model_config().vision
      assert s.data.image_patches_per_row == 8192
      # the prefix buckets halve the row's slots n - 1 times, in units of 4-patch merge cells
      assert s.data.image_patches_per_row % (4 << (s.model_config().vision_prefix_buckets - 1)) == 0
    assert not stages["tiny"].data.images
  bad = dataclasses.replace(stage_8k.TINY, data=dataclasses.replace(
      stage_8k.TINY.data, images="digits", image_ratio=0.5))
  with pytest.raises(ValueError, match="model.vision=true"):
    bad.validate()
  dataclasses.replace(bad, model_overrides=(("vision", True),)).validate()
