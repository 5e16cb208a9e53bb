"""stage_8k: pretraining from scratch at 8,192 tokens per sequence (ARCHITECTURE.md §8).

The first stage of the context curriculum trains the model from a fresh initialisation on
packed short documents. At full scale (`full`, 2.8T total / 104B active parameters) each step
sees 4,096 sequences x 8K = 33.5M tokens, warms the learning rate up over 2,000 steps to 2e-4,
holds it, and decays it to a tenth over the last 10% of 120,000 steps: 4.0T tokens, about
6 x 104B x 4.0T = 2.5e24 FLOPs. The mesh is the layout that fits v5p HBM
(docs/scaling.md: 87.8 of 95 GB per chip on v5p:8x16x16 with the vision encoder, compiled
2026-11-30): 2,048 chips as fsdp=2 x expert=128 x context=8 (7 experts per chip; each 8K sequence over 8 chips), 16 micro-batches of 256
sequences, full remat, an expert-parallel receive cap of 1.25 x the mean. The `small` preset (1.6B total,
0.3B active) takes 32 x 8K = 262K tokens per step, in 4 micro-batches of 8 rows (one H200
holds a micro-batch of 8 x 8K under full remat, docs/benchmarks.md), for 20,000 steps (5.2B
tokens) on the devices it finds. The `tiny` preset scales the stage down to 256 tokens per sequence and
8 sequences per step, 500 steps (1M tokens), so it finishes on two CPU cores in minutes.
"""

import dataclasses

from experiments.base import DataConfig, MeshLayout, OptimizerConfig, StageConfig, main

# Natively multimodal from the first stage (ARCHITECTURE §7): image-caption examples from the
# installed packages (sparse_lm/data/image_sources.py; use imagefolder:/imagetar: for a real
# corpus) are half of the packed elements (text chunks are up to 8K tokens, an example tens to
# hundreds, so images are a small share of tokens); 8,192 encoder patch slots per row at every
# stage (the later stages inherit the mix). `tiny` is text-only by default so the README job
# stays fast: --set model.vision=true --set data.images=digits --set data.image_ratio=0.5.
IMAGES = "digits+words+lines:8+samples"

FULL = StageConfig(
    name="stage_8k", preset="full", seq_len=8192, tokens_per_batch=4096 * 8192, steps=120_000,
    optim=OptimizerConfig(peak_lr=2e-4, warmup_steps=2000, decay_fraction=0.1),
    eval_every=1000, eval_batches=8, eval_batch_size=512, checkpoint_every=1000,
    micro_batches=16, mesh=MeshLayout(fsdp=-1, expert=128, context=8), topology="v5p:8x16x16",
    model_overrides=(("ragged_buffer_factor", 1.25),),
    data=DataConfig(images=IMAGES, image_ratio=0.5, image_patches_per_row=8192),
    reference_seq_len=8192)

SMALL = dataclasses.replace(
    FULL, preset="small", tokens_per_batch=32 * 8192, micro_batches=4, steps=20_000,
    optim=OptimizerConfig(peak_lr=3e-4, warmup_steps=1000, decay_fraction=0.1),
    eval_every=500, eval_batch_size=None, checkpoint_every=1000, mesh=MeshLayout(fsdp=-1),
    topology=None, model_overrides=())

TINY = dataclasses.replace(
    SMALL, preset="tiny", seq_len=256, tokens_per_batch=8 * 256, micro_batches=1, steps=500,
    optim=OptimizerConfig(peak_lr=3e-3, warmup_steps=50, decay_fraction=0.2, weight_decay=0.01),
    eval_every=100, eval_batches=4, eval_batch_size=8, checkpoint_every=100,
    data=DataConfig(),
    # launch-bound on a GPU: XLA's autotuning costs compile time and buys no step time
    gpu_autotune=False)

STAGES = {"full": FULL, "small": SMALL, "tiny": TINY}

if __name__ == "__main__":
  raise SystemExit(main(STAGES))
