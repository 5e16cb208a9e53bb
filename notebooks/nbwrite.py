"""Shared by the notebooks/make_*.py generators: write cells as notebooks/<name>."""

import pathlib

import nbformat
from nbformat.v4 import new_notebook

# First-cell lines (after `import os, pathlib, sys`): in a checkout, Jupyter starts the kernel
# in notebooks/, where the repository is not importable; put the checkout on the import path.
FIND_CHECKOUT = (
    "# In a checkout (Jupyter starts in notebooks/): the first folder at or above this one\n"
    "# that holds sparse_lm/ is the repository; put it on the import path.\n"
    "_here = pathlib.Path.cwd()\n"
    "for _root in (_here, *_here.parents):\n"
    "  if (_root / 'sparse_lm' / '__init__.py').is_file():\n"
    "    sys.path.insert(0, str(_root))\n"
    "    break\n")


def write_notebook(cells, name: str, **metadata) -> pathlib.Path:
  """Write `cells` as notebooks/`name` with a Python 3 kernel (plus `metadata`); returns it.

  Cell ids are the notebook's name and the cell's index (nbformat draws random ones), so
  regenerating an unchanged notebook rewrites the same file."""
  stem = pathlib.Path(name).stem
  for i, cell in enumerate(cells):
    cell["id"] = f"{stem}-{i}"
  nb = new_notebook(cells=cells, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
      **metadata,
  })
  out = pathlib.Path(__file__).with_name(name)
  nbformat.write(nb, out)
  print("wrote", out)
  return out
