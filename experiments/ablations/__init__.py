"""Ablations of the seed's claims: per claim, stage configs that differ in one field, trained
by the stage pipeline (`sparse_lm.train.loop.run`, built by `sparse_lm.train.builder`) on the
same data, steps and seeds. `python -m experiments.ablations.report --preset=tiny` runs them and
writes docs/ablations.md (see report.py). A preset is a budget on stage_8k's tiny model (PRESETS).

Each `Ablation` names the `--set` key that differs (`field`), the values compared (`variants`,
label -> value text as `--set` parses it), the `--set` items every variant shares (`common`),
and what its table reports (`summary`, see run.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Ablation:
  name: str
  claim: str
  field: str
  variants: tuple[tuple, ...]  # (label, value) or (label, value, extra --set items)
  common: tuple[str, ...] = ()
  summary: str = "loss"  # "loss", "balance", "gate", "length" or "activation"
  probes: tuple[str, ...] = ()  # probe.probe_run kinds run on each finished run
  not_measured: str = ""  # what the claim asks for that this harness does not measure yet


# The presets are ablation budgets (steps, batch, sequence length, checkpoints) applied to
# stage_8k's tiny stage: every preset trains the tiny model (sparse_lm/config.py `tiny`,
# d_model 64), never stage_8k's `small` (1.6B) model, whatever its name. `small` is the tiny
# model as stage_8k has it (9 layers, rows of 256) for 2,000 steps; `tiny` cuts it down (below).
# BUDGETS says so in --help and the report (tests/ablations/test_report.py checks them against
# the resolved configs).
#
# Every ablation at the tiny preset: stage_8k's tiny stage, shortened to a 5-layer model (3 KDA
# + 2 MLA layers; a dense FFN in the first, MoE in the other 4), 80 steps of 16 x 128 tokens, the "blocked" grouped
# matmul (moe/gmm.py; XLA's CPU ragged_dot works densely over the experts). Configurations that
# resolve to the same config (the bounded gate, block AttnRes, gated MLA and SiTU-GLU are all
# the default) train once and are shared (run.config_key, jobs.plan). Checkpoints every 20 steps
# are kept for the probes over training (probe.py). The balancing ablation overrides the model
# and batch (3 layers, 256 rows of 32 tokens per step: its `common` items). The second seed of
# a configuration reuses the first one's compiled programs through the persistent XLA cache.
# Measured times: docs/ablations.md.
PRESETS = {
    "tiny": ("model.num_layers=5", "model.gmm_backend=blocked", "seq_len=128",
             "tokens_per_batch=2048", "steps=80", "optim.warmup_steps=10", "eval_every=40",
             "eval_batches=2", "checkpoint_every=20", "keep_checkpoints=10", "sample_tokens=0"),
    "small": ("steps=2000", "optim.warmup_steps=200", "eval_every=250",
              "checkpoint_every=250", "keep_checkpoints=10", "sample_tokens=0"),
    # Test size: 2 steps, one checkpoint (tests/ablations/test_report.py).
    "smoke": ("model.num_layers=5", "seq_len=64", "tokens_per_batch=256", "steps=2",
              "checkpoint_every=2", "keep_checkpoints=10", "eval_every=100", "eval_batches=1",
              "sample_tokens=0", "optim.warmup_steps=1"),
}
SEEDS = (0, 1)
# What each budget trains, for --help and the report (the balancing claim's `common` items
# set its own 3-layer model and 256 x 32-token batch in every budget).
BUDGETS = {
    "tiny": "tiny model cut to 5 layers, 80 steps of 16 x 128 tokens",
    "small": "tiny model at its own 9 layers, 2,000 steps of 8 x 256 tokens",
    "smoke": "tiny model cut to 5 layers, 2 steps of 4 x 64 tokens (tests)",
}

ABLATIONS = (
    Ablation(
        "balancing",
        "Quantile Balancing keeps expert loads even without an auxiliary loss (max/mean load "
        "below 1.3 after warm-up) where no balancer collapses (ARCHITECTURE.md §6).",
        "model.balancer",
        (("quantile (midpoint)", "quantile"),
         ("quantile (kplus1)", "quantile", ("model.qb_cutoff=kplus1",)),
         ("bias_sign", "bias_sign"), ("aux_loss", "aux_loss"), ("none", "none")),
        # Per-step load is measured on the whole batch: 8,192 tokens as 256 rows of 32 (m =
        # 8192 x 4 / 64 = 512 assignments per expert), rows shuffled over a window of 16,384
        # rows (512K tokens). A row is a run of one document, so a batch's tokens are not
        # independent: more, shorter rows per step bring the best bias fixed before the batch
        # from 1.32 (32 rows of 128) to 1.15 (docs/ablations/SIZING.md). A 3-layer model
        # (KDA, MLA, MLA; the dense FFN, then 2 MoE layers) pays for the 8,192 tokens.
        common=("model.num_experts=64", "model.experts_per_token=4", "model.num_layers=3",
                "model.mla_every=2", "seq_len=32", "tokens_per_batch=8192",
                "data.shuffle_window=16384"),
        summary="balance", probes=("load",)),
    Ablation(
        "gate",
        "The lower-bounded KDA decay gate trains as well as the unbounded one and keeps the "
        "dense diagonal-tile exponent bounded (<= 75 nats by construction).",
        "model.kda_gate_lower_bound",
        (("bounded (-5)", "-5.0"), ("unbounded", "None")),
        summary="gate", probes=("gate",)),
    Ablation(
        "residual",
        "Block AttnRes trains at least as well as full AttnRes and the standard residual at "
        "equal steps.",
        "model.residual",
        (("block AttnRes", "attnres_block"), ("full AttnRes", "attnres_full"),
         ("standard", "standard")),
        not_measured="the equal-FLOPs comparison (only equal steps)"),
    Ablation(
        "length",
        "NoPE MLA + KDA trained at length L extrapolates to 2L, 4L and 8L (held-out loss by "
        "position) and retrieves a pass key hidden in real text at any depth.",
        "model.mla_output_gate",
        (("gated MLA", "true"),),
        summary="length", probes=("length",)),
    Ablation(
        "activation",
        "SiTU-GLU trains as well as SwiGLU (ARCHITECTURE.md §5).",
        "model.ffn_activation",
        (("SiTU-GLU", "situ"), ("SwiGLU", "swiglu")),
        summary="activation", probes=("activation",)),
    Ablation(
        "optimizer",
        "Muon (per-head orthogonalisation, AdamW for embeddings/norms/gates) with QK-clip "
        "reaches a lower loss than AdamW at equal tokens (Kimi K2).",
        "optim.name",
        (("AdamW", "adamw"), ("Muon + QK-clip", "muon")),
        common=("optim.qk_clip_threshold=100",)),
)

BY_NAME = {a.name: a for a in ABLATIONS}
