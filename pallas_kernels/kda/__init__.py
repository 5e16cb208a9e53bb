"""Kimi Delta Attention (KDA): the operator contract (ARCHITECTURE.md §2.5).

Source: Kimi Linear (arXiv 2510.26692). Layout [B, T, H, K] for q, k, g; [B, T, H, V] for v;
[B, T, H] for beta; state [B, H, K, V] fp32. g is the log-decay after the gate (`kda_gate`).

Backends (`backend=`), one file each, each declaring `supported_on(device)`; api.py picks:
  "reference"  token-serial scan (reference.py), runs everywhere, the definition.
  "xla"        chunked algorithm in pure jax.numpy (xla.py), runs everywhere, differentiable.
  "pallas_tpu" Mosaic TPU kernels with custom_vjp (wrapper pallas_tpu.py, kernel bodies
               pallas_tpu_kernels.py), TPU (interpret mode on CPU when `interpret=True` is
               passed, for tests).
  "pallas_gpu" batched-XLA intra-chunk work plus a Pallas (Triton lowering) state-pass kernel
               with custom_vjp (pallas_gpu.py, pallas_gpu_kernels.py), NVIDIA GPUs
               (interpret mode on CPU when `interpret=True` is passed, for tests).
  "auto"       pallas_tpu on TPU, pallas_gpu on Hopper GPUs, xla elsewhere (api.AUTO_ORDER).
Shared rules (chunk sizes, 16-token sub-tiles, the diagonal-tile method, segment resets) are
in tiles.py; the context-parallel state passing in context_parallel.py.

Segment semantics (packed documents, segment_ids [B, T] int32, 0 = padding): the state resets
to zero at every t > 0 whose id is non-zero and differs from the id at t - 1; padding tokens are
identity steps (g = 0, beta = 0) with zero output. See `tiles.segment_resets`. fla's varlen
`cu_seqlens` converts with `segment_ids_from_cu_seqlens` (one packed row, one state per row).
"""

from __future__ import annotations

from pallas_kernels.kda.api import chunk_kda, segment_ids_from_cu_seqlens
from pallas_kernels.kda.gate import kda_gate
from pallas_kernels.kda.reference import recurrent_kda, recurrent_step
from pallas_kernels.kda.tiles import segment_resets

__all__ = ["chunk_kda", "segment_ids_from_cu_seqlens", "recurrent_kda", "recurrent_step", "kda_gate", "segment_resets"]
