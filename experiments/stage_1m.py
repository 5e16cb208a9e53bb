"""stage_1m: stage_256k with 4x the length (1,048,576 tokens), a wider `context` axis.

The last stage reaches the full context of §1. It starts from stage_256k's final checkpoint in
the same workdir. Full scale: 32 sequences x 1M = 33.5M tokens per step, 1,000 steps (34B
tokens), a 200-step re-warmup to 7e-5 and a decay over the last 30% to the end of pretraining.
The largest v5p slice is 16x16x24 (6,144 chips), so the 8,192 chips are two v5p:16x16x16
slices over DCN, data parallel across them (`dcn_data=2`, MaxText's dcn_data_parallelism),
each slice fsdp=4 x expert=128 x context=8 with `expert_shards="context"`: each 1M sequence is
split over expert x context = 1,024 chips of one slice (1,024 tokens each) while the experts
are spread 7 per chip; 4 micro-batches of 8 sequences (4 per slice), full remat, an
expert-parallel receive cap of 1.25 x the mean (docs/scaling.md has the compiled plan). `small` keeps one sequence per step, all devices
on `context`. `tiny` doubles its length once more (1,024 -> 2,048 tokens, 1 sequence per
step, 80 steps). Passkey retrieval beyond the trained length is the check that follows.
"""

import dataclasses

from experiments import stage_256k
from experiments.base import MeshLayout, OptimizerConfig, main


def _next(prev, **changes):
  return dataclasses.replace(prev, name="stage_1m", init_from="stage_256k", **changes)


FULL = _next(stage_256k.FULL, seq_len=1_048_576, reference_seq_len=1_048_576, steps=1000,
             optim=OptimizerConfig(peak_lr=7e-5, warmup_steps=200, decay_fraction=0.3),
             eval_batch_size=8, micro_batches=4, topology="v5p:16x16x16", num_slices=2,
             mesh=MeshLayout(dcn_data=2, fsdp=-1, expert=128, context=8,
                             expert_shards="context"))
SMALL = _next(stage_256k.SMALL, seq_len=1_048_576, reference_seq_len=1_048_576,
              tokens_per_batch=1_048_576, steps=500,
              optim=OptimizerConfig(peak_lr=1e-4, warmup_steps=50, decay_fraction=0.3))
TINY = _next(stage_256k.TINY, seq_len=2048, reference_seq_len=1_048_576, steps=80,
             optim=OptimizerConfig(peak_lr=7e-4, warmup_steps=8, decay_fraction=0.3,
                                   weight_decay=0.01))

STAGES = {"full": FULL, "small": SMALL, "tiny": TINY}

if __name__ == "__main__":
  raise SystemExit(main(STAGES))
