"""notebooks/vision.ipynb runs top to bottom (tiny preset, a few training steps)."""

import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_vision_notebook_executes():
  nb = nbformat.read(ROOT / "notebooks" / "vision.ipynb", as_version=4)
  env_before = dict(os.environ)
  os.environ.update(VISION_STEPS="3", VISION_EVAL="12", JAX_PLATFORMS="cpu")
  try:
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
  finally:
    os.environ.clear()
    os.environ.update(env_before)
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "held-out digits: accuracy" in outputs and "held-out words" in outputs, outputs[-2000:]
  assert "loss mask:" in outputs
