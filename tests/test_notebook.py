"""notebooks/quickstart.ipynb runs top to bottom (tiny preset, training shortened to 12 steps:
the held-out loss is evaluated at steps 0, 4, 8, 12 and must end lower)."""

from tests.notebook_testlib import execute_notebook


def test_quickstart_notebook_executes():
  outputs = execute_notebook("quickstart.ipynb", QUICKSTART_STEPS="12")
  assert "held-out loss" in outputs and "lower)" in outputs, outputs[-2000:]


def test_first_cells_import_the_checkout_from_the_notebooks_folder():
  """Jupyter starts a notebook's kernel in its own folder (notebooks/), where the repository
  is not importable; the first cell must find the checkout above it (a new user's
  `jupyter execute notebooks/quickstart.ipynb` failed here while the test above, run from the
  repository root, passed)."""
  import json
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARSE_LM_REPO")}
  env["JAX_PLATFORMS"] = "cpu"
  for name in ("quickstart.ipynb", "vision.ipynb"):
    cells = json.loads((root / "notebooks" / name).read_text())["cells"]
    first = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    code = first + "\nimport sparse_lm\nprint('FROM', sparse_lm.__file__)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=root / "notebooks", env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (name, out.stderr[-2000:])
    assert f"FROM {root / 'sparse_lm' / '__init__.py'}" in out.stdout, (name, out.stdout)


def test_generators_rewrite_the_committed_notebooks_byte_for_byte():
  """notebooks/make_*.py write what is committed (the notebooks are not edited by hand) and
  write it the same each time: cell ids are fixed, not nbformat's random ones (every
  regeneration used to change all three files)."""
  import pathlib
  import subprocess
  import sys
  nb_dir = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
  for name in ("quickstart", "vision", "ablations"):
    path = nb_dir / f"{name}.ipynb"
    before = path.read_bytes()
    try:
      out = subprocess.run([sys.executable, f"make_{name}.py"], cwd=nb_dir,
                           capture_output=True, text=True, timeout=300)
      assert out.returncode == 0, out.stderr[-2000:]
      assert path.read_bytes() == before, f"make_{name}.py does not write {path.name} as committed"
    finally:
      path.write_bytes(before)
