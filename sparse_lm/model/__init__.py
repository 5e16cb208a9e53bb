"""The hybrid KDA / Gated-MLA decoder with Block AttnRes (ARCHITECTURE.md §1-§4).

Public API: `Transformer(cfg, rngs=nnx.Rngs(seed))`, `loss_fn(model, batch, ...)`,
`count_params(cfg)`, `flops_per_token(cfg, seq_len)`. The MoE layers live in `sparse_lm.moe`.
"""

from sparse_lm.model.loss import cross_entropy_reference, loss_fn
from sparse_lm.model.params import count_params, flops_per_token, param_breakdown
from sparse_lm.model.transformer import Transformer

__all__ = ["Transformer", "count_params", "cross_entropy_reference", "flops_per_token",
           "loss_fn", "param_breakdown"]
