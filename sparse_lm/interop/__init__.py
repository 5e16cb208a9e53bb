"""Checkpoint interop: Hugging Face Kimi-Linear / Kimi-K3 safetensors <-> sparse_lm models.

Public API: `load_pretrained(path) -> (model, cfg)`, `save_pretrained(model, cfg, path)`
(sparse_lm.interop.hf); the CLI is `python -m sparse_lm.interop.hf import|export`.
"""

from sparse_lm.interop.hf import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
