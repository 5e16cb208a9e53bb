"""notebooks/ablations.ipynb runs top to bottom on the recorded results (it trains nothing) and
is what notebooks/make_ablations.py writes."""

import pathlib
import subprocess
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ablations_notebook_executes_and_is_generated(tmp_path):
  nb_path = ROOT / "notebooks" / "ablations.ipynb"
  nb = nbformat.read(nb_path, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT)}}).execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "recorded:" in outputs and "== balancing" in outputs, outputs[-2000:]
  assert "plotted" in outputs
  # The committed notebook is the generator's output.
  gen = (ROOT / "notebooks" / "make_ablations.py").read_text()
  copy = tmp_path / "make_ablations.py"
  copy.write_text(gen)
  (tmp_path / "nbwrite.py").write_text((ROOT / "notebooks" / "nbwrite.py").read_text())
  subprocess.run([sys.executable, str(copy)], check=True, capture_output=True)
  fresh = nbformat.read(tmp_path / "ablations.ipynb", as_version=4)
  assert [c.source for c in fresh.cells] == [c.source for c in nbformat.read(nb_path, 4).cells]
