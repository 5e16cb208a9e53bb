"""Ablations of the seed's claims: per claim, stage configs that differ in one field, trained
by the stage pipeline (`sparse_lm.train.loop.run`, built by `sparse_lm.train.builder`) on the
same data, steps and seeds. `python -m experiments.ablations.report --preset=tiny` runs them and
writes docs/ablations.md (see report.py).

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
  variants: tuple[tuple[str, str], ...]  # (label, value)
  common: tuple[str, ...] = ()
  summary: str = "loss"  # "loss", "balance" or "length"
  not_measured: str = ""  # what the claim asks for that this harness does not measure yet


# Every ablation at the tiny preset: stage_8k's tiny stage, shortened (15 configurations x 2
# seeds; the second seed of a configuration reuses the first one's compiled programs through the
# persistent XLA cache). The 45-minute target on 2 idle cores is NOT met or measured yet: on the
# loaded machine of 2026-11-30 a 64-expert balancing step took ~25 s (docs/ablations.md).
PRESETS = {
    "tiny": ("seq_len=128", "tokens_per_batch=1024", "steps=120", "optim.warmup_steps=20",
             "eval_every=40", "eval_batches=2", "checkpoint_every=120", "sample_tokens=0"),
    "small": ("steps=2000", "optim.warmup_steps=200", "eval_every=250",
              "checkpoint_every=2000", "sample_tokens=0"),
    # Test size (tests/train/conftest.py's SMALL_SETS: compiled once per test process).
    "smoke": ("model.num_layers=5", "seq_len=64", "tokens_per_batch=256", "steps=5",
              "checkpoint_every=2", "eval_every=100", "eval_batches=1", "sample_tokens=0",
              "optim.warmup_steps=2"),
}
SEEDS = (0, 1)

ABLATIONS = (
    Ablation(
        "balancing",
        "Quantile Balancing keeps expert loads even without an auxiliary loss (max/mean load "
        "below 1.3 after warm-up) where no balancer collapses (ARCHITECTURE.md §6).",
        "model.balancer",
        (("quantile (midpoint)", "quantile"), ("bias_sign", "bias_sign"),
         ("aux_loss", "aux_loss"), ("none", "none")),
        common=("model.num_experts=64", "model.experts_per_token=4"),
        summary="balance",
        not_measured="quantile's second cutoff (model.qb_cutoff) is not a variant yet"),
    Ablation(
        "gate",
        "The lower-bounded KDA decay gate trains as well as the unbounded one and keeps the "
        "dense diagonal-tile exponent bounded (<= 75 nats by construction).",
        "model.kda_gate_lower_bound",
        (("bounded (-5)", "-5.0"), ("unbounded", "None")),
        not_measured="the per-layer dense-tile exponent over training (needs the gate "
                     "activations as a training metric; only the loss is compared)"),
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
        "NoPE MLA + KDA trained at length L extrapolates to 2L (held-out loss by length).",
        "model.mla_output_gate",
        (("gated MLA", "true"),),
        summary="length",
        not_measured="4L / 8L, per-position buckets and passkey retrieval in real text"),
    Ablation(
        "activation",
        "SiTU-GLU trains as well as SwiGLU (ARCHITECTURE.md §5).",
        "model.ffn_activation",
        (("SiTU-GLU", "situ"), ("SwiGLU", "swiglu")),
        not_measured="the largest activation magnitude per layer"),
    Ablation(
        "optimizer",
        "Muon (per-head orthogonalisation, AdamW for embeddings/norms/gates) with QK-clip "
        "reaches a lower loss than AdamW at equal tokens (Kimi K2).",
        "optim.name",
        (("AdamW", "adamw"), ("Muon + QK-clip", "muon")),
        common=("optim.qk_clip_threshold=100",)),
)

BY_NAME = {a.name: a for a in ABLATIONS}
