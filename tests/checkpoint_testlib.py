"""Damage a checkpoint on disk as a failed write would, for the tests of unreadable checkpoints."""

from __future__ import annotations

import pathlib


def truncate_arrays(step_dir: str | pathlib.Path) -> None:
  """Cut every array data file of checkpoint step `step_dir` (its `state/` item, written by
  `sparse_lm.train.checkpoint.Checkpointer`) to half its size: a truncated write."""
  for f in (pathlib.Path(step_dir) / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and "d" in f.parent.name:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
