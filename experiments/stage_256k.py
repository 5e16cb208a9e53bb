"""stage_256k: stage_64k with 4x the length, the same tokens per step, and a `context` axis.

From 256K tokens on, one sequence no longer fits one device's activations, so the mesh gains a
`context` axis: the sequence is split over it (KDA passes its recurrent state between shards,
MLA gathers its latent K/V; ARCHITECTURE.md §9). It starts from stage_64k's final checkpoint
in the same workdir. Full scale: 128 sequences x 256K = 33.5M tokens per step, 1,500 steps
(50B tokens) with a 300-step re-warmup, on stage_8k's slice (v5p:8x16x16, 2,048 chips) as
fsdp=8 x expert=128 x context=2 with the sequence over expert x context (`expert_shards=
"context"`, as stage_1m): each 256K sequence over 256 chips (1,024 tokens per chip), 7
experts per chip, 16 micro-batches of 8 sequences. `small`
puts every device on `context` (one 256K sequence per step). `tiny` doubles its length again
(512 -> 1,024 tokens, 2 sequences per step, 100 steps).
"""

import dataclasses

from experiments import stage_64k
from experiments.base import MeshLayout, OptimizerConfig, main


def _next(prev, **changes):
  return dataclasses.replace(prev, name="stage_256k", init_from="stage_64k", **changes)


FULL = _next(stage_64k.FULL, seq_len=262_144, reference_seq_len=262_144, steps=1500,
             optim=OptimizerConfig(peak_lr=1e-4, warmup_steps=300, decay_fraction=0.2),
             eval_batch_size=16, micro_batches=16,
             mesh=MeshLayout(fsdp=-1, expert=128, context=2, expert_shards="context"))
SMALL = _next(stage_64k.SMALL, seq_len=262_144, reference_seq_len=262_144, steps=1000,
              optim=OptimizerConfig(peak_lr=1.5e-4, warmup_steps=100, decay_fraction=0.2),
              micro_batches=1, mesh=MeshLayout(fsdp=1, context=-1))
TINY = _next(stage_64k.TINY, seq_len=1024, reference_seq_len=262_144, steps=100,
             optim=OptimizerConfig(peak_lr=1e-3, warmup_steps=10, decay_fraction=0.2,
                                   weight_decay=0.01))

STAGES = {"full": FULL, "small": SMALL, "tiny": TINY}

if __name__ == "__main__":
  raise SystemExit(main(STAGES))
