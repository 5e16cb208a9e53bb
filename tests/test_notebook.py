"""notebooks/quickstart.ipynb runs top to bottom (tiny preset, shortened training)."""

from tests.notebook_testlib import execute_notebook


def test_quickstart_notebook_executes():
  outputs = execute_notebook("quickstart.ipynb", QUICKSTART_STEPS="60")
  assert "held-out loss" in outputs and "lower)" in outputs, outputs[-2000:]
