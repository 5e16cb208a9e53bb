"""Shared by the notebooks/make_*.py generators: write cells as notebooks/<name>."""

import pathlib

import nbformat
from nbformat.v4 import new_notebook


def write_notebook(cells, name: str, **metadata) -> pathlib.Path:
  """Write `cells` as notebooks/`name` with a Python 3 kernel (plus `metadata`); returns it."""
  nb = new_notebook(cells=cells, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
      **metadata,
  })
  out = pathlib.Path(__file__).with_name(name)
  nbformat.write(nb, out)
  print("wrote", out)
  return out
