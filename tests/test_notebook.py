"""notebooks/quickstart.ipynb runs top to bottom (tiny preset, shortened training)."""

import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(tmp_path):
  nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
  env_before = dict(os.environ)
  os.environ.update(QUICKSTART_STEPS="60", JAX_PLATFORMS="cpu")
  try:
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
  finally:
    os.environ.clear()
    os.environ.update(env_before)
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "held-out loss" in outputs and "lower)" in outputs, outputs[-2000:]
