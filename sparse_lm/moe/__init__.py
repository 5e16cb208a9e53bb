"""Stable LatentMoE with SiTU-GLU experts and Quantile Balancing (ARCHITECTURE.md §5-§6)."""

from sparse_lm.moe.situ_glu import SiTUGLU, situ_activation, situ_glu

__all__ = ["SiTUGLU", "situ_activation", "situ_glu"]
