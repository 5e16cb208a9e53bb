"""notebooks/quickstart.ipynb runs top to bottom (tiny preset, training shortened to 12 steps:
the held-out loss is evaluated at steps 0, 4, 8, 12 and must end lower)."""

from tests.notebook_testlib import execute_notebook


def test_quickstart_notebook_executes():
  outputs = execute_notebook("quickstart.ipynb", QUICKSTART_STEPS="12")
  assert "held-out loss" in outputs and "lower)" in outputs, outputs[-2000:]
