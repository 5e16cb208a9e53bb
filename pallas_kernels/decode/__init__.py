"""Fused kernels of one decode step (Pallas, Triton lowering), for the inference engine.

A batch-1 decode step is hundreds of tiny XLA kernels (norms, gates, the short-conv update,
the AttnRes mixes, routing glue): on a GPU each costs a launch of a few microseconds, far more
than its bytes. These kernels fuse a layer's small ops; XLA keeps the projections (GEMMs).

  kda_step        KDA at one token per row: short-conv update + SiLU + L2 norm, the decay gate,
                  sigmoid(beta), the delta-rule state update and readout, the per-head output
                  RMSNorm and sigmoid output gate (ARCHITECTURE.md §2.1-§2.3). State read and
                  written once.
  attnres_mix     one Block-AttnRes read (softmax over w · RMSNorm(sources), §4) fused with the
                  sub-layer's pre-norm, optionally adding the previous sub-layer's output into
                  the running block sum first.
  moe_experts     the routed experts of a small batch reading the chosen experts' weights in
                  place (no gather copy): SiTU-GLU per (assignment, hidden block), §5;
                  `moe_experts_routed` also takes each token's top k and gates (§5, §6).

Each takes `interpret=True` to run on CPU (tests/inference/test_fused_decode.py compares each
with the pure-JAX decode path of `sparse_lm.inference.forward`). Shapes: feature sizes (K, V,
D, L, the hidden block) must be powers of two >= 16 on the GPU (Triton's block rule;
`sparse_lm.inference.fused.shapes_supported` checks a config). The engine uses them through
`sparse_lm.inference.fused` (cfg.decode_backend). This package never imports sparse_lm.
"""

from __future__ import annotations

from pallas_kernels.decode.attnres_mix import attnres_mix
from pallas_kernels.decode.common import is_pow2, on_gpu
from pallas_kernels.decode.kda_step import kda_step
from pallas_kernels.decode.moe_experts import moe_experts, moe_experts_routed

__all__ = ["attnres_mix", "kda_step", "moe_experts", "moe_experts_routed", "is_pow2", "on_gpu"]
