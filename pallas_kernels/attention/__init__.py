"""Softmax attention operators in plain JAX (no sparse_lm imports).

`flash_attention` (xla.py): blocked online softmax with a recomputing (FlashAttention-2) or
autodiff (checkpointed) backward, causal or bidirectional, segment-masked, MQA or per-head
keys; the decoder's "xla_chunked" backend, the vision encoder and the context-parallel
attention all call it. The definition it is tested against is the full softmax `sparse_lm.model.attention.attention_xla`.
`tokamax_masked` (tokamax.py): tokamax's kernels with each query's key range [k_start, k_end)
(the decoder's "tokamax" backend, the vision encoder's packed rows on a GPU); `run_ranges`:
each position's run of equal segment ids, the ranges both callers pass.
`resolve_backend` (backend.py): what "auto" means on this platform.
"""

from pallas_kernels.attention.backend import resolve_backend
from pallas_kernels.attention.tokamax import run_ranges, tokamax_flags, tokamax_masked
from pallas_kernels.attention.xla import flash_attention

__all__ = ["flash_attention", "resolve_backend", "run_ranges", "tokamax_flags",
           "tokamax_masked"]
