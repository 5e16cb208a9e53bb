"""Shared by the notebook tests: run a notebook of notebooks/ top to bottom."""

import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def execute_notebook(name: str, **env: str) -> str:
  """Execute notebooks/`name` from the repo root with `env` added to the environment (and JAX
  on CPU); returns the text of its code cells' outputs. A failing cell raises nbclient's
  CellExecutionError."""
  nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
  env_before = dict(os.environ)
  os.environ.update(env, JAX_PLATFORMS="cpu")
  try:
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
  finally:
    os.environ.clear()
    os.environ.update(env_before)
  return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
