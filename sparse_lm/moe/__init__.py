"""Stable LatentMoE with SiTU-GLU experts and Quantile Balancing (ARCHITECTURE.md §5-§6)."""

from sparse_lm.moe.balancing import (BalancerBias, BalancerStats, bias_sign_update,
                                     quantile_bias_update, update_balancers)
from sparse_lm.moe.latent_moe import LatentMoE, dispatch_and_compute
from sparse_lm.moe.situ_glu import SiTUGLU, situ_activation, situ_glu

__all__ = ["BalancerBias", "BalancerStats", "LatentMoE", "SiTUGLU", "bias_sign_update",
           "dispatch_and_compute", "quantile_bias_update", "situ_activation", "situ_glu",
           "update_balancers"]
