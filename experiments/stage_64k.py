"""stage_64k: stage_8k with 8x the length, the same tokens per step, and a re-warmup.

It starts from stage_8k's final checkpoint in the same workdir (found by name, no path needed),
keeping the weights, the balancer biases and the AdamW moments; its step count, learning-rate
schedule and data position start afresh. Sequences are 65,536 tokens drawn from the
long-document view of the corpus (whole packages of the standard library by default), so the
model sees dependencies longer than the 8K it was trained on. Tokens per step are unchanged,
so the batch shrinks 8x (full: 512 x 64K; small: 4 x 64K); the schedule re-warms up over 500
steps (full) to a peak a little below stage_8k's and decays over the last 20%. Full scale runs
on stage_8k's slice (v5p:8x16x16, 2,048 chips) with the sequence split over the
expert-parallel axis (`expert_shards="context"`, as stage_1m): fsdp=16 x expert=128, each 64K
sequence over the 128 expert ranks (512 tokens per chip), 7 experts per chip, 32 micro-batches
of 16 sequences. (With `expert` a batch axis, EP 128 would need 128 sequences = 8M tokens per
micro-batch; docs/scaling.md.) The stage is
short: 4,000 steps x 33.5M = 134B tokens at full scale. NoPE attention needs no RoPE rescaling.
`tiny` doubles its length instead (256 -> 512 tokens, 4 sequences per step, 150 steps).
Its held-out set is the long-document view too, so its step-0 loss is stage_8k's final weights
measured on longer documents (with `--set data.long_documents=false` it equals stage_8k's
final loss at twice its length exactly; tests/experiments/test_cli.py checks that).
"""

import dataclasses

from experiments import stage_8k
from experiments.base import MeshLayout, OptimizerConfig, main


def _next(prev, **changes):
  return dataclasses.replace(prev, name="stage_64k", init_from="stage_8k",
                             data=dataclasses.replace(prev.data, long_documents=True), **changes)


FULL = _next(stage_8k.FULL, seq_len=65_536, reference_seq_len=65_536, steps=4000,
             optim=OptimizerConfig(peak_lr=1.5e-4, warmup_steps=500, decay_fraction=0.2),
             eval_batch_size=64, micro_batches=32,
             mesh=MeshLayout(fsdp=-1, expert=128, expert_shards="context"))
SMALL = _next(stage_8k.SMALL, seq_len=65_536, reference_seq_len=65_536, steps=2000,
              optim=OptimizerConfig(peak_lr=2e-4, warmup_steps=200, decay_fraction=0.2))
TINY = _next(stage_8k.TINY, seq_len=512, reference_seq_len=65_536, steps=150,
             optim=OptimizerConfig(peak_lr=1.5e-3, warmup_steps=20, decay_fraction=0.2,
                                   weight_decay=0.01), eval_every=50, checkpoint_every=50)

STAGES = {"full": FULL, "small": SMALL, "tiny": TINY}

if __name__ == "__main__":
  raise SystemExit(main(STAGES))
