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

# First-cell lines after FIND_CHECKOUT (needs `import os, subprocess, sys`): outside a checkout
# (Colab), clone the repository named by SPARSE_LM_REPO (once: a rerun after a failed install
# reuses the clone) and install its pinned requirements.
GET_CODE = (
    "try:\n"
    "  import sparse_lm  # noqa: F401\n"
    "except ImportError:  # Colab: fetch the code and its pinned requirements\n"
    "  REPO = os.environ.get('SPARSE_LM_REPO')  # the git URL of your sparse_lm copy\n"
    "  if not REPO:\n"
    "    raise RuntimeError('sparse_lm is not importable: open this notebook from a checkout '\n"
    "                       'of the repository, or (Colab) run %env SPARSE_LM_REPO=<its git URL> '\n"
    "                       'in a cell above and rerun')\n"
    "  if not os.path.isdir('sparse_lm_repo'):\n"
    "    subprocess.run(['git', 'clone', '--depth=1', REPO, 'sparse_lm_repo'], check=True)\n"
    "  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-r',\n"
    "                  'sparse_lm_repo/requirements.txt'], check=True)\n"
    "  sys.path.insert(0, os.path.abspath('sparse_lm_repo'))\n")

# The markdown line every notebook's introduction ends with.
COLAB = ("On Colab: first add a cell `%env SPARSE_LM_REPO=<the git URL of your sparse_lm copy>` "
         "and run it, then `Runtime → Run all`; the first cell clones the repository and "
         "installs its requirements when it is not already importable (in a checkout it uses "
         "the checkout).")


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
