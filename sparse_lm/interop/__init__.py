"""Checkpoint interop: Hugging Face Kimi-Linear / Kimi-K3 safetensors <-> sparse_lm models.

Public API (sparse_lm.interop.hf): `load_pretrained(path) -> (model, cfg)`,
`save_pretrained(model, cfg, path, layout=...)`; the CLI is
`python -m sparse_lm.interop.hf import|export`.
"""


def __getattr__(name):  # lazy, so that `python -m sparse_lm.interop.hf` imports hf once
  if name in ("load_pretrained", "save_pretrained"):
    from sparse_lm.interop import hf  # pylint: disable=g-import-not-at-top
    return getattr(hf, name)
  raise AttributeError(name)


__all__ = ["load_pretrained", "save_pretrained"]
